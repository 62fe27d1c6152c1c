"""Progress bars for the command line's long operations: bytes done and the rate, on stderr.

Shown only when stderr is a terminal, ``quiet`` is off and tqdm (the progress library Lightning and
the HF stack use) is importable; otherwise every call here does nothing.  The library's own
functions never create one: only ``layerckpt.cli`` does.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
from typing import Callable, Iterator, Optional


def wanted(quiet: bool = False) -> bool:
    """Whether to draw bars: not ``quiet``, stderr a terminal, tqdm installed."""
    if quiet or not _isatty(sys.stderr):
        return False
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


def _columns() -> int:
    """stderr's width; 80 where it reports none (0 columns: some pseudo-terminals), not an empty bar."""
    try:
        cols = os.get_terminal_size(sys.stderr.fileno()).columns
    except (AttributeError, ValueError, OSError):
        cols = 0
    return cols or shutil.get_terminal_size().columns


class Bar:
    """One bar of ``total`` bytes (None: unknown, then bytes and rate only); a no-op when not ``shown``."""

    def __init__(self, total: Optional[int], desc: str, shown: bool):
        self._bar = None
        if shown:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                             leave=False, ncols=_columns(), mininterval=0.2)

    def update(self, nbytes: int) -> None:
        if self._bar is not None and nbytes:
            self._bar.update(nbytes)

    def set(self, nbytes: int) -> None:
        """Bytes done so far (a watched count)."""
        if self._bar is not None and nbytes > self._bar.n:
            self._bar.update(nbytes - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Bar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def watching(count: Callable[[], int], total: Optional[int], desc: str, shown: bool,
             every_s: float = 0.2) -> Iterator[Bar]:
    """A bar fed by polling ``count()`` (bytes done so far) on a thread, for work that reports nothing
    itself (a library call writing a file or folder)."""
    with Bar(total, desc, shown) as bar:
        if not shown:
            yield bar
            return
        stop = threading.Event()
        base = count()

        def poll() -> None:
            while not stop.wait(every_s):
                bar.set(count() - base)

        t = threading.Thread(target=poll, name="layerckpt-progress", daemon=True)
        t.start()
        try:
            yield bar
        finally:
            stop.set()
            t.join()


def size_of(path: str) -> int:
    """Bytes under ``path`` (a file, or a directory's files); 0 while it does not exist."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(d, f))
            except OSError:  # renamed or removed meanwhile
                pass
    return total


def process_io() -> int:
    """Bytes this process has read and written through the storage layer so far (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields.get("read_bytes", 0)) + int(fields.get("write_bytes", 0))
    except (OSError, ValueError):
        return 0


class _BarSafe:
    """stdout that clears the bars before each write (a table printed while a bar runs stays readable)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, s: str) -> int:
        from tqdm import tqdm

        with tqdm.external_write_mode(file=sys.stderr):
            return self._stream.write(s)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def printing_beside(shown: bool) -> Iterator[None]:
    """While bars may run: what goes to stdout clears them first."""
    if not shown:
        yield
        return
    old, sys.stdout = sys.stdout, _BarSafe(sys.stdout)
    try:
        yield
    finally:
        sys.stdout = old
