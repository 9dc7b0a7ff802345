"""The shipped rule sets, with their default settings, on models no other test uses:
transformers models in bfloat16/float16 and T5's encoder (transformer.rw), and classic
CNNs written here (fusion.rw, amp_bf16.rw, cleanup.rw): MobileNetV2 (depthwise conv,
ReLU6, residual), a UNet (ConvTranspose2d + cat + BN), a 1-d audio net, a 3-d net and
batch norms without affine parameters or running statistics, also channels_last.

Each test checks that ``apply`` (check on) does not raise, that the expected rewrites
happened, that outputs match, and that the input GraphModule is left as it was."""

from __future__ import annotations

import collections
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import rewrite
from rewrite.examples.graph_stats import count_batch_norms
from rewrite.ops import bind_node


@functools.lru_cache(maxsize=None)
def rule_set(path: str, name: str | None = None):
    rules = rewrite.load(path)
    return rules[name] if name else rules


def ops(gm):
    """Canonical op -> count (every spelling at every level)."""
    return collections.Counter(b[0].op for n in gm.graph.nodes for b in [bind_node(n, gm)] if b)


def state(gm):
    return (gm.code, {k: (v.detach().clone(), v.requires_grad) for k, v in gm.state_dict(keep_vars=True).items()},
            {n: m.training for n, m in gm.named_modules()})


def assert_same_state(before, after):
    assert before[0] == after[0], "apply() changed its input's code"
    assert before[1].keys() == after[1].keys()
    for k, (v, grad) in before[1].items():
        assert torch.equal(v, after[1][k][0]) and grad == after[1][k][1], f"apply() changed {k}"
    assert before[2] == after[2], "apply() changed a training flag"


def apply_checked(rules, gm, args):
    """``rules.apply`` with its defaults; the input is untouched and outputs match."""
    before = state(gm)
    result = rules.apply(gm, example_inputs=args)
    assert_same_state(before, state(gm))
    return result


def first(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return next(iter(out.values()))
    return out[0]


def export(model, args):
    return torch.export.export(model, args, strict=False).module()


# ---------------------------------------------------------------- transformers models


def _tokens(seq=8):
    return (torch.randint(0, 100, (1, seq), generator=torch.Generator().manual_seed(0)),)


def _llama(kind):
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{kind}Config")(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, vocab_size=100, max_position_embeddings=64, use_cache=False,
        attn_implementation="eager")
    return getattr(transformers, f"{kind}Model")(config).eval(), _tokens()


def _t5():
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    config = T5Config(vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                      attn_implementation="eager")
    return T5EncoderModel(config).eval(), _tokens()


def _vit():
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(0)
    config = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                       image_size=32, patch_size=8, attn_implementation="eager")
    return ViTModel(config).eval(), (torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)),)


def _transformer_rewrite(build, dtype):
    pytest.importorskip("transformers")
    model, args = build()
    model = model.to(dtype)
    args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
    gm = export(model, args)
    result = apply_checked(rule_set("rules/transformer.rw", "transformer"), gm, args)
    with torch.no_grad():
        want, got = first(gm(*args)), first(result.graph_module(*args))
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2 * want.abs().max().item())
    return ops(gm), ops(result.graph_module), result.counts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["Llama"])
def test_half_precision_llama_attention_and_rms_norm_become_one_op(kind, dtype):
    # HF computes the softmax and the RMSNorm of a half-precision model in float32 and casts
    # back; torch's softmax and rms_norm of a half-precision tensor do the same inside.
    # A float16 causal mask holds finfo(float16).min, which rounds a fully masked row's
    # scores away written out and not in sdpa (mask_rounds_alike): that attention stays
    # written out, its softmax one op
    before, after, counts = _transformer_rewrite(functools.partial(_llama, kind), dtype)
    lowered = dtype == torch.bfloat16
    assert before["softmax"] == 2 and after["softmax"] == (0 if lowered else 2), counts
    assert after["scaled_dot_product_attention"] == (2 if lowered else 0)
    assert after["rms_norm"] == 5 and after["rsqrt"] == 0, counts  # 2 per layer + the final one


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_t5_attention_with_a_position_bias_and_a_mask_becomes_sdpa(dtype):
    before, after, counts = _transformer_rewrite(_t5, dtype)
    assert counts.get("attention_scale_bias_mask") == 2, counts
    assert before["softmax"] == 2 and after["softmax"] == 0
    assert after["rms_norm"] == 5 and after["rsqrt"] == 0, counts


def test_float16_vit_attention_becomes_sdpa():
    # ViT's mask is where(arange >= 0, 0, finfo(float16).min): the condition holds
    # everywhere, so the mask is 0 and rounds the scores as sdpa does (mask_rounds_alike)
    before, after, counts = _transformer_rewrite(_vit, torch.float16)
    assert counts.get("softmax_upcast_fp16") == 2, counts
    assert after["softmax"] == 0 and after["scaled_dot_product_attention"] == 2


class _UpcastSoftmax(nn.Module):
    def forward(self, x):
        return F.softmax(x, -1, dtype=torch.float32).to(x.dtype)


def test_float64_softmax_computed_in_float32_stays():
    # the float32 round trip of a float64 tensor rounds: not a softmax of x
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    result = apply_checked(rule_set("rules/transformer.rw", "transformer"), export(_UpcastSoftmax(), (x,)), (x,))
    assert not result.counts.get("softmax_upcast_bf16") and not result.counts.get("softmax_upcast_fp16")
    assert ops(result.graph_module)["to"] == 1


# ---------------------------------------------------------------- classic CNNs, written here


def _random_bn(model):
    g = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            if m.running_mean is not None:
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
            if m.affine:
                m.weight.data.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.bias.data.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
    return model.eval()


def _cbr(ci, co, k=3, s=1, g=1):
    return nn.Sequential(nn.Conv2d(ci, co, k, s, k // 2, groups=g, bias=False), nn.BatchNorm2d(co),
                         nn.ReLU6(inplace=True))


class _InvertedResidual(nn.Module):
    def __init__(self, ci, co, s, t):
        super().__init__()
        self.res = s == 1 and ci == co
        self.conv = nn.Sequential(_cbr(ci, ci * t, 1), _cbr(ci * t, ci * t, 3, s, g=ci * t),
                                  nn.Conv2d(ci * t, co, 1, bias=False), nn.BatchNorm2d(co))

    def forward(self, x):
        return x + self.conv(x) if self.res else self.conv(x)


class MobileNetV2(nn.Module):
    FOLDABLE = 11

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(_cbr(3, 8, 3, 2), _InvertedResidual(8, 8, 1, 1), _InvertedResidual(8, 12, 2, 4),
                                      _InvertedResidual(12, 12, 1, 4), _cbr(12, 32, 1))
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(32, 10))

    def forward(self, x):
        return self.classifier(F.adaptive_avg_pool2d(self.features(x), 1).flatten(1))


class UNet(nn.Module):
    FOLDABLE = 7

    def __init__(self):
        super().__init__()

        def block(i, o):
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(inplace=True),
                                 nn.Conv2d(o, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True))

        self.down, self.mid = block(3, 8), block(8, 8)
        self.up = nn.ConvTranspose2d(8, 8, 2, stride=2)
        self.bn_up = nn.BatchNorm2d(8)
        self.out_block = block(16, 8)
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        a = self.down(x)
        m = self.bn_up(self.up(self.mid(F.max_pool2d(a, 2))))
        return self.head(self.out_block(torch.cat([m, a], 1)))


class Audio1d(nn.Module):
    FOLDABLE = 3

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv1d(1, 8, 9, stride=2, padding=4), nn.BatchNorm1d(8)
        self.c2, self.b2 = nn.Conv1d(8, 8, 3, padding=2, dilation=2, groups=4, bias=False), nn.BatchNorm1d(8)
        self.fc, self.bfc = nn.Linear(8, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        x = F.relu(self.b1(self.c1(x)))
        x = x + F.gelu(self.b2(self.c2(x)))
        return self.bfc(self.fc(x.mean(-1)))


class Net3d(nn.Module):
    FOLDABLE = 3

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv3d(2, 4, 3, padding=1), nn.BatchNorm3d(4)
        self.c2, self.b2 = nn.Conv3d(4, 4, (1, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1), bias=False), nn.BatchNorm3d(4)
        self.t, self.bt = nn.ConvTranspose3d(4, 2, 2, stride=2), nn.BatchNorm3d(2)

    def forward(self, x):
        return self.bt(self.t(F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))))))


class BatchNormVariants(nn.Module):
    """affine=False and momentum=None fold; without running statistics a BN uses the
    batch's own statistics, even in eval mode, and must stay."""

    FOLDABLE = 2

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4, affine=False)
        self.c2, self.b2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4, track_running_stats=False)
        self.c3, self.b3 = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4, momentum=None, eps=1e-3)

    def forward(self, x):
        return self.b3(self.c3(self.b2(self.c2(self.b1(self.c1(x))))))


CNNS = {"mobilenet_v2": (MobileNetV2, (2, 3, 32, 32)), "unet": (UNet, (2, 3, 16, 16)),
        "audio1d": (Audio1d, (2, 1, 64)), "net3d": (Net3d, (1, 2, 4, 8, 8)),
        "bn_variants": (BatchNormVariants, (2, 3, 8, 8))}


def _cnn(name, channels_last=False):
    cls, shape = CNNS[name]
    torch.manual_seed(0)
    model = _random_bn(cls())
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    return model, (x,)


def _capture(model, args, level):
    return torch.fx.symbolic_trace(model) if level == "fx" else export(model, args)


@pytest.mark.parametrize("name,level", [("mobilenet_v2", "export"), ("unet", "fx"), ("unet", "export"),
                                        ("audio1d", "fx"), ("audio1d", "export"), ("net3d", "export"),
                                        ("bn_variants", "fx"), ("bn_variants", "export")])
def test_fusion_folds_every_foldable_batch_norm(name, level):
    model, args = _cnn(name)
    gm = _capture(model, args, level)
    bns = count_batch_norms(gm)
    result = apply_checked(rule_set("rules/fusion.rw"), gm, args)
    folds = sum(n for rule, n in result.counts.items() if rule.endswith("_bn"))
    assert folds == CNNS[name][0].FOLDABLE, result.counts
    assert count_batch_norms(result.graph_module) == bns - folds
    with torch.no_grad():
        torch.testing.assert_close(result.graph_module(*args), model(*args), rtol=1e-3, atol=1e-4)


def test_a_channels_last_unet_fuses_and_lowers_keeping_its_layout():
    model, args = _cnn("unet", channels_last=True)
    gm = export(model, args)
    for path in ("rules/fusion.rw", "rules/amp_bf16.rw", "rules/cleanup.rw"):
        result = apply_checked(rule_set(path), gm, args)
        with torch.no_grad():
            want, got = gm(*args), result.graph_module(*args)
        if want.dim() == 4:
            assert got.is_contiguous(memory_format=torch.channels_last)
        tol = 3e-2 if "amp" in path else 1e-3
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_fusion_then_amp_on_a_unet_chain():
    model, args = _cnn("unet")
    gm = export(model, args)
    result = apply_checked(rule_set("rules/fusion.rw") + rule_set("rules/amp_bf16.rw"), gm, args)
    after = ops(result.graph_module)
    assert after["batch_norm"] == 0 and result.counts.get("conv_transpose_bf16") == 1, result.counts
    assert all(n.meta["val"].dtype == torch.bfloat16 for n in result.graph_module.graph.nodes
               if bind_node(n, result.graph_module) and bind_node(n, result.graph_module)[0].op == "conv"
               and "val" in n.meta)
