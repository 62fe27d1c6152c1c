"""Save and restore, bit for bit, through both backends."""
import json
import os
import random

import numpy as np
import pytest
import torch
from safetensors import safe_open

import layerckpt
from conftest import assert_same_optimizer, assert_same_state, small_model, trained

pytestmark = pytest.mark.usefixtures("backend")


@pytest.mark.parametrize("opt_cls,kw", [
    (torch.optim.AdamW, {"lr": 1e-3}),
    (torch.optim.Adam, {"lr": 1e-3, "betas": (0.8, 0.9)}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
])
def test_model_and_optimizer_bit_exact(tmp_path, opt_cls, kw):
    model, opt = trained(0, opt_cls, **kw)
    with layerckpt.Checkpointer(tmp_path, model, opt) as ck:
        p = ck.save(7)
        assert p.wait() is p and p.bytes_written > 0
    fresh = small_model(seed=5)
    fresh_opt = opt_cls(fresh.parameters(), **kw)
    report = layerckpt.restore(tmp_path, fresh, fresh_opt)
    assert report.step == 7
    assert_same_state(model, fresh)
    assert_same_optimizer(opt, fresh_opt)
    assert fresh.lm_head.weight is fresh.wte.weight  # ties survive
    assert set(report.layers) >= {"wte", "wpe", "h.0", "h.3", "ln_f"} and set(report.layers.values()) == {7}
    # training goes on identically from both
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for m, o in ((model, opt), (fresh, fresh_opt)):
        torch.nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
        o.step()
    assert_same_state(model, fresh)


def test_awkward_tensors_round_trip(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    extra = {
        "noncontig": base.t(),
        "strided": base[:, ::2],
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 3),
        "bf16": torch.randn(5, 7).to(torch.bfloat16),
        "fp16": torch.randn(3).half(),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "i64": torch.tensor([2**62, -1]),
        "bool": torch.tensor([True, False, True]),
        "u8": torch.arange(255, dtype=torch.uint8),
        "shared_a": base[0], "shared_b": base[1:3],  # views of one storage
        "nested": {"list": [1, 2.5, None, "s", (1, 2)], "t": torch.ones(2, 2), 3: "int key"},
        "ndarray": np.arange(6, dtype=np.int32).reshape(2, 3),
    }
    model = small_model()
    with layerckpt.Checkpointer(tmp_path, model) as ck:
        ck.save(1, extra=extra).wait()
    r = layerckpt.restore(tmp_path, small_model(9))
    got = r.extra
    for k, v in extra.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            assert torch.equal(got[k], v), k
    assert got["nested"]["list"] == [1, 2.5, None, "s", (1, 2)]
    assert torch.equal(got["nested"]["t"], torch.ones(2, 2)) and got["nested"][3] == "int key"
    assert isinstance(got["ndarray"], np.ndarray) and (got["ndarray"] == extra["ndarray"]).all()


def test_module_buffers_of_every_dtype(tmp_path):
    class M(torch.nn.Module):
        def __init__(self, fill):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)
            self.register_buffer("count", torch.tensor(fill, dtype=torch.int64))
            self.register_buffer("mask", torch.tensor([True, fill % 2 == 0]))
            self.register_buffer("f16", torch.full((2, 2), float(fill), dtype=torch.float16))
            self.register_buffer("b16", torch.full((3,), float(fill), dtype=torch.bfloat16))
            self.register_buffer("empty", torch.empty(0))

    a, b = M(3), M(8)
    with layerckpt.Checkpointer(tmp_path, a) as ck:
        ck.save(0).wait()
    layerckpt.restore(tmp_path, b)
    assert_same_state(a, b)


def test_data_file_is_valid_aligned_safetensors(tmp_path):
    """With encoding off a data file holds every tensor as it is (see test_encode for encoded files)."""
    model, opt = trained()
    with layerckpt.Checkpointer(tmp_path, model, opt, config=layerckpt.Config(encoding="off")) as ck:
        p = ck.save(3).wait()
    data = os.listdir(tmp_path / "data")
    assert data == ["step-00000003.rank0.safetensors"]
    path = tmp_path / "data" / data[0]
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert (8 + header_len) % 4096 == 0  # tensor data starts 4 KiB aligned
    assert os.path.getsize(path) == p.bytes_written
    names = {n: p for n, p in model.named_parameters()}
    with safe_open(str(path), "pt") as f:
        for n, t in model.state_dict().items():
            if n != "lm_head.weight":  # tied: stored once
                assert torch.equal(f.get_tensor(f"model/{n}"), t), n
        st = opt.state[names["h.1.c_fc.weight"]]
        assert torch.equal(f.get_tensor("optim/h.1.c_fc.weight/exp_avg_sq"), st["exp_avg_sq"])


def test_rng_states_restored(tmp_path):
    model = small_model()
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    with layerckpt.Checkpointer(tmp_path, model) as ck:
        ck.save(0).wait()
    expect = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    layerckpt.restore(tmp_path, model)
    got = (random.random(), np.random.rand(), torch.rand(1))
    assert expect[0] == got[0] and expect[1] == got[1] and torch.equal(expect[2], got[2])


def test_back_pressure_small_pool_and_many_saves(tmp_path):
    model, opt = trained()
    cfg = layerckpt.Config(staging_bytes="16KiB", chunk_bytes="4KiB", keep_last=2, threshold=0.0, encoding="delta")
    with layerckpt.Checkpointer(tmp_path, model, opt, config=cfg) as ck:
        for step in range(1, 5):
            ck.save(step).wait()
            assert ck.pool.allocated_bytes <= 16 * 1024  # never past the bound
    # keep_last=2: only the last two composites remain, and their files only: their own, and the first save's,
    # which holds the self-contained versions their tensors are delta-encoded against
    assert sorted(os.listdir(tmp_path / "manifests")) == ["step-00000003.json", "step-00000004.json"]
    assert sorted(os.listdir(tmp_path / "data")) == ["step-00000001.rank0.safetensors",
                                                       "step-00000003.rank0.safetensors",
                                                       "step-00000004.rank0.safetensors"]
    m = json.loads((tmp_path / "manifests" / "step-00000004.json").read_text())
    assert {t["enc"]["ref"]["file"] for t in m["tensors"].values() if t["enc"]["ref"]} == {
        "step-00000001.rank0.safetensors"}
    assert (tmp_path / "latest").read_text().strip() == "step-00000004.json"
    fresh, fopt = small_model(3), torch.optim.AdamW(small_model(3).parameters())
    fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    assert layerckpt.restore(tmp_path, fresh, fopt, step=3, config=cfg).step == 3
    assert_same_state(model, fresh)
    assert_same_optimizer(opt, fopt)


def test_pipelined_saves_and_resave_of_a_committed_step(tmp_path):
    model = small_model()
    cfg = layerckpt.Config(max_inflight=2, keep_last=0, threshold=0.0)
    with layerckpt.Checkpointer(tmp_path, model, config=cfg) as ck:
        pend = []
        for step in (1, 2, 3):
            with torch.no_grad():
                model.wte.weight.fill_(step)
            pend.append(ck.save(step))  # staged: later changes do not leak into it
        for p in pend:
            p.wait()
        with torch.no_grad():
            model.wte.weight.fill_(20)
        ck.save(2).wait()  # the same step again: a new file, the old one untouched until the commit
    m = json.loads((tmp_path / "manifests" / "step-00000002.json").read_text())
    assert [f for f, e in m["files"].items() if e["step"] == 2] == ["step-00000002.v1.rank0.safetensors"]
    assert {t["file"] for t in m["tensors"].values()} == {"step-00000002.v1.rank0.safetensors"}  # the rest: refs
    for step, fill in ((1, 1.0), (2, 20.0), (3, 3.0)):
        out = small_model(4)
        layerckpt.restore(tmp_path, out, step=step)
        assert torch.all(out.wte.weight == fill), step
    # the newest *committed* is the re-saved step 2, not the highest step
    out = small_model(4)
    assert layerckpt.restore(tmp_path, out).step == 2


def test_config_yaml_and_validation(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("layerckpt:\n  keep_last: 5\n  chunk_bytes: 8MiB\n  backend: threads\n")
    cfg = layerckpt.Config.from_yaml(y)
    assert cfg.keep_last == 5 and cfg.chunk_bytes == 8 << 20 and cfg.backend == "threads"
    y.write_text("keep_lsat: 5\n")
    with pytest.raises(layerckpt.ConfigError, match="keep_lsat"):
        layerckpt.Config.from_yaml(y)
    for kw, field in [({"threshold": -1}, "threshold"), ({"max_staleness": 0}, "max_staleness"),
                      ({"chunk_bytes": 1000}, "chunk_bytes"), ({"queue_depth": 0}, "queue_depth"),
                      ({"staging_bytes": "lots"}, "staging_bytes"), ({"backend": "fast"}, "backend"),
                      ({"keep_last": 1.5}, "keep_last"), ({"direct_io": "yes"}, "direct_io")]:
        with pytest.raises(layerckpt.ConfigError, match=f"Config.{field}"):
            layerckpt.Config(**kw)


def test_bad_arguments_are_refused(tmp_path):
    model = small_model()
    with pytest.raises(layerckpt.CheckpointError, match="model must be"):
        layerckpt.Checkpointer(tmp_path, "not a model")
    with layerckpt.Checkpointer(tmp_path, model) as ck:
        with pytest.raises(layerckpt.CheckpointError, match="step must be a non-negative int"):
            ck.save(-1)
        with pytest.raises(layerckpt.CheckpointError, match=r"extra\['obj'\] is a .*object.*without pickling"):
            ck.save(1, extra={"obj": object()})
        ck.save(2).wait()  # a refused save leaves the Checkpointer usable
    with pytest.raises(layerckpt.CheckpointError, match="closed"):
        ck.save(3)


def test_module_extra_state_round_trips(tmp_path):
    class WithExtra(torch.nn.Module):
        def __init__(self, tag):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.tag = tag

        def get_extra_state(self):
            return {"tag": self.tag, "table": torch.arange(3) * len(self.tag)}

        def set_extra_state(self, state):
            self.tag = state["tag"]
            self.table = state["table"]

    a = torch.nn.Sequential(WithExtra("trained"))
    with layerckpt.Checkpointer(tmp_path, a) as ck:
        ck.save(0).wait()
    b = torch.nn.Sequential(WithExtra("fresh"))
    layerckpt.restore(tmp_path, b)
    assert b[0].tag == "trained" and torch.equal(b[0].table, torch.arange(3) * 7)
    assert torch.equal(b[0].lin.weight, a[0].lin.weight)


EXIT_WITHOUT_CLOSE = r"""
import sys, torch, layerckpt
model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(16)])
ck = layerckpt.Checkpointer(sys.argv[1], model, config=layerckpt.Config(threshold=0.0))
ck.save(5)  # neither wait() nor close(): the interpreter exits while the flush runs
"""


def test_flush_in_flight_completes_at_normal_exit(tmp_path):
    from conftest import run_py

    r = run_py(EXIT_WITHOUT_CLOSE, str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "manifests" / "step-00000005.json").exists()
    out = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(16)])
    assert layerckpt.restore(tmp_path, out).step == 5
