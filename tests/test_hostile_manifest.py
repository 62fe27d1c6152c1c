"""Hostile manifests built by editing genuine stores (a delta-encoded one, one with row blocks, the same recorded as
boxes: tests/hostile_stores.py), one variant per way a few bytes of JSON could turn a restore against its user:

- memory from a few bytes: one stored block decoded many times, a tensor cut into one-byte blocks, a claim of a
  terabyte or of a shape whose size overflows;
- another tensor's bytes: a tensor's blocks (or row block, or box) and checksum copied onto another, two of them
  swapped with their checksums, an entry taken from another step, a checksum's seal cleared, a parameter's
  optimizer state referring to another parameter's;
- an older version's bytes: a tensor's own entry of an older step (or a whole layer's, or an RNG state's) copied
  with its checksum while the manifest records its layer at the newer step, a layer claiming a newer step than
  its bytes, an older file's entry relabelled with the newer step, an entry of the newer step whose delta blocks
  all say "unchanged" against an older reference, with that version's checksum (each checksum is sealed to its
  file's step);
- raw exceptions: a list or object where a dtype belongs, an alias to a tensor that has no entry, an empty list
  of row blocks, NaN costs.

Every variant is read (``read_checkpoint``), restored into the model, verified and inspected in one child process,
each call within BOUND_S seconds and BOUND_RSS bytes of peak memory (``/proc/self/clear_refs`` resets the peak
between calls): each ends with the genuine tensors (bit for bit) or the library's own error naming what is
wrong; ``layerckpt verify`` exits 1 on every damaged store with no traceback."""
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

import hostile_stores as hs

BOUND_S = 10.0  # seconds one call on a damaged store may take (a genuine one takes well under one here)
BOUND_RSS = 96 << 20  # peak memory one call may add (the stores hold about 1.5 MB a step; unbounded decodes: GBs)
TB = 1 << 40
A, B, EMB = "model/a.weight", "model/b.weight", "model/emb.weight"
ROW0, ROW1 = f"{EMB}#rows=0:256", f"{EMB}#rows=256:512"
BOX0, BOX1 = f"{EMB}#box=0,0:256,64", f"{EMB}#box=256,0:256,64"
MISMATCH = r"checksum mismatch in tensor '{}'"
SEAL_KIND = r"tensor '{}' in file .* has a checksum not sealed to its step, where the file's other entries are"
OLDER = (r"tensor '{0}' of layer '{1}', which the manifest records at step 4, is in file "
         r"'step-0000000{2}\.rank0\.safetensors' of step {2}")

pytestmark = pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                                reason="peak memory per call needs /proc/self/clear_refs (Linux)")


def _t(d):
    return d["tensors"]


# each change takes the parsed manifest and the directory of the store it is in

def _copy(src, dst, fields=("file", "offset", "crc", "enc")):
    def change(d, root):
        for f in fields:
            _t(d)[dst][f] = _t(d)[src][f]
    return change


def _swap(x, y, fields=("file", "offset", "crc", "enc")):
    def change(d, root):
        for f in fields:
            _t(d)[x][f], _t(d)[y][f] = _t(d)[y][f], _t(d)[x][f]
    return change


def _swap_refs(d, root):
    _t(d)[A]["enc"]["ref"], _t(d)[B]["enc"]["ref"] = _t(d)[B]["enc"]["ref"], _t(d)[A]["enc"]["ref"]


def _repeat_block(times):
    """The table's first (self-contained) block listed ``times`` times, its claimed size grown to match: about
    1 GiB decoded from one region of a few KiB if nothing stopped it."""
    def change(d, root):
        e = _t(d)[EMB]
        blk = e["enc"]["blocks"][0]
        e["enc"]["blocks"] = [blk] * times
        e["nbytes"], e["shape"] = blk[2] * times, [blk[2] * times // 4]
    return change


def _reread_ref_block(d, root):
    """The reference's second block replaced by its first one (with the second's raw length: the blocks still
    cover the tensor): one stored block decoded twice."""
    ref = _t(d)[EMB]["enc"]["ref"]["blocks"]
    ref[1] = ref[0][:2] + ref[1][2:]


def _one_byte_blocks(d, root):
    """A weight's own region of its file, as one-byte raw blocks of a U8 tensor: as many blocks as bytes."""
    e = _t(d)[A]
    start, end = e["enc"]["blocks"][0][0], e["enc"]["blocks"][-1][0] + e["enc"]["blocks"][-1][1]
    e.update(dtype="U8", shape=[end - start], nbytes=end - start)
    e["enc"] = {"codec": e["enc"]["codec"], "blocks": [[o, 1, 1, 0] for o in range(start, end)], "ref": None}


def _terabyte(encoded):
    """A tensor moved past the end of its file, claiming a terabyte there, and the file claiming to hold it."""
    def change(d, root):
        e = _t(d)[A]
        f = d["files"][e["file"]]
        e.update(offset=f["size"], shape=[TB // 4], nbytes=TB)
        if encoded:
            e["enc"] = {"codec": e["enc"]["codec"], "blocks": [[f["size"], TB, TB, 0]], "ref": None}
        f["size"] += TB
    return change


def _older_entry(src):
    """model/b.weight given ``src``'s entry of step 3 (its file listed too): values copied as they are."""
    def change(d, root):
        with open(hs.manifest_path(root, 3)) as f:
            old = json.load(f)
        _t(d)[B] = _t(old)[src]
        d["files"].update(old["files"])
    return change


def _rolled_back(*keys, file_step=None):
    """``keys`` given their own entries of step 3 (their files listed too), each checksum matching what it reads:
    the older version of a tensor (or of a whole layer, or an RNG state), while the manifest still records the
    layer at step 4.  ``file_step``: the older file's entry also claims that step."""
    def change(d, root):
        with open(hs.manifest_path(root, 3)) as f:
            old = json.load(f)
        for k in keys:
            _t(d)[k] = _t(old)[k]
        d["files"].update(old["files"])
        if file_step is not None:
            d["files"][_t(old)[keys[0]]["file"]]["step"] = file_step
    return change


def _same_as_older(d, root):
    """model/b.weight's delta blocks all 'unchanged' against its reference of step 1, with step 1's checksum."""
    with open(hs.manifest_path(root, 1)) as f:
        old = json.load(f)
    e = _t(d)[B]
    assert e["enc"]["ref"]["step"] == 1
    e["enc"]["blocks"] = [[b[0], 0, b[2], 3] for b in e["enc"]["blocks"]]  # SAME: the reference's bytes
    e["crc"] = _t(old)[B]["crc"]


def _layer_claims_step(layer, step):
    def change(d, root):
        d["layers"][layer].update(step=step, age=0)
    return change


def _unseal(d, root):
    _t(d)[A]["crc"] &= 0xFFFFFFFF


def _unstep(d, root):
    """model/a.weight's (raw) seal without its step: the key-only seal format version 4 wrote (what an edit could
    copy from an entry written before step seals), beside the step-sealed entries of its file."""
    from layerckpt.io._backend import checksum_function
    from layerckpt.format._places import seal

    check = checksum_function(d["checksum"])
    e = _t(d)[A]
    with open(os.path.join(root, "data", e["file"]), "rb") as f:
        f.seek(e["offset"])
        e["crc"] = seal(check, A, check(f.read(e["nbytes"]), 0))


def _set(path, value):
    def change(d, root):
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return change


def _layer_cost_nan(d, root):
    next(iter(d["layers"].values()))["cost"] = float("nan")


def _shape_overflow(d, root):
    _t(d)[A].update(shape=[TB, TB, 0], nbytes=0)


# name -> (store, step, change or None, what every read says: a regex of the library's error, None: genuine)
VARIANTS = {
    # controls: the harness restores what was saved
    "delta untouched": ("delta", 4, None, None),
    "rows untouched": ("rows", 4, None, None),
    "boxes untouched": ("boxes", 4, None, None),
    # memory from a few bytes
    "a block decoded 16384 times": ("delta", 1, _repeat_block(16384), r"has a block at bytes .* before the end"),
    "a reference block decoded twice": ("delta", 4, _reread_ref_block, r"\(its reference\) has a block at bytes"),
    "one-byte blocks": ("delta", 1, _one_byte_blocks, r"blocks in .*, more than the \d+ its \d+ bytes are cut into"),
    "a terabyte raw tensor": ("rows", 4, _terabyte(False), r"is truncated: .* tensor 'model/a.weight' is cut off"),
    "a terabyte encoded tensor": ("delta", 4, _terabyte(True), r"is truncated: .* tensor 'model/a.weight' is cut off"),
    "a shape of 2**80 empty elements": ("rows", 4, _shape_overflow, r"entry for tensor 'model/a.weight' is malformed"),
    "boxes of 2**80 empty elements": ("boxes", 4, _set(["boxes", EMB, "shape"], [TB, TB, 0]),
                                      r"the boxes of tensor 'model/emb.weight' are malformed"),
    # another tensor's bytes
    "blocks and checksum copied": ("delta", 4, _copy(A, B), r"tensor 'model/b.weight' \(bytes .*\) overlaps tensor "
                                                            r"'model/a.weight'"),
    "blocks and checksums swapped": ("delta", 4, _swap(A, B), MISMATCH.format(r"model/[ab]\.weight")),
    "references swapped": ("delta", 4, _swap_refs, MISMATCH.format(r"model/[ab]\.weight")),
    "another tensor's entry of another step": ("delta", 4, _older_entry(A), OLDER.format("model/b.weight", "b", 3)),
    "the same tensor's entry of an older step": ("delta", 4, _rolled_back(B), OLDER.format("model/b.weight", "b", 3)),
    "the same raw tensor's entry of an older step": ("rows", 4, _rolled_back(A),
                                                      OLDER.format("model/a.weight", "a", 3)),
    "a layer's entries of an older step": ("delta", 4, _rolled_back(B, "model/b.bias", "optim/b.weight/exp_avg"),
                                           OLDER.format(r"(model|optim)/b\.(weight|bias)(/exp_avg)?", "b", 3)),
    "an older box's layer claiming this step": ("boxes", 4, _layer_claims_step("emb#rows=0:256", 4),
                                                OLDER.format(re.escape(BOX0), re.escape("emb#rows=0:256"), 1)),
    "an RNG state of an older step": ("delta", 4, _rolled_back("rng/torch"),
                                      r"tensor 'rng/torch', which no layer lists, is in file "
                                      r"'step-00000003\.rank0\.safetensors' of step 3, not the manifest's step 4"),
    "a delta of unchanged blocks with an older checksum": ("delta", 4, _same_as_older,
                                                           MISMATCH.format(r"model/b\.weight")),
    "an older file's entry claiming this step": ("delta", 4, _rolled_back(B, file_step=4),
                                                 MISMATCH.format(r"model/b\.weight")),
    "a seal cleared": ("delta", 4, _unseal, SEAL_KIND.format(r"model/a\.weight")),
    "a seal's step cleared": ("rows", 4, _unstep, SEAL_KIND.format(r"model/a\.weight")),
    "row block copied": ("rows", 4, _copy(ROW0, ROW1, ("file", "offset", "crc")),
                         r"tensor '.*#rows=.*' \(bytes .*\) overlaps tensor '.*#rows="),
    "row blocks swapped": ("rows", 4, _swap(ROW0, ROW1, ("file", "offset", "crc")),
                           MISMATCH.format(r"model/emb\.weight#rows=(0:256|256:512)")),
    "boxes swapped": ("boxes", 4, _swap(BOX0, BOX1, ("file", "offset", "crc")),
                      MISMATCH.format(r"model/emb\.weight#box=(0|256),0:256,64")),
    "another parameter's moments": ("delta", 4, _set(["optimizer", "state", "a.weight", "exp_avg"],
                                                     {"__tensor__": "optim/b.weight/exp_avg"}),
                                    r"field 'optimizer' refers to tensor 'optim/b.weight/exp_avg' where the tensor "
                                    r"'optim/a.weight/exp_avg' belongs"),
    # raw exceptions
    "a dtype list in an entry": ("delta", 4, _set(["tensors", A, "dtype"], ["F32"]),
                                 r"entry for tensor 'model/a.weight' is malformed"),
    "a dtype list in row blocks": ("rows", 4, _set(["blocks", EMB, "dtype"], ["F32"]),
                                   r"the row blocks of tensor 'model/emb.weight' are malformed"),
    "a dtype object in boxes": ("boxes", 4, _set(["boxes", EMB, "dtype"], {"F32": 4}),
                                r"the boxes of tensor 'model/emb.weight' are malformed"),
    "an alias to a missing tensor": ("delta", 4, _set(["model", "aliases"], {"head.weight": "gone.weight"}),
                                     r"ties 'head.weight' to 'gone.weight', a model tensor the manifest has no entry"),
    "an alias over a stored tensor": ("delta", 4, _set(["model", "aliases"], {"a.weight": "b.weight"}),
                                      r"'a.weight' has an entry of its own"),
    "an empty row block list": ("rows", 4, _set(["blocks", EMB, "rows"], []),
                                r"the row blocks of tensor 'model/emb.weight' are malformed"),
    "a NaN cost": ("delta", 4, _set(["cost"], float("nan")), r"field 'cost' is nan"),
    "a NaN layer cost": ("rows", 4, _layer_cost_nan, r"entry for layer .* is malformed \(cost nan"),
    "a NaN loss": ("rows", 4, _set(["loss"], float("nan")), r"field 'loss' is nan"),
}


#: variants whose manifest is sound but gives a tensor another shape: a restore into the model refuses them by that
#: (read_checkpoint, which takes any shape, meets the damage itself)
RESHAPED = {"a terabyte raw tensor": r"mismatched: a\.weight", "a terabyte encoded tensor": r"mismatched: a\.weight"}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile_manifest")
    roots = {"delta": str(base / "delta"), "rows": str(base / "rows"), "boxes": str(base / "boxes")}
    states = {"delta": hs.build_delta(roots["delta"]), "rows": hs.build_rows(roots["rows"])}
    hs.rows_to_boxes(roots["rows"], roots["boxes"])
    states["boxes"] = states["rows"]
    return roots, states, base


@pytest.fixture(scope="module")
def probed(stores):
    """Every variant built and probed in one child process; its results by variant name."""
    roots, _, base = stores
    plan = []
    for name, (store, step, change, _) in VARIANTS.items():
        d = str(base / "variants" / re.sub(r"\W+", "-", name))
        shutil.copytree(roots[store], d, ignore=shutil.ignore_patterns(".writer.lock"))
        if change is not None:
            hs.edit(d, step, lambda m: change(m, d))
        plan.append({"name": name, "dir": d, "step": step, "pristine": roots[store]})
    with open(base / "plan.json", "w") as f:
        json.dump(plan, f)
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import test_hostile_manifest as t; t.probe(*sys.argv[1:])"
    env = {k: v for k, v in os.environ.items() if k != "LAYERCKPT_TRACEBACK"}
    r = subprocess.run([sys.executable, "-c", code, str(base / "plan.json"), str(base / "out.json")],
                       capture_output=True, text=True, timeout=60 + BOUND_S * 4 * len(plan), env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(base / "out.json") as f:
        return json.load(f)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_hostile_manifest_restores_the_genuine_tensors_or_is_refused_by_name(probed, name):
    store, step, _, expected = VARIANTS[name]
    got = probed[name]
    for call in ("manifest", "read", "restore", "verify", "inspect"):
        c = got[call]
        assert c["seconds"] <= BOUND_S, (call, c)
        assert c["grew"] <= BOUND_RSS, f"{call} grew the peak memory by {c['grew'] / 2 ** 20:.0f} MiB"
        assert "Traceback" not in c.get("out", ""), (call, c["out"])
    for call in ("read", "restore"):
        c = got[call]
        if expected is None:
            assert c["error"] is None and c["genuine"] is True, (call, c)
        elif call == "restore" and name in RESHAPED:
            assert c["error"] == "CheckpointMismatchError" and re.search(RESHAPED[name], c["message"]), (call, c)
        else:  # the library's own error, naming what is wrong (the manifest's field, or the tensor and its file)
            assert c["error"] == "CheckpointCorruptError" and re.search(expected, c["message"]), (call, c)
    verify = got["verify"]
    assert verify["error"] is None, verify  # verify itself never raises
    if expected is None:
        assert verify["rc"] == 0, verify["out"]
    else:
        assert verify["rc"] == 1 and re.search(expected, verify["out"]), verify["out"]
        assert f"step-{step:08d}.json" in verify["out"], verify["out"]
    inspect = got["inspect"]
    assert inspect["error"] is None, inspect
    if got["manifest"]["error"] is not None:  # refused by the validator: inspect says so, by name
        assert got["manifest"]["error"] == "CheckpointCorruptError" and re.search(expected, got["manifest"]["message"])
        assert inspect["rc"] != 0 and re.search(expected, inspect["out"]), inspect["out"]
    else:
        assert inspect["rc"] == 0, inspect["out"]


def test_the_boxes_store_is_the_rows_store_recorded_as_boxes(stores):
    roots, states, _ = stores
    import layerckpt
    from layerckpt.format._manifest import load_manifest

    m = load_manifest(hs.manifest_path(roots["boxes"], 4))
    assert m.blocks is None and m.boxes[EMB].boxes[1] == [[256, 0], [256, 64]] and m.version == 5
    assert m.tensors[BOX1].crc >> 32 == 3  # sealed to the box and its file's step
    boxes, rows = (layerckpt.read_checkpoint(roots[s], 4) for s in ("boxes", "rows"))
    assert _same(boxes.model, rows.model) and boxes.model.keys() == states["rows"][4].keys()
    st = rows.optimizer["state"]
    assert all(torch.equal(boxes.optimizer["state"][i][k], v) for i in st for k, v in st[i].items())


def test_entries_are_sealed_to_their_place_and_blocks_lie_in_order(stores):
    """What the writers record: every crc sealed (bits 32 and 33) to its own key and its file's step; an encoded
    tensor's blocks in file order, several per tensor where its bytes span chunks; no two tensors of a file
    overlapping."""
    roots, _, _ = stores
    from layerckpt.io._backend import checksum_function
    from layerckpt.format._manifest import load_manifest
    from layerckpt.format._places import region, seal, sealed_ok

    for store in ("delta", "rows"):
        m = load_manifest(hs.manifest_path(roots[store], 4))
        assert m.version == 5 and all(e.crc >> 32 == 3 for e in m.tensors.values())
        e = m.tensors[A]
        check = checksum_function(m.checksum)
        assert not sealed_ok(check, e.crc, B, 0, 4)  # another key: another seal
    m = load_manifest(hs.manifest_path(roots["rows"], 4))
    e, check = m.tensors[A], checksum_function(m.checksum)
    with open(os.path.join(roots["rows"], "data", e.file), "rb") as f:
        f.seek(e.offset)
        crc = check(f.read(e.nbytes), 0)
    step = m.files[e.file].step
    assert e.crc == seal(check, A, crc, step) and sealed_ok(check, e.crc, A, crc, step)
    assert not sealed_ok(check, e.crc, A, crc, step - 1)  # another step: another seal
    assert sealed_ok(check, seal(check, A, crc), A, crc, step - 1)  # format 4's key-only seal: read as it was
    m = load_manifest(hs.manifest_path(roots["delta"], 4))
    blocks = m.tensors[EMB].enc["blocks"]
    assert len(blocks) >= 4 and all(b[0] + b[1] <= c[0] for b, c in zip(blocks, blocks[1:]))
    assert any(b[3] == 2 for b in blocks) and m.tensors[EMB].enc["ref"]  # deltas against a reference
    spans = sorted(region(e) for e in m.tensors.values() if e.file == m.tensors[EMB].file)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("change", [_same_as_older, _rolled_back(B, file_step=4)],
                         ids=["a delta of unchanged blocks with an older checksum",
                              "an older file's entry claiming this step"])
def test_an_older_version_under_the_newer_step_is_refused(stores, tmp_path, change):
    """Each checksum is sealed to its file's step: the older version's checksum does not match under the newer
    step, whether its bytes come through unchanged delta blocks or from the older file relabelled."""
    import layerckpt
    from layerckpt.errors import CheckpointCorruptError

    roots, _, _ = stores
    d = str(tmp_path / "same")
    shutil.copytree(roots["delta"], d, ignore=shutil.ignore_patterns(".writer.lock"))
    hs.edit(d, 4, lambda m: change(m, d))
    with pytest.raises(CheckpointCorruptError, match=MISMATCH.format(r"model/b\.weight")) as e:
        layerckpt.read_checkpoint(d, 4)
    assert e.value.tensor == B
    v = _cli("verify", d)
    assert v["rc"] == 1 and re.search(MISMATCH.format(r"model/b\.weight"), v["out"]), v["out"]


def _as_format_4(d, root):
    """Every seal as format version 4 wrote it: to the key only (recomputed over the raw bytes)."""
    from layerckpt.io._backend import checksum_function
    from layerckpt.format._places import seal

    check = checksum_function(d["checksum"])
    for k, e in _t(d).items():
        with open(os.path.join(root, "data", e["file"]), "rb") as f:
            f.seek(e["offset"])
            e["crc"] = seal(check, k, check(f.read(e["nbytes"]), 0))
    d["version"] = 4


def test_a_format_4_store_still_reads_its_key_only_seals(stores, tmp_path):
    """A store written before steps were sealed (its entries sealed to their keys only, version 4) reads and
    verifies as before; its seals still tell tensors apart."""
    import layerckpt
    from layerckpt.errors import CheckpointCorruptError

    roots, _, _ = stores
    d = str(tmp_path / "v4")
    shutil.copytree(roots["rows"], d, ignore=shutil.ignore_patterns(".writer.lock"))
    for step in range(1, 5):
        hs.edit(d, step, lambda m: _as_format_4(m, d))
    for step in range(1, 5):
        got = layerckpt.read_checkpoint(d, step)
        assert _same(got.model, layerckpt.read_checkpoint(roots["rows"], step).model)
    v = _cli("verify", d)
    assert v["rc"] == 0, v["out"]
    hs.edit(d, 4, lambda m: _swap(ROW0, ROW1, ("file", "offset", "crc"))(m, d))
    with pytest.raises(CheckpointCorruptError, match=MISMATCH.format(r"model/emb\.weight#rows=(0:256|256:512)")):
        layerckpt.read_checkpoint(d, 4)


# -- the child process ---------------------------------------------------------------------------------------

def _peak() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) << 10


def _rss() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) << 10


def _measured(fn) -> dict:
    """fn() with its time and the peak memory it added: its result's fields, or its error's type and message."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from what the process holds now
    start, t = _rss(), time.perf_counter()
    out = {"error": None}
    try:
        out.update(fn() or {})
    except Exception as e:  # noqa: BLE001 - reported to the test, which judges it
        out.update(error=type(e).__name__, message=str(e))
    out.update(seconds=time.perf_counter() - t, grew=_peak() - start)
    return out


def _same(model: dict, genuine: dict) -> bool:
    return model.keys() == genuine.keys() and all(
        model[k].dtype == v.dtype and model[k].shape == v.shape and torch.equal(model[k], v) for k, v in genuine.items())


def _cli(*argv) -> dict:
    from layerckpt import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = cli.main(list(argv))
    return {"rc": rc, "out": out.getvalue()}


def probe(plan_path: str, out_path: str) -> None:
    """For each variant of the plan: its manifest loaded, read, restored into the model, verified, inspected."""
    import layerckpt
    from layerckpt.format._manifest import load_manifest

    torch.set_num_threads(1)
    with open(plan_path) as f:
        plan = json.load(f)
    genuine = {}
    results = {}
    for root in sorted({v["pristine"] for v in plan}):  # the first calls' imports and pools are not the variants'
        layerckpt.restore(root, *hs.model_and_optimizer())
        _cli("verify", root)
        _cli("inspect", root)
    for v in plan:
        key = (v["pristine"], v["step"])
        if key not in genuine:
            genuine[key] = layerckpt.read_checkpoint(v["pristine"], v["step"]).model
        want = genuine[key]

        def restored():
            model, opt = hs.model_and_optimizer()
            layerckpt.restore(v["dir"], model, opt, step=v["step"])
            return {"genuine": _same(model.state_dict(), want)}

        path = hs.manifest_path(v["dir"], v["step"])
        results[v["name"]] = {
            "manifest": _measured(lambda: load_manifest(path) and None),
            "read": _measured(lambda: {"genuine": _same(layerckpt.read_checkpoint(v["dir"], v["step"]).model, want)}),
            "restore": _measured(restored),
            "verify": _measured(lambda: _cli("verify", v["dir"])),
            "inspect": _measured(lambda: _cli("inspect", path)),
        }
    with open(out_path, "w") as f:
        json.dump(results, f)
