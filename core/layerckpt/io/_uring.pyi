"""Native io_uring writer and CRC32C for layerckpt (built from csrc/)."""
from typing import Any, List, Sequence

from typing_extensions import Buffer

HW_CRC32C: int
"""1 if crc32c() uses the CPU's CRC32 instruction, else 0."""

class Ring:
    """An io_uring with a fixed queue depth (1 to 256)."""

    def __init__(self, depth: int = 8) -> None: ...
    def write(self, fd: int, buffer: Buffer, offset: int, token: Any, path: Any = None, /) -> None:
        """Queue a write of the whole buffer at offset; blocks (GIL released) only when depth requests are in flight."""
    def read(self, fd: int, buffer: Buffer, offset: int, token: Any, path: Any = None, /) -> None:
        """Queue a read filling the writable buffer from offset (stops early at EOF)."""
    def wait(self, min_complete: int = 0, /) -> List[Any]:
        """Submit, wait for min_complete requests, return the tokens finished so far; OSError(errno, strerror, path) on failure."""
    def drain(self) -> List[Any]:
        """Wait for every queued request; returns their tokens."""
    def register_buffers(self, buffers: Sequence[Buffer], /) -> None:
        """Register writable buffers as fixed buffers, replacing any; an empty sequence unregisters."""
    def close(self) -> None:
        """Wait for I/O in flight and free the ring."""
    @property
    def inflight(self) -> int:
        """Requests queued or in flight."""
    @property
    def registered(self) -> int:
        """Number of registered buffers."""

def copy_crc32c(dst: Buffer, src: Buffer, crc: int = 0, /) -> int:
    """Copy src into dst (same length), returning the CRC32C of the bytes copied, continuing from crc; one pass."""
def crc32c(buffer: Buffer, crc: int = 0, /) -> int:
    """CRC32C (Castagnoli) of a buffer, continuing from crc."""

def populate(buffer: Buffer, /) -> None:
    """Fault in (and zero) the pages of a fresh writable buffer, GIL released."""

def probe() -> None:
    """Raise OSError if this kernel refuses io_uring."""

def planes(raw: Buffer, ref: Any, out: Buffer, esize: int, /) -> bool:
    """Byte planes of raw's elements (or, with ref, of the zigzag-mapped difference raw - ref) into out; whether any byte is nonzero."""
def unplanes(planes: Buffer, out: Buffer, esize: int, add: bool, /) -> None:
    """The inverse of planes(); with add, out holds the reference and the delta is added to it."""

def gather_runs(dst: Buffer, runs: Any, /) -> None:
    """The drift sample: for each (addr, start, stride, count, run, div), count runs of run fp32 elements, the i-th at
    addr + 4 * (start + i * stride), divided by div, copied into dst in order (addr 0: zeros)."""

def segsums(specs: Any, /) -> List[float]:
    """Per (a, b, g1, g2, n), summed in double over n fp32 elements: sum((a - b)^2) where g1 is 0 (b 0: sum(a^2)),
    else sum((g1 + g2) / 2 * (a - b))."""
