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


def test_adopts_torchao_nf4_bitwise():
    nf4 = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    torch.manual_seed(0)
    t = nf4.to_nf4(torch.randn(128, 256), 64, 256)
    q = NF4Weight.from_torchao(t)
    assert torch.equal(q.dequantize(), t.get_original_weight())
    assert torch.equal(torch.split(q, [64, 64])[1].dequantize(), t.get_original_weight()[64:])


def test_torchtitan_refuses_trainable_float8_weights_only():
    """torchao's float8 training weights run on CPU, but they are trainable subclass
    parameters, which the engine does not reduce: the torchtitan shim refuses them by name."""
    float8 = pytest.importorskip("torchao.float8")
    from ragged_fsdp.integrations.torchtitan.shard import fully_shard_for_torchtitan
    from ragged_fsdp.integrations.torchtitan.support import Refused

    m = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False))
    float8.convert_to_float8_training(m, config=float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    m(torch.randn(4, 64)).sum().backward()  # the converter itself works on CPU here
    with pytest.raises(Refused, match="trainable WeightWithDynamicFloat8CastTensor"):
        fully_shard_for_torchtitan(m)
