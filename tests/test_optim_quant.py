"""The dynamic maps and block-wise quantisation (pure functions, one process).

The maps are checked bit for bit against bitsandbytes (an independent implementation, a test
extra: ``pip install bitsandbytes``; skipped when it does not import).
"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ragged_fsdp.optim.quant import (
    _bounds_for, dequantize_blockwise, dynamic_map, nearest_codes, num_blocks, quantize_blockwise,
    signed_map, unsigned_map,
)


def _bnb():
    try:
        import bitsandbytes.functional as F  # noqa: F401
    except Exception as e:  # not installed, or no usable backend
        pytest.skip(f"bitsandbytes not importable: {e}")
    return F


def test_maps_shape_and_order():
    for signed in (True, False):
        m = dynamic_map(signed)
        assert m.dtype == torch.float32 and m.shape == (256,)
        assert torch.all(m[1:] > m[:-1]), "sorted, no duplicates"
        assert m[-1] == 1.0 and (m == 0).sum() == 1
    s, u = signed_map(), unsigned_map()
    assert s.min() > -1 and s.min() < -0.99 and u.min() == 0
    # signed: the negative half mirrors the positive half below 1
    pos = s[s > 0][:-1]
    assert torch.equal(-pos.flip(0), s[s < 0])
    assert signed_map() is signed_map(), "one shared constant, not per call"


def test_maps_equal_bitsandbytes():
    F = _bnb()
    assert torch.equal(dynamic_map(True), F.create_dynamic_map(signed=True))
    assert torch.equal(dynamic_map(False), F.create_dynamic_map(signed=False))


def test_quantise_matches_bitsandbytes_blockwise():
    """Same absmax; codes equal except rare ties (bitsandbytes scales by a reciprocal)."""
    F = _bnb()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10 * 256 + 77, generator=g) * torch.logspace(-4, 1, 10 * 256 + 77)
    for code in (signed_map(), unsigned_map()):
        xx = x if code is signed_map() else x.abs()
        c, am = quantize_blockwise(xx, code, 256)
        c2, st2 = F.quantize_blockwise(xx, code=code, blocksize=256)
        assert torch.equal(am, st2.absmax)
        diff = (c.int() - c2.int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 5e-3
        same = F.dequantize_blockwise(c, absmax=am, code=code, blocksize=256)
        assert torch.equal(dequantize_blockwise(c, am, code, 256), same)


def test_roundtrip_error_and_partial_block():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3 * 256 + 5, generator=g)
    c, am = quantize_blockwise(x, signed_map(), 256)
    assert c.dtype == torch.uint8 and am.shape == (4,) and c.shape == x.shape
    assert am[-1] == x[-5:].abs().max()
    y = dequantize_blockwise(c, am, signed_map(), 256)
    # the largest gap of the signed map near 1 is ~0.0141: error <= half a gap times absmax
    err = (y - x).abs().view(-1)
    bound = torch.cat([am[:3].repeat_interleave(256), am[3:].expand(5)]) * 0.0071
    assert torch.all(err <= bound + 1e-12)
    assert torch.all(y.abs() <= torch.cat([am[:3].repeat_interleave(256), am[3:].expand(5)]))


def test_zero_blocks_and_nonnegative_second_moment():
    x = torch.zeros(600)
    x[300:310] = torch.arange(10.0)
    c, am = quantize_blockwise(x, unsigned_map(), 256)
    assert am[0] == 0 and torch.all(c[:256] == 0)
    y = dequantize_blockwise(c, am, unsigned_map(), 256)
    assert torch.equal(y[:256], torch.zeros(256)) and torch.all(y >= 0)
    assert y[309] == 9.0, "absmax itself is exact (code 1.0)"


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 2000), block=st.sampled_from([1, 7, 64, 256]),
       cut=st.integers(0, 50), seed=st.integers(0, 2**16), signed=st.booleans())
def test_any_run_of_whole_blocks_quantises_like_the_whole(n, block, cut, seed, signed):
    """What makes sharded 8-bit states exact: a rank's run of whole blocks gets the very codes
    and absmax the whole tensor gets."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    if not signed:
        x = x.abs()
    code = signed_map() if signed else unsigned_map()
    c, am = quantize_blockwise(x, code, block)
    nb = num_blocks(n, block)
    lo = min(cut, nb)
    hi = max(lo, nb - cut // 2)
    a, b = lo * block, min(hi * block, n)
    c2, am2 = quantize_blockwise(x[a:b], code, block)
    assert torch.equal(c2, c[a:b]) and torch.equal(am2, am[lo:hi])
    assert torch.equal(dequantize_blockwise(c2, am2, code, block),
                       dequantize_blockwise(c, am, code, block)[a:b])


def test_out_buffers_and_errors():
    x = torch.randn(513)
    codes = torch.empty(513, dtype=torch.uint8)
    absmax = torch.empty(3)
    c, am = quantize_blockwise(x, signed_map(), 256, codes_out=codes, absmax_out=absmax)
    assert c is codes and am.data_ptr() == absmax.data_ptr()
    with pytest.raises(ValueError, match="absmax"):
        dequantize_blockwise(codes, absmax[:2], signed_map(), 256)
    with pytest.raises(ValueError, match="block"):
        quantize_blockwise(x, signed_map(), 0)
    assert math.isclose(float(dequantize_blockwise(c, am, signed_map(), 256).sub(x).abs().max()), 0, abs_tol=0.05)


@pytest.mark.parametrize("signed", [True, False])
def test_lookup_equals_bucketize_at_every_bucket_edge(signed):
    """The 16-bit lookup gives torch.bucketize's answer: checked at both ends of every
    bucket in [-1, 1], at every decision boundary and one float either side of it."""
    code = signed_map() if signed else unsigned_map()
    b = _bounds_for(code)
    top = torch.arange(65536, dtype=torch.int64) << 16
    ends = torch.cat([top, top | 0xFFFF])
    ends = torch.where(ends >= 2 ** 31, ends - 2 ** 32, ends).to(torch.int32).view(torch.float32)
    ends = ends[torch.isfinite(ends) & (ends.abs() <= 1)]
    near = torch.cat([b, torch.nextafter(b, torch.full_like(b, 2.0)), torch.nextafter(b, torch.full_like(b, -2.0))])
    x = torch.cat([ends, near, torch.rand(100_000) * 2 - 1, torch.tensor([0.0, -0.0, 1.0, -1.0])])
    assert torch.equal(nearest_codes(x, code), torch.bucketize(x, b, out_int32=True))
