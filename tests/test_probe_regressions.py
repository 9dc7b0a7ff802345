"""Regressions found by adversarial probes (session 23), outside the check itself:

* where clauses: a tensor the model computes holds no value at match time
  (``c != 0`` is unknown);
* the caller's model: ``symbolic_trace`` adds no ``_tensor_constant``, ``save``
  keeps each submodule's own train/eval mode;
* facts: recorded from one apply's inputs, forgotten when it ends; recorded on
  copies laid out as the inputs (a sliced input is no contiguous one);
* analysis: no guard on a dynamic export's sizes, no fused attention fast path;
* the check runs a model holding ``torch.cond`` once an approximate rule fired;
* CLI: bad ``--max-examples`` and a model that cannot run on its own example
  inputs are usage errors.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch.export import Dim

import rewrite
import rewrite.capture
from rewrite.analysis import analyze

CLEANUP = "rules/cleanup.rw"
FUSION = "rules/fusion.rw"
FUSION_PATH = Path(__file__).resolve().parents[1] / "rules" / "fusion.rw"


# ---------------------------------------------------------------- where clauses


class _MulDiv(nn.Module):
    def forward(self, x, c):
        return (torch.tanh(x) * c) / c + 1


def test_a_graph_value_compared_with_a_literal_is_unknown():
    rules = rewrite.parse('rule cancel(tolerance="approx"): div(mul(x, c), c) where c != 0 and is_float(x) => x')
    x, c = torch.randn(4), torch.randn(4)
    result = rules.apply(fx.symbolic_trace(_MulDiv()), example_inputs=(x, c))
    assert result.counts == {}  # c's values are the model's business: c != 0 is not known
    for clause in ("c not in (0, 1)", "c > 0", "not (c == 0)"):
        rules = rewrite.parse(f'rule cancel(tolerance="approx"): div(mul(x, c), c) where {clause} => x')
        assert rules.apply(fx.symbolic_trace(_MulDiv()), example_inputs=(x, c), check=False).counts == {}, clause


def test_a_graph_value_equals_itself():
    rules = rewrite.parse("rule same(change=True): add(x, y) where x == y => mul(x, 2)")
    gm = fx.symbolic_trace(_Double())
    x = torch.randn(3)
    result = rules.apply(gm, example_inputs=(x,))
    assert result.counts == {"same": 1}
    torch.testing.assert_close(result.graph_module(x), x + x)
    assert rules.apply(fx.symbolic_trace(_MulDiv()), example_inputs=(x, x), check=False).counts == {}


class _Double(nn.Module):
    def forward(self, x):
        return x + x


# ---------------------------------------------------------------- the caller's model


MASK = torch.tensor([1.0, 0.0, 1.0])


class _Masked(nn.Module):
    def forward(self, x):
        return x * MASK * 1.0


def test_apply_on_a_module_adds_no_attribute_to_it():
    model = _Masked()
    before = set(vars(model))
    result = rewrite.parse("rule mul_one: mul(x, 1.0) => x").apply(model, example_inputs=(torch.randn(3),))
    assert result.counts == {"mul_one": 1}
    assert set(vars(model)) == before
    x = torch.randn(3)
    torch.testing.assert_close(result.graph_module(x), model(x))


class _ConvBn(nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.c(x))


def test_save_keeps_each_submodules_mode(tmp_path):
    model = _ConvBn().train()
    model.bn.eval()  # fine-tuning with frozen batch norms
    gm = fx.symbolic_trace(model)
    rewrite.capture.save(gm, str(tmp_path / "m.pt"), level="fx")
    assert model.training and not model.bn.training and not gm.bn.training
    loaded = torch.load(str(tmp_path / "m.pt"), weights_only=False)
    assert loaded.training and not loaded.bn.training


# ---------------------------------------------------------------- facts


class _Reshaped(nn.Module):
    def forward(self, x):
        return torch.sigmoid(x.reshape(2, -1)) * 1.0


@pytest.mark.parametrize("inplace", [False, True])
def test_facts_of_one_applys_inputs_do_not_reach_a_later_apply(inplace):
    cleanup = rewrite.load(CLEANUP)
    mul_one = rewrite.parse("rule m1: mul(x, 1.0) where is_float(x) => x")
    x_a, x_b = torch.randn(2, 6), torch.randn(3, 4)  # reshape(2, -1) is a no-op for x_a only
    gm = fx.symbolic_trace(_Reshaped())
    first = mul_one.apply(gm, example_inputs=(x_a,), inplace=inplace)
    assert first.counts == {"m1": 1}
    assert not any("rewrite_facts" in n.meta and "val" not in n.meta for n in first.graph_module.graph.nodes)
    second = cleanup.apply(first.graph_module, example_inputs=(x_b,))  # the default check passes
    assert "reshape_noop" not in second.counts
    torch.testing.assert_close(second.graph_module(x_b), _Reshaped()(x_b))


class _Cat(nn.Module):
    def forward(self, x):
        return torch.cat([x.unsqueeze(0)], 0).view(-1).sum(0, keepdim=True)


def test_facts_see_a_sliced_input_as_it_is():
    x = torch.randn(4, 8)[:, :4]  # strides (8, 1): not contiguous
    cleanup = rewrite.load(CLEANUP)
    result = cleanup.apply(fx.symbolic_trace(_Cat()), (x,), check=False)
    assert "cat_single" not in result.counts  # is_contiguous(x) is False for this input
    torch.testing.assert_close(result.graph_module(x), _Cat()(x))
    cleanup.apply(fx.symbolic_trace(_Cat()), (x,))  # and the default check passes


# ---------------------------------------------------------------- analysis


class _Sum(nn.Module):
    def forward(self, x):
        return x.sum(0)


def test_analyze_without_inputs_leaves_a_dynamic_export_dynamic():
    x = torch.randn(2, 6)
    gm = torch.export.export(_Sum(), (x,), dynamic_shapes={"x": {0: Dim("B", min=2, max=64)}}).module()
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder" and "val" in n.meta)
    before = str(placeholder.meta["val"].shape)
    analyze(gm)
    assert str(placeholder.meta["val"].shape) == before
    rules = rewrite.parse("rule r: sum(x, [0]) where shape(x)[0] == 2 => add(select(x, 0, 0), select(x, 0, 1))")
    assert rules.apply(gm, example_inputs=(x,)).counts == {}  # the batch is still symbolic


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

    def forward(self, x):
        return self.enc(x)


def test_analyze_counts_attention_modules_of_a_symbolic_trace():
    from torch.utils.flop_counter import FlopCounterMode

    model, x = _Encoder().eval(), torch.randn(2, 5, 16)
    with FlopCounterMode(display=False) as counter:
        model(x)
    flops = analyze(fx.symbolic_trace(model), (x,)).totals.flops
    assert flops == counter.get_total_flops() > 0


# ---------------------------------------------------------------- the check and torch.cond


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(3, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        y = self.bn(self.lin(x))
        return torch.cond(y.sum() > 0, lambda t: t * 2, lambda t: t * 3, (y,))


def test_the_check_runs_a_cond_once_an_approximate_rule_fired():
    x = torch.randn(2, 3)
    model = _Branchy().eval()
    gm = torch.export.export(model, (x,)).module()
    result = rewrite.load(FUSION).apply(gm, example_inputs=(x,))
    assert result.counts == {"linear_bn": 1} and result.equivalence.ok
    torch.testing.assert_close(result.graph_module(x), model(x))


# ---------------------------------------------------------------- CLI usage


def _cli(*argv: str, cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rewrite", *argv], cwd=cwd, capture_output=True, text=True)


def test_cli_max_examples_must_be_positive(tmp_path):
    (tmp_path / "r.rw").write_text("rule r: neg(neg(x)) => x\n")
    done = _cli("check", "--verify", "--max-examples", "0", "r.rw", cwd=str(tmp_path))
    assert done.returncode == 2 and "--max-examples: 0 is not a positive int" in done.stderr


def test_cli_model_that_cannot_run_on_its_example_inputs_is_a_usage_error(tmp_path):
    (tmp_path / "badmodels.py").write_text(
        "import torch\n"
        "def convbad():\n"
        "    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).eval()\n"
        "    return m, (torch.randn(1, 5, 8, 8),)\n"
        "def number():\n"
        "    return torch.nn.Linear(2, 2), 5\n")
    for argv in (("apply", str(FUSION_PATH), "--model", "badmodels:convbad"), ("stats", "--model", "badmodels:convbad"),
                 ("stats", "--model", "badmodels:number")):
        done = _cli(*argv, cwd=str(tmp_path))
        assert done.returncode == 2, (argv, done.stderr)
        assert "the model raised on its example inputs" in done.stderr and "internal error" not in done.stderr
        assert len([line for line in done.stderr.splitlines() if line.startswith("rewrite")]) == 1



# ---------------------------------------------------------------- layouts the graph records wrongly


class _ConvFlattenBn(nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.c(x).flatten(2))


@pytest.mark.parametrize("rules", [FUSION, "rules/amp_bf16.rw"])
def test_an_output_layout_the_fake_kernel_got_wrong_is_mended_at_the_output(rules):
    # torch's fake batch_norm lays out its output as its strided input; the CPU kernel
    # returns it contiguous: the layout restore trusted the record, the check caught it,
    # and the output is now copied into the original's format instead of rejected
    torch.manual_seed(0)
    model = _ConvFlattenBn().eval()
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    gm = torch.export.export(model, (x,)).module()
    result = rewrite.load(rules).apply(gm, example_inputs=(x,))
    assert result.counts and result.equivalence.ok
    out = result.graph_module(x)
    assert out.is_contiguous() and model(x).is_contiguous()
    torch.testing.assert_close(out, model(x), rtol=2e-2, atol=2e-2)
