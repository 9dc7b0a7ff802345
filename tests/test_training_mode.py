"""Whether a graph trains decides whether its parameters may be folded into constants
(AMP's weights cast once). An ATen graph keeps no trace of ``model.eval()``: where
nothing in it tells, a parameter that requires grad is not folded, and apply says why
(``TrainingModeWarning``). The caller's word (``training=``), the graph's batch norms
and dropouts, a capture of an eval-mode model (``rewrite.capture``) and an earlier
apply that knew (``INFERENCE_KEY`` on the result) all tell."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import fx

import rewrite
from rewrite.capture import INFERENCE_KEY, capture
from rewrite.ops.effects import graph_mode

AMP = rewrite.load(rewrite.rules_dir() / "amp_bf16.rw")
FUSION = rewrite.load(rewrite.rules_dir() / "fusion.rw")
TOL = {"rtol": 0.05, "atol": 0.05}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.bn, self.fc = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Linear(8, 2)

    def forward(self, x):
        return self.fc(self.bn(self.conv(x)).mean((2, 3)))


class Dropping(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.p = nn.Linear(8, 8), p

    def forward(self, x):
        return F.dropout(self.fc(x), self.p, self.training)


def half_constants(gm: fx.GraphModule) -> int:
    """bfloat16 tensors the graph reads as constants: weights AMP cast once."""
    return sum(1 for t in [*gm.parameters(), *gm.buffers()] if t.dtype == torch.bfloat16)


def exported(model: nn.Module, x: torch.Tensor) -> fx.GraphModule:
    return torch.export.export(model, (x,)).module()


def apply_recording(rules, gm, x, **options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = rules.apply(gm, (x,), **TOL, **options)
    told = [w for w in caught if issubclass(w.category, rewrite.TrainingModeWarning)]
    return result, told


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_an_export_graph_that_tells_nothing_keeps_its_parameters_trainable(mode):
    model = getattr(mlp(), mode)()
    x = torch.randn(3, 8)
    result, told = apply_recording(AMP, exported(model, x), x)
    gm = result.graph_module
    assert half_constants(gm) == 0  # cast at run time, as autocast does
    assert result.counts  # the linears still run in bfloat16
    assert len(told) == 1 and "training=False" in str(told[0].message) and "4 parameter" in str(told[0].message)
    # the gradients reach every parameter of the result
    gm(x).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in gm.parameters())
    assert INFERENCE_KEY not in gm.meta


def test_the_callers_word_decides():
    x = torch.randn(3, 8)
    gm = exported(mlp().eval(), x)
    folded, told = apply_recording(AMP, gm, x, training=False)
    assert half_constants(folded.graph_module) == 4 and not told
    assert folded.graph_module.meta[INFERENCE_KEY] is True
    torch.testing.assert_close(folded.graph_module(x), gm(x), **TOL)
    kept, told = apply_recording(AMP, gm, x, training=True)
    assert half_constants(kept.graph_module) == 0 and not told
    assert INFERENCE_KEY not in gm.meta  # the input is untouched


@pytest.mark.parametrize("level", ["export", "dynamo"])
def test_a_capture_of_an_eval_model_says_it_is_inference(level):
    x = torch.randn(3, 8)
    gm = capture(mlp().eval(), (x,), level)
    assert gm.meta.get(INFERENCE_KEY) is True
    assert capture(mlp().train(), (x,), level).meta.get(INFERENCE_KEY) is False
    if level == "export":
        result, told = apply_recording(AMP, gm, x)
        assert half_constants(result.graph_module) == 4 and not told


def test_one_module_in_training_mode_makes_the_capture_say_it_may_train():
    model = mlp().eval()
    model[2].train()
    assert capture(model, (torch.randn(3, 8),), "export").meta.get(INFERENCE_KEY) is False


def test_a_fine_tuned_model_with_frozen_batch_norms_keeps_its_weights_trainable():
    # model.train(); model.bn.eval(): the export holds an eval-mode batch norm, which alone
    # would read as inference; the capture knows the model trains (probe AJ F5)
    model = ConvBN().train()
    model.bn.eval()
    x = torch.randn(2, 3, 8, 8)
    result, told = apply_recording(AMP, capture(model, (x,), "export"), x)
    assert half_constants(result.graph_module) == 0 and not told
    result.graph_module(x).sum().backward()
    assert all(p.grad is not None for p in result.graph_module.parameters() if p.requires_grad)


def test_the_callers_word_is_kept_on_the_result():
    x = torch.randn(3, 8)
    gm = capture(mlp().eval(), (x,), "export")
    trained = AMP.apply(gm, (x,), training=True, **TOL).graph_module
    assert trained.meta[INFERENCE_KEY] is False
    assert half_constants(AMP.apply(trained, (x,), **TOL).graph_module) == 0


def test_an_apply_that_knew_tells_the_next_one():
    # fusion folds the eval-mode batch norm that told; AMP after it still folds
    x = torch.randn(2, 3, 8, 8)
    gm = exported(ConvBN().eval(), x)
    assert graph_mode(gm) is False
    fused, told = apply_recording(FUSION, gm, x)
    assert fused.counts.get("conv_bn") == 1 and not told
    assert graph_mode(fused.graph_module) is None and fused.graph_module.meta[INFERENCE_KEY] is True
    amp, told = apply_recording(AMP, fused.graph_module, x)
    assert half_constants(amp.graph_module) == 4 and not told
    torch.testing.assert_close(amp.graph_module(x), gm(x), **TOL)


@pytest.mark.parametrize(("model", "expected"), [
    (ConvBN().eval(), False),
    (ConvBN().train(), True),
    (Dropping(0.5).eval(), False),
    (Dropping(0.5).train(), True),
    (mlp().eval(), None),
    (mlp().train(), None),
])
def test_graph_mode_reads_batch_norms_and_dropouts(model, expected):
    x = torch.randn(2, 3, 8, 8) if isinstance(model, ConvBN) else torch.randn(3, 8)
    assert graph_mode(exported(model, x)) is expected
    assert graph_mode(fx.symbolic_trace(model)) is expected


def test_a_training_export_graph_is_known_to_train():
    x = torch.randn(3, 8)
    result, told = apply_recording(AMP, exported(Dropping(0.0).train(), x), x, check=False)
    assert half_constants(result.graph_module) == 0 and not told  # the dropout told: no warning


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_symbolic_trace_graphs_keep_reading_their_modules_flags(mode):
    x = torch.randn(3, 8)
    result, told = apply_recording(AMP, fx.symbolic_trace(getattr(mlp(), mode)()), x)
    assert half_constants(result.graph_module) == (4 if mode == "eval" else 0) and not told


def test_frozen_backend_graphs_fold_without_a_warning():
    model = mlp().eval()
    x = torch.randn(3, 8)
    results = []
    compiled = torch.compile(model, backend=rewrite.backend(AMP, on_result=results.append, **TOL))
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        out = compiled(x)
    assert not [w for w in caught if issubclass(w.category, rewrite.TrainingModeWarning)]
    assert half_constants(results[0].graph_module) == 4
    torch.testing.assert_close(out, model(x), **TOL)
