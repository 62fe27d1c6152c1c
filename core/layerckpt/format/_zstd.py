"""zstd for the encoded blocks (``_encode``, ``_qblock``): one compressor and decompressor per thread, and
the checked inflate a restore goes through."""
from __future__ import annotations

import threading

import numpy as np

from ..errors import CheckpointCorruptError

#: zstd for byte planes: level 1's fast strategy with a tiny hash table (64 entries), one probe and 7-byte
#: matches.  A plane of floats' bytes has few long repeats and many short false ones, which level 1 (a 4-byte
#: match, a hash of 2^14 entries) spends its time finding and then codes worse.  Measured on an AdamW state of
#: GPT-2-small-shaped tensors (``encode_block``, one thread, AMD EPYC VM), level 1 -> these: weights' delta
#: 1.04 -> 1.02 GB/s (1.396x -> 1.397x), ``exp_avg``'s delta 0.76 -> 1.76 GB/s (1.172x -> 1.186x),
#: ``exp_avg_sq``'s 1.04 -> 1.11 GB/s (1.403x both), self-contained weights 0.75 -> 1.66 GB/s (1.178x ->
#: 1.197x), sparse row updates 2.70 -> 3.17 GB/s (244x -> 273x).  Any zstd decoder reads the frames.
PLANE_PARAMS = dict(window_log=20, hash_log=6, chain_log=6, search_log=1, min_match=7, target_length=0)
PAYS = 0.96  # a plane (or a block) is stored compressed only below this fraction of its raw size
#: a block that reads its reference (a delta) is stored only below this fraction of the block's self-contained
#: size (its reference's, or its own code's): a restore reads the reference too, so a delta that saves less
#: would cost more time than it saves bytes
MARGIN = 0.8

_local = threading.local()


def _zstd():
    import zstandard

    return zstandard


def compressor():
    c = getattr(_local, "cctx", None)
    if c is None:
        z = _zstd()
        c = _local.cctx = z.ZstdCompressor(compression_params=z.ZstdCompressionParameters(
            strategy=z.STRATEGY_FAST, write_checksum=False, write_content_size=True, **PLANE_PARAMS))
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
