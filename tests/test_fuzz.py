"""Seeded fuzzing of a real store: manifests and data files mutated (field types, duplicate keys, sizes,
nesting, special files, truncation, flipped bytes, another store's files) and read back.  Every case ends,
within a timeout, in a result or one of the library's errors (a CheckpointError); a result holds exactly
the bytes the step it reports saved; ``layerckpt verify`` never crashes, exits 1 where a read refuses the
store as damaged and 0 where every checkpoint reads back as saved.  The same cases run over the store read as a
``file://`` remote tier (read in place), and put under a ``memory://`` and an S3 URL (a loopback moto server):
read through the download path, a temporary folder the composite is copied into, with the size checks of
the copy.  Read as a URL, every error about the store names it by its URL, never a temporary folder.  The
short runs are part of the suite; ``-m slow`` runs the long ones (``LAYERCKPT_FUZZ_CASES`` cases each)."""
import contextlib
import io
import json
import os
import random
import shutil
import stat
import threading
import uuid

import pytest
import torch

import layerckpt
from layerckpt import cli
from layerckpt.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError

CASE_TIMEOUT = 15.0
SHORT = 40
LONG = int(os.environ.get("LAYERCKPT_FUZZ_CASES", "1000"))


def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))


def _save(root, base: float) -> dict:
    """A store of steps 1 and 2 (the second selective); returns {step: {model key: raw bytes}}."""
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    states = {}
    with layerckpt.Checkpointer(root, model, opt, config=layerckpt.Config(keep_last=0)) as ck:
        for step in (1, 2):
            with torch.no_grad():
                for i, p in enumerate(model.parameters()):
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(step * 10 + i)) + base)
                    p.grad = torch.ones_like(p)
            opt.step()
            ck.save(step).wait()
    for step in (1, 2):
        got = layerckpt.read_checkpoint(root, step).model
        states[step] = {k: _raw(v) for k, v in got.items()}
    return states


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    ours, theirs = base / "ours", base / "theirs"
    return ours, _save(ours, 0.0), theirs, _save(theirs, 1000.0)


# -- mutations: each takes (rng, root, other store's root) and damages root -----------------------------------

VALUES = [None, True, False, -1, 0, 1, 2 ** 63, 10 ** 40, 1.5, float("nan"), "", "x", "../../etc/passwd", [],
          [1, "a"], {}, {"__tensor__": 3}, {"a": {"b": []}}]


def _manifests(root):
    d = root / "manifests"
    return sorted(d / n for n in os.listdir(d) if n.endswith(".json"))


def _datas(root):
    d = root / "data"
    return sorted(d / n for n in os.listdir(d))


def _paths(obj, prefix=(), depth=0):
    """Every (path, value) inside a parsed manifest, but inside rng/optimizer/extra/config only their top."""
    yield prefix, obj
    if depth >= 5 or (prefix and prefix[0] in ("rng", "optimizer", "extra", "config", "rng_ranks")):
        return
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from _paths(v, prefix + (k,), depth + 1)


def _set(obj, path, value):
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


def field_value(rng, root, other):
    p = rng.choice(_manifests(root))
    d = json.loads(p.read_text())
    path, _ = rng.choice([x for x in _paths(d) if x[0]])
    _set(d, path, rng.choice(VALUES))
    p.write_text(json.dumps(d))


def field_delete(rng, root, other):
    p = rng.choice(_manifests(root))
    d = json.loads(p.read_text())
    path, _ = rng.choice([x for x in _paths(d) if x[0] and not isinstance(x[0][-1], int)])
    parent = d
    for k in path[:-1]:
        parent = parent[k]
    del parent[path[-1]]
    p.write_text(json.dumps(d))


def number_nudge(rng, root, other):
    p = rng.choice(_manifests(root))
    d = json.loads(p.read_text())
    nums = [x for x in _paths(d) if x[0] and isinstance(x[1], int) and not isinstance(x[1], bool)]
    path, v = rng.choice(nums)
    _set(d, path, rng.choice([v + 1, v - 1, v * 2, v + 4096, -v, 0, v + (1 << 40)]))
    p.write_text(json.dumps(d))


def duplicate_key(rng, root, other):
    p = rng.choice(_manifests(root))
    text = p.read_text()
    keys = [k for k in json.loads(text)["tensors"]]
    a, b = rng.sample(keys, 2)
    entry = json.dumps(json.loads(text)["tensors"][b], separators=(",", ":"))
    at = text.index(json.dumps(a) + ":{")
    p.write_text(text[:at] + json.dumps(a) + ":" + entry + "," + text[at:])


def deep_nesting(rng, root, other):
    p = rng.choice(_manifests(root))
    n = rng.choice([1000, 100_000])
    p.write_text(p.read_text().replace('"name":null', '"name":' + "[" * n + "]" * n, 1))


def huge_integer(rng, root, other):
    p = rng.choice(_manifests(root))
    p.write_text(p.read_text().replace('"seq":', '"seq":' + "7" * rng.choice([30, 5000]) + ',"_":', 1))


def manifest_bytes(rng, root, other):
    p = rng.choice(_manifests(root))
    raw = bytearray(p.read_bytes())
    kind = rng.randrange(3)
    if kind == 0:
        raw = raw[: rng.randrange(len(raw))]
    elif kind == 1:
        for _ in range(rng.randint(1, 8)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
    else:
        at = rng.randrange(len(raw))
        raw[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    p.write_bytes(bytes(raw))


def data_bytes(rng, root, other):
    p = rng.choice(_datas(root))
    size = os.path.getsize(p)
    if rng.random() < 0.4:
        os.truncate(p, rng.randrange(size))
        return
    with open(p, "r+b") as f:
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(size)
            f.seek(at)
            f.write(bytes([f.read(1)[0] ^ (1 << rng.randrange(8))]))


def special_file(rng, root, other):
    p = rng.choice(_manifests(root) + _datas(root))
    os.unlink(p)
    kind = rng.randrange(5)
    if kind == 0:
        os.mkfifo(p)
    elif kind == 1:
        os.mkdir(p)
    elif kind == 2:
        os.symlink("/dev/zero", p)
    elif kind == 3:
        p.write_bytes(b"")
    # kind 4: gone


def planted_manifest(rng, root, other):
    """A newer manifest that is not ours: a FIFO, /dev/zero, or the other store's renamed to a newer step."""
    p = root / "manifests" / "step-00000009.json"
    kind = rng.randrange(3)
    if kind == 0:
        os.mkfifo(p)
    elif kind == 1:
        os.symlink("/dev/zero", p)
    else:
        shutil.copy(_manifests(other)[-1], p)


def other_store_data(rng, root, other):
    """One of our data files replaced by the other store's file of the same name."""
    p = rng.choice(_datas(root))
    shutil.copy(other / "data" / p.name, p)


MUTATIONS = [field_value, field_delete, number_nudge, duplicate_key, deep_nesting, huge_integer, manifest_bytes,
             data_bytes, special_file, planted_manifest, other_store_data]


# -- one case ------------------------------------------------------------------------------------------------

def _bounded(fn, *args):
    box = {}

    def run():
        try:
            box["out"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - judged by the caller
            box["err"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(CASE_TIMEOUT)
    if t.is_alive():
        raise AssertionError(f"{fn.__name__} hung for {CASE_TIMEOUT}s")
    return box.get("out"), box.get("err")


def _verify(root, *opts):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        return cli.main(["verify", str(root), *opts]), out.getvalue()


def _check_result(loaded, ours, where: str) -> None:
    """A read that succeeded is of a step this store saved and holds, for each tensor, exactly the bytes that
    step saved under that name: never another step's, another store's, or bytes between tensors."""
    assert loaded.step in ours, f"{where}: read step {loaded.step}, which this store never saved"
    want = ours[loaded.step]
    for k, v in loaded.model.items():
        assert k in want, f"{where}: step {loaded.step} read a tensor {k!r} it never saved"
        assert _raw(v) == want[k], f"{where}: tensor {k!r} of step {loaded.step} restored with other bytes"


class _Restored:
    """A restore's outcome as :func:`_check_result` judges it: the step it reports, the model's state."""

    def __init__(self, step, model):
        self.step, self.model = step, model


def _read_lenient(root, step: int, config=None):
    return layerckpt.read_checkpoint(root, step, strict=False, config=config)


def _expected_verify(root, err, ours, where: str, via=None) -> int:
    """What ``layerckpt verify`` must exit with, from reading the newest checkpoint (``err``) and each step the
    store saved (strict=False: staleness is the caller's bound, not damage): 1 where a read refused the store as
    damaged; 0 where every read gave back exactly the saved bytes (a step whose manifest is gone is no
    checkpoint, not damage)."""
    damaged = isinstance(err, CheckpointCorruptError)
    for step in ours:
        loaded, e = _bounded(_read_lenient, root, step, via.config if via else None)
        if via is not None:
            via.names(e, f"{where}: step {step}")
        if e is None:
            _check_result(loaded, ours, f"{where}: step {step}")
        elif isinstance(e, CheckpointCorruptError):
            damaged = True
        else:
            assert isinstance(e, CheckpointNotFoundError), f"{where}: step {step}: {type(e).__name__}: {e}"
    return 1 if damaged else 0


#: what no message of a read of a URL holds: the temporary folders a remote composite is copied into
TEMPORARY = ("layerckpt-fetch-", "layerckpt-view-")
#: the bytes a remote copy of a link to a device holds (an object store has no links): more than any file of
#: the small stores ``special_file`` damages, so the copy's size checks refuse it
LINKED_BYTES = 64 << 10


class Via:
    """How a case's mutated store is read: ``local``, its directory; ``file``, the same directory as a ``file://``
    remote tier (read in place); ``memory`` or ``s3``, every file of it put under a ``memory://`` or S3 URL
    (read through a download into a temporary folder)."""

    def __init__(self, kind: str = "local", s3=None):
        self.kind, self.s3 = kind, s3
        self.url = None
        self.config = None
        self.opts = []

    @property
    def tag(self) -> str:
        return "" if self.kind == "local" else ", remote" if self.kind == "file" else f", {self.kind}"

    def target(self, root, name: str):
        """What a read is given for the store at ``root``: ``name`` makes a case's URL its own."""
        if self.kind == "local":
            return root
        if self.kind == "file":
            self.url = "file://" + str(root)
            return self.url
        import fsspec

        options = self.s3.options if self.kind == "s3" else {}
        bucket = self.s3.bucket() if self.kind == "s3" else f"fuzz-{uuid.uuid4().hex[:12]}"
        self.url = f"{self.kind}://{bucket}/{name}"
        fs, base = fsspec.core.url_to_fs(self.url, **options)
        fs.pipe(_as_objects(root, base))
        if options:
            self.config = layerckpt.Config(remote=self.url, remote_options=options)
            self.opts = ["--remote-options", json.dumps(options)]
        return self.url

    def names(self, err, where: str) -> None:
        """Read as a URL, an error names no temporary folder (``file://``: the folder only inside its URL), and
        one about the store (damage, nothing committed) names the store by its URL."""
        if err is None or self.url is None:
            return
        self.text_names(str(err), where)
        if isinstance(err, (CheckpointCorruptError, CheckpointNotFoundError)):
            assert self.url in str(err), f"{where}: {type(err).__name__} does not name {self.url}: {err}"
        path = getattr(err, "path", None)
        if isinstance(path, str):
            self.text_names(path, where)

    def text_names(self, text: str, where: str) -> None:
        if self.url is None:
            return
        for t in TEMPORARY:
            assert t not in text, f"{where}: names a temporary folder: {text}"
        if self.kind == "file":
            folder = self.url[len("file://"):]
            assert text.count(folder) == text.count(self.url), f"{where}: names {folder}, not its URL: {text}"

    def done(self) -> None:
        """The case's memory:// copy removed (the file system is this process's memory)."""
        if self.kind == "memory" and self.url:
            import fsspec

            fs, base = fsspec.core.url_to_fs(self.url)
            with contextlib.suppress(FileNotFoundError):
                fs.rm(base, recursive=True)


def _as_objects(root, base: str) -> dict:
    """Every file of the store at ``root`` as the objects of a copy of it under ``base``: a regular file its
    bytes, a link what reading it gives (a device's: ``LINKED_BYTES`` of it), an empty folder an object
    inside it; a FIFO (or socket) has no copy."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            key = base + "/" + os.path.relpath(p, root).replace(os.sep, "/")
            st = os.lstat(p)
            if name == ".writer.lock":
                continue
            if stat.S_ISLNK(st.st_mode):
                target = os.stat(p).st_mode if os.path.exists(p) else 0
                if stat.S_ISREG(target) or stat.S_ISCHR(target):
                    with open(p, "rb") as f:
                        out[key] = f.read(LINKED_BYTES)
            elif stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    out[key] = f.read()
            elif stat.S_ISDIR(st.st_mode) and not os.listdir(p):
                out[key + "/.keep"] = b""
    return out


def _via(remote) -> Via:
    return remote if isinstance(remote, Via) else Via("file" if remote else "local")


def run_case(seed, stores, tmp_path, remote=False):
    """One case; ``remote``: False (the directory), True (as a file:// remote) or a :class:`Via`."""
    via = _via(remote)
    ours_src, ours, other, _ = stores
    rng = random.Random(seed)
    root = tmp_path / f"case{seed}"
    shutil.copytree(ours_src, root, symlinks=True, ignore=shutil.ignore_patterns(".writer.lock"))
    mutation = MUTATIONS[seed % len(MUTATIONS)]
    mutation(rng, root, other)
    where = f"seed {seed} ({mutation.__name__}{via.tag})"
    try:
        target = via.target(root, f"case{seed}")
        _judge(target, via, ours, where, _model_and_optimizer)
    finally:
        via.done()


def _model_and_optimizer():
    """What the store was saved from: a restore of it reads every tensor (the optimizer's by the names of its
    model's parameters)."""
    model = tiny()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _judge(target, via: Via, ours, where: str, model_and_optimizer) -> None:
    """The oracle of every case: each read ends in a result of the genuine bytes or a library error (naming the
    store by its URL, read as one), verify in the exit code those reads imply, never a traceback."""
    def read_checkpoint():
        return layerckpt.read_checkpoint(target, config=via.config)

    loaded, err = _bounded(read_checkpoint)
    assert err is None or isinstance(err, CheckpointError), f"{where}: {type(err).__name__}: {err}"
    via.names(err, where)
    if err is None:
        _check_result(loaded, ours, where)
    def restore():
        model, opt = model_and_optimizer()
        return layerckpt.restore(target, model, opt, config=via.config), model

    restored, rerr = _bounded(restore)
    assert rerr is None or isinstance(rerr, CheckpointError), f"{where}: restore: {type(rerr).__name__}: {rerr}"
    via.names(rerr, f"{where}: restore")
    if rerr is None:  # the model holds exactly the bytes the step it reports saved
        report, model = restored
        _check_result(_Restored(report.step, model.state_dict()), ours, f"{where}: restore")
    out, verr = _bounded(_verify, target, *via.opts)
    assert verr is None, f"{where}: verify raised {type(verr).__name__}: {verr}"
    rc, text = out
    assert "Traceback" not in text, f"{where}:\n{text}"
    via.text_names(text, f"{where}: verify")
    want = _expected_verify(target, err, ours, where, via)
    assert rc == want, f"{where}: verify exited {rc}, expected {want} (newest read: {err!r}):\n{text}"


def test_fuzz_short(stores, tmp_path):
    for seed in range(SHORT):
        run_case(seed, stores, tmp_path)


@pytest.mark.slow
def test_fuzz_long(stores, tmp_path):
    for seed in range(SHORT, SHORT + LONG):
        run_case(seed, stores, tmp_path)
        shutil.rmtree(tmp_path / f"case{seed}", ignore_errors=True)


# -- the enc and boxes fields: encoded blocks and their references, tensors stored as boxes -------------------

@pytest.fixture(scope="module")
def piece_stores(tmp_path_factory):
    """A delta-encoded store (every tensor an ``enc`` record, deltas with references) and one whose embedding
    table is stored as boxes (tests/hostile_stores.py), each with {step: {model key: the bytes it reads back}}."""
    import hostile_stores as hs

    base = tmp_path_factory.mktemp("fuzz_pieces")
    hs.build_delta(str(base / "delta"))
    hs.build_rows(str(base / "rows"))
    hs.rows_to_boxes(str(base / "rows"), str(base / "boxes"))
    out = {}
    for name in ("delta", "boxes"):
        root = base / name
        out[name] = root, {s: {k: _raw(v) for k, v in layerckpt.read_checkpoint(root, s).model.items()}
                           for s in range(1, 5)}
    return out


def _inside(d, field):
    """Every (path, value) inside each tensor's ``enc`` record, or inside the ``boxes`` records."""
    if field == "boxes":
        return [(("boxes",) + p, v) for p, v in _paths(d.get("boxes") or {}) if p]
    return [(("tensors", k, "enc") + p, v) for k, e in d["tensors"].items() if isinstance(e.get("enc"), dict)
            for p, v in _paths(e["enc"]) if p]


def _piece_value(field):
    def mutate(rng, d):
        path, _ = rng.choice(_inside(d, field))
        _set(d, path, rng.choice(VALUES + [[], [[0, 0], [1, 1]], [0, 1, 1, 0]]))
    mutate.__name__ = f"{field}_value"
    return mutate


def _piece_number(field):
    def mutate(rng, d):
        nums = [x for x in _inside(d, field) if isinstance(x[1], int) and not isinstance(x[1], bool)]
        path, v = rng.choice(nums)
        other = rng.choice(nums)[1]
        _set(d, path, rng.choice([v + 1, v - 1, v * 2, v + 4096, -v, 0, other, v + (1 << 40), 1 << 20]))
    mutate.__name__ = f"{field}_number"
    return mutate


def enc_blocks(rng, d):
    """A tensor's block list (its own or its reference's) cut, repeated, reordered, or another tensor's."""
    encs = [e["enc"] for e in d["tensors"].values() if e.get("enc")]
    lists = [e["blocks"] for e in encs] + [e["ref"]["blocks"] for e in encs if e.get("ref")]
    blocks, other = rng.choice(lists), rng.choice(lists)
    kind = rng.randrange(5)
    if kind == 0:
        blocks.append(rng.choice(blocks or [[0, 0, 1, 3]]))
    elif kind == 1 and blocks:
        del blocks[rng.randrange(len(blocks))]
    elif kind == 2:
        blocks.reverse()
    elif kind == 3:
        blocks[:] = [list(b) for b in other]
    elif blocks and other:
        blocks[rng.randrange(len(blocks))] = list(rng.choice(other))


def boxes_swap(rng, d):
    """Two boxes' coordinates swapped, a box repeated or dropped, or two boxes' entries swapped with their
    checksums."""
    key = rng.choice(sorted(d["boxes"]))
    boxes = d["boxes"][key]["boxes"]
    i, j = rng.sample(range(len(boxes)), 2)
    kind = rng.randrange(4)
    if kind == 0:
        boxes[i], boxes[j] = boxes[j], boxes[i]
    elif kind == 1:
        boxes[i] = boxes[j]
    elif kind == 2:
        del boxes[i]
    else:
        keys = [k for k in d["tensors"] if k.startswith(key + "#box=")]
        a, b = rng.sample(keys, 2)
        for f in ("file", "offset", "crc"):
            d["tensors"][a][f], d["tensors"][b][f] = d["tensors"][b][f], d["tensors"][a][f]


#: (store, mutation of one of its parsed manifests)
PIECE_MUTATIONS = [("delta", _piece_value("enc")), ("boxes", _piece_value("boxes")), ("delta", _piece_number("enc")),
                   ("boxes", _piece_number("boxes")), ("delta", enc_blocks), ("boxes", boxes_swap)]
PIECE_SHORT = 24


def _linked_copy(src, dst) -> None:
    """A copy of a store whose data files are hard links to the original's (the mutations here edit manifests)."""
    def copy(s, t):
        if os.path.basename(os.path.dirname(s)) == "data":
            os.link(s, t)
        else:
            shutil.copy2(s, t)

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".writer.lock"), copy_function=copy)


def run_piece_case(seed, piece_stores, tmp_path, remote=False):
    import hostile_stores as hs

    via = _via(remote)
    rng = random.Random(seed)
    store, mutation = PIECE_MUTATIONS[seed % len(PIECE_MUTATIONS)]
    src, ours = piece_stores[store]
    root = tmp_path / f"pieces{seed}"
    _linked_copy(src, root)
    p = rng.choice(_manifests(root))
    d = json.loads(p.read_text())
    mutation(rng, d)
    p.write_text(json.dumps(d))
    where = f"seed {seed} ({store}, {mutation.__name__} of {p.name}{via.tag})"
    try:
        _judge(via.target(root, f"pieces{seed}"), via, ours, where, hs.model_and_optimizer)
    finally:
        via.done()


def test_fuzz_enc_and_boxes_short(piece_stores, tmp_path):
    for seed in range(PIECE_SHORT):
        run_piece_case(seed, piece_stores, tmp_path)


@pytest.mark.slow
def test_fuzz_enc_and_boxes_long(piece_stores, tmp_path):
    for seed in range(PIECE_SHORT, PIECE_SHORT + LONG):
        run_piece_case(seed, piece_stores, tmp_path)
        shutil.rmtree(tmp_path / f"pieces{seed}", ignore_errors=True)


# -- the same over a file:// remote tier: the store's directory read as a URL (fsspec, a local view) ------------

#: seeds of the remote runs: apart from the local ones, and in the short run each mutation once
REMOTE_SEEDS = 1000
REMOTE_SHORT = len(MUTATIONS)
PIECE_REMOTE_SHORT = len(PIECE_MUTATIONS)


def test_fuzz_remote_short(stores, tmp_path):
    for seed in range(REMOTE_SEEDS, REMOTE_SEEDS + REMOTE_SHORT):
        run_case(seed, stores, tmp_path, remote=True)


def test_fuzz_enc_and_boxes_remote_short(piece_stores, tmp_path):
    for seed in range(REMOTE_SEEDS, REMOTE_SEEDS + PIECE_REMOTE_SHORT):
        run_piece_case(seed, piece_stores, tmp_path, remote=True)


@pytest.mark.slow
def test_fuzz_remote_long(stores, tmp_path):
    for seed in range(REMOTE_SEEDS + REMOTE_SHORT, REMOTE_SEEDS + REMOTE_SHORT + LONG):
        run_case(seed, stores, tmp_path, remote=True)
        shutil.rmtree(tmp_path / f"case{seed}", ignore_errors=True)


@pytest.mark.slow
def test_fuzz_enc_and_boxes_remote_long(piece_stores, tmp_path):
    for seed in range(REMOTE_SEEDS + PIECE_REMOTE_SHORT, REMOTE_SEEDS + PIECE_REMOTE_SHORT + LONG):
        run_piece_case(seed, piece_stores, tmp_path, remote=True)
        shutil.rmtree(tmp_path / f"pieces{seed}", ignore_errors=True)


# -- the same through the download path: each mutated store put under a memory:// and an S3 URL ----------------

#: seeds of the memory:// and S3 runs; their short runs take each mutation three times (memory://) or twice
#: (S3, whose requests take longer)
MEMORY_SEEDS, S3_SEEDS = 2000, 3000
MEMORY_SHORT, PIECE_MEMORY_SHORT = 3 * len(MUTATIONS), 3 * len(PIECE_MUTATIONS)
S3_SHORT, PIECE_S3_SHORT = 2 * len(MUTATIONS), 2 * len(PIECE_MUTATIONS)


def test_fuzz_memory_short(stores, tmp_path):
    for seed in range(MEMORY_SEEDS, MEMORY_SEEDS + MEMORY_SHORT):
        run_case(seed, stores, tmp_path, Via("memory"))


def test_fuzz_enc_and_boxes_memory_short(piece_stores, tmp_path):
    for seed in range(MEMORY_SEEDS, MEMORY_SEEDS + PIECE_MEMORY_SHORT):
        run_piece_case(seed, piece_stores, tmp_path, Via("memory"))


def test_fuzz_s3_short(stores, tmp_path, s3):
    for seed in range(S3_SEEDS, S3_SEEDS + S3_SHORT):
        run_case(seed, stores, tmp_path, Via("s3", s3))


def test_fuzz_enc_and_boxes_s3_short(piece_stores, tmp_path, s3):
    for seed in range(S3_SEEDS, S3_SEEDS + PIECE_S3_SHORT):
        run_piece_case(seed, piece_stores, tmp_path, Via("s3", s3))


@pytest.mark.slow
def test_fuzz_memory_long(stores, tmp_path):
    for seed in range(MEMORY_SEEDS + MEMORY_SHORT, MEMORY_SEEDS + MEMORY_SHORT + LONG):
        run_case(seed, stores, tmp_path, Via("memory"))
        shutil.rmtree(tmp_path / f"case{seed}", ignore_errors=True)


@pytest.mark.slow
def test_fuzz_enc_and_boxes_memory_long(piece_stores, tmp_path):
    for seed in range(MEMORY_SEEDS + PIECE_MEMORY_SHORT, MEMORY_SEEDS + PIECE_MEMORY_SHORT + LONG):
        run_piece_case(seed, piece_stores, tmp_path, Via("memory"))
        shutil.rmtree(tmp_path / f"pieces{seed}", ignore_errors=True)


@pytest.mark.slow
def test_fuzz_s3_long(stores, tmp_path, s3):
    for seed in range(S3_SEEDS + S3_SHORT, S3_SEEDS + S3_SHORT + LONG):
        run_case(seed, stores, tmp_path, Via("s3", s3))
        shutil.rmtree(tmp_path / f"case{seed}", ignore_errors=True)


@pytest.mark.slow
def test_fuzz_enc_and_boxes_s3_long(piece_stores, tmp_path, s3):
    for seed in range(S3_SEEDS + PIECE_S3_SHORT, S3_SEEDS + PIECE_S3_SHORT + LONG):
        run_piece_case(seed, piece_stores, tmp_path, Via("s3", s3))
        shutil.rmtree(tmp_path / f"pieces{seed}", ignore_errors=True)
