"""Lightning's checkpoint dict beside the model and optimizer 0: every kind of value torch.load(weights_only=True)
accepts comes back from a layerckpt store exactly (type and value); anything that would need pickle is refused at
save time, naming its key."""
import collections
import math

import numpy as np
import pytest
import torch

import lightning  # noqa: F401
import layerckpt  # noqa: E402
from conftest import assert_same_tensors  # noqa: E402
from layerckpt.errors import CheckpointError  # noqa: E402
from lightning_layerckpt._state import EXTRA_KEY, KIND, StateModule, to_extra, to_lightning  # noqa: E402


def _accepted():
    return {
        "none": None, "flag": True, "count": 7, "big": 2 ** 62, "rate": 0.1, "inf": math.inf, "name": "run",
        "blob": b"\x00\xffraw", "buffer": bytearray(b"abc"), "z": complex(1.5, -2.0),
        "list": [1, "a", None], "tuple": (1, (2.5, "b")), "set": {3, 1, 2},
        "ordered": collections.OrderedDict([("b", 1), ("a", torch.arange(3))]),
        "counter": collections.Counter({"x": 2, "y": 5}),
        "int_keys": {0: "zero", 1: "one", (2, 3): "pair"},
        "size": torch.Size([4, 5]), "dtype": torch.bfloat16, "dtypes": [torch.float32, torch.int8, torch.bool],
        "device": torch.device("cpu"), "layout": torch.sparse_coo, "qscheme": torch.per_channel_affine,
        "tensor": torch.randn(3, 2, generator=torch.Generator().manual_seed(0)),
        "param": torch.nn.Parameter(torch.ones(2), requires_grad=False),
        "np_array": np.arange(6, dtype=np.int16).reshape(2, 3), "np_scalar": np.float32(0.25),
        "looks_tagged": {KIND: "size", "dims": [1]},  # a dict of the user's own with the tag's key
        "nested": {"loops": [{"state": {"epoch": 1}}], "hparams": {"lr": 1e-3, "betas": (0.9, 0.99)}},
    }


def _same(a, b, where="checkpoint"):
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
        if isinstance(a, torch.nn.Parameter):
            assert a.requires_grad == b.requires_grad, where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where  # order too (OrderedDict)
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_every_kind_weights_only_loading_accepts_round_trips_exactly(tmp_path):
    model = torch.nn.Linear(2, 2)
    ckpt = {"state_dict": model.state_dict(), "epoch": 3, "global_step": 12, "extra_state": _accepted()}
    # the reference: all of it loads under weights_only=True (numpy values: kept too, as before)
    torch.save({**ckpt, "extra_state": {k: v for k, v in _accepted().items() if not k.startswith("np_")}},
               tmp_path / "plain.ckpt")
    torch.load(tmp_path / "plain.ckpt", weights_only=True)
    with layerckpt.Checkpointer(tmp_path / "store", model) as ck:
        ck.save(12, extra=to_extra(ckpt, has_optimizer=False)).wait()
    back = to_lightning(layerckpt.read_checkpoint(tmp_path / "store"))
    back.pop("layerckpt")
    _same({k: v for k, v in back.items() if k != "state_dict"}, {k: v for k, v in ckpt.items() if k != "state_dict"})
    assert_same_tensors(back["state_dict"], model.state_dict())


class Custom:
    pass


@pytest.mark.parametrize("bad, key, kind", [
    (lambda x: x, "checkpoint['hyper_parameters']['fn']", "function"),
    (Custom(), "checkpoint['hyper_parameters']['fn']", "Custom"),
    (collections.namedtuple("Point", "x y")(1, 2), "checkpoint['hyper_parameters']['fn']", "Point"),
    ([1, {"deep": print}], "checkpoint['hyper_parameters']['fn'][1]['deep']", "builtin_function_or_method"),
    (np.array([object()], dtype=object), "checkpoint['hyper_parameters']['fn']", "ndarray"),
])
def test_a_value_that_needs_pickle_is_refused_naming_its_key(tmp_path, bad, key, kind):
    ckpt = {"state_dict": {}, "hyper_parameters": {"lr": 0.1, "fn": bad}}
    with pytest.raises(CheckpointError, match=r"layerckpt stores no pickles") as e:
        to_extra(ckpt, has_optimizer=False)
    assert str(e.value).startswith(f"{key} is a ") and kind in str(e.value)


def test_the_lightning_part_is_stored_under_its_key(tmp_path):
    extra = to_extra({"state_dict": {}, "optimizer_states": [{"a": 1}, {"b": 2}], "epoch": 1}, has_optimizer=True)
    assert list(extra) == [EXTRA_KEY] and extra[EXTRA_KEY]["optimizer_states"] == [None, {"b": 2}]
    assert StateModule({"w": torch.ones(1)}).state_dict()["w"].item() == 1.0
