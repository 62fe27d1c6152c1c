"""A newer Checkpointer of this process on a store takes over from the older one: the older one's saves
in flight end first (nothing in flight deleted, nothing committed lost), then it is closed and any later
save/keep/adopt on it says it was replaced.  Another live process is still refused; the writer lock is
never written through a symbolic link."""
import gc
import os
import socket
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch

import layerckpt
from conftest import assert_same_optimizer_state, assert_same_tensors, small_model, trained
from layerckpt import _faults, _registry
from test_reliability import HOLDER

CFG = layerckpt.Config(threshold=0.0, keep_last=0)
REPLACED = r"replaced by a newer Checkpointer on the same directory in this process"


def _flushers():
    return {t for t in threading.enumerate() if t.name == "layerckpt-flusher" and t.is_alive()}


def _snapshot(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {"state": {k: {n: t.clone() if torch.is_tensor(t) else t for n, t in s.items()}
                       for k, s in opt.state_dict()["state"].items()},
             "param_groups": opt.state_dict()["param_groups"]})


def _step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (2, 16), generator=g)
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _restored(root, step):
    model, opt = trained(7)  # other values everywhere: the restore must overwrite all of them
    layerckpt.restore(root, model, opt, step=step)
    return _snapshot(model, opt)


def _assert_restores(root, step, want):
    got = _restored(root, step)
    assert_same_tensors(got[0], want[0])
    assert_same_optimizer_state(got[1], want[1])


def _assert_replaced(old, root):
    with pytest.raises(layerckpt.CheckpointError, match=REPLACED) as ei:
        old.save(99)
    assert str(root) in str(ei.value)
    with pytest.raises(layerckpt.CheckpointError, match=REPLACED):
        old.keep([])
    with pytest.raises(layerckpt.CheckpointError, match=REPLACED):
        old.adopt(os.path.join(root, "manifests", "step-00000001.json"))
    old.wait()  # its saves had all ended: nothing to wait for, nothing to raise
    old.close()


@pytest.mark.parametrize("first", ["referenced", "unreachable", "collected"])
def test_a_new_checkpointer_takes_over_from_an_older_one_of_this_process(tmp_path, first):
    root = tmp_path / "ck"
    model, opt = trained(0)
    before = _flushers()
    begun, held = threading.Event(), threading.Event()
    if first != "collected":  # its commit waits until the new one takes over; a collected one finished it
        def hold():
            held.set()
            assert begun.wait(60)

        _faults.install("commit.before", hold)
        _faults.install("takeover.begun", begun.set)
    old = layerckpt.Checkpointer(root, model, opt, config=CFG)
    p1 = old.save(1)
    want1 = _snapshot(model, opt)
    if first != "collected":
        assert held.wait(60) and not p1.done()  # still flushing when the new one comes
    if first == "unreachable":  # garbage not collected yet: only the registry still reaches it
        gc.disable()
        old._cycle = old
    ref = weakref.ref(old)
    if first != "referenced":
        del old
    if first == "collected":
        gc.collect()
    assert (ref() is None) == (first == "collected")
    try:
        new = layerckpt.Checkpointer(root, model, opt, config=CFG)
    finally:
        gc.enable()
        begun.set()
        _faults.remove("commit.before")
        _faults.remove("takeover.begun")
    assert p1.done() and p1.error is None and p1.manifest_path is not None
    assert len(_flushers() - before) == 0  # the old flusher thread ended
    assert len(opt._optimizer_step_pre_hooks) == (1 if CFG.lazy_staging else 0)  # the new one's guard only
    _step(model, opt, 1)
    new.save(2).wait()
    want2 = _snapshot(model, opt)
    if first == "referenced":
        _assert_replaced(old, root)
    new.close()
    _assert_restores(root, 1, want1)
    _assert_restores(root, 2, want2)
    gc.collect()
    assert _registry._stores.get(str(root)) is None  # nothing of either left in the registry


def test_a_takeover_waits_for_the_older_ones_save_in_flight(tmp_path):
    root = tmp_path / "ck"
    model, opt = trained(0)
    go, held, begun = threading.Event(), threading.Event(), threading.Event()

    def hold():  # the first save's data is durable, its manifest not written yet
        held.set()
        assert go.wait(60)

    old = layerckpt.Checkpointer(root, model, opt, config=CFG)
    _faults.install("flush.written", hold)
    _faults.install("takeover.begun", begun.set)
    try:
        p1 = old.save(1)
        want1 = _snapshot(model, opt)
        assert held.wait(60)
        in_flight = sorted(os.listdir(root / "data"))
        assert in_flight == ["step-00000001.rank0.safetensors"] and os.listdir(root / "manifests") == []
        made = []
        opener = threading.Thread(target=lambda: made.append(layerckpt.Checkpointer(root, model, opt, config=CFG)))
        opener.start()
        assert begun.wait(60)  # the takeover began ...
        opener.join(0.2)
        assert opener.is_alive() and not made  # ... and waits for the save in flight ...
        assert sorted(os.listdir(root / "data")) == in_flight  # ... and its cleanup has not run
        _faults.remove("flush.written")
        go.set()
        opener.join(60)
        assert not opener.is_alive() and len(made) == 1
    finally:
        _faults.remove("flush.written")
        _faults.remove("takeover.begun")
        go.set()
    new = made[0]
    assert p1.done() and p1.error is None  # the first save committed
    assert sorted(os.listdir(root / "manifests")) == ["step-00000001.json"]
    _assert_replaced(old, root)
    _step(model, opt, 1)
    new.save(2).wait()  # the new one's next save commits
    want2 = _snapshot(model, opt)
    new.close()
    _assert_restores(root, 1, want1)
    _assert_restores(root, 2, want2)


def test_a_failed_save_of_the_older_one_keeps_its_error_and_the_takeover_goes_on(tmp_path):
    root = tmp_path / "ck"
    model = small_model()
    old = layerckpt.Checkpointer(root, model, config=CFG)
    old.save(1).wait()

    begun = threading.Event()

    def boom():  # fails once the new one is taking over
        assert begun.wait(60)
        raise OSError(5, "injected write failure")

    _faults.install("flush.written", boom)
    _faults.install("takeover.begun", begun.set)
    try:
        p2 = old.save(2)
        new = layerckpt.Checkpointer(root, model, config=CFG)
    finally:
        begun.set()
        _faults.remove("flush.written")
        _faults.remove("takeover.begun")
    assert p2.done()
    with pytest.raises(layerckpt.CheckpointWriteError, match=r"Input/output error .*step-00000002\.rank0"):
        p2.wait()  # the error stays with its PendingSave
    assert sorted(os.listdir(root / "manifests")) == ["step-00000001.json"]
    new.save(3).wait()
    new.close()
    assert layerckpt.restore(root, small_model()).step == 3


def test_another_live_process_is_still_refused(tmp_path):
    root, gate = tmp_path / "ck", tmp_path / "go"
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(root), str(gate)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "FLUSHING"
        data = sorted(os.listdir(root / "data"))
        assert data == ["step-00000001.rank0.safetensors"]
        for _ in range(2):  # and a refused opener leaves nothing in this process's registry to take over from
            with pytest.raises(layerckpt.CheckpointError,
                               match=rf"already has a writer \(pid {child.pid} on {socket.gethostname()}\)"):
                layerckpt.Checkpointer(root, small_model())
        assert str(root) not in _registry._stores
        assert sorted(os.listdir(root / "data")) == data  # the refused opener deleted nothing
        gate.touch()
        assert child.stdout.readline().strip() == "COMMITTED"
    finally:
        gate.touch()
        child.wait(timeout=60)
    out = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    assert layerckpt.restore(root, out).step == 1
    assert all(bool((p == 3.0).all()) for p in out.parameters())
    layerckpt.Checkpointer(root, small_model()).close()  # the holder is gone: the lock went with it


@pytest.mark.parametrize("target", ["existing", "dangling"])
def test_a_symlinked_writer_lock_is_refused_and_its_target_untouched(tmp_path, target):
    root = tmp_path / "ck"
    (root / "data").mkdir(parents=True)
    (root / "manifests").mkdir()
    victim = tmp_path / "victim"
    if target == "existing":
        victim.write_text("precious\n")
    os.symlink(victim, root / ".writer.lock")
    with pytest.raises(layerckpt.CheckpointError, match=r"\.writer\.lock is a symbolic link; layerckpt never writes "
                                                        r"through one: remove it"):
        layerckpt.Checkpointer(root, small_model())
    if target == "existing":
        assert victim.read_text() == "precious\n"
    else:
        assert not victim.exists()
    os.unlink(root / ".writer.lock")
    with layerckpt.Checkpointer(root, small_model(), config=CFG) as ck:  # the store itself was fine
        ck.save(1)
    assert layerckpt.restore(root, small_model()).step == 1


def test_a_writer_lock_that_is_not_a_plain_file_is_refused(tmp_path):
    root = tmp_path / "ck"
    root.mkdir()
    os.mkfifo(root / ".writer.lock")
    t = time.time()
    with pytest.raises(layerckpt.CheckpointError, match=r"\.writer\.lock is not a plain file; remove it"):
        layerckpt.Checkpointer(root, small_model())
    assert time.time() - t < 30  # no hang on the FIFO


RANKS = r"""
import os, sys, torch, torch.distributed as dist, layerckpt
rank, world, root, port, here = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=world)
sys.path.insert(0, here)
from conftest import trained
model, opt = trained(0)
cfg = layerckpt.Config(threshold=0.0, keep_last=0)
old = layerckpt.Checkpointer(root, model, opt, config=cfg)
p1 = old.save(1)  # every rank's save in flight: the ranks' flushers still have to agree
new = layerckpt.Checkpointer(root, model, opt, config=cfg)  # every rank takes over from its own
print("SAVE1", p1.done() and p1.error is None, flush=True)
try:
    old.save(9)
except layerckpt.CheckpointError as e:
    print("OLD", "replaced by a newer Checkpointer" in str(e), flush=True)
with torch.no_grad():
    model.h[1].c_fc.weight.add_(1.0)
print("SAVE2", new.save(2).wait().error is None, flush=True)
new.close()
dist.barrier()
dist.destroy_process_group()
"""


def test_every_rank_takes_over_from_its_own_older_checkpointer(tmp_path):
    root = tmp_path / "ck"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    here = os.path.dirname(__file__)
    procs = [subprocess.Popen([sys.executable, "-c", RANKS, str(r), "2", str(root), port, here],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        assert out.split() == ["SAVE1", "True", "OLD", "True", "SAVE2", "True"], out
    model, opt = trained(0)
    want1 = _snapshot(model, opt)
    _assert_restores(root, 1, want1)
    with torch.no_grad():
        model.h[1].c_fc.weight.add_(1.0)
    got = _restored(root, 2)
    assert_same_tensors(got[0], model.state_dict())
    assert sorted(os.listdir(root / "manifests")) == ["step-00000001.json", "step-00000002.json"]
