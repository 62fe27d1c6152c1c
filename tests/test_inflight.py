"""Selective saves in flight together (Config.max_inflight > 1): each plans on the one before it, and
what it carries from a save still in flight is filled in when that one commits; if that one fails, so
does every save built on it, and the next builds on the last committed checkpoint."""
import threading

import pytest
import torch

import layerckpt
from layerckpt import _faults
from conftest import assert_same_tensors, small_model

CFG = layerckpt.Config(threshold=0.05, max_inflight=4, keep_last=0)


def _move(model, names, step):
    with torch.no_grad():
        for n in names:
            for p in getattr(model.h, n).parameters():
                p.add_(0.5 * step)


@pytest.fixture
def gate():
    """Hold the flusher at its first save until released, so the next saves queue up behind it."""
    go, calls = threading.Event(), []

    def hook():
        calls.append(1)
        if len(calls) == 1:
            assert go.wait(30)

    _faults.install("flush.written", hook)
    yield go
    go.set()
    _faults.remove("flush.written")


def test_selective_saves_in_flight_together_restore_bit_for_bit(tmp_path, gate):
    model = small_model()
    snaps, pend = {}, []
    with layerckpt.Checkpointer(tmp_path, model, config=CFG) as ck:
        for step, moved in ((1, []), (2, ["1", "3"]), (3, ["1"]), (4, ["0"])):
            _move(model, moved, step)
            snaps[step] = {k: v.clone() for k, v in model.state_dict().items()}
            pend.append(ck.save(step))
        assert not any(p.done() for p in pend)  # all four in flight at once
        gate.set()
        for p in pend:
            p.wait()
    assert [p.layers_persisted for p in pend][1:] == [2, 1, 1]
    for step in (1, 2, 3, 4):
        m2 = small_model(seed=5)
        r = layerckpt.restore(tmp_path, m2, step=step, strict=False)
        assert_same_tensors(m2.state_dict(), snaps[step])
    # step 4 carries h.3 from step 2 and h.1 from step 3, both in flight when it was planned
    assert r.layers["h.3"] == 2 and r.layers["h.1"] == 3 and r.layers["h.0"] == 4 and r.layers["h.2"] == 1


def test_a_failed_save_fails_those_built_on_it(tmp_path):
    model = small_model()
    calls = []
    go = threading.Event()

    def hook():
        calls.append(1)
        if len(calls) == 1:
            assert go.wait(30)
        if len(calls) == 2:
            raise OSError(5, "injected", "x")

    _faults.install("flush.written", hook)
    try:
        with layerckpt.Checkpointer(tmp_path, model, config=CFG) as ck:
            ck.save(1)
            _move(model, ["1"], 2)
            p2 = ck.save(2)
            _move(model, ["3"], 3)
            p3 = ck.save(3)  # carries h.1 from step 2, still in flight
            go.set()
            with pytest.raises(layerckpt.CheckpointError):
                p2.wait()
            with pytest.raises(layerckpt.CheckpointError, match=r"step 3 was not committed: it carries layer "
                                                                r"'h\.1' from a save before it that failed"):
                p3.wait()
            want = {k: v.clone() for k, v in model.state_dict().items()}
            p5 = ck.save(5)  # builds on step 1, the last committed: rewrites h.1 and h.3
            p5.wait()
    finally:
        _faults.remove("flush.written")
    assert p5.layers_persisted == 2
    m2 = small_model(seed=5)
    r = layerckpt.restore(tmp_path, m2, strict=False)
    assert r.step == 5
    assert_same_tensors(m2.state_dict(), want)
