"""Random generator objects the model's own code holds (a module-level
``numpy.random.default_rng()`` a wrapped helper draws from, a ``random.Random``
a user's leaf module keeps, a ``torch.Generator`` in a closure): the check cannot
seed them without changing what the model computes, so every run starts from
their state as the caller left it (``rewrite.trust.rng.model_generators``). The
reference and the rewrite draw the same numbers, a correct rewrite passes, a
wrong one still fails, and no generator of the caller's has moved after
``apply``, ``explain`` or a failed check."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import fx, nn

import rewrite
from rewrite.ruleset import EquivalenceError

TWICE = "rule twice: mul(x, 2) where is_float(x) => add(x, x)"
WRONG = "rule twice: mul(x, 2) where is_float(x) => add(x, 1)"

NUMPY_RNG = np.random.default_rng(0)
LEGACY_RNG = np.random.RandomState(3)
TORCH_RNG = torch.Generator().manual_seed(2)


@torch.fx.wrap
def numpy_noise(x):
    return x + torch.from_numpy(NUMPY_RNG.normal(size=tuple(x.shape)).astype("float32"))


@torch.fx.wrap
def legacy_noise(x):
    return x + float(LEGACY_RNG.uniform())


@torch.fx.wrap
def torch_noise(x, generator=TORCH_RNG):  # held as a default argument
    return x + torch.randn(x.shape, generator=generator)


class Jitter(nn.Module):
    """A user's leaf module keeping its own Python generator."""

    def __init__(self) -> None:
        super().__init__()
        self.rng = random.Random(1)

    def forward(self, x):
        return x * (1.0 + self.rng.random())


class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.jitter = Jitter()

    def forward(self, x):
        y = numpy_noise(self.lin(x) * 2.0)
        return self.jitter(legacy_noise(torch_noise(y)))


class _Tracer(fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return isinstance(m, Jitter) or super().is_leaf_module(m, qualname)


def _traced(model: nn.Module) -> fx.GraphModule:
    return fx.GraphModule(model, _Tracer().trace(model))


def _states(model: Noisy) -> tuple:
    return (NUMPY_RNG.bit_generator.state, LEGACY_RNG.get_state()[1].tobytes(), LEGACY_RNG.get_state()[2],
            TORCH_RNG.get_state(), model.jitter.rng.getstate())


def _same(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


def _model() -> tuple:
    torch.manual_seed(0)
    model = Noisy().eval()
    gm = _traced(model)
    assert {n.target for n in gm.graph.nodes if n.op == "call_function"} >= {numpy_noise, legacy_noise, torch_noise}
    return model, gm


def test_a_correct_rewrite_of_a_model_drawing_from_held_generators_passes_and_moves_none():
    model, gm = _model()
    x = torch.randn(3, 4)
    before = _states(model)
    result = rewrite.parse(TWICE).apply(gm, (x,))
    assert result.counts == {"twice": 1}
    assert result.equivalence.ok and result.equivalence.max_abs_error == 0
    assert _same(before, _states(model)), "apply moved a generator the model's code holds"
    assert "add" in {n.target.__name__ for n in result.graph_module.graph.nodes if n.op == "call_function"
                     and hasattr(n.target, "__name__")}


def test_a_wrong_rewrite_is_still_refused_and_moves_none():
    model, gm = _model()
    x = torch.randn(3, 4)
    before = _states(model)
    with pytest.raises(EquivalenceError):
        rewrite.parse(WRONG).apply(gm, (x,))
    assert _same(before, _states(model))


@pytest.mark.parametrize("check", [False, True])
def test_recording_runs_and_explain_move_none(check):
    """A symbolic_trace graph has no shapes: apply runs it on the example inputs to
    record them, and explain runs it too."""
    model, gm = _model()
    x = torch.randn(3, 4)
    before = _states(model)
    rewrite.parse(TWICE).apply(gm, (x,), check=check)
    assert _same(before, _states(model))
    text = str(rewrite.parse(TWICE).explain(gm, example_inputs=(x,)))
    assert "twice" in text
    assert _same(before, _states(model))


def test_the_generators_are_drawn_from_as_before_after_apply():
    """What the caller's next run draws is what it would have drawn without the apply."""
    model, gm = _model()
    x = torch.randn(3, 4)
    expected = _traced(model)  # same code, same generators: run it once, then put them back
    saved = _states(model)
    want = expected(x)
    NUMPY_RNG.bit_generator.state = saved[0]
    state = LEGACY_RNG.get_state()
    LEGACY_RNG.set_state((state[0], np.frombuffer(saved[1], dtype=state[1].dtype), saved[2], *state[3:]))
    TORCH_RNG.set_state(saved[3])
    model.jitter.rng.setstate(saved[4])
    out = rewrite.parse(TWICE).apply(gm, (x,)).graph_module
    assert torch.allclose(out(x), want, atol=1e-6)
