"""No blind spots in layer selection: "unchanged" is proven on every byte, state the tracker cannot price is
written whenever it changed, and restore holds every composite to the caller's staleness bound."""
import json
import os
import re

import pytest
import torch

import layerckpt
from layerckpt import _faults
from layerckpt.select._exact import CHUNK, PARALLEL_BYTES, fingerprint, fingerprints
from layerckpt.format._manifest import load_manifest
from layerckpt.errors import StalenessError
from layerckpt.select._track import sample_plan, sampled_positions


def manifests(d):
    """Every manifest in the directory, by step."""
    names = os.listdir(os.path.join(d, "manifests"))
    steps = sorted((int(re.search(r"(\d+)", n).group(1)), n) for n in names if n.endswith(".json"))
    return [load_manifest(os.path.join(d, "manifests", n)) for _, n in steps]


# ------------------------------------------------------------------ 1. "unchanged" must be exact

N, DIM = 100_000, 4


class Table(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(N, DIM)
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, ids):
        return (self.head(self.emb(ids)) - 1.0).square().mean()


def unsampled(name: str, n: int, total: int):
    """The flat indices of the tensor ``name`` (``n`` fp32 elements in a layer of ``total``) that the drift
    sample does not look at, by the sample's own plan (see _track)."""
    seen = set(sampled_positions(sample_plan(name, n, 4, layerckpt.Config().drift_sample, total), n))
    return [i for i in range(n) if i not in seen]


def unsampled_rows(count: int):
    """Rows of the table none of whose elements the drift sample looks at (runs of a cache line, a fixed
    stride apart, from an offset hashed from the table's name)."""
    hidden = set(unsampled("emb.weight", N * DIM, N * DIM))
    rows = [r for r in range(N) if all(r * DIM + i in hidden for i in range(DIM))]
    assert len(rows) > count  # the case exists: whole rows fall between sampled runs
    return rows[:count]


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_table_trained_between_the_sampled_elements_is_never_older_than_max_staleness(tmp_path, momentum):
    torch.manual_seed(0)
    model = Table()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    cfg = layerckpt.Config()
    rows = torch.tensor(unsampled_rows(16))
    d = str(tmp_path)
    history = {}
    with layerckpt.Checkpointer(d, model, opt, cfg) as ck:
        for step in range(1, cfg.max_staleness + 7):
            opt.zero_grad()
            loss = model(rows[torch.randint(0, len(rows), (4,))])
            loss.backward()
            opt.step()
            history[step] = model.emb.weight.detach().clone()
            ck.save(step, loss=loss.item()).wait()
    e = manifests(d)[-1].layers["emb"]  # the table is one layer (smaller than two row blocks)
    # older than the bound only where proven bit-identical, which it is not: it moved at every step
    assert e.age <= cfg.max_staleness and not e.unchanged, (e.age, e.reason)
    model2 = Table()
    layerckpt.restore(d, model2, torch.optim.SGD(model2.parameters(), lr=0.05, momentum=momentum))
    assert torch.equal(model2.emb.weight, history[e.step])
    if momentum == 0.0:  # no gradient average: unpriced, so written whenever it changed
        assert e.step == cfg.max_staleness + 6 and e.reason == "unpriced-changed"


def test_fingerprints_see_every_byte():
    x = torch.randn(1000)
    fp = fingerprint(x)
    assert fingerprint(x.clone()) == fp
    y = x.clone()
    y.view(torch.int32)[777] ^= 1  # one bit of one element
    assert fingerprint(y) != fp
    zero = torch.zeros(8)
    neg = zero.clone()
    neg[5] = -0.0  # equal as numbers, not as bytes
    assert fingerprint(neg) != fingerprint(zero)
    assert fingerprint(x.view(torch.int32)) != fp  # another dtype never matches
    assert fingerprint(x.reshape(10, 100)) != fp  # nor another shape


def test_fingerprints_on_threads_equal_one_thread_and_see_one_bit_in_any_chunk():
    """Over PARALLEL_BYTES the chunks go to threads: the fingerprints are those of the one-thread path, and a
    bit flipped in the last chunk of a tensor of several chunks changes its fingerprint and no other."""
    big = torch.randn((CHUNK * 2 + 12345) // 4)  # three chunks, the last one short
    rest = {f"t{i}": torch.randn(1000 + i) for i in range(5)}
    tensors = {"big": big, "col": torch.randn(64, 300)[:, 7], **rest}  # a strided view too
    assert sum(t.numel() * t.element_size() for t in tensors.values()) >= PARALLEL_BYTES
    many = fingerprints(tensors)
    assert many == {k: fingerprint(t) for k, t in tensors.items()}
    assert len(many["big"][2]) == 3 and len(many["t0"][2]) == 1
    flipped = big.clone()
    flipped.view(torch.int32)[-1] ^= 1 << 30
    again = fingerprints({**tensors, "big": flipped})
    assert again["big"] != many["big"] and again["big"][2][:2] == many["big"][2][:2]
    assert {k: v for k, v in again.items() if k != "big"} == {k: v for k, v in many.items() if k != "big"}


# ------------------------------------------------------------------ 2. state the tracker cannot price

W = 256


class Mixed(torch.nn.Module):
    """``a`` has a gradient average (SGD momentum); ``plain`` none (momentum 0); ``bn`` holds only buffers;
    ``side`` is outside the optimizer."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(W, W)
        self.plain = torch.nn.Linear(W, W)
        self.bn = torch.nn.BatchNorm1d(W, affine=False)
        self.side = torch.nn.Linear(W, W)

    def forward(self, x):
        return self.side(self.plain(self.bn(self.a(x)))).square().mean()


def test_unpriced_state_is_written_whenever_it_changed_and_only_then(tmp_path):
    torch.manual_seed(0)
    model = Mixed()
    opt = torch.optim.SGD([{"params": model.a.parameters(), "momentum": 0.9},
                           {"params": model.plain.parameters(), "momentum": 0.0}], lr=1e-3)
    # an element of side.weight the drift sample does not look at
    hidden = unsampled("side.weight", W * W, W * W + W)[0]
    d = str(tmp_path)
    with layerckpt.Checkpointer(d, model, opt, layerckpt.Config(keep_last=0)) as ck:
        for step in range(1, 7):
            if step == 4:
                model.bn.eval()  # its running statistics stop moving
            if step == 5:
                with torch.no_grad():
                    model.side.weight.view(-1)[hidden] += 1e-3  # changed by hand, between the sampled elements
            if step == 6:
                opt.param_groups[1]["lr"] = 0.0  # plain stops moving
            opt.zero_grad()
            loss = model(torch.randn(32, W))
            loss.backward()
            opt.step()
            ck.save(step, loss=loss.item()).wait()
    ms = manifests(d)
    written = {name: [m.step for m in ms if m.layers[name].step == m.step] for name in ("plain", "bn", "side")}
    assert written == {"plain": [1, 2, 3, 4, 5], "bn": [1, 2, 3], "side": [1, 5]}, written
    for m in ms[1:]:
        for name in ("plain", "bn", "side"):
            e = m.layers[name]
            assert e.reason == ("unpriced-changed" if e.step == m.step else "unchanged"), (m.step, name, e.reason)
            assert e.unchanged == (e.step != m.step)
    model2 = Mixed()
    layerckpt.restore(d, model2)
    for k, v in model.state_dict().items():
        if not k.startswith("a."):
            assert torch.equal(model2.state_dict()[k], v), k


# ------------------------------------------------------------------ 3. restore's guard is the caller's

def small():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))


def stale_composite(d, saves=20, max_staleness=100):
    """A composite whose second layer was last written at the first save: it barely moves (threshold rule)."""
    model = small()
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.5},
                           {"params": model[1].parameters(), "lr": 1e-6}], momentum=0.9)
    with layerckpt.Checkpointer(d, model, opt, layerckpt.Config(threshold=0.05, max_staleness=max_staleness)) as ck:
        for step in range(1, saves + 1):
            opt.zero_grad()
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            ck.save(step).wait()
    m = manifests(d)[-1]
    assert m.layers["1"].age == saves - 1 and not getattr(m.layers["1"], "unchanged", False)
    return model


def test_restore_holds_a_composite_saved_under_a_larger_bound_to_the_default(tmp_path):
    d = str(tmp_path)
    stale_composite(d)
    with pytest.raises(StalenessError) as e:
        layerckpt.restore(d, small())
    msg = str(e.value)
    assert "max_staleness=16" in msg and "1 (age 19, 19 steps)" in msg, msg
    assert "strict=False" in msg and "Config(max_staleness=19)" in msg, msg
    with pytest.raises(StalenessError):
        layerckpt.read_checkpoint(d)
    layerckpt.restore(d, small(), config=layerckpt.Config(max_staleness=19))  # the caller's own bound
    report = layerckpt.restore(d, small(), strict=False)
    assert report.staleness["1"] == 19


def test_restore_ignores_the_bound_a_manifest_claims(tmp_path):
    d = str(tmp_path)
    stale_composite(d, max_staleness=100)
    last = sorted(os.listdir(os.path.join(d, "manifests")), key=lambda n: int(re.search(r"(\d+)", n).group(1)))[-1]
    path = os.path.join(d, "manifests", last)
    with open(path) as f:
        doc = json.load(f)
    doc["config"]["max_staleness"] = 10 ** 9
    doc["layers"]["1"]["reason"] = "unchanged"  # claims without the proof count for nothing
    doc["layers"]["1"]["frozen"] = True
    with open(path, "w") as f:
        json.dump(doc, f)
    with pytest.raises(StalenessError, match=r"older than max_staleness=16 .*1 \(age 19, 19 steps\)"):
        layerckpt.restore(d, small())
    with pytest.raises(StalenessError, match="max_staleness=18"):
        layerckpt.restore(d, small(), config=layerckpt.Config(max_staleness=18))


def test_a_frozen_layer_changed_between_the_sampled_elements_is_written(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(W, W), torch.nn.Linear(W, 1))
    model[0].requires_grad_(False)
    opt = torch.optim.Adam(model[1].parameters(), lr=1e-3)
    hidden = unsampled("0.weight", W * W, W * W + W)[0]
    d = str(tmp_path)
    with layerckpt.Checkpointer(d, model, opt, layerckpt.Config(keep_last=0)) as ck:
        for step in range(1, 5):
            if step == 3:
                with torch.no_grad():
                    model[0].weight.view(-1)[hidden] += 1e-3
            opt.zero_grad()
            model(torch.randn(8, W)).square().mean().backward()
            opt.step()
            ck.save(step).wait()
    reasons = [(e.reason, e.step, getattr(e, "unchanged", None)) for e in (m.layers["0"] for m in manifests(d))]
    assert reasons == [("first", 1, False), ("frozen", 1, True), ("frozen-changed", 3, False), ("frozen", 3, True)]
    model2 = torch.nn.Sequential(torch.nn.Linear(W, W), torch.nn.Linear(W, 1))
    layerckpt.restore(d, model2)
    assert torch.equal(model2[0].weight, model[0].weight)


def test_a_failed_save_proves_nothing(tmp_path):
    """The fingerprints of what a save persists become references when it is planned, and are forgotten when it
    fails: the next save must not prove a layer unchanged against a version no checkpoint holds."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(W, W), torch.nn.Linear(W, 1))
    model[0].requires_grad_(False)
    opt = torch.optim.Adam(model[1].parameters(), lr=1e-3)
    calls = []

    def hook():
        calls.append(1)
        if len(calls) == 2:
            raise OSError(5, "injected", "x")

    _faults.install("flush.written", hook)
    try:
        with layerckpt.Checkpointer(str(tmp_path), model, opt, layerckpt.Config(keep_last=0)) as ck:
            ck.save(1).wait()
            with torch.no_grad():
                model[0].weight.add_(1e-3)
            with pytest.raises(layerckpt.CheckpointError):
                ck.save(2).wait()  # planned to write layer 0, failed
            ck.save(3).wait()
    finally:
        _faults.remove("flush.written")
    e = manifests(str(tmp_path))[-1].layers["0"]
    assert (e.step, e.reason, e.unchanged) == (3, "frozen-changed", False)
    model2 = torch.nn.Sequential(torch.nn.Linear(W, W), torch.nn.Linear(W, 1))
    layerckpt.restore(str(tmp_path), model2)
    assert torch.equal(model2[0].weight, model[0].weight)
