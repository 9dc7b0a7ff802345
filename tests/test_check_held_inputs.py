"""Example inputs the check must see through: tensors held in objects torch's pytree
does not flatten (a dataclass, a SimpleNamespace, a dict subclass, a UserDict such as
transformers' BatchEncoding), and ``nn.Parameter`` inputs.

Before: such tensors were one opaque leaf. The model ran on the caller's own tensors
(a forward that writes its input wrote the caller's, once per run), every random
trial equalled the example (a wrong rule right on the example passed), and writes
into them were never compared.
"""

import collections
import dataclasses
import types

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import rewrite
from rewrite.trust.check import check_equivalence, generate_inputs, inputs_copy
from rewrite.trust.held import held_tensors, input_leaves, map_held

WRONG_SQUARE = rewrite.parse("rule square_is_itself: mul(x, x) => Tensor.clone(x)\n")  # right for 0 and 1 only
MUL_ONE = rewrite.parse("rule mul_one: mul(x, 1.0) where is_float(x) => x\n")


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    count: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(1))


class AttrDict(dict):
    """A dict subclass whose attribute look-up raises KeyError (copy.deepcopy asks it
    for ``__deepcopy__``)."""
    __getattr__ = dict.__getitem__


def _containers(x):
    return {
        "dataclass": Batch(x),
        "SimpleNamespace": types.SimpleNamespace(x=x, count=torch.zeros(1)),
        "dict subclass": AttrDict(x=x, count=torch.zeros(1)),
        "UserDict": collections.UserDict(x=x, count=torch.zeros(1)),
    }


class ByAttribute(nn.Module):
    def forward(self, b):
        x = b.x
        return torch.tanh(x * x)


class ByKey(nn.Module):
    def forward(self, b):
        x = b["x"]
        return torch.tanh(x * x)


def _model(kind):
    return ByAttribute() if kind in ("dataclass", "SimpleNamespace") else ByKey()


@pytest.mark.parametrize("kind", ["dataclass", "SimpleNamespace", "dict subclass", "UserDict"])
def test_a_wrong_rule_right_on_the_example_is_caught_through_an_object(kind):
    gm = fx.symbolic_trace(_model(kind))
    example = _containers(torch.ones(8))[kind]  # x * x == x on ones: trial 0 cannot tell
    assert WRONG_SQUARE.apply(gm, (example,), check=False).counts == {"square_is_itself": 1}
    with pytest.raises(rewrite.EquivalenceError) as info:
        WRONG_SQUARE.apply(gm, (example,))
    assert "trial 1" in str(info.value) or "trial 2" in str(info.value)


@pytest.mark.parametrize("kind", ["dataclass", "SimpleNamespace", "dict subclass", "UserDict"])
def test_apply_never_writes_tensors_the_callers_object_holds(kind):
    class Counting(nn.Module):
        def forward(self, b):
            count = b.count if kind in ("dataclass", "SimpleNamespace") else b["count"]
            count.add_(1)  # the model counts its calls in its input
            x = b.x if kind in ("dataclass", "SimpleNamespace") else b["x"]
            return torch.relu(x) * 1.0

    gm = fx.symbolic_trace(Counting())
    example = _containers(torch.randn(4))[kind]
    x_before = (example.x if hasattr(example, "x") and not isinstance(example, dict) else example["x"]).clone()
    result = MUL_ONE.apply(gm, (example,))
    assert result.counts == {"mul_one": 1}
    count = example.count if kind in ("dataclass", "SimpleNamespace") else example["count"]
    assert count.item() == 0.0  # every run of the check wrote a copy
    x_after = example.x if kind in ("dataclass", "SimpleNamespace") else example["x"]
    assert torch.equal(x_after, x_before)


def test_writes_into_held_tensors_are_compared():
    def writes(b):
        b.count.add_(1)
        return b.x * 2

    def does_not(b):
        return b.x * 2

    report = check_equivalence(writes, does_not, (Batch(torch.randn(3)),))
    assert not report.ok and "writes into this input" in report.first_mismatch.message
    assert check_equivalence(writes, writes, (Batch(torch.randn(3)),)).ok


def test_parameter_inputs_are_drawn_as_parameters():
    p = nn.Parameter(torch.ones(8))  # x * x == x on ones: only a drawn trial can tell
    with pytest.raises(rewrite.EquivalenceError):
        WRONG_SQUARE.apply(_square_model(), (p,))
    drawn = generate_inputs((p, nn.Parameter(torch.ones(3), requires_grad=False)), seed=1)
    assert isinstance(drawn[0], nn.Parameter) and drawn[0].requires_grad and not torch.equal(drawn[0], p)
    assert isinstance(drawn[1], nn.Parameter) and not drawn[1].requires_grad


def _square_model():
    class Square(nn.Module):
        def forward(self, x):
            return torch.tanh(x * x)

    return fx.symbolic_trace(Square())


def test_held_tensors_order_survives_a_copy_and_sharing_is_kept():
    shared = torch.randn(3)
    obj = types.SimpleNamespace(a=shared, inner=Batch(torch.randn(2), shared), items=[torch.ones(1), "text", 3])
    held = held_tensors(obj)
    assert len(held) == 3 and held[0] is shared  # shared counted once
    copied = map_held(obj, lambda t: t + 1)
    assert copied.a is copied.inner.count  # one tensor held twice is one tensor in the copy
    assert [torch.equal(c, h + 1) for c, h in zip(held_tensors(copied), held)] == [True] * 3
    assert copied.items[1] == "text" and obj.a is shared
    assert len(input_leaves(((obj,), {"y": torch.zeros(1)}))) == 4
    private = inputs_copy((obj,))[0]
    assert private.a is not shared and torch.equal(private.a, shared)


def test_an_object_that_cannot_be_copied_is_refused_clearly():
    class Locked:
        def __init__(self):
            self.x = torch.randn(2)
            self.lock = __import__("threading").Lock()

        def __reduce_ex__(self, protocol):
            raise TypeError("cannot pickle")

    with pytest.raises(TypeError, match="holds tensors, and the check cannot copy it"):
        map_held(Locked(), lambda t: t)
