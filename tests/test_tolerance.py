"""The one tolerance comparator (``rewrite.trust.tolerance``) that ``apply``'s check
and rule verification share."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rewrite.trust import check, verify
from rewrite.trust.tolerance import TOLERANCES, Tolerance, compare_tensors


def test_check_and_verify_read_the_same_tables_and_comparator():
    assert check.TOLERANCES is TOLERANCES
    assert check.compare_tensors is verify.compare_tensors is compare_tensors


def test_bitwise_allows_nothing_but_nan_for_nan_and_signed_zero():
    ref = torch.tensor([1.0, float("nan"), 0.0, float("inf")])
    assert compare_tensors(ref, torch.tensor([1.0, float("nan"), -0.0, float("inf")]), Tolerance.bitwise())[2] is None
    problem = compare_tensors(ref, ref.nextafter(torch.tensor(2.0)), Tolerance.bitwise())[2]
    assert problem is not None and "differ (exact rule)" in problem.message


@settings(max_examples=30, deadline=None)
@given(scale=st.floats(1e-3, 1e4), rel=st.floats(0.0, 0.9))
def test_approx_passes_within_and_fails_beyond_its_tolerance(scale, rel):
    ref = torch.linspace(-1, 1, 17, dtype=torch.float32) * scale
    tol = Tolerance.of(torch.bfloat16, "approx", floor=1.0)
    rtol, atol = TOLERANCES[torch.bfloat16]
    allowed = atol * max(1.0, scale)  # the tensor's largest value is `scale`
    assert compare_tensors(ref, ref + rel * allowed, tol)[2] is None
    _, _, problem = compare_tensors(ref, ref + 2.5 * allowed + rtol * scale, tol)
    assert problem is not None and "outside tolerance" in problem.message


def test_a_finite_value_turned_inf_fails_whatever_the_tolerance():
    ref = torch.tensor([1.0, 2.0])
    loose = Tolerance(rtol=1e9, atol=1e9, floor=None)
    _, _, problem = compare_tensors(ref, torch.tensor([1.0, math.inf]), loose)
    assert problem is not None and "inf or nan" in problem.message


def test_integers_are_exact_unless_an_agreement_share_is_allowed():
    ref = torch.arange(20)
    got = ref.clone()
    got[3] = 7
    assert compare_tensors(ref, got, Tolerance.of(torch.float32, "approx"))[2] is not None
    assert compare_tensors(ref, got, Tolerance.of(torch.float32, "approx"), agreement=0.95)[2] is None


def test_one_int8_step_widens_a_tight_tolerance():
    ref = torch.zeros(4)
    got = torch.full((4,), 0.05)
    tight = Tolerance.of(torch.float32, "approx", floor=1.0)
    assert compare_tensors(ref, got, tight)[2] is not None
    assert compare_tensors(ref, got, Tolerance.of(torch.float32, "approx", floor=1.0, quantum=0.1))[2] is None


def test_quantized_values_may_be_one_step_apart_only_when_approximate():
    ref = torch.quantize_per_tensor(torch.tensor([0.0, 1.0]), 0.1, 0, torch.qint8)
    got = torch.quantize_per_tensor(torch.tensor([0.0, 1.1]), 0.1, 0, torch.qint8)
    assert compare_tensors(ref, got, Tolerance.of(torch.float32, "approx"))[2] is None
    assert compare_tensors(ref, got, Tolerance.bitwise())[2] is not None


def test_loosest_prefers_the_lower_precision_on_a_tie():
    from rewrite.trust.tolerance import EXACT_TOLERANCES, loosest

    for kind, table in (("approx", TOLERANCES), ("exact", EXACT_TOLERANCES)):
        for order in ([torch.float32, torch.float16], [torch.float16, torch.float32]):
            assert loosest(order, kind) == torch.float16
    # a rewrite to float16 is never held tighter than float16's own rounding
    assert TOLERANCES[torch.float16] >= EXACT_TOLERANCES[torch.float16]


@settings(max_examples=30, deadline=None)
@given(fill=st.sampled_from([torch.finfo(torch.float32).min, -1e9, -1e4, 3e38]),
       masked=st.floats(0.1, 0.95), kind=st.sampled_from(["exact", "approx"]), seed=st.integers(0, 1000))
def test_a_wrong_value_next_to_mask_fills_is_caught(fill, masked, kind, seed):
    # HF-style masking: sigmoid scores with masked positions filled with a huge value;
    # a wrong rule (tanh for sigmoid) must not hide behind the fill's magnitude
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 16, generator=g)
    mask = torch.rand(6, 16, generator=g) < masked
    mask[0, 0] = False  # at least one score
    ref = torch.sigmoid(x).masked_fill(mask, fill)
    wrong = torch.tanh(x).masked_fill(mask, fill)
    _, _, problem = compare_tensors(ref, wrong, Tolerance.of(torch.float32, kind))
    assert problem is not None


def test_rounding_next_to_mask_fills_still_passes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=g, dtype=torch.float64)
    mask = torch.rand(6, 16, generator=g) < 0.5
    fill = torch.finfo(torch.float32).min
    ref = torch.softmax(x, -1).float().masked_fill(mask, fill)
    rounded = (torch.softmax(x, -1).float() * (1 + 1e-7)).masked_fill(mask, fill)
    assert compare_tensors(ref, rounded, Tolerance.of(torch.float32, "exact"))[2] is None
