"""The one agreement protocol (``ragged_fsdp.agreement``): validate locally, then agree.

Real gloo ranks (W = 3, one launch): an invalid value on one rank is an error on every rank
(never a hang), a value that differs is an error naming each rank's value, and agreed values
come back in rank order. The references are written out by hand per rank."""

from __future__ import annotations

import pytest

from _dist import check_case, run_cases


def _expect(fn, kind, *parts):
    try:
        fn()
    except kind as e:
        for p in parts:
            assert p in str(e), (p, str(e))
        return
    raise AssertionError(f"expected {kind.__name__}")


def case_agree_returns_values(rank, world):
    from ragged_fsdp.agreement import agree

    assert agree("v", 7) == [7] * world
    assert agree("v", rank * 2, same=False) == [2 * r for r in range(world)]


def case_invalid_on_one_rank_raises_everywhere(rank, world):
    from ragged_fsdp.agreement import agree

    def check(v):
        return None if isinstance(v, int) and v > 0 else f"micro_batches={v!r} must be a positive integer"

    value = 0 if rank == 1 else 4
    if rank == 1:
        _expect(lambda: agree("global_order", value, validate=check), ValueError, "micro_batches=0")
    else:
        _expect(lambda: agree("global_order", value, validate=check), ValueError, "rank(s) [1]", "micro_batches=0")


def case_differing_values_named(rank, world):
    from ragged_fsdp.agreement import DisagreementError, agree

    value = 5 if rank == world - 1 else 4
    _expect(lambda: agree("micro_batches", value, fix="pass the same V"), DisagreementError,
            f"rank(s) [{world - 1}]: 5", "rank(s) [0, 1]: 4" if world > 2 else "rank(s) [0]: 4", "pass the same V")


def case_error_type_kept(rank, world):
    from ragged_fsdp.agreement import agree

    err = TypeError("bad type") if rank == 0 else None
    _expect(lambda: agree("x", 1, error=err), TypeError, "bad type")


def case_flags_and_raise_everywhere(rank, world):
    from ragged_fsdp.agreement import agree_flags, raise_everywhere

    assert agree_flags([rank, -rank]) == [world - 1, 0]
    raise_everywhere("nothing", None)
    err = RuntimeError("disk full") if rank == world - 1 else None
    _expect(lambda: raise_everywhere("save", err), RuntimeError, "disk full")


CASES = [case_agree_returns_values, case_invalid_on_one_rank_raises_everywhere, case_differing_values_named,
         case_error_type_kept, case_flags_and_raise_everywhere]


@pytest.fixture(scope="module")
def results():
    return run_cases(3, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_agreement(results, case):
    check_case(results, case, 3)


def test_first_line():
    from ragged_fsdp.agreement import first_line

    assert first_line(ValueError("a\nb")) == "a"
    assert first_line(KeyError()) == "KeyError"
