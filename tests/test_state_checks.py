"""Issue 26, items 4 and 9: optimizer state recorded with another shape or dtype than its parameter is refused
before anything is loaded; save() refuses an ``extra`` it could not store and read back, naming the key."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import layerckpt
from layerckpt.errors import CheckpointError, CheckpointMismatchError


def tiny(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))


def trained(make_opt, seed: int = 0, steps: int = 2):
    model = tiny(seed)
    opt = make_opt(model.parameters())
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(3, 8)).square().sum().backward()
        opt.step()
    return model, opt


def saved(tmp_path, make_opt):
    """A store holding one step of a trained model and its optimizer; returns (root, manifest, model, opt)."""
    root = tmp_path / "ck"
    model, opt = trained(make_opt)
    with layerckpt.Checkpointer(root, model, opt, config=layerckpt.Config(full=True)) as ck:
        ck.save(1).wait()
    return root, root / "manifests" / "step-00000001.json", model, opt


def edit_tensor(mpath, key, **fields) -> None:
    """Change a tensor's manifest entry (dtype or shape of as many bytes: its checksum still matches)."""
    d = json.loads(mpath.read_text())
    d["tensors"][key].update(fields)
    mpath.write_text(json.dumps(d))


def snapshot(model, opt):
    """Bit-for-bit copies of the model's and the optimizer's state."""
    def copy(v):
        return v.detach().clone() if isinstance(v, torch.Tensor) else v
    return ({k: copy(v) for k, v in model.state_dict().items()},
            {i: {k: copy(v) for k, v in st.items()} for i, st in opt.state_dict()["state"].items()},
            json.dumps(opt.state_dict()["param_groups"], default=str))


def same(a, b) -> None:
    """Two snapshots are equal bit for bit."""
    def eq(x, y):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x.view(torch.uint8) if x.dim() else x.reshape(1).view(torch.uint8),
                               y.view(torch.uint8) if y.dim() else y.reshape(1).view(torch.uint8))
        else:
            assert x == y
    assert a[0].keys() == b[0].keys() and a[1].keys() == b[1].keys() and a[2] == b[2]
    for k in a[0]:
        eq(a[0][k], b[0][k])
    for i in a[1]:
        assert a[1][i].keys() == b[1][i].keys()
        for k in a[1][i]:
            eq(a[1][i][k], b[1][i][k])


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


def sgd(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


# -- 4: optimizer state against its parameter ------------------------------------------------------------------

@pytest.mark.parametrize("fields, shown", [
    ({"dtype": "I32"}, "checkpoint (8, 8) I32, expected (8, 8) F32"),
    ({"shape": [4, 16]}, "checkpoint (4, 16) F32, expected (8, 8) F32"),
    ({"shape": [64]}, "checkpoint (64,) F32, expected (8, 8) F32"),
])
def test_adam_state_of_another_dtype_or_shape_is_refused_before_anything_loads(tmp_path, fields, shown):
    root, mpath, _, _ = saved(tmp_path, adam)
    edit_tensor(mpath, "optim/0.weight/exp_avg", **fields)
    model, opt = trained(adam, seed=1, steps=1)  # state of its own, which must survive the refusal
    before = snapshot(model, opt)
    with pytest.raises(CheckpointMismatchError) as e:
        layerckpt.restore(root, model, opt)
    assert "optimizer.state[0.weight]['exp_avg']" in str(e.value)
    assert shown in str(e.value), str(e.value)
    assert len(e.value.mismatched) == 1
    same(before, snapshot(model, opt))


def test_a_step_that_is_not_a_scalar_is_refused(tmp_path):
    root, mpath, _, _ = saved(tmp_path, adam)
    d = json.loads(mpath.read_text())
    d["optimizer"]["state"]["1.bias"]["step"] = [1, 2]
    mpath.write_text(json.dumps(d))
    model, opt = trained(adam, seed=1, steps=1)
    before = snapshot(model, opt)
    with pytest.raises(CheckpointMismatchError, match=r"optimizer.state\[1.bias\]\['step'\]: checkpoint a list, "
                                                      r"expected a number or a one-element tensor"):
        layerckpt.restore(root, model, opt)
    same(before, snapshot(model, opt))


def test_sgd_momentum_of_another_shape_is_refused_also_with_strict_false(tmp_path):
    root, mpath, _, _ = saved(tmp_path, sgd)
    edit_tensor(mpath, "optim/1.weight/momentum_buffer", shape=[8, 4])
    model, opt = trained(sgd, seed=1, steps=1)
    before = snapshot(model, opt)
    with pytest.raises(CheckpointMismatchError, match=r"optimizer.state\[1.weight\]\['momentum_buffer'\]: "
                                                      r"checkpoint \(8, 4\) F32, expected \(4, 8\) F32"):
        layerckpt.restore(root, model, opt, strict=False)
    same(before, snapshot(model, opt))


@pytest.mark.parametrize("make_opt", [adam, sgd, lambda p: torch.optim.AdamW(p, lr=0.01, amsgrad=True),
                                      lambda p: torch.optim.ASGD(p, lr=0.01), lambda p: torch.optim.NAdam(p)],
                         ids=["adam", "sgd-momentum", "adamw-amsgrad", "asgd", "nadam"])
def test_a_matching_state_restores_bit_for_bit(tmp_path, make_opt):
    root, _, model, opt = saved(tmp_path, make_opt)
    want = snapshot(model, opt)
    model2, opt2 = trained(make_opt, seed=1, steps=1)
    layerckpt.restore(root, model2, opt2)
    same(want, snapshot(model2, opt2))


class _Custom(torch.optim.SGD):
    """Not one of torch's own classes: the generic rule applies."""


def _custom(params):
    return _Custom(params, lr=0.01, momentum=0.9)


def test_an_unknown_optimizer_gets_the_generic_rule(tmp_path):
    root, mpath, model, opt = saved(tmp_path, _custom)
    want = snapshot(model, opt)
    model2, opt2 = trained(_custom, seed=1, steps=1)
    layerckpt.restore(root, model2, opt2)
    same(want, snapshot(model2, opt2))
    edit_tensor(mpath, "optim/0.weight/momentum_buffer", dtype="I32")  # an integer state is left alone
    layerckpt.read_checkpoint(root)
    edit_tensor(mpath, "optim/0.weight/momentum_buffer", dtype="F32", shape=[4, 16])  # same size, other shape
    before = snapshot(model2, opt2)
    with pytest.raises(CheckpointMismatchError, match=r"optimizer.state\[0.weight\]\['momentum_buffer'\]"):
        layerckpt.restore(root, model2, opt2)
    same(before, snapshot(model2, opt2))


# -- 9: extra refused at save() --------------------------------------------------------------------------------

BAD_EXTRA = [
    ({"sched": {"x": torch.empty(3, device="meta")}}, "extra['sched']['x']", "meta device"),
    ({"s": torch.eye(3).to_sparse()}, "extra['s']", "sparse_coo tensor"),
    ({"s": torch.eye(3).to_sparse_csr()}, "extra['s']", "sparse_csr tensor"),
    ({"n": 10 ** 5000}, "extra['n']", "more than 100 digits"),
    ({"n": -10 ** 100}, "extra['n']", "more than 100 digits"),
    ({"l": [1, 2, 10 ** 100]}, "extra['l'][2]", "more than 100 digits"),
    ({"d": {10 ** 200: 1}}, "extra['d'] key", "more than 100 digits"),
    ({"d": {float("nan"): 1}}, "extra['d']", "NaN dict key"),
    ({"d": {(1, float("nan")): 1}}, "extra['d']", "NaN dict key"),
    ({"d": {(1, torch.zeros(1)): 1}}, "extra['d']", "of type Tensor"),
    ({"d": {np.int64(3): 1}}, "extra['d']", "of type int64"),
    ({"c": torch.zeros(2, dtype=torch.complex64)}, "extra['c']", "complex64"),
    ({"a": np.array([object()])}, "extra['a']", "dtype object"),
    ({"o": {"p": object()}}, "extra['o']['p']", "cannot store without pickling"),
    ({"g": np.complex128(1j)}, "extra['g']", "complex"),
    ({"a/b": torch.ones(2), "a": {"b": torch.zeros(3)}}, "'extra/a/b'", "rename one of them"),
]


@pytest.mark.parametrize("extra, where, why", BAD_EXTRA, ids=[f"{i}" for i in range(len(BAD_EXTRA))])
def test_bad_extra_is_refused_at_save_naming_the_key(tmp_path, extra, where, why):
    root = tmp_path / "ck"
    model = tiny()
    with layerckpt.Checkpointer(root, model, config=layerckpt.Config(full=True)) as ck:
        with pytest.raises(CheckpointError) as e:
            ck.save(1, extra)
        assert where in str(e.value) and why in str(e.value), str(e.value)
        assert os.listdir(root / "manifests") == [] and os.listdir(root / "data") == []
        ck.save(2, {"fine": {1: 2.5, "x": [float("nan"), 10 ** 99]}}).wait()  # the checkpointer goes on
    r = layerckpt.restore(root, tiny(1))
    assert r.step == 2 and r.extra["fine"][1] == 2.5 and r.extra["fine"]["x"][1] == 10 ** 99
