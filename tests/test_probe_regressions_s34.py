"""Session 34's probe findings, each as the behaviour its repro showed wrong.

- T01: cleanup's cast removals relied on dtype facts recorded without autocast: a
  model's ``logits.float()`` after a linear was removed, and the result returned
  bfloat16 under ``torch.autocast`` where the model returns float32.
- T02: ``apply`` called inside ``torch.autocast`` recorded the facts under it and
  removed a ``.to(torch.bfloat16)`` that matters without it.
- T04: ``apply`` left Python's ``random`` and numpy's generator advanced, and a model
  drawing from them made the check compare two different draws.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.fx as fx

import rewrite

CLEANUP = "rules/cleanup.rw"


class FloatLogits(torch.nn.Module):
    """HF's ``logits = self.lm_head(h).float()``."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        return torch.relu(self.head(x)).float()


class FloatInput(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x.float()) * 2


@pytest.mark.parametrize("spelling", ["float", "to"])
def test_a_models_cast_after_a_linear_stays_for_autocast(spelling):
    class Model(FloatLogits):
        def forward(self, x):
            y = torch.relu(self.head(x))
            return y.float() if spelling == "float" else y.to(torch.float32)

    model = Model().eval()
    x = torch.randn(2, 8)
    gm = fx.symbolic_trace(model)
    result = rewrite.load(CLEANUP).apply(gm, example_inputs=(x,))
    assert "to_same_dtype" not in result.counts
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert result.graph_module(x).dtype == model(x).dtype == torch.float32
    torch.testing.assert_close(result.graph_module(x), model(x))


def test_a_cast_of_an_input_is_still_removed():
    """x's dtype is the caller's: autocast changes it nowhere before the cast."""
    x = torch.randn(2, 8)
    gm = fx.symbolic_trace(FloatInput())
    result = rewrite.load(CLEANUP).apply(gm, example_inputs=(x,))
    assert result.counts.get("to_same_dtype") == 1
    assert not any(n.target == "float" for n in result.graph_module.graph.nodes)
    torch.testing.assert_close(result.graph_module(x), FloatInput()(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert result.graph_module(x).dtype == torch.float32


def test_a_round_trip_the_model_wrote_after_a_linear_stays():
    class Model(FloatLogits):
        def forward(self, x):
            return self.head(x).to(torch.float64).to(torch.float32)

    model = Model().eval()
    x = torch.randn(2, 8)
    result = rewrite.load(CLEANUP).apply(fx.symbolic_trace(model), example_inputs=(x,))
    assert "to_roundtrip" not in result.counts
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert result.graph_module(x).dtype == model(x).dtype == torch.float32


def test_amp_still_cancels_its_own_round_trips():
    """The casts the AMP rules insert are theirs to remove (rule_made)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).eval()
    x = torch.randn(2, 8)
    result = rewrite.load("rules/amp_bf16.rw").apply(fx.symbolic_trace(model), example_inputs=(x,))
    casts = [n for n in result.graph_module.graph.nodes
             if n.op == "call_method" and n.target == "to" or n.target in (torch.Tensor.to,)]
    # in: one cast of x; out: one back to float32; none between the two linears
    assert len(casts) == 2, result.graph_module.graph
    assert result.counts.get("to_roundtrip", 0) >= 1


def test_apply_inside_autocast_rewrites_the_model_as_it_runs_without():
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)

        def forward(self, x):
            return self.lin(x).to(torch.bfloat16)

    model = Head().eval()
    x = torch.randn(2, 8)
    gm = fx.symbolic_trace(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        result = rewrite.load(CLEANUP).apply(gm, example_inputs=(x,))
        assert torch.is_autocast_enabled("cpu")  # the caller's state is left as it was
    assert result.graph_module(x).dtype == model(x).dtype == torch.bfloat16
    torch.testing.assert_close(result.graph_module(x), model(x))


@fx.wrap
def layer_drop(x):
    """Skips its input's block with Python's generator, as LayerDrop helpers do."""
    return x * 0.0 if random.random() < 0.5 else x


@fx.wrap
def numpy_jitter(x):
    return x + float(np.random.rand())


class Drawing(torch.nn.Module):
    def forward(self, x):
        return numpy_jitter(layer_drop(torch.relu(torch.relu(x))))


def test_apply_puts_pythons_and_numpys_generators_back():
    x = torch.randn(4, 8)
    gm = fx.symbolic_trace(Drawing())
    random.seed(5)
    np.random.seed(5)
    expected = (random.random(), np.random.rand())
    random.seed(5)
    np.random.seed(5)
    result = rewrite.load(CLEANUP).apply(gm, example_inputs=(x,))
    assert result.counts.get("relu_relu") == 1
    assert (random.random(), np.random.rand()) == expected


def test_the_check_gives_both_models_the_same_host_draws():
    """Before: the original and the rewrite drew different numbers from Python's and
    numpy's generators, and a right rewrite failed the check."""
    x = torch.randn(4, 8)
    for seed in range(4):  # whichever way the draws fall
        random.seed(seed)
        result = rewrite.load(CLEANUP).apply(fx.symbolic_trace(Drawing()), example_inputs=(x,))
        assert result.counts.get("relu_relu") == 1
        assert result.equivalence is not None and result.equivalence.ok


# ---------------------------------------------------------------- probe U


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return self.fc(y.mean((2, 3)))


def _cnn():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    return model, torch.randn(2, 3, 8, 8)


def test_an_amp_result_saves_and_loads_with_torch_save(tmp_path):
    """Before: the casts the rules emitted were call_functions of ``torch.Tensor.to``,
    which fx pickles as ``from torch._C import TensorBase.to``: torch.save wrote the
    file and torch.load raised SyntaxError."""
    model, x = _cnn()
    result = rewrite.load("rules/amp_bf16.rw").apply(fx.symbolic_trace(model), example_inputs=(x,))
    casts = [n for n in result.graph_module.graph.nodes if n.op == "call_method" and n.target == "to"]
    assert casts and not any(n.op == "call_function" and n.target is torch.Tensor.to
                             for n in result.graph_module.graph.nodes)
    path = tmp_path / "amp.pt"
    torch.save(result.graph_module, path)
    loaded = torch.load(path, weights_only=False)
    torch.testing.assert_close(loaded(x), result.graph_module(x))


@pytest.mark.parametrize("rules", ["rules/fusion.rw", "rules/amp_bf16.rw"])
@pytest.mark.parametrize("check", [True, False])
def test_the_default_result_scripts_like_the_original(rules, check):
    model, x = _cnn()
    gm = fx.symbolic_trace(model)
    torch.jit.script(gm)  # the original scripts
    result = rewrite.load(rules).apply(gm, example_inputs=(x,), check=check)
    assert result.counts
    graph_before = list(result.graph_module.graph.nodes)
    scripted = torch.jit.script(result.graph_module)
    torch.testing.assert_close(scripted(x), result.graph_module(x))
    assert list(result.graph_module.graph.nodes) == graph_before
    assert result.graph_module.graph.owning_module is result.graph_module


@pytest.mark.parametrize("register", [
    lambda m: m.register_state_dict_post_hook(lambda mod, sd, prefix, meta: sd.__setitem__("version", 2)),
    lambda m: m._register_state_dict_hook(lambda mod, sd, prefix, meta: None),
    lambda m: m.register_load_state_dict_pre_hook(lambda *a: None),
    lambda m: m.register_load_state_dict_post_hook(lambda *a: None),
], ids=["state_dict_post", "state_dict", "load_pre", "load_post"])
def test_a_state_dict_hook_on_the_model_itself_is_refused(register):
    """Before: dropped without a word; the result saved and loaded other
    checkpoints than the model."""
    model, x = _cnn()
    register(model)
    with pytest.raises(TypeError, match="hooks registered on itself.*state"):
        rewrite.load("rules/fusion.rw").apply(model, example_inputs=(x,))
