"""Regressions from session 29's probes: wrong rules that verified (probe D), and
files, figures and options that misled users (probe E). Each test failed before
its fix."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn as nn

import rewrite
from rewrite.analysis.measure import analyze
from rewrite.capture import SaveError, higher_order_ops, picklable, save
from rewrite.cli import main
from rewrite.trust.verify import verify_rule


def _verify(text: str, name: str, n: int = 20, seed: int = 1) -> str:
    return verify_rule(rewrite.parse(text, "probe.rw"), name, max_examples=n, seed=seed).status


# ---------------------------------------------------------------- verification draws


@pytest.mark.parametrize("name, text", [
    # dropout is the identity only when training=False (F.dropout's default is True)
    ("drop_any", "dropout(x, ...) => x"),
    # max(x, s * x) is leaky_relu only for s <= 1
    ("lrelu_max", "leaky_relu(x, s) where is_number(s) and s > 0 => aten.maximum(x, mul(x, s))"),
    # sum over [] is over every dim: the keepdim form squeezes none of them back
    ("sum_via_keepdim", "sum(x, d, False) => squeeze(sum(x, d, True), d)"),
    # halving an odd multiple of the smallest subnormal rounds
    ("half_twice", "mul(div(x, 2), 2) where is_float(x) => x"),
])
def test_wrong_rules_outside_the_old_draws_are_caught(name, text):
    assert _verify(f"rule {name}: {text}", name) == "counterexample"


def test_the_new_draws_keep_right_rules_right():
    for name, text in (("relu_clamp", "relu(x) => clamp(x, 0, None)"),
                       ("sum_empty", "sum(x, [], False) => sum(x)"),
                       ("div2_mul", "div(x, 2) => mul(x, 0.5)"),
                       ("dropout_eval", "dropout(x, _, training=False) => x")):
        assert _verify(f"rule {name}: {text}", name) == "ok", name


# ---------------------------------------------------------------- saving a .pt


class _Autocast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.l(x)
        return y.float() + 1


class _NoGrad(_Autocast):
    def forward(self, x):
        with torch.no_grad():
            y = self.l(x)
        return y + 1


@pytest.mark.parametrize("model, op", [(_Autocast, "wrap_with_autocast"), (_NoGrad, "wrap_with_set_grad_enabled")])
def test_a_pt_file_that_would_lose_a_higher_order_op_is_refused(tmp_path, model, op):
    # torch.load re-traces a saved GraphModule's code, which calls the region's
    # subgraph as a plain submodule: the file ran in float32 (or with gradients)
    x = torch.randn(4, 8)
    gm = torch.export.export(model().eval(), (x,), strict=False).module()
    assert higher_order_ops(gm) == [op]
    with pytest.raises(SaveError, match=op):
        save(gm, tmp_path / "m.pt", level="fx")
    assert not (tmp_path / "m.pt").exists()
    with pytest.raises(SaveError, match=r"\.pt2"):
        picklable(rewrite.load("rules/cleanup.rw").apply(gm, (x,)).graph_module)
    # .pt2 keeps it
    path = save(gm, tmp_path / "m.pt2", level="export", example_inputs=(x,))
    assert torch.equal(torch.export.load(str(path)).module()(x), gm(x))


def test_a_graph_without_higher_order_ops_still_saves(tmp_path):
    x = torch.randn(2, 8)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    path = save(torch.fx.symbolic_trace(model), tmp_path / "m.pt", level="fx")
    assert torch.equal(torch.load(path, weights_only=False)(x), model(x))


# ---------------------------------------------------------------- example inputs


def test_a_bare_tensor_is_one_input_everywhere():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    gm = torch.fx.symbolic_trace(model)
    x = torch.randn(4, 16)
    # it was iterated: analyze measured x[0] (a quarter of the FLOPs), apply kept 4 rows
    assert analyze(gm, x).totals.flops == analyze(gm, (x,)).totals.flops == 2 * 4 * (16 * 16 + 16 * 4)
    result = rewrite.load("rules/cleanup.rw").apply(model, example_inputs=x)
    assert len(result.example_inputs) == 1 and result.example_inputs[0] is x
    with pytest.raises(ValueError, match="3 inputs for a graph of 1"):
        analyze(gm, (x, x, x))


# ---------------------------------------------------------------- command-line counts


@pytest.mark.parametrize("argv", [
    ["quantize", "--model", "m:f", "--held-out", "0"],
    ["quantize", "--model", "m:f", "--calibration", "-2"],
    ["stats", "--model", "m:f", "--limit", "-1"],
    ["stats", "--model", "m:f", "--by", "module", "--depth", "-2"],
])
def test_counts_out_of_range_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert re.search(r"is not a (positive|non-negative) int", capsys.readouterr().err)


# ---------------------------------------------------------------- the backend and gradients


def test_the_backend_says_parameters_get_no_gradients():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=rewrite.backend(rewrite.load("rules/cleanup.rw")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(torch.randn(3, 4, requires_grad=True)).sum().backward()
    assert any("get none through it" in str(w.message) for w in caught)
    assert all(p.grad is None for p in model.parameters())
    torch._dynamo.reset()


# ---------------------------------------------------------------- the README's testing example


@pytest.mark.parametrize("seed", [18, 21])
def test_the_readme_conv_bn_example_holds_at_the_seeds_that_broke_it(seed):
    # with check=False, an instance graph records no strides: a fold of a batch norm
    # of a column-major input returned the conv's column-major output (the CPU batch
    # norm's is contiguous), and the README example failed at these seeds (~1 run in
    # 15); apply's check relays it out
    hyp = pytest.importorskip("hypothesis")
    from rewrite.testing import assert_equivalent, rule_instances

    rules = rewrite.load("rules/fusion.rw")

    @hyp.seed(seed)
    @hyp.settings(max_examples=25, deadline=None, database=None)
    @hyp.given(instance=rule_instances(rules, "conv_bn"))
    def check(instance):
        result = rules["conv_bn"].apply(instance.graph_module, instance.example_inputs)
        assert result.counts == {"conv_bn": 1}
        assert_equivalent(instance.graph_module, result.graph_module, instance.example_inputs)

    check()
