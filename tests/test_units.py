"""The pure pieces, one at a time: policy, tracker, layer grouping, JSON codec, file layout, manifest."""
import json
import math

import pytest
import torch

from layerckpt import CheckpointCorruptError, CheckpointError
from layerckpt.select import _policy as policy
from layerckpt.format._codec import decode, encode, tensor_refs
from layerckpt.select._layers import group_layers
from layerckpt.format._layout import plan_layout
from layerckpt.format._manifest import Manifest, param_of
from layerckpt.select._track import DriftTracker, sample_plan, sampled_positions
from conftest import require_native


# ------------------------------------------------------------------ policy

def _st(cost, nbytes=100, progress=0.0, age=0, drift=0.1, frozen=False, unchanged=False):
    return policy.LayerState(drift=drift, age=age, nbytes=nbytes, frozen=frozen, cost=cost, progress=progress,
                             unchanged=unchanged)


def test_policy_first_and_base_write_everything():
    layers = {"a": _st(0.0), "b": _st(0.0, frozen=True)}
    assert policy.decide(layers, first=True, base_due=False, max_staleness=4) == {"a": "first", "b": "first"}
    assert policy.decide(layers, first=False, base_due=True, max_staleness=4) == {"a": "base", "b": "base"}


def test_policy_budget_skips_cheapest_per_byte_until_the_allowance_is_spent():
    layers = {"big": _st(3.0, nbytes=1000, progress=4.0), "small": _st(3.0, nbytes=10, progress=4.0),
              "idle": _st(0.0, nbytes=500, progress=2.0)}
    # loss 500, fidelity 1%: 5.0 of cost may stay stale.  Cost per byte: idle 0, big 0.003, small 0.3,
    # so idle and big fit (3.0 <= 5.0) and small does not
    out = policy.decide(layers, first=False, base_due=False, max_staleness=8, fidelity=0.01, loss=500.0)
    assert out == {"idle": "within-budget", "big": "within-budget", "small": "cost"}
    assert policy.composite_cost(layers, {"small"}) == 3.0
    # no scale of its own: the same decisions with the loss (and so every cost) in other units
    scaled = {n: _st(s.cost * 1e-4, s.nbytes, s.progress * 1e-4) for n, s in layers.items()}
    assert policy.decide(scaled, first=False, base_due=False, max_staleness=8, fidelity=0.01, loss=0.05) == out
    # without a loss: NO_LOSS_INTERVALS (0.25) x the progress of 10 = 2.5 -> only idle fits
    out = policy.decide(layers, first=False, base_due=False, max_staleness=8, fidelity=0.01)
    assert out == {"idle": "within-budget", "big": "cost", "small": "cost"}


def test_policy_unknown_cost_staleness_and_frozen():
    layers = {"new": _st(math.inf), "old": _st(0.0, age=3), "frozen": _st(0.0, frozen=True, drift=0.0, unchanged=True),
              "thawed": _st(0.0, frozen=True, drift=0.2)}
    out = policy.decide(layers, first=False, base_due=False, max_staleness=3, fidelity=1.0, loss=1.0)
    assert out == {"new": "cost", "old": "stale", "frozen": "frozen", "thawed": "frozen-changed"}


def test_policy_threshold_rule_and_byte_cap():
    layers = {"a": _st(0, nbytes=60, drift=0.3), "b": _st(0, nbytes=60, drift=0.2), "c": _st(0, nbytes=60, drift=0.01)}
    out = policy.decide(layers, first=False, base_due=False, max_staleness=9, threshold=0.1)
    assert out == {"a": "drift", "b": "drift", "c": "below-threshold"}
    out = policy.decide(layers, first=False, base_due=False, max_staleness=9, threshold=0.1, budget_bytes=100)
    assert out == {"a": "drift", "b": "over-budget", "c": "below-threshold"}


# ------------------------------------------------------------------ tracker

def test_tracker_cost_is_first_order_progress_and_resets_on_commit():
    tr = DriftTracker(sample_per_layer=0)  # exact
    w = torch.zeros(4)
    g = torch.tensor([1.0, -2.0, 0.0, 0.5])
    s = tr.sample({"w": w}, {"w": g})
    m, snaps = tr.measure({"L": s})
    assert m["L"].cost == math.inf and m["L"].drift == math.inf  # nothing persisted yet
    tr.advance(snaps)
    tr.commit({"L": snaps["L"][0]})
    # one step of plain gradient descent: w -= 0.1 g, the gradient unchanged
    w2 = w - 0.1 * g
    m, snaps = tr.measure({"L": tr.sample({"w": w2}, {"w": g})})
    expect = 0.1 * float(g @ g)  # -<g, dw>
    assert m["L"].progress == pytest.approx(expect) and m["L"].cost == pytest.approx(expect)
    tr.advance(snaps)
    w3 = w2 - 0.1 * g
    m, snaps = tr.measure({"L": tr.sample({"w": w3}, {"w": g})})
    assert m["L"].progress == pytest.approx(expect) and m["L"].cost == pytest.approx(2 * expect)  # accumulates
    tr.advance(snaps)
    tr.commit({"L": snaps["L"][0]})  # persisted at w3
    m, _ = tr.measure({"L": tr.sample({"w": w3.clone()}, {"w": g})})
    assert m["L"].cost == 0.0 and m["L"].drift == 0.0


def test_tracker_samples_a_bounded_fixed_subset_in_cache_line_runs_and_scales_it_up():
    tr = DriftTracker(sample_per_layer=100)
    big = torch.randn(10_000)
    s = tr.sample({"big": big}, {"big": torch.ones(10_000)})
    views = s.w
    # 6 runs of 16 float32 (a 64-byte line each), spread over the tensor: 96 of the 100 elements allowed
    assert views[0].shape == (6, 16) and views[0].data_ptr() >= big.data_ptr()  # a view, no copy
    where = sampled_positions(sample_plan("big", 10_000, 4, 100, 10_000), 10_000)
    assert len(set(where)) == 96 and max(where) < 10_000 and max(where) - min(where) > 8_000
    assert torch.equal(views[0].reshape(-1), big[torch.tensor(where)])
    assert torch.equal(tr.sample({"big": big}, {}).w[0], views[0])  # the same elements every time
    assert s.scale == [10_000 / 96] and s.g[0].numel() == 96
    # bf16 runs are 32 elements long (the same 64 bytes); a tensor the budget covers is read whole
    assert sample_plan("big", 10_000, 2, 100, 10_000)[2:] == (3, 32)
    assert sample_plan("small", 40, 4, 100, 40) is None and sample_plan("small", 40, 4, 100, 10_000) == (4, 40, 1, 16)
    snap = tr.measure({"L": s})[1]["L"][0]
    assert snap[0].shape == (96,) and torch.equal(snap[0], views[0].reshape(-1))  # snapshots are flat copies


def test_the_native_gather_of_the_samples_is_the_views_bit_for_bit():
    """The tracker copies every layer's samples in one native pass (``gather_runs``): the same floats as the
    views it stands for, gradient averages divided as torch divides (no reciprocal), zeros where a tensor has
    no gradient average; and refused where the runs do not fill the buffer."""
    from layerckpt.select import _track

    require_native("the tracker's native kernels")
    torch.manual_seed(0)
    tr = DriftTracker(sample_per_layer=500)
    w = {"a": torch.randn(3000, 7), "b": torch.randn(8), "c": torch.randn(50, 90).t()}  # c: not contiguous
    g = {"a": torch.randn(3000, 7) * 1e-3, "c": torch.randn(50, 90).t()}
    s = tr.sample(w, g)
    s.gdiv = [0.1 ** 0.5, 1.0, 0.271]
    assert s.parts[0][1] is not None and s.parts[1][1] is None and s.gparts[1] is None  # b: read whole, no g
    assert s.parts[2][0].is_contiguous() and s.parts[2][1] is not None
    flat = _track._Flat.of({"L": s})
    native = _track._NATIVE
    try:
        _track._NATIVE = None  # the torch path: a copy per view
        ref = _track._Flat.of({"L": s})
    finally:
        _track._NATIVE = native
    assert torch.equal(flat.w, ref.w) and torch.equal(flat.g, ref.g)
    assert torch.equal(flat.w, torch.cat([v.reshape(-1) for v in s.w]))
    want_g = torch.cat([(_track._view(*s.gparts[0]) / s.gdiv[0]).reshape(-1), torch.zeros(8),
                        (_track._view(*s.gparts[2]) / s.gdiv[2]).reshape(-1)])
    assert torch.equal(flat.g, want_g)
    with pytest.raises(ValueError, match="dst has 400 bytes, the runs 396"):
        native.gather_runs(torch.empty(100).numpy(), [(w["b"].data_ptr(), 0, 99, 1, 99, 1.0)])
    with pytest.raises(ValueError, match="stride 3, count 2, run 4"):
        native.gather_runs(torch.empty(8).numpy(), [(w["b"].data_ptr(), 0, 3, 2, 4, 1.0)])


def test_the_native_sums_of_the_tracker_agree_with_torch_and_see_the_smallest_move():
    """Squared distances, squared norms and first-order steps, summed natively in double (``segsums``): as torch
    computes them, to float rounding; a tensor that moved by one subnormal step still counts as moved."""
    from layerckpt.select import _track

    require_native("the tracker's native kernels")
    torch.manual_seed(0)
    a = [torch.randn(n) for n in (1, 7, 4096, 10_001)]
    b = [x + torch.randn_like(x) * 1e-3 for x in a]
    native = _track._squares(a, b)
    saved = _track._NATIVE
    try:
        _track._NATIVE = None
        assert native == pytest.approx(_track._squares(a, b), rel=1e-5)
        assert _track._squares(a, None) == pytest.approx([float(x.double().square().sum()) for x in a], rel=1e-5)
    finally:
        _track._NATIVE = saved
    assert _track._squares(a, None) == pytest.approx([float(x.double().square().sum()) for x in a], rel=1e-12)
    tiny = a[3].clone()
    tiny[5000] = torch.nextafter(tiny[5000], torch.tensor(math.inf))  # one ulp at one element
    sub = torch.zeros(33)
    sub2 = sub.clone()
    sub2[32] = torch.finfo(torch.float32).smallest_normal / 2 ** 20  # a subnormal: its square underflows fp32
    one_ulp, subnormal, same = _track._squares([tiny, sub2, a[2]], [a[3], sub, a[2].clone()])
    assert one_ulp > 0.0 and subnormal > 0.0 and same == 0.0
    assert _track._squares([torch.empty(0), a[0]], [torch.empty(0), a[0]]) == [0.0, 0.0]  # an empty tensor: address 0
    # the steps over a flat arrangement: native against the torch path
    tr = DriftTracker(sample_per_layer=64)
    w = {"x": torch.randn(1000), "y": torch.randn(30)}
    g = {"x": torch.randn(1000), "y": torch.randn(30)}
    s1 = tr.sample(w, g)
    f1 = _track._Flat.of({"L": s1})
    w2 = {k: v + 0.01 * torch.randn_like(v) for k, v in w.items()}
    s2 = tr.sample(w2, {k: v * 0.9 for k, v in g.items()})
    f2 = _track._Flat.of({"L": s2})
    fast = _track._steps(f1, f2, {"L": s2})
    try:
        _track._NATIVE = None
        slow = _track._steps(f1, f2, {"L": s2})
    finally:
        _track._NATIVE = saved
    assert fast["L"] == pytest.approx(slow["L"], rel=1e-5) and fast["L"] != 0.0


# ------------------------------------------------------------------ layers

def test_layer_grouping_blocks_and_named_modules():
    model = torch.nn.Module()
    model.emb = torch.nn.Embedding(4, 2)
    model.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(2)])
    model.head = torch.nn.Linear(2, 2)
    names = [n for n, _ in model.named_parameters()]
    groups = group_layers(model, names)
    assert groups == {"emb": ["emb.weight"], "blocks.0": ["blocks.0.weight", "blocks.0.bias"],
                      "blocks.1": ["blocks.1.weight", "blocks.1.bias"], "head": ["head.weight", "head.bias"]}
    assert set(group_layers(model, names, {"blocks.*": "body"})) == {"body", "emb", "head"}
    assert set(group_layers(model, names, lambda n: n.split(".")[0])) == {"emb", "blocks", "head"}
    assert param_of("optim/blocks.0.weight/exp_avg") == "blocks.0.weight" and param_of("rng/torch") is None


# ------------------------------------------------------------------ codec

def test_codec_round_trips_plain_values_and_tensors_without_pickle():
    value = {"epoch": 3, "t": (1, 2.5, None), "ids": {1: "a", (2, 3): "b"}, "x": torch.arange(3), "l": [True, "s"]}
    out = []
    enc = encode(value, "extra", out, "extra")
    json.dumps(enc)  # JSON all the way
    assert [k for k, _ in out] == ["extra/x"] and tensor_refs(enc) == ["extra/x"]
    back = decode(enc, dict(out))
    assert back["t"] == (1, 2.5, None) and back["ids"] == {1: "a", (2, 3): "b"} and back["l"] == [True, "s"]
    assert torch.equal(back["x"], torch.arange(3))
    with pytest.raises(CheckpointError, match=r"extra\['f'\] is a builtins.builtin_function_or_method.*without pickling"):
        encode({"f": len}, "extra", [], "extra")


# ------------------------------------------------------------------ layout

def test_layout_is_a_4k_aligned_safetensors_image_ordered_by_element_size():
    entries = [("a", torch.zeros(3, dtype=torch.int8)), ("b", torch.zeros(5, dtype=torch.float64)),
               ("c", torch.zeros(2, 2, dtype=torch.float32))]
    lay = plan_layout(entries)
    assert len(lay.header) % 4096 == 0
    hlen = int.from_bytes(lay.header[:8], "little")
    meta = json.loads(lay.header[8:8 + hlen])
    assert [it.key for it in lay.items] == ["b", "c", "a"]  # 8-, 4-, 1-byte elements: every tensor aligned
    assert meta["b"]["data_offsets"] == [0, 40] and meta["c"]["data_offsets"] == [40, 56]
    assert lay.size == len(lay.header) + 59
    assert all(it.offset % it.tensor.element_size() == 0 for it in lay.items)


# ------------------------------------------------------------------ manifest

def _manifest_dict():
    return {"format": "layerckpt", "version": 1, "step": 7, "world_size": 1, "model": {"aliases": {}},
            "files": {"f": {"step": 5, "rank": 0, "size": 8192}},  # the file the layer's version of step 5 is in
            "tensors": {"model/w": {"file": "f", "dtype": "F32", "shape": [2, 3], "offset": 4096, "nbytes": 24,
                                    "crc": 1}},
            "layers": {"w": {"step": 5, "file": "f", "tensors": ["model/w"], "nbytes": 24, "age": 1}}}


def test_manifest_validates_in_one_place_and_round_trips():
    m = Manifest.from_dict(_manifest_dict(), "m.json")
    assert m.layers["w"].age == 1 and m.steps_behind() == {"w": 2} and m.lag is None
    again = Manifest.from_dict(json.loads(m.to_json()), "m.json")
    assert again == m
    d = m.to_dict()  # the same document as to_json, as a copy: changing it leaves the manifest alone
    assert d == json.loads(m.to_json())
    d["tensors"]["model/w"]["shape"].append(7)
    d["files"].clear()
    assert m.tensors["model/w"].shape == [2, 3] and m.files and Manifest.from_dict(m.to_dict(), "m.json") == m
    bad = _manifest_dict()
    bad["tensors"]["model/w"]["nbytes"] = 25
    with pytest.raises(CheckpointCorruptError, match=r"'model/w' has shape \[2, 3\] and dtype F32 but 25 bytes"):
        Manifest.from_dict(bad, "m.json")
    bad = _manifest_dict()
    bad["tensors"]["model/w"]["file"] = "g"
    with pytest.raises(CheckpointCorruptError, match="points to file 'g' that the manifest does not list"):
        Manifest.from_dict(bad, "m.json")
    bad = _manifest_dict()
    bad["layers"]["w"]["step"] = 7  # the layer said current, its bytes in the file of step 5
    with pytest.raises(CheckpointCorruptError, match=r"tensor 'model/w' of layer 'w', which the manifest records at "
                                                     r"step 7, is in file 'f' of step 5"):
        Manifest.from_dict(bad, "m.json")
    bad = _manifest_dict()
    bad["version"] = 99
    with pytest.raises(CheckpointCorruptError, match="newer than this layerckpt reads"):
        Manifest.from_dict(bad, "m.json")


def test_policy_fidelity_writes_the_smallest_moved_layers_whatever_their_cost():
    """The smallest layers whose bytes together stay within SMALL_SHARE (0.1%) of the state's are written when
    they moved, though their cost fits the allowance (skipping a final LayerNorm saves nothing); the rest are
    chosen as before, and neither the threshold rule nor an unchanged or frozen layer is touched."""
    layers = {"body": _st(0.0, nbytes=99_000), "ln_f": _st(0.001, nbytes=60), "scalar": _st(0.0, nbytes=4),
              "norm": _st(0.0, nbytes=40), "idle": _st(0.0, nbytes=900, drift=0.0, unchanged=True),
              "head": _st(0.001, nbytes=120)}
    # 0.1% of the 100,124 bytes is 100.1: scalar (4), norm (40) and ln_f (60) would be 104, so ln_f stays open
    out = policy.decide(layers, first=False, base_due=False, max_staleness=8, fidelity=0.01, loss=1.0)
    assert out == {"body": "within-budget", "ln_f": "within-budget", "scalar": "small", "norm": "small",
                   "idle": "unchanged", "head": "within-budget"}
    layers["body"] = _st(0.0, nbytes=300_000)  # now 301 bytes of room: the four small ones (224) go
    out = policy.decide(layers, first=False, base_due=False, max_staleness=8, fidelity=0.01, loss=1.0)
    assert {n for n, why in out.items() if why == "small"} == {"ln_f", "scalar", "norm", "head"}
    assert "small" in policy.WRITE and out["body"] == "within-budget" and out["idle"] == "unchanged"
    out = policy.decide(layers, first=False, base_due=False, max_staleness=8, threshold=0.5)
    assert "small" not in out.values()
    # a frozen base does not widen the room: a LoRA's adapters are the trained bytes, not a share of the base
    layers["body"] = _st(0.0, nbytes=99_000)
    layers["base"] = _st(0.0, nbytes=10 ** 9, frozen=True, drift=0.0, unchanged=True)
    out = policy.decide(layers, first=False, base_due=False, max_staleness=8, fidelity=0.01, loss=1.0)
    assert {n for n, why in out.items() if why == "small"} == {"scalar", "norm"} and out["base"] == "frozen"
