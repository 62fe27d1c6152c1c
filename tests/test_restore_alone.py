"""A restore on one node stays a call of its own: under a 2-rank gloo group on one machine, rank 0 alone restoring
an empty directory gets CheckpointNotFoundError at once (only a job of several nodes reads an empty directory
together with the other ranks, as a node that came back empty: docs/nodes.md)."""
import os
import socket
import subprocess
import sys

CHILD = r"""
import datetime, os, sys, time, torch, torch.distributed as dist, layerckpt
rank, root, port = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_WORLD_SIZE="2")
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
if rank == 0:
    t0 = time.perf_counter()
    try:
        layerckpt.restore(os.path.join(root, "empty"), torch.nn.Linear(2, 2))
    except layerckpt.CheckpointNotFoundError as e:
        print("NOTFOUND", round(time.perf_counter() - t0, 3), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_rank_restoring_an_empty_directory_on_one_node_is_not_a_collective(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LAYERCKPT_NODE", "SLURM_"))}
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(r), str(tmp_path), port], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    line = [ln for ln in outs[0][0].splitlines() if ln.startswith("NOTFOUND")]
    assert line and float(line[0].split()[1]) < 10.0, outs[0]
