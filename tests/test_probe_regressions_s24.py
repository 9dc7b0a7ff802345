"""Regressions found by adversarial probes in session 24 (helpers 52-54):

* apply's check leaves the caller's modules' Python attributes as they were (a
  forward hook caching features, a leaf module counting its calls);
* an all-zero float example (an RNN's h0) tells no sign: trials draw both;
* rules naming an embedding are compared on a backward pass (``padding_idx``,
  ``scale_grad_by_freq``, ``sparse`` change only gradients), by apply and verify;
* a parameter whose module is in training mode (symbolic_trace keeps the flags) is
  no constant: nothing folds it away from the caller's optimizer;
* transformer.rw's masked-attention rules leave masks of rank 0 or 1 alone (sdpa
  refuses them; the shipped rule set failed its own check).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.fx as fx
from torch import nn

import rewrite
from rewrite.trust.check import random_like

ROOT = Path(__file__).resolve().parents[1]
RELU_RELU = "rule relu_relu: relu(relu(_) as r) => r"


# ---------------------------------------------------------------- the caller's modules


class _Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(torch.relu(self.body(x)))


def test_a_hook_caching_features_sees_no_check_run():
    torch.manual_seed(0)
    gm = fx.symbolic_trace(_Body().eval())

    def cache(mod, inp, out):
        mod.last_features = out.detach().clone()
        mod.calls = getattr(mod, "calls", 0) + 1

    gm.body.register_forward_hook(cache)
    x = torch.randn(2, 4)
    gm(x)
    features, calls = gm.body.last_features, gm.body.calls
    result = rewrite.parse(RELU_RELU).apply(gm, example_inputs=(x,))
    assert result.counts == {"relu_relu": 1}
    assert gm.body.last_features is features and gm.body.calls == calls
    # the result's own modules run the hook as the caller's did
    torch.testing.assert_close(result.graph_module(x), gm(x))


class _Stream(nn.Module):
    def __init__(self):
        super().__init__()
        self.steps = 0
        self.last = None

    def forward(self, x):
        self.steps += 1
        self.last = x.detach()
        return x * 2


class _Streaming(nn.Module):
    def __init__(self):
        super().__init__()
        self.stream = _Stream()

    def forward(self, x):
        return torch.relu(torch.relu(self.stream(x)))


class _LeafTracer(fx.Tracer):
    def is_leaf_module(self, m, name):
        return isinstance(m, _Stream) or super().is_leaf_module(m, name)


@pytest.mark.parametrize("inplace", [False, True])
def test_a_leaf_modules_python_state_is_left_as_it_was(inplace):
    model = _Streaming()
    gm = fx.GraphModule(model, _LeafTracer().trace(model))
    x = torch.randn(3)
    gm(x)
    steps, last = gm.stream.steps, gm.stream.last
    result = rewrite.parse(RELU_RELU).apply(gm, example_inputs=(x,), inplace=inplace)
    assert result.counts == {"relu_relu": 1}
    assert gm.stream.steps == steps and gm.stream.last is last


# ---------------------------------------------------------------- trial inputs


def test_an_all_zero_float_example_gets_trials_of_both_signs():
    out = random_like(torch.zeros(200), torch.Generator().manual_seed(0))
    assert float(out.min()) < 0 < float(out.max())


class _Cell(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, h):
        return torch.tanh(self.lin(x) + torch.relu(h))


def test_a_rule_wrong_for_negative_state_is_caught_from_a_zero_state():
    torch.manual_seed(0)
    x, h0 = torch.randn(4, 8), torch.zeros(4, 8)
    gm = torch.export.export(_Cell().eval(), (x, h0)).module()
    with pytest.raises(rewrite.EquivalenceError, match="NOT equivalent"):
        rewrite.parse("rule wrong: relu(h) => clone(h)").apply(gm, example_inputs=(x, h0))


# ---------------------------------------------------------------- gradients


class _Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.lin = nn.Linear(4, 2)

    def forward(self, idx):
        return self.lin(self.emb(idx))


@pytest.mark.parametrize("replacement", ["embedding(i, w, 0)", "embedding(i, w, scale_grad_by_freq=True)"])
@pytest.mark.parametrize("capture", ["fx", "export"])
def test_embedding_rules_that_change_only_gradients_are_refused(replacement, capture):
    torch.manual_seed(0)
    model = _Embed().train()
    idx = torch.tensor([[0, 1, 1, 2, 0, 3, 9, 0]])
    gm = fx.symbolic_trace(model) if capture == "fx" else torch.export.export(model, (idx,)).module()
    with pytest.raises(rewrite.EquivalenceError, match="gradient"):
        rewrite.parse(f"rule wrong: embedding(i, w) => {replacement}").apply(gm, example_inputs=(idx,))


def test_verify_finds_an_embedding_rule_that_changes_only_gradients():
    rules = rewrite.parse("rule pad: embedding(i, w) => embedding(i, w, 0)\n"
                          "rule same: embedding(i, clone(w)) => embedding(i, w)\n")
    verdicts = rules.verify(max_examples=20, seed=0)
    assert verdicts["pad"].status == "counterexample" and "gradient" in str(verdicts["pad"])
    assert verdicts["same"].status == "ok"


# ---------------------------------------------------------------- training mode


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


def test_a_model_in_training_mode_keeps_training_its_parameters():
    torch.manual_seed(0)
    model = _MLP().train()
    x = torch.randn(8, 16)
    result = rewrite.load(str(ROOT / "rules" / "amp_bf16.rw")).apply(fx.symbolic_trace(model), example_inputs=(x,))
    result.graph_module(x).float().sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    # in eval mode the weights are constants: cast once
    evaluated = rewrite.load(str(ROOT / "rules" / "amp_bf16.rw")).apply(fx.symbolic_trace(_MLP().eval()),
                                                                       example_inputs=(x,))
    assert any("bf16" in name for name in evaluated.counts)


class _FrozenBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.bn = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.c(x))).mean((2, 3)))


def test_fine_tuning_around_a_frozen_batch_norm_does_not_fold_the_trained_conv():
    torch.manual_seed(0)
    model = _FrozenBN().train()
    model.bn.eval()
    x = torch.randn(2, 3, 16, 16)
    result = rewrite.load(str(ROOT / "rules" / "fusion.rw")).apply(fx.symbolic_trace(model), example_inputs=(x,))
    assert "conv_bn" not in result.counts
    result.graph_module(x).sum().backward()
    assert model.c.weight.grad is not None
    model.eval()
    folded = rewrite.load(str(ROOT / "rules" / "fusion.rw")).apply(fx.symbolic_trace(model), example_inputs=(x,))
    assert folded.counts.get("conv_bn") == 1


# ---------------------------------------------------------------- transformer.rw


class _Attention(nn.Module):
    """The mask a constant: a mask given as an input may hold -inf rows, which sdpa
    does not keep (tests/test_attention_masks.py)."""

    def __init__(self, m):
        super().__init__()
        self.register_buffer("m", m)

    def forward(self, q, k, v):
        a = torch.matmul(q, k.transpose(-2, -1)) * 0.25 + self.m
        return torch.matmul(torch.softmax(a, -1), v)


@pytest.mark.parametrize("mask_shape, fires", [((6,), False), ((), False), ((1, 6), True), ((1, 1, 4, 6), True)])
def test_masked_attention_rules_need_a_mask_sdpa_takes(mask_shape, fires):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    gm = torch.export.export(_Attention(torch.randn(mask_shape)), (q, k, v), strict=False).module()
    result = rewrite.load(str(ROOT / "rules" / "transformer.rw")).apply(gm, example_inputs=(q, k, v))
    assert bool(result.counts) == fires
    torch.testing.assert_close(result.graph_module(q, k, v), gm(q, k, v), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- language and CLI


def test_a_where_clause_that_is_the_literal_true_holds():
    gm = fx.symbolic_trace(_Body().eval())
    for clause in ("True", "not False", "True and rank(x) == 2"):
        rules = rewrite.parse(f"rule r: relu(relu(x)) where {clause} => relu(x)")
        assert rules.apply(gm, example_inputs=(torch.randn(2, 4),)).counts == {"r": 1}, clause
    assert rewrite.parse("rule r: relu(relu(x)) where False => relu(x)").apply(
        gm, example_inputs=(torch.randn(2, 4),)).counts == {}


def test_an_integer_literal_beyond_64_bits_is_a_load_error():
    with pytest.raises(rewrite.RuleError, match=r"E010.*|out of range") as err:
        rewrite.parse("rule r: relu(relu(x)) => add(relu(x), 99999999999999999999999)")
    assert "<string>:1:" in str(err.value) and "out of range" in str(err.value)
    rewrite.parse("rule r: add(x, -9223372036854775808) => x")  # int64's smallest still loads


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("body, message", [
    ("def f():\n    raise SystemExit(0)\n", "raised SystemExit"),
    ("raise ValueError('import boom')\ndef f():\n    pass\n", "ValueError while loading it"),
    ("def f(:\n", "SyntaxError while loading it"),
])
def test_a_model_module_that_exits_or_fails_on_import_is_a_one_line_error(tmp_path, monkeypatch, capsys, body,
                                                                          message):
    from rewrite.cli import main

    name = f"s24_model_{abs(hash(body)) % 10**8}"
    _write(tmp_path / f"{name}.py", body)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["apply", str(ROOT / "rules" / "fusion.rw"), "--model", f"{name}:f"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "internal error" not in err and "Traceback" not in err


def test_a_relative_model_module_is_a_one_line_error(capsys):
    from rewrite.cli import main

    code = main(["apply", str(ROOT / "rules" / "fusion.rw"), "--model", ".cnn:demo_cnn_with_inputs"])
    err = capsys.readouterr().err
    assert code == 2 and "absolute module path" in err and "internal error" not in err


def test_quantize_save_into_a_missing_folder_fails_before_any_work(tmp_path, capsys):
    from rewrite.cli import main

    code = main(["quantize", "--model", "rewrite.examples.cnn:demo_cnn_with_inputs",
                 "--save", str(tmp_path / "missing" / "int8.pt")])
    captured = capsys.readouterr()
    assert code == 2 and "does not exist" in captured.err and "internal error" not in captured.err
    assert "SQNR" not in captured.out  # nothing was quantized first


def test_parse_takes_text_with_a_byte_order_mark_as_load_does():
    assert list(rewrite.parse("\ufeffrule r: relu(relu(x)) => relu(x)").rules) == ["r"]


class _BiasedAttention(nn.Module):
    def __init__(self, b, m):
        super().__init__()
        self.register_buffer("b", b)
        self.register_buffer("m", m)

    def forward(self, q, k, v):
        a = torch.matmul(q, k.transpose(-2, -1)) * 0.25 + self.b + self.m
        return torch.matmul(torch.softmax(a, -1), v)


@pytest.mark.parametrize("bias_shape, mask_shape, fires", [
    ((1, 2, 4, 6), (1, 1, 1, 6), True),  # T5: a position bias, then the mask
    ((6,), (1, 6), True),  # a per-key bias before a mask sdpa takes: their sum has rank 2
    ((1, 2, 4, 6), (6,), False),  # the mask itself a per-key vector
])
def test_a_bias_then_a_mask_becomes_one_sdpa_mask_of_a_rank_it_takes(bias_shape, mask_shape, fires):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    model = _BiasedAttention(torch.randn(bias_shape), torch.randn(mask_shape))
    gm = torch.export.export(model, (q, k, v), strict=False).module()
    result = rewrite.load(str(ROOT / "rules" / "transformer.rw")).apply(gm, example_inputs=(q, k, v))
    assert ("attention_scale_bias_mask" in result.counts) == fires
    torch.testing.assert_close(result.graph_module(q, k, v), gm(q, k, v), rtol=1e-4, atol=1e-5)
