"""Exact change detection: whether a tensor is bit-identical to the version of it a checkpoint holds.

The drift sample (``_track``) can say a layer moved; it cannot say one did not,
since the elements it skips may have.  A layer counts as unchanged only when
every byte of every one of its tensors (weights, buffers, optimizer state)
fingerprints as the version persisted.  The fingerprint of a tensor is two
independent 32-bit CRCs of its bytes, CRC-32C (Castagnoli, the CPU's CRC
instruction) and CRC-32 (IEEE, zlib), together a CRC of degree 64 (the two
generators are coprime).  What it guarantees, for two byte strings of the same
length:

- equal bytes always give equal fingerprints;
- bytes that differ only within 8 consecutive bytes (one element of up to 8
  bytes, or two neighbours) never do: a burst no longer than the generator's
  degree;
- any other difference gives equal fingerprints only if, read as a polynomial
  over GF(2), it is a multiple of the degree-64 generator: a chance of 2^-64
  for a change not chosen against these polynomials (training updates are not).
  It is no cryptographic hash: a change crafted to collide would pass.

A tensor of another dtype or shape never matches (the fingerprint records both).
The two CRCs are taken of each ``CHUNK`` bytes of the tensor apart, and the
fingerprint holds them all: the guarantees above hold chunk by chunk, and
the chunks of many tensors are fingerprinted on several threads at once
(:func:`fingerprints`; both CRCs release the GIL).
Fingerprints are taken while ``save()`` runs, only of the tensors whose
sample says nothing moved and of those expected to stay put (see ``_plan``); a
tensor off the CPU is copied to the host a chunk at a time first.
"""
from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import torch

from ..format._entries import FINGERPRINT_CHUNK
from ..io._backend import checksum_function

CHUNK = FINGERPRINT_CHUNK
PARALLEL_BYTES = 32 << 20  # below this many bytes in all, the caller's thread fingerprints alone
THREADS = max(1, min(8, os.cpu_count() or 1))
_crc32c = checksum_function("crc32c")

Fingerprint = Tuple[str, Tuple[int, ...], Tuple[int, ...]]  # (dtype, shape, crc32c << 32 | crc32 of each chunk)


def _raw(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def _crc_pair(view: memoryview) -> int:
    """One chunk's part of a fingerprint: its CRC32C and its CRC-32 (zlib), two independent checks, in one int."""
    return (_crc32c(view) << 32) | zlib.crc32(view)


def _chunk_crc(part: torch.Tensor) -> int:
    if part.device.type != "cpu":
        part = part.cpu()
    return _crc_pair(memoryview(part.numpy()))


def _pieces(raw: torch.Tensor) -> List[torch.Tensor]:
    return [raw[at:at + CHUNK] for at in range(0, max(raw.numel(), 1), CHUNK)]


def fingerprint(t: torch.Tensor) -> Fingerprint:
    """The fingerprint of every byte of ``t`` (see the module docstring for what a match proves)."""
    return str(t.dtype), tuple(t.shape), tuple(_chunk_crc(p) for p in _pieces(_raw(t)))


def fingerprint_parts(dtype: torch.dtype, shape: Iterable[int], parts: Iterable[memoryview]) -> Fingerprint:
    """The fingerprint :func:`fingerprint` gives a tensor of ``dtype`` and ``shape`` whose bytes are ``parts``, read
    in turn (each ``CHUNK`` bytes but the last; one empty part for a tensor of no bytes): of bytes not in memory
    as a tensor (a file read a chunk at a time, ``read/_pretrained``)."""
    return str(dtype), tuple(shape), tuple(_crc_pair(v) for v in parts)


def fingerprints(tensors: Mapping[str, torch.Tensor]) -> Dict[str, Fingerprint]:
    """:func:`fingerprint` of each tensor, by key; host tensors of ``PARALLEL_BYTES`` or more in all are
    fingerprinted a chunk per task on up to ``THREADS`` threads (started and ended within the call)."""
    raws = {k: _raw(t) for k, t in tensors.items()}
    host = [k for k, r in raws.items() if r.device.type == "cpu"]
    if THREADS == 1 or sum(raws[k].numel() for k in host) < PARALLEL_BYTES:
        return {k: fingerprint(t) for k, t in tensors.items()}
    out = {k: fingerprint(t) for k, t in tensors.items() if raws[k].device.type != "cpu"}
    tasks = [(k, p) for k in host for p in _pieces(raws[k])]
    with ThreadPoolExecutor(THREADS, thread_name_prefix="layerckpt-fingerprint") as pool:
        crcs = list(pool.map(_chunk_crc, [p for _, p in tasks]))
    per_key: Dict[str, List[int]] = {k: [] for k in host}
    for (k, _), c in zip(tasks, crcs):
        per_key[k].append(c)
    for k in host:
        t = tensors[k]
        out[k] = (str(t.dtype), tuple(t.shape), tuple(per_key[k]))
    return out


class Fingerprints:
    """The fingerprint of each tensor's persisted version, by checkpoint key, where one was taken.

    Like the drift references, they move when a save that persists the tensor is planned, and are forgotten
    if that save fails: a tensor without one is never proven unchanged."""

    def __init__(self) -> None:
        self._ref: Dict[str, Fingerprint] = {}

    def __len__(self) -> int:
        return len(self._ref)

    def matches(self, key: str, now: Fingerprint) -> bool:
        """Whether ``now`` proves the tensor ``key`` bit-identical to its persisted version."""
        return self._ref.get(key) == now

    def persisted(self, keys: Iterable[str], taken: Dict[str, Fingerprint]) -> None:
        """The tensors ``keys`` are persisted now: their references become the fingerprints ``taken`` now
        (none where none was taken)."""
        for k in keys:
            fp: Optional[Fingerprint] = taken.get(k)
            if fp is None:
                self._ref.pop(k, None)
            else:
                self._ref[k] = fp

    def forget(self, keys: Iterable[str]) -> None:
        for k in keys:
            self._ref.pop(k, None)
