"""The AMP rule sets on values near the edges of float16/bfloat16's range: a
rewrite may round, never turn a finite value into inf, 0-then-inf or NaN that the
float32 model does not compute (each case failed before the fix it names)."""

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import rewrite
from rewrite.ops import bind_node

RULES = {"fp16": "rules/amp_fp16.rw", "bf16": "rules/amp_bf16.rw"}
LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}


def amp(kind):
    return rewrite.load(RULES[kind])


def ran_in(gm, inputs, op):
    """The dtypes the calls to ``op`` (an op of the vocabulary) compute in, from one run."""
    seen = []

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if any(b.op == op for b in bind_node(n, gm)):
                seen.append(out.dtype)
            return out

    with torch.no_grad():
        Recorder(gm).run(*inputs)
    return seen


class CausalPaddedAttention(nn.Module):
    """transformers' eager mask: finfo(float32).min on masked positions, causal and
    left padding, so the first query rows see no key at all."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.register_buffer("causal", torch.ones(5, 5, dtype=torch.bool).tril())

    def forward(self, x, keep):
        b, n = x.shape[0], x.shape[1]
        allowed = self.causal[None, None] & keep[:, None, None, :].bool()
        mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
        q, k, v = (p(x).view(b, n, 2, 8).transpose(1, 2) for p in (self.q, self.k, self.v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, n, 16)


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
@pytest.mark.parametrize("level", ["fx", "export"])
def test_a_finfo_min_attention_mask_stays_float32_and_fully_masked_rows_stay_finite(kind, level):
    torch.manual_seed(0)
    model = CausalPaddedAttention().eval()
    x = torch.randn(2, 5, 16)
    keep = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    gm = fx.symbolic_trace(model) if level == "fx" else torch.export.export(model, (x, keep)).module()
    result = amp(kind).apply(gm, (x, keep))  # the default check: it failed with a NaN trial
    assert ran_in(result.graph_module, (x, keep), "scaled_dot_product_attention") == [LOW[kind]]
    expected, got = model(x, keep), result.graph_module(x, keep)
    assert torch.isfinite(got).all()
    # the first row of the padded sequence is masked everywhere: a uniform average
    torch.testing.assert_close(got[0, 0], expected[0, 0], atol=0.05, rtol=0.05)
    torch.testing.assert_close(got, expected, atol=0.05, rtol=0.05)


class ComputedWeightLinear(nn.Module):
    """A weight the graph computes (a run-time cast) and a constant bias beyond
    float16's range: the fold refuses to cast it, the run-time cast must not either."""

    def __init__(self, bias):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 8) * 0.1)
        self.b = nn.Parameter(torch.full((4,), bias))

    def forward(self, x):
        return F.linear(x, self.w * 2, self.b)


@pytest.mark.parametrize("level", ["fx", "export"])
def test_a_constant_bias_beyond_float16_keeps_the_linear_in_float32(level):
    model = ComputedWeightLinear(-1e5).eval()
    x = torch.randn(3, 8)
    gm = fx.symbolic_trace(model) if level == "fx" else torch.export.export(model, (x,)).module()
    result = amp("fp16").apply(gm, (x,), check=False, training=False)  # the check caught it; the rule must not fire
    assert ran_in(result.graph_module, (x,), "linear") == [torch.float32]
    torch.testing.assert_close(result.graph_module(x), model(x))


def test_a_constant_bias_within_float16_still_runs_the_linear_in_float16():
    model = ComputedWeightLinear(3.0).eval()
    x = torch.randn(3, 8)
    result = amp("fp16").apply(fx.symbolic_trace(model), (x,))
    assert ran_in(result.graph_module, (x,), "linear") == [torch.float16]
    torch.testing.assert_close(result.graph_module(x), model(x), atol=0.02, rtol=0.02)


@pytest.mark.parametrize("scale,lowered", [(1e-9, False), (1e-4, False), (0.125, True), (-0.001, True),
                                           (0.0, True)])
def test_float16_scaling_by_a_number_that_could_vanish_stays_float32(scale, lowered):
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.log(torch.relu(self.fc(x) * scale) + 1e-30)

    model = Scaled().eval()
    x = torch.randn(4, 8) * 10
    result = amp("fp16").apply(fx.symbolic_trace(model), (x,), check=False)
    assert (result.counts.get("mul_scalar_fp16", 0) == 1) == lowered
    if not lowered:
        got = result.graph_module(x)
        assert (torch.isfinite(got) == torch.isfinite(model(x))).all()


@pytest.mark.parametrize("divisor,lowered", [(1e9, False), (4096.0, False), (8.0, True), (-1024.0, True)])
def test_float16_division_by_a_number_that_could_vanish_the_result_stays_float32(divisor, lowered):
    class Divided(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x) / divisor

    model = Divided().eval()
    x = torch.randn(4, 8)
    result = amp("fp16").apply(fx.symbolic_trace(model), (x,), check=False)
    assert (result.counts.get("div_scalar_fp16", 0) == 1) == lowered
    torch.testing.assert_close(result.graph_module(x), model(x), atol=1e-3, rtol=1e-2)


class SaturatingGate(nn.Module):
    """``log(1 - sigmoid(z)) > -15``: True in float32 for logits up to 15; a bfloat16
    sigmoid rounds to 1.0 above about 6 and the log gives -inf (False)."""

    def __init__(self, gain):
        super().__init__()
        self.fc = nn.Linear(16, 256)
        with torch.no_grad():
            self.fc.weight.mul_(gain)

    def forward(self, x):
        return torch.log(1 - torch.sigmoid(self.fc(x))) > -15


@pytest.mark.parametrize("inplace", [False, True])
def test_bool_outputs_flipped_by_a_new_inf_fail_the_check_within_the_agreement(inplace):
    # in place, the original's count is taken before the model changes
    torch.manual_seed(0)
    model, x = SaturatingGate(5.0).eval(), torch.randn(8, 16)
    flips = (amp("bf16").apply(fx.symbolic_trace(model), (x,), check=False).graph_module(x) != model(x))
    assert 0 < flips.float().mean() < 0.05  # within the agreement the check allows rounding
    gm = fx.symbolic_trace(model)
    code = gm.code
    with pytest.raises(rewrite.EquivalenceError, match="newly makes inf"):
        amp("bf16").apply(gm, (x,), inplace=inplace)
    assert gm.code == code  # nothing half-applied


class Threshold(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 256)

    def forward(self, x):
        return torch.sigmoid(self.fc(x)) > 0.501  # a bfloat16 sigmoid near 0.5 rounds across it


@pytest.mark.parametrize("inplace", [False, True])
def test_bool_outputs_that_flip_from_rounding_alone_still_pass_on_agreement(inplace):
    torch.manual_seed(0)
    model, x = Threshold().eval(), torch.randn(64, 16)
    result = amp("bf16").apply(fx.symbolic_trace(model), (x,), inplace=inplace)
    assert result.counts["sigmoid_bf16"] == 1
    assert result.equivalence.int_agreement is not None and result.equivalence.int_agreement < 1.0
