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
Fingerprints are taken on the training thread, only of the tensors whose
sample says nothing moved and of those expected to stay put (see ``_plan``); a
tensor off the CPU is copied to the host in chunks of ``CHUNK`` bytes first.
"""
from __future__ import annotations

import zlib
from typing import Dict, Iterable, Optional, Tuple

import torch

from ._backend import checksum_function

CHUNK = 64 << 20
_crc32c = checksum_function("crc32c")

Fingerprint = Tuple[str, Tuple[int, ...], int]  # (dtype, shape, crc32c << 32 | crc32)


def fingerprint(t: torch.Tensor) -> Fingerprint:
    """The fingerprint of every byte of ``t`` (see the module docstring for what a match proves)."""
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    c, z = 0, 0
    for at in range(0, max(raw.numel(), 1), CHUNK):
        part = raw[at:at + CHUNK]
        if part.device.type != "cpu":
            part = part.cpu()
        view = memoryview(part.numpy())
        c = _crc32c(view, c)
        z = zlib.crc32(view, z)
    return str(t.dtype), tuple(t.shape), (c << 32) | z


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
