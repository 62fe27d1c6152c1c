"""`layerckpt bench --goodput`: a training job killed at random and restarted, per checkpointing contender.

A supervisor runs a training job (``goodput_child``: the bench's GPT with AdamW, in a plain loop or under a
Lightning Trainer) as a child process, SIGKILLs it at failure times drawn from an exponential distribution
of mean ``mtbf`` (a seeded ``random.Random``; the same times for every contender, in wall-clock seconds since
the contender's run began) and starts it again at once, as torchrun's ``--max-restarts`` or a scheduler
would, until the job has done its steps.  With ``restarts="standby"`` every attempt is instead a fork of one
``layerckpt launch`` process that has imported what the job imports (``layerckpt.launch``): the same kills,
the restarts without their interpreters' start (for the crash kind: a node loss takes the standby with it).
Three kinds of failure:

* ``crash``: the process dies; its local files and ``/dev/shm`` stay;
* ``node``: the machine is lost: after the kill the supervisor deletes the contender's local store and its
  memory tier; layerckpt restores from its ``file://`` remote tier.  torch.save, ``dcp.async_save`` and
  ModelCheckpoint write straight into that surviving folder (on the same disk, so a node loss costs them no
  more than a crash: a real remote would slow each of their saves instead);
* ``preempt``: a notice, then the kill: at the failure time the supervisor sends SIGTERM, and SIGKILLs the
  process ``grace`` seconds later if it is still there; the job starts again once the process is gone (an exit
  on the notice, status 0 or ``layerckpt.EXIT_PREEMPTED``, or the kill), its local files and ``/dev/shm`` kept as
  after a crash.  Each contender handles the notice as its users would (``goodput_child``).  The standby
  restarts are not run under it: the notice says the machine is going away, and its standby with it.

Contenders, on the same failure times: in the plain loop torch.save, ``dcp.async_save`` and layerckpt's
``Checkpointer`` (default Config with the memory tier and the remote tier), each every N steps for each of
``cadences``, and layerckpt with ``layerckpt.Interval(mtbf)``; under Lightning, ModelCheckpoint and
LayerCheckpoint every N steps and ``LayerCheckpoint(mtbf=...)``.  A failure-free run without checkpoints of
each loop gives the median step (the productive work of a step) and what a failure-free job costs.  Where the
time went is ``goodput_account``'s buckets; goodput is productive step time over wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Tuple

from .goodput_account import account, figures, read_progress
from .goodput_report import OURS, format_table
from .machine import machine
BATCH, LR = 2, 3e-4
THREADS = 1  # torch's threads in the job: the rest of the cores are the savers' (and the machine's other users')
MAX_ATTEMPTS = 200  # a job that cannot get through its start between failures would never end
#: seconds from the notice (SIGTERM) to the SIGKILL under the preempt kind (``--grace``).  SIGTERM's convention is
#: 30 s (Kubernetes, Google Cloud's spot VMs), a few saves of a job whose save takes seconds; gpt2-mini saves in
#: 1-3 s on 2 cores (ModelCheckpoint writes two files on the exception), so 10 s keeps the grace a few saves long
GRACE_S = 10.0
#: the exit statuses of a process that handled a notice: 0 (a script's own handler; Lightning's SIGTERMException)
#: and layerckpt.EXIT_PREEMPTED
HANDLED = (0, 75)
#: how each attempt after a kill starts: a new interpreter (as torchrun restarts), or a fork of a launcher that has
#: imported the job's modules (``layerckpt launch``)
RESTARTS = ("fresh", "standby")


@dataclass(frozen=True)
class Contender:
    name: str  # the child's checkpointing: none, torch.save, dcp.async_save, layerckpt, ModelCheckpoint or
    # LayerCheckpoint
    loop: str  # plain or lightning
    every: Optional[int] = None  # a checkpoint every this many steps
    mtbf: bool = False  # layerckpt.Interval(mtbf) decides instead

    @property
    def label(self) -> str:
        return f"{self.name} mtbf=" if self.mtbf else self.name


def contenders(cadences: List[int]) -> List[Contender]:
    out = [Contender(n, "plain", c) for n in ("torch.save", "dcp.async_save", "layerckpt") for c in cadences]
    out.append(Contender("layerckpt", "plain", mtbf=True))
    out += [Contender(n, "lightning", c) for n in ("ModelCheckpoint", "LayerCheckpoint") for c in cadences]
    out.append(Contender("LayerCheckpoint", "lightning", mtbf=True))
    return out


class Failures:
    """Failure times, seconds since a run began: cumulative exponential draws of mean ``mtbf``, the same for
    every contender (drawn once, as far as the slowest needs)."""

    def __init__(self, mtbf: float, seed: int):
        self._rng, self._mean, self.times = random.Random(seed), mtbf, []

    def at(self, k: int) -> float:
        while len(self.times) <= k:
            self.times.append((self.times[-1] if self.times else 0.0) + self._rng.expovariate(1 / self._mean))
        return self.times[k]


def model_config(size: str) -> Dict[str, Any]:
    from .sharded import SIZES

    return asdict(SIZES[size])


# ---------------------------------------------------------------- the supervisor

def supervise(c: Contender, spec: Dict[str, Any], work: str, steps: int, failures: Optional[Failures],
              node_loss: bool, restarts: str = "fresh") -> List[Dict[str, Any]]:
    """Run ``c``'s job until it has done ``steps`` steps, killing it at each failure time; its attempts.  With
    ``spec["grace"]`` (the preempt kind) each failure is a notice, SIGTERM, and a SIGKILL that many seconds later
    where the process is still there; an attempt ended so holds ``notice`` (the SIGTERM's time) and ``exit`` (its
    status: 0 or 75 where it handled the notice, -15 where it had no handler yet, -9 for the SIGKILL)."""
    dirs = {k: os.path.join(work, k) for k in ("node", "remote", "progress")}
    shm = tempfile.mkdtemp(prefix="layerckpt-bench-goodput-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.makedirs(dirs["progress"])
    env = dict(os.environ, LAYERCKPT_SHM=shm)
    spec = {**spec, "kind": c.name, "loop": c.loop, "every": c.every, "node": dirs["node"], "remote": dirs["remote"]}
    if restarts == "standby":
        if spec.get("grace") is not None:
            raise ValueError("the preempt kind runs with fresh restarts only: its notice takes the standby too")
        try:
            return _supervise_standby(c, spec, dirs, env, steps, failures, node_loss, shm)
        finally:
            shutil.rmtree(shm, ignore_errors=True)
    attempts: List[Dict[str, Any]] = []
    t0, k = None, 0
    try:
        while True:
            if len(attempts) == MAX_ATTEMPTS:
                raise RuntimeError(f"{c.label}: {MAX_ATTEMPTS} attempts without finishing {steps} steps: the failures "
                                   f"come faster than the job starts; give a longer --mtbf")
            n = len(attempts)
            path = os.path.join(dirs["progress"], f"{n}.jsonl")
            log = os.path.join(dirs["progress"], f"{n}.log")
            spawned = time.time()
            t0 = spawned if t0 is None else t0
            with open(log, "wb") as out:
                child = json.dumps({**spec, "progress": path, "spawned": spawned})
                proc = subprocess.Popen([sys.executable, "-m", "layerckpt.bench.goodput", "--child", child],
                                        stdout=out, stderr=subprocess.STDOUT, env=env)
                due = t0 + failures.at(k) if failures else None
                if spec.get("grace") is None:
                    notice, killed = None, _wait_or_kill(proc, due)
                else:
                    notice, killed = _wait_or_preempt(proc, due, spec["grace"])
            events = read_progress(path)
            finished = any(e["e"] == "step" and e["s"] == steps for e in events)
            attempts.append({"spawned": spawned, "killed": None if finished else killed, "events": events,
                             "failure_s": None if finished or killed is None else failures.at(k)})
            if notice is not None and not finished:
                attempts[-1].update(notice=notice, exit=proc.returncode)
            if finished:
                return attempts
            if killed is None or (notice is not None and proc.returncode not in HANDLED + (-signal.SIGTERM,
                                                                                           -signal.SIGKILL)):
                with open(log, encoding="utf-8", errors="replace") as f:
                    tail = f.read()[-3000:]
                raise RuntimeError(f"{c.label}: attempt {n} exited with status {proc.returncode} before step "
                                   f"{steps}{' on the notice' if notice is not None else ''}:\n{tail}")
            k += 1
            if node_loss:  # the machine is gone: its disk and its shared memory with it
                shutil.rmtree(dirs["node"], ignore_errors=True)
                shutil.rmtree(shm, ignore_errors=True)
                os.mkdir(shm, 0o700)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def preloads(c: Contender) -> List[str]:
    """What ``c``'s job imports before its setup: what its standby imports once."""
    out = ["layerckpt.bench.goodput_child", "layerckpt.bench.models", "layerckpt.bench.workload"]
    if c.loop == "lightning":
        out += ["lightning.pytorch", "lightning_layerckpt"]
    if c.name == "dcp.async_save":
        out += ["torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict"]
    return out


def _supervise_standby(c: Contender, spec: Dict[str, Any], dirs: Dict[str, str], env: Dict[str, str], steps: int,
                       failures: Optional[Failures], node_loss: bool, shm: str) -> List[Dict[str, Any]]:
    """``supervise`` with every attempt a fork of one ``layerckpt launch`` process.  Attempt n writes its pid to
    ``progress/n.pid`` and starts its work once ``progress/n.go`` holds its start time: the supervisor writes it
    once the kill before it and a node loss's deletions are done, as it would start a new process then."""
    prog = dirs["progress"]
    spec = {**spec, "standby": prog}
    log = os.path.join(prog, "launch.log")
    attempts: List[Dict[str, Any]] = []
    t0 = time.time()
    with open(log, "wb") as out:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "layerckpt.cli", "launch", "--max-restarts", str(MAX_ATTEMPTS),
             "--preload", ",".join(preloads(c)), "-m", "layerckpt.bench.goodput", "--", "--child", json.dumps(spec)],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        k = 0
        while True:
            n = len(attempts)
            if n == MAX_ATTEMPTS:
                raise RuntimeError(f"{c.label}: {MAX_ATTEMPTS} attempts without finishing {steps} steps: the failures "
                                   f"come faster than the job starts; give a longer --mtbf")
            spawned = t0 if n == 0 else time.time()  # the first attempt's start is the launcher's, imports and all
            with open(os.path.join(prog, f"{n}.go.tmp"), "w") as f:
                f.write(repr(spawned))
            os.replace(os.path.join(prog, f"{n}.go.tmp"), os.path.join(prog, f"{n}.go"))
            pid = _attempt_pid(os.path.join(prog, f"{n}.pid"), launcher, log)
            due = t0 + failures.at(k) if failures else None
            killed = _wait_or_kill_pid(pid, due)
            events = read_progress(os.path.join(prog, f"{n}.jsonl"))
            finished = any(e["e"] == "step" and e["s"] == steps for e in events)
            attempts.append({"spawned": spawned, "killed": None if finished else killed, "events": events,
                             "failure_s": None if finished or killed is None else failures.at(k)})
            if finished:  # killed on its way out, it was restarted: the finally ends the launcher and that attempt
                if killed is None and launcher.wait(timeout=120) != 0:
                    raise RuntimeError(f"{c.label}: the launcher exited with status {launcher.returncode} after the "
                                       f"job finished:\n{_tail(log)}")
                return attempts
            if killed is None:
                raise RuntimeError(f"{c.label}: attempt {n} ended before step {steps} without a kill:\n{_tail(log)}")
            k += 1
            if node_loss:
                shutil.rmtree(dirs["node"], ignore_errors=True)
                shutil.rmtree(shm, ignore_errors=True)
                os.mkdir(shm, 0o700)
    finally:  # the launcher, then any attempt it left (one waiting for its start ends itself once orphaned)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for name in os.listdir(prog):
            if name.endswith(".pid"):
                try:
                    with open(os.path.join(prog, name)) as f:
                        os.kill(int(f.read()), signal.SIGKILL)
                except (OSError, ValueError):  # gone already
                    pass


def _tail(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()[-3000:]


def _attempt_pid(path: str, launcher: subprocess.Popen, log: str) -> int:
    """The pid the next attempt wrote to ``path`` (it writes it first thing after the fork)."""
    deadline = time.time() + 300  # the first attempt waits for the launcher's imports
    while time.time() < deadline:
        try:
            with open(path) as f:
                text = f.read()
            if text.endswith("\n"):
                return int(text)
        except FileNotFoundError:
            pass
        if launcher.poll() is not None:
            raise RuntimeError(f"the launcher exited with status {launcher.returncode} before an attempt "
                               f"started:\n{_tail(log)}")
        time.sleep(0.002)
    raise RuntimeError(f"no attempt started within 300 s:\n{_tail(log)}")


def _wait_or_kill_pid(pid: int, due: Optional[float]) -> Optional[float]:
    """``_wait_or_kill`` for a process this one did not start (the launcher's child, reaped by the launcher)."""
    killed = None
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return killed
        now = time.time()
        if killed is None and due is not None and now >= due:
            os.kill(pid, signal.SIGKILL)
            killed = time.time()
        time.sleep(0.002 if killed is not None or due is None else min(0.01, max(0.0, due - now)))


def standby_attempt(spec: Dict[str, Any]) -> Dict[str, Any]:
    """In an attempt forked by the standby: its pid told, its start awaited; the spec of this attempt."""
    from ..launch import LAUNCHER_PID, RESTART_COUNT

    prog, n = spec["standby"], int(os.environ[RESTART_COUNT])
    with open(os.path.join(prog, f"{n}.pid.tmp"), "w") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(os.path.join(prog, f"{n}.pid.tmp"), os.path.join(prog, f"{n}.pid"))
    go, parent = os.path.join(prog, f"{n}.go"), int(os.environ[LAUNCHER_PID])
    while not os.path.exists(go):
        if os.getppid() != parent:  # the launcher is gone (maybe before this line): no one will start this attempt
            os._exit(1)
        time.sleep(0.001)
    with open(go) as f:
        spawned = float(f.read())
    return {**spec, "progress": os.path.join(prog, f"{n}.jsonl"), "spawned": spawned}


def _wait_or_kill(proc: subprocess.Popen, due: Optional[float]) -> Optional[float]:
    """Wait for ``proc`` to exit, or SIGKILL it at ``due`` (wall clock); the kill's time, or None."""
    while proc.poll() is None:
        now = time.time()
        if due is not None and now >= due:
            os.kill(proc.pid, signal.SIGKILL)
            killed = time.time()
            proc.wait()
            return killed
        time.sleep(0.01 if due is None else min(0.01, due - now))
    return None


def _wait_or_preempt(proc: subprocess.Popen, due: Optional[float], grace: float) -> Tuple[Optional[float],
                                                                                         Optional[float]]:
    """Wait for ``proc`` to exit; at ``due`` send it SIGTERM, the notice, and SIGKILL it ``grace`` seconds later
    where it is still there: the notice's time and when the process was gone, or (None, None) where it exited
    before the notice."""
    notice = None
    while proc.poll() is None:
        now = time.time()
        if notice is None and due is not None and now >= due:
            os.kill(proc.pid, signal.SIGTERM)
            notice = time.time()
        elif notice is not None and now >= notice + grace:
            os.kill(proc.pid, signal.SIGKILL)
            killed = time.time()
            proc.wait()
            return notice, killed
        wake = notice + grace if notice is not None else due
        time.sleep(0.005 if notice is not None else 0.01 if wake is None else min(0.01, max(0.0, wake - now)))
    return notice, (time.time() if notice is not None else None)


def _summary(attempts: List[Dict[str, Any]], t0: float) -> List[Dict[str, Any]]:
    """Each attempt's marks in seconds since the run began (None where the process did not get there)."""
    def at(ev, kind):
        return next((round(e["t"] - t0, 3) for e in ev if e["e"] == kind), None)

    return [{"spawned_s": round(a["spawned"] - t0, 3), "imports_s": at(a["events"], "imports"),
             "setup_s": at(a["events"], "setup"), "restored_s": at(a["events"], "restored"),
             "resumed_at": next((e["step"] for e in a["events"] if e["e"] == "restored"), None),
             "last_step": max((e["s"] for e in a["events"] if e["e"] == "step"), default=None),
             "last_save": max((e["s"] for e in a["events"] if e["e"] == "save"), default=None),
             "killed_s": None if a["killed"] is None else round(a["killed"] - t0, 3), "failure_s": a["failure_s"],
             **({} if a.get("notice") is None else {"notice_s": round(a["notice"] - t0, 3), "exit": a["exit"]})}
            for a in attempts]


def _one(c: Contender, spec: Dict[str, Any], root: str, steps: int, base: Optional[float],
         failures: Optional[Failures], node_loss: bool, restarts: str = "fresh") -> Dict[str, Any]:
    work = tempfile.mkdtemp(prefix=f"{c.loop}-{c.name}-", dir=root)
    try:
        attempts = supervise(c, spec, work, steps, failures, node_loss, restarts)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if base is None:  # the failure-free run: its own median step is the base
        import statistics

        ts = [e["t"] for e in attempts[0]["events"] if e["e"] in ("restored", "step")]
        base = statistics.median(b - a for a, b in zip(ts, ts[1:]))
    r = account(attempts, steps, base)
    r.update(name=c.name, label=c.label, loop=c.loop, every=c.every, mtbf=c.mtbf, restarts=restarts, base_step_s=base,
             failure_times_s=[a["failure_s"] for a in attempts if a["failure_s"] is not None],
             attempts=_summary(attempts, attempts[0]["spawned"]))
    return r


def run(size: str = "gpt2-mini", steps: int = 300, mtbf: float = 60.0, kinds=("crash", "node"), seed: int = 0,
        cadences=(10, 25, 50), dirpath: Optional[str] = None, say=lambda line: None,
        restarts=("fresh",), grace: float = GRACE_S, save_on_exception: bool = False) -> Dict[str, Any]:
    cfg = model_config(size)
    spec = {"model": cfg, "steps": steps, "batch": BATCH, "lr": LR, "seed": seed, "mtbf": None,
            "threads": THREADS}
    failures = Failures(mtbf, seed)
    res: Dict[str, Any] = {"machine": machine(), "size": size, "model": cfg, "params": _params(cfg), "steps": steps,
                           "batch": BATCH, "seq": 32, "threads": THREADS, "mtbf_s": mtbf, "seed": seed,
                           "cadences": list(cadences), "kinds": list(kinds), "restarts": list(restarts), "free": {},
                           "runs": {}}
    if "preempt" in kinds:
        res["grace_s"] = grace
        res["save_on_exception"] = save_on_exception  # ModelCheckpoint's, on Lightning's SIGTERMException
    if dirpath:
        os.makedirs(dirpath, exist_ok=True)
    root = tempfile.mkdtemp(prefix="layerckpt-bench-goodput-", dir=dirpath)
    try:
        for loop in ("plain", "lightning"):
            res["free"][loop] = free = _one(Contender("none", loop), spec, root, steps, None, None, False)
            free["goodput"], free["lost_s"] = free["buckets"]["compute"] / free["wall_s"], 0.0
            say(f"goodput: failure-free {loop} loop: {steps} steps in {free['wall_s']:.1f} s, "
                f"median step {free['base_step_s']:.3f} s")
        ran: Dict[Any, Dict[str, Any]] = {}
        for kind in kinds:
            res["runs"][kind] = rows = []
            for mode, c in ((m, c) for m in restarts for c in contenders(list(cadences))):
                if mode == "standby" and kind != "crash":  # a standby on the lost (or going) node goes with it
                    continue
                if kind != "preempt" and (c, mode) in ran:  # its files are in the surviving folder: a node loss is
                    rows.append(ran[(c, mode)])  # a crash to it, run once
                    continue
                free = res["free"][c.loop]
                try:
                    r = _one(c, {**spec, "mtbf": mtbf if c.mtbf else None,
                                 "grace": grace if kind == "preempt" else None,
                                 "save_on_exception": save_on_exception}, root, steps, free["base_step_s"],
                             failures, kind == "node", mode)
                except Exception as e:  # a contender that cannot finish: its row says why, the others still run
                    rows.append(failed_row(c, mode, kind, e))
                    say(f"goodput: {kind}: {c.label}{f' every {c.every}' if c.every else ''}: FAILED: "
                        f"{rows[-1]['failed']}")
                    continue
                figures(r, free, mtbf)
                r["ran_under"] = kind
                rows.append(r)
                if c.name not in OURS and kind != "preempt":
                    ran[(c, mode)] = r
                say(f"goodput: {kind}: {c.label}{f' every {c.every}' if c.every else ''}"
                    f"{', standby restarts' if mode == 'standby' else ''}: {r['kills']} "
                    f"{'notice(s)' if kind == 'preempt' else 'kill(s)'}, {steps} steps in {r['wall_s']:.1f} s, "
                    f"goodput {r['goodput'] * 100:.1f}%, {r['redone_steps']} step(s) redone")
        res["failure_times_s"] = failures.times
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return res


def failed_row(c: Contender, mode: str, kind: str, e: BaseException) -> Dict[str, Any]:
    """The row of a contender whose run could not finish (a restart that failed): what it was, and why, with the
    end of its message (a child's traceback ends with the error)."""
    why = f"{type(e).__name__}: {e}"
    return {"name": c.name, "label": c.label, "loop": c.loop, "every": c.every, "mtbf": c.mtbf, "restarts": mode,
            "ran_under": kind, "failed": why if len(why) <= 2000 else why[:300] + " ... " + why[-1700:]}


def _params(cfg: Dict[str, Any]) -> int:
    e = cfg["n_embd"]
    head = 0 if cfg["tie_weights"] else cfg["vocab_size"] * e
    return (cfg["vocab_size"] + cfg["n_positions"]) * e + cfg["n_layer"] * (12 * e * e + 13 * e) + 2 * e + head


def main(args) -> int:
    from ..interval import parse_duration

    kinds = [k.strip() for k in args.failure.split(",") if k.strip()]
    cadences = [int(x) for x in args.cadences.split(",")]

    def say(line: str) -> None:  # a line per run on stderr while the bench goes on (it takes minutes)
        if not getattr(args, "quiet", False):
            print(line, file=sys.stderr, flush=True)

    restarts = [m.strip() for m in args.restarts.split(",") if m.strip()]
    res = run(args.size, args.goodput_steps, parse_duration(args.mtbf, "--mtbf"), kinds, args.seed, cadences,
              args.dir, say, restarts, parse_duration(args.grace, "--grace"), bool(args.save_on_exception))
    print(json.dumps(res) if args.json else format_table(res), flush=True)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m layerckpt.bench.goodput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", metavar="SPEC", help="one attempt of the training job (the supervisor starts it)")
    a = p.parse_args()
    if not a.child:
        p.error("run the bench as: layerckpt bench --goodput [...]")
    from .goodput_child import main as child

    spec = json.loads(a.child)
    child(standby_attempt(spec) if "standby" in spec else spec)
