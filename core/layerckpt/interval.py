"""The checkpoint interval the failure rate calls for (Young/Daly), measured online.

A job that checkpoints every ``T`` seconds of training, pays ``C`` seconds of training per checkpoint and
fails on average every ``M`` seconds (its MTBF) loses, per second of training, about ``C / T`` to
checkpoints and ``T / (2 M)`` to the work redone after a failure (half an interval on average).  The sum
is smallest at

    T = sqrt(2 x C x M)            (Young 1974; Daly 2006 refines it to sqrt(2CM) - C for C < M/2)

:class:`Interval` measures ``C`` and the step time online, and turns ``T`` into a number of steps, bounded by
``min_steps`` and ``max_steps``.  ``C`` is all a save costs the training: what it blocks (``save()``'s return
plus the next step's wait for the copies, :attr:`layerckpt.PendingSave.blocked_s`) and how much it slows the
steps after it while its copies, encoding and flush, and the memory and remote tiers' copies of it after its
commit, share the machine (those steps' time beyond as many steps with no save in flight,
:meth:`layerckpt.PendingSave.settled`).  The step time is measured on steps with no save in flight; until it is,
a save waits for the one before it to settle and for a step that no save shares.  Before the first save's cost
is known, a save is taken to cost one step (so a job, or a job restarted after a failure, does not save at its
first step: its newest checkpoint is as fresh as it gets).  A selective checkpoint costs less than a full one,
so it is taken more often.
Assumptions, as in Young's: failures arrive independently at a constant rate (exponential, memoryless) with the
given mean; ``C`` is small beside ``M``; the restart's own cost does not depend on ``T`` (it does not move the
optimum); the cost and step time change slowly (they are moving averages over the last saves and steps).
"""
from __future__ import annotations

import logging
import math
import re
import time
from datetime import timedelta
from typing import Callable, Dict, Iterable, List, Optional, Union

from .write._flush import PendingSave
from .errors import ConfigError

log = logging.getLogger("layerckpt")

_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$", re.IGNORECASE)


def parse_duration(value: Union[str, float, int, timedelta], name: str = "mtbf") -> float:
    """Seconds of ``value``: a number of seconds, a ``timedelta`` or a string such as "8h", "30m", "2d"."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION_RE.match(value)):
        seconds = float(m.group(1)) * _SECONDS[(m.group(2) or "s").lower()]
    else:
        raise ConfigError(f"{name}={value!r} is not a duration; give seconds (28800), a timedelta or a string "
                          f"such as '8h', '30m', '2d'")
    if not seconds > 0 or math.isinf(seconds):
        raise ConfigError(f"{name}={value!r} must be a positive, finite duration")
    return seconds


class Interval:
    """Whether to checkpoint now, from the job's expected time between failures (see the module docstring).

    ::

        interval = layerckpt.Interval(mtbf="8h", min_steps=20, max_steps=5000)
        for step in range(start, steps):
            train_step()
            if interval.due(step):
                interval.saved(ckpt.save(step, loss=loss))

    Call :meth:`due` once per training step (or every few: the steps between calls are counted); when it
    says yes, save and hand the ``PendingSave`` (or the list of them, one per model) to :meth:`saved`.
    Until a save's cost is known, a save is taken to cost one step.  Under torch.distributed each rank measures
    its own clocks: broadcast rank 0's answer so that every rank saves together (the Lightning callback
    does).  :meth:`metrics` gives the chosen interval and its inputs for a logger.

    Args:
        mtbf: the job's mean time between failures: seconds, a ``timedelta`` or "8h", "30m", "2d".
        min_steps, max_steps: bounds on the interval in steps (``max_steps=None``: none above).
        smoothing: weight of the newest measurement in the moving averages of cost and step time.
        clock: seconds, monotonic (``time.perf_counter``; a stub in tests).
    """

    def __init__(self, mtbf: Union[str, float, timedelta], min_steps: int = 1, max_steps: Optional[int] = None, *,
                 smoothing: float = 0.3, clock: Callable[[], float] = time.perf_counter):
        self.mtbf_s = parse_duration(mtbf)
        if isinstance(min_steps, bool) or not isinstance(min_steps, int) or min_steps < 1:
            raise ConfigError(f"Interval(min_steps={min_steps!r}) must be an int >= 1")
        if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int)
                                      or max_steps < min_steps):
            raise ConfigError(f"Interval(max_steps={max_steps!r}) must be None or an int >= min_steps ({min_steps})")
        if not 0 < smoothing <= 1:
            raise ConfigError(f"Interval(smoothing={smoothing!r}) must be in (0, 1]")
        self.min_steps, self.max_steps, self.smoothing, self.clock = min_steps, max_steps, smoothing, clock
        self.checkpoint_cost_s: Optional[float] = None  # moving average of what one save cost training
        self.step_s: Optional[float] = None  # moving average of one training step with no save in flight
        self.steps = min_steps  # the interval now, in steps
        self._last: Optional[tuple] = None  # (step, clock, whether a save was in flight) of the previous due() call
        self._saved_at: Optional[int] = None  # step of the newest save (before one: the step before the first call)
        self._new: List[List[PendingSave]] = []  # saves since the previous due() call
        self._open: Optional[_Cost] = None  # the newest save, while its cost to the training is still adding up

    def due(self, step: int) -> bool:
        """Whether to checkpoint at ``step``: ``interval`` steps or more since the last save.  Measures the
        step time and the cost of the saves made since the previous call first."""
        now = self.clock()
        if self._last is not None and step <= self._last[0]:
            return False  # asked again at the same step: measured and answered already
        self._measure(step, now)
        flying = self._open is not None and not self._open.done()
        self._last = (step, now, flying)
        if self._saved_at is None:  # the first call comes after one step: counted from the step before
            self._saved_at = step - 1
        if step - self._saved_at < self.steps or self.step_s is None:
            return False  # (no step time yet: a step that no save shares is measured first)
        self._saved_at = step
        return True

    def saved(self, saves: Union[PendingSave, Iterable[PendingSave]]) -> None:
        """The save(s) made at the step :meth:`due` said yes to; their cost is read at the next call (the
        next step's wait for the copies is part of it)."""
        group = [saves] if isinstance(saves, PendingSave) else list(saves)
        if group:
            self._new.append(group)

    def metrics(self) -> Dict[str, float]:
        """The chosen interval and its inputs, for a logger (a cost or step time not measured yet is left out)."""
        out = {"layerckpt/interval_steps": float(self.steps), "layerckpt/interval_mtbf_s": self.mtbf_s}
        if self.checkpoint_cost_s is not None:
            out["layerckpt/interval_ckpt_cost_s"] = self.checkpoint_cost_s
        if self.step_s is not None:
            out["layerckpt/interval_step_s"] = self.step_s
        return out

    def optimum_s(self) -> Optional[float]:
        """Young's interval in seconds, sqrt(2 x C x MTBF), once a save's cost is measured."""
        return None if self.checkpoint_cost_s is None else math.sqrt(2 * self.checkpoint_cost_s * self.mtbf_s)

    def __repr__(self) -> str:
        return (f"Interval(mtbf={self.mtbf_s:g}s, every {self.steps} steps, cost={self.checkpoint_cost_s}, "
                f"step={self.step_s})")

    def _measure(self, step: int, now: float) -> None:
        """From the time since the previous call: a step time where no save was in flight, else more of the
        newest save's cost; a save made at that call opens its own (the one before it is then complete)."""
        paid = sum(p.blocked_s for g in self._new for p in g)
        if self._new:
            self._close()
            self._open = _Cost(self._new)
        self._new = []
        if self._last is not None:
            last_step, last_t, flying = self._last
            took = max(now - last_t - paid, 0.0)  # the steps' own time, less what the save blocked
            if self._open is not None and (flying or paid):  # a save shared these steps: they count toward it
                self._open.add(paid, took, step - last_step)
            else:
                self.step_s = self._average(self.step_s, took / (step - last_step))
                self._close()  # nothing was in flight: the newest save's cost is complete
        self._choose()

    def _close(self) -> None:
        if self._open is not None:
            self.checkpoint_cost_s = self._average(self.checkpoint_cost_s, self._open.cost(self.step_s))
            self._open = None

    def _average(self, old: Optional[float], new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def _choose(self) -> None:
        if not self.step_s:
            return
        # no save's cost known yet: one step's time, the least a save of the training's state plausibly costs
        best = self.optimum_s() or math.sqrt(2 * self.step_s * self.mtbf_s)
        steps = max(self.min_steps, int(round(best / self.step_s)))
        if self.max_steps is not None:
            steps = min(steps, self.max_steps)
        if steps != self.steps:
            cost = self.step_s if self.checkpoint_cost_s is None else self.checkpoint_cost_s
            log.info("layerckpt: checkpoint every %d steps (sqrt(2 x cost %.3gs%s x MTBF %.3gs) = %.3gs at %.3gs a "
                     "step, bounded to [%d, %s])", steps, cost, " (one step: no save measured yet)"
                     if self.checkpoint_cost_s is None else "", self.mtbf_s, best, self.step_s, self.min_steps,
                     self.max_steps)
        self.steps = steps


class _Cost:
    """One save's cost to the training, adding up over the steps it shares: what it blocked, and the time of
    those steps beyond as many steps with no save in flight."""

    __slots__ = ("saves", "blocked", "took", "steps")

    def __init__(self, saves: List[List[PendingSave]]):
        self.saves = [p for g in saves for p in g]
        self.blocked = self.took = 0.0
        self.steps = 0

    def done(self) -> bool:
        return all(p.settled() for p in self.saves)

    def add(self, blocked: float, took: float, steps: int) -> None:
        self.blocked += blocked
        self.took += took
        self.steps += steps

    def cost(self, step_s: Optional[float]) -> float:
        slowed = 0.0 if step_s is None else max(self.took - self.steps * step_s, 0.0)
        return self.blocked + slowed
