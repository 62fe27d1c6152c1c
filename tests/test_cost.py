"""Config(encoding='auto'): the cost model decides per tensor kind whether encoding pays on the sink, on
measured rates; what it decided is recorded and restores bit for bit either way."""
import copy
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import layerckpt
from layerckpt.select import _cost
from conftest import assert_same_optimizer_state, assert_same_state, assert_same_tensors, train_steps, trained


def test_a_kind_is_dtype_role_frozen_and_rows():
    k = _cost.kind
    assert k("model/h.0.attn.weight", "F32") == "F32 weight"
    assert k("optim/h.0.attn.weight/exp_avg", "F32") == "F32 exp_avg"
    assert k("optim/h.0.attn.weight/exp_avg_sq", "BF16") == "BF16 exp_avg_sq"
    assert k("optim/fc.weight/momentum_buffer", "F32") == "F32 momentum"
    assert k("optim/fc.weight/step", "F32") == "F32 state"
    assert k("optim/wte.weight/exp_avg#rows=0:64", "F32") == "F32 exp_avg rows"
    assert k("model/base.weight", "BF16", frozen=True) == "BF16 weight frozen"
    assert k("rng/torch", "U8") == "U8 other"


def test_the_charge_is_the_share_of_encoder_threads_that_share_a_core_with_training():
    assert _cost.charge(True, training_threads=2, encoder_threads=1, cores=2) == 1.0  # this machine, CPU training
    assert _cost.charge(True, training_threads=3, encoder_threads=2, cores=4) == 0.5
    assert _cost.charge(True, training_threads=4, encoder_threads=2, cores=4) == 1.0
    # a GPU run drives the device from one core: 8 encoder threads on 15 idle cores cost the floor
    assert _cost.charge(False, training_threads=16, encoder_threads=8, cores=16) == _cost.FLOOR
    assert _cost.charge(True, training_threads=1, encoder_threads=1, cores=2) == _cost.FLOOR


def _sink(bandwidth: float) -> _cost.Sink:
    s = _cost.Sink("test sink")
    s.observe(int(bandwidth), 1.0)
    return s


def _model(ratio: float, gbps: float, mode: str = _cost.COMPRESS, kind: str = "F32 weight") -> _cost.CostModel:
    m = _cost.CostModel()
    raw = 1 << 20
    m.observe(kind, mode, raw, int(raw / ratio), raw / (gbps * 1e9))
    m.fold()
    return m


def test_encoding_pays_only_where_the_sink_time_saved_beats_the_cpu_charged():
    # 2x at 0.4 GB/s: 0.5 byte saved per raw byte, 2.5 ns of CPU per raw byte
    m = _model(2.0, 0.4)
    fast = m.decide("F32 weight", _sink(2e9), 1.0)  # saves 0.25 ns/B of a 2 GB/s disk: raw
    assert fast.mode == _cost.RAW and "compress 2.00x at 0.40 GB/s" in fast.why and "test sink 2 GB/s" in fast.why
    assert fast.ratio == pytest.approx(2.0)
    slow = m.decide("F32 weight", _sink(1e8), 1.0)  # saves 5 ns/B of a 100 MB/s remote: encoded
    assert slow.mode == _cost.COMPRESS
    # the CPU is charged by the share of it the training loses: on idle cores the disk wins sooner
    assert m.decide("F32 weight", _sink(3e8), 1.0).mode == _cost.RAW  # 1.67 ns/B saved vs 2.5 ns/B
    assert m.decide("F32 weight", _sink(3e8), _cost.FLOOR).mode == _cost.COMPRESS  # vs 0.625 ns/B
    # nothing measured, or no bandwidth yet: raw, and why
    assert m.decide("F32 exp_avg", _sink(1e8), 1.0).why.startswith("not measured yet")
    assert m.decide("F32 weight", _cost.Sink("new"), 1.0).why == "new bandwidth not measured yet"


def test_a_kind_starts_encoding_past_a_margin_and_stops_below_break_even():
    m = _model(2.0, 0.4)  # every sink below is named "test sink": the decision is kept per sink and kind
    near = _sink(1.8e8)  # saves 2.78 ns/B against 2.5 ns/B: pays, but not by MARGIN (3.125)
    assert m.decide("F32 weight", near, 1.0).mode == _cost.RAW
    assert m.decide("F32 weight", _sink(1e8), 1.0).mode == _cost.COMPRESS  # now encoded for this sink...
    assert m.decide("F32 weight", near, 1.0).mode == _cost.COMPRESS  # ...and it stays so above break-even
    assert m.decide("F32 weight", _sink(2.2e8), 1.0).mode == _cost.RAW  # 2.27 < 2.5 ns/B: back to raw
    assert m.decide("F32 weight", near, 1.0).mode == _cost.RAW


def test_a_delta_is_chosen_where_it_gains_more_and_only_where_allowed():
    m = _model(1.2, 0.5)
    m.observe("F32 weight", _cost.DELTA, 1 << 20, (1 << 20) // 8, (1 << 20) / 2e9)  # 8x at 2 GB/s: a sparse update
    m.fold()
    assert m.decide("F32 weight", _sink(1e9), 1.0).mode == _cost.DELTA
    assert m.decide("F32 weight", _sink(1e9), 1.0, delta_ok=False).mode == _cost.RAW  # compress alone does not pay
    assert _cost.CostModel(delta=False).decide("F32 weight", _sink(1e9), 1.0).mode == _cost.RAW


def test_a_probe_copies_its_region_across_staging_buffers_and_measures_both_modes():
    model = _cost.CostModel()
    probes = _cost.Probes(model)
    rng = np.random.default_rng(0)
    before = rng.standard_normal(200_000).astype(np.float32)
    after = before + rng.standard_normal(200_000).astype(np.float32) * 1e-4
    items = [("model/w", 4096, before.nbytes, 4)]

    def feed(values: np.ndarray) -> None:
        ps = probes.plan(items, ["F32 weight"], {"F32 weight"})
        image = np.zeros(4096 + values.nbytes, dtype=np.uint8)
        image[4096:] = values.view(np.uint8)
        for base in range(0, image.size, 300_000):  # buffers that cut the region
            part = image[base:base + 300_000]
            ps.tap(base, memoryview(part), part.size)
        ps.run()

    feed(before)  # arms a region: nothing to measure yet
    assert model.estimate("F32 weight", _cost.DELTA) is None
    key, start, copy = probes._armed["F32 weight"]
    assert key == "model/w" and np.array_equal(copy, before.view(np.uint8)[start:start + copy.size])
    feed(after)  # measures the region against its copy
    model.fold()
    d, c = model.estimate("F32 weight", _cost.DELTA), model.estimate("F32 weight", _cost.COMPRESS)
    assert d.raw == c.raw == _cost.PROBE
    assert d.ratio > c.ratio > 1.0  # a small update: the delta compresses better than the values


def _fixed(ck, bandwidth: float) -> None:
    """The local disk as the cost model sees it, fixed at ``bandwidth`` bytes a second."""
    sink = _cost.Sink("local disk")
    sink.observe(int(bandwidth), 1.0)
    sink.observe = lambda *a: None
    ck._flusher.disk = sink


def _two_layers() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))


def _with_remote(tmp_path, model, **config):
    """A Checkpointer of ``model`` with a ``file://`` remote tier at ``tmp_path/remote`` (and its URL); the local
    disk fixed at 20 GB/s, so that only the remote's encoding is in question."""
    url = "file://" + str(tmp_path / "remote")
    ck = layerckpt.Checkpointer(tmp_path / "ck", model, config=layerckpt.Config(remote=url, **config))
    _fixed(ck, 20e9)
    return ck, url


def _remote_fast(sink) -> None:
    """The remote as the cost model sees it, from now on 20 GB/s: every copy goes raw."""
    sink.cap, sink._bytes, sink._seconds = None, 20e9, 1.0
    sink.observe = lambda *a: None


def _train(model, opt) -> None:
    train_steps(model, opt, seed=1)


def _run(root, bandwidth: float, saves: int = 6):
    model, opt = trained()
    with layerckpt.Checkpointer(root, model, opt, config=layerckpt.Config(full=True, keep_last=0)) as ck:
        _fixed(ck, bandwidth)
        for step in range(1, saves + 1):
            _train(model, opt)
            ck.save(step).wait()
        estimates = {k: ck._flusher.cost.estimate("F32 weight", k) for k in (_cost.DELTA, _cost.COMPRESS)}
    return model, opt, estimates


def _manifest(root, step):
    with open(os.path.join(root, "manifests", f"step-{step:08d}.json")) as f:
        return json.load(f)


def _restores(root, step, model, opt):
    fresh, fopt = trained(seed=1)
    layerckpt.restore(root, fresh, fopt, step=step)
    assert_same_state(fresh, model)
    assert_same_optimizer_state(fopt.state_dict(), opt.state_dict())


def test_auto_writes_dense_state_raw_to_a_fast_disk_and_says_why(tmp_path):
    model, opt, est = _run(tmp_path, bandwidth=20e9)
    m = _manifest(tmp_path, 6)
    assert all(t["enc"] is None for t in m["tensors"].values())  # a plain safetensors file, read straight back
    (coding,) = m["coding"].values()
    assert {k for k in coding} >= {"F32 weight", "F32 exp_avg", "F32 exp_avg_sq"}
    for kind, r in coding.items():
        assert r["mode"] == "raw" and r["sink"] == "local disk" and r["bandwidth"] == 20e9, (kind, r)
        assert "ns/B" in r["why"] and r["tensors"] > 0 and r["bytes"] >= _cost.MIN_BYTES
    # the probes measured what encoding would give, both ways
    assert est[_cost.DELTA] is not None and est[_cost.COMPRESS] is not None
    _restores(tmp_path, 6, model, opt)
    out = subprocess.run([sys.executable, "-m", "layerckpt.cli", "inspect", str(tmp_path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "encoding of step-00000006.rank0.safetensors" in out.stdout
    assert "F32 exp_avg_sq" in out.stdout and "raw" in out.stdout


def test_auto_encodes_for_a_slow_disk_and_restores_every_step(tmp_path):
    model, opt, _ = _run(tmp_path, bandwidth=2e6)
    m = _manifest(tmp_path, 6)
    (coding,) = m["coding"].values()
    assert coding["F32 weight"]["mode"] in ("delta", "compress")
    raw = sum(t["nbytes"] for t in m["tensors"].values())
    own = sum(f["size"] for f in m["files"].values() if f["step"] == 6)
    assert own < raw  # fewer bytes than the state: encoded
    assert any(t["enc"] is not None for t in m["tensors"].values())
    _restores(tmp_path, 6, model, opt)


@pytest.mark.parametrize("part", [None, 64 * 1024])
def test_a_slow_remote_gets_encoded_copies_while_the_disk_gets_raw_bytes(tmp_path, monkeypatch, part):
    from layerckpt.write import _transcode

    if part is not None:  # copies in many parts, each uploaded while the next is encoded
        monkeypatch.setattr(_transcode, "PART", part)
    remote = tmp_path / "remote"
    url = "file://" + str(remote)
    cfg = layerckpt.Config(full=True, keep_last=0, remote=url, remote_bandwidth="4MB")
    model, opt = trained()
    states = {}
    with layerckpt.Checkpointer(tmp_path / "ck", model, opt, config=cfg) as ck:
        _fixed(ck, 20e9)
        for step in range(1, 7):
            _train(model, opt)
            ck.save(step).wait()
            ck.wait()  # the remote copy too
            states[step] = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
        tc = ck._tiers.tiers[0].transcoder
        assert 0 < tc.encoded_bytes < tc.raw_bytes  # what went up, encoded
    local = _manifest(tmp_path / "ck", 6)
    assert all(t["enc"] is None for t in local["tensors"].values())  # the disk: raw
    with open(remote / "manifests" / "step-00000006.json") as f:
        rm = json.load(f)
    modes = {b[3] for t in rm["tensors"].values() if t["enc"] for b in t["enc"]["blocks"]}
    assert modes & {1, 2, 3}  # compressed or delta blocks on the remote
    (decided,) = rm["coding"].values()  # the remote's own decisions, for its own sink
    assert decided["F32 weight"]["sink"] == "remote" and 0 < decided["F32 weight"]["bandwidth"] <= 4e6  # the cap, or slower
    assert decided["F32 weight"]["mode"] in ("delta", "compress")
    own = lambda m, s: sum(f["size"] for f in m["files"].values() if f["step"] == s)  # noqa: E731
    assert own(rm, 6) < own(local, 6)
    parts = [n for n, f in rm["files"].items() if f["step"] == 6]
    assert (len(parts) > 2) == (part is not None), parts
    assert sorted(os.listdir(remote / "data")) == sorted({n for s in range(1, 7) for n in json.load(
        open(remote / "manifests" / f"step-{s:08d}.json"))["files"]})  # every part listed, nothing else
    assert not [n for n in os.listdir(tmp_path / "ck" / "data") if n.endswith(".tmp")]
    for step in (5, 6):  # every remote composite restores bit for bit from the remote alone
        fresh, fopt = trained(seed=1)
        layerckpt.restore(url, fresh, fopt, step=step)
        assert_same_tensors(fresh.state_dict(), states[step][0])
        assert_same_optimizer_state(fopt.state_dict(), states[step][1])


def test_a_remote_copy_carrying_an_encoded_file_keeps_the_newer_versions_of_its_tensors(tmp_path):
    """A composite that carries a file the remote holds as an encoded copy (a layer not written since) takes from
    that copy only the tensors it still reads there: a tensor of the file written again since stays the newer
    file's. (Each remote copy below carries the third save's file, encoded, for the second layer, while the first layer is
    newer each time and goes raw; were every tensor of the old copy taken, the first layer would name the third
    save's bytes under a newer step, and the tier's manifest would be refused.)"""
    torch.manual_seed(0)
    model = _two_layers()
    states = {}
    ck, url = _with_remote(tmp_path, model, keep_last=0)
    with ck:
        tc = ck._tiers.tiers[0].transcoder
        tc.sink.cap = 1e3  # a remote taken for 1 kB/s: every copy once estimated is encoded
        for step in range(1, 8):
            with torch.no_grad():  # the first three saves write both layers (the third encoded: the first two
                # measure the encoder), later ones only the first layer
                for p in (model.parameters() if step <= 3 else model[0].parameters()):
                    p.add_(torch.randn_like(p) * 1e-2)
            ck.save(step).wait()
            ck.wait()  # the remote copy too: raises where it failed
            states[step] = copy.deepcopy(model.state_dict())
            if step == 3:  # from now on the remote is fast: the newer files go raw, the third stays encoded
                _remote_fast(tc.sink)
        assert tc.encoded_bytes > 0
    assert all(t["enc"] for k, t in _manifest(tmp_path / "remote", 3)["tensors"].items() if k.startswith("model/"))
    for step in range(4, 8):
        rm = _manifest(tmp_path / "remote", step)
        assert rm["layers"]["1"]["step"] == 3 and rm["layers"]["0"]["step"] == step
        assert not any(t["enc"] for k, t in rm["tensors"].items() if k.startswith("model/0."))  # raw, newer
        assert all(rm["files"][t["file"]]["step"] == rm["layers"][k.split("/")[1].split(".")[0]]["step"]
                   for k, t in rm["tensors"].items() if k.startswith("model/")), step
    for step in (4, 7):  # restored from the remote alone, bit for bit
        fresh = _two_layers()
        layerckpt.restore(url, fresh, step=step)
        assert_same_tensors(fresh.state_dict(), states[step])


def test_a_remote_is_timed_on_its_uploads_not_on_the_encoding_before_them(tmp_path, monkeypatch):
    """The remote's rate is its bytes over the time an upload ran: were the encoding of its copies counted
    in, a slow encoder would make the remote look slow, which makes encoding look more worth it."""
    from layerckpt.write import _transcode

    slow = _transcode.Transcoder._encode

    def encode(self, *a, **kw):
        time.sleep(0.01)  # an encoder far slower than the folder the copies go to
        return slow(self, *a, **kw)

    monkeypatch.setattr(_transcode.Transcoder, "_encode", encode)
    cfg = layerckpt.Config(full=True, keep_last=0, remote="file://" + str(tmp_path / "remote"))
    model, opt = trained()
    seen = []
    with layerckpt.Checkpointer(tmp_path / "ck", model, opt, config=cfg) as ck:
        _fixed(ck, 20e9)
        tc = ck._tiers.tiers[0].transcoder
        tc.sink.cap = 1e3  # a remote taken for 1 kB/s whatever it measures: once estimated, copies are encoded
        observe = tc.sink.observe
        tc.sink.observe = lambda n, sec: (seen.append((n, sec, tc.encoded_bytes)), observe(n, sec))
        for step in range(1, 5):
            _train(model, opt)
            ck.save(step).wait()
            ck.wait()
        encodes = len(_manifest(tmp_path / "ck", 4)["tensors"])
    encoded = [(n, sec) for (n, sec, after), (_, _, before) in zip(seen[1:], seen) if after > before]
    assert encoded  # copies that were encoded, 10 ms a tensor: none of that is the remote's time
    for n, sec in encoded:
        assert n > 0 and sec < 0.5 * 0.01 * encodes, (n, sec, encodes)


@pytest.mark.parametrize("encoding", ["off", "auto", "delta"])
def test_full_saves_carry_a_frozen_layer_proven_unchanged_in_any_encoding(tmp_path, encoding):
    model, _ = trained()
    for p in model.h[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    frozen = sum(p.numel() * p.element_size() for p in model.h[0].parameters())
    cfg = layerckpt.Config(full=True, keep_last=0, encoding=encoding)
    written = {}
    with layerckpt.Checkpointer(tmp_path, model, opt, config=cfg) as ck:
        for step in (1, 2, 3):
            _train(model, opt)
            written[step] = ck.save(step).wait().bytes_written
        m3 = _manifest(tmp_path, 3)
        assert m3["layers"]["h.0"]["step"] == 1 and m3["layers"]["h.0"]["reason"] == "unchanged"
        assert m3["layers"]["h.1"]["step"] == 3 and m3["layers"]["h.1"]["reason"] == "full"
        assert all(m3["tensors"][k]["file"] == "step-00000001.rank0.safetensors" for k in m3["layers"]["h.0"]["tensors"])
        h0 = set(m3["layers"]["h.0"]["tensors"])
        own3 = sum(t["nbytes"] for t in m3["tensors"].values() if t["file"] == "step-00000003.rank0.safetensors")
        assert own3 == sum(t["nbytes"] for k, t in m3["tensors"].items() if k not in h0)  # all but the frozen layer
        assert sum(m3["tensors"][k]["nbytes"] for k in h0) >= frozen and written[3] < written[1]
        _restores_frozen(tmp_path, 3, model, opt)
        with torch.no_grad():  # changed, frozen or not: written again
            next(model.h[0].parameters()).add_(1.0)
        ck.save(4).wait()
    m4 = _manifest(tmp_path, 4)
    assert m4["layers"]["h.0"]["step"] == 4 and m4["layers"]["h.0"]["reason"] == "full"
    _restores_frozen(tmp_path, 4, model, opt)


def _restores_frozen(root, step, model, opt):
    fresh, _ = trained(seed=1)
    for p in fresh.h[0].parameters():
        p.requires_grad_(False)
    fopt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-3)
    layerckpt.restore(root, fresh, fopt, step=step)
    assert_same_state(fresh, model)
    assert_same_optimizer_state(fopt.state_dict(), opt.state_dict())


def test_full_saves_for_a_bases_only_remote_write_every_layer(tmp_path):
    model, _ = trained()
    for p in model.h[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    cfg = layerckpt.Config(full=True, keep_last=0, remote="file://" + str(tmp_path / "remote"), remote_every="base")
    with layerckpt.Checkpointer(tmp_path / "ck", model, opt, config=cfg) as ck:
        for step in (1, 2):
            _train(model, opt)
            ck.save(step).wait()
    assert _manifest(tmp_path / "ck", 2)["layers"]["h.0"]["step"] == 2  # a base reads no older file
    assert (tmp_path / "remote" / "manifests" / "step-00000002.json").exists()


def test_a_tier_copy_refused_for_no_system_error_does_not_say_input_output_error():
    """A tier copy that failed for a reason of the library's own (a manifest refused, a checksum) is reported as
    that reason, not as an I/O error of the system's; one the system gave keeps the system's words."""
    from types import SimpleNamespace

    from layerckpt.errors import CheckpointCorruptError
    from layerckpt.tiers._tiers import _as_write_error

    tier = SimpleNamespace(kind="remote", store=SimpleNamespace(url="file:///r"))
    e = _as_write_error(CheckpointCorruptError("manifest m: tensor t is another version"), tier, 4)
    assert str(e).startswith("checkpoint write failed (file:///r); copying the composite of step 4 to the remote "
                             "tier file:///r failed (CheckpointCorruptError: manifest m: tensor t is another version)")
    assert "Input/output error" not in str(e)
    e = _as_write_error(OSError(28, "No space left on device", "/r/data/x"), tier, 4)
    assert str(e).startswith("checkpoint write failed: No space left on device (/r/data/x); free space")


def test_a_remote_delta_is_never_taken_against_a_copy_its_retention_removed(tmp_path):
    """Encoded remote copies are deltas against references the remote holds; where the remote's retention has
    removed a reference (the composites that named it dropped while the remote was fast and got raw bytes), a later
    encoded copy is written without it, not against it: every committed remote composite restores from the remote
    alone, and names no file the remote lacks. (Before, the transcoder kept its reference past its removal and the
    remote committed a composite naming files it no longer held: a restore after a node loss refused it as missing.)"""
    torch.manual_seed(0)
    model = _two_layers()
    states = {}
    ck, url = _with_remote(tmp_path, model, full=True, keep_last=2)
    with ck:
        tc = ck._tiers.tiers[0].transcoder
        for step in range(1, 9):
            slow = step <= 3 or step >= 7  # encoded copies, then raw ones (the remote fast), then encoded again
            if slow:
                tc.sink.cap, tc.sink._bytes, tc.sink._seconds = 1e3, 0, 0.0
                tc.sink.observe = type(tc.sink).observe.__get__(tc.sink)
            else:
                _remote_fast(tc.sink)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 1e-2)
            ck.save(step).wait()
            ck.wait()  # the remote copy too: raises where it failed
            states[step] = copy.deepcopy(model.state_dict())
            if step == 3:
                assert tc.refs  # references for the deltas of the next encoded copies
    remote = tmp_path / "remote"
    held = set(os.listdir(remote / "data"))
    for name in sorted(os.listdir(remote / "manifests")):
        assert set(_manifest(remote, int(name[5:13]))["files"]) <= held, name
    assert any(t["enc"] for t in _manifest(remote, 8)["tensors"].values())  # encoded again at the end
    for step in (7, 8):  # from the remote alone, bit for bit
        fresh = _two_layers()
        layerckpt.restore(url, fresh, step=step)
        assert_same_tensors(fresh.state_dict(), states[step])
