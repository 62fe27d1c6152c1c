"""SIGKILL during a flush: the last committed checkpoint always restores, bit for bit, and the next open removes
what the killed save left behind.

Each test checks that the kills really left torn state (a data file no manifest references) for the next open to
clean up.  The kills at random moments are matched by kills inside a flush that the child holds open for them
(at a random chunk of its saves), so torn state is there to clean up however fast or loaded the machine is."""
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import layerckpt

CHILD = r"""
import itertools, os, signal, sys, threading, torch, layerckpt
from layerckpt import _faults
root, step = sys.argv[1], int(sys.argv[2])
kill_point, kill_step = (sys.argv[3], int(sys.argv[4])) if len(sys.argv) > 3 else (None, None)
if kill_point == "hold":  # the kill_step-th chunk this process flushes waits there, and says so, for a kill
    chunks = itertools.count(1)  # from outside

    def hold():
        if next(chunks) == kill_step:
            print("HELD", step, flush=True)
            threading.Event().wait()

    _faults.install("flush.checksum", hold)
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(12)])  # ~12.6 MB a checkpoint
ck = layerckpt.Checkpointer(root, model, config=layerckpt.Config(threshold=0.0, keep_last=2, chunk_bytes="1MiB", queue_depth=4))
print("READY", flush=True)
while True:
    if step == kill_step and kill_point != "hold":  # the first time the save of kill_step reaches the point,
        _faults.install(kill_point, lambda: os.kill(os.getpid(), signal.SIGKILL))  # the process dies there
    with torch.no_grad():
        for i, m in enumerate(model):
            m.weight.fill_(step * 100 + i)
            m.bias.fill_(-step)
    ck.save(step).wait()
    print("COMMITTED", step, flush=True)
    step += 1
"""

# where a fault point kills the save of KILL_STEP: what of it is on disk then
POINTS = {
    "flush.checksum": "its data file open and partly written",
    "flush.written": "its data file whole and durable, the ranks not yet agreed",
    "commit.before": "its data file whole, its manifest not yet written",
}
KILL_STEP = 3
KILLS = 6  # kills per backend in the default run: half at random moments, half held inside a flush
HELD_CHUNK = 20  # a held kill waits at one of the first this many chunks its child flushes (2-14 a save)


def expected(step: int) -> torch.nn.Module:
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(12)])
    with torch.no_grad():
        for i, m in enumerate(model):
            m.weight.fill_(step * 100 + i)
            m.bias.fill_(-step)
    return model


def _committed(out: str):
    # a line the kill cut short is not a report
    return [int(f[1]) for f in map(str.split, out.splitlines()) if len(f) == 2 and f[0] == "COMMITTED" and f[1].isdigit()]


def _referenced(root: str) -> set:
    files = set()
    for n in os.listdir(os.path.join(root, "manifests")):
        assert n.endswith(".json"), n  # no *.tmp left behind
        with open(os.path.join(root, "manifests", n)) as f:
            files |= set(json.load(f)["files"])
    return files


def _check_and_clean(root: str, committed) -> tuple:
    """Restore after a kill (newest committed, bit for bit), then open the store again.  Returns the restored step
    (0: nothing committed yet) and the data files the open removed (the torn save's)."""
    data = set(os.listdir(os.path.join(root, "data")))
    model = expected(0)
    try:
        r = layerckpt.restore(root, model)
    except layerckpt.CheckpointNotFoundError:
        assert not committed, "a reported commit must be restorable"
        step = 0
    else:
        # the newest committed (a commit may land after its line was printed, never before)
        assert not committed or r.step >= committed[-1]
        for a, b in zip(model.state_dict().values(), expected(r.step).state_dict().values()):
            assert torch.equal(a, b)
        step = r.step
    layerckpt.Checkpointer(root, expected(0)).close()  # removes the leftovers of the torn save
    after = set(os.listdir(os.path.join(root, "data")))
    assert after == _referenced(root)
    return step, data - after


@pytest.mark.parametrize("point", list(POINTS))
def test_sigkill_at_each_flush_stage_leaves_a_torn_save_that_the_next_open_removes(tmp_path, backend, point):
    root = str(tmp_path / "ck")
    p = subprocess.run([sys.executable, "-c", CHILD, root, "1", point, str(KILL_STEP)], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    assert _committed(p.stdout) == list(range(1, KILL_STEP)), p.stdout
    torn_file = f"step-{KILL_STEP:08d}.rank0.safetensors"
    # the kill left the save of KILL_STEP torn: its data file there, no manifest for it
    assert torn_file in os.listdir(os.path.join(root, "data")), (point, POINTS[point])
    assert f"step-{KILL_STEP:08d}.json" not in os.listdir(os.path.join(root, "manifests"))
    step, removed = _check_and_clean(root, _committed(p.stdout))
    assert step == KILL_STEP - 1
    assert removed == {torn_file}, (point, POINTS[point])


def _lines(p: subprocess.Popen) -> queue.Queue:
    """The child's lines as they come, None at its end: a wait for one has a bound, so a child that stops
    talking fails the test instead of hanging it."""
    q: queue.Queue = queue.Queue()

    def pump():
        for line in p.stdout:
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def _random_kills(root: str, seed: int, kills: int) -> tuple:
    """Kill a saving child ``kills`` times: every other kill at a random moment from its first commit on, the
    others inside a flush (at a random chunk of its saves, where the child waits for the kill), each of which
    must leave its save's data file torn for the next open to remove.  Returns (torn files removed, last
    restored step)."""
    rng = random.Random(seed)
    start, torn = 1, 0
    for n in range(kills):
        held = n % 2 == 0
        args = ["hold", str(rng.randint(1, HELD_CHUNK))] if held else []
        p = subprocess.Popen([sys.executable, "-c", CHILD, root, str(start), *args], stdout=subprocess.PIPE,
                             text=True)
        lines, said, at = _lines(p), [], None
        try:
            assert lines.get(timeout=120) == "READY\n"
            if held:  # the child saves on until the chosen chunk, and waits there
                while at is None:
                    said.append(lines.get(timeout=120))
                    assert said[-1] is not None, said
                    if said[-1].startswith("HELD"):
                        at = int(said[-1].split()[1])
            else:  # from its first commit on the child saves back to back: the kill lands in a save or between two
                said.append(lines.get(timeout=120))
                assert said[0].startswith("COMMITTED"), said
                time.sleep(rng.uniform(0.0, 0.3))  # the kill's random moment
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
        said.extend(iter(lines.get, None))
        step, removed = _check_and_clean(root, _committed("".join(said)))
        if held:  # the held save was torn, and only it: every save before it committed
            assert step == at - 1 and removed == {f"step-{at:08d}.rank0.safetensors"}, (at, step, removed)
        torn += len(removed)
        start = step + 1
    return torn, start - 1


def _sigkill_at_random_times(tmp_path, backend, kills, want_torn):
    seed = {"uring": 1234, "threads": 4321}[backend]
    torn, last = _random_kills(str(tmp_path / "ck"), seed, kills)
    print(f"{backend}: {torn} torn file(s) removed over {kills} kills")
    assert last >= 1, "no checkpoint ever committed"
    assert torn >= want_torn, f"only {torn} of {kills} kills landed inside a flush: the test did not test recovery"


def test_sigkill_at_random_times(tmp_path, backend):
    _sigkill_at_random_times(tmp_path, backend, KILLS, want_torn=1)


@pytest.mark.slow
def test_sigkill_at_random_times_long(tmp_path, backend):
    kills = int(os.environ.get("LAYERCKPT_KILLS", "60"))  # .ci/run bounds it to fit CI's time
    _sigkill_at_random_times(tmp_path, backend, kills, want_torn=min(5, kills // 2))
