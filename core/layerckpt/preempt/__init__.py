"""Preemption: an announced interruption becomes one committed checkpoint, at one step every rank agrees on,
before the deadline.

A notice is a signal (``Config.preemption``: SIGTERM by default in the adapters; SLURM's ``--signal=USR1@90``
sends SIGUSR1) or a call, ``Checkpointer.preempt(seconds)`` (a cloud's metadata notice, watched by the user's
code).  The signal handler only records the notice and its deadline (two attribute stores: no lock, no I/O, no
logging, nothing unsafe between two bytecodes of whatever the main thread was running).  It is acted on at the
next step boundary, ``Checkpointer.preempted(step)`` (or an adapter's step hook): every rank posts, at each
boundary, the earliest deadline it knows of (+inf for none) in a non-blocking all-reduce (MIN) over a gloo group
of its own, and reads the result of the previous boundary's.  Every rank so reads the same value at the same
boundary: the ranks agree on one step, one boundary after the first notice, even where only some ranks got the
signal, with no blocking collective per step (one alone: no collective at all).

At the agreed step: the save is started only where it can be durable before the deadline (the newest committed
save's time from ``save()`` to commit, on the slowest rank, against the time left: agreed by all ranks, and
logged where it cannot); the commit point is unchanged, so a SIGKILL before the commit leaves the previous
composite restorable.  Then the tiers copy it for what time is left (a spot VM's local disk goes with it: the
remote is what survives), and training stops: the plain loop exits with :data:`EXIT_PREEMPTED`
(sysexits' EX_TEMPFAIL, 75: "try again later", which ``layerckpt launch`` reads as "the machine is going away,
do not restart here"); the adapters use their framework's own stop.
"""
from __future__ import annotations

import logging
import math
import signal
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from ..errors import ConfigError

log = logging.getLogger("layerckpt")

#: the exit status of a process that stopped on a notice with its checkpoint handled (sysexits' EX_TEMPFAIL)
EXIT_PREEMPTED = 75

#: seconds from a signal to the SIGKILL that follows it, by the convention of who sends it: SIGTERM 30 s
#: (Kubernetes' terminationGracePeriodSeconds default, Google Cloud's spot and preemptible notice), SIGUSR1 and
#: SIGUSR2 60 s (SLURM's lead for ``--signal`` without ``@time``), SIGINT 10 s (an operator's Ctrl-C or
#: ``docker stop``)
GRACE_S: Dict[str, float] = {"SIGTERM": 30.0, "SIGUSR1": 60.0, "SIGUSR2": 60.0, "SIGINT": 10.0}
#: what a notice told by a call allows where it names no deadline
CALL_GRACE_S = 30.0
#: the share of the time left a save may need and still be started
FIT = 0.9

ADAPTER_DEFAULT = ("SIGTERM",)


def signal_names(value: Union[None, bool, str, Sequence[str]], default: Sequence[str] = ()) -> Optional[Tuple[str, ...]]:
    """``Config.preemption`` as signal names: None where preemption is off, () for notices by call only."""
    if value is None:
        value = tuple(default) if default else False
    if value is False:
        return None
    if value is True:
        return ("SIGTERM",)
    names = [value] if isinstance(value, str) else list(value)
    out = []
    for n in names:
        if not isinstance(n, str):
            raise ConfigError(f"Config.preemption names signals (e.g. 'SIGTERM', 'SIGUSR1'), got {n!r}")
        name = n.upper() if n.upper().startswith("SIG") else "SIG" + n.upper()
        if name in ("SIGKILL", "SIGSTOP") or not isinstance(getattr(signal, name, None), signal.Signals):
            raise ConfigError(f"Config.preemption: {n!r} is not a signal this process can handle; name one such as "
                              f"SIGTERM, SIGUSR1 or SIGINT")
        out.append(name)
    return tuple(dict.fromkeys(out))


class Notice:
    """One Checkpointer's notices: the signal handlers, the agreement at each step boundary, and what was done."""

    def __init__(self, signals: Tuple[str, ...], grace_s: Optional[float], group: Any = None):
        self.signals = signals
        self.grace_s = grace_s
        self._group = group  # a _dist.Group of every rank (None alone)
        self._pg = group.pg if group is not None else None
        self._got: Optional[Tuple[str, float]] = None  # (what, deadline as time.time()): set by the handler
        self._old: Dict[int, Any] = {}
        self._work = None
        self._buf = None
        #: (step, deadline) once every rank agreed to stop at ``step``
        self.agreed: Optional[Tuple[int, float]] = None
        #: what was done at the agreed step, for the log and the tests: "saved", "already saved", "no time"
        self.outcome: Optional[str] = None
        self._install()

    # ------------------------------------------------------------ receiving

    def _install(self) -> None:
        if not self.signals:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning("layerckpt: the Checkpointer was opened outside the main thread, where no signal handler can "
                        "be installed: %s will not be noticed (tell a notice with Checkpointer.preempt())",
                        ", ".join(self.signals))
            return
        for name in self.signals:
            sig = getattr(signal, name)
            self._old[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        # in signal context: record, nothing else (the next step boundary acts on it)
        if self._got is None:
            name = signal.Signals(signum).name
            grace = self.grace_s if self.grace_s is not None else GRACE_S.get(name, CALL_GRACE_S)
            self._got = (name, time.time() + grace)

    def tell(self, seconds: Optional[float] = None, what: str = "a call") -> None:
        """A notice by call: the process ends ``seconds`` from now (``grace_s``, else 30 s, where not given)."""
        if seconds is None:
            seconds = self.grace_s if self.grace_s is not None else CALL_GRACE_S
        deadline = time.time() + float(seconds)
        got = self._got
        if got is None or deadline < got[1]:
            self._got = (what, deadline)

    @property
    def received(self) -> Optional[Tuple[str, float]]:
        """(what, deadline) of the notice this rank received, if any."""
        return self._got

    def close(self) -> None:
        """Put back the handlers found (where ours are still installed), and end the last boundary's exchange."""
        if threading.current_thread() is threading.main_thread():
            for sig, old in self._old.items():
                try:
                    if signal.getsignal(sig) == self._on_signal:
                        signal.signal(sig, old if old is not None else signal.SIG_DFL)
                except (ValueError, OSError):
                    pass
        self._old = {}
        work, self._work = self._work, None
        ended = True
        if work is not None:  # every rank posted it at the same boundary: it has completed, or will at once
            try:
                import datetime

                work.wait(datetime.timedelta(seconds=10))
            except Exception as e:  # noqa: BLE001 - a peer gone at the end must not fail close()
                ended = False  # its group is left to the process's end: destroyed now, gloo could abort
                log.debug("layerckpt: the last notice exchange did not complete: %s", e)
        group, self._group, self._pg = self._group, None, None
        if group is not None and ended:
            group.close()

    # ------------------------------------------------------------ agreeing

    def boundary(self, step: int) -> Optional[float]:
        """At a step boundary, on every rank: the deadline every rank agreed to act on at this ``step`` (once),
        else None.  Under several ranks, the result of the previous boundary's exchange, read now."""
        if self.agreed is not None:
            return None
        got = self._got
        mine = got[1] if got is not None else math.inf
        if self._pg is None:
            seen = mine
        else:
            seen = math.inf
            if self._work is not None:
                self._work.wait()
                seen = float(self._buf[0])
                self._work = None
            if seen == math.inf:
                import torch
                import torch.distributed as dist

                self._buf = torch.tensor([mine], dtype=torch.float64)
                self._work = dist.all_reduce(self._buf, op=dist.ReduceOp.MIN, group=self._pg, async_op=True)
        if seen == math.inf:
            return None
        self.agreed = (step, seen)
        what = got[0] if got is not None else "another rank's notice"
        log.warning("layerckpt: preemption notice (%s): stopping at step %d, %.1f s before the deadline", what, step,
                    seen - time.time())
        return seen

    def all_can(self, ok: bool) -> bool:
        """Whether every rank can (a blocking exchange over the notice group, at the agreed step only)."""
        if self._pg is None:
            return ok
        import torch
        import torch.distributed as dist

        t = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._pg)
        return bool(t.item())


def open_notice(preemption: Union[None, bool, str, Sequence[str]], grace_s: Optional[float],
                world: Optional[int] = None) -> Optional[Notice]:
    """A :class:`Notice` for ``Config.preemption`` (None where it is off): the signal handlers, and with several
    ranks the gloo group of every rank it agrees over, formed now (every rank must call this, in the same order).
    ``world``: the ranks taking part (default: torch.distributed's world, 1 outside it)."""
    from .. import _dist

    signals = signal_names(preemption)
    if signals is None:
        return None
    world = _dist.world_size() if world is None else world
    return Notice(signals, grace_s, group=_dist.Group(ranks=list(range(world))) if world > 1 else None)


def estimate_s(saves: List[Any]) -> Optional[float]:
    """What the next save needs from ``save()`` to its commit: the newest committed one's time (None: no save
    committed yet, nothing to go by)."""
    done = [p for p in saves if p.done() and p.error is None and not p.cancelled and p.durable_s > 0]
    return done[-1].durable_s if done else None


def wait_until(fn: Callable[[], None], deadline: float) -> Tuple[bool, Optional[BaseException]]:
    """Run ``fn`` on a thread of its own until ``deadline`` (time.time()): (whether it ended, its error)."""
    box: List[Optional[BaseException]] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the caller
            box[0] = e

    t = threading.Thread(target=run, name="layerckpt-notice", daemon=True)
    t.start()
    t.join(max(0.0, deadline - time.time()))
    return not t.is_alive(), box[0]
