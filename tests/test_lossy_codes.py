"""The bounded-loss codes (``layerckpt.format._lossy``): each one's error bound holds element by element, on sizes
that do not fill a block, with zeros, tiny values beside large ones and non-finite values refused."""
from __future__ import annotations

import math

import pytest
import torch

from layerckpt.format import _lossy


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("spread,kind", [(1.0, torch.int8), (300.0, torch.int16), (1e6, torch.int32)])
def test_a_delta_is_within_half_a_quantum_in_the_narrowest_integers(spread, kind):
    ref = torch.randn(3001, generator=_g())
    step = 1e-3
    w = ref + torch.randn(3001, generator=_g(1)) * step * spread / 4
    c = _lossy.encode_delta(w, ref, step)
    assert c.codes.dtype == kind
    got = _lossy.decode(c, ref)
    assert got.dtype == w.dtype and got.shape == w.shape
    err = (got.double() - w.double()).abs().max().item()
    assert err <= step / 2 + 2 * torch.finfo(torch.float32).eps * float(w.abs().max()), err
    assert err > step / 10  # it is lossy: the bound is not met by chance of an exact copy


def test_a_delta_refuses_what_it_cannot_bound():
    ref = torch.zeros(8)
    with pytest.raises(ValueError, match="NaN or infinite"):
        _lossy.encode_delta(torch.tensor([0.0] * 7 + [float("nan")]), ref, 1e-3)
    with pytest.raises(ValueError, match="same shape"):
        _lossy.encode_delta(torch.zeros(9), ref, 1e-3)
    with pytest.raises(ValueError, match="positive"):
        _lossy.encode_delta(torch.zeros(8), ref, 0.0)
    with pytest.raises(ValueError, match="too far from its reference"):
        _lossy.encode_delta(torch.full((8,), 1e4), ref, 1e-6)
    with pytest.raises(ValueError, match="pass it"):
        _lossy.decode(_lossy.encode_delta(torch.zeros(8), ref, 1.0))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", [1, 2047, 2048, 5001])
def test_a_moment_is_within_its_blocks_bound(bits, n):
    t = torch.randn(n, generator=_g(n)) * torch.logspace(-6, 0, n)  # blocks of very different scales
    c = _lossy.encode_moment(t.view(-1, 1) if n > 1 else t, bits)
    got = _lossy.decode(c).reshape(-1)
    top = 2 ** (bits - 1) - 1
    pad = -n % _lossy.BLOCK
    absmax = torch.cat([t.abs(), t.new_zeros(pad)]).view(-1, _lossy.BLOCK).amax(1)
    bound = (absmax / (2 * top)).repeat_interleave(_lossy.BLOCK)[:n] * (1 + 1e-5)
    assert ((got - t).abs() <= bound).all()
    assert c.nbytes <= n * bits // 8 + 1 + 4 * (-(-n // _lossy.BLOCK))
    assert torch.equal(_lossy.decode(_lossy.encode_moment(torch.zeros(n), bits)), torch.zeros(n))


@pytest.mark.parametrize("bits", [8, 4])
def test_a_second_moment_keeps_its_relative_error_and_its_zeros(bits):
    n = 4099
    v = torch.rand(n, generator=_g(3)).pow(8) * 1e-3
    v[::7] = 0.0
    v[5] = 1e-30  # a tiny value beside large ones: Adam divides by its square root
    v[6] = 10.0
    c = _lossy.encode_sq(v, bits)
    got = _lossy.decode(c)
    zero = v == 0
    assert torch.equal(got[zero], v[zero])
    rel = ((got[~zero].double() - v[~zero].double()).abs() / v[~zero].double()).max().item()
    bound = _lossy.sq_bound(c)
    assert rel <= bound * (1 + 1e-4) + 1e-6, (rel, bound)
    assert got[5] > 0 and abs(got[5].item() / 1e-30 - 1) <= bound + 1e-6
    # the widest block spans 1e-30 to 10: half a code's step of that log range
    assert abs(bound - (2 ** (math.log2(10 / 1e-30) / (2 * (2 ** bits - 2))) - 1)) < 1e-3 * bound
    with pytest.raises(ValueError, match="non-negative"):
        _lossy.encode_sq(torch.tensor([1.0, -1e-9]), bits)


def test_codes_are_eight_or_four_bits_and_four_pack_two_a_byte():
    with pytest.raises(ValueError, match="8 or 4 bits"):
        _lossy.encode_moment(torch.zeros(4), 2)
    codes = torch.randint(0, 16, (9,), generator=_g(), dtype=torch.uint8)
    packed = _lossy.pack(codes)
    assert packed.numel() == 5 and torch.equal(_lossy.unpack(packed, 9), codes)


def test_the_lossy_study_prices_bytes_and_loss_on_a_real_run():
    from layerckpt.bench import lossy
    from layerckpt.bench.family import WORKLOADS

    settings = ((2.0, 8, "base"), (8.0, 4, "chain"))
    r = lossy.run(WORKLOADS["finetune-1e-4"], settings, steps=20)
    eight, four = r["settings"]["q=2,8b,base"], r["settings"]["q=8,4b,chain"]
    assert r["saves"] == 4 and r["raw_bytes"] > 0
    # 4-bit moments and a coarser quantum write less than 8-bit ones and a fine quantum
    assert 1.0 < eight["ratio"] < four["ratio"]
    for row in (eight, four):
        assert [c["step"] for c in row["crashes"]] == [5, 10, 15]
        # lossy: some restore differs from the uninterrupted run, none by more than the loss bound
        assert any(c["deviation"] != 0.0 for c in row["crashes"])
        assert all(abs(c["deviation"]) < 0.005 for c in row["crashes"])
        assert row["cycles"]["restores"] == 3 and abs(row["cycles"]["deviation"]) < 0.01
    text = lossy.format_table({"rows": [r]})
    assert "finetune-1e-4" in text and f"{four['ratio']:.1f}x" in text
