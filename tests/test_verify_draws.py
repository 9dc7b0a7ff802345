"""Integer draws of rule verification: besides small values and the dtype's extremes,
exact rules meet values spread over the dtype's whole range, so a rule that only
holds while products do not wrap (``abs(x * x) => x * x``: int8 12 * 12 is -112) gets
a counterexample; small values stay the common case, draws stay deterministic per
seed, and the shipped rule files still verify."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings

import rewrite
from rewrite.cli import main
from rewrite.testing import rule_instances
from rewrite.trust.instances import spread_integers
from rewrite.trust.verify import verify_rule

ABS_SQUARE = "rule abs_square: abs(mul(x, x)) => mul(x, x)"
INTS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


@pytest.mark.parametrize("dtype", INTS)
def test_spread_values_fit_the_dtype_and_make_products_wrap(dtype):
    info = torch.iinfo(dtype)
    values = spread_integers(dtype)
    assert values == spread_integers(dtype)  # a fixed list: draws depend on the seed only
    assert all(info.min < v < info.max for v in values)
    assert all(abs(v) > 4 for v in values)  # the small values are drawn apart
    t = torch.tensor(values, dtype=dtype)
    exact = torch.tensor(values, dtype=torch.float64) ** 2
    assert (t * t).double().ne(exact).any()  # some squares wrap
    assert (t + t).double().ne(2 * torch.tensor(values, dtype=torch.float64)).any()  # some sums wrap


def test_spread_values_of_small_dtypes_reach_mid_range():
    assert {12, -12, 13, 15, 100}.issubset(spread_integers(torch.int8))
    assert 181 < max(v for v in spread_integers(torch.int16) if v * v > 2 ** 15)
    assert 46341 in spread_integers(torch.int32)
    assert 3037000500 in spread_integers(torch.int64)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_square_that_wraps_gets_a_counterexample(seed):
    rules = rewrite.parse(ABS_SQUARE)
    v = verify_rule(rules, "abs_square", seed=seed)
    assert v.status == "counterexample", v
    message = v.counterexample.message
    assert any(name in message for name in ("int8", "uint8", "int16", "int32", "int64")), message


def test_the_counterexample_is_the_same_on_every_run():
    rules = rewrite.parse(ABS_SQUARE)
    first = verify_rule(rules, "abs_square", seed=0)
    again = verify_rule(rules, "abs_square", seed=0)
    assert first.status == again.status == "counterexample"
    assert first.counterexample.message == again.counterexample.message


def test_check_verify_rejects_the_rule(tmp_path, capsys):
    path = tmp_path / "abs_square.rw"
    path.write_text(ABS_SQUARE + "\n")
    assert main(["check", "--verify", "--seed", "0", str(path)]) == 1
    assert "abs_square" in capsys.readouterr().out


_seen: list = []


@seed(0)
@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(instance=rule_instances(rewrite.parse("rule n: neg(neg(x)) => x"), "n", firing=False))
def _collect(instance):
    if not instance.dtype.is_floating_point and instance.dtype != torch.bool:
        _seen.extend(instance.example_inputs[0].flatten().tolist())


def test_small_integers_stay_the_common_case():
    _seen.clear()
    _collect()
    assert len(_seen) >= 20
    small = sum(-4 <= v <= 4 for v in _seen)
    assert small >= len(_seen) // 2, _seen
    assert small < len(_seen), _seen  # and the others are met too


def test_a_correct_integer_rule_still_verifies():
    """Wrapping is modular arithmetic: (x + x) - x is x whatever wraps on the way."""
    rules = rewrite.parse("rule n: neg(neg(x)) => x\n"
                          "rule w: sub(add(x, x), x) where dtype(x) == torch.int8 or dtype(x) == torch.int32 => x")
    for name in ("n", "w"):
        v = verify_rule(rules, name, max_examples=40)
        assert v.status == "ok", v


def test_shipped_exact_rules_still_verify(capsys):
    """The CI's command on the file of exact integer-capable rules (the whole
    command, every shipped file, is .ci's job: minutes)."""
    assert main(["check", "--verify", "--seed", "0", "--max-examples", "10", "-q", "rules/cleanup.rw"]) == 0
