"""Signed checkpoints (``Config.sign_key`` / ``$LAYERCKPT_SIGN_KEY``, ``format/_sign.py``): every manifest carries an
HMAC over itself and its store's identity, every file entry the SHA-256 digest of its file's bytes (taken from the
staged buffers as they are written, or read back where the file was written encoded); a restore or ``verify`` with
the key refuses every forgery a writer of the store could make with recomputed CRCs and seals, a file swapped or
edited, a manifest unsigned, signed with another key or copied from another store; without the key a signed store
reads as any other, and the key is written nowhere."""
import contextlib
import hashlib
import hmac
import inspect
import json
import os
import re
import shutil
import sys

import pytest
import torch

import layerckpt
from layerckpt.errors import CheckpointCorruptError, CheckpointError, ConfigError
from layerckpt.format import _places, _sign
from layerckpt.io._backend import checksum_function

sys.path.insert(0, os.path.dirname(__file__))
import test_hostile as hostile  # noqa: E402
from test_hostile import expected, fill, tiny  # noqa: E402

K = "signing-key-0123456789abcdef"  # the store's key
OTHER = "another-signing-key-fedcba9876543210"  # a key that did not sign it
ENV = _sign.ENV
STEP1, STEP2 = "step-00000001.json", "step-00000002.json"
FILE1, FILE2 = "step-00000001.rank0.safetensors", "step-00000002.rank0.safetensors"
TIMEOUT = 30.0
NOT_OURS = "not signed by the key given"
DIGEST = "do not match the digest"


@pytest.fixture(scope="module", autouse=True)
def _no_key_in_the_environment():
    """The stores are built, and every test starts, with no key in the environment (a test sets its own)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(ENV, raising=False)
        yield


# -- helpers -----------------------------------------------------------------------------------------------------

def signed(**kw) -> layerckpt.Config:
    return layerckpt.Config(sign_key=K, **kw)


def mpath(root, step: int) -> str:
    return os.path.join(str(root), "manifests", f"step-{step:08d}.json")


def manifest(root, step: int) -> dict:
    with open(mpath(root, step)) as f:
        return json.load(f)


def edit(root, step: int, change) -> None:
    """Change the parsed manifest of ``step`` and write it back as the writers do (compact: its signature, if it
    has one, stays where a reader looks for it, so an edit is refused as such, not as unsigned)."""
    d = manifest(root, step)
    change(d)
    with open(mpath(root, step), "w") as f:
        f.write(json.dumps(d, separators=(",", ":")).replace("NaN", "1e999"))


def copy(src, dst):
    shutil.copytree(str(src), str(dst), ignore=shutil.ignore_patterns(".writer.lock"))
    return dst


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def data(root, name: str) -> str:
    return os.path.join(str(root), "data", name)


def same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def restored(root, step=None, config=None) -> dict:
    m = tiny()
    hostile.in_time(layerckpt.restore, str(root), m, step=step, config=config, timeout=TIMEOUT)
    return m.state_dict()


@contextlib.contextmanager
def env_key(key):
    with pytest.MonkeyPatch.context() as mp:
        if key is None:
            mp.delenv(ENV, raising=False)
        else:
            mp.setenv(ENV, key)
        yield


def verify(root, key=None) -> tuple:
    """``layerckpt verify ROOT`` with ``$LAYERCKPT_SIGN_KEY`` set to ``key`` (unset: None): (exit code, output)."""
    with env_key(key):
        return hostile.verify(root, timeout=TIMEOUT)


def refused(root, *needles, step=2, restore=None, verify_needles=None):
    """With the key: restore (``restore``, else restore of the tiny model) and read_checkpoint of ``step`` raise a
    CheckpointCorruptError naming ``needles``; ``layerckpt verify`` with $LAYERCKPT_SIGN_KEY exits 1 naming them,
    without a traceback.  Returns the restore's error message."""
    call = restore or (lambda: restored(root, step, signed()))
    with pytest.raises(CheckpointCorruptError) as e:
        call()
    for n in needles:
        assert n in str(e.value), (n, str(e.value))
    if restore is None:
        with pytest.raises(CheckpointCorruptError) as e2:
            hostile.in_time(layerckpt.read_checkpoint, str(root), step, config=signed(), timeout=TIMEOUT)
        for n in needles:
            assert n in str(e2.value), (n, str(e2.value))
    rc, text = verify(root, K)
    assert rc == 1, text
    assert "Traceback" not in text, text
    for n in needles if verify_needles is None else verify_needles:
        assert n in text, (n, text)
    return str(e.value)


def unkeyed(root, step=2, restore=None):
    """Without any key: the restore ends with the tensors or the library's own error (None then), never another
    exception; ``verify`` exits 0 or 1 without a traceback."""
    try:
        got = restore() if restore is not None else restored(root, step)
    except CheckpointError:
        got = None
    rc, text = verify(root, None)
    assert rc in (0, 1) and "Traceback" not in text, text
    return got


def sealed_crc(root, d: dict, key: str) -> int:
    """The crc the writers seal into the entry ``key`` of the parsed manifest ``d``, over its bytes as they are now."""
    e = d["tensors"][key]
    check = checksum_function(d["checksum"])
    with open(data(root, e["file"]), "rb") as f:
        f.seek(e["offset"])
        raw = f.read(e["nbytes"])
    return _places.seal(check, key, check(raw, 0), d["files"][e["file"]]["step"])


def digest_ok(root, name: str, entry: dict) -> None:
    """The entry's digest is SHA-256 of the file's bytes, part by part, and covers the file exactly."""
    with open(data(root, name), "rb") as f:
        raw = f.read()
    parts = entry["digest"]
    assert parts and sum(n for n, _ in parts) == entry["size"] == len(raw), (name, entry)
    at = 0
    for n, want in parts:
        assert re.fullmatch(r"[0-9a-f]{64}", want), want
        assert hashlib.sha256(raw[at:at + n]).hexdigest() == want, (name, at, n)
        at += n


def signature_ok(path: str, key: str = K) -> None:
    """The manifest at ``path`` ends with the HMAC of every byte before it, under ``key``: as ``_sign.check`` says,
    and as recomputed here from the format's definition."""
    with open(path, "rb") as f:
        raw = f.read()
    _sign.check(raw, key.encode(), path)
    found = re.search(rb',"signature":"([0-9a-f]{64})"\}\s*$', raw)
    assert found, raw[-120:]
    body = raw[:found.start()] + b"}"
    mac = hmac.new(key.encode(), b"layerckpt-manifest-signature-1\0" + body, hashlib.sha256).hexdigest()
    assert mac == found.group(1).decode()
    with pytest.raises(CheckpointCorruptError, match=NOT_OURS):
        _sign.check(raw, OTHER.encode(), path)


def every_manifest(root):
    d = os.path.join(str(root), "manifests")
    return [os.path.join(d, n) for n in sorted(os.listdir(d))]


def save_full(root, config: layerckpt.Config, steps=(1, 2)) -> None:
    model = tiny()
    with layerckpt.Checkpointer(str(root), model, config=config) as ck:
        for step in steps:
            fill(model, step)
            ck.save(step).wait()


# -- stores, built once ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def selective(tmp_path_factory):
    """Selective signed saves: step 1 everything, steps 2 and 3 layer 0 only, step 4 layer 1 only (so steps 2 and 3
    carry step 1's file, step 4 step 3's).  Returns (root, {step: state})."""
    root = tmp_path_factory.mktemp("selective") / "ck"
    model = tiny()
    states = {}
    with layerckpt.Checkpointer(str(root), model, config=signed(keep_last=0, encoding="off")) as ck:
        for step in (1, 2, 3, 4):
            with torch.no_grad():
                if step == 1:
                    fill(model, 1)
                elif step < 4:
                    model[0].weight.add_(1.0)
                    model[0].bias.add_(1.0)
                else:
                    model[1].weight.add_(1.0)
            ck.save(step).wait()
            states[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return root, states


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """Full signed saves of steps 1 and 2, raw (each tensor's bytes at its offset)."""
    root = tmp_path_factory.mktemp("full") / "ck"
    save_full(root, signed(full=True, keep_last=0, encoding="off"))
    return root


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    """The same saves as ``full``, with the same key, in another directory (another store)."""
    root = tmp_path_factory.mktemp("twin") / "ck"
    save_full(root, signed(full=True, keep_last=0, encoding="off"))
    return root


@pytest.fixture(scope="module")
def unsigned(tmp_path_factory):
    root = tmp_path_factory.mktemp("unsigned") / "ck"
    save_full(root, layerckpt.Config(full=True, keep_last=0, encoding="off"))
    return root


@pytest.fixture
def store(full, tmp_path):
    """A copy of the full signed store to damage."""
    return copy(full, tmp_path / "ck")


# -- 1: round trip -----------------------------------------------------------------------------------------------

def test_a_signed_selective_store_restores_bit_exact_with_and_without_the_key(selective, full):
    root, states = selective
    m2, m4 = manifest(root, 2), manifest(root, 4)
    assert set(m2["files"]) == {FILE1, FILE2} and m2["layers"]["1"]["step"] == 1  # carried with its digest
    assert m4["layers"]["0"]["step"] == 3 and "step-00000003.rank0.safetensors" in m4["files"]
    for step in (1, 2, 3, 4):
        same(restored(root, step, signed()), states[step])
        same(restored(root, step), states[step])
    same(restored(root, None, signed()), states[4])
    loaded = layerckpt.read_checkpoint(str(root), 2, config=signed())
    same({k: v for k, v in loaded.model.items()}, states[2])
    for step in (1, 2):
        same(restored(full, step, signed()), expected(step))
        same(restored(full, step), expected(step))
    assert verify(root, K)[0] == 0 and verify(full, K)[0] == 0
    assert verify(root, None)[0] == 0


def test_every_file_entry_carries_its_files_digest_and_every_manifest_is_signed(selective, full):
    root, _ = selective
    for r in (root, full):
        with open(os.path.join(str(r), ".store-id")) as f:
            identity = f.read().strip()
        for path in every_manifest(r):
            signature_ok(path)
            with open(path) as f:
                d = json.load(f)
            assert d["store"] == identity, path
            assert d["files"], path
            for name, e in d["files"].items():
                digest_ok(r, name, e)
    # a carried file's digest is the one recorded when it was written
    assert manifest(root, 3)["files"][FILE1]["digest"] == manifest(root, 1)["files"][FILE1]["digest"]


def test_the_key_is_written_nowhere_and_never_shown(selective, full, remote):
    root, _ = selective
    needles = [K.encode(), K.encode().hex().encode(), K[::-1].encode()]
    for r in (root, full, remote[0]):  # the last: a store and its file:// remote tier
        seen = 0
        for dirpath, _, names in os.walk(str(r)):
            for n in names:
                p = os.path.join(dirpath, n)
                if os.path.islink(p) or not os.path.isfile(p):
                    continue
                with open(p, "rb") as f:
                    raw = f.read()
                seen += 1
                for needle in needles:
                    assert needle not in raw, p
        assert seen >= 6
    cfg = signed(full=True)
    assert K not in repr(cfg) and K not in str(cfg)
    assert K not in json.dumps(cfg.recorded(), default=str)
    assert K not in json.dumps(cfg.to_dict(), default=str)
    assert cfg.recorded().get("sign_key") is None and cfg.to_dict().get("sign_key") is None
    assert cfg.sign_key == K  # the Config itself still holds it


def test_a_resumed_signed_store_goes_on_signing_and_adopt_checks_the_signature(selective, tmp_path):
    root = copy(selective[0], tmp_path / "ck")
    states = selective[1]
    model = tiny()
    report = layerckpt.restore(str(root), model, config=signed())
    same(model.state_dict(), states[4])
    with layerckpt.Checkpointer(str(root), model, config=signed(keep_last=0, encoding="off")) as ck:
        ck.adopt(report)
        with torch.no_grad():
            model[0].weight.add_(1.0)
        ck.save(5).wait()
        want = {k: v.clone() for k, v in model.state_dict().items()}
    d5 = manifest(root, 5)
    assert d5["layers"]["1"]["step"] == 4  # selective against the adopted step 4: its file carried
    file4 = "step-00000004.rank0.safetensors"
    assert d5["files"][file4] == manifest(root, 4)["files"][file4]
    signature_ok(mpath(root, 5))
    for name, e in d5["files"].items():
        digest_ok(root, name, e)
    same(restored(root, 5, signed()), want)

    path = mpath(root, 5)  # adopt() with the key refuses a manifest not signed by it
    with open(path, "rb") as f:
        raw = f.read()
    with open(path, "wb") as f:
        f.write(re.sub(rb',"signature":"[0-9a-f]{64}"\}\s*$', b"}", raw))
    with layerckpt.Checkpointer(str(root), tiny(), config=signed(keep_last=0, encoding="off")) as ck:
        with pytest.raises(CheckpointCorruptError, match="is not signed"):
            ck.adopt(path)


# -- 2: digests as written and read back -------------------------------------------------------------------------

class Wide(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.a = torch.nn.Linear(64, 64)  # 16 KiB of weight: four chunks of 4 KiB
        self.b = torch.nn.Linear(64, 8)


def test_the_minimum_chunk_is_4096_bytes():
    assert layerckpt.Config(chunk_bytes=4096).chunk_bytes == 4096
    for bad in (2048, 4096 + 512):
        with pytest.raises(ConfigError):
            layerckpt.Config(chunk_bytes=bad)


def _save_wide(root, **kw):
    model = Wide()
    with layerckpt.Checkpointer(str(root), model, config=signed(full=True, keep_last=0, chunk_bytes=4096, **kw)) as ck:
        for step in (1, 2):
            with torch.no_grad():
                model.a.weight.mul_(1.001)
            ck.save(step).wait()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _counting_read_back(monkeypatch):
    calls = []
    real = _sign.file_parts

    def counted(*a, **kw):
        calls.append(a)
        return real(*a, **kw)

    monkeypatch.setattr(_sign, "file_parts", counted)
    return calls


def test_a_raw_file_is_digested_from_its_staged_buffers_in_parts(tmp_path, monkeypatch):
    calls = _counting_read_back(monkeypatch)
    want = _save_wide(tmp_path / "ck", encoding="off")
    assert calls == []  # no file was read back: each digest came from the buffers as they were written
    for step in (1, 2):
        d = manifest(tmp_path / "ck", step)
        (name, e), = d["files"].items()
        assert len(e["digest"]) >= 4, e["digest"]  # one part per staged buffer (the read-back takes 64 MiB parts)
        assert all(n <= 4096 for n, _ in e["digest"]), e["digest"]
        digest_ok(tmp_path / "ck", name, e)
        signature_ok(mpath(tmp_path / "ck", step))
    model = Wide()
    layerckpt.restore(str(tmp_path / "ck"), model, config=signed())
    same(model.state_dict(), want)


@pytest.mark.parametrize("encoding", ["compress", "delta"])
def test_an_encoded_file_is_digested_as_it_lies_on_disk(tmp_path, monkeypatch, encoding):
    calls = _counting_read_back(monkeypatch)
    root = tmp_path / "ck"
    want = _save_wide(root, encoding=encoding)
    encoded = False
    for step in (1, 2):
        d = manifest(root, step)
        encoded |= any(e.get("enc") for e in d["tensors"].values())
        for name, e in d["files"].items():
            digest_ok(root, name, e)
        signature_ok(mpath(root, step))
    assert encoded  # the files were written encoded: their bytes are not the staged ones
    assert calls  # so they were read back once durable
    model = Wide()
    layerckpt.restore(str(root), model, config=signed())
    same(model.state_dict(), want)
    assert verify(root, K)[0] == 0


# -- 3: hostile stores, refused with the key ---------------------------------------------------------------------

def test_a_tensor_edited_with_its_crc_recomputed_is_refused_by_the_signature(store):
    key = "model/0.weight"
    e = manifest(store, 2)["tensors"][key]
    flip(data(store, e["file"]), e["offset"] + 3)

    def recrc(d):
        d["tensors"][key]["crc"] = sealed_crc(store, d, key)

    edit(store, 2, recrc)
    # without the key the forgery reads as sound: that is what the signature is for
    got = unkeyed(store)
    assert got is not None and not torch.equal(got["0.weight"], expected(2)["0.weight"])
    refused(store, STEP2, NOT_OURS)


def test_data_bytes_edited_under_an_untouched_manifest_are_refused_by_the_digest(store):
    e = manifest(store, 2)["tensors"]["model/1.weight"]
    flip(data(store, e["file"]), e["offset"] + 5)
    assert unkeyed(store) is None  # the CRC catches it too
    refused(store, FILE2, DIGEST)
    same(restored(store, 1, signed()), expected(1))  # the older step stays restorable


def test_a_file_edited_outside_any_tensor_is_refused_by_the_digest(store):
    size = os.path.getsize(data(store, FILE2))
    flip(data(store, FILE2), size - 1)  # the last byte: no tensor's CRC covers it
    refused(store, FILE2, DIGEST)


def test_a_digest_edited_in_the_manifest_is_refused_by_the_signature(store):
    def change(d):
        (n, h), = d["files"][FILE2]["digest"]
        d["files"][FILE2]["digest"] = [[n, hashlib.sha256(b"forged").hexdigest()]]

    edit(store, 2, change)
    assert unkeyed(store) is not None
    refused(store, STEP2, NOT_OURS)


def test_an_older_entry_copied_in_with_its_file_and_layer_is_refused(store):
    """Step 1's layer 0 (entries, file entry, layer record aged 1) copied into step 2's full composite: the gap it
    leaves in step 2's own file is refused without the key too; with it, the signature refuses it first."""
    old = manifest(store, 1)

    def rollback(d):
        layer = old["layers"]["0"]
        for k in layer["tensors"]:
            d["tensors"][k] = old["tensors"][k]
        d["files"][FILE1] = old["files"][FILE1]
        d["layers"]["0"] = dict(layer, age=1)

    edit(store, 2, rollback)
    unkeyed(store)
    refused(store, STEP2, NOT_OURS, verify_needles=(STEP2,))


def test_an_older_composites_layer_under_a_newer_step_is_refused(selective, tmp_path):
    """Step 3 wrote layer 0 only; its entries (and the RNG states its file holds), file entry and layer record
    replaced by step 2's (age 1): every seal is sound; with the key the signature refuses it."""
    root = copy(selective[0], tmp_path / "ck")
    old = manifest(root, 2)
    file3 = "step-00000003.rank0.safetensors"

    def rollback(d):
        for k in [k for k, e in d["tensors"].items() if e["file"] == file3]:  # layer 0's, and the RNG states
            d["tensors"][k] = old["tensors"][k]
        del d["files"][file3]
        d["files"][FILE2] = old["files"][FILE2]
        d["layers"]["0"] = dict(old["layers"]["0"], age=1)

    edit(root, 3, rollback)
    unkeyed(root, 3)  # the library's own checks refuse it too (the RNG states are not the step's own)
    refused(root, "step-00000003.json", NOT_OURS, step=3, verify_needles=("step-00000003.json",))


def test_two_data_files_swapped_are_refused_by_the_digest(store):
    tmp = data(store, "swap")
    os.rename(data(store, FILE1), tmp)
    os.rename(data(store, FILE2), data(store, FILE1))
    os.rename(tmp, data(store, FILE2))
    unkeyed(store)
    refused(store, FILE2, DIGEST)
    refused(store, FILE1, DIGEST, step=1)


def test_a_file_dropped_from_the_manifest_is_refused(selective, tmp_path):
    root = copy(selective[0], tmp_path / "ck")

    def drop(d):
        del d["files"][FILE1]
        for k in [k for k, e in d["tensors"].items() if e["file"] == FILE1]:
            del d["tensors"][k]
        for n in [n for n, e in d["layers"].items() if e["file"] == FILE1]:
            del d["layers"][n]

    edit(root, 2, drop)
    unkeyed(root, restore=lambda: _restore_lenient(root))
    refused(root, STEP2, NOT_OURS)


def _restore_lenient(root):
    m = tiny()
    layerckpt.restore(str(root), m, step=2, strict=False)
    return m.state_dict()


def test_a_file_entry_added_is_refused(store):
    edit(store, 2, lambda d: d["files"].__setitem__(FILE1, manifest(store, 1)["files"][FILE1]))
    unkeyed(store)
    refused(store, STEP2, NOT_OURS)


def test_a_manifest_with_its_signature_removed_is_not_signed(store):
    path = mpath(store, 2)
    with open(path, "rb") as f:
        raw = f.read()
    stripped = re.sub(rb',"signature":"[0-9a-f]{64}"\}\s*$', b"}", raw)
    assert stripped != raw and json.loads(stripped)
    with open(path, "wb") as f:
        f.write(stripped)
    got = unkeyed(store)
    assert got is not None  # without the key it is a sound unsigned manifest
    same(got, expected(2))
    refused(store, STEP2, "is not signed")


def test_an_unsigned_store_read_with_the_key_is_not_signed(unsigned):
    same(restored(unsigned, 2), expected(2))
    text = refused(unsigned, STEP2, "is not signed")
    assert ENV in text  # it says which key asked for a signature


def test_a_store_signed_with_another_key_is_refused(full):
    with pytest.raises(CheckpointCorruptError, match=NOT_OURS) as e:
        restored(full, 2, layerckpt.Config(sign_key=OTHER))
    assert STEP2 in str(e.value)
    rc, text = verify(full, OTHER)
    assert rc == 1 and NOT_OURS in text and "Traceback" not in text, text


def test_a_signed_manifest_copied_from_another_store_is_refused(store, twin):
    shutil.copyfile(mpath(twin, 2), mpath(store, 2))
    signature_ok(mpath(store, 2))  # signed with the same key: only its store tells it apart
    unkeyed(store)
    with open(os.path.join(str(twin), ".store-id")) as f:
        theirs = f.read().strip()
    text = refused(store, STEP2, "signed for the store", theirs)
    with open(os.path.join(str(store), ".store-id")) as f:
        assert f.read().strip() in text


@pytest.fixture(scope="module")
def coded(tmp_path_factory):
    """Signed full saves of an AdamW run (tests/test_lossy_store.py's), delta-encoded and with bounded loss: steps 2
    and 3 hold deltas against step 1's file, which their composites list.  {encoding: (root, states)}."""
    import test_lossy_store as lossy

    out = {}
    for enc in ("delta", "lossy"):
        root = tmp_path_factory.mktemp(enc) / "ck"
        states = lossy._saves(str(root), n=3, config=signed(encoding=enc, full=True, keep_last=0, delta_chain=3))
        out[enc] = (root, states)
    return out


def _restore_coded(root, step, config=None):
    import test_lossy_store as lossy

    model = lossy._model()
    hostile.in_time(layerckpt.restore, str(root), model, step=step, config=config, timeout=TIMEOUT)
    return model.state_dict()


@pytest.mark.parametrize("enc", ["delta", "lossy"])
def test_a_signed_delta_or_lossy_store_carries_every_digest_and_restores_with_the_key(coded, enc):
    root, states = coded[enc]
    d3 = manifest(root, 3)
    refs = {((e.get("enc") or {}).get("ref") or {}).get("file") for e in d3["tensors"].values()}
    assert FILE1 in refs and FILE1 in d3["files"]  # step 3 reads deltas against step 1's file
    for step in (1, 2, 3):
        signature_ok(mpath(root, step))
        want = _restore_coded(root, step)  # without the key
        got = _restore_coded(root, step, signed())
        same(got, want)
        if enc == "delta":
            same(got, states[step][0])
        for name, e in manifest(root, step)["files"].items():
            digest_ok(root, name, e)


def test_a_forged_lossy_record_is_refused_by_the_signature(coded, tmp_path):
    root = copy(coded["lossy"][0], tmp_path / "ck")
    d3 = manifest(root, 3)
    coded_keys = [k for k, e in d3["tensors"].items() if (e.get("enc") or {}).get("lossy")]
    assert "model/0.weight" in coded_keys, coded_keys
    for step in (1, 2, 3):
        signature_ok(mpath(root, step))
    _restore_coded(root, 1, signed())  # the self-contained step restores with the key

    rec = d3["tensors"]["model/0.weight"]["enc"]["lossy"]
    field = "move" if "move" in rec else "rms"

    def forge(d):  # the error bound and the scale it is told against, made to look ten times better
        r = d["tensors"]["model/0.weight"]["enc"]["lossy"]
        r[field] = r[field] * 10
        r["max_err"] = r["max_err"] / 10
        r["rms_err"] = r["rms_err"] / 10

    edit(root, 3, forge)
    unkeyed(root, 3, restore=lambda: _restore_coded(root, 3))
    refused(root, "step-00000003.json", NOT_OURS, restore=lambda: _restore_coded(root, 3, signed()))


def test_a_forged_pretrained_reference_is_refused_by_the_signature(tmp_path):
    import test_pretrained as pre

    path = pre._pretrained(tmp_path)
    model = pre.Net(0)
    opt = pre._frozen(model)
    root = tmp_path / "ck"
    with layerckpt.Checkpointer(str(root), model, opt, config=signed(pretrained=path)) as ck:
        for s in (1, 2):
            pre._train(model, opt, s)
            ck.save(s).wait()
    want = pre._state(model)
    d = manifest(root, 2)
    assert set(d["pretrained"]) == set(pre.FROZEN)
    signature_ok(mpath(root, 2))

    def restore(config=None):
        m = pre.Net(5)
        cfg = (config or layerckpt.Config()).replace(pretrained=path)
        hostile.in_time(layerckpt.restore, str(root), m, step=2, config=cfg, timeout=TIMEOUT)
        return pre._state(m)

    pre._same(restore(signed()), want)  # the genuine store restores with the key

    key = "model/backbone.2.weight"

    def resealed(d, e):
        """The entry's seal as the writers compute it (over what ``pretrained_seal`` takes of the entry)."""
        params = inspect.signature(_places.pretrained_seal).parameters
        extra = {k: e[k] for k in ("step", "dtype", "shape") if k in params and k in e}
        return _places.pretrained_seal(checksum_function(d["checksum"]), key, e["name"], e["fp"], **extra)

    genuine = d["pretrained"][key]
    assert resealed(d, genuine) == genuine["seal"]  # the seal is recomputed here as the writers compute it

    def forge(d):
        e = d["pretrained"][key]
        e["fp"] = [(e["fp"][0] ^ 1)] + list(e["fp"][1:])
        e["seal"] = resealed(d, e)

    edit(root, 2, forge)
    with pytest.raises(CheckpointError) as e:  # without the key: the fingerprint no longer matches the file
        restore()
    assert "does not carry its own seal" not in str(e.value)  # the seal was recomputed: only the fp is refused
    refused(root, STEP2, NOT_OURS, restore=lambda: restore(signed()))


# -- 4: the remote tier ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    base = tmp_path_factory.mktemp("remote")
    url = "file://" + str(base / "remote")
    save_full(base / "ck", signed(full=True, keep_last=0, remote=url, encoding="off"))
    return base, url


def _remote_copy(remote, tmp_path):
    base, _ = remote
    copy(base / "ck", tmp_path / "ck")
    copy(base / "remote", tmp_path / "remote")
    return tmp_path / "ck", tmp_path / "remote", "file://" + str(tmp_path / "remote")


def test_the_remote_tiers_manifest_is_signed_and_restores_bit_exact(remote, tmp_path):
    local, far, url = _remote_copy(remote, tmp_path)
    for step in (1, 2):
        signature_ok(mpath(far, step))
        d = manifest(far, step)
        assert d["store"] == manifest(local, step)["store"]
        for name, e in d["files"].items():
            digest_ok(far, name, e)
    shutil.rmtree(local)
    m = tiny()
    layerckpt.restore(url, m, step=2, config=signed())
    same(m.state_dict(), expected(2))
    m = tiny()
    layerckpt.restore(url, m, config=layerckpt.Config())
    same(m.state_dict(), expected(2))
    with pytest.raises(CheckpointCorruptError, match=NOT_OURS):
        layerckpt.restore(url, tiny(), config=layerckpt.Config(sign_key=OTHER))


@pytest.mark.parametrize("recrc", [False, True], ids=["edited", "edited-crc-recomputed"])
def test_a_remote_data_file_edited_is_refused_with_the_key(remote, tmp_path, recrc):
    local, far, url = _remote_copy(remote, tmp_path)
    shutil.rmtree(local)
    d = manifest(far, 2)
    (name,) = d["files"]
    e = d["tensors"]["model/0.weight"]
    flip(data(far, name), e["offset"] + 2)
    if recrc:  # in the remote's own data file, under its own (signed) manifest
        edit(far, 2, lambda d: d["tensors"]["model/0.weight"].__setitem__("crc", sealed_crc(far, d, "model/0.weight")))
    try:
        got = restored(url, 2)
    except CheckpointError:
        got = None
    if not recrc:
        assert got is None  # the CRC catches a plain edit
    with pytest.raises(CheckpointCorruptError) as err:
        restored(url, 2, signed())
    assert (NOT_OURS if recrc else DIGEST) in str(err.value), str(err.value)
    assert name in str(err.value) or STEP2 in str(err.value)


# -- 5: the key's settings ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["short", "x" * 15, b"fifteen-bytes!!", 12345])
def test_a_short_or_odd_key_is_a_config_error_naming_the_minimum(bad):
    with pytest.raises(ConfigError, match="at least 16 characters") as e:
        layerckpt.Config(sign_key=bad)
    assert "sign_key" in str(e.value)
    if isinstance(bad, (str, bytes)) and bad != "short":  # the message does not echo the secret
        assert (bad.decode() if isinstance(bad, bytes) else bad) not in str(e.value)
    assert layerckpt.Config(sign_key="x" * 16).sign_key == "x" * 16


def test_a_short_key_in_the_environment_is_a_config_error_naming_it(tmp_path):
    with env_key("short"):
        with pytest.raises(ConfigError, match="at least 16 characters") as e:
            save_full(tmp_path / "ck", layerckpt.Config(full=True), steps=(1,))
    assert ENV in str(e.value)


def test_the_environments_key_alone_signs_and_is_required_the_same_way(tmp_path, unsigned):
    root = tmp_path / "ck"
    with env_key(K):
        save_full(root, layerckpt.Config(full=True, keep_last=0))
        same(restored(root, 2), expected(2))  # the environment's key checks it
        with pytest.raises(CheckpointCorruptError, match="is not signed"):
            restored(unsigned, 2)  # and requires a signature
        assert hostile.verify(root, timeout=TIMEOUT)[0] == 0
    for path in every_manifest(root):
        signature_ok(path, K)
        with open(path) as f:
            for name, e in json.load(f)["files"].items():
                digest_ok(root, name, e)
    same(restored(root, 2), expected(2))  # no key: reads as any store
    with env_key(OTHER):
        with pytest.raises(CheckpointCorruptError, match=NOT_OURS):
            restored(root, 2)
        same(restored(root, 2, signed()), expected(2))  # the Config's key comes first
    with env_key(OTHER):  # and signs, over the environment's
        save_full(tmp_path / "ck2", signed(full=True, keep_last=0), steps=(1,))
    signature_ok(mpath(tmp_path / "ck2", 1), K)
