"""What rule verification draws, so that subtly wrong rules get counterexamples in a
small budget: every dtype the rule admits among its first instances (whatever ran
before in the process), 0-d tensors and dims of size 0 where the ops take them,
non-contiguous tensors of every dtype, operands the other broadcasts to, the
floats' largest finite values, the integers' extremes. Each wrong rule below is
wrong in one class (named by its comment) and must be reported as a counterexample
with ``max_examples=10`` and with the default budget; the correct ones must still
verify."""

from __future__ import annotations

import re

import pytest
import torch

import rewrite
from rewrite.language import RuleError
from rewrite.trust.instances import draw_instance, plan_for, strategies, trapping_division
from rewrite.trust.verify import verify_rule, verify_rules

#: (name, rule), each wrong somewhere in its domain
WRONG = [
    # bool arithmetic: bool * 2 is int64, bool + bool saturates
    ("bool_mul_add", "mul(x, 2) => add(x, x)"),
    ("bool_add_mul", "add(x, x) => mul(x, 2)"),
    ("bool_saturating_add", "to(add(x, y), torch.int64) => add(to(x, torch.int64), to(y, torch.int64))"),
    # integer wrap and extremes
    ("int_halve_double", 'div(add(x, x), 2, rounding_mode="trunc") where dtype(x) == torch.int32 => x'),
    ("int_relu_abs", "relu(abs(x)) => abs(x)"),  # abs(INT_MIN) is INT_MIN
    ("int_narrowing_roundtrip", "to(to(x, torch.int32), torch.int64) where dtype(x) == torch.int64 => x"),
    ("int_neg_before_cast", "neg(to(x, torch.float64)) where dtype(x) == torch.int64 "
                            "=> to(neg(x), torch.float64)"),
    ("int8_via_uint8", "to(to(x, torch.uint8), torch.int64) where dtype(x) == torch.int8 => to(x, torch.int64)"),
    ("unsigned_abs_neg", "abs(neg(x)) => abs(x)"),  # uint8: -1 is 255
    # integer vs true division, rounding modes
    ("floor_is_trunc", 'div(x, 2, rounding_mode="floor") => div(x, 2, rounding_mode="trunc")'),
    # (its instances meet int32's minimum over -1, which traps torch's kernel: not run)
    ("int_trunc_is_floor", 'div(x, y, rounding_mode="trunc") where dtype(x) == torch.int32 '
                           '=> div(x, y, rounding_mode="floor")'),
    ("true_div_int", "div(mul(x, 2), 2) => x"),
    # edge values: NaN, infinities, -0.0, overflow
    ("pow_zero_nan", "pow(x, 0) where is_float(x) => add(mul(x, 0), 1)"),
    ("signed_zero_reciprocal", "reciprocal(add(x, 0)) where is_float(x) => reciprocal(x)"),
    ("double_then_halve", "div(mul(x, 2), 2) where is_float(x) => x"),
    ("zero_times_y", "add(x, mul(_, 0)) where is_float(x) => x"),
    # broadcasting that changes the output shape
    ("broadcast_cancel_int", "sub(add(x, y), y) where dtype(x) == torch.int64 => x"),
    ("broadcast_times_one", "mul(x, div(y, y)) where is_float(x) => x"),
    # non-contiguous inputs
    ("reshape_is_view_int", "reshape(x, s) where dtype(x) == torch.int64 => view(x, s)"),
    ("flatten_is_view", "flatten(x, 0, -1) => view(x, (-1,))"),
    # rank-0 and empty
    ("flatten_rank_le1", "flatten(x) where rank(x) <= 1 => x"),
    ("reshape_rank_le1", "reshape(x, (-1,)) where rank(x) <= 1 => x"),
    ("sum_keepdim_unsqueeze", "sum(x, d, True) where is_literal(d) and not is_none(d) "
                              "=> unsqueeze(sum(x, d, False), d)"),
    ("mean_of_empty", "mul(mean(x, d, k), 0.0) where is_float(x) => mul(sum(x, d, k), 0.0)"),
    ("cat_legacy_empty", "cat([x, y], 1) where is_float(x) "
                         "=> transpose(cat([transpose(x, 0, 1), transpose(y, 0, 1)], 0), 0, 1)"),
    # reduction dims and keepdim
    ("amax_all_is_last", "amax(x, (), k) => amax(x, -1, k)"),
    ("mean_drops_keepdim", "mean(x, d, True) => mean(x, d, False)"),
    # dtype promotion
    ("half_sum_in_half", "add(to(x, torch.float32), 2.0) where dtype(x) == torch.float16 "
                         "=> to(add(x, 2.0), torch.float32)"),
    ("int_times_float_two", "mul(x, 2.0) => mul(x, 2)"),
    ("lossy_roundtrip", "to(to(x, torch.float16), torch.float32) where dtype(x) == torch.float32 => x"),
    # commutativity of non-commutative ops
    ("cat_swapped", "relu(cat([x, y], d)) => cat([relu(y), relu(x)], d)"),
    ("sub_swapped", "sub(x, y) where is_float(x) => add(neg(x), y)"),
    ("pow_swapped", "pow(x, y) where is_tensor(y) => pow(y, x)"),
    ("clamp_order", "clamp(x, a, b) where is_number(a) and is_number(b) "
                    "=> clamp(clamp(x, None, b), a, None)"),
    # approximate rules claimed exact
    ("div_by_reciprocal", "div(x, y) where is_float(x) => mul(x, reciprocal(y))"),
    ("gelu_tanh", 'gelu(x) => gelu(x, "tanh")'),
    ("log_exp", "log(exp(x)) => x"),
    ("reassociate", "div(mul(x, y), z) where is_float(x) => mul(x, div(y, z))"),
]

#: the cases the suite runs, at least one per class (each takes 1-25 s, most of it
#: shrinking: all of them take about 10 minutes of one core); the others were found
#: in ten examples too when this was written: ``_verify(name, text)`` for one
SUITE = {"bool_mul_add", "floor_is_trunc", "unsigned_abs_neg", "int_neg_before_cast", "pow_zero_nan",
         "zero_times_y", "signed_zero_reciprocal", "broadcast_cancel_int", "reshape_is_view_int",
         "flatten_rank_le1", "reshape_rank_le1", "mean_of_empty", "amax_all_is_last", "clamp_order",
         "int_times_float_two", "div_by_reciprocal"}

CORRECT = [
    ("neg_sub", "neg(sub(x, y)) => sub(y, x)"),
    ("transpose_rank_le1", "transpose(x, 0, -1) where rank(x) <= 1 => x"),
    ("reshape_flat", "reshape(x, (-1,)) => flatten(x)"),
    ("abs_neg_float", "abs(neg(x)) where is_float(x) => abs(x)"),
    ("double", "add(x, x) where is_float(x) => mul(x, 2)"),
    ("sub_neg", "sub(x, neg(y)) => add(x, y)"),
    ("halve", "div(x, 2) where is_float(x) => mul(x, 0.5)"),
    ("squeeze_unsqueeze", "squeeze(unsqueeze(x, d), d) => x"),
    ("flatten_reshape", "flatten(x, 0, -1) => reshape(x, (-1,))"),
    ("amax_unsqueeze", "amax(unsqueeze(x, d), d) => x"),
    ("widen_back", "to(to(x, torch.float64), torch.float32) where dtype(x) == torch.float32 => x"),
]


def _verify(name: str, text: str, n: int = 10, seed: int = 0):
    return verify_rule(rewrite.parse(f"rule {name}: {text}", "case.rw"), name, max_examples=n, seed=seed)


@pytest.mark.parametrize("name, text", [(n, t) for n, t in WRONG if n in SUITE],
                         ids=[n for n, _ in WRONG if n in SUITE])
def test_a_subtly_wrong_rule_gets_a_counterexample_in_ten_examples(name, text):
    v = _verify(name, text)
    assert v.status == "counterexample", v
    assert v.counterexample.kind in ("mismatch", "error", "non-termination"), v


@pytest.mark.parametrize("name, text", CORRECT, ids=[n for n, _ in CORRECT])
def test_a_correct_rule_still_verifies(name, text):
    v = _verify(name, text)
    assert v.status == "ok", v
    assert v.checked >= 3, v


# ---------------------------------------------------------------- leading instances


@pytest.mark.parametrize("name, text, dtype", [
    ("bool_only", "mul(x, 2) => add(x, x)", "bool"),
    ("uint8_only", "abs(neg(x)) => abs(x)", "uint8"),
])
def test_every_dtype_is_met_whatever_the_budget(name, text, dtype):
    # wrong in one dtype of nine, and found with a budget of three: the first
    # instances are one per dtype, not hypothesis' adaptive choice
    v = _verify(name, text, n=3)
    assert v.status == "counterexample", v
    assert v.counterexample.dtype == dtype


@pytest.mark.slow
def test_every_dtype_is_met_after_other_rules_were_verified():
    # what ran before in the process changes hypothesis' draws, not the leading ones
    verify_rules(rewrite.load("rules/cleanup.rw"), max_examples=3)
    assert _verify("bool_only", "mul(x, 2) => add(x, x)").status == "counterexample"
    assert _verify("uint8_only", "abs(neg(x)) => abs(x)").status == "counterexample"
    assert _verify("empty_only", "mul(mean(x, d, k), 0.0) where is_float(x) "
                                 "=> mul(sum(x, d, k), 0.0)").status == "counterexample"


@pytest.mark.parametrize("name, text, shape", [
    ("scalar_only", "reshape(x, (-1,)) where rank(x) <= 1 => x", r"\[\]"),
    ("empty_only", "mul(mean(x, d, k), 0.0) where is_float(x) => mul(sum(x, d, k), 0.0)",
     r"\[(\d+, )*0(, \d+)*\]"),
])
def test_degenerate_shapes_are_met_in_a_small_budget(name, text, shape):
    v = _verify(name, text, n=2)
    assert v.status == "counterexample", v
    (_, value), *_ = [b for b in v.counterexample.bindings if b[0] == "x"]
    assert re.match(r"float\w*" + shape, value), v


@pytest.mark.slow
def test_a_non_contiguous_integer_tensor_is_met_in_a_small_budget():
    v = _verify("view_int", "reshape(x, s) where dtype(x) == torch.int64 => view(x, s)", n=3)
    assert v.status == "counterexample" and "view" in v.counterexample.message, v


def test_instances_draw_no_degenerate_shapes_unless_asked():
    # rewrite.testing's strategies keep their shapes; verification asks for the others
    hyp, st = pytest.importorskip("hypothesis"), strategies()
    plan = plan_for(rewrite.parse("rule n: neg(x) => x").rules["n"])
    shapes: dict = {None: [], "mixed": []}

    # (a tenth each, as hypothesis draws them: several seeds, so that no one seed's
    # luck decides it)
    for seed in range(3):
        @hyp.seed(seed)
        @hyp.settings(max_examples=200, deadline=None, database=None,
                      suppress_health_check=list(hyp.HealthCheck))
        @hyp.given(st.data())
        def draw(data):
            for mode, seen in shapes.items():
                inst = data.draw(st.composite(lambda d: draw_instance(d, plan, shapes=mode))())
                if not isinstance(inst, str):
                    seen.append(tuple(inst.example_inputs[0].shape))

        draw()
    assert shapes[None] and all(s and 0 not in s for s in shapes[None])
    assert any(s == () for s in shapes["mixed"]) and any(0 in s for s in shapes["mixed"])


# ---------------------------------------------------------------- in place: rejected before verification


@pytest.mark.parametrize("text", ["add(x, y) => aten.add_.Tensor(x, y)", "relu(x) => aten.relu_.default(x)"])
def test_a_replacement_writing_its_input_in_place_is_rejected_when_loaded(text):
    with pytest.raises(RuleError, match="in place"):
        rewrite.parse(f"rule w: {text}", "case.rw")


@pytest.mark.slow
def test_an_in_place_pattern_is_not_trusted():
    assert _verify("in_place", "aten.add_.Tensor(x, y) => add(x, y)").failed


# ---------------------------------------------------------------- a division that traps the CPU


def test_a_division_that_would_trap_is_an_error_not_a_crash():
    x = torch.tensor([torch.iinfo(torch.int32).min, 4], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="traps"):
        trapping_division((x, torch.tensor([-1, 2], dtype=torch.int32)), {"rounding_mode": "trunc"})
    with pytest.raises(RuntimeError, match="traps"):
        trapping_division((x, -1), {"rounding_mode": "trunc"})
    trapping_division((x, -1), {"rounding_mode": "floor"})  # floor wraps: it runs
    trapping_division((x.to(torch.int8), -1), {"rounding_mode": "trunc"})

