"""When encoding pays: the cost model behind ``Config(encoding='auto')``, measured online.

A tensor of ``n`` raw bytes that encodes ``R`` times smaller spares a sink ``n (1 - 1/R)`` bytes, which on a
sink moving ``B`` bytes a second is ``n (1 - 1/R) / B`` seconds of that sink's time.  Encoding it costs
``n / E`` seconds of a core (``E``: the encoder's rate, raw bytes per CPU second), and that core is taken
from the training in proportion ``charge``: all of it where the training's threads fill the cores (training
on the CPU), down to ``FLOOR`` where the encoder runs on cores the training leaves idle (a GPU run with
spare cores).  A kind of tensor is encoded for a sink only where

    (1 - 1/R) / B  >  charge / E          (per raw byte: the sink time saved beats the CPU charged)

with a margin before a kind starts being encoded (``MARGIN``), so that noise does not flip a decision
back and forth.  ``R`` and ``E`` are kept per tensor kind (:func:`kind`: dtype, role, frozen, row block) and
per mode (``compress``: byte planes + zstd of the tensor alone; ``delta``: against a host copy of its
previous version), from the encodes the saves make and, for kinds written raw, from small probes
(:class:`Probes`): a few hundred KiB of one tensor of the kind, encoded off the save's path, every
``PROBE_EVERY`` saves once the first ``WARM`` are in.  ``B`` is measured on the sink's own writes.

On this project's machine (2 cores, an NVMe-class disk writing 1.5-3 GB/s, the encoder 1-2 GB/s a thread)
dense fp32 state does not pay locally: at the 1.2-1.4x it codes to, a delta spares 0.1-0.15 ns of disk time
per byte where encoding it costs 0.5-1 ns of CPU.  What pays is what codes far smaller or faster than that:
tensors that did not change (a delta of zeros), a frozen layer that moved a little, sparse row updates, and
any kind of state bound for a slow remote (at 100 MB/s every kind of AdamW state pays).
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import AbstractSet, Any, Dict, List, Optional, Tuple

import numpy as np

from ..format import _encode
from ..format._manifest import MODEL, OPTIM, ROWS
from ..io._units import KiB

RAW, COMPRESS, DELTA = "raw", "compress", "delta"
FLOOR = 0.25  # the least share of a core an encoder thread is charged: idle cores still cost memory bandwidth
MARGIN = 1.25  # a kind starts being encoded only where it saves this many times what it costs
MIN_BYTES = 64 * KiB  # smaller tensors stay raw under 'auto': per-call costs dominate, and no reference is kept
DECAY = 0.6  # weight an estimate keeps at each new save's observations
PROBE = 256 * KiB  # bytes of one tensor a probe encodes
PROBE_EVERY = 8  # saves between probes of a kind, once WARM probes are in
WARM = 3
ROLES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "momentum_buffer": "momentum"}


def role(key: str) -> str:
    """A tensor's role by its key: weight, an optimizer state key of ROLES, another optimizer state, other."""
    if key.startswith(MODEL):
        return "weight"
    if key.startswith(OPTIM) and key.count("/") >= 2:
        return ROLES.get(key.split("#", 1)[0].rsplit("/", 1)[1], "state")
    return "other"


def kind(key: str, dtype: str, frozen: bool = False) -> str:
    """A tensor's kind for the cost model: dtype, role (weight, an optimizer state key, other), frozen, rows."""
    return f"{dtype} {role(key)}" + (" frozen" if frozen else "") + (" rows" if ROWS in key else "")


def charge(on_cpu: bool, training_threads: int, encoder_threads: int, cores: Optional[int] = None) -> float:
    """The share of an encoder thread's CPU time that comes out of the training: the part of the encoder
    threads that must share a core with the training's threads (all of them when training runs on the
    CPU with a thread per core), at least ``FLOOR``."""
    cores = cores or _cores()
    busy = training_threads if on_cpu else 1  # a GPU run keeps one core driving the device
    shared = min(encoder_threads, max(0, busy + encoder_threads - cores))
    return max(FLOOR, shared / max(1, encoder_threads))


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class Estimate:
    """Raw bytes in, encoded bytes out and CPU seconds of one kind's encodes in one mode, each save's
    observations weighted ``1 - DECAY`` against what came before."""

    __slots__ = ("raw", "out", "cpu", "fresh")

    def __init__(self) -> None:
        self.raw = self.out = self.cpu = 0.0
        self.fresh = [0.0, 0.0, 0.0]  # this save's, folded in at the next save

    def add(self, raw: int, out: int, cpu: float) -> None:
        self.fresh[0] += raw
        self.fresh[1] += out
        self.fresh[2] += cpu

    def fold(self) -> None:
        r, o, c = self.fresh
        if r:
            keep = DECAY if self.raw else 0.0
            self.raw = keep * self.raw + (1 - keep) * r
            self.out = keep * self.out + (1 - keep) * o
            self.cpu = keep * self.cpu + (1 - keep) * c
            self.fresh = [0.0, 0.0, 0.0]

    @property
    def known(self) -> bool:
        return self.raw > 0 and self.out > 0

    @property
    def ratio(self) -> float:
        return self.raw / self.out if self.out else 1.0

    @property
    def rate(self) -> float:
        """Raw bytes per CPU second (a very fast encode, below the clock's resolution, counts as 1 us)."""
        return self.raw / max(self.cpu, 1e-6)


class Sink:
    """Where a save's bytes go, and how fast it takes them: bytes per second, measured on its writes (the
    seconds spent waiting for them), or a cap that bounds it."""

    def __init__(self, name: str, cap: Optional[float] = None):
        self.name = name
        self.cap = cap
        self._bytes = 0.0
        self._seconds = 0.0

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            keep = DECAY if self._bytes else 0.0
            self._bytes = keep * self._bytes + (1 - keep) * nbytes
            self._seconds = keep * self._seconds + (1 - keep) * seconds

    @property
    def bandwidth(self) -> Optional[float]:
        """Bytes per second; None before any measurement (and without a cap)."""
        got = self._bytes / self._seconds if self._seconds else None
        if self.cap is not None:
            return min(self.cap, got) if got is not None else self.cap
        return got


@dataclass
class Verdict:
    mode: str
    why: str
    ratio: Optional[float] = None
    rate: Optional[float] = None

    def record(self, sink: Sink, charge_: float) -> Dict[str, Any]:
        bw = sink.bandwidth
        return {"mode": self.mode, "why": self.why, "ratio": _round(self.ratio), "rate": _round(self.rate),
                "sink": sink.name, "bandwidth": _round(bw), "charge": round(charge_, 3)}


def _round(x: Optional[float]) -> Optional[float]:
    return None if x is None else float(f"{x:.4g}")


class CostModel:
    """The estimates of every (kind, mode) and the current decision of every (sink, kind); thread-safe
    (saves decide on the flusher thread, encoder threads report)."""

    def __init__(self, delta: bool = True):
        self.delta = delta  # whether a delta (a host copy of the reference) may be chosen
        self._est: Dict[Tuple[str, str], Estimate] = {}
        self._mode: Dict[Tuple[str, str], str] = {}
        self._lock = threading.Lock()

    def observe(self, kind_: str, mode: str, raw: int, out: int, cpu: float) -> None:
        with self._lock:
            self._est.setdefault((kind_, mode), Estimate()).add(raw, out, cpu)

    def fold(self) -> None:
        """A new save: what the last one observed joins the estimates."""
        with self._lock:
            for e in self._est.values():
                e.fold()

    def estimate(self, kind_: str, mode: str) -> Optional[Estimate]:
        with self._lock:
            e = self._est.get((kind_, mode))
            return e if e is not None and e.known else None

    def decide(self, kind_: str, sink: Sink, charge_: float, delta_ok: bool = True) -> Verdict:
        """The mode ``kind_`` is written in to ``sink`` (see the module docstring)."""
        bw = sink.bandwidth
        if bw is None:
            return Verdict(RAW, f"{sink.name} bandwidth not measured yet")
        best: Optional[Tuple[float, str, Estimate]] = None
        seen: List[str] = []
        for mode in (DELTA, COMPRESS) if self.delta and delta_ok else (COMPRESS,):
            e = self.estimate(kind_, mode)
            if e is None:
                continue
            saved = (1 - 1 / e.ratio) / bw if e.ratio > 1 else 0.0  # sink seconds per raw byte
            cost = charge_ / e.rate  # CPU seconds charged per raw byte
            seen.append(f"{mode} {e.ratio:.2f}x at {e.rate / 1e9:.2f} GB/s saves {saved * 1e9:.3g} ns/B vs "
                        f"{cost * 1e9:.3g} ns/B of CPU")
            need = 1.0 if self._mode.get((sink.name, kind_)) == mode else MARGIN
            if saved > need * cost and (best is None or saved - cost > best[0]):
                best = (saved - cost, mode, e)
        where = f"{sink.name} {bw / 1e9:.3g} GB/s, CPU charged {charge_:.2f}"
        if best is None:
            why = ("; ".join(seen) if seen else "not measured yet") + f" ({where})"
            self._mode[(sink.name, kind_)] = RAW
            e = self.estimate(kind_, DELTA) or self.estimate(kind_, COMPRESS)
            return Verdict(RAW, why, e.ratio if e else None, e.rate if e else None)
        _, mode, e = best
        self._mode[(sink.name, kind_)] = mode
        return Verdict(mode, "; ".join(seen) + f" ({where})", e.ratio, e.rate)


class Probes:
    """Small samples of the kinds a save does not encode against a reference, so that the cost model keeps
    measuring what encoding them would give.  Per kind, one region (at most ``PROBE`` bytes of one tensor)
    is copied from every save that writes that tensor (a copy of a few hundred KiB); at a probe save the
    region is encoded against the copy the save before took (a delta) and on its own (compress), on an
    encoder thread once the save's data is durable, and the region moves on to the kind's next tensor."""

    def __init__(self, model: CostModel):
        self.model = model
        self._saves: Dict[str, int] = {}  # kind -> saves since its last probe
        self._count: Dict[str, int] = {}  # kind -> probes so far
        self._armed: Dict[str, Tuple[str, int, np.ndarray]] = {}  # kind -> (key, start, copy)
        self._turn: Dict[str, int] = {}

    def plan(self, items: List[Tuple[str, int, int, int]], kinds: List[str], wanted: AbstractSet[str]
             ) -> "ProbeSave":
        """This save's regions: ``items`` (key, image offset, bytes, element size) of the layout, ``kinds``
        theirs, ``wanted`` the kinds to probe."""
        arms: List[Tuple[str, str, int, int, int]] = []
        measures: List[Tuple[str, int, np.ndarray, int]] = []
        by_kind: Dict[str, List[int]] = {}
        for i, k in enumerate(kinds):
            if k in wanted and items[i][2] >= MIN_BYTES:
                by_kind.setdefault(k, []).append(i)
        for k, idx in by_kind.items():
            self._saves[k] = saves = self._saves.get(k, 0) + 1
            armed = self._armed.pop(k, None)
            here = None if armed is None else next((i for i in idx if items[i][0] == armed[0]), None)
            region = None
            if here is not None:
                key, start, copy = armed
                if self._count.get(k, 0) < WARM or saves >= PROBE_EVERY:  # measure, then move on
                    measures.append((k, items[here][1] + start, copy, items[here][3]))
                    self._saves[k] = 0
                    self._count[k] = self._count.get(k, 0) + 1
                else:  # the same region again, so that the next probe's delta spans one save
                    region = (key, start, copy.size, items[here])
            if region is None:
                self._turn[k] = t = self._turn.get(k, -1) + 1
                it = items[idx[t % len(idx)]]
                start = _start(it[2], t, it[3])
                n = min(PROBE, it[2] - start)
                region = (it[0], start, n - n % it[3], it)
            key, start, n, it = region
            if n > 0:
                arms.append((k, key, start, it[1] + start, n))
        return ProbeSave(self, arms, measures)


def _start(n: int, turn: int, es: int) -> int:
    """Where in a tensor of ``n`` bytes a probe's region starts: moving along it from one probe to the next."""
    if n <= PROBE:
        return 0
    s = (turn * 7 * PROBE) % (n - PROBE)
    return s - s % max(es, 1)


class ProbeSave:
    """One save's probe work: regions to copy as staging buffers pass (:meth:`tap`), then encodes to run
    after the save (:meth:`run`)."""

    def __init__(self, probes: Probes, arms: List[Tuple[str, str, int, int, int]],
                 measures: List[Tuple[str, int, np.ndarray, int]]):
        self.probes = probes
        #: (kind, key, start in the tensor, image offset, length): copied for the next probe
        self.arms = arms
        #: (kind, image offset, the armed copy, element size): encoded against this save's bytes there
        self.measures = measures
        self._copies = [np.empty(a[4], dtype=np.uint8) for a in arms]
        self._now = [np.empty(m[2].size, dtype=np.uint8) for m in measures]

    @property
    def empty(self) -> bool:
        return not self.arms and not self.measures

    def tap(self, base: int, view: memoryview, fill: int) -> None:
        """A staging buffer holding image bytes [base, base + fill): copy what it holds of the regions
        (before the buffer is encoded in place or reused)."""
        if self.empty:
            return
        buf = np.frombuffer(view, dtype=np.uint8, count=fill)
        for dst, off in [(c, a[3]) for c, a in zip(self._copies, self.arms)] + [
                (c, m[1]) for c, m in zip(self._now, self.measures)]:
            a, b = max(off, base), min(off + dst.size, base + fill)
            if a < b:
                dst[a - off:b - off] = buf[a - base:b - base]

    def run(self) -> None:
        """The probe encodes (on an encoder thread), then the copies armed for the next probe."""
        model = self.probes.model
        for (k, _, ref, es), now in zip(self.measures, self._now):
            if model.delta:
                _timed_encode(model, k, DELTA, now, ref, es)
            _timed_encode(model, k, COMPRESS, now, None, es)
        for (k, key, start, _, _), copy in zip(self.arms, self._copies):
            self.probes._armed[k] = (key, start, copy)


def _timed_encode(model: CostModel, kind_: str, mode: str, raw: np.ndarray, ref: Optional[np.ndarray],
                  es: int) -> None:
    _, _, stored, cpu = _encode.encode_timed(raw, ref, es)
    model.observe(kind_, mode, raw.size, max(stored, 1), cpu)
