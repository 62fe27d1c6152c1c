"""Lazy staging: save() returns once the plan is taken, the copies run in the background, and the
optimizer's step waits for them, so every checkpoint holds the state of its step bit for bit."""
import threading
import time
import types

import pytest
import torch

import layerckpt
from layerckpt import _faults
from conftest import assert_same_optimizer_state, assert_same_tensors, trained


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (2, 16), generator=g)


def _loss(model, x):
    return model(x).float().logsumexp(-1).mean()


@pytest.fixture
def held():
    """Hold the stager after its copies, before it declares the image complete, until released."""
    reached, go = threading.Event(), threading.Event()

    def hook():
        reached.set()
        assert go.wait(30)

    _faults.install("stage.copied", hook)
    yield reached, go
    go.set()
    _faults.remove("stage.copied")


@pytest.fixture
def step_waits():
    """``waiting`` is set, and ``began`` gets the time (``time.perf_counter()``), each time an optimizer step
    begins waiting for a save's copies."""
    marks = types.SimpleNamespace(waiting=threading.Event(), began=[])

    def hook():
        marks.began.append(time.perf_counter())
        marks.waiting.set()

    _faults.install("stage.step-waits", hook)
    yield marks
    _faults.remove("stage.step-waits")


def _snapshot(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {"state": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                       for i, s in opt.state_dict()["state"].items()},
             "param_groups": opt.state_dict()["param_groups"]})


@pytest.mark.parametrize("with_closure", [False, True])
def test_the_step_waits_for_the_copies(tmp_path, held, step_waits, with_closure):
    reached, go = held
    model, opt = trained()
    ck = layerckpt.Checkpointer(str(tmp_path), model, opt, layerckpt.Config(threshold=0.0))
    want_model, want_opt = _snapshot(model, opt)
    p = ck.save(7)
    assert reached.wait(30) and not p.done()  # save() returned while the copies are still held
    x = _batch(1)
    ran = []

    def closure():
        opt.zero_grad()
        loss = _loss(model, x)
        loss.backward()
        ran.append(loss.item())
        return loss

    stepped = threading.Event()

    def step():
        if with_closure:  # Lightning's automatic optimization: forward and backward inside step()
            opt.step(closure)
        else:
            closure()
            opt.step()
        stepped.set()

    t = threading.Thread(target=step)
    t.start()
    assert step_waits.waiting.wait(30)  # the step waits for the copies, still held...
    assert ran  # ...once the closure (forward and backward) ran
    assert not stepped.wait(0.1) and not p.done()  # the update has not run: the copies are still held
    assert torch.equal(model.state_dict()["h.0.c_fc.weight"], want_model["h.0.c_fc.weight"])
    go.set()
    t.join(30)
    assert stepped.is_set()
    ck.close()
    assert not torch.equal(model.state_dict()["h.0.c_fc.weight"], want_model["h.0.c_fc.weight"])  # it stepped
    model2, opt2 = trained(seed=1)
    layerckpt.restore(str(tmp_path), model2, opt2)
    assert_same_tensors(model2.state_dict(), want_model)
    assert_same_optimizer_state(opt2.state_dict(), want_opt)


def test_buffers_are_copied_before_save_returns(tmp_path, held):
    """Forward passes update buffers (BatchNorm's running statistics) before the next step: those are
    copied by save() itself."""
    reached, go = held
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(16, 8)).sum().backward()
    opt.step()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    ck = layerckpt.Checkpointer(str(tmp_path), model, opt, layerckpt.Config(threshold=0.0))
    ck.save(1)
    assert reached.wait(30)
    model(torch.randn(16, 8) * 5)  # the running statistics move
    assert not torch.equal(model[1].running_mean, want["1.running_mean"])
    go.set()
    ck.close()
    model2 = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    layerckpt.restore(str(tmp_path), model2, torch.optim.SGD(model2.parameters(), lr=0.1))
    assert_same_tensors(model2.state_dict(), want)


def test_a_weight_changed_outside_the_step_fails_that_save_only(tmp_path, held):
    reached, go = held
    model, opt = trained()
    ck = layerckpt.Checkpointer(str(tmp_path), model, opt, layerckpt.Config(threshold=0.0))
    go.set()  # the first save goes through
    ck.save(1).wait()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    go.clear()
    reached.clear()
    p = ck.save(2)
    assert reached.wait(30)
    with torch.no_grad():
        model.h[0].c_fc.weight.add_(1.0)  # not through optimizer.step()
    go.set()
    with pytest.raises(layerckpt.CheckpointError, match=r"step 2 was not committed.*model/h\.0\.c_fc\.weight.*"
                                                        r"lazy_staging=False"):
        p.wait()
    ck.close()
    model2, opt2 = trained(seed=1)
    report = layerckpt.restore(str(tmp_path), model2, opt2)
    assert report.step == 1
    assert_same_tensors(model2.state_dict(), want)


def test_eager_staging_copies_before_returning(tmp_path):
    model, opt = trained()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with layerckpt.Checkpointer(str(tmp_path), model, opt, layerckpt.Config(threshold=0.0, lazy_staging=False)) as ck:
        ck.save(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    model2, opt2 = trained(seed=1)
    layerckpt.restore(str(tmp_path), model2, opt2)
    assert_same_tensors(model2.state_dict(), want)


def test_training_with_lazy_saves_every_step_matches_eager(tmp_path):
    """Saves every step, selective too, with the step right behind each save: lazy and eager staging
    commit the same bytes, and no thread outlives close()."""
    results = []
    for lazy in (True, False):
        model, opt = trained()
        d = tmp_path / str(lazy)
        with layerckpt.Checkpointer(str(d), model, opt, layerckpt.Config(lazy_staging=lazy)) as ck:
            for step in range(6):
                x = _batch(step)
                opt.zero_grad()
                loss = _loss(model, x)
                loss.backward()
                opt.step()
                ck.save(step, loss=loss)
        model2, opt2 = trained(seed=1)
        layerckpt.restore(str(d), model2, opt2)
        results.append((model2.state_dict(), opt2.state_dict()))
    assert_same_tensors(results[0][0], results[1][0])
    assert_same_optimizer_state(results[0][1], results[1][1])
    assert not [t for t in threading.enumerate() if t.name.startswith("layerckpt-stager")]


@pytest.fixture
def slow_copy():
    """The stager, its copies done, waits for the event ``go``, then takes ``SLOW`` seconds more (a sleep, on
    the stager thread) before it lets them go; ``released`` gets the time (``time.perf_counter()``) it does."""
    marks = types.SimpleNamespace(go=threading.Event(), released=[], done=threading.Event())

    def hook():
        assert marks.go.wait(30)
        time.sleep(SLOW)
        marks.released.append(time.perf_counter())
        marks.done.set()

    _faults.install("stage.copied", hook)
    yield marks
    marks.go.set()
    _faults.remove("stage.copied")


SLOW = 0.5


@pytest.mark.parametrize("with_closure", [False, True])
def test_the_step_wait_is_recorded_on_the_save(tmp_path, slow_copy, step_waits, with_closure):
    """What the optimizer's step waited for the copies lands on the save's handle (``step_wait_s``), apart
    from save()'s return (``stall_s``); what training paid is their sum.  The copies are let go ``SLOW``
    seconds after the step began waiting for them: the wait recorded is at least that span and at most
    the step's time outside its closure."""
    slow_copy.go = step_waits.waiting  # the copies' SLOW seconds start once the step waits for them
    model, opt = trained()
    ck = layerckpt.Checkpointer(str(tmp_path), model, opt, layerckpt.Config(threshold=0.0))
    p = ck.save(7)  # returns with the copies held: they wait for the step
    assert p.step_wait_s == 0.0 and p.save_return_s == p.stall_s and not p.done()
    x, span = _batch(1), []

    def closure():
        t = time.perf_counter()
        opt.zero_grad()
        loss = _loss(model, x)
        loss.backward()
        span.append((t, time.perf_counter()))
        return loss

    t0 = time.perf_counter()
    if with_closure:
        opt.step(closure)
    else:
        closure()
        opt.step()
    t1 = time.perf_counter()
    (began,), (released,), ((c0, c1),) = step_waits.began, slow_copy.released, span
    assert c1 <= began  # the step began waiting once its closure was over
    outside = (t1 - t0) - (c1 - c0)  # the step without the closure: the wait, then the update
    assert released - began <= p.step_wait_s <= outside, (released - began, p.step_wait_s, outside)
    assert p.step_wait_s >= SLOW
    assert p.blocked_s == p.stall_s + p.step_wait_s
    waited = p.step_wait_s
    opt.step()  # the copies are over: the next step waits for nothing and records nothing
    assert p.step_wait_s == waited and len(step_waits.began) == 1
    ck.close()
    assert p.wait().step_wait_s == waited


def test_the_closure_is_not_counted_as_a_step_wait(tmp_path, slow_copy, step_waits):
    """Lightning's automatic optimization runs forward and backward in a closure inside ``step()``: the
    copies may end while it runs, and the closure's time is not counted as waiting for them."""
    model, opt = trained()
    ck = layerckpt.Checkpointer(str(tmp_path), model, opt, layerckpt.Config(threshold=0.0))
    p = ck.save(7)
    x, ran = _batch(1), []

    def closure():
        t = time.perf_counter()
        slow_copy.go.set()
        opt.zero_grad()
        loss = _loss(model, x)
        loss.backward()
        assert slow_copy.done.wait(30)  # the closure lasts until the copies are let go, SLOW seconds
        ran.append(time.perf_counter() - t)
        return loss

    opt.step(closure)
    assert len(step_waits.began) == 1  # the step still waited (for the end of the save's staging) ...
    assert p.step_wait_s < ran[0], (p.step_wait_s, ran[0])  # ... and not for its closure's time
    assert ran[0] >= SLOW and p.blocked_s == p.stall_s + p.step_wait_s
    ck.close()
    assert p.wait().error is None


def test_eager_staging_records_no_step_wait(tmp_path, slow_copy):
    model, opt = trained()
    slow_copy.go.set()
    with layerckpt.Checkpointer(str(tmp_path), model, opt, layerckpt.Config(threshold=0.0, lazy_staging=False)) as ck:
        t0 = time.perf_counter()
        p = ck.save(1)
        assert p.stall_s >= SLOW and time.perf_counter() - t0 >= SLOW  # the copies ran inside save()
        opt.step()
    assert p.step_wait_s == 0.0 and p.blocked_s == p.stall_s
