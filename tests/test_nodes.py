"""Many nodes, simulated on this host: one torchrun launcher per node, 2 gloo ranks each (tests/nodes_helpers.py).

Each node is ``python -m torch.distributed.run --nnodes N --nproc-per-node 2 --node-rank K`` with a static
rendezvous on a free loopback port (node 0's launcher hosts the store), started as its own process in a session
of its own, with its own identity (``LAYERCKPT_NODE=node<K>``), its own memory tier's base folder
(``LAYERCKPT_SHM=BASE/shm<K>``, 0700) and its own checkpoint directory (``BASE/node<K>``, picked by the worker
from torchrun's ``GROUP_RANK``).  Losing a node (``lose_node``) empties both its directory and its memory tier,
as a replacement machine would come up.

Every launch is bounded (``launch(timeout=)``): a hang dumps every rank's stacks into the node's log and fails
the test with the logs, never blocks the suite.  A node whose ranks all succeeded while another node's failed
would wait out torchrun's exit barrier (300 s): the harness ends it after a few seconds and reports the exit 0
it would have given (``_BARRIER_GRACE_S``).  Each rank's failure is in ``BASE/error.<phase>.rank<R>.txt`` (the
failure messages quote them); each node's output in ``BASE/logs/<phase>.node<K>.{out,err}``.

A launch of 2 nodes costs about 5 s on the idle 2-core VM (mostly importing torch in four processes; 3 nodes
about 8 s), so each test launches twice at most.  pytest-timeout is not installed: the launches bound
themselves.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import pytest
import torch

from conftest import assert_same_optimizer_state, assert_same_tensors

from layerckpt.format._store import _DATA_RE

HERE = os.path.dirname(os.path.abspath(__file__))
HELPER = os.path.join(HERE, "nodes_helpers.py")
NPROC = 2  # ranks per node: node k holds ranks NPROC*k .. NPROC*k+NPROC-1
TIMEOUT_S = 240  # per launch
#: the variables a launcher must not inherit: the outer job's rendezvous, and any layerckpt setting of the caller
_STRIP = ("LAYERCKPT_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
          "ROLE_", "TORCHELASTIC_", "TORCH_NCCL_", "OMP_NUM_THREADS")
#: node 0's launcher could not bind the port picked (taken between the pick and the bind): launch again
_PORT_TAKEN = ("EADDRINUSE", "address already in use")
#: A launcher whose workers all succeeded waits in torchrun's exit barrier for every other node's (300 s, not
#: settable from the command line); a node that failed never comes to it.  Once a launcher failed, one left with
#: no worker for this long is in that barrier: it is ended and reported as torchrun would end it, exit 0.
_BARRIER_GRACE_S = 5.0
_BARRIER_NOTE = ("\n[test_nodes] this node's workers all succeeded and its launcher waited in torchrun's exit "
                 "barrier for a node that failed: ended, reported with the exit 0 it would have given\n")
Result = Tuple[int, str, str]  # one launcher's (returncode, stdout, stderr)


def ranks_of(k: int) -> List[int]:
    return list(range(NPROC * k, NPROC * (k + 1)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shm(base, k: int) -> str:
    return os.path.join(str(base), f"shm{k}")


def _node(base, k: int) -> str:
    return os.path.join(str(base), f"node{k}")


def _private_dir(path: str) -> None:
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)  # makedirs' mode goes through the umask, and leaves an existing folder as it is


def _env(base, k: int, extra: Optional[Mapping[str, str]]) -> Dict[str, str]:
    env = {n: v for n, v in os.environ.items() if not n.startswith(_STRIP)}
    env.update(OMP_NUM_THREADS="1",  # 2 cores, up to 6 ranks and their launchers
               GLOO_SOCKET_IFNAME="lo",  # gloo on loopback only (both ends of every pair on this host)
               PYTHONUNBUFFERED="1", LAYERCKPT_NODE=f"node{k}", LAYERCKPT_SHM=_shm(base, k))
    env.update(extra or {})
    return env


def _command(nnodes: int, k: int, port: int, phase_args: Sequence[str]) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(NPROC),
            "--node-rank", str(k), "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "0",
            HELPER, *[str(a) for a in phase_args]]


def _children() -> Dict[int, List[int]]:
    """pid -> the pids of its children, of every process now running."""
    children: Dict[int, List[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    return children


def _descendants(pid: int, children: Optional[Dict[int, List[int]]] = None) -> List[int]:
    """Every process below ``pid`` (torchrun starts each worker in a session of its own: a signal to the
    launcher's group does not reach them)."""
    children = _children() if children is None else children
    found, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def _signal(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _end(procs: Sequence[subprocess.Popen]) -> None:
    """Ends launchers still running and every process they started: their stacks first (SIGUSR1: the workers'
    faulthandler), then SIGTERM (torchrun ends its workers), then SIGKILL to whatever is left."""
    alive = [p for p in procs if p.poll() is None]
    if not alive:
        return
    tree = _children()
    below = [c for p in alive for c in _descendants(p.pid, tree)]
    _signal(below, signal.SIGUSR1)
    time.sleep(1.0)
    _signal([p.pid for p in alive], signal.SIGTERM)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(p.poll() is None for p in alive):
        time.sleep(0.2)
    _signal(below + [p.pid for p in alive if p.poll() is None], signal.SIGKILL)
    for p in alive:
        p.wait()


def launch(base, nnodes: int, phase_args: Sequence[str], timeout: float = TIMEOUT_S,
           node_env: Optional[Mapping[int, Mapping[str, str]]] = None) -> List[Result]:
    """One torchrun launcher per node, started together on a free port; waits for all and returns each node's
    (returncode, stdout, stderr), node 0 first.  ``phase_args`` follow the helper (``["train", base, ...]``);
    ``node_env``: node -> variables to add to that node's environment.  The logs stay in
    ``base/logs/<phase>.node<k>.{out,err}`` (files, not pipes: a node whose pipe filled would stall its ranks,
    and every rank with them).  A launch still running after ``timeout`` seconds is ended and fails the test,
    with every node's output (the ranks' stacks at the end included)."""
    base = str(base)
    logs = os.path.join(base, "logs")
    os.makedirs(logs, exist_ok=True)
    for k in range(nnodes):
        _private_dir(_shm(base, k))
    phase = str(phase_args[0])
    for name in os.listdir(base):  # what an earlier launch of this phase left: each rank's results and errors
        if name.startswith((f"error.{phase}.rank", f"result.{phase}.rank")):
            os.remove(os.path.join(base, name))
    for attempt in range(3):
        port = _free_port()
        procs, paths = [], []
        try:
            for k in range(nnodes):
                out, err = (os.path.join(logs, f"{phase}.node{k}.{ext}") for ext in ("out", "err"))
                paths.append((out, err))
                with open(out, "w") as fo, open(err, "w") as fe:
                    procs.append(subprocess.Popen(_command(nnodes, k, port, phase_args),
                                                  env=_env(base, k, (node_env or {}).get(k)), cwd=os.path.dirname(HERE),
                                                  stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                                                  start_new_session=True))
            deadline = time.monotonic() + timeout
            taken, had_workers, idle_since, barrier = False, [False] * nnodes, [None] * nnodes, set()
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if procs[0].poll() is not None and procs[0].returncode != 0 and any(
                        s in _read(paths[0][1]) for s in _PORT_TAKEN):
                    taken = True
                    break
                failed = any(p.poll() is not None and p.returncode != 0 for p in procs)
                tree = _children()
                for k, p in enumerate(procs):
                    if p.poll() is not None or k in barrier:
                        continue
                    if _descendants(p.pid, tree):
                        had_workers[k], idle_since[k] = True, None
                    elif had_workers[k] and failed:
                        idle_since[k] = idle_since[k] or time.monotonic()
                        if time.monotonic() - idle_since[k] > _BARRIER_GRACE_S:
                            barrier.add(k)
                if barrier and all(p.poll() is not None or k in barrier for k, p in enumerate(procs)):
                    break
                time.sleep(0.3)
            hung = not taken and any(p.poll() is None and k not in barrier for k, p in enumerate(procs))
        finally:
            for k in barrier:  # no worker left; torchrun blocked in the barrier's store wait ignores SIGTERM
                _signal([procs[k].pid], signal.SIGKILL)
                procs[k].wait()
            _end(procs)  # the test failing (or interrupted) leaves nothing running
        results = []
        for k, (p, (o, e)) in enumerate(zip(procs, paths)):
            if k in barrier:  # what torchrun would have exited with, after waiting out its exit barrier
                results.append((0, _read(o), _read(e) + _BARRIER_NOTE))
            else:
                results.append((p.returncode, _read(o), _read(e)))
        if taken and attempt < 2:
            continue
        if hung:
            pytest.fail(f"{' '.join(map(str, phase_args))} on {nnodes} nodes: still running after {timeout:.0f}s, "
                        f"ended\n{outputs(results)}", pytrace=False)
        return results
    raise AssertionError("unreachable")


def outputs(results: Sequence[Result], tail: int = 3000) -> str:
    return "\n".join(f"--- node{k}: exit {rc}\n[stdout]\n{out[-tail:]}\n[stderr]\n{err[-tail:]}"
                     for k, (rc, out, err) in enumerate(results))


def rank_errors(base, phase: str) -> Dict[int, str]:
    """rank -> what it was told ("Type: message"), for each rank of ``phase`` that failed (its error file)."""
    got = {}
    for name in os.listdir(str(base)):
        if name.startswith(f"error.{phase}.rank") and name.endswith(".txt"):
            text = _read(os.path.join(str(base), name))
            got[int(name[len(f"error.{phase}.rank"):-4])] = text.split("\nTraceback (most recent call last)", 1)[0]
    return dict(sorted(got.items()))


def assert_all_ok(results: Sequence[Result], base, phase: str) -> None:
    if all(rc == 0 for rc, _, _ in results):
        return
    told = "".join(f"\n  rank {r}: {e}" for r, e in rank_errors(base, phase).items())
    pytest.fail(f"{phase}: a launcher failed (exits {[rc for rc, _, _ in results]}); the ranks were told:"
                f"{told or ' nothing (no error file)'}\n{outputs(results)}", pytrace=False)


def lose_node(base, k: int) -> None:
    """Node ``k`` lost and replaced: its checkpoint directory and its memory tier's base folder emptied (both
    folders stay, the memory tier's private (0700), as on a fresh machine with the same mounts)."""
    for path in (_node(base, k), _shm(base, k)):
        if os.path.isdir(path):
            for name in os.listdir(path):
                p = os.path.join(path, name)
                if os.path.isdir(p) and not os.path.islink(p):
                    shutil.rmtree(p)
                else:
                    os.remove(p)
    os.makedirs(_node(base, k), exist_ok=True)
    _private_dir(_shm(base, k))


# ------------------------------------------------------------------ what the ranks wrote

def _load(path: str):
    return torch.load(path, weights_only=True)


def trained(base, nnodes: int) -> Dict[int, dict]:
    """Each rank's state after training, checked identical on every rank (the harness trains as DDP does)."""
    got = {r: _load(os.path.join(str(base), f"result.train.rank{r}.pt")) for r in range(NPROC * nnodes)}
    for r, res in got.items():
        assert res["node"] == r // NPROC and res["world"] == NPROC * nnodes, (r, res["node"], res["world"])
        assert_same_tensors(res["model"], got[0]["model"])
        assert_same_optimizer_state(res["optim"], got[0]["optim"])
    return got


def restored(base, nnodes: int) -> Tuple[Dict[int, dict], Dict[int, str]]:
    """Each rank's restore report (its JSON) and the sources all of them name, merged: rank -> where its part
    came from.  Two reports that disagree on a rank fail."""
    reports, sources = {}, {}
    for r in range(NPROC * nnodes):
        path = os.path.join(str(base), f"result.restore.rank{r}.json")
        with open(path) as f:
            reports[r] = json.load(f)
        assert reports[r]["sources"] is not None, f"rank {r}: the restore report has no sources"
        for rank, src in reports[r]["sources"].items():
            assert sources.setdefault(int(rank), src) == src, f"rank {rank}: {src!r} on rank {r}, " \
                                                               f"{sources[int(rank)]!r} on another"
    assert set(sources) == set(range(NPROC * nnodes)), f"sources name ranks {sorted(sources)}"
    return reports, sources


def assert_restored_bit_for_bit(base, nnodes: int, train: Dict[int, dict]) -> None:
    for r in range(NPROC * nnodes):
        got = _load(os.path.join(str(base), f"restored.rank{r}.pt"))
        assert_same_tensors(got["model"], train[r]["model"])
        assert_same_optimizer_state(got["optim"], train[r]["optim"])


def data_ranks(node_dir: str) -> Dict[str, int]:
    """The data files of a checkpoint directory -> the rank each belongs to (its name, _store.data_name)."""
    names = sorted(os.listdir(os.path.join(node_dir, "data")))
    parsed = {n: _DATA_RE.match(n) for n in names}
    assert all(parsed.values()), f"{node_dir}/data: files that are not data files: " \
                                 f"{[n for n, m in parsed.items() if not m]}"
    return {n: int(m.group(3)) for n, m in parsed.items()}


def train_and_restore(base, nnodes: int, replicas: int, lose: Optional[int] = None):
    steps, every = 4, 2
    assert_all_ok(launch(base, nnodes, ["train", base, steps, every, replicas]), base, "train")
    train = trained(base, nnodes)
    assert train[0]["saved"] == [2, 4]
    if lose is not None:
        lose_node(base, lose)
    results = launch(base, nnodes, ["restore", base, replicas])
    return train, results


# ------------------------------------------------------------------ the harness itself

def test_the_harness_gives_each_node_its_rank_group_identity_and_memory_folder(tmp_path):
    results = launch(tmp_path, 2, ["ping", tmp_path], timeout=120)
    assert_all_ok(results, tmp_path, "ping")
    for r in range(2 * NPROC):
        with open(tmp_path / f"result.ping.rank{r}.json") as f:
            got = json.load(f)
        k = r // NPROC
        assert (got["rank"], got["RANK"], got["GROUP_RANK"], got["LOCAL_RANK"], got["world"]) == \
               (r, r, k, r % NPROC, 2 * NPROC)
        assert got["sum"] == sum(range(2 * NPROC))
        assert got["LAYERCKPT_NODE"] == f"node{k}" and got["LAYERCKPT_SHM"] == str(tmp_path / f"shm{k}")
        assert os.stat(got["LAYERCKPT_SHM"]).st_mode & 0o777 == 0o700


# ------------------------------------------------------------------ many nodes

def test_two_nodes_each_write_only_their_own_directory_and_restore_bit_for_bit(tmp_path):
    train, results = train_and_restore(tmp_path, 2, replicas=0)
    manifests = {}
    for k in range(2):
        d = _node(tmp_path, k)
        ranks = data_ranks(d)
        assert ranks and set(ranks.values()) <= set(ranks_of(k)), \
            f"node{k}/data holds files of ranks {sorted(set(ranks.values()))}, its ranks are {ranks_of(k)}: " \
            f"{sorted(ranks)}"
        manifests[k] = sorted(os.listdir(os.path.join(d, "manifests")))
    assert manifests[0] and manifests[0] == manifests[1], manifests
    assert_all_ok(results, tmp_path, "restore")
    reports, sources = restored(tmp_path, 2)
    assert {r: rep["step"] for r, rep in reports.items()} == {r: 4 for r in range(4)}
    assert all(s in ("disk", "memory") for s in sources.values()), sources
    assert_restored_bit_for_bit(tmp_path, 2, train)


def _lost_node_comes_back(base, nnodes: int, lost: int) -> None:
    train, results = train_and_restore(base, nnodes, replicas=1, lose=lost)
    assert_all_ok(results, base, "restore")
    reports, sources = restored(base, nnodes)
    assert {r: rep["step"] for r, rep in reports.items()} == {r: 4 for r in range(NPROC * nnodes)}
    assert {r: s for r, s in sources.items() if r in ranks_of(lost)} == {r: "replica" for r in ranks_of(lost)}, \
        sources
    assert all(s in ("disk", "memory") for r, s in sources.items() if r not in ranks_of(lost)), sources
    assert_restored_bit_for_bit(base, nnodes, train)


def test_a_lost_node_comes_back_from_its_partners_replica(tmp_path):
    _lost_node_comes_back(tmp_path, 2, 1)


def test_three_nodes_one_lost(tmp_path):
    _lost_node_comes_back(tmp_path, 3, 2)


def test_a_lost_node_without_replicas_is_a_clear_error(tmp_path):
    _, results = train_and_restore(tmp_path, 2, replicas=0, lose=1)
    assert all(rc != 0 for rc, _, _ in results), f"a restore without node1's part succeeded somewhere\n" \
                                                 f"{outputs(results)}"
    errors = rank_errors(tmp_path, "restore")
    for r in ranks_of(1):
        assert r in errors, f"rank {r} (node1) left no error\n{outputs(results)}"
        told = errors[r]
        low = told.lower()
        assert "node1" in told and ("missing" in low or "no committed" in low), \
            f"rank {r} (node1) was told: {told}\n{outputs(results)}"
