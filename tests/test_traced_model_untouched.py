"""A plain nn.Module given to apply/explain/quantize is captured with
torch.fx.symbolic_trace, which runs its forward's Python on the caller's own module
objects; the check then runs it eagerly as its reference. What that Python does to
the model besides the traced values must not stay in the caller's model: writes into
its existing tensors are stopped before they happen (and the capture refused), and
attributes set, deleted or filled in place are put back (probe P F07, F10)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import rewrite
import rewrite.quant as rq
from rewrite.capture import symbolic_trace

RULES = rewrite.parse("rule relu_twice: relu(relu(x)) => relu(x)\n")


def _state(m):
    """Everything of the caller's model the probes saw change: tensors by value, and
    the attributes the forwards below touch."""
    out = {k: v.detach().clone() for k, v in m.state_dict().items()}
    for name in ("counter", "calls", "cache"):
        if hasattr(m, name):
            value = getattr(m, name)
            out[name] = value.clone() if isinstance(value, torch.Tensor) else value
    if hasattr(m, "seen"):
        out["seen"] = list(m.seen)
    return out


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        elif isinstance(a[k], list):
            assert len(a[k]) == len(b[k]) and all(x is y for x, y in zip(a[k], b[k])), k
        else:
            assert a[k] == b[k], k


class PlainTensorCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.counter = torch.zeros(())

    def forward(self, x):
        self.counter.add_(1)
        return F.relu(F.relu(self.fc(x)))


class ClampThroughParameters(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            for p in self.parameters():
                p.clamp_(-0.1, 0.1)
        return F.relu(F.relu(self.fc(x)))


class ClampThroughData(ClampThroughParameters):
    def forward(self, x):
        for p in self.parameters():
            p.data.clamp_(-0.1, 0.1)  # no version counter moves
        return F.relu(F.relu(self.fc(x)))


class BufferStep(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("step", torch.zeros(()))

    def forward(self, x):
        self.step.add_(1)
        return F.relu(F.relu(self.fc(x)))


WRITERS = {"plain tensor attribute": (PlainTensorCounter, "'counter'"),
           "parameters under no_grad": (ClampThroughParameters, "'fc.weight'"),
           "parameters through .data": (ClampThroughData, "'fc.weight'"),
           "buffer": (BufferStep, "'step'")}

ENTRY_POINTS = {
    "apply": lambda m, x: RULES.apply(m, (x,)),
    "apply check=False": lambda m, x: RULES.apply(m, (x,), check=False),
    "explain": lambda m, x: RULES.explain(m, example_inputs=(x,)),
    "prepare": lambda m, x: rq.prepare(m, (x,)),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_forward_writing_the_models_tensors_is_refused_and_nothing_is_written(writer, entry):
    cls, name = WRITERS[writer]
    torch.manual_seed(0)
    model, x = cls().eval(), torch.randn(2, 4)
    before = _state(model)
    with pytest.raises((TypeError, ValueError)) as info:
        ENTRY_POINTS[entry](model, x)
    assert name in str(info.value) and "in place" in str(info.value)
    _same(before, _state(model))


def test_the_refusal_names_what_and_how():
    with pytest.raises(ValueError, match=r"would write 'fc.weight' in place \(aten.clamp_.*nothing was written"):
        symbolic_trace(ClampThroughData())


class PythonCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = 0
        self.seen = []
        self.cache = None

    def forward(self, x):
        self.calls += 1
        self.seen.append(x.sum())
        if self.cache is None:  # a lazily filled cache (rotary tables): tracing fills it with a Proxy
            self.cache = torch.ones(4)
        return F.relu(F.relu(self.fc(x))) * self.cache


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_attributes_a_forward_sets_or_fills_are_put_back(entry):
    torch.manual_seed(0)
    model, x = PythonCounter().eval(), torch.randn(2, 4)
    before = _state(model)
    ENTRY_POINTS[entry](model, x)
    _same(before, _state(model))
    assert model.cache is None and model.seen == [] and model.calls == 0
    model(x)  # the caller's model still runs eagerly, and fills its own cache
    assert isinstance(model.cache, torch.Tensor) and model.calls == 1


def test_tensors_the_forward_creates_may_be_written():
    class OwnMask(nn.Module):
        def forward(self, x):
            mask = torch.zeros(4)
            mask[1:3] = 1.0  # a write into memory the forward made: traced as a constant
            return F.relu(F.relu(x)) * mask

    model, x = OwnMask(), torch.randn(2, 4)
    result = RULES.apply(model, (x,))
    assert result.counts == {"relu_twice": 1}
    torch.testing.assert_close(result.graph_module(x), model(x))
