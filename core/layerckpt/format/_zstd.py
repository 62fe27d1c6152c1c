"""zstd for the encoded blocks (``_encode``, ``_qblock``): one compressor and decompressor per thread, and
the checked inflate a restore goes through."""
from __future__ import annotations

import threading

import numpy as np

from ..errors import CheckpointCorruptError

LEVEL = 1  # zstd level: the measured knee (higher levels bought < 2% more on the family, at 2-4x the time)
PAYS = 0.96  # a plane (or a block) is stored compressed only below this fraction of its raw size

_local = threading.local()


def _zstd():
    import zstandard

    return zstandard


def compressor():
    c = getattr(_local, "cctx", None)
    if c is None:
        c = _local.cctx = _zstd().ZstdCompressor(level=LEVEL, write_checksum=False)
    return c


def codes_compressor():
    """zstd for bounded-loss codes (``_qblock``): noise-like small integers, where a match is rare and level 1's
    search is time lost.  A fast strategy with a one-probe search, 7-byte matches and a 1 MiB window (a block's
    codes): measured on a GPT-2-small-shaped AdamW state, 2 threads, against level 1: weight deltas' encode 0.57
    -> 1.18 GB/s, exp_avg 0.60 -> 0.87 GB/s, ratios equal or better (9.30x -> 9.46x)."""
    c = getattr(_local, "qctx", None)
    if c is None:
        z = _zstd()
        c = _local.qctx = z.ZstdCompressor(compression_params=z.ZstdCompressionParameters(
            window_log=20, hash_log=10, chain_log=6, search_log=1, min_match=7, target_length=0,
            strategy=z.STRATEGY_FAST, write_checksum=False, write_content_size=True))
    return c


def _decompressor():
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = _zstd().ZstdDecompressor()
    return d


def inflate(part: memoryview, n: int, where: str) -> np.ndarray:
    """A zstd frame that must hold exactly ``n`` bytes, decompressed; a damaged one raises ``bad``'s error."""
    z = _zstd()
    try:
        claimed = z.frame_content_size(part)
        if claimed != n:
            raise bad(where, f"a compressed plane claims {claimed} bytes, expected {n}")
        got = _decompressor().decompress(part, max_output_size=n)
    except z.ZstdError as e:
        raise bad(where, f"a compressed plane does not decode ({e})") from None
    if len(got) != n:
        raise bad(where, f"a compressed plane decoded to {len(got)} bytes, expected {n}")
    return np.frombuffer(got, dtype=np.uint8)


def bad(where: str, msg: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"damaged encoded block in {where}: {msg}; the file is damaged: run "
                                  f"`layerckpt verify`, or restore an older step")
