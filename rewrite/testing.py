"""Helpers for your own property tests of rewrites (pytest + hypothesis).

``rewrite check --verify`` verifies the shipped and your rules on random instances.
These helpers let a test suite do the same for what it cares about: a rule on
random instances of its pattern, or a whole rewritten model on random inputs.

* ``assert_equivalent(a, b, inputs)``: the randomized equivalence check of
  ``apply`` (``rewrite.trust.check``), raising ``AssertionError`` with the first diverging
  output; ``exact=True`` for bit-for-bit rules.
* ``inputs_for(graph_module_or_example_inputs)``: a hypothesis strategy of inputs
  shaped like a graph's placeholders (from their metadata) or like example inputs.
* ``rule_instances(ruleset, rule_name)``: a strategy of random instances of a rule's
  pattern (``rewrite.trust.verify.Instance``: a small GraphModule and inputs for it), built
  by the verifier's generators; by default only instances where the rule fires.

Example (README.md, "Testing your rewrites")::

    @settings(max_examples=25, deadline=None)
    @given(instance=rule_instances(rules, "conv_bn"))
    def test_conv_bn(instance):
        result = rules["conv_bn"].apply(instance.graph_module, instance.example_inputs, check=False)
        assert result.counts == {"conv_bn": 1}
        assert_equivalent(instance.graph_module, result.graph_module, instance.example_inputs)

Needs ``hypothesis`` (a test extra).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch.fx as fx

from rewrite.trust.check import EquivalenceReport, generate_inputs, inputs_from_graph
from rewrite.trust.check import assert_equivalent as _assert_equivalent

__all__ = ["assert_equivalent", "inputs_for", "rule_instances"]


def assert_equivalent(reference: Callable, candidate: Callable, example_inputs: Any = None, *,
                      trials: int = 1, exact: bool = False, rtol: float | None = None,
                      atol: float | None = None, seed: int = 0, **kw: Any) -> EquivalenceReport:
    """Assert that ``candidate`` computes what ``reference`` computes.

    Args:
        reference, candidate: callables (GraphModules, modules, functions).
        example_inputs: positional inputs (a tuple); None to build them from
            ``reference``'s placeholder metadata.
        trials: runs; trial 0 uses ``example_inputs`` as given, later trials random
            inputs shaped like them (1 by default: hypothesis draws the inputs).
        exact: require equal values (NaN equals NaN) instead of dtype-aware tolerances.
        rtol, atol: override the tolerances (see ``rewrite.trust.check.TOLERANCES``).
        seed: for the random trials.
        kw: passed to ``rewrite.trust.check.check_equivalence`` (``input_ranges``, ...).

    Returns:
        The ``EquivalenceReport`` (for its error figures).

    Raises:
        AssertionError: naming the first output that differed.
    """
    if exact:
        rtol, atol = 0.0, 0.0
    return _assert_equivalent(reference, candidate, example_inputs, trials=trials, seed=seed,
                              rtol=rtol, atol=atol, **kw)


def inputs_for(source: Any, *, input_ranges: Mapping | None = None) -> Any:
    """A hypothesis strategy of inputs for a graph or shaped like example inputs.

    Args:
        source: a GraphModule whose placeholders carry shape metadata (``meta['val']``
            as torch.export and dynamo record it, or ``tensor_meta``), or example
            inputs (a tuple or pytree) to imitate: same shapes and dtypes, floats
            around their mean and spread, integers within their range.
        input_ranges: leaf (flat index or name/path) -> ``(low, high)`` uniform range.

    Returns:
        A strategy of input tuples (pytrees like ``source``); it shrinks to seed 0.
    """
    from hypothesis import strategies as st

    seeds = st.integers(0, 2**31 - 1)
    if isinstance(source, fx.GraphModule):
        return seeds.map(lambda s: inputs_from_graph(source, s, input_ranges=input_ranges))
    return seeds.map(lambda s: generate_inputs(source, s, input_ranges=input_ranges))


def rule_instances(ruleset: Any, rule_name: str, *, firing: bool = True) -> Any:
    """A hypothesis strategy of random instances of one rule's pattern.

    Args:
        ruleset: the ``RuleSet`` holding the rule (``rewrite.load(...)``).
        rule_name: the rule.
        firing: keep only instances on which the rule fires (its where clause
            holds); False yields every instance of the pattern.

    Returns:
        A strategy of ``rewrite.trust.verify.Instance``: ``graph_module``,
        ``example_inputs``, ``bindings`` (pattern variable -> value), ``dtype``,
        ``dialect``.

    Raises:
        ValueError: an op of the pattern has no instance generator.
    """
    from rewrite.trust.verify import instances

    rule = ruleset.rules[rule_name]
    if not firing:
        return instances(rule)
    one = ruleset[rule_name]

    def fires(inst: Any) -> bool:
        try:
            return bool(one.apply(inst.graph_module, inst.example_inputs, check=False).counts)
        except Exception:  # noqa: BLE001 - an instance the engine rejects is not one that fires
            return False

    return instances(rule, accept=fires)
