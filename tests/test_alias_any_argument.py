"""Memory sharing the alias model must see beyond first arguments and name lists.

A rule may forward an existing value (``mul(x, 1) => x``) only when the caller can
observe no new sharing. These cases share memory in ways an earlier model missed:
a user function returning its second argument, ops that return their input with no
alias annotation (``_unsafe_view``, ``unsafe_chunk``, ``dequantize`` of a float,
``+x``, ``einsum("ij->ji")``), ops taking their tensors as varargs
(``broadcast_tensors(a, b)``), in-place functions whose names start with an
underscore (``_foreach_add_``), and graph inputs the caller passes as one tensor.
With ``check=False`` the engine must refuse these rewrites by itself; the check must
see writes that bump no version counter and run the inputs as the caller gave them
(strides and sharing kept).
"""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx, nn

import rewrite
from rewrite.trust.check import check_equivalence, generate_inputs
from rewrite.trust.verify import verify_rules

MUL_ONE = rewrite.parse("rule mul_one: mul(x, 1) => x\n")
ADD_ZERO = rewrite.parse("rule add_zero: add(x, 0, ...) where is_float(x) => x\n")


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@fx.wrap
def pick_second(a, b):
    return b


class SecondArgument(nn.Module):
    """A leaf function that returns its second argument: the clone it is given
    protects the input from the write, and its result is the parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(3))

    def forward(self, x):
        y = pick_second(x * 2, x.clone())
        y.add_(1)
        return y, pick_second(x * 3, self.p) * 1


def test_a_function_returning_its_second_argument_is_followed():
    gm = fx.symbolic_trace(SecondArgument())
    rules = rewrite.parse("rule clone_drop: clone(x) => x\nrule mul_one: mul(x, 1) => x\n")
    result = rules.apply(gm, (torch.randn(3),), check=False)
    assert result.counts == {}, "both rewrites would let the caller see new sharing"
    x = torch.randn(3)
    before = x.clone()
    out = result.graph_module(x)
    assert torch.equal(x, before), "the input was written"
    assert not _shares(out[1], result.graph_module.p), "the output is the parameter"


UNANNOTATED = {
    "_unsafe_view": lambda x: torch.ops.aten._unsafe_view.default(x, [12]),
    "dequantize_of_a_float": lambda x: torch.ops.aten.dequantize.self(x),
    "lift": lambda x: torch.ops.aten.lift.default(x),
    "pos": lambda x: +x,
    "unsafe_split": lambda x: torch.unsafe_split(x, 2)[0],
    "unsafe_chunk": lambda x: torch.unsafe_chunk(x, 2)[0],
    "new": lambda x: x.new(x),
    "dequantize_method": lambda x: x.dequantize(),
    "einsum_transpose": lambda x: torch.einsum("ij->ji", x),
}


@pytest.mark.parametrize("name", sorted(UNANNOTATED))
def test_ops_returning_their_input_unannotated_are_not_fresh(name):
    f = UNANNOTATED[name]

    class Returns(nn.Module):
        def forward(self, x):
            return f(x) + 0

    gm = fx.symbolic_trace(Returns())
    x = torch.randn(4, 3)
    assert _shares(f(x), x), "the op really returns its input's memory"
    result = ADD_ZERO.apply(gm, (x,), check=False)
    assert result.counts == {}
    assert not _shares(result.graph_module(x), x)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_einsum_operands_after_the_equation_are_followed(capture):
    class Einsum(nn.Module):
        def forward(self, x):
            y = torch.einsum("ij->ji", x) * 1
            y.add_(1)
            return y + 1

    x = torch.randn(3, 4)
    model = Einsum()
    gm = fx.symbolic_trace(model) if capture == "fx" else torch.export.export(model, (x,)).module()
    result = MUL_ONE.apply(gm, (x,), check=False)
    before = x.clone()
    torch.testing.assert_close(result.graph_module(x), model(before.clone()))
    assert torch.equal(x, before), "the rewrite made the model write its input"


@pytest.mark.parametrize("op", [torch.broadcast_tensors, torch.meshgrid, torch.atleast_2d])
def test_ops_taking_tensors_as_varargs_may_return_any_of_them(op):
    class Varargs(nn.Module):
        def forward(self, a, y):
            return op(a, y)[1] * 1

    a, y = torch.randn(3), torch.randn(3)
    result = MUL_ONE.apply(fx.symbolic_trace(Varargs()), (a, y), check=False)
    assert result.counts == {}
    assert not _shares(result.graph_module(a, y), y)


@pytest.mark.parametrize("write", [
    lambda y: torch._foreach_add_([y], 1.0),
    lambda y: torch._foreach_mul_([y], 2.0),
    lambda y: torch._index_put_impl_(y, (torch.tensor([0]),), torch.tensor(5.0)),
])
def test_in_place_functions_named_with_a_leading_underscore_write(write):
    class Writes(nn.Module):
        def forward(self, x):
            y = x * 1
            write(y)
            return y + 1

    x = torch.randn(3)
    before = x.clone()
    result = MUL_ONE.apply(fx.symbolic_trace(Writes()), (x,), check=False)
    assert result.counts == {}
    result.graph_module(x)
    assert torch.equal(x, before)


class WritesFirstInput(nn.Module):
    def forward(self, a, b):
        y = b * 1
        a.add_(1)
        return y * 2


def test_graph_inputs_may_be_one_tensor():
    """``m(t, t)`` is a legal call: forwarding ``b`` would let the write into ``a``
    reach ``y``."""
    model = WritesFirstInput()
    result = MUL_ONE.apply(fx.symbolic_trace(model), (torch.zeros(3), torch.zeros(3)), check=False)
    assert result.counts == {}
    t, u = torch.zeros(3), torch.zeros(3)
    assert torch.equal(result.graph_module(t, t), model(u, u))


def test_the_check_runs_inputs_the_caller_shares_as_one_tensor():
    """The check's private copy of ``(t, t)`` is one tensor too: a candidate that
    differs only when the inputs share memory is caught."""
    t = torch.zeros(3)

    def reference(a, b):
        y = b * 1
        a.add_(1)
        return y * 2

    def candidate(a, b):
        y = b
        a.add_(1)
        return y * 2

    report = check_equivalence(reference, candidate, (t, t), trials=2)
    assert not report.ok
    assert torch.equal(t, torch.zeros(3)), "the caller's inputs are never run"
    same = generate_inputs((t, t), seed=1)
    assert same[0] is same[1], "random trials share what the example inputs share"


def test_the_check_sees_writes_that_bump_no_version():
    def reference(x):
        return x * 2

    def candidate(x):  # writes x through a chunk that shares its memory, not its version
        torch.unsafe_chunk(x, 2)[0].add_(1)
        return x * 2 - torch.cat([torch.ones(2), torch.zeros(2)]) * 2

    report = check_equivalence(reference, candidate, (torch.randn(4),), trials=1)
    assert not report.ok and "input" in str(report.first_mismatch)


def test_the_check_runs_inputs_with_their_strides():
    """A ``reshape => view`` rule fails on a sliced input as it would for the
    caller; random trials keep the example's layout."""
    class Flat(nn.Module):
        def forward(self, x):
            return x.reshape(-1) + 1

    x = torch.randn(4, 5)[:, :3]
    gm = fx.symbolic_trace(Flat())
    with pytest.raises(rewrite.EquivalenceError):
        rewrite.parse("rule reshape_view: reshape(x, s) => view(x, s)\n").apply(gm, (x,))
    for example in (x, torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last), torch.randn(3, 4).t()):
        drawn = generate_inputs((example,), seed=3)[0]
        assert drawn.stride() == example.stride() and drawn.shape == example.shape


class WritesItsParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4), requires_grad=False)

    def forward(self, x):
        torch.unsafe_chunk(self.w, 2)[0].add_(1)  # shares w's memory, not its version
        return (x + 1) * 1  # not x * 1: x may be w itself (m(m.w)), which is written


def test_apply_puts_back_a_parameter_the_model_writes_without_a_version_bump():
    gm = fx.symbolic_trace(WritesItsParameter())
    before = gm.w.detach().clone()
    result = MUL_ONE.apply(gm, (torch.randn(4, 4),))
    assert result.counts == {"mul_one": 1} and result.equivalence.ok
    assert torch.equal(gm.w, before), "apply left the model's parameter written"


def test_an_approximate_rule_pinned_to_float32_is_checked_in_float64():
    rules = rewrite.parse('rule gelu_tanh(tolerance="approx"):\n'
                          '    gelu(x) where dtype(x) == torch.float32 => gelu(x, approximate="tanh")\n')
    assert verify_rules(rules, max_examples=40, seed=0)["gelu_tanh"].status == "counterexample"


def test_approximate_rules_meet_integers_that_wrap():
    rules = rewrite.parse('rule abs_sq(tolerance="approx"): abs(mul(x, x)) => mul(x, x)\n')
    assert verify_rules(rules, max_examples=60, seed=0)["abs_sq"].status == "counterexample"


def test_operator_functions_known_fresh_still_rewrite():
    """The knowledge is not blanket refusal: ``x * 1`` of a sum is forwarded."""
    class Sum(nn.Module):
        def forward(self, a, b):
            return operator.add(a, b) * 1

    a, b = torch.randn(3), torch.randn(3)
    result = MUL_ONE.apply(fx.symbolic_trace(Sum()), (a, b), check=False)
    assert result.counts == {"mul_one": 1}
    torch.testing.assert_close(result.graph_module(a, b), a + b)


class Counts(nn.Module):
    """Reassigns a buffer each call: dynamo hands the graph a new tensor each time."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("step", torch.zeros(()))

    def forward(self, x):
        self.step = self.step + 1
        return x * self.step * 1


def test_the_backend_sees_a_buffer_the_model_reassigns():
    torch._dynamo.reset()
    x = torch.ones(3)
    model, results = Counts(), []
    compiled = torch.compile(model, backend=rewrite.backend(MUL_ONE, on_result=results.append))
    got = [compiled(x).clone() for _ in range(3)]
    reference = Counts()
    eager = [reference(x).clone() for _ in range(3)]
    assert results and results[0].counts == {"mul_one": 1}, "the rules ran on the graph"
    assert all(torch.equal(a, b) for a, b in zip(got, eager)), (got, eager)
    torch._dynamo.reset()
