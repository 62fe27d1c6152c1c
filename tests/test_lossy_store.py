"""Config(encoding='lossy') through the store: every element within its code's bound of the saved state, at every
step (errors never add up: each delta refers to a lossless reference), what no code fits stays lossless, the
error is recorded and reported, damage is refused."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import layerckpt
from layerckpt.format import _encode, _entries, _qblock
from conftest import require_native

QUANTUM = 2.0
GROUP = 2048


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128))


def _train(model, opt, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 128, generator=g)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def _saves(root, n=6, config=None, poison=None):
    """A save after every step of an AdamW run; returns each step's (model, optimizer) state as saved."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = config or layerckpt.Config(encoding="lossy", full=True, keep_last=0, delta_chain=3)
    states = {}
    with layerckpt.Checkpointer(root, model, opt, config=cfg) as ck:
        for step in range(1, n + 1):
            _train(model, opt, step)
            if poison is not None and step == n:
                poison(model)
            ck.save(step).wait()
            states[step] = ({k: v.clone() for k, v in model.state_dict().items()},
                            {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()})
    return states


def _manifest(root, step):
    with open(os.path.join(root, "manifests", f"step-{step:08d}.json")) as f:
        return json.load(f)


def _restored(root, step):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    report = layerckpt.restore(root, model, opt, step=step)
    return model.state_dict(), opt.state_dict()["state"], report


def _blocks(entry):
    """(raw start in elements, elements, mode) of each block of an entry."""
    out, pos = [], 0
    for _, _, rlen, mode in entry["enc"]["blocks"]:
        out.append((pos // 4, rlen // 4, mode))
        pos += rlen
    return out


def _check_weight(entry, saved, ref, got, steps):
    """Each element of a bounded-loss delta block within half of its block's quantum (one fp32 rounding more)."""
    s, r, g = (t.reshape(-1).double() for t in (saved, ref, got))
    coded = 0
    for a, n, mode in _blocks(entry):
        err = (g[a:a + n] - s[a:a + n]).abs().max().item()
        if mode == _encode.QDELTA:
            d = s[a:a + n] - r[a:a + n]
            quantum = QUANTUM * d.pow(2).mean().sqrt().item() / steps
            assert err <= quantum / 2 * (1 + 1e-5) + 2 * np.spacing(np.float32(s[a:a + n].abs().max().item()))
            coded += 1
        else:
            assert err == 0.0, f"a lossless block ({mode}) restored {err} off"
    return coded


def _check_moment(entry, saved, got, bits):
    s, g = saved.reshape(-1).double(), got.reshape(-1).double()
    levels = 2 ** (bits - 1) - 1
    for a, n, mode in _blocks(entry):
        assert mode == _encode.QMOM
        group = _qblock.group_of(mode, bits, n)  # elements per scale
        for j in range(a, a + n, group):
            part = slice(j, min(j + group, a + n))
            assert (g[part] - s[part]).abs().max() <= s[part].abs().max() / (2 * levels) * (1 + 1e-6)


def _check_sq(entry, saved, got, bits):
    """In bit patterns: each non-zero value within half a step of its group's range spread over the 2 ** bits - 2
    steps between its codes; zeros exact.  The same bound where the codes are told against the reference's
    (QSQREF): the reference predicts them, its error never adds to theirs.  Returns the blocks told so."""
    s, g = saved.reshape(-1).numpy().view(np.int32).astype(np.int64), got.reshape(-1).numpy().view(np.int32)
    told = 0
    for a, n, mode in _blocks(entry):
        assert mode in (_encode.QSQ, _encode.QSQREF)
        told += mode == _encode.QSQREF
        for j in range(a, a + n, GROUP):
            part = s[j:min(j + GROUP, a + n)]
            nz = part > 0
            step = max(1, math.ceil((part[nz].max() - part[nz].min()) / (2 ** bits - 2))) if nz.any() else 1
            diff = np.abs(g[j:j + part.size].astype(np.int64) - part)
            assert (diff[nz] <= step // 2 + 1).all() and (diff[~nz] == 0).all()
    if told:
        assert all(b[3] == _encode.QSQ for b in entry["enc"]["ref"]["blocks"]), "its reference is self-contained"
    return told


@pytest.mark.parametrize("bits", [4, 8])
def test_every_restore_is_within_each_codes_bound_and_errors_never_add_up(tmp_path, bits):
    states = _saves(tmp_path, config=layerckpt.Config(encoding="lossy", full=True, keep_last=0, delta_chain=3,
                                                      lossy_bits=bits))
    coded = told = 0
    for step in states:
        m = _manifest(tmp_path, step)
        modes = {b[3] for e in m["tensors"].values() if e.get("enc") for b in e["enc"]["blocks"]}
        assert m["version"] == (6 if _encode.QSQREF in modes else 5)  # a reader of 5 says "upgrade", not "damaged"
        assert _entries._QSQREF_MODE == _encode.QSQREF  # the manifest's own copy of the mode number
        model, opt, report = _restored(tmp_path, step)
        saved_model, saved_opt = states[step]
        for name in ("0.weight", "2.weight", "0.bias", "2.bias"):  # biases of 1 KiB and 512 bytes: coded too
            e = m["tensors"][f"model/{name}"]
            ref = e["enc"]["ref"]
            if ref is None or e["enc"].get("lossy") is None:  # a self-contained version: a lossless reference
                assert "lossy" not in e["enc"] and torch.equal(model[name], saved_model[name])
                continue
            assert all(b[3] in (_encode.RAW, _encode.PLANES) for b in ref["blocks"]), "a reference is lossless"
            coded += _check_weight(e, saved_model[name], states[ref["step"]][0][name], model[name],
                                   step - ref["step"])
            assert 0.3 < report.quantization[name.split(".")[0]] <= QUANTUM / 2 * 1.01  # within half a quantum
        for i, w in enumerate(("0.weight", "0.bias", "2.weight", "2.bias")):
            _check_moment(m["tensors"][f"optim/{w}/exp_avg"], saved_opt[i]["exp_avg"], opt[i]["exp_avg"], bits)
            told += _check_sq(m["tensors"][f"optim/{w}/exp_avg_sq"], saved_opt[i]["exp_avg_sq"],
                              opt[i]["exp_avg_sq"], bits)
            assert torch.equal(opt[i]["step"], saved_opt[i]["step"])
    assert coded >= 6  # the weights of most saves were coded with loss, not left lossless
    assert told >= 4  # second moments told against their reference's codes, where that was smaller
    out = subprocess.run([sys.executable, "-m", "layerckpt.cli", "verify", str(tmp_path)], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    out = subprocess.run([sys.executable, "-m", "layerckpt.cli", "inspect", str(tmp_path)], capture_output=True,
                         text=True)
    assert "bounded loss" in out.stdout and "model/0.weight" in out.stdout and "qdelta" in out.stdout


def test_lossy_writes_fewer_bytes_than_delta_and_the_default_stays_lossless(tmp_path):
    sizes = {}
    for enc in ("lossy", "delta", "auto"):
        root = tmp_path / enc
        states = _saves(root, n=3, config=layerckpt.Config(encoding=enc, full=True, keep_last=0, delta_chain=8))
        m = _manifest(root, 3)
        sizes[enc] = m["files"][f"step-00000003.rank0.safetensors"]["size"]
        lossy = [k for k, e in m["tensors"].items() if (e.get("enc") or {}).get("lossy")]
        model, _, report = _restored(root, 3)
        if enc == "lossy":
            assert {"model/0.weight", "optim/0.weight/exp_avg", "optim/0.weight/exp_avg_sq"} <= set(lossy)
        else:
            assert lossy == [] and report.quantization == {}
            assert all(torch.equal(model[k], v) for k, v in states[3][0].items())
    assert sizes["lossy"] * 2.5 < sizes["delta"], sizes


def test_what_no_code_fits_stays_lossless(tmp_path):
    def poison(model):
        with torch.no_grad():
            model[0].weight[3, 5] = float("nan")
            model[2].weight[0, 0] = float("inf")

    states = _saves(tmp_path, n=3, poison=poison)
    m = _manifest(tmp_path, 3)
    model, _, _ = _restored(tmp_path, 3)
    for name in ("0.weight", "2.weight"):
        e = m["tensors"][f"model/{name}"]
        assert not any(b[3] in _encode.LOSSY for b in e["enc"]["blocks"]) and "lossy" not in e["enc"]
        assert torch.equal(model[name].isnan(), states[3][0][name].isnan())
        ok = ~states[3][0][name].isnan()
        assert torch.equal(model[name][ok], states[3][0][name][ok])


def _lossy_block(root, step, key, mode):
    e = _manifest(root, step)["tensors"][key]
    off, n, _, m = next(b for b in e["enc"]["blocks"] if b[3] == mode)
    return os.path.join(root, "data", e["file"]), off, n


@pytest.mark.parametrize("where,message", [("header", "header is malformed"), ("codes", "damaged")])
def test_a_damaged_bounded_loss_block_is_refused(tmp_path, where, message):
    _saves(tmp_path, n=3)
    path, off, n = _lossy_block(tmp_path, 3, "model/0.weight", _encode.QDELTA)
    with open(path, "r+b") as f:
        f.seek(off if where == "header" else off + n - 8)
        b = f.read(1)
        f.seek(off if where == "header" else off + n - 8)
        f.write(bytes([3 if where == "header" else b[0] ^ 0x5A]))
    with pytest.raises(layerckpt.CheckpointCorruptError, match=message):
        _restored(tmp_path, 3)
    _restored(tmp_path, 2)  # an earlier step stays restorable


@pytest.mark.parametrize("change,message", [
    (lambda t: t["model/0.weight"]["enc"]["lossy"].update(code="bogus"), "malformed record of its bounded-loss"),
    (lambda t: t["model/0.weight"]["enc"]["lossy"].update(max_err=float("nan")), "malformed record"),
    (lambda t: t["rng/torch"]["enc"]["blocks"][0].__setitem__(3, _encode.QMOM), "only fp32 tensors"),
])
def test_a_manifest_that_misstates_bounded_loss_is_refused_by_name(tmp_path, change, message):
    _saves(tmp_path, n=3)
    path = os.path.join(tmp_path, "manifests", "step-00000003.json")
    with open(path) as f:
        d = json.load(f)
    change(d["tensors"])
    with open(path, "w") as f:
        f.write(json.dumps(d).replace("NaN", "1e999"))
    with pytest.raises(layerckpt.CheckpointCorruptError, match=message):
        _restored(tmp_path, 3)


@pytest.mark.parametrize("field,value,message", [
    ("lossy_bits", 6, "lossy_bits must be 4 or 8"), ("lossy_quantum", 0.0, "lossy_quantum must be above 0"),
    ("encoding", "lossless", "encoding must be one of"),
])
def test_lossy_settings_are_checked(field, value, message):
    with pytest.raises(layerckpt.ConfigError, match=message):
        layerckpt.Config(**{field: value})


def test_four_bit_moments_write_fewer_bytes(tmp_path):
    sizes = {}
    for bits in (8, 4):
        root = tmp_path / str(bits)
        _saves(root, n=2, config=layerckpt.Config(encoding="lossy", lossy_bits=bits, full=True, keep_last=0))
        e = _manifest(root, 2)["tensors"]["optim/0.weight/exp_avg"]
        sizes[bits] = sum(b[1] for b in e["enc"]["blocks"])
        assert e["enc"]["lossy"]["code"] == "qmom"
    assert sizes[4] < 0.7 * sizes[8], sizes


def test_the_codes_error_is_priced_inside_the_fidelity_allowance():
    from layerckpt.select import _policy as policy

    layers = {n: policy.LayerState(drift=0.1, age=1, nbytes=1000, frozen=False, cost=0.3, progress=1.0)
              for n in ("a", "b")}
    layers["f"] = policy.LayerState(drift=0.0, age=1, nbytes=1000, frozen=True, cost=0.0, progress=5.0,
                                     unchanged=True)
    # an RMS error of 2/sqrt(12) steps' move over 4 elements: that over sqrt(4) of one step's progress (a quarter
    # of the interval's), for each unfrozen layer
    n = {"a": 4, "b": 4, "f": 1}
    assert policy.quantization_cost(layers, 2.0, 4, n) == pytest.approx(2 * (2 / 12 ** 0.5) / 2 * 1.0 / 4)
    kw = dict(first=False, base_due=False, max_staleness=10, fidelity=0.1, loss=10.0)  # an allowance of 1.0
    assert set(policy.decide(layers, **kw).values()) == {policy.SKIP_BUDGET, policy.SKIP_FROZEN}
    reserved = policy.quantization_cost(layers, 12 ** 0.5, 1, {"a": 1, "b": 1})  # one step's progress each: 2.0
    assert reserved == pytest.approx(2.0)
    reasons = policy.decide(layers, **kw, reserved=reserved)  # 2.0 of the 1.0
    assert reasons["a"] == reasons["b"] == policy.COST


@pytest.mark.parametrize("encoding", ["auto", "lossy"])
def test_a_lossy_composite_states_the_codes_price_in_its_cost(tmp_path, encoding):
    """Every layer written at every save: the composite gives up nothing to staleness, and under 'lossy' the
    codes' price alone."""
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with layerckpt.Checkpointer(tmp_path, model, opt, config=layerckpt.Config(encoding=encoding, fidelity=0.0)) as ck:
        for step in range(1, 4):
            _train(model, opt, step)
            ck.save(step, loss=1.0).wait()
        m = ck.selector.composite
    assert all(layer.step == 3 for layer in m.layers.values())
    assert (m.cost > 0) == (encoding == "lossy")


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("steps,layout", [(400, "SPLIT"), (40000, "PLANES")])
def test_wide_delta_codes_go_split_or_as_byte_planes_and_decode_bit_for_bit(monkeypatch, native, steps, layout):
    """A reference 400 steps old: codes of hundreds of quanta, 2 bytes wide, their zigzag map split at 4 bits
    (SPLIT), smaller than its byte planes and than the codes compressed as they are.  Codes 100 times wider
    (quanta measured over 40,000 steps) pass what a split holds: byte planes.  Native and numpy planes decode
    alike."""
    from layerckpt.format import _planes
    from layerckpt.format._zstd import codes_compressor

    if not native:
        monkeypatch.setattr(_planes, "_NATIVE", None)
    g = np.random.default_rng(5)
    ref = g.standard_normal(1 << 16).astype(np.float32)
    x = (ref + 1e-4 * np.cumsum(g.standard_normal((400, ref.size), dtype=np.float32), axis=0)[-1]
         + 3e-3 * g.standard_normal(ref.size, dtype=np.float32)).astype(np.float32)
    mode, data, restored, emax, _, _ = _qblock.encode("qdelta", x.view(np.uint8), ref.view(np.uint8), QUANTUM, steps,
                                                      8)
    width, got, glog, _, step = _qblock.HEAD.unpack_from(data)
    assert glog == 0
    assert (mode, width, got) == (_encode.QDELTA, 2 if layout == "SPLIT" else 4, getattr(_qblock, layout))
    codes = np.rint((x - ref) / np.float32(step)).astype(np.int32)
    assert len(data) < _qblock.HEAD.size + len(codes_compressor().compress(codes.astype(f"i{width}").tobytes()))
    planes = codes_compressor().compress(_qblock._zigzag_planes(codes.astype(f"i{width}")).data)
    as_planes = _qblock.HEAD.size + len(planes)
    assert len(data) < as_planes if layout == "SPLIT" else len(data) == as_planes
    out = ref.copy().view(np.uint8)
    _qblock.decode(mode, memoryview(data), out, "test")
    assert np.array_equal(out, restored) and emax <= step / 2 * (1 + 1e-5) + 2 * np.spacing(np.float32(10))
    assert np.array_equal(out.view(np.float32), ref + np.float32(step) * codes.astype(np.float32))
    if layout == "SPLIT":  # a damaged part table is refused by name
        bad = bytearray(data)
        bad[_qblock.HEAD.size] ^= 0x40
        with pytest.raises(layerckpt.CheckpointCorruptError, match="split block"):
            _qblock.decode(mode, memoryview(bytes(bad)), ref.copy().view(np.uint8), "test")


def _numpy_and_native(monkeypatch, fn):

    require_native("the native bounded-loss codes")
    native = fn()
    monkeypatch.setattr(_qblock, "_NATIVE", None)
    python = fn()
    monkeypatch.undo()
    return native, python


def _moments(g):
    """fp32 moments a block may hold: values over many octaves, -0.0, subnormals, a group of zeros and
    subnormals only (a momentum decayed for hundreds of steps: its scale's reciprocal would overflow), a count
    of elements that is not whole groups and odd."""
    n = 3 * GROUP + 1001
    m = (g.standard_normal(n) * np.exp(g.uniform(-20, 2, n))).astype(np.float32)
    m[GROUP:2 * GROUP] = 0.0
    m[5::97] = -0.0
    m[7::101] = np.float32(1e-42)
    return m


@pytest.mark.parametrize("bits", [8, 4])
def test_native_and_numpy_moment_codes_agree_bit_for_bit(monkeypatch, bits):

    g = np.random.default_rng(11)
    for code, x in (("qmom", _moments(g)), ("qsq", np.abs(_moments(g)) ** 2)):
        x = x.astype(np.float32)
        native, python = _numpy_and_native(monkeypatch, lambda: _qblock.encode(code, x.view(np.uint8), None, 2.0, 1,
                                                                              bits))
        assert native[0] == python[0] and native[1] == python[1], code
        assert np.array_equal(native[2], python[2]), code
        assert np.allclose(native[3:], python[3:], rtol=1e-3, atol=0), code
        out = np.empty(x.nbytes, np.uint8)
        _qblock.decode(native[0], memoryview(native[1]), out, "test")
        assert np.array_equal(out, native[2])
    for code, bad in (("qmom", np.inf), ("qmom", np.nan), ("qsq", -1e-30), ("qsq", np.nan), ("qsq", np.inf)):
        x = np.abs(_moments(g))
        x[GROUP + 3] = bad
        assert _numpy_and_native(monkeypatch, lambda: _qblock.encode(code, x.view(np.uint8), None, 2.0, 1, bits)) \
            == (None, None), (code, bad)


@pytest.mark.parametrize("bits", [8, 4])
def test_second_moments_told_against_their_reference_restore_their_own_codes(monkeypatch, bits):
    """QSQREF: the same values restored as QSQ's, in fewer bytes, native and numpy alike; whatever the reference
    holds (negative, NaN, inf, zeros: it only predicts the codes), and decoded by either path."""
    g = np.random.default_rng(5)
    ref = np.abs(_moments(g)) ** 2
    x = (ref * np.float32(1.02) + np.abs(_moments(g)).astype(np.float32) ** 2 * np.float32(1e-3)).astype(np.float32)
    hostile = ref.copy()
    hostile[3::13], hostile[4::17], hostile[6::19] = -1.0, np.nan, np.inf
    own = _qblock.encode("qsq", x.view(np.uint8), None, 2.0, 1, bits)
    for r, told in ((ref, True), (hostile, None)):
        native, python = _numpy_and_native(monkeypatch, lambda: _qblock.encode("qsq", x.view(np.uint8),
                                                                              r.view(np.uint8), 2.0, 1, bits))
        assert native[0] == python[0] and native[1] == python[1]
        assert np.array_equal(native[2], own[2]), "the values restored are the codes' own, as QSQ's"
        if told:
            assert native[0] == _qblock.QSQREF and len(native[1]) < 0.8 * len(own[1]), (len(native[1]), len(own[1]))
        if native[0] != _qblock.QSQREF:
            continue
        for path in ("native", "numpy"):
            if path == "numpy":
                monkeypatch.setattr(_qblock, "_NATIVE", None)
            out = r.copy().view(np.uint8)  # a restore puts the reference's bytes where the block decodes
            _qblock.decode(_qblock.QSQREF, memoryview(native[1]), out, "test")
            monkeypatch.undo()
            assert np.array_equal(out, own[2]), path
    out = np.zeros(x.nbytes, np.uint8)  # another reference: other values, not an error (the checksum tells)
    _qblock.decode(_qblock.QSQREF, memoryview(_qblock.encode("qsq", x.view(np.uint8), ref.view(np.uint8), 2.0, 1,
                                                             bits)[1]), out, "test")
    assert not np.array_equal(out, own[2])


def test_native_delta_codes_are_numpys_and_decode_to_what_they_checksum(monkeypatch):
    """The native kernel's codes, for one quantum, are rint((x - r) / step) and restore r + step * code as the
    decoder does (a reference's -0.0 included); codes of 2^22 quanta and more take its exact path; 2^24 and
    more, or NaN, do not fit."""

    require_native("the native bounded-loss codes")
    g = np.random.default_rng(12)
    n = 3 * GROUP + 7
    r = g.standard_normal(n).astype(np.float32)
    r[::13] = -0.0
    x = (r + g.standard_normal(n).astype(np.float32) * 1e-3).astype(np.float32)
    x[::13] = np.float32(-1e-9)  # rounds to code -0: restored must be +0.0, as decoded
    for step, big in ((np.float32(3e-4), None), (np.float32(1e-9), 5_000_000.0), (np.float32(1e-9), 2.0 ** 24)):
        xx = x.copy()
        if big is not None:
            xx[100] = r[100] + np.float32(big) * step
        codes, restored = np.empty(n, np.int32), np.empty(n, np.float32)
        got = _qblock._NATIVE.qdelta(xx, r, float(step), codes, restored)
        want = np.rint((xx - r) / step)
        if big == 2.0 ** 24:
            assert got is None
            continue
        assert np.array_equal(codes, want.astype(np.int32))
        assert np.array_equal(restored.view(np.int32), (r + step * codes.astype(np.float32)).view(np.int32))
        assert got[0] == np.abs(want).max()
    xx = x.copy()
    xx[3] = np.nan
    assert _qblock._NATIVE.qdelta(xx, r, 1e-3, np.empty(n, np.int32), np.empty(n, np.float32)) is None
    assert _qblock._NATIVE.qdelta_ss(xx, r) is None
    for native in (True, False):  # each encoder's block decodes to the bytes it checksums, -0.0 references too
        if not native:
            monkeypatch.setattr(_qblock, "_NATIVE", None)
        mode, data, restored, _, _, _ = _qblock.encode("qdelta", x.view(np.uint8), r.view(np.uint8), 2.0, 3, 8)
        out = r.copy().view(np.uint8)
        _qblock.decode(mode, memoryview(data), out, "test")
        assert np.array_equal(out, restored), native


def test_which_tensors_are_coded_with_loss():
    """fp32 training state of 512 bytes and more, by role; smaller tensors, other dtypes and frozen layers stay
    lossless ('delta')."""
    from layerckpt.write._flush import _lossy_mode

    f32, f16 = torch.zeros(1, dtype=torch.float32), torch.zeros(1, dtype=torch.float16)
    assert _lossy_mode("model/0.weight", f32, 512, False) == "qdelta"
    assert _lossy_mode("model/0.weight", f32, 508, False) == "delta"
    assert _lossy_mode("model/0.weight", f32, 1 << 20, True) == "delta"
    assert _lossy_mode("model/0.weight", f16, 1 << 20, False) == "delta"
    assert _lossy_mode("optim/0.weight/exp_avg", f32, 512, False) == "qmom"
    assert _lossy_mode("optim/0.weight/exp_avg_sq", f32, 512, False) == "qsq"


def test_a_four_bit_moment_block_records_its_group_and_older_blocks_still_decode(monkeypatch):
    """4-bit exp_avg blocks scale every 32nd of the block, 256 elements at least, said in the header (log2: 8); a
    block of the earlier layout (0: 2,048 elements a scale) decodes as before; a group the header cannot mean is
    refused."""
    assert [_qblock.group_of(_encode.QMOM, 4, n) for n in (1000, 3072, 16384, 1 << 18)] == [256, 256, 512, 2048]
    assert _qblock.group_of(_encode.QMOM, 8, 1000) == _qblock.group_of(_encode.QSQ, 4, 1000) == 2048
    x = _moments(np.random.default_rng(13))
    mode, data, restored, _, _, _ = _qblock.encode("qmom", x.view(np.uint8), None, 2.0, 1, 4)
    assert _qblock.HEAD.unpack_from(data)[2:4] == (8, -(-x.size // 256))
    out = np.empty(x.nbytes, np.uint8)
    _qblock.decode(mode, memoryview(data), out, "test")
    assert np.array_equal(out, restored)
    for glog in (5, 12, 0):
        bad = bytearray(data)
        bad[2] = glog
        with pytest.raises(layerckpt.CheckpointCorruptError, match="header is malformed"):
            _qblock.decode(mode, memoryview(bytes(bad)), out, "test")
    monkeypatch.setattr(_qblock, "GROUP4", _qblock.GROUP)  # as blocks were written before the header said it
    old = _qblock.encode("qmom", x.view(np.uint8), None, 2.0, 1, 4)
    monkeypatch.undo()
    assert _qblock.HEAD.unpack_from(old[1])[2] == 0
    _qblock.decode(old[0], memoryview(old[1]), out, "test")
    assert np.array_equal(out, old[2])


def test_a_wandering_weights_quantum_follows_its_recent_move_and_bounds_its_error(tmp_path):
    """Selective saves (the tracker samples every element here): a weight that wanders (a random walk: after n steps
    it is only sqrt(n) steps' moves from its reference) gets the quantum of its move per step over the last
    interval, not the smaller average since its reference; the manifest records that move, and every element is
    restored within half a quantum of it."""
    model = _model()
    sigma = 1e-3
    cfg = layerckpt.Config(encoding="lossy", keep_last=0, drift_sample=0, max_staleness=1)
    saved, coded = {}, 0
    with layerckpt.Checkpointer(tmp_path, model, config=cfg) as ck:
        for step in range(1, 7):
            g = torch.Generator().manual_seed(step)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * sigma)
            ck.save(step).wait()
            saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    for step in range(3, 7):
        m = _manifest(tmp_path, step)
        got = _restored_model(tmp_path, step)
        for name in ("0.weight", "2.weight"):
            e = m["tensors"][f"model/{name}"]
            rec = (e.get("enc") or {}).get("lossy")
            if rec is None or e["file"] != f"step-{step:08d}.rank0.safetensors":
                continue
            ref = e["enc"]["ref"]
            n = step - ref["step"]
            x, r = saved[step][name].double(), saved[ref["step"]][name].double()
            recent = (x - saved[step - 1][name].double()).pow(2).mean().sqrt().item()  # one step's interval
            since = (x - r).pow(2).mean().sqrt().item() / n
            assert rec["move"] == pytest.approx(recent, rel=1e-4), (step, name)
            assert rec["move"] > 1.3 * since, (step, name, rec["move"], since)  # what a random walk makes of it
            s, q, gv = x.reshape(-1), r.reshape(-1), got[name].double().reshape(-1)
            for a, k, mode in _blocks(e):
                err = (gv[a:a + k] - s[a:a + k]).abs().max().item()
                if mode != _encode.QDELTA:
                    assert err == 0.0
                    continue
                block_since = (s[a:a + k] - q[a:a + k]).pow(2).mean().sqrt().item() / n
                bound = QUANTUM / 2 * max(block_since, rec["move"])
                assert err <= bound * (1 + 1e-5) + 2 * np.spacing(np.float32(s[a:a + k].abs().max().item()))
                assert err > 0.9 * QUANTUM / 2 * rec["move"]  # the coarser quantum was used: its errors reach half
                coded += 1
    assert coded >= 4


def _restored_model(root, step):
    model = _model()
    layerckpt.restore(root, model, step=step)
    return model.state_dict()



@pytest.mark.parametrize("recent", [math.inf, math.nan])
def test_a_move_out_of_inf_or_nan_measures_nothing(recent):
    """A weight that held inf or NaN at the save before moved an infinite (or no) amount over the last interval:
    its quantum and its manifest record come from its move since the reference, and the record stays finite
    (the manifest's reader refuses anything else)."""
    from layerckpt.write import _encwrite

    x = np.linspace(-1, 1, 4096, dtype=np.float32)
    r = x - np.float32(1e-3) * np.cos(np.arange(4096, dtype=np.float32))
    ss = float(np.sum((x.astype(np.float64) - r) ** 2))
    since = (ss / x.size) ** 0.5 / 4
    assert _qblock._step(QUANTUM, ss, x.size, 4, recent) == np.float32(QUANTUM * since)
    got = _qblock.encode("qdelta", x.view(np.uint8), r.view(np.uint8), QUANTUM, 4, 4, recent)
    assert got is not None and got[3] <= QUANTUM / 2 * since * (1 + 1e-5) + 2 * np.spacing(np.float32(1))
    rec = _encwrite._lossy_record(("qdelta", 4, recent), x.size, got[3], got[4], got[5])
    assert rec["move"] == pytest.approx(since, rel=1e-6) and all(math.isfinite(rec[k]) for k in rec if k != "code")
