"""Exit under torchrun: a 2-rank FSDP2 run that saves, restores, trains on and leaves, many times.

The suite's check is deterministic (tests/test_multirank.py: after ``close()`` each rank has one group
fewer and no layerckpt thread).  This is the stress run behind ``-m slow``: it counts the runs whose
process aborted (SIGABRT, "terminate called without an active exception") with layerckpt and, as the
control, the same script without it.  ``LAYERCKPT_EXIT_RUNS`` sets how many runs of each (default 30).

What aborts, from a core dump of one such run: a gloo worker thread of the *default* group frees the
barrier it just ran, which holds a finished all-reduce from the backward pass; that work's saved
thread-local state holds a Python object (the context autograd stashes for the backward), and freeing it
takes the GIL after the interpreter began finalizing, so CPython ends the thread and C++ calls
std::terminate.  Nothing of layerckpt is on that thread; layerckpt's own group is destroyed and its
threads joined at ``close()`` (tests/test_multirank.py).
"""
import os
import subprocess
import sys
import tempfile

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

SCRIPT = r"""
import os, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import layerckpt

def build():
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    for layer in m:
        fully_shard(layer)
    fully_shard(m)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3)

def step(m, o):
    m(torch.randn(8, 256)).sum().backward()
    o.step()
    o.zero_grad()

dist.init_process_group("gloo")
m, o = build()
for _ in range(3):
    step(m, o)
m2, o2 = build()
if sys.argv[2] == "1":
    c = layerckpt.Checkpointer(sys.argv[1], m, o, layerckpt.Config(full=True))
    c.save(3).wait()
    c.close()
    layerckpt.restore(sys.argv[1], m2, o2)
step(m, o)
step(m2, o2)
dist.barrier()
print("OK", dist.get_rank(), flush=True)
dist.destroy_process_group()
"""


def _aborts(runs: int, with_layerckpt: bool) -> int:
    aborted = 0
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as d:
            script = os.path.join(d, "run.py")
            with open(script, "w") as f:
                f.write(SCRIPT)
            r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                "2", script, os.path.join(d, "store"), "1" if with_layerckpt else "0"],
                               capture_output=True, text=True, timeout=300)
            assert r.stdout.count("OK") == 2, r.stdout[-2000:] + r.stderr[-3000:]  # both ranks got to the end
            aborted += r.returncode != 0
    return aborted


@pytest.mark.slow
def test_a_run_with_layerckpt_exits_cleanly_as_often_as_one_without():
    runs = int(os.environ.get("LAYERCKPT_EXIT_RUNS", "30"))
    ours, control = _aborts(runs, True), _aborts(runs, False)
    print(f"aborts at exit: {ours} of {runs} with layerckpt, {control} of {runs} without")
    assert ours == 0, f"{ours} of {runs} runs with layerckpt aborted at exit ({control} of {runs} without it)"
