"""Layer-wise selective persistence: what is written, why, and how composites restore."""
import json
import os
import signal

import pytest
import torch
from safetensors import safe_open

import layerckpt
from conftest import run_py, small_model, stored_byte
from layerckpt.bench.workload import make_model, make_optimizer, post_training_run, run


def _manifest(root, step):
    return json.loads((root / "manifests" / f"step-{step:08d}.json").read_text())


def _keys(root, step):
    """The tensors the save of ``step`` wrote into its own file (encoded or not: as the manifest places them)."""
    m = _manifest(root, step)
    own = [f for f, e in m["files"].items() if e["step"] == step]
    keys = {k for k, t in m["tensors"].items() if t["file"] == own[0]}
    if not any(t.get("enc") for t in m["tensors"].values()):  # a raw file lists them itself
        with safe_open(str(root / "data" / own[0]), "pt") as f:
            assert set(f.keys()) == keys
    return keys


def _nudge(module: torch.nn.Module, rel: float, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.norm() / max(1, p.numel()) ** 0.5 * rel)


def _layer_bytes(model: torch.nn.Module, opt, layer: str) -> int:
    """Bytes of a layer counted from the live objects: its parameters and buffers (a tied weight once) and every
    optimizer state tensor of its parameters."""
    prefix = layer + "."
    tensors = {t.data_ptr(): t for n, t in model.state_dict().items() if n.startswith(prefix)}
    n = sum(t.numel() * t.element_size() for t in tensors.values())
    for name, p in model.named_parameters():
        if name.startswith(prefix) and opt is not None:
            n += sum(v.numel() * v.element_size() for v in opt.state.get(p, {}).values() if torch.is_tensor(v))
    return n


def test_only_drifted_layers_and_their_optimizer_state_are_written(tmp_path):
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    with layerckpt.Checkpointer(tmp_path, model, opt, config=layerckpt.Config(threshold=0.05)) as ck:
        ck.save(1).wait()
        _nudge(model.h[1], 0.2)
        _nudge(model.h[2], 0.01)  # below the threshold
        ck.save(2).wait()
    keys = _keys(tmp_path, 2)
    assert any(k.startswith("model/h.1.") for k in keys) and "optim/h.1.c_fc.weight/momentum_buffer" in keys
    assert not any(k.startswith(("model/h.0.", "model/h.2.", "optim/h.2.", "model/wte")) for k in keys)
    assert "rng/torch" in keys  # the small state travels with every save
    m = _manifest(tmp_path, 2)
    assert m["layers"]["h.1"]["step"] == 2 and m["layers"]["h.1"]["reason"] == "drift"
    assert m["layers"]["h.1"]["drift"] == pytest.approx(0.2, rel=0.2)
    assert m["layers"]["h.2"]["step"] == 1 and m["layers"]["h.2"]["age"] == 1
    assert m["layers"]["h.2"]["reason"] == "below-threshold" and m["layers"]["h.2"]["drift"] < 0.05
    assert _manifest(tmp_path, 1)["layers"]["h.0"]["reason"] == "first"
    # the composite of step 2 takes h.2 (and its momentum) from step 1's file
    assert m["tensors"]["optim/h.2.c_fc.weight/momentum_buffer"]["file"] == "step-00000001.rank0.safetensors"


def test_composite_restores_each_layer_from_its_own_step(tmp_path):
    """Weights and moments of a layer come from the step it was persisted at, bit for bit."""
    model = make_model(0, n_layer=3, n_embd=32)
    opt = make_optimizer(model)
    snaps = {}
    cfg = layerckpt.Config(threshold=0.02, max_staleness=4)
    with layerckpt.Checkpointer(tmp_path, model, opt, config=cfg) as ck:
        for step in range(1, 13):
            run(model, opt, "count" if step < 4 else "affine", step, step + 1)
            if step % 2 == 0:
                ck.save(step).wait()
                snaps[step] = ({k: v.clone() for k, v in model.state_dict().items()},
                               {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()})
    fresh = make_model(5, n_layer=3, n_embd=32)
    fopt = make_optimizer(fresh)
    rep = layerckpt.restore(tmp_path, fresh, fopt)
    assert rep.step == 12 and len(set(rep.layers.values())) > 1, rep.layers  # a real composite
    groups = _manifest(tmp_path, 12)["layers"]
    params = dict(fresh.named_parameters())
    for layer, info in groups.items():
        weights, moments = snaps[info["step"]]
        for key in info["tensors"]:
            kind, name = key.split("/")[:2]
            if kind == "model":
                assert torch.equal(fresh.state_dict()[name], weights[name]), (layer, name)
            else:
                for k, v in moments[name].items():
                    assert torch.equal(fopt.state[params[name]][k], v), (layer, name, k)
        assert rep.staleness[layer] == info["age"]
    assert rep.max_staleness == max(rep.staleness.values()) <= 4
    # what restore reports per layer is what the layer holds: weights and AdamW moments, nothing left out
    assert rep.layer_bytes == {layer: _layer_bytes(fresh, fopt, layer) for layer in groups}


def test_staleness_bound_and_base_every(tmp_path):
    model = small_model()
    cfg = layerckpt.Config(threshold=10.0, max_staleness=2, base_every=4, keep_last=0)
    with layerckpt.Checkpointer(tmp_path, model, config=cfg) as ck:
        for step in range(9):
            _nudge(model, 0.001, seed=step)
            ck.save(step).wait()
    reasons = [{lay: e["reason"] for lay, e in _manifest(tmp_path, s)["layers"].items()} for s in range(9)]
    assert set(reasons[0].values()) == {"first"} and set(reasons[4].values()) == {"base"}
    assert set(reasons[8].values()) == {"base"}
    assert set(reasons[3].values()) == {"stale"} and set(reasons[1].values()) == {"below-threshold"}
    for s in range(9):
        assert max(e["age"] for e in _manifest(tmp_path, s)["layers"].values()) <= 2


def test_frozen_layers_written_once(tmp_path):
    model = make_model(0, n_layer=2, n_embd=32)
    for p in model.h[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    cfg = layerckpt.Config(threshold=0.0001, max_staleness=1)
    with layerckpt.Checkpointer(tmp_path, model, opt, config=cfg) as ck:
        for step in range(1, 5):
            run(model, opt, "count", step, step + 1)
            ck.save(step).wait()
    m = _manifest(tmp_path, 4)
    assert m["layers"]["h.0"]["step"] == 1 and m["layers"]["h.0"]["reason"] == "frozen" and m["layers"]["h.0"]["frozen"]
    assert m["layers"]["h.1"]["step"] == 4
    assert not any(k.startswith("model/h.0.") for k in _keys(tmp_path, 4))
    # age 3 > max_staleness 1, but a frozen layer's old version is its current one: no error
    fresh = make_model(3, n_layer=2, n_embd=32)
    assert layerckpt.restore(tmp_path, fresh).staleness["h.0"] == 3
    assert torch.equal(fresh.h[0].c_fc.weight, model.h[0].c_fc.weight)


def test_byte_budget_takes_most_drifted_first(tmp_path):
    model = small_model()
    per_block = sum(p.numel() * 4 for p in model.h[0].parameters())
    cfg = layerckpt.Config(threshold=0.01, budget_bytes=int(per_block * 1.5))
    with layerckpt.Checkpointer(tmp_path, model, config=cfg) as ck:
        ck.save(1).wait()
        _nudge(model.h[0], 0.05)
        _nudge(model.h[2], 0.30)
        _nudge(model.h[3], 0.10)
        ck.save(2).wait()
    layers = _manifest(tmp_path, 2)["layers"]
    assert layers["h.2"]["reason"] == "drift" and layers["h.2"]["step"] == 2
    assert layers["h.3"]["reason"] == "over-budget" and layers["h.0"]["reason"] == "over-budget"


def test_new_optimizer_state_forces_the_layer(tmp_path):
    model = small_model()
    opt = torch.optim.AdamW(model.parameters())
    with layerckpt.Checkpointer(tmp_path, model, opt, config=layerckpt.Config(threshold=1.0)) as ck:
        ck.save(1).wait()  # no optimizer state yet
        model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
        opt.step()  # tiny drift, but every layer now has moments
        ck.save(2).wait()
    assert {e["reason"] for e in _manifest(tmp_path, 2)["layers"].values()} == {"new"}
    fresh = small_model(4)
    fopt = torch.optim.AdamW(fresh.parameters())
    layerckpt.restore(tmp_path, fresh, fopt)
    assert len(fopt.state) == len(opt.state)


def test_layer_override_by_patterns_and_callable(tmp_path):
    model = small_model()
    cfg = layerckpt.Config(layers={"h.*": "blocks", "*": "rest"})
    with layerckpt.Checkpointer(tmp_path / "a", model, config=cfg) as ck:
        ck.save(0).wait()
    assert set(_manifest(tmp_path / "a", 0)["layers"]) == {"blocks", "rest"}
    with layerckpt.Checkpointer(tmp_path / "b", model, layers=lambda n: n.split(".")[0]) as ck:
        ck.save(0).wait()
    assert set(_manifest(tmp_path / "b", 0)["layers"]) == {"wte", "wpe", "h", "ln_f"}


def _two_step_composite(tmp_path):
    model = small_model()
    cfg = layerckpt.Config(threshold=0.05, keep_last=0)
    with layerckpt.Checkpointer(tmp_path, model, config=cfg) as ck:
        ck.save(1).wait()
        _nudge(model.h[1], 0.3)
        ck.save(2).wait()
    return model


def test_missing_file_of_a_composite_names_layer_step_and_file(tmp_path):
    _two_step_composite(tmp_path)
    os.unlink(tmp_path / "data" / "step-00000001.rank0.safetensors")
    with pytest.raises(layerckpt.CheckpointCorruptError) as ei:
        layerckpt.restore(tmp_path, small_model())
    msg = str(ei.value)
    assert "step-00000001.rank0.safetensors" in msg and "is missing" in msg
    assert "persisted at step 1" in msg and "layer 'h.0'" in msg


def test_corrupt_newer_file_leaves_older_composite_restorable(tmp_path):
    _two_step_composite(tmp_path)
    e = _manifest(tmp_path, 2)["tensors"]["model/h.1.c_fc.weight"]
    with open(tmp_path / "data" / e["file"], "r+b") as f:
        f.seek(stored_byte(e))
        f.write(b"\xde\xad")
    with pytest.raises(layerckpt.CheckpointCorruptError, match=r"layer 'h\.1' persisted at step 2"):
        layerckpt.restore(tmp_path, small_model())
    assert layerckpt.restore(tmp_path, small_model(), step=1).step == 1


def test_staleness_violation_is_an_error_when_strict(tmp_path, caplog):
    model = small_model()
    with layerckpt.Checkpointer(tmp_path, model, config=layerckpt.Config(threshold=5.0)) as ck:
        for step in range(4):
            with torch.no_grad():  # every layer moves a little (an unchanged one is never stale)
                for p in model.parameters():
                    p.add_(1e-3)
            ck.save(step).wait()
    strict = layerckpt.Config(max_staleness=2)
    with pytest.raises(layerckpt.StalenessError, match=r"older than max_staleness=2.*h\.0 \(age 3, 3 steps\)"):
        layerckpt.restore(tmp_path, small_model(), config=strict)
    r = layerckpt.restore(tmp_path, small_model(), strict=False, config=strict)
    assert r.max_staleness == 3 and "h.0 (age 3, 3 steps)" in caplog.text


def test_retention_keeps_what_retained_composites_reference(tmp_path):
    model = small_model()
    with layerckpt.Checkpointer(tmp_path, model, config=layerckpt.Config(threshold=0.05, keep_last=2)) as ck:
        ck.save(1).wait()
        for step in (2, 3, 4):
            _nudge(model.h[1], 0.3, seed=step)
            ck.save(step).wait()
    assert sorted(os.listdir(tmp_path / "manifests")) == ["step-00000003.json", "step-00000004.json"]
    # step 1's file still holds every layer but h.1, so it stays; step 2's file is gone
    assert sorted(os.listdir(tmp_path / "data")) == [
        "step-00000001.rank0.safetensors", "step-00000003.rank0.safetensors", "step-00000004.rank0.safetensors"]
    for step in (3, 4):
        out = small_model(6)
        assert layerckpt.restore(tmp_path, out, step=step).layers["h.0"] == 1


KILL_IN_RETAIN = r"""
import os, signal, sys, torch, layerckpt
from layerckpt import _faults
sys.path.insert(0, sys.argv[2])
from conftest import small_model
_faults.install("retain.manifests-dropped", lambda: os.kill(os.getpid(), signal.SIGKILL))
model = small_model()
# every file self-contained (no delta refers to step 1's file): once its manifest is gone, nothing needs it
config = layerckpt.Config(threshold=0.0, keep_last=2, encoding="compress")
ck = layerckpt.Checkpointer(sys.argv[1], model, config=config)
for step in range(1, 4):
    with torch.no_grad():
        model.wte.weight.fill_(step)
    ck.save(step).wait()
"""


def test_sigkill_during_retention(tmp_path):
    root = tmp_path / "ck"
    r = run_py(KILL_IN_RETAIN, str(root), os.path.dirname(__file__))
    assert r.returncode == -signal.SIGKILL, r.stderr
    # killed after dropping step 1's manifest, before deleting its data: both retained composites restore
    assert sorted(os.listdir(root / "manifests")) == ["step-00000002.json", "step-00000003.json"]
    assert "step-00000001.rank0.safetensors" in os.listdir(root / "data")
    for step in (2, 3):
        out = small_model(1)
        layerckpt.restore(root, out, step=step)
        assert torch.all(out.wte.weight == step)
    layerckpt.Checkpointer(root, small_model()).close()  # the next open removes the orphan
    assert "step-00000001.rank0.safetensors" not in os.listdir(root / "data")


def _full_save_bytes_ok(r) -> None:
    """The first save of post_training_run (its full-checkpoint unit) holds the whole state once: the model (the tied
    head not again) and AdamW's state, plus at most 48 KiB of RNG states, header and alignment (39 KiB here)."""
    model = make_model(0)
    opt = make_optimizer(model)
    run(model, opt, "count", 0, 1)
    state = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in model.state_dict().values()}.values())
    state += sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    assert r["full_bytes"] % r["saves"] == 0
    assert state <= r["full_bytes"] // r["saves"] <= state + 48 * 1024, (r["full_bytes"] // r["saves"], state)


def test_post_training_run_defaults_stay_within_half_a_percent(tmp_path):
    """Default Config on the examples' fine-tuning workload (every block learns the new task): the loss after a
    mid-run restore within 0.5%, the composite within its fidelity budget, and fewer bytes than full (1.4x here:
    a rule that writes every layer at every save gives 1.0x)."""
    r = post_training_run(str(tmp_path / "sel"))
    ratio = r["full_bytes"] / r["bytes"]
    print(f"\ndefault Config: {r['saves']} checkpoints, {ratio:.1f}x fewer bytes than full, "
          f"loss after restore within {r['mean_loss_rel'] * 100:.3f}% (max staleness {r['report'].max_staleness})")
    _full_save_bytes_ok(r)
    assert r["saves"] == 60
    assert 1.15 <= ratio <= 3.0, ratio
    assert r["mean_loss_rel"] <= 0.005
    assert r["report"].loss_increase <= layerckpt.Config().fidelity


def test_threshold_zero_resume_is_bit_exact(tmp_path):
    # bit-exactness needs no long run: a short pre-training, 5 saves, a restore from the fourth
    r = post_training_run(str(tmp_path / "full"), layerckpt.Config(threshold=0.0), every=6, crash_at=24,
                          pretrain=6, finetune=30)
    assert r["identical"], "with every layer in every checkpoint the continued run must equal the original"
    assert r["full_bytes"] == r["bytes"] and r["saves"] == 5
    _full_save_bytes_ok(r)


def test_adopting_a_restored_composite_keeps_the_next_save_selective(tmp_path):
    """A new Checkpointer (a resumed process) continues the composite it restored instead of starting full."""
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    cfg = layerckpt.Config(threshold=0.05, keep_last=0)
    with layerckpt.Checkpointer(tmp_path, model, opt, config=cfg) as ck:
        full = ck.save(1).wait().nbytes
        _nudge(model.h[1], 0.2)
        ck.save(2).wait()

    model2 = small_model(seed=3)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    report = layerckpt.restore(tmp_path, model2, opt2)
    with layerckpt.Checkpointer(tmp_path, model2, opt2, config=cfg) as ck:
        ck.adopt(report)
        _nudge(model2.h[2], 0.2)
        p = ck.save(3).wait()
        with pytest.raises(layerckpt.CheckpointError, match="before the first save"):
            ck.adopt(report)
    m = _manifest(tmp_path, 3)
    assert p.nbytes < full / 2
    # step 3 wrote h.2 (weights and momentum) and the small state, not one layer the adopted composite holds
    keys = _keys(tmp_path, 3)
    h2 = [n for n, _ in model2.named_parameters() if n.startswith("h.2.")]
    assert {k for k in keys if k.startswith(("model/", "optim/"))} == (
        {f"model/{n}" for n in model2.state_dict() if n.startswith("h.2.")} | {f"optim/{n}/momentum_buffer" for n in h2})
    assert all(k.startswith("rng/") for k in keys if not k.startswith(("model/", "optim/"))), keys
    assert m["layers"]["h.2"]["step"] == 3 and m["layers"]["h.1"]["step"] == 2 and m["layers"]["h.0"]["step"] == 1
    assert m["layers"]["h.0"]["age"] == 2 and m["chain"] == 2
    model3 = small_model(seed=4)
    opt3 = torch.optim.SGD(model3.parameters(), lr=0.1, momentum=0.9)
    layerckpt.restore(tmp_path, model3, opt3)
    for (k, a), b in zip(model2.state_dict().items(), model3.state_dict().values()):
        assert torch.equal(a, b), k
    other = tmp_path / "other"
    with layerckpt.Checkpointer(other, model2, opt2, config=cfg) as ck:
        with pytest.raises(layerckpt.CheckpointError, match="not to this Checkpointer"):
            ck.adopt(report)


def test_a_long_run_keeps_no_more_manifest_entries_alive_than_a_short_one(tmp_path):
    """What a save keeps in memory for the next ones is bounded by the few composites in flight, not the run's
    length: entries of old manifests held on (by a serialisation cache, say) grow memory and the collector's
    work with every save."""
    import gc

    from layerckpt.format._entries import TensorEntry

    torch.manual_seed(0)
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ck = layerckpt.Checkpointer(str(tmp_path / "ck"), model, opt, layerckpt.Config(keep_last=2))

    def alive() -> int:
        gc.collect()
        return sum(isinstance(o, TensorEntry) for o in gc.get_objects())

    counts = []
    try:
        for step in range(1, 61):
            sum(p.square().sum() for p in model.parameters()).backward()
            opt.step()
            opt.zero_grad()
            ck.save(step).wait()
            if step in (20, 60):
                counts.append(alive())
    finally:
        ck.close()
    assert counts[0] > 0
    assert counts[1] <= counts[0] * 1.2, f"entries alive after 20 saves: {counts[0]}, after 60: {counts[1]}"
