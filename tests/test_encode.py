"""Delta encoding: lossless blocks, encoded data files that stay safetensors, bounded chains, retention and
verify across chains, damaged encodings refused by name."""
import copy
import json
import os

import numpy as np
import pytest
import torch
from safetensors import safe_open

import layerckpt
from layerckpt.format import _encode, _planes
from layerckpt import _faults
from layerckpt.errors import CheckpointCorruptError, CheckpointError
from conftest import require_native, assert_same_optimizer_state, assert_same_state, train_steps, trained


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(-1).view(torch.uint8).numpy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                                   torch.int32, torch.uint8, torch.bool])
def test_every_mode_round_trips_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(70001, generator=g) * 0.05)
    moved = base + torch.randn(70001, generator=g) * 1e-4
    if dtype.is_floating_point:
        ref, raw = base.to(dtype), moved.to(dtype)
        raw[5] = float("nan")  # any bit pattern comes back, NaN and -0.0 included
        raw[6] = -0.0
    elif dtype == torch.bool:
        ref, raw = base > 0, moved > 0
    else:
        ref, raw = (base * 1e4).to(dtype), (moved * 1e4).to(dtype)
    es = raw.element_size()
    a, r = _bits(raw), _bits(ref)
    seen = set()
    for cut in range(0, a.size, 1 << 16):
        blk, rblk = a[cut:cut + (1 << 16)], r[cut:cut + (1 << 16)]
        for reference in (None, rblk, blk.copy()):
            mode, data = _encode.encode_block(blk, reference, es)
            seen.add(mode)
            out = np.zeros_like(blk) if reference is None else reference.copy()
            payload = memoryview(blk if mode == _encode.RAW else data)
            _encode.decode_block(mode, payload, out, es, "test")
            assert np.array_equal(out, blk)
    assert _encode.SAME in seen  # a block against itself stores nothing


def test_encoding_pays_where_bytes_repeat_and_stays_raw_where_they_do_not():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(1 << 18, generator=g) * 0.05
    moved = w + torch.randn(1 << 18, generator=g) * 1e-5
    mode, data = _encode.encode_block(_bits(moved)[:_encode.BLOCK], _bits(w)[:_encode.BLOCK], 4)
    assert mode == _encode.DELTA and len(data) < 0.75 * _encode.BLOCK
    noise = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    assert _encode.encode_block(noise, None, 1) == (_encode.RAW, None)


def test_damaged_blocks_are_refused_with_a_clear_error():
    w = (torch.randn(1 << 14) * 0.05)
    mode, data = _encode.encode_block(_bits(w), None, 4)
    assert mode == _encode.PLANES
    out = np.zeros(w.numel() * 4, dtype=np.uint8)
    bad = bytearray(data)
    bad[0:4] = (10 ** 6).to_bytes(4, "little")  # a plane longer than the block
    with pytest.raises(CheckpointCorruptError, match="plane sizes do not add up"):
        _encode.decode_block(mode, memoryview(bytes(bad)), out, 4, "tensor 'x'")
    with pytest.raises(CheckpointCorruptError, match="raw block of"):
        _encode.decode_block(_encode.RAW, memoryview(b"abc"), out, 4, "tensor 'x'")
    with pytest.raises(CheckpointCorruptError, match="unchanged block carries data"):
        _encode.decode_block(_encode.SAME, memoryview(b"abc"), out, 4, "tensor 'x'")


_train = train_steps


def _saves(root, config, n=6):
    """n full saves with training between, at a fine-tune's small learning rate (where a delta pays: see
    _encode.MARGIN); returns the states at each step."""
    model, opt = trained()
    for g in opt.param_groups:
        g["lr"] = 1e-6
    states = {}
    with layerckpt.Checkpointer(root, model, opt, config=config) as ck:
        for step in range(1, n + 1):
            _train(model, opt, seed=step)
            ck.save(step).wait()
            states[step] = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    return states


def _manifest(root, step):
    with open(os.path.join(root, "manifests", f"step-{step:08d}.json")) as f:
        return json.load(f)


def _check_restore(root, states, step):
    model, opt = trained(seed=1)
    report = layerckpt.restore(root, model, opt, step=step)
    assert report.step == step
    ref_model, _ = trained(seed=1)
    ref_model.load_state_dict(states[step][0])
    assert_same_state(model, ref_model)
    assert_same_optimizer_state(opt.state_dict(), states[step][1])


def test_full_saves_are_deltas_restored_bit_for_bit_and_smaller(tmp_path):
    states = _saves(tmp_path, layerckpt.Config(encoding="delta", full=True, keep_last=0, delta_chain=3))
    for step in states:
        _check_restore(tmp_path, states, step)
    sizes = {s: sum(f["size"] for f in _manifest(tmp_path, s)["files"].values() if f["step"] == s) for s in states}
    m1 = _manifest(tmp_path, 1)
    raw = sum(t["nbytes"] for t in m1["tensors"].values())
    assert all(sizes[s] < raw for s in states), (sizes, raw)
    # chains: the first save is self-contained; each delta refers straight to a self-contained version at most
    # delta_chain versions back; then the tensor is written self-contained again
    assert m1["version"] == 5 and all(t["enc"]["ref"] is None for t in m1["tensors"].values())
    for s in (2, 3, 4, 6):
        m = _manifest(tmp_path, s)
        refs = {t["enc"]["ref"]["step"] for t in m["tensors"].values() if t["enc"]["ref"]}
        assert refs and all(s - r <= 3 for r in refs), (s, refs)
        for t in m["tensors"].values():
            if t["enc"]["ref"]:
                assert t["enc"]["ref"]["file"] in m["files"]  # retention and the tiers keep what a delta needs
                assert all(b[3] in (0, 1) for b in t["enc"]["ref"]["blocks"])  # a reference is self-contained
    # at most delta_chain deltas per reference: after 3, step 5 renews every reference still in use since step 1
    assert all(t["enc"]["ref"] is None or t["enc"]["ref"]["step"] > 1 for t in _manifest(tmp_path, 5)["tensors"].values())


def test_encoded_data_file_is_valid_safetensors(tmp_path):
    model, opt = trained()
    with layerckpt.Checkpointer(tmp_path, model, opt, config=layerckpt.Config(encoding="delta")) as ck:
        p = ck.save(3).wait()
    path = tmp_path / "data" / "step-00000003.rank0.safetensors"
    assert os.path.getsize(path) == p.bytes_written
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert (8 + header_len) % 4096 == 0
    with safe_open(str(path), "pt") as f:
        assert f.metadata()["encoding"] == _encode.CODEC
        total = sum(f.get_tensor(k).numel() for k in f.keys())
        assert all(f.get_tensor(k).dtype == torch.uint8 for k in f.keys())
    assert 8 + header_len + total == os.path.getsize(path)


@pytest.mark.parametrize("encoding", ["compress", "off"])
def test_other_encodings_are_self_contained(tmp_path, encoding):
    states = _saves(tmp_path, layerckpt.Config(full=True, keep_last=0, encoding=encoding), n=3)
    _check_restore(tmp_path, states, 3)
    m = _manifest(tmp_path, 3)
    assert list(m["files"]) == ["step-00000003.rank0.safetensors"]
    for t in m["tensors"].values():
        assert (t["enc"] is None) == (encoding == "off")
        assert t["enc"] is None or t["enc"]["ref"] is None


def test_retention_keeps_the_references_kept_composites_need(tmp_path):
    states = _saves(tmp_path, layerckpt.Config(encoding="delta", full=True, keep_last=1, delta_chain=8), n=5)
    assert sorted(os.listdir(tmp_path / "manifests")) == ["step-00000005.json"]
    m = _manifest(tmp_path, 5)
    refs = {t["enc"]["ref"]["file"] for t in m["tensors"].values() if t["enc"]["ref"]}
    assert refs and "step-00000005.rank0.safetensors" not in refs  # older files its deltas read
    assert sorted(os.listdir(tmp_path / "data")) == sorted(refs | {"step-00000005.rank0.safetensors"}) == sorted(
        m["files"])
    _check_restore(tmp_path, states, 5)


def test_a_damaged_reference_names_every_checkpoint_that_needs_it(tmp_path, capsys):
    from layerckpt.cli import main

    _saves(tmp_path, layerckpt.Config(encoding="delta", full=True, keep_last=0, delta_chain=8), n=3)
    path = tmp_path / "data" / "step-00000001.rank0.safetensors"
    m = _manifest(tmp_path, 3)
    big = next(t for t in m["tensors"].values() if t["enc"]["ref"])
    off, n = big["enc"]["ref"]["blocks"][0][:2]
    with open(path, "r+b") as f:
        f.seek(off + n // 2)
        byte = f.read(1)
        f.seek(off + n // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    model, opt = trained()
    with pytest.raises(CheckpointCorruptError, match="step-00000001"):
        layerckpt.restore(tmp_path, model, opt, step=3)
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert ("DAMAGED step-00000001.rank0.safetensors: needed by 3 checkpoint(s): step-00000001.json, "
            "step-00000002.json, step-00000003.json") in out


def test_a_failed_save_leaves_no_reference_behind(tmp_path):
    model, opt = trained()
    config = layerckpt.Config(encoding="delta", full=True, keep_last=0, delta_chain=8)
    with layerckpt.Checkpointer(tmp_path, model, opt, config=config) as ck:
        ck.save(1).wait()
        _train(model, opt, seed=2)
        ck.save(2).wait()

        def boom():
            raise OSError(5, "injected")

        _faults.install("flush.written", boom)
        try:
            _train(model, opt, seed=3)
            with pytest.raises(CheckpointError):
                ck.save(3).wait()
        finally:
            _faults.remove("flush.written")
        _train(model, opt, seed=4)
        ck.save(4).wait()
        want = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    _check_restore(tmp_path, {4: want}, 4)


def test_version_1_manifests_still_read(tmp_path):
    states = _saves(tmp_path, layerckpt.Config(full=True, keep_last=0, encoding="off"), n=2)
    path = tmp_path / "manifests" / "step-00000002.json"
    m = json.loads(path.read_text())
    m["version"] = 1
    for t in m["tensors"].values():
        del t["enc"]
    path.write_text(json.dumps(m))
    _check_restore(tmp_path, states, 2)


def test_an_edited_encoding_is_refused_by_name(tmp_path):
    _saves(tmp_path, layerckpt.Config(encoding="delta", full=True, keep_last=0), n=2)
    path = tmp_path / "manifests" / "step-00000002.json"
    m = json.loads(path.read_text())
    key, t = next((k, t) for k, t in m["tensors"].items() if t["enc"]["ref"])
    t["enc"]["blocks"][0][2] += 4  # blocks no longer cover the tensor
    path.write_text(json.dumps(m))
    model, opt = trained()
    with pytest.raises(CheckpointCorruptError, match="blocks .* cover"):
        layerckpt.restore(tmp_path, model, opt, step=2)
    t["enc"]["blocks"][0][2] -= 4
    t["enc"]["ref"]["file"] = "step-00000009.rank0.safetensors"  # a file the manifest does not list
    path.write_text(json.dumps(m))
    with pytest.raises(CheckpointCorruptError, match="malformed reference"):
        layerckpt.restore(tmp_path, model, opt, step=2)


def test_native_and_python_planes_agree(monkeypatch):
    require_native("the native byte planes")
    g = torch.Generator().manual_seed(3)
    # sizes off the native loops' 16 elements (their scalar tails), and a start off any vector alignment
    for dtype, n, skip in ((torch.float32, 4096, 0), (torch.bfloat16, 4096, 0), (torch.float64, 4096, 0),
                           (torch.uint8, 4096, 0), (torch.float32, 4109, 1), (torch.float16, 1037, 3),
                           (torch.float32, 5, 0), (torch.bfloat16, 15, 1)):
        a = _bits((torch.randn(n + skip, generator=g) * 100).to(dtype)[skip:])
        b = _bits((torch.randn(n + skip, generator=g) * 100).to(dtype)[skip:])
        es = a.size // n
        native = [_planes.plane_bytes(a, ref, es) for ref in (None, b)]
        monkeypatch.setattr(_planes, "_NATIVE", None)
        python = [_planes.plane_bytes(a, ref, es) for ref in (None, b)]
        monkeypatch.undo()
        for (x, anyx), (y, anyy) in zip(native, python):
            assert np.array_equal(x, y) and anyx == anyy
        for add, start in ((False, np.zeros_like(a)), (True, b.copy())):
            outs = []
            for native_on in (True, False):
                if not native_on:
                    monkeypatch.setattr(_planes, "_NATIVE", None)
                out = start.copy()
                _planes.from_planes(python[1 if add else 0][0], out, es, add)
                outs.append(out)
                monkeypatch.undo()
            assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], a)


def test_a_buffer_of_unchanged_blocks_only_is_recorded(tmp_path):
    """Every block of a staging buffer unchanged: nothing of it is written, yet each block is recorded."""
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256, bias=False) for _ in range(4)])
    want = copy.deepcopy(model.state_dict())
    config = layerckpt.Config(encoding="delta", full=True, keep_last=0, chunk_bytes=64 * 1024)
    with layerckpt.Checkpointer(tmp_path, model, config=config) as ck:
        ck.save(1).wait()
        p = ck.save(2).wait()
    assert p.bytes_written < 64 * 1024  # the header and the small state
    out = torch.nn.Sequential(*[torch.nn.Linear(256, 256, bias=False) for _ in range(4)])
    layerckpt.restore(tmp_path, out, step=2)
    for k, v in out.state_dict().items():
        assert torch.equal(v, want[k])


def test_base_every_writes_self_contained_composites_in_full_mode(tmp_path):
    from layerckpt.format._manifest import load_manifest
    from layerckpt.tiers._tiers import is_base

    _saves(tmp_path, layerckpt.Config(encoding="delta", full=True, keep_last=0, base_every=2, delta_chain=100), n=5)
    bases = [s for s in range(1, 6) if is_base(load_manifest(str(tmp_path / "manifests" / f"step-{s:08d}.json")))]
    assert bases == [1, 3, 5]
    for s in bases:
        assert list(_manifest(tmp_path, s)["files"]) == [f"step-{s:08d}.rank0.safetensors"]


def test_no_reference_copy_is_kept_for_a_frozen_layer(tmp_path):
    def held(freeze: bool, root) -> int:
        model, opt = trained()
        if freeze:
            for p in model.h[0].parameters():
                p.requires_grad_(False)
        with layerckpt.Checkpointer(root, model, opt, config=layerckpt.Config(encoding="delta", keep_last=0)) as ck:
            ck.save(1).wait()
            return ck._flusher.refs.memory_bytes

    model, _ = trained()
    weights = sum(p.numel() * p.element_size() for p in model.h[0].parameters() if p.numel() * 4 >= 65536)
    assert weights > 0
    # the frozen block's weights (and the optimizer state the block still had) get no host copy
    assert held(True, tmp_path / "frozen") <= held(False, tmp_path / "all") - weights


def test_a_restore_reads_only_the_reference_blocks_its_deltas_need(tmp_path):
    from layerckpt.read._encread import _runs
    from layerckpt.format._manifest import load_manifest

    _saves(tmp_path, layerckpt.Config(encoding="delta", full=True, keep_last=0), n=2)
    m = load_manifest(str(tmp_path / "manifests" / "step-00000002.json"))
    for k, e in m.tensors.items():
        own, refs = _runs(k, e)
        if e.enc["ref"] is None:
            assert refs == []
            continue
        need = {pos for b, pos in own[2] if b[3] in (_encode.DELTA, _encode.SAME)}
        got = {pos for _, _, placed in refs for _, pos in placed}
        assert need <= got and got <= {pos for _, pos in own[2]}  # the same block cuts: exactly those needed
        assert need == got


def test_a_save_that_waits_for_the_previous_one_stops_its_encoding(tmp_path):
    """Training never waits for the encoder: a save() that must wait for the save flushing (max_inflight=1)
    makes the rest of that one go to disk unencoded, and both restore bit for bit."""
    import threading

    from layerckpt.write import _encwrite

    real = _encwrite.encode_chunk
    holding = [True]

    def slow(s, blocks, layout, plan, hurry=None):
        if holding[0]:  # the encoder is slow: the first save encodes nothing until the next save() waits for it
            assert hurry.wait(30)
            holding[0] = False
        return real(s, blocks, layout, plan, hurry)

    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    config = layerckpt.Config(encoding="delta", full=True, keep_last=0, chunk_bytes=64 * 1024, lazy_staging=False)
    with layerckpt.Checkpointer(tmp_path, model, config=config) as ck:
        _encwrite.encode_chunk = slow
        try:
            first = ck.save(1)
            want1 = copy.deepcopy(model.state_dict())
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            second = ck.save(2)  # waits for the first: hurries it
        finally:
            _encwrite.encode_chunk = real
        first.wait()
        second.wait()
        want2 = copy.deepcopy(model.state_dict())
    assert first.unencoded > 0 and second.unencoded == 0
    for step, want in ((1, want1), (2, want2)):
        out = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
        layerckpt.restore(tmp_path, out, step=step)
        for k, v in out.state_dict().items():
            assert torch.equal(v, want[k]), (step, k)


def test_a_reference_no_block_read_stays_kept_for_the_saves_after(tmp_path):
    """A save whose blocks all went self-contained (its change too big for a delta to pay) still lists its
    reference, so keep_last=1 keeps that file while it is the reference the next save may encode against."""
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256, bias=False) for _ in range(2)])
    config = layerckpt.Config(encoding="delta", full=True, keep_last=1, delta_chain=8)
    with layerckpt.Checkpointer(tmp_path, model, config=config) as ck:
        ck.save(1).wait()
        first = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p))  # everything changes: no delta pays
        ck.save(2).wait()
        assert "step-00000001.rank0.safetensors" in os.listdir(tmp_path / "data")  # still the reference
        with torch.no_grad():
            for p, q in zip(model.parameters(), first):
                p.copy_(q * (1 + 1e-7))  # close to step 1 again: deltas against the step-1 reference pay
        ck.save(3).wait()
        want = copy.deepcopy(model.state_dict())
    out = torch.nn.Sequential(*[torch.nn.Linear(256, 256, bias=False) for _ in range(2)])
    layerckpt.restore(tmp_path, out)
    for k, v in out.state_dict().items():
        assert torch.equal(v, want[k])


def test_a_tensor_whose_deltas_do_not_pay_is_not_encoded_twice_every_save(tmp_path):
    """Random changes every save: after a delta that paid for no block the tensor is written self-contained
    (a fresh reference) for 2, then 4 writes before the next try, not delta-encoded and then re-encoded."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False))
    config = layerckpt.Config(encoding="delta", full=True, keep_last=0, delta_chain=8)
    with layerckpt.Checkpointer(tmp_path, model, config=config) as ck:
        for step in range(1, 10):
            with torch.no_grad():
                model[0].weight.copy_(torch.randn(256, 256))
            ck.save(step).wait()
    tried = [s for s in range(1, 10) if _manifest(tmp_path, s)["tensors"]["model/0.weight"]["enc"]["ref"]]
    assert tried == [2, 5], tried  # 1: the first; 2: a try, no block paid; 3-4 skipped; 5: a try; 6-9 skipped
