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

Faults: a node's ranks SIGKILL themselves at the n-th hit of a fault point of the library (``NODES_DIE_AT`` in
that node's ``node_env``: a peer dying mid-restore, a partner dying mid-replication, a node dying mid-upload);
each saved state is recorded (``BASE/saved.step<S>.rank<R>.pt``), so that whatever step a restore falls back to is
checked bit for bit.  ``Launch`` starts a launch without waiting: the soak (``-m slow``,
``LAYERCKPT_NODE_LOSSES``) kills whole nodes at random times with it.

A launch of 2 nodes costs about 5 s on the idle 2-core VM (mostly importing torch in four processes; 3 nodes
about 8 s), so each test launches twice (three times at most).  pytest-timeout is not installed: the launches
bound themselves.
"""
from __future__ import annotations

import glob
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
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


class Launch:
    """One start of a phase: a torchrun launcher per node, started together on a free port, not waited for
    (``launch`` waits; the soak kills).  Clears what an earlier launch of this phase left (each rank's results
    and errors); the logs go to ``base/logs/<phase>.node<k>.{out,err}`` (files, not pipes: a node whose pipe
    filled would stall its ranks, and every rank with them)."""

    def __init__(self, base, nnodes: int, phase_args: Sequence[str],
                 node_env: Optional[Mapping[int, Mapping[str, str]]] = None):
        base = str(base)
        self.base, self.nnodes = base, nnodes
        logs = os.path.join(base, "logs")
        os.makedirs(logs, exist_ok=True)
        for k in range(nnodes):
            _private_dir(_shm(base, k))
        self.phase = phase = str(phase_args[0])
        for name in os.listdir(base):  # what an earlier launch of this phase left: each rank's results and errors
            if name.startswith((f"error.{phase}.rank", f"result.{phase}.rank")):
                os.remove(os.path.join(base, name))
        port = _free_port()
        self.procs: List[subprocess.Popen] = []
        self.paths: List[Tuple[str, str]] = []
        self.seen: Dict[int, int] = {}  # every worker seen below a launcher -> its node (to end orphans)
        self.started = time.monotonic()
        try:
            for k in range(nnodes):
                out, err = (os.path.join(logs, f"{phase}.node{k}.{ext}") for ext in ("out", "err"))
                self.paths.append((out, err))
                with open(out, "w") as fo, open(err, "w") as fe:
                    self.procs.append(subprocess.Popen(
                        _command(nnodes, k, port, phase_args), env=_env(base, k, (node_env or {}).get(k)),
                        cwd=os.path.dirname(HERE), stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                        start_new_session=True))
        except BaseException:
            self.end()
            raise

    def port_taken(self) -> bool:
        """Node 0's launcher failed to bind the port picked (taken between the pick and the bind)."""
        p = self.procs[0]
        return p.poll() is not None and p.returncode != 0 and any(s in _read(self.paths[0][1]) for s in _PORT_TAKEN)

    def below(self, k: int, tree: Optional[Dict[int, List[int]]] = None) -> List[int]:
        """Node ``k``'s workers now (its launcher's descendants), remembered for :meth:`end`."""
        found = _descendants(self.procs[k].pid, tree)
        for pid in found:
            self.seen[pid] = k
        return found

    def kill_node(self, k: int) -> None:
        """SIGKILL node ``k``'s launcher and every process below it at once, as a node lost would."""
        pids = [self.procs[k].pid] + self.below(k) + [p for p, n in self.seen.items() if n == k]
        _signal(pids, signal.SIGKILL)
        self.procs[k].wait()
        _gone([p for p in pids if p != self.procs[k].pid])

    def results(self, barrier: Sequence[int] = ()) -> List[Result]:
        out = []
        for k, (p, (o, e)) in enumerate(zip(self.procs, self.paths)):
            if k in barrier:  # what torchrun would have exited with, after waiting out its exit barrier
                out.append((0, _read(o), _read(e) + _BARRIER_NOTE))
            else:
                out.append((p.returncode, _read(o), _read(e)))
        return out

    def end(self) -> None:
        """Ends whatever is still running (``_end``), then any worker seen that outlived its launcher."""
        _end(self.procs)
        _signal(_ours([p for p in self.seen]), signal.SIGKILL)
        _gone(list(self.seen))


def _ours(pids: Sequence[int]) -> List[int]:
    """Those of ``pids`` that still run this harness's worker (a pid reused by another process is left)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if HELPER.encode() in f.read():
                    out.append(pid)
        except OSError:
            pass
    return out


def _gone(pids: Sequence[int], timeout: float = 10.0) -> None:
    """Until every process of ``pids`` is gone (or a zombie): a SIGKILL is delivered, not awaited."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                        break
            except OSError:
                break
            time.sleep(0.05)


def launch(base, nnodes: int, phase_args: Sequence[str], timeout: float = TIMEOUT_S,
           node_env: Optional[Mapping[int, Mapping[str, str]]] = None) -> List[Result]:
    """One torchrun launcher per node (``Launch``); waits for all and returns each node's (returncode, stdout,
    stderr), node 0 first.  ``phase_args`` follow the helper (``["train", base, ...]``); ``node_env``: node ->
    variables to add to that node's environment.  A launch still running after ``timeout`` seconds is ended and
    fails the test, with every node's output (the ranks' stacks at the end included).  Whatever a launch
    leaves running (a worker that outlived its launcher) is killed before it returns."""
    for attempt in range(3):
        run = Launch(base, nnodes, phase_args, node_env)
        procs = run.procs
        barrier: set = set()
        try:
            deadline = time.monotonic() + timeout
            taken, had_workers, idle_since = False, [False] * nnodes, [None] * nnodes
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if run.port_taken():
                    taken = True
                    break
                failed = any(p.poll() is not None and p.returncode != 0 for p in procs)
                tree = _children()
                for k, p in enumerate(procs):
                    if p.poll() is not None or k in barrier:
                        continue
                    if run.below(k, tree):
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
            run.end()  # the test failing (or interrupted) leaves nothing running
        results = run.results(barrier)
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


# ------------------------------------------------------------------ faults: deaths mid-transfer, node losses

def _saved(base, step: int, r: int) -> dict:
    """What rank ``r``'s save of ``step`` was given (nodes_helpers.record)."""
    return _load(os.path.join(str(base), f"saved.step{step}.rank{r}.pt"))


def _assert_equals_saved(base, nnodes: int, step: int, restored_name: str = "restored") -> None:
    for r in range(NPROC * nnodes):
        got = _load(os.path.join(str(base), f"{restored_name}.rank{r}.pt"))
        want = _saved(base, step, r)
        assert_same_tensors(got["model"], want["model"])
        assert_same_optimizer_state(got["optim"], want["optim"])


def _died(base) -> Dict[int, str]:
    """rank -> the fault point (and hit) at which it killed itself (nodes_helpers.install_faults)."""
    out = {}
    for name in os.listdir(str(base)):
        if name.startswith("died.rank") and name.endswith(".txt"):
            out[int(name[len("died.rank"):-4])] = _read(os.path.join(str(base), name)).strip()
    return out


def _is_layerckpt_error(told: str) -> bool:
    """Whether "Type: message" names a CheckpointError (or a subclass) of layerckpt."""
    import layerckpt.errors as errors

    cls = getattr(errors, told.split(":", 1)[0].strip(), None)
    return isinstance(cls, type) and issubclass(cls, errors.CheckpointError)


def _die_at(point: str, n: int, **extra: str) -> Dict[str, str]:
    return {"NODES_DIE_AT": f"{point}:{n}", **extra}


#: a restore whose peer died mid-transfer must fail within the training's process-group timeout (the worker's
#: GLOO_TIMEOUT_S, 60 s), plus the launch's own start and end: a hang is ended and fails the test there
_DEAD_PEER_BOUND_S = 60 + 30


def test_a_peer_dying_mid_transfer_fails_the_restore_on_every_other_rank(tmp_path):
    """replicas=0: every node gathers the whole composite, so node0 receives node1's files; node1's store owner
    (rank 2) dies as it begins sending them.  The other ranks fail with a layerckpt error naming the rank or the
    node gone, well before the harness's bound, never a hang."""
    assert_all_ok(launch(tmp_path, 2, ["train", tmp_path, 4, 2, 0]), tmp_path, "train")
    t0 = time.monotonic()
    results = launch(tmp_path, 2, ["restore", tmp_path, 0], timeout=_DEAD_PEER_BOUND_S,
                     node_env={1: _die_at("parts.sending", 1)})
    took = time.monotonic() - t0
    assert _died(tmp_path) == {2: "parts.sending:1"}, f"{_died(tmp_path)}\n{outputs(results)}"
    assert all(rc != 0 for rc, _, _ in results[:1]), f"node0's restore succeeded without node1\n{outputs(results)}"
    errors = rank_errors(tmp_path, "restore")
    for r in ranks_of(0):
        assert r in errors, f"rank {r} (node0) left no error\n{outputs(results)}"
        told = errors[r]
        assert _is_layerckpt_error(told), f"rank {r} was told no layerckpt error: {told}"
        assert re.search(r"\branks? (?:\d+, )*2\b|\bnode ?1\b", told), \
            f"rank {r} was told of no rank/node gone: {told}"
    assert not any(os.path.exists(tmp_path / f"result.restore.rank{r}.json") for r in range(2 * NPROC))
    # from the death to the last of node0's errors: the peer's loss is seen, not waited out (gloo's timeout)
    died_at = os.path.getmtime(tmp_path / "died.rank2.txt")
    told_after = max(os.path.getmtime(tmp_path / f"error.restore.rank{r}.txt") for r in ranks_of(0)) - died_at
    print(f"restore with a peer dying mid-transfer: node0's ranks failed {told_after:.1f}s after the death "
          f"(the launch took {took:.1f}s)")
    assert told_after < 60, f"node0's ranks failed {told_after:.0f}s after rank 2 died: gloo's timeout waited out"
    assert took < _DEAD_PEER_BOUND_S


def _replica_of(base, holder: int, source: int) -> Tuple[List[str], Optional[str]]:
    """What node ``holder`` holds of node ``source``'s part in its memory tier's base: the complete copies'
    manifests (normally one) and the steps of the data files of the copy that was arriving (None: none)."""
    found = glob.glob(os.path.join(_shm(base, holder), "layerckpt-replicas-*", f"node{source}"))
    assert len(found) == 1, f"node{holder} holds no replica folder of node{source}: {found}"
    complete = sorted(glob.glob(os.path.join(found[0], "c-*", "manifests", "*.json")))
    incoming = os.path.join(found[0], ".incoming")
    partial = sorted(os.listdir(os.path.join(incoming, "data"))) if os.path.isdir(incoming) else None
    return complete, None if partial is None else ",".join(partial)


@pytest.mark.parametrize("stall_s", [0, 4], ids=["prompt", "lagging"])
def test_a_kill_during_replication_leaves_the_previous_composite_restorable(tmp_path, stall_s):
    """Node1's owner dies as the 3rd data file arrives of node0's part: the 1st of the 2nd round (2 files per
    round, one per rank of node0), that of step 4 or 6.  Node0 lost: the restore reads node0's part from the
    replica node1 held complete (the 1st round's), never the partial one.  ``lagging``: the replication
    thread stalls 4 s at that file before the death while the training goes on (a round slower than the saves,
    as with a slow link): node1 commits step 6 meanwhile, and its own part of the composite whose replica of
    node0 it holds complete must stay for that replica to restore."""
    results = launch(tmp_path, 2, ["train", tmp_path, 6, 2, 1],
                     node_env={1: {"NODES_DIE_AT": f"replica.file-received:3:{stall_s}"}})
    assert _died(tmp_path) == {2: "replica.file-received:3"}, f"{_died(tmp_path)}\n{outputs(results)}"
    assert any(rc != 0 for rc, _, _ in results), outputs(results)
    complete, partial = _replica_of(tmp_path, 1, 0)
    assert len(complete) == 1, complete
    held = _store_step(complete[0])
    assert partial, f"node1 was killed receiving a round, but holds no partial copy: {complete}"
    partial_steps = {int(n[len("step-"):].split(".")[0]) for n in partial.split(",")}
    assert partial_steps and min(partial_steps) > held, (held, partial)
    # the composite node1 holds node0's part of complete is still whole with node1's own part (its disk)
    own = sorted(os.listdir(os.path.join(_node(tmp_path, 1), "manifests")))
    print(f"node1 holds node0's part of step {held} complete (partial: {partial}); its own manifests: {own}")
    lose_node(tmp_path, 0)
    results = launch(tmp_path, 2, ["restore", tmp_path, 1])
    assert_all_ok(results, tmp_path, "restore")
    reports, sources = restored(tmp_path, 2)
    assert {r: rep["step"] for r, rep in reports.items()} == {r: held for r in range(4)}, (held, reports)
    assert {r: sources[r] for r in ranks_of(0)} == {r: "replica" for r in ranks_of(0)}, sources
    assert all(sources[r] in ("disk", "memory") for r in ranks_of(1)), sources
    _assert_equals_saved(tmp_path, 2, held)


def _store_step(manifest_path: str) -> int:
    name = os.path.basename(manifest_path)
    assert re.fullmatch(r"step-\d{8,}\.json", name), manifest_path
    return int(name[len("step-"):-len(".json")])


def test_a_kill_during_upload_leaves_the_previous_remote_composite_restorable(tmp_path):
    """replicas=0, a file:// remote: node1's owner dies as the 3rd file it uploads lands (the 1st of the 2nd
    composite it uploads: 2 files per composite, one per rank of node1).  Node1 lost: the restore reads the
    remote's newest committed composite, bit for bit, every rank's part from the remote."""
    remote = tmp_path / "remote"
    remote.mkdir()  # as a bucket is there before the job
    env = {"NODES_REMOTE": f"file://{remote}"}
    results = launch(tmp_path, 2, ["train", tmp_path, 6, 2, 0],
                     node_env={0: env, 1: _die_at("tier.file-copied", 3, **env)})
    assert _died(tmp_path) == {2: "tier.file-copied:3"}, f"{_died(tmp_path)}\n{outputs(results)}"
    assert any(rc != 0 for rc, _, _ in results), outputs(results)
    committed = sorted(_store_step(n) for n in os.listdir(remote / "manifests") if n.endswith(".json"))
    assert committed, f"nothing committed on the remote: {sorted(os.listdir(remote / 'manifests'))}"
    newest = committed[-1]
    uploaded = data_ranks(str(remote))
    step2 = {r for n, r in uploaded.items() if n.startswith("step-00000002.")}
    assert step2 == set(range(4)), f"the remote holds step 2's files of ranks {sorted(step2)}: {sorted(uploaded)}"
    print(f"remote: committed {committed}, data {sorted(uploaded)}")
    lose_node(tmp_path, 1)
    results = launch(tmp_path, 2, ["restore", tmp_path, 0], node_env={0: env, 1: env})
    assert_all_ok(results, tmp_path, "restore")
    reports, sources = restored(tmp_path, 2)
    assert {r: rep["step"] for r, rep in reports.items()} == {r: newest for r in range(4)}, (committed, reports)
    assert sources == {r: "remote" for r in range(4)}, sources
    _assert_equals_saved(tmp_path, 2, newest)


def test_every_node_lost_restores_from_the_remote_and_trains_on(tmp_path):
    """replicas=0, a file:// remote; both nodes lost (a node and its partners: docs/nodes.md's third row).  The
    restore reads the remote's newest composite, bit for bit, and the job trains on with the same remote: the
    nodes' new, empty directories take the remote's store identity, as one empty directory does."""
    remote = tmp_path / "remote"
    remote.mkdir()
    env = {k: {"NODES_REMOTE": f"file://{remote}"} for k in range(2)}
    assert_all_ok(launch(tmp_path, 2, ["train", tmp_path, 4, 2, 0], node_env=env), tmp_path, "train")
    lose_node(tmp_path, 0)
    lose_node(tmp_path, 1)
    results = launch(tmp_path, 2, ["resume", tmp_path, 0, 2, 2], node_env=env)
    for r in range(4):
        path = tmp_path / f"result.resume.rank{r}.json"
        assert path.exists(), f"rank {r}: no restore\n{outputs(results)}"
        with open(path) as f:
            rep = json.load(f)
        assert rep["step"] == 4 and rep["sources"] == {str(q): "remote" for q in range(4)}, rep
    _assert_equals_saved(tmp_path, 2, 4, "restored.resume")
    assert_all_ok(results, tmp_path, "resume")
    assert _load(os.path.join(str(tmp_path), "result.resume.rank0.pt"))["saved"] == [6]


def _expected_composite(base, r: int, report: dict) -> dict:
    """What a restore of a selective composite must give rank ``r``, bit for bit: each layer's tensors and
    optimizer state as saved at the step that layer was persisted (the restored step minus its staleness)."""
    step = report["step"]
    layer_of = {n: layer for layer, names in report["layers"].items() for n in names}
    stale = report["staleness"]
    at = {n: step - stale.get(layer_of[n], 0) for n in layer_of}
    cache: Dict[int, dict] = {}

    def saved(s: int) -> dict:
        if s not in cache:
            cache[s] = _saved(base, s, r)
        return cache[s]

    model = {n: saved(at[n])["model"][n] for n in saved(step)["model"]}
    newest = saved(step)["optim"]
    optim = {"param_groups": newest["param_groups"],
             "state": {i: saved(at[n])["optim"]["state"][i] for i, n in enumerate(report["params"])
                       if i in newest["state"]}}
    return {"model": model, "optim": optim, "steps": sorted(set(at.values()))}


def test_a_node_restored_from_its_partner_trains_on_selectively_and_restores_after_a_crash(tmp_path):
    """Node1 lost and restored from node0's replica, then both train on with the DEFAULT selective Config
    (replicas=1, keep_last=2) and save; a process crash (a plain relaunch) restores the newest save from the
    disks alone, each layer bit for bit as the step that persisted it saved it."""
    assert_all_ok(launch(tmp_path, 2, ["train", tmp_path, 4, 2, 1]), tmp_path, "train")
    lose_node(tmp_path, 1)
    results = launch(tmp_path, 2, ["resume", tmp_path, 1, 4, 2])
    assert_all_ok(results, tmp_path, "resume")
    for r in range(4):
        with open(tmp_path / f"result.resume.rank{r}.json") as f:
            rep = json.load(f)
        assert rep["step"] == 4, rep
        want = {str(q): "replica" if q in ranks_of(1) else "disk" for q in range(4)}
        assert rep["sources"] == want, rep["sources"]
    _assert_equals_saved(tmp_path, 2, 4, "restored.resume")
    resumed = _load(os.path.join(str(tmp_path), "result.resume.rank0.pt"))
    assert resumed["saved"] == [6, 8], resumed["saved"]
    results = launch(tmp_path, 2, ["restore", tmp_path, 1])
    assert_all_ok(results, tmp_path, "restore")
    reports, sources = restored(tmp_path, 2)
    assert {r: rep["step"] for r, rep in reports.items()} == {r: 8 for r in range(4)}, reports
    assert sources == {r: "disk" for r in range(4)}, sources
    for r in range(4):
        got = _load(os.path.join(str(tmp_path), f"restored.rank{r}.pt"))
        want = _expected_composite(tmp_path, r, reports[r])
        assert_same_tensors(got["model"], want["model"])
        assert_same_optimizer_state(got["optim"], want["optim"])
    print(f"the selective composite of step 8: layers from steps {want['steps']}, "
          f"staleness {reports[0]['staleness']}")


def test_three_nodes_restored_onto_two(tmp_path):
    """3 nodes train with replicas=1; node2 gone, a 2-node launch (node0's and node1's directories) restores
    the newest composite, node2's part from node0's replica of it: every rank bit for bit the 3-node state."""
    assert_all_ok(launch(tmp_path, 3, ["train", tmp_path, 4, 2, 1]), tmp_path, "train")
    train = trained(tmp_path, 3)
    results = launch(tmp_path, 2, ["restore", tmp_path, 1])
    assert_all_ok(results, tmp_path, "restore")
    steps, sources = {}, {}
    for r in range(4):
        with open(tmp_path / f"result.restore.rank{r}.json") as f:
            rep = json.load(f)
        steps[r], sources[r] = rep["step"], rep["sources"]
    assert steps == {r: 4 for r in range(4)}, steps
    print(f"3 -> 2 nodes: sources {sources[0]}")
    for r in range(4):
        got = _load(os.path.join(str(tmp_path), f"restored.rank{r}.pt"))
        assert_same_tensors(got["model"], train[0]["model"])
        assert_same_optimizer_state(got["optim"], train[0]["optim"])


# ------------------------------------------------------------------ the soak: nodes lost at random times

def _steps_in(base, prefix: str, ranks: Optional[Sequence[int]] = None, skip: Optional[Dict[int, int]] = None
              ) -> List[int]:
    """The steps ranks appended to BASE/<prefix>.rank<R> (``ranks``: those ranks only; ``skip``: rank -> how many
    of its first lines to leave out, those of earlier launches)."""
    out = []
    for path in glob.glob(os.path.join(str(base), f"{prefix}.rank*")):
        r = int(path.rsplit(".rank", 1)[1])
        if ranks is None or r in ranks:
            out += [int(x) for x in _read(path).split()[(skip or {}).get(r, 0):] if x.isdigit()]
    return out


def _lines(base, prefix: str) -> Dict[int, int]:
    return {int(p.rsplit(".rank", 1)[1]): len(_read(p).split()) for p in glob.glob(os.path.join(str(base),
                                                                                                 f"{prefix}.rank*"))}


def _soak_results(base, nnodes: int) -> Dict[int, dict]:
    out = {}
    for r in range(NPROC * nnodes):
        path = os.path.join(str(base), f"result.soak.rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                out[r] = json.load(f)
    return out


def _check_soak_restore(got: Dict[int, dict], committed: Optional[int], i: int, outs: str) -> None:
    steps = {r: g["step"] for r, g in got.items()}
    assert len(set(steps.values())) == 1, f"launch {i}: the ranks restored different steps: {steps}"
    step = next(iter(steps.values()))
    if committed is not None:
        assert step is not None and step >= committed, \
            f"launch {i}: restored {step}, but step {committed} was committed before the kill (on the remote, or " \
            f"replicated to the node that survived it): {got}\n{outs}"
    for r, g in got.items():
        if step is not None:
            assert g["recorded"] is not None, f"launch {i}: rank {r} restored step {step}, of which no save " \
                                              f"recorded a hash"
            assert g["hash"] == g["recorded"], f"launch {i}: rank {r}: the state restored of step {step} is " \
                                               f"not the one saved"


def _errors_before(base, phase: str, t: float) -> Dict[int, str]:
    """The ranks' errors written before the wall-clock time ``t`` (a kill's: those after it are its echo)."""
    out = {}
    for r, told in rank_errors(base, phase).items():
        if os.path.getmtime(os.path.join(str(base), f"error.{phase}.rank{r}.txt")) < t:
            out[r] = told
    return out


@pytest.mark.slow
def test_soak_random_node_losses(tmp_path):
    """LAYERCKPT_NODE_LOSSES times: 2 nodes train saving every step (full, replicas=1, a file:// remote); one
    random node is SIGKILLed whole (launcher and workers), then the other (the scheduler ending the job), and the
    first is lost (its directory and memory tier emptied).  The kill comes a random 2-8 s after every rank
    restored (the launch's own start, importing torch in six processes, takes about as long again: counted from
    the start, most kills would land before the training), or, one launch in four, at a random time during the
    start and the collective restore.  Each next launch's restore must give a step no older than any committed
    before the kill (0 committed composites lost: one is committed once its Checkpointer's wait() returned, its
    replica and remote copy made) and the state its save recorded, bit for bit (a hash)."""
    losses = int(os.environ.get("LAYERCKPT_NODE_LOSSES", "30"))
    rng = random.Random(20240611)
    base, nnodes = str(tmp_path), 2
    (tmp_path / "remote").mkdir()
    env = {k: {"NODES_REMOTE": f"file://{tmp_path / 'remote'}"} for k in range(nnodes)}
    t0 = time.monotonic()
    kinds: Counter = Counter()
    fresh = unchecked = early_kills = 0
    newest, ready_s = 0, [6.0]
    i = 0
    committed, saved, lost_local = None, None, 0
    while i <= losses:
        required = committed  # what this launch's restore must reach, learnt at the last kill
        before, before_local = _lines(base, "committed"), _lines(base, "local")
        final = i == losses  # the last launch only restores, checked, then ends
        early = not final and rng.random() < 0.25
        wait = rng.uniform(1.0, sum(ready_s) / len(ready_s)) if early else rng.uniform(2.0, 8.0)
        lost = rng.randrange(nnodes)
        run = Launch(base, nnodes, ["soak", base, 100000], node_env=env)
        try:
            ready, deadline = None, run.started + (wait if early else TIMEOUT_S)
            while time.monotonic() < deadline:
                tree = _children()
                for k in range(nnodes):
                    run.below(k, tree)
                if run.port_taken():
                    break
                if any(p.poll() is not None for p in run.procs):
                    pytest.fail(f"soak launch {i}: a launcher ended by itself (exits "
                                f"{[p.poll() for p in run.procs]}); the ranks were told: "
                                f"{rank_errors(base, 'soak')}\n{outputs(run.results())}", pytrace=False)
                if ready is None and len(_soak_results(base, nnodes)) == NPROC * nnodes:
                    ready = time.monotonic()
                    ready_s.append(ready - run.started)
                    if final:
                        break
                    if not early:
                        deadline = ready + wait
                time.sleep(0.05)
            else:
                if ready is None and not early:
                    pytest.fail(f"soak launch {i}: no restore after {TIMEOUT_S}s\n{outputs(run.results())}",
                                pytrace=False)
            if run.port_taken():
                continue
            t_kill = time.time()
            run.kill_node(lost)
            for k in range(nnodes):
                if k != lost:
                    run.kill_node(k)
        finally:
            run.end()
        outs = outputs(run.results(), tail=1500)
        told = _errors_before(base, "soak", t_kill)
        assert not told, f"soak launch {i}: ranks failed before the kill: {told}\n{outs}"
        got = _soak_results(base, nnodes)
        if final:
            assert len(got) == NPROC * nnodes, f"the last launch did not restore on every rank: {got}\n{outs}"
        step = next(iter(got.values()))["step"] if got else None
        if got:
            _check_soak_restore(got, required, i, outs)
            if step is None:
                fresh += 1
            else:
                newest = max(newest, step)
                kinds.update((next(iter(got.values()))["sources"] or {}).values())
        elif committed is not None:
            unchecked += 1  # killed before its restore ended
        early_kills += early
        if got and saved is not None and (step or 0) < saved:
            lost_local += 1  # saved, but killed before its copies were made: lost with its node, by design
        if not final:
            lose_node(base, lost)
        # what the next restore must reach: the remote's commits (rank 0's, ever), and what the survivor's owner
        # holds of the lost node's part, replicated during this launch
        survivor = ranks_of(1 - lost)[0]
        committed = max(_steps_in(base, "committed", ranks=[0]) +
                        _steps_in(base, "committed", ranks=[survivor], skip=before), default=None)
        saved = max(_steps_in(base, "local", skip=before_local), default=saved)
        print(f"launch {i}: {'restored step ' + str(step) if got else 'killed before its restore'} (committed "
              f"before: {required}), killed {'during the start' if early else 'after the restore'} +{wait:.1f}s, "
              f"node{lost} lost, {time.monotonic() - t0:.0f}s")
        i += 1
    took = time.monotonic() - t0
    summary = (f"soak: {losses} node losses in {took:.0f}s ({early_kills} during a start or restore); rank parts "
               f"restored, by source: {dict(kinds)}; fresh starts {fresh}; launches killed before their restore "
               f"ended {unchecked}; newest step restored {newest}; restores older than a save that had "
               f"returned (killed before its copies were made) {lost_local}; steps committed "
               f"{len(set(_steps_in(base, 'committed')))}; a launch restored after {sum(ready_s) / len(ready_s):.1f}s "
               f"on average")
    print(summary)
    assert newest > 0, summary
