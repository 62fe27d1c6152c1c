"""Bounded-loss codes for training state (opt-in; the format's default stays lossless).

Three codes, each with an error bound that holds element by element and that the caller sets:

- **weights, as a delta**: ``w - ref`` against a lossless reference, rounded to a multiple of ``step``: each
  element restored within ``step / 2`` of the saved one.  The reference is always self-contained and
  lossless, so errors never add up along a chain of saves.  ``step`` is meant to be a fraction of what one
  training step moves the layer (:func:`delta_step`), which keeps the error below the training's own noise.
- **signed moments** (Adam's ``exp_avg``, SGD's momentum): block-wise absmax scaling to 8 or 4 bits: each
  element within ``absmax(block) / 254`` (8 bits; ``/ 14`` at 4) of the saved one.
- **second moments** (Adam's ``exp_avg_sq``, non-negative): 8- or 4-bit codes of ``log2`` of the value in each
  block's own range, code 0 kept for exact zeros: each value within a relative error of
  ``2 ** (range / 508) - 1`` at 8 bits (about 2-5% for the ranges met in training; ``range / 28`` at 4), so
  ``sqrt(v)`` of a small value, by which Adam divides, is never rounded to 0 or blown up by its block's
  largest value.

Every code keeps the tensor's non-finite values refused (:class:`ValueError`): a NaN has no bounded error.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

#: elements per block of a moment code: one fp32 scale (or range) per BLOCK elements
BLOCK = 2048


@dataclass
class Coded:
    """A tensor's code: integer codes (int8, or the smallest signed int that holds a delta's) and the block
    scales or ranges (fp32), and what restores it (shape, dtype)."""
    kind: str  # "delta", "moment" or "sq"
    codes: torch.Tensor
    scales: torch.Tensor
    shape: tuple
    dtype: torch.dtype
    step: float = 0.0  # the delta's quantum
    bits: int = 8  # a moment code's width: 8, or 4 (two codes a byte)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()


def _finite(t: torch.Tensor, what: str) -> torch.Tensor:
    x = t.detach().reshape(-1).float()
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{what} holds NaN or infinite values, which no bounded-loss code represents; "
                         f"store it lossless")
    return x


def _blocks(x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """``x`` (flat) as rows of BLOCK elements, the last one padded with ``fill``."""
    pad = -x.numel() % BLOCK
    if pad:
        x = torch.cat([x, x.new_full((pad,), fill)])
    return x.view(-1, BLOCK)


# ---------------------------------------------------------------- weights: a delta against a lossless reference

def delta_step(update_rms: float, fraction: float) -> float:
    """The quantum of a weight delta: ``fraction`` of the RMS by which one training step moves the layer's
    elements (so each restored element is within ``fraction / 2`` of one step's move of it)."""
    if not update_rms > 0 or not fraction > 0:
        raise ValueError(f"delta_step needs a positive update RMS and fraction, got {update_rms!r}, {fraction!r}")
    return float(update_rms) * float(fraction)


def encode_delta(w: torch.Tensor, ref: torch.Tensor, step: float) -> Coded:
    """``w`` as ``ref + step * codes`` with integer codes: every element within ``step / 2`` (plus fp32
    rounding of the sum) of ``w``."""
    if w.shape != ref.shape:
        raise ValueError(f"a delta needs a reference of the same shape: {tuple(w.shape)} against {tuple(ref.shape)}")
    if not step > 0:
        raise ValueError(f"the delta's quantum must be positive, got {step!r}")
    d = (_finite(w, "the tensor").double() - _finite(ref, "the reference").double()) / step
    q = torch.round(d)
    top = float(q.abs().max()) if q.numel() else 0.0
    kind = torch.int8 if top <= 127 else torch.int16 if top <= 32767 else torch.int32 if top < 2 ** 31 else None
    if kind is None:
        raise ValueError(f"the delta spans {top:.3g} quanta of {step:.3g}: too far from its reference for a "
                         f"bounded code; store it lossless")
    return Coded("delta", q.to(kind), torch.tensor([step], dtype=torch.float64).float(), tuple(w.shape), w.dtype, step)


def decode_delta(c: Coded, ref: torch.Tensor) -> torch.Tensor:
    out = ref.detach().reshape(-1).double() + c.codes.double() * c.step
    return out.to(c.dtype).view(c.shape)


# ---------------------------------------------------------------- signed moments: block-wise absmax int8

def _check_bits(bits: int) -> int:
    if bits not in (4, 8):
        raise ValueError(f"a moment code is 8 or 4 bits wide, not {bits!r}")
    return bits


def pack(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8 values below 16), two a byte (the first in the low nibble)."""
    c = codes.to(torch.uint8).reshape(-1)
    if c.numel() % 2:
        c = torch.cat([c, c.new_zeros(1)])
    return c[0::2] | (c[1::2] << 4)


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)
    return out[:n]


def encode_moment(t: torch.Tensor, bits: int = 8) -> Coded:
    """Block-wise absmax, ``bits`` wide: each element within ``absmax(block) / (2 * L)`` of ``t``'s, where L =
    2 ** (bits - 1) - 1 (127 for 8 bits, 7 for 4)."""
    top = 2 ** (_check_bits(bits) - 1) - 1
    b = _blocks(_finite(t, "the moment"))
    scale = b.abs().amax(dim=1) / top
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(b / safe[:, None]).clamp_(-top, top).reshape(-1)[: t.numel()]
    codes = codes.to(torch.int8) if bits == 8 else pack(codes + top)
    return Coded("moment", codes, scale, tuple(t.shape), t.dtype, bits=bits)


def decode_moment(c: Coded) -> torch.Tensor:
    n = _numel(c.shape)
    top = 2 ** (c.bits - 1) - 1
    codes = c.codes.float() if c.bits == 8 else unpack(c.codes, n).float() - top
    b = _blocks(codes)
    return (b * c.scales[:, None]).reshape(-1)[:n].to(c.dtype).view(c.shape)


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------- second moments: block-wise log2, int8

def encode_sq(t: torch.Tensor, bits: int = 8) -> Coded:
    """Non-negative values as codes of log2 in each block's own [min, max] of the non-zero values (code 0:
    exactly zero, codes 1 to 2 ** bits - 1 spread evenly over the block's log range)."""
    steps = 2 ** _check_bits(bits) - 2
    x = _finite(t, "the second moment")
    if x.numel() and float(x.min()) < 0:
        raise ValueError("a second moment must be non-negative; this one has negative values")
    b = _blocks(x)
    zero = b <= 0
    lg = torch.log2(torch.where(zero, torch.ones_like(b), b))
    inf = torch.tensor(float("inf"))
    lo = torch.where(zero, inf, lg).amin(dim=1)
    hi = torch.where(zero, -inf, lg).amax(dim=1)
    empty = ~torch.isfinite(lo)  # a block of zeros
    lo = torch.where(empty, torch.zeros_like(lo), lo)
    hi = torch.where(empty, torch.zeros_like(hi), hi)
    width = (hi - lo).clamp_min(1e-12)
    codes = 1 + torch.round((lg - lo[:, None]) / width[:, None] * steps)
    codes = torch.where(zero, torch.zeros_like(codes), codes).to(torch.uint8).reshape(-1)[: t.numel()]
    return Coded("sq", codes if bits == 8 else pack(codes), torch.stack([lo, hi], dim=1).reshape(-1),
                 tuple(t.shape), t.dtype, bits=bits)


def decode_sq(c: Coded) -> torch.Tensor:
    n = _numel(c.shape)
    steps = 2 ** c.bits - 2
    b = _blocks((c.codes if c.bits == 8 else unpack(c.codes, n)).float())
    lo, hi = c.scales.view(-1, 2).unbind(1)
    v = torch.exp2(lo[:, None] + (b - 1.0) / steps * (hi - lo)[:, None])
    v = torch.where(b == 0, torch.zeros_like(v), v)
    return v.reshape(-1)[:n].to(c.dtype).view(c.shape)


def sq_bound(c: Coded) -> float:
    """The largest relative error :func:`decode_sq` can make on ``c``: half a code's step of the widest block's
    log2 range."""
    lo, hi = c.scales.view(-1, 2).unbind(1)
    width = float((hi - lo).max()) if lo.numel() else 0.0
    return 2.0 ** (width / (2 * (2 ** c.bits - 2))) - 1.0


def decode(c: Coded, ref: Optional[torch.Tensor] = None) -> torch.Tensor:
    if c.kind == "delta":
        if ref is None:
            raise ValueError("a delta decodes on top of its reference; pass it")
        return decode_delta(c, ref)
    return decode_moment(c) if c.kind == "moment" else decode_sq(c)
