"""The check on models that compute in half precision: the original's own rounding
error, measured against a run widened to float32, is allowed on top of the tolerance
(``rewrite.trust.precision``), so a shipped rule set passes its own default check on
a deep bfloat16 ResNet with sharp batch-norm statistics, in place or not, while a
rewrite that is wrong by more than that error still fails."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import rewrite
from rewrite.trust.check import (Reference, check_equivalence, generate_inputs, new_half_precisions,
                                 static_float_dtypes)
from rewrite.trust.precision import NOISE_MULTIPLIER, narrowed_run, rounding_noise, widened_run
from rewrite.trust.tolerance import Tolerance, compare_tensors


@functools.lru_cache(maxsize=None)
def rules(path: str):
    return rewrite.load(path)


def sharp_batchnorm(model: nn.Module, seed: int = 0) -> nn.Module:
    """Batch-norm statistics a trained net can have: variances down to 0.01, scales
    of either sign, means and shifts of order one (folding multiplies weights by up
    to 10 and the bfloat16 rounding with them)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for bn in model.modules():
            if isinstance(bn, nn.BatchNorm2d):
                n = bn.num_features
                bn.running_mean.copy_(torch.randn(n, generator=g))
                bn.running_var.copy_(torch.rand(n, generator=g) * 2 + 0.01)
                bn.weight.copy_(torch.randn(n, generator=g))
                bn.bias.copy_(torch.randn(n, generator=g))
    return model


@functools.lru_cache(maxsize=None)
def hf_resnet_bf16():
    """transformers' ResNet (two bottleneck blocks per stage: 28 conv + BN pairs) in
    bfloat16, captured with torch.export; the float32 model for the truth."""
    from transformers import ResNetConfig, ResNetModel

    torch.manual_seed(0)
    config = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[2, 2, 2, 2],
                          layer_type="bottleneck")
    model32 = sharp_batchnorm(ResNetModel(config).eval())
    x32 = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(3))  # (one the fold needs the relaxation on)
    model = ResNetModel(config).eval()
    model.load_state_dict(model32.state_dict())
    model = model.to(torch.bfloat16)
    x = x32.to(torch.bfloat16)
    return torch.export.export(model, (x,)).module(), (x,), model32, (x32,)


def _output(out):
    return out["last_hidden_state"] if isinstance(out, dict) else out[0]


@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
def test_fusion_passes_its_default_check_on_a_deep_bfloat16_resnet(inplace):
    gm, args, model32, args32 = hf_resnet_bf16()
    before = gm.code
    target = copy.deepcopy(gm) if inplace else gm  # (the cached module stays the original)
    result = rules("rules/fusion.rw").apply(target, args, inplace=inplace)
    assert result.counts == {"conv_bn": 28}, result.counts
    assert result.equivalence is not None and result.equivalence.ok
    out = result.graph_module
    assert not any("batch_norm" in str(n.target) for n in out.graph.nodes if n.op == "call_function")
    if not inplace:
        assert gm.code == before
    # about as far from the float32 model as the original: the folded weights and
    # biases are rounded to bfloat16 once more (3.6x the original's error here)
    with torch.no_grad():
        truth = _output(model32(*args32)).double()
        ref_err = (_output(gm(*args)).double() - truth).abs().max()
        new_err = (_output(out(*args)).double() - truth).abs().max()
    scale = truth.abs().max()
    assert new_err < 0.1 * scale, (new_err, scale)
    assert new_err < 5 * ref_err, (new_err, ref_err)


def test_the_fold_is_outside_bfloat16s_tolerance_and_within_the_originals_own_error():
    """What makes the relaxation needed: the folded model differs from the original
    by more than bfloat16's tolerance, and by less than three times the original's
    own error against its float32 run."""
    gm, args, _, _ = hf_resnet_bf16()
    fused = rules("rules/fusion.rw").apply(gm, args, check=False).graph_module
    tol = Tolerance.of(torch.bfloat16, "approx")
    outside = 0
    for trial in range(3):  # the check's trials: the example, then random inputs like it
        inputs = args if trial == 0 else generate_inputs(args, trial)
        with torch.no_grad():
            ref, cand = _output(gm(*inputs)), _output(fused(*inputs))
        noise = rounding_noise((ref,), (_output(widened_run(gm, inputs, trial)),))
        assert noise is not None and noise[0] is not None
        outside += compare_tensors(ref, cand, tol)[2] is not None
        assert compare_tensors(ref, cand, tol, noise=noise[0], noise_multiplier=NOISE_MULTIPLIER)[2] is None
    assert outside >= 1


def test_a_wrong_rewrite_of_a_bfloat16_model_still_fails():
    """Residual branches 10% off: more than the original's own rounding error."""
    gm, args, _, _ = hf_resnet_bf16()
    wrong = rewrite.parse("rule scaled: relu(add(x, y)) where is_float(x) and same_shape(x, y) "
                          "=> clamp(add(x, mul(y, 1.1)), 0)", "wrong.rw")
    with pytest.raises(rewrite.EquivalenceError):
        wrong.apply(gm, args)


class _Shallow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x).relu()


def test_a_shallow_bfloat16_model_gets_no_more_than_its_rounding():
    """One linear layer in bfloat16 is about exact: a 10% change of one element fails."""
    torch.manual_seed(0)
    model = _Shallow().to(torch.bfloat16).eval()
    x = torch.randn(4, 16, dtype=torch.bfloat16)

    def off(inp):
        out = model(inp).clone()
        out[0, 0] = out[0, 0] * 1.1 + 0.5
        return out

    report = check_equivalence(model, off, (x,), tolerance="approx")
    assert not report.ok


class _WritesBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(4, dtype=torch.bfloat16))

    def forward(self, x):
        self.count.add_(1)
        return x * self.count


def test_no_widened_run_for_a_model_that_writes_its_half_precision_state():
    """The widened copy of the buffer would take the write: no estimate, no relaxation."""
    model = _WritesBuffer()
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    assert widened_run(model, (x.clone(),), 0) is None
    assert torch.equal(model.count, torch.zeros(4, dtype=torch.bfloat16))


def test_float32_models_are_not_run_again():
    """The widened run is for half precision only: a float32 reference has no noise."""
    model = _Shallow().eval()
    x = torch.randn(4, 16)
    ref = Reference(model, (x,))
    ref.run(0)
    assert ref.noise(0) is None


# ---------------------------------------------------------------- a float32 model rewritten to bfloat16


@functools.lru_cache(maxsize=None)
def wav2vec2():
    """transformers' Wav2Vec2 (conv feature encoder, two layers), float32, exported:
    rules/amp_bf16.rw's default check failed on it at bfloat16's tolerance (one
    element in 5088, 1.8% of the scale against 1.6%)."""
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    torch.manual_seed(0)
    config = Wav2Vec2Config(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, max_position_embeddings=64, conv_dim=[16, 16],
                            conv_stride=[5, 2], conv_kernel=[10, 3], num_conv_pos_embeddings=16,
                            num_conv_pos_embedding_groups=2)
    config._attn_implementation = "eager"
    model = Wav2Vec2Model(config).eval()
    x = torch.randn(1, 1600, generator=torch.Generator().manual_seed(0))
    return torch.export.export(model, (x,), strict=False).module(), (x,)


@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
def test_amp_passes_its_default_check_as_close_as_autocast(inplace):
    gm, args = wav2vec2()
    target = copy.deepcopy(gm) if inplace else gm
    result = rules("rules/amp_bf16.rw").apply(target, args, inplace=inplace)
    assert result.counts.get("linear_bf16", 0) >= 10, result.counts
    assert result.equivalence is not None and result.equivalence.ok
    out = result.graph_module
    assert any(n.meta["val"].dtype == torch.bfloat16 for n in out.graph.nodes
               if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor))
    # about as close to the float32 model as torch's autocast is
    with torch.no_grad():
        ref = _output(gm(*args))
        mine = (_output(out(*args)) - ref).abs().max()
    auto = (_output(narrowed_run(gm, args, 0, torch.bfloat16)).float() - ref).abs().max()
    assert mine < 3 * auto, (mine, auto)


def test_a_wrong_bfloat16_rewrite_of_a_float32_model_still_fails():
    """gelu in bfloat16, and 5% off: more than autocast's own error."""
    gm, args = wav2vec2()
    wrong = rewrite.parse("rule gelu_off(tolerance=\"approx\"): gelu(x) where dtype(x) == torch.float32 "
                          "=> to(mul(gelu(to(x, torch.bfloat16)), 1.05), torch.float32)", "wrong.rw")
    with pytest.raises(rewrite.EquivalenceError):
        wrong.apply(gm, args)


def test_an_exported_graphs_dtypes_are_read_from_its_metadata():
    """export's input guard and dtype checks compute nothing: the check reads the
    dtypes from the nodes (no recording run), and in place knows the new precisions."""
    gm, args = wav2vec2()
    assert static_float_dtypes(gm) == {torch.float32}
    out = rules("rules/amp_bf16.rw").apply(gm, args, check=False).graph_module
    assert new_half_precisions(static_float_dtypes(gm), static_float_dtypes(out)) == (torch.bfloat16,)
