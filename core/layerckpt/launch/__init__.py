"""``layerckpt launch``: run a training script, and restart it from a warm standby when it fails.

A restart of a failed job pays for a new interpreter and its imports before its first step: 7-10 s for torch and
Lightning on a 2-core machine, more than the restore itself.  ``launch`` imports torch, layerckpt and the modules
named with ``--preload`` once, in its own process, and runs each attempt of the script in a fork of that process:
an attempt starts with its imports done, as ``torchrun --max-restarts`` would restart it otherwise.  The script
itself is unchanged (it restores from its newest checkpoint as it would after any restart), and runs as
``python SCRIPT ARGS`` runs it: ``__name__ == "__main__"``, ``sys.argv``, ``sys.path[0]`` its folder.

Each attempt gets ``LAYERCKPT_RESTART_COUNT`` (0 for the first).  A fork is taken only while it is safe: the
launcher runs no Python thread of its own and no native thread beyond those its first imports started (BLAS
pools, which fork cleanly); where a preloaded module started one, or initialised CUDA, every attempt runs in a
new interpreter instead, and the launcher says so.  Each attempt reseeds Python's, NumPy's and torch's global
generators from the OS, as a new interpreter would have.

Exit status: the script's, once it exits 0 or the restarts run out (a death by signal N as 128 + N);
``SIGTERM`` sent to the launcher is passed to the running attempt, and ``SIGTERM`` or ``SIGINT`` stop the restarts.
An attempt that exits with ``layerckpt.EXIT_PREEMPTED`` (75: it stopped on a notice of preemption, its checkpoint
handled) is not restarted either: the machine is going away, and the job resumes wherever it is started next.
``SIGUSR1`` and ``SIGUSR2`` (SLURM's ``--signal``) are passed to the running attempt as they come.

An attempt dies with its launcher, however the launcher dies: the kernel SIGKILLs it then (Linux's parent-death
signal, set in the attempt between its fork and its script's first line, or its ``exec``; an attempt whose launcher
died before that finds its parent changed and dies at once).  SIGKILL, not SIGTERM: a launcher killed with SIGKILL
was given no grace by whoever killed it, who is done waiting (a stop with grace is a SIGTERM, which the launcher
passes on and the attempt's preemption handler saves on), and who may start the job again at once: an attempt still
saving would write the checkpoints the new one restores from.  The job resumes from its newest committed checkpoint,
as after any crash.  The launcher is itself the warm standby, so the attempt is the one process it starts; what the
script starts is the script's (torch's data loader workers end once orphaned).  Off Linux every attempt is a new
interpreter (the launcher's threads cannot be counted there) and nothing ties it: it outlives a SIGKILLed launcher.
"""
from __future__ import annotations

import ctypes
import importlib
import os
import signal
import subprocess
import sys
import threading
import time
from typing import List, Optional

from ..errors import CheckpointError
from ..preempt import EXIT_PREEMPTED

#: the environment variable that tells an attempt how many ran before it
RESTART_COUNT = "LAYERCKPT_RESTART_COUNT"
#: and the launcher's pid (an attempt that outlived it can tell: its parent is another process by then)
LAUNCHER_PID = "LAYERCKPT_LAUNCHER_PID"


#: prctl(2)'s option: the signal the kernel sends a process when the thread that started it dies
_PR_SET_PDEATHSIG = 1


def _prctl():
    """libc's ``prctl``, or None off Linux; taken before any fork, so that an attempt only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def _die_with(launcher: int) -> None:
    """In an attempt, first thing after its fork (a ``preexec_fn`` for a new interpreter: it holds across the
    ``exec``): have the kernel SIGKILL it when the launcher dies.  The signal comes at the death of the thread that
    forked, the launcher's main thread (``launch`` blocks in it while the attempt runs); a launcher dead before this
    call has no death left to tell, so the attempt checks its parent is still ``launcher`` after it."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0), ctypes.c_ulong(0),
               ctypes.c_ulong(0))
    if os.getppid() != launcher:
        os.kill(os.getpid(), signal.SIGKILL)


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: no way to count them, so no fork
        return -1


#: the process's native threads once torch and NumPy are imported (OpenBLAS's pool, which forks cleanly)
_BASELINE_THREADS: Optional[int] = None


def _say(text: str) -> None:
    print(f"layerckpt launch: {text}", file=sys.stderr, flush=True)


def _preload(modules: List[str]) -> None:
    """Import what every attempt would import, so a fork of this process starts with it done."""
    global _BASELINE_THREADS
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # torch.cuda.is_available() without a CUDA init
    import numpy  # noqa: F401
    import torch  # noqa: F401

    import layerckpt  # noqa: F401
    if _BASELINE_THREADS is None:
        _BASELINE_THREADS = _native_threads()
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise CheckpointError(f"--preload {name}: the module does not import here ({e}); install it or leave "
                                  f"it out") from e


def fork_refused() -> Optional[str]:
    """Why an attempt cannot be a fork of this process now, or None where it can."""
    import torch

    if threading.active_count() > 1:
        return f"{threading.active_count() - 1} Python thread(s) run beside the launcher's own"
    n = _native_threads()
    if n < 0 or _BASELINE_THREADS is None or n > _BASELINE_THREADS:
        return "a preloaded module started native threads" if n >= 0 else "its threads cannot be counted here"
    if torch.cuda.is_initialized():
        return "a preloaded module initialised CUDA, which a forked process cannot use"
    return None


def _reseed() -> None:
    """The global generators as a new interpreter would find them: seeded from the OS, not the parent's state."""
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()


def _attempt_in_fork(target: List[str], restart: int, launcher: int) -> int:
    """In the forked child: run the script as ``python`` would and return its exit status (the caller exits
    the interpreter with it, so its threads are joined and its exit handlers run as at any exit).  ``launcher`` is
    the launcher's pid, taken before the fork: where the launcher died first, ``os.getppid()`` here is already
    another process's, and an attempt that checks whether it was orphaned would never find out."""
    import runpy
    import traceback

    os.environ[RESTART_COUNT] = str(restart)
    os.environ[LAUNCHER_PID] = str(launcher)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    _reseed()
    module = target[0] == "-m"
    sys.argv = ([target[1]] if module else [target[0]]) + target[2 if module else 1:]
    sys.path[0] = os.getcwd() if module else os.path.dirname(os.path.abspath(target[0]))
    try:
        if module:
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return int(e.code or 0)
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # as the interpreter does: the traceback, then the status of a death by SIGINT
        traceback.print_exc()
        return 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 - as the interpreter does: the traceback, status 1
        traceback.print_exc()
        return 1
    return 0


def _status(wait_status: int) -> int:
    code = os.waitstatus_to_exitcode(wait_status)
    return 128 - code if code < 0 else code


def _how_it_ended(code: int) -> str:
    if code > 128 and code - 128 in signal.Signals._value2member_map_:
        return f"killed by {signal.Signals(code - 128).name}"
    return f"exit status {code}"


def launch(target: List[str], max_restarts: int = 3, preload: Optional[List[str]] = None,
           standby: bool = True) -> int:
    """Run ``target`` (``[script, *args]`` or ``["-m", module, *args]``) until it exits 0 or has been restarted
    ``max_restarts`` times; return its exit status.  In a forked attempt this returns that attempt's status
    instead, and the caller must exit with it (what :func:`main` does)."""
    if not target or (target[0] == "-m" and len(target) < 2):
        raise CheckpointError("no script named: layerckpt launch [options] SCRIPT [ARGS...] "
                              "or -m MODULE [ARGS...]")
    if target[0] != "-m" and not os.path.isfile(target[0]):
        raise CheckpointError(f"no script at {target[0]!r}: name a Python file, or -m MODULE")
    if max_restarts < 0:
        raise CheckpointError(f"--max-restarts must be 0 or more, got {max_restarts}")
    if standby:
        _preload(list(preload or []))
    stopping: List[int] = []
    running: List[int] = []  # the attempt's pid, while one runs

    def on_signal(sig, _frame):  # _wait passes a SIGTERM on (a SIGINT from a terminal reached the attempt already)
        stopping.append(sig)

    def pass_on(sig, _frame):  # a notice the attempt acts on itself (SLURM's --signal=USR1@90)
        for pid in running:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    old.update({s: signal.signal(s, pass_on) for s in (signal.SIGUSR1, signal.SIGUSR2)})
    told, code = False, 0
    try:
        for restart in range(max_restarts + 1):
            if stopping:  # a signal came between the last attempt's end and this one's start
                return code
            t0 = time.perf_counter()
            why = fork_refused() if standby else "--no-standby"
            if why and standby and not told:
                _say(f"every attempt starts a new interpreter: {why}")
                told = True
            launcher = os.getpid()
            pid = _start(target, restart, launcher, fork=not why)
            if pid == 0:
                return _attempt_in_fork(target, restart, launcher)
            running[:] = [pid]
            code = _status(_wait(pid, stopping))
            running.clear()
            if code == EXIT_PREEMPTED:
                _say("the job stopped on a notice of preemption, its checkpoint handled; no restart here")
                return code
            if code == 0 or stopping or restart == max_restarts:
                if code and not stopping and max_restarts:
                    _say(f"the job ended ({_how_it_ended(code)}) after {max_restarts} restart(s); giving up")
                return code
            _say(f"the job ended ({_how_it_ended(code)}) after {time.perf_counter() - t0:.1f} s; restart "
                 f"{restart + 1} of {max_restarts}" + ("" if why else ", from the warm standby"))
        return code  # pragma: no cover - the loop returns
    finally:  # in the launcher, and in an attempt once its script ended
        for s, h in old.items():
            signal.signal(s, h)


def _start(target: List[str], restart: int, launcher: int, fork: bool) -> int:
    """Start attempt ``restart`` of ``target``, a fork of this process or a new interpreter, tied to ``launcher``
    (this process); its pid (0 in the fork, as ``os.fork`` returns)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if fork:
        pid = os.fork()
        if pid == 0:
            _die_with(launcher)
        return pid
    return subprocess.Popen([sys.executable] + target, env=dict(os.environ, **{RESTART_COUNT: str(restart)}),
                            preexec_fn=lambda: _die_with(launcher)).pid


def _wait(pid: int, stopping: List[int]) -> int:
    """The wait status of ``pid``, passing it a SIGTERM the launcher got.  Polled: a signal handler runs between
    Python's instructions, and one that came just before a blocking ``waitpid`` would wait with it."""
    sent = False
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere: nothing to report
            return 0
        if done:
            return status
        if not sent and signal.SIGTERM in stopping:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            sent = True
        time.sleep(0.005)


def main(args) -> int:
    """``layerckpt launch``'s body (the parsed arguments of :mod:`layerckpt.cli`)."""
    preload = [m for part in (args.preload or []) for m in part.split(",") if m]
    target = list(args.target)
    if target and target[0] == "--":
        target = target[1:]
    if args.module:
        target = ["-m", args.module] + target
    return launch(target, args.max_restarts, preload, not args.no_standby)
