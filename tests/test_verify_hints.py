"""Where-clause hints of rule verification: a variable the where clause wants a
number (``positive_number(s)``) is drawn as one, a mask the clause wants to fit the
scores (``additive_mask(m, sc)``) is drawn of their shape or a suffix of it, and
``matmul`` keeps its operands' batch dims, so a rule whose where clause is a
conjunction of such facts meets instances where all of them hold (a rule that
never meets one is reported skipped, and CI fails on a skipped shipped rule); a
reshape whose result the clause wants of rank N (``rank(f) == 2``) is drawn so."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rewrite
from rewrite.testing import rule_instances
from rewrite.trust.instances import plan_for
from rewrite.trust.verify import verify_rule

SCALED_RELU = """
rule scaled_relu:
    relu(mul(x, s)) where is_float(x) and positive_number(s) => mul(relu(x), s)
"""

MASKED = """
rule masked_softmax(tolerance="approx"):
    softmax(add(mul(matmul(q, transpose(k, -2, -1)), s) as sc, m), -1, dt)
    where is_float(q) and positive_number(s) and additive_mask(m, sc) and rank(q) >= 3
    => softmax(add(matmul(mul(q, s), transpose(k, -2, -1)), m), -1, dt)
"""


def _rules(tmp_path, text, name="hints.rw"):
    path = tmp_path / name
    path.write_text(text)
    return rewrite.load(str(path))


def test_plan_reads_number_and_fitting_hints(tmp_path):
    rules = _rules(tmp_path, MASKED)
    plan = plan_for(rules.rules["masked_softmax"])
    assert plan.numbers == {"s"} and plan.positives == {"s"}
    assert plan.fitting == {"m"}


def test_plan_reads_a_per_feature_weight():
    rules = rewrite.load("rules/transformer.rw")
    assert plan_for(rules.rules["rms_norm_upcast_bf16"]).features == {"w"}


@pytest.mark.parametrize("rule", ["rms_norm_upcast_bf16", "rms_norm_upcast_fp16"])
def test_a_per_feature_weight_is_drawn_as_one(rule):
    """``mul(w, normalized) where norm_weight(w, x)``: w of x's last dim, not a
    broadcasting operand of any shape (1 draw in 30 met the clause before)."""
    v = verify_rule(rewrite.load("rules/transformer.rw"), rule, max_examples=6, seed=0)
    assert v.status == "ok" and v.checked >= 6 and v.generated <= 10 * v.checked, (v.checked, v.generated)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_positive_number_operand_is_drawn_as_one(tmp_path, seed):
    rules = _rules(tmp_path, SCALED_RELU)
    v = verify_rule(rules, "scaled_relu", max_examples=10, seed=seed)
    assert v.status == "ok", str(v)
    # before the hint a number was one draw in five of the operand, a positive one
    # three in twenty: most instances were discarded
    assert v.checked >= 10 and v.generated <= 2 * v.checked, (v.checked, v.generated)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_conjunction_of_attention_facts_meets_instances(tmp_path, seed):
    rules = _rules(tmp_path, MASKED)
    v = verify_rule(rules, "masked_softmax", max_examples=6, seed=seed)
    assert v.status == "ok", str(v)
    assert v.checked >= 6


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_the_shipped_bias_and_mask_attention_rule_verifies_on_few_examples(seed):
    """Four conjuncts over shapes and a number: with four examples it was skipped
    (the where clause held on none of 300 instances) on some seeds."""
    rules = rewrite.load("rules/transformer.rw")
    v = verify_rule(rules, "attention_scale_bias_mask", max_examples=4, seed=seed)
    assert v.status == "ok", str(v)


FLATTENED = """
rule flat_relu:
    relu((flatten | reshape | view)(x, ...) as f) where is_float(x) and rank(f) == 2 => relu(f)
"""


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_reshape_draws_the_rank_the_where_clause_asks_of_its_result(data, tmp_path_factory):
    rules = _rules(tmp_path_factory.mktemp("hints"), FLATTENED)
    instance = data.draw(rule_instances(rules, "flat_relu", firing=False))
    f = instance.bindings["f"]
    assert f.dim() == 2, (tuple(instance.bindings["x"].shape), tuple(f.shape))


ROUND_TRIP = """
rule reshape_back:
    reshape(relu(reshape(x, _)), _) as r where same_shape(r, x) => relu(x)
"""


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_reshape_draws_the_shape_same_shape_pairs_it_with(data, tmp_path_factory):
    rules = _rules(tmp_path_factory.mktemp("hints"), ROUND_TRIP)
    instance = data.draw(rule_instances(rules, "reshape_back", firing=False))
    x, r = instance.bindings["x"], instance.bindings["r"]
    assert r.shape == x.shape
