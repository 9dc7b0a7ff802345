"""rewrite.testing: the README's "Testing your rewrites" example runs as written, and
each helper does what its docstring says."""

import re
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from hypothesis import given, settings
from hypothesis import strategies as st

import rewrite
from rewrite.testing import assert_equivalent, inputs_for, rule_instances
from rewrite.trust.verify import Instance

README = Path(__file__).resolve().parents[1] / "README.md"


def _readme_example() -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Testing your rewrites", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    return code


def test_readme_example_runs_as_written():
    namespace: dict = {"__name__": "readme_example"}
    # a file name that names no file: hypothesis reads a test's source lines by name
    exec(compile(_readme_example(), "<README.md: Testing your rewrites>", "exec"), namespace)  # noqa: S102
    tests = [v for k, v in namespace.items() if k.startswith("test_") and callable(v)]
    assert len(tests) == 2
    for test in tests:
        test()


# ---------------------------------------------------------------- assert_equivalent


def test_assert_equivalent_passes_and_fails_with_the_output_named():
    x = torch.randn(3, 4)
    report = assert_equivalent(torch.relu, lambda t: t.clamp(min=0), (x,))
    assert report.ok
    with pytest.raises(AssertionError, match="output"):
        assert_equivalent(torch.relu, torch.neg, (x,))


def test_exact_catches_what_tolerances_allow():
    x = torch.randn(8)
    assert_equivalent(lambda t: t * 1.0, lambda t: t * (1 + 1e-6), (x,))  # within float32 tolerance
    with pytest.raises(AssertionError):
        assert_equivalent(lambda t: t * 1.0, lambda t: t * (1 + 1e-6), (x,), exact=True)


# ---------------------------------------------------------------- inputs_for


@settings(max_examples=10, deadline=None)
@given(inputs=inputs_for((torch.zeros(2, 3), torch.arange(5))))
def test_inputs_for_example_inputs_keeps_shapes_dtypes_and_int_ranges(inputs):
    a, b = inputs
    assert a.shape == (2, 3) and a.dtype == torch.float32
    assert b.shape == (5,) and b.dtype == torch.int64
    assert int(b.min()) >= 0 and int(b.max()) <= 4


class _Net(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) + 1


_EXPORTED = torch.export.export(_Net(), (torch.randn(2, 5),)).module()


@settings(max_examples=5, deadline=None)
@given(inputs=inputs_for(_EXPORTED))
def test_inputs_for_a_graph_reads_placeholder_metadata(inputs):
    (x,) = inputs
    assert x.shape == (2, 5) and x.dtype == torch.float32


# ---------------------------------------------------------------- rule_instances


CLEANUP = rewrite.load("rules/cleanup.rw")


@settings(max_examples=15, deadline=None)
@given(instance=rule_instances(CLEANUP, "permute_permute"))
def test_rule_instances_fire_by_default(instance):
    assert isinstance(instance, Instance)
    assert isinstance(instance.graph_module, fx.GraphModule)
    assert set(instance.bindings) >= {"x", "p", "q"}
    result = CLEANUP["permute_permute"].apply(instance.graph_module, instance.example_inputs, check=False)
    assert result.counts == {"permute_permute": 1}
    assert_equivalent(instance.graph_module, result.graph_module, instance.example_inputs, exact=True)


@settings(max_examples=15, deadline=None)
@given(instance=rule_instances(CLEANUP, "to_same_dtype", firing=False), data=st.data())
def test_rule_instances_can_include_ones_the_where_clause_rejects(instance, data):
    x, d = instance.bindings["x"], instance.bindings["d"]
    assert isinstance(x, torch.Tensor) and isinstance(d, torch.dtype)
    out = instance.graph_module(*instance.example_inputs)
    assert out.dtype == d


def test_rule_instances_need_a_generator_for_every_op():
    rules = rewrite.parse("rule r: aten.narrow.default(x, _, _, _) => x")
    with pytest.raises(ValueError, match="no instance generator"):
        rule_instances(rules, "r")
