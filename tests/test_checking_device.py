"""The ordering-checking device itself (tests/_checking_device.py): it must make a read
before a wait, and a freed ``keep`` tensor, visible. No process group needed."""

from __future__ import annotations

import pytest
import torch

from _checking_device import CheckingDevice


def _launch(dev, out, keep=(), after=None):
    def comm(async_op):
        out.copy_(torch.arange(out.numel(), dtype=out.dtype))
        return None

    return dev.launch("all_gather", comm, keep=(out, *keep), out=(out,), after=after)


def test_outputs_are_nan_until_the_wait():
    dev = CheckingDevice(torch.device("cpu"))
    out = torch.zeros(6)
    v = out._version
    p = _launch(dev, out)
    assert torch.isnan(out).all(), "an output read before its wait must see NaN"
    assert out._version == v, "poisoning must not look like an in-place change to autograd"
    p.wait()
    assert torch.equal(out, torch.arange(6.0))


def test_accumulating_outputs_keep_their_contents():
    dev = CheckingDevice(torch.device("cpu"))
    out = torch.full((4,), 2.0)

    def comm(async_op):
        out.add_(1.0)  # a reduction into existing gradients
        return None

    p = dev.launch("reduce_scatter", comm, keep=(out,), out=(out,))
    assert torch.isnan(out).all()
    p.wait()
    assert torch.equal(out, torch.full((4,), 3.0))


def test_a_freed_keep_tensor_is_an_error():
    dev = CheckingDevice(torch.device("cpu"))
    out, src = torch.zeros(4), torch.ones(4)
    p = _launch(dev, out, keep=(src,))
    src.untyped_storage().resize_(0)
    with pytest.raises(AssertionError, match="freed or resized before its wait"):
        p.wait()


def test_after_runs_first_and_shared_outputs_are_restored_once():
    dev = CheckingDevice(torch.device("cpu"))
    t = torch.zeros(3)
    order = []

    def first(async_op):
        order.append("first")
        t.fill_(5.0)

    def second(async_op):
        order.append("second")
        t.mul_(2.0)

    a = dev.launch("reduce_scatter", first, keep=(t,), out=(t,))
    b = dev.launch("all_reduce", second, keep=(t,), out=(t,), after=a)
    b.wait()
    assert order == ["first", "second"] and torch.equal(t, torch.full((3,), 10.0))
