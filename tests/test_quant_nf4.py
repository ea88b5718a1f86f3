"""NF4Weight (ragged_fsdp.quant.nf4): QLoRA's format, splits on whole scaler blocks, and the
same bits as torchao's NF4Tensor when adopted from it. No process group."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ragged_fsdp.quant.nf4 import NF4Weight, nf4_rows_unit


def test_quantise_error_and_linear():
    torch.manual_seed(0)
    w = torch.randn(128, 256)
    q = NF4Weight.from_float(w)
    d = q.dequantize()
    # the largest NF4 gap is 0.3038 of a block's absmax (between -1 and -0.696): half of it
    absmax = w.view(-1, 64).abs().amax(1).repeat_interleave(64).view_as(w)
    assert ((d - w).abs() <= 0.16 * absmax + 1e-2).all()
    x = torch.randn(3, 256, requires_grad=True)
    y = F.linear(x, torch.nn.Parameter(q, requires_grad=False))
    assert torch.equal(y, F.linear(x, d))
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(3, 128) @ d)


def test_split_rows_keeps_scaler_blocks_whole():
    w = NF4Weight.from_float(torch.randn(192, 128))  # 1.5 scaler blocks of 64 * 256 values
    assert nf4_rows_unit(128) == 128 and w.ragged_granularity == "rows:128"
    a, b, c = torch.split(w, [128, 64, 0])
    assert torch.equal(torch.cat([a.dequantize(), b.dequantize()]), w.dequantize())
    assert c.shape == (0, 128)
    with pytest.raises(ValueError, match="cut a scaler block"):
        torch.split(w, [64, 128])
    with pytest.raises(NotImplementedError, match="NF4Weight does not implement"):
        w + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adopts_torchao_nf4_bitwise(dtype):
    """bf16: torchao keeps bf16 factors, mean and codebook and dequantises in bf16; with fp32
    math on them (before) 13256 of these 65536 values differed, by up to 0.0156."""
    nf4 = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    torch.manual_seed(0)
    t = nf4.to_nf4(torch.randn(256, 256).to(dtype), 64, 256)
    q = NF4Weight.from_torchao(t)
    assert torch.equal(q.dequantize(), t.get_original_weight())
    assert torch.equal(q.get_original_weight(), t.get_original_weight())
    assert torch.equal(q.dequantize(torch.float32), t.to(torch.float32))  # what F.linear in fp32 uses
    assert torch.equal(torch.split(q, [64, 192])[1].dequantize(), t.get_original_weight()[64:])


def test_pickles_own_bytes_and_loads_weights_only():
    """DCP writes each piece with torch.save and reads it with torch.load(weights_only=True)
    (before: UnpicklingError, and a piece pickled its whole unsharded weight's storage)."""
    import io

    w = NF4Weight.from_float(torch.randn(256, 128))  # 2 scaler blocks
    piece = torch.split(w, [128, 128])[1]
    whole, part = io.BytesIO(), io.BytesIO()
    torch.save(w, whole)
    torch.save(piece, part)
    assert len(part.getvalue()) < 0.7 * len(whole.getvalue())
    part.seek(0)
    back = torch.load(part, weights_only=True)
    assert type(back) is NF4Weight and torch.equal(back.dequantize(), piece.dequantize())
    # rows by narrow (DCP's resharding) and copy_ into a piece's own tensors (its load)
    dst = NF4Weight.from_float(torch.zeros(256, 128))
    view = dst.narrow(0, 128, 128)
    assert type(view) is NF4Weight and view.codes.data_ptr() == dst.codes.data_ptr() + 128 * 128 // 2
    view.copy_(back)
    assert torch.equal(dst.dequantize()[128:], piece.dequantize())
    plain = torch.empty(128, 128)
    plain.copy_(back)  # into plain values: dequantised
    assert torch.equal(plain, piece.dequantize())
    with pytest.raises(TypeError, match="re-quantising.*from_float"):
        view.copy_(torch.zeros(128, 128))


class _OtherHooked(torch.Tensor):
    """A tensor subclass with FSDP2's all-gather hooks that is not torchao's float8 weight."""

    def fsdp_pre_all_gather(self, mesh):
        raise AssertionError("not reached: refused before fully_shard")

    def fsdp_post_all_gather(self, outs, metadata, param_dtype, *, out=None):
        raise AssertionError("not reached: refused before fully_shard")


def test_torchtitan_refuses_untested_trainable_subclass_weights():
    """The torchtitan shim lets the float8 Linear converter's trainable weights through
    (trained against torch's fully_shard in test_quantized_weights.py) and refuses other
    trainable subclass weights (MX / NVFP4) by name."""
    from ragged_fsdp.integrations.torchtitan.shard import _TESTED_TRAINABLE, fully_shard_for_torchtitan
    from ragged_fsdp.integrations.torchtitan.support import Refused

    assert ("torchao.float8.fsdp_utils", "WeightWithDynamicFloat8CastTensor") in _TESTED_TRAINABLE
    m = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False))
    m[0].weight = torch.nn.Parameter(torch.randn(8, 8).as_subclass(_OtherHooked))
    with pytest.raises(Refused, match="trainable _OtherHooked"):
        fully_shard_for_torchtitan(m)
