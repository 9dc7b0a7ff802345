"""Rule verification: every shipped rule passes on random instances of its pattern; wrong
rules are rejected with a shrunk, Alive-style counterexample (integer, bool and
half-precision instances included, new inf/nan rejected whatever the tolerance); a rule
the verifier cannot instantiate is skipped with a reason, and a skipped rule fails
`rewrite check --verify` unless --allow-skipped."""

from __future__ import annotations

import functools
import glob
import re

import pytest
import torch

import rewrite
from rewrite.cli import main
from rewrite.functions.registry import register_constant
from rewrite.trust.instances import OUTSIDE_VOCABULARY, plan_for
from rewrite.trust.verify import (EXACT_WIDE_DRAWS, RuleVerdict, VerificationReport, rule_tolerance, verify_rule,
                                  verify_rules)

SHIPPED = sorted(glob.glob("rules/*.rw")) + sorted(glob.glob("rules/quant/*.rw"))

#: Shipped rules declared intentional changes (change=True: int8 weights change the
#: function by design, the QDQ form's pooling requantizes as the int8 kernels do;
#: rewrite.quant measures them by SQNR): listed, not verified.
INTENTIONAL = {"conv_weight", "linear_weight", "conv_weight_pt2e", "linear_weight_pt2e",
               "requantize_avg_pool2d", "requantize_adaptive_avg_pool2d"}


@functools.lru_cache(maxsize=None)
def _report(path: str, n: int) -> VerificationReport:
    return verify_rules(rewrite.load(path), max_examples=n)


@pytest.mark.parametrize("path", ["rules/fusion.rw", "rules/cleanup.rw"])
def test_every_shipped_rule_is_verified(path):
    report = _report(path, 30)
    for v in report.verdicts:
        assert v.status == "ok", v
        assert v.checked >= 3, v  # the rule fired and was compared on several instances


def test_silu_from_sigmoid_is_for_floats_only():
    # x * sigmoid(x) is float for an integer x where silu(x) raises: the rule asks is_float(x)
    v = _report("rules/fusion.rw", 30)["silu_from_sigmoid"]
    assert v.status == "ok" and v.checked >= 3
    bad = rewrite.parse("rule s(tolerance=\"approx\"): mul(x, sigmoid(x)) => silu(x)", "bad.rw")
    assert verify_rule(bad, "s", max_examples=30).status == "counterexample"


def test_intentional_changes_are_listed_not_verified():
    report = verify_rules(rewrite.load("rules/quant/convert.rw"), max_examples=5)
    assert {v.rule for v in report.verdicts if v.status == "intentional"} == INTENTIONAL
    assert report.ok and f"{len(INTENTIONAL)} intentional" in report.table()


def test_tolerances_of_shipped_rules():
    fusion = rewrite.load("rules/fusion.rw")
    assert rule_tolerance(fusion.rules["conv_bn"]) == "approx"  # computes rewrite-time constants
    assert rule_tolerance(fusion.rules["silu_from_sigmoid"]) == "approx"  # says so
    assert rule_tolerance(fusion.rules["identity"]) == "exact"


def _verify(text: str, name: str, n: int = 40) -> RuleVerdict:
    return verify_rule(rewrite.parse(text, "bad.rw"), name, max_examples=n)


def test_a_wrong_rule_gets_a_shrunk_counterexample():
    v = _verify("rule bad: relu(x) => neg(x)", "bad")
    assert v.status == "counterexample" and v.failed
    cex = v.counterexample
    assert cex.kind == "mismatch" and cex.location == "bad.rw:1:1"
    (name, value), = cex.bindings
    assert name == "x" and "[1]" in value  # shrunk to a single element
    assert "relu" in cex.source and "neg" in cex.target
    assert "neg" in cex.diverging and "relu" in cex.diverging
    assert cex.expected != cex.got
    text = str(v)
    assert text.startswith("bad.rw:1:1: rule bad: mismatch:")
    for part in ("instance (", "original:", "rewritten:", "first diverging node:", "expected:", "got:"):
        assert part in text


def test_swapping_nonlinearities_is_caught():
    v = _verify("rule swap: sigmoid(relu(x)) => relu(sigmoid(x))", "swap")
    assert v.status == "counterexample"
    assert "sigmoid" in v.counterexample.target


def test_an_approximate_rule_outside_tolerance_is_caught():
    v = _verify('rule gs(tolerance="approx"): gelu(x) => silu(x)', "gs")
    assert v.status == "counterexample" and "outside tolerance" in v.counterexample.message


def test_float64_catches_what_float32_tolerances_hide():
    # x * 1.000001 == x within float32's tolerance, not within float64's
    v = _verify('rule near(tolerance="approx"): mul(x, 1.000001) where is_float(x) => x', "near")
    assert v.status == "counterexample" and "float64" in v.counterexample.message


def test_a_shape_changing_rule_is_caught():
    v = _verify("rule tr: transpose(x, _, _) => x", "tr")
    assert v.status == "counterexample"
    assert "expected" in v.counterexample.message and "got" in v.counterexample.message


def test_exact_rules_must_be_exact():
    v = _verify("rule half: div(x, 2) => mul(x, 0.5)", "half")  # equal for floats: exact
    assert v.status == "ok", v
    v = _verify("rule sq: mul(x, x) => pow(x, 2)", "sq")  # pow rounds differently in low precision
    assert v.status in ("ok", "counterexample")


def test_instances_violating_the_where_clause_are_discarded_not_failed():
    v = _verify("rule same: to(x, d) where dtype(x) == d => x", "same")
    assert v.status == "ok" and 0 < v.checked < v.generated


def test_rules_without_a_generator_are_skipped_with_a_reason():
    v = _verify("rule narrow: aten.narrow.default(x, _, _, _) => x", "narrow")
    assert v.status == "skipped" and not v.failed
    assert "no instance generator for op 'aten.narrow.default'" in v.reason
    report = VerificationReport((v,))
    assert not report.ok and report.ok_or_skipped  # a skipped rule is an unverified rule
    assert report.skipped == (v,) and report.failures == ()


def test_a_rule_whose_where_clause_never_holds_is_skipped():
    v = _verify("rule never: relu(x) where rank(x) == 9 => x", "never", n=15)
    assert v.status == "skipped" and "where clause held on none" in v.reason


@register_constant("_verify_test_broken")
def _broken(t):
    """A rewrite-time function that always fails (for the 'did not fire' verdict)."""
    raise RuntimeError("broken on purpose")


def test_a_rule_that_cannot_build_its_replacement_did_not_fire():
    v = _verify("rule b: neg(w) where const(w) => neg(_verify_test_broken(w))", "b", n=20)
    assert v.status == "did not fire" and v.failed
    assert "replacement failed" in v.counterexample.message


def test_generic_ops_outside_the_vocabulary_are_instantiated():
    assert "aten.hardsigmoid" not in OUTSIDE_VOCABULARY  # the generic generator builds its instances
    v = _verify('rule hs(tolerance="approx"): aten.hardsigmoid(x) => div(relu6(add(x, 3)), 6)', "hs")
    assert v.status == "ok", v  # hardsigmoid(x) == relu6(x + 3) / 6
    v = _verify('rule hs(tolerance="approx"): aten.hardsigmoid(x) => relu6(add(x, 3))', "hs")
    assert v.status == "counterexample"


def test_a_rule_that_rebuilds_its_own_pattern_does_not_terminate():
    # a where clause keeps `rewrite check` (E409) from rejecting the rule before verify sees it;
    # the replacement matches the pattern again, around a new node each time (a replacement
    # that is the very call it matched is no rewrite: tests/test_probe_regressions_s45.py)
    v = _verify("rule loop: aten.neg.default(x) where is_float(x) "
                "=> aten.neg.default(aten.neg.default(aten.neg.default(x)))", "loop", n=10)
    assert v.status == "counterexample" and v.counterexample.kind == "non-termination"


def test_where_clause_hints_make_constants_and_pick_dtypes():
    rules = rewrite.load("rules/fusion.rw")
    plan = plan_for(rules.rules["conv_bn"])
    assert plan.consts == {"w", "b", "mean", "var", "gamma", "beta"}
    assert plan.tolerance == "approx" and plan.dtypes[:2] == (torch.float32, torch.float64)
    amp = plan_for(rewrite.parse("rule r: relu(x) where dtype(x) == torch.bfloat16 => x").rules["r"])
    assert amp.dtypes[0] == torch.bfloat16


def test_verification_is_reproducible():
    rules = rewrite.load("rules/cleanup.rw")
    a = verify_rule(rules, "permute_permute", max_examples=20, seed=3)
    b = verify_rule(rules, "permute_permute", max_examples=20, seed=3)
    assert (a.checked, a.generated) == (b.checked, b.generated)


def test_report_table_and_summary():
    report = verify_rules(rewrite.parse("rule bad: relu(x) => neg(x)\nrule fine: neg(neg(x)) => x", "t.rw"),
                          max_examples=20)
    assert not report.ok and [v.rule for v in report.failures] == ["bad"]
    table = report.table()
    assert table.splitlines()[0].split() == ["rule", "verdict", "tolerance", "checked", "where"]
    assert "bad   counterexample" in table and "t.rw:2:1" in table
    assert table.splitlines()[-1] == "1 ok, 1 counterexample"
    assert report["fine"].status == "ok"


# ---------------------------------------------------------------- the command


def test_check_verify_exits_1_with_the_counterexample(tmp_path, capsys):
    bad = tmp_path / "bad.rw"
    bad.write_text("# wrong on purpose\nrule bad: relu(x) => neg(x)\nrule ok: neg(neg(x)) => x\n")
    assert main(["check", "--verify", "--max-examples", "20", str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"{bad}: ok (2 rules)" in out
    assert "counterexample" in out and f"{bad}:2:1: rule bad: mismatch" in out
    assert "1 ok, 1 counterexample" in out


def test_check_verify_passes_on_good_rules(tmp_path, capsys):
    good = tmp_path / "good.rw"
    good.write_text("rule neg_neg: neg(neg(x)) => x\n")
    assert main(["check", "--verify", "--max-examples", "10", str(good)]) == 0
    assert "neg_neg  ok" in capsys.readouterr().out


def test_check_verify_verifies_each_instantiation_of_a_parametrized_file(tmp_path, capsys):
    # amp_bf16.rw and amp_fp16.rw import amp/policy.rw with two dtypes: the same
    # place in the same file, two rules (the float16 one was never verified)
    (tmp_path / "policy.rw").write_text(
        "param lowp\n"
        "rule exp_lowp(tolerance=\"approx\"):\n"
        "    exp(to(y, torch.float32)) where dtype(y) == lowp => to(exp(y), torch.float32)\n")
    (tmp_path / "a.rw").write_text('import "policy.rw" with lowp = torch.bfloat16 as bf16\n')
    (tmp_path / "b.rw").write_text('import "policy.rw" with lowp = torch.float16 as fp16\n')
    assert main(["check", "--verify", "--max-examples", "5", str(tmp_path / "a.rw"), str(tmp_path / "b.rw")]) == 1
    out = capsys.readouterr().out
    assert re.search(r"exp_bf16 +ok", out) and re.search(r"exp_fp16 +counterexample", out)
    # float16's exp overflows past 11 where float32's does not: caught at large magnitudes
    assert "rule exp_fp16: mismatch" in out and "operands of large magnitude" in out


def test_a_dtype_dependent_default_is_no_counterexample_in_float64():
    # rms_norm's eps=None is float32's epsilon for a float32 (and a bfloat16) input and
    # float64's for a float64 one: the float64 recheck of rms_norm_bf16 runs the
    # original's float32 cast widened too, so a tiny input is no counterexample
    rules = rewrite.load("rules/amp_bf16.rw")
    for seed in (102, 103):  # the seeds that drew one (|y| ~ 0.004)
        assert verify_rule(rules, "rms_norm_bf16", max_examples=40, seed=seed).status == "ok"


def test_constant_root_folds_are_verified():
    rules = rewrite.parse("""
    rule fold_cast: to(w, d) where is_tensor(w) and const(w) => cast(w, d)
    rule bad_fold: to(w, _) where is_tensor(w) and const(w) => cast(w, torch.float16)
    """)
    report = rules.verify(max_examples=30)
    assert not report.ok
    assert "bad_fold" in report.table() and "fold_cast" in report.table()
    assert [f.rule for f in report.failures] == ["bad_fold"]


def test_check_verify_fails_on_skipped_rules_unless_allowed(tmp_path, capsys):
    f = tmp_path / "narrow.rw"
    # every vocabulary op has a generator; an aten op outside it with required
    # attributes the generic generator cannot draw stays unverified
    f.write_text("rule narrow: aten.narrow.default(x, _, _, _) => x\n")
    assert main(["check", "--verify", "--max-examples", "5", str(f)]) == 1
    out = capsys.readouterr().out
    assert "1 skipped" in out and "unverified" in out
    assert main(["check", "--verify", "--allow-skipped", "--max-examples", "5", str(f)]) == 0


# ---------------------------------------------------------------- dtypes


def test_true_division_of_integers_is_caught():
    # div(x, 1) is float for an integer x: an int64 x is not its value
    v = _verify("rule d: div(x, 1) => x", "d")
    assert v.status == "counterexample", v
    assert v.counterexample.dtype in ("int64", "int32", "int8", "uint8", "bool")
    assert "float32" in v.counterexample.message and "expected" in v.counterexample.message


def test_bool_arithmetic_is_caught():
    # mul(x, 2) of a bool tensor is int64 (0 or 2); add(x, x) is a logical or (bool).
    # verify's default budget (100): in 40, hypothesis' generation, which adapts to what
    # ran before in the process, may draw no bool at all
    v = _verify("rule m: mul(x, 2) => add(x, x)", "m", n=100)
    assert v.status == "counterexample", v
    assert v.counterexample.dtype == "bool"
    assert "bool" in v.counterexample.message and "int64" in v.counterexample.message


def test_integer_overflow_is_met():
    # int8 wraps: (x + x) / 2 is not x when x + x does not fit
    v = _verify('rule h: div(add(x, x), 2, rounding_mode="floor") => x', "h", n=60)
    assert v.status == "counterexample", v


def test_correct_rules_still_verify_in_every_dtype():
    assert _verify("rule m1: mul(x, 1) where is_float(x) => x", "m1").status == "ok"
    v = _verify("rule n: neg(neg(x)) => x", "n")  # wraps back for int8's -128 too
    assert v.status == "ok", v
    assert _verify("rule a: add(x, 0) where is_float(x) => x", "a").status == "ok"


def test_dtype_hints_shape_the_pool():
    def dtypes(text):
        return plan_for(rewrite.parse(text).rules["r"]).dtypes

    exact = dtypes("rule r: neg(neg(x)) => x")
    assert set(exact) == {torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32,
                          torch.int16, torch.int8, torch.uint8, torch.bool}
    assert not any(d.is_floating_point is False for d in dtypes("rule r: neg(x) where is_float(x) => x")
                   if d != torch.bool) and torch.bool not in dtypes("rule r: neg(x) where is_float(x) => x")
    assert dtypes("rule r: neg(x) where dtype(x) == torch.int8 => x")[0] == torch.int8
    approx = dtypes('rule r(tolerance="approx"): neg(x) => x')
    assert torch.int64 in approx and torch.float16 not in approx  # half precision where asked for only
    assert torch.float16 in dtypes('rule r(tolerance="approx"): neg(x) where dtype(x) == torch.float16 => x')


def test_a_dtype_an_op_rejects_discards_the_instance():
    # softmax has no integer or bool kernel: those draws are discarded, never failures
    # (and the exact rule's large-magnitude instances, in float32, come on top)
    v = _verify("rule s: relu(softmax(x, d)) => softmax(x, d)", "s", n=15)
    assert v.status == "ok" and v.checked == 15 + len(EXACT_WIDE_DRAWS), v


# ---------------------------------------------------------------- overflow, lower precision


def test_a_new_infinity_is_wrong_whatever_the_tolerance():
    # what rules/amp_fp16.rw's div_fp16 did (1 / 1e-5 is finite in float32, inf in
    # float16), in a form every instance meets: a * 1e5 overflows float16 for |a| > 0.66
    # (the division needs a divisor near 0, which a search may or may not draw)
    v = _verify("""rule mul16(tolerance="approx"):
        mul(to(a, torch.float32), 100000.0) where dtype(a) == torch.float16
        => to(mul(a, 100000.0), torch.float32)""", "mul16", n=50)
    assert v.status == "counterexample", v
    assert "inf or nan in the rewritten graph (wrong whatever the tolerance)" in v.counterexample.message


def test_approximate_rules_meet_large_magnitudes():
    # an approximate rule's instances stay within [-4, 4] but for a few drawn at large
    # magnitudes (WIDE_DRAWS), where only a new inf or NaN is a failure: exp overflows
    # float16 past 11, a float16 round trip past 65504, exp(x) / sum(exp(x)) float32
    # past 88 (softmax subtracts the maximum first)
    for name, text in (
            ("exp16", "exp(x) where dtype(x) == torch.float32 => to(exp(to(x, torch.float16)), torch.float32)"),
            ("relu16", "relu(x) where dtype(x) == torch.float32 => to(relu(to(x, torch.float16)), torch.float32)"),
            # (contiguous: softmax's kernel returns a strided input's result contiguous,
            # elementwise ops keep the layout, which a view after it would see)
            ("softmax_naive", "softmax(x, -1) where dtype(x) == torch.float32 "
                              "=> contiguous(div(exp(x), sum(exp(x), -1, True)))"),
            # float16's x * x overflows past 256, where the norm's kernel accumulates in
            # float32: half precision is drawn at large magnitudes though not otherwise
            ("l2_naive", "linalg_vector_norm(x, 2, d, k) where is_float(x) => sqrt(sum(mul(x, x), d, k))")):
        v = _verify(f'rule {name}(tolerance="approx"): {text}', name, n=10)
        assert v.status == "counterexample", (name, v)
        assert "operands of large magnitude" in v.counterexample.message
        # declared to rely on the values staying in range (autocast's contract), it verifies
        assert _verify(f'rule {name}(tolerance="approx", assumes_range=True): {text}', name,
                       n=10).status == "ok"
    # large values amplify rounding past the tolerance; only overflow is judged there
    # (a bfloat16 layer norm with a weight of 3e4 is 0.23 off where it is 0 in float32)
    assert _verify("""rule ln16(tolerance="approx"):
        layer_norm(to(y, torch.float32), s, w, b, eps)
        where dtype(y) == torch.bfloat16 and is_tensor(w) and is_tensor(b)
        => to(layer_norm(y, s, to(w, torch.bfloat16), to(b, torch.bfloat16), eps), torch.float32)""",
                   "ln16", n=20).status == "ok"


@pytest.mark.parametrize("name, text", [
    # right for every dim up to 8, which is all ordinary instances draw (T05): a
    # leading instance has every dim just past a power of two
    ("prefix16", "slice(x, 1, 0, 16) => x"),
    ("prefix32", "slice(x, 0, 0, 32) => x"),
    ("prefix64", "slice(x, -1, 0, 64) => x"),
])
def test_a_literal_size_meets_larger_dims(name, text):
    v = _verify(f"rule {name}: {text}", name, n=10)
    assert v.status == "counterexample", v


def test_integer_operands_meet_float_numbers():
    # floor(idx * c) is idx * c for an integer c, not for idx * 0.5 (probe Z1 F4)
    v = _verify("rule floor_int_mul: torch.floor(mul(x, c)) where not is_float(x) and is_number(c) => mul(x, c)",
                "floor_int_mul", n=30)
    assert v.status == "counterexample", v


@pytest.mark.parametrize("name, text", [
    # wrong where an operand broadcasts through size-1 dims (probe Z1 F2): a keepdim
    # reduction's (x + x.mean(-1, keepdim=True)), an outer product's ((1, 4) * (4, 1))
    ("sum_add", "sum(add(x, y), -1) where is_float(x) and rank(x) == rank(y) => add(sum(x, -1), sum(y, -1))"),
    ("mul_reshape", "mul(x, y) where is_float(x) and numel(x) == numel(y) and numel(x) > 0 "
                    "and not same_shape(x, y) => mul(x, reshape_as(y, x))"),
])
def test_operands_broadcast_through_size_one_dims(name, text):
    v = _verify(f'rule {name}(tolerance="approx"): {text}', name, n=30)
    assert v.status == "counterexample", v


@pytest.mark.parametrize("name, text", [
    # wrong only past 4, where ordinary instances never reach (probe Z1 F1)
    ("relu_as_relu6", "relu(x) where is_float(x) => hardtanh(x, 0.0, 6.0)"),
    ("softplus_capped", "F.softplus(x) => log(add(exp(clamp(x, None, 4.0)), 1))"),
])
def test_approximate_rules_are_compared_at_large_magnitudes(name, text):
    v = _verify(f'rule {name}(tolerance="approx"): {text}', name, n=10)
    assert v.status == "counterexample", v
    assert "operands of large magnitude, where the rewrite computes another value" in v.counterexample.message, v


@pytest.mark.parametrize("name, text, status", [
    # a variance as E[x^2] - E[x]^2 cancels on values about 1000 (a sensor's readings):
    # within tolerance about zero, in float64, and at large magnitudes, wrong there
    ("var_naive", "torch.var(x, correction=0) where dtype(x) == torch.float32 "
                  "=> sub(mean(mul(x, x)), mul(mean(x), mean(x)))", "counterexample"),
    ("std_naive", "torch.std(x, correction=0) where dtype(x) == torch.float32 "
                  "=> sqrt(sub(mean(mul(x, x)), mul(mean(x), mean(x))))", "counterexample"),
    # the two-pass formula is as accurate as the kernel: verified
    ("var_two_pass", "torch.var(x, correction=0) => mean(mul(sub(x, mean(x)), sub(x, mean(x))))", "ok"),
    # a written-out variance made the kernel: more accurate than the original, verified
    ("var_kernel", "sub(mean(mul(x, x)), mul(mean(x), mean(x))) where dtype(x) == torch.float32 "
                   "=> torch.var(x, correction=0)", "ok"),
])
def test_approximate_rules_meet_values_about_a_large_offset(name, text, status):
    v = _verify(f'rule {name}(tolerance="approx"): {text}', name, n=10)
    assert v.status == status, v
    if status == "counterexample":
        assert "inputs drawn about a large value" in v.counterexample.message, v


def test_lowering_precision_is_judged_on_rounded_inputs():
    # a matmul run in float16 loses what float16 cannot hold of its operands: approx
    # (within autocast's contract, that its operands and result fit float16)
    good = """rule mm16(tolerance="approx", assumes_range=True):
        mm(a, b) where dtype(a) == torch.float32 and dtype(b) == torch.float32
        => to(mm(to(a, torch.float16), to(b, torch.float16)), torch.float32)"""
    assert _verify(good, "mm16", n=60).status == "ok"
    # ... but not a wrong formula
    bad = """rule lin16(tolerance="approx"):
        linear(x, w, b) where dtype(x) == torch.float32 and is_tensor(b)
        => to(linear(to(x, torch.float16), to(w, torch.float16)), torch.float32)"""
    assert _verify(bad, "lin16").status == "counterexample"


@pytest.mark.parametrize("name, text", [
    ("relu_bf_wrong", "relu(x) where dtype(x) == torch.float32 "
                      "=> to(mul(relu(to(x, torch.bfloat16)), 1.012), torch.float32)"),
    ("gelu_lowp", "gelu(x) where dtype(x) == torch.float32 "
                  '=> to(gelu(to(x, torch.float16), approximate="tanh"), torch.float32)'),
])
def test_a_wrong_formula_behind_its_own_low_precision_cast_is_caught(name, text):
    """The float64 recheck widens the replacement's casts: their rounding cannot hide a formula change."""
    v = _verify(f'rule {name}(tolerance="approx"): {text}', name, n=30)
    assert v.status == "counterexample", v
    assert "float64" in v.counterexample.message, v.counterexample


def test_a_right_formula_behind_its_own_low_precision_cast_still_verifies():
    v = _verify('rule relu_bf(tolerance="approx"): relu(x) where dtype(x) == torch.float32 '
                "=> to(relu(to(x, torch.bfloat16)), torch.float32)", "relu_bf", n=30)
    assert v.status == "ok" and v.checked >= 3, v


@pytest.mark.parametrize("name, text, status", [
    ("mp_dil", "relu(max_pool2d(x, k, s, p, _, c)) => max_pool2d(relu(x), k, s, p, 1, c)", "counterexample"),
    ("sm_dtype", "softmax(neg(neg(x)), d, _) => softmax(x, d)", "counterexample"),
    ("ct_outpad", "neg(neg(conv_transpose(x, w, b, s, p, _, g, d))) => conv_transpose(x, w, b, s, p, 0, g, d)",
     "counterexample"),
    ("ap_div", "neg(avg_pool2d(x, k, s, p, c, i, _)) where is_float(x) => avg_pool2d(neg(x), k, s, p, c, i)",
     "counterexample"),
    # the engine does not rewrite a functional batch_norm that writes its running stats
    ("bn_train", "neg(neg(batch_norm(x, m, v, w, b, _, mo, eps))) => batch_norm(x, m, v, w, b, False, mo, eps)",
     "did not fire"),
])
def test_a_rule_that_drops_an_attribute_is_rejected(name, text, status):
    """Verification draws every attribute away from its default, not only the common ones."""
    v = _verify(f"rule {name}: {text}", name, n=30)
    assert v.status == status, v


def test_shipped_amp_rules_that_overflowed_are_gone():
    fp16 = rewrite.load("rules/amp_fp16.rw")
    for name in ("div_fp16", "add_fp16", "mul_fp16", "sub_fp16", "batch_norm_fp16"):
        assert name not in fp16.rules
    for name in ("clamp_fp16", "hardtanh_fp16", "pad_fp16", "mul_scalar_fp16", "div_scalar_fp16", "addmm_fp16"):
        v = verify_rule(fp16, name, max_examples=25)
        assert v.status == "ok", v


# ---------------------------------------------------------------- quantized patterns


def test_quantized_patterns_are_instantiated_with_observers():
    lower = rewrite.load("rules/quant/lower.rw")
    for name in ("int8_relu", "int8_max_pool2d", "lower_add", "lower_conv_relu", "requantize_same", "unused_qdq"):
        v = verify_rule(lower, name, max_examples=8)
        assert v.status == "ok" and v.checked == 8, v


def test_a_wrong_quantized_rule_is_caught():
    # dropping a requantization to other parameters changes the int8 values
    v = _verify("rule rq: quantize_per_tensor(dequantize(x), _, _, _) => x", "rq", n=30)
    assert v.status == "counterexample", v
    assert "quantization parameters" in v.counterexample.message or "quantized" in v.counterexample.message
    # a clamp moved onto int8 values clamps at the nearest step: within one step, not exact
    exact = "rule ht: hardtanh(dequantize(x), lo, hi) => dequantize(hardtanh(x, lo, hi))"
    v = _verify(exact, "ht", n=30)
    assert v.status == "counterexample" and "(exact rule)" in v.counterexample.message
    v = _verify(exact.replace("rule ht:", 'rule ht(tolerance="approx"):'), "ht", n=30)
    assert v.status == "ok", v  # what rules/quant/lower.rw's int8_hardtanh says


def test_onednn_only_replacements_are_discarded_on_other_engines():
    lower = rewrite.load("rules/quant/lower.rw")
    v = verify_rule(lower, "lower_conv_add", max_examples=4)
    assert v.status == "ok", v
    assert v.generated > v.checked  # x86 instances (and convs that are not 2-d) discarded


# ---------------------------------------------------------------- every shipped rule


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_shipped_file_verifies_on_random_seeds(seed):
    """What .ci/run checks on seed 0, on other seeds: 0 counterexamples, 0 skipped
    (intentional changes are listed, not verified; a few minutes per seed)."""
    seen, bad = set(), []
    for path in SHIPPED:
        rules = rewrite.load(path)
        for rule in rules:
            if rule.location in seen:
                continue
            seen.add(rule.location)
            v = verify_rule(rules, rule, max_examples=4, seed=seed)
            if v.status not in ("ok", "intentional"):
                bad.append(str(v))
    assert not bad, "\n\n".join(bad)
