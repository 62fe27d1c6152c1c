"""SIGKILL at random points of a flush: the last committed checkpoint always restores, bit for bit."""
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

import layerckpt

TRIALS = 20

CHILD = r"""
import os, sys, torch, layerckpt
root = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(12)])  # ~12.6 MB a checkpoint
ck = layerckpt.Checkpointer(root, model, config=layerckpt.Config(threshold=0.0, keep_last=2, chunk_bytes="1MiB", queue_depth=4))
print("READY", flush=True)
step = int(sys.argv[2])
while True:
    with torch.no_grad():
        for i, m in enumerate(model):
            m.weight.fill_(step * 100 + i)
            m.bias.fill_(-step)
    ck.save(step).wait()
    print("COMMITTED", step, flush=True)
    step += 1
"""


def expected(step: int) -> torch.nn.Module:
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(12)])
    with torch.no_grad():
        for i, m in enumerate(model):
            m.weight.fill_(step * 100 + i)
            m.bias.fill_(-step)
    return model


@pytest.mark.parametrize("backend_name", ["uring", "threads"])
def test_sigkill_during_flushes(tmp_path, backend_name):
    from layerckpt._backend import uring_available

    if backend_name == "uring" and uring_available():
        pytest.skip(uring_available())
    rng = random.Random(1234 if backend_name == "uring" else 4321)
    root = str(tmp_path / "ck")
    env = {**os.environ, "LAYERCKPT_BACKEND": backend_name}
    start = 1
    torn_seen = 0
    for trial in range(TRIALS // 2):
        p = subprocess.Popen([sys.executable, "-c", CHILD, root, str(start)], stdout=subprocess.PIPE, text=True,
                             env=env)
        assert p.stdout.readline().strip() == "READY"
        time.sleep(rng.uniform(0.0, 0.4))  # several saves a tenth of a second: lands inside flushes
        p.send_signal(signal.SIGKILL)
        out, _ = p.communicate()
        # a line the kill cut short is not a report
        committed = [int(f[1]) for f in map(str.split, out.splitlines())
                     if len(f) == 2 and f[0] == "COMMITTED" and f[1].isdigit()]
        data = set(os.listdir(os.path.join(root, "data")))
        model = expected(0)
        try:
            r = layerckpt.restore(root, model)
        except layerckpt.CheckpointNotFoundError:
            assert not committed, "a reported commit must be restorable"
            continue
        # the newest committed (a commit may land after its line was printed, never before)
        assert not committed or r.step >= committed[-1]
        want = expected(r.step)
        for a, b in zip(model.state_dict().values(), want.state_dict().values()):
            assert torch.equal(a, b)
        # leftovers of the torn save are removed by the next open
        layerckpt.Checkpointer(root, expected(0)).close()
        after = set(os.listdir(os.path.join(root, "data")))
        referenced = set()
        for n in os.listdir(os.path.join(root, "manifests")):
            assert n.endswith(".json"), n  # no *.tmp left behind
            import json

            referenced |= set(json.load(open(os.path.join(root, "manifests", n)))["files"])
        assert after == referenced
        torn_seen += len(data - after)
        start = r.step + 1
    assert start > 1, "no checkpoint ever committed"
    print(f"{backend_name}: {torn_seen} torn file(s) cleaned over {TRIALS // 2} kills")
