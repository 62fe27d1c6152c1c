"""A token bucket: the bandwidth cap (``Config.remote_bandwidth``) that a tier's concurrent uploads share."""
from __future__ import annotations

import threading
import time


class TokenBucket:
    """At most ``rate`` bytes per second over every thread that calls :meth:`take`.

    Each caller takes tokens for a chunk *before* it writes it; a take that overdraws the bucket sleeps
    until the debt is paid, so N threads moving chunks at once together stay at ``rate`` (each waits for
    its own reservation, in the order they took).  Tokens saved while idle are capped at ``burst`` bytes:
    an upload after a pause may start that far ahead, never more.  The bucket starts empty, so a fresh
    upload of N bytes takes at least N / rate seconds.
    """

    def __init__(self, rate: float, burst: int):
        if rate <= 0 or burst <= 0:
            raise ValueError(f"TokenBucket needs rate > 0 and burst > 0, got rate={rate}, burst={burst}")
        self.rate = float(rate)
        self.burst = int(burst)
        self._lock = threading.Lock()
        self._tokens = 0.0
        self._t = time.monotonic()

    def take(self, nbytes: int) -> float:
        """Reserve ``nbytes`` of the bandwidth; returns after the reservation's time has come (seconds slept)."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(float(self.burst), self._tokens + (now - self._t) * self.rate)
            self._t = now
            self._tokens -= nbytes
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)
        return wait
