"""Rule verification: every shipped rule passes on random instances of its pattern; wrong
rules are rejected with a shrunk, Alive-style counterexample; rules the verifier cannot
instantiate are skipped with a reason, never failed."""

from __future__ import annotations

import functools

import pytest
import torch

import rewrite
from rewrite.cli import main
from rewrite.functions.registry import register_constant
from rewrite.instances import GENERATORS, plan_for
from rewrite.verify import RuleVerdict, VerificationReport, rule_tolerance, verify_rule, verify_rules


@functools.lru_cache(maxsize=None)
def _report(path: str, n: int) -> VerificationReport:
    return verify_rules(rewrite.load(path), max_examples=n)


@pytest.mark.parametrize("path", ["rules/fusion.rw", "rules/cleanup.rw"])
def test_every_shipped_rule_is_verified(path):
    report = _report(path, 30)
    assert report.ok, str(report)
    for v in report.verdicts:
        assert v.status == "ok", v
        assert v.checked >= 3, v  # the rule fired and was compared on several instances


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
    v = _verify('rule near(tolerance="approx"): mul(x, 1.000001) => x', "near")
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
    v = _verify("rule emb: embedding(x, _, padding_idx=0) => x", "emb")
    assert v.status == "skipped" and not v.failed
    assert "no instance generator for op 'embedding'" in v.reason


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
    assert "aten.hardsigmoid" not in GENERATORS  # the generic generator builds its instances
    v = _verify('rule hs(tolerance="approx"): aten.hardsigmoid(x) => div(relu6(add(x, 3)), 6)', "hs")
    assert v.status == "ok", v  # hardsigmoid(x) == relu6(x + 3) / 6
    v = _verify('rule hs(tolerance="approx"): aten.hardsigmoid(x) => relu6(add(x, 3))', "hs")
    assert v.status == "counterexample"


def test_a_rule_that_rebuilds_its_own_pattern_does_not_terminate():
    v = _verify("rule loop: aten.hardsigmoid.default(x) => aten.hardsigmoid.default(x)", "loop", n=10)
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


def test_constant_root_folds_are_verified():
    rules = rewrite.parse("""
    rule fold_cast: to(w, d) where is_tensor(w) and const(w) => cast(w, d)
    rule bad_fold: to(w, _) where is_tensor(w) and const(w) => cast(w, torch.float16)
    """)
    report = rules.verify(max_examples=30)
    assert not report.ok
    assert "bad_fold" in report.table() and "fold_cast" in report.table()
    assert [f.rule for f in report.failures] == ["bad_fold"]
