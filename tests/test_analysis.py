"""rewrite.analysis: per-node FLOPs, bytes, shapes, memory; before/after; rewrite stats."""

from __future__ import annotations

import csv
import io
import json
import re

import pytest
import torch
import torch.fx as fx
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import rewrite
from rewrite.analysis import analyze, compare, module_path
from rewrite.capture import capture_with_inputs
from rewrite.cli import main
from rewrite.examples.cnn import resnet_tiny_with_inputs


def _eager_flops(model: nn.Module, inputs: tuple) -> int:
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(*inputs)
    return counter.get_total_flops()


class _Linear(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.fc = nn.Linear(cin, cout)

    def forward(self, x):
        return torch.relu(self.fc(x))


# ---------------------------------------------------------------- per node, by hand


def test_linear_node_by_hand():
    model = _Linear(8, 4).eval()
    x = torch.randn(2, 8)
    a = analyze(fx.symbolic_trace(model), (x,))
    fc = a["fc"]
    assert fc.op == "linear" and fc.shape == (2, 4) and fc.dtype == "float32"
    assert fc.flops == 2 * 2 * 8 * 4  # a multiply and an add per (row, in, out)
    assert fc.param_bytes == (8 * 4 + 4) * 4
    assert fc.bytes_read == 2 * 8 * 4 + (8 * 4 + 4) * 4  # input + weight + bias
    assert fc.bytes_written == 2 * 4 * 4
    assert fc.intensity == pytest.approx(128 / (208 + 32))
    relu = a["relu"]
    assert relu.flops == 0 and relu.elementwise == 8  # FlopCounterMode does not count relu
    assert relu.bytes_read == 32 and relu.bytes_written == 32
    assert a.totals.flops == _eager_flops(model, (x,))
    assert a.totals.param_bytes == (8 * 4 + 4) * 4


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 3), cin=st.integers(1, 6), cout=st.integers(1, 6), k=st.integers(1, 3),
       size=st.integers(3, 9), stride=st.integers(1, 2), level=st.sampled_from(["fx", "export"]))
def test_conv_flops_by_hand_and_flop_counter(n, cin, cout, k, size, stride, level):
    model = nn.Sequential(nn.Conv2d(cin, cout, k, stride=stride, bias=False)).eval()
    x = torch.randn(n, cin, size, size)
    gm, inputs = capture_with_inputs(model, (x,), level)
    a = analyze(gm, inputs)
    conv = next(r for r in a.nodes if r.op == "conv")
    out = (size - k) // stride + 1
    assert conv.shape == (n, cout, out, out)
    assert conv.flops == 2 * n * cout * out * out * cin * k * k
    assert conv.bytes_written == n * cout * out * out * 4
    assert conv.param_bytes == cout * cin * k * k * 4
    assert a.totals.flops == _eager_flops(model, (x,))


@pytest.mark.parametrize("level", ["fx", "export", "export_core", "dynamo"])
def test_totals_equal_flop_counter_mode_at_every_level(level):
    model, inputs = resnet_tiny_with_inputs()
    gm, args = capture_with_inputs(model, inputs, level)
    a = analyze(gm, args)
    assert a.totals.flops == _eager_flops(model, inputs)
    assert sum(r.flops for r in a.nodes) == a.totals.flops
    # the same parameters, whatever the level (dynamo lifts them to inputs)
    assert a.totals.param_bytes == pytest.approx(sum(p.numel() * 4 for p in model.state_dict().values()
                                                     if p.dtype == torch.float32), rel=1e-3)


def test_transformer_flops_equal_flop_counter_mode():
    hf = pytest.importorskip("rewrite.examples.hf")
    pytest.importorskip("transformers")
    model, inputs = hf.hf_bert()
    gm, args = capture_with_inputs(model, inputs, "export")
    a = analyze(gm, args)
    assert a.totals.flops == _eager_flops(model, inputs) > 0
    assert "linear" in {g.key for g in a.by_op() if g.flops}
    # on CPU, attention dispatches to _scaled_dot_product_flash_attention_for_cpu, which
    # FlopCounterMode's registry does not list: 0 FLOPs there, and so here (README)
    sdpa = [n for n in a.nodes if n.op == "scaled_dot_product_attention"]
    assert len(sdpa) == 2 and all(n.flops == 0 and n.elementwise > 0 for n in sdpa)


# ---------------------------------------------------------------- views, in place, memory


class _Chain(nn.Module):
    def forward(self, x):
        a = torch.sigmoid(x)
        v = a.view(-1)            # a view: no bytes, no memory
        b = v * 2
        c = b + 1
        return c


class _Branch(nn.Module):
    def forward(self, x):
        y1 = x * 2
        y2 = x * 3
        return y1 + y2


class _InPlace(nn.Module):
    def forward(self, x):
        y = x * 2
        return torch.relu_(y)


def test_views_move_nothing_and_peak_is_a_liveness_walk():
    x = torch.randn(4, 16)
    s = 4 * 16 * 4
    a = analyze(fx.symbolic_trace(_Chain()), (x,))
    view = a["view"]
    assert view.alias == "view" and view.bytes_read == view.bytes_written == 0 and view.elementwise == 0
    # sigmoid's output stays alive through its view until `mul` has read it: 2 buffers at once
    assert a.peak_bytes == 2 * s
    assert a.input_bytes == s
    b = analyze(fx.symbolic_trace(_Branch()), (x,))
    assert b.peak_bytes == 3 * s and b.peak_node == "add"  # y1, y2 and the sum


def test_inplace_writes_its_input():
    x = torch.randn(3, 5)
    a = analyze(fx.symbolic_trace(_InPlace()), (x,))
    relu = a["relu_"]
    assert relu.alias == "inplace"
    assert relu.bytes_written == 3 * 5 * 4
    assert a.peak_bytes == 3 * 5 * 4  # relu_ allocates nothing


def test_analyze_leaves_the_graph_alone_and_works_from_metadata():
    model, inputs = resnet_tiny_with_inputs()
    ep = torch.export.export(model, inputs, strict=False)
    gm = ep.module()
    code = gm.code
    from_meta = analyze(ep)  # inputs made from placeholder metadata
    given = analyze(gm, inputs)
    assert gm.code == code
    assert from_meta.totals == given.totals


def test_casts_and_int8_ops_are_counted():
    class Q(nn.Module):
        def forward(self, x):
            h = x.to(torch.float16).to(torch.float32)
            q = torch.quantize_per_tensor(h, 0.1, 0, torch.quint8)
            return q.dequantize()

    a = analyze(fx.symbolic_trace(Q()), (torch.randn(4, 4),))
    assert a.totals.casts == 2
    assert a.totals.int8_ops == 2  # quantize (writes int8) and dequantize (reads it)


# ---------------------------------------------------------------- roll-ups and plain data


def test_rollups_add_up_and_name_modules():
    model, inputs = resnet_tiny_with_inputs()
    a = analyze(fx.symbolic_trace(model), inputs)
    for groups in (a.by_op(), a.by_module(), a.by_module(depth=1)):
        assert sum(g.flops for g in groups) == a.totals.flops
        assert sum(g.bytes_written for g in groups) == a.totals.bytes_written
        assert sum(g.nodes for g in groups) == a.totals.nodes
    assert {"layer1", "layer2", "layer3", "layer4", "conv1", "fc"} <= {g.key for g in a.by_module(depth=1)}
    assert a.by_op()[0].key == "conv"  # most FLOPs first
    export = analyze(capture_with_inputs(model, inputs, "export")[0], inputs)
    assert {g.key: g.flops for g in export.by_module(depth=1)} == {g.key: g.flops for g in a.by_module(depth=1)}


def test_plain_data_round_trips():
    model, inputs = resnet_tiny_with_inputs()
    a = analyze(fx.symbolic_trace(model), inputs)
    data = json.loads(a.to_json())
    assert data["totals"]["flops"] == a.totals.flops
    assert [n["name"] for n in data["nodes"]] == [n.name for n in a.nodes]
    rows = list(csv.DictReader(io.StringIO(a.to_csv())))
    assert len(rows) == len(a.nodes)
    assert sum(int(r["flops"]) for r in rows) == a.totals.flops
    assert json.loads(rows[1]["shape"]) == list(a.nodes[1].shape)
    assert "conv" in a.table() and "layer1" in a.table(by="module")
    with pytest.raises(ValueError, match="by must be"):
        a.table(by="shape")


def test_module_path_spellings():
    node = fx.Graph().placeholder("x")
    for spelled, path in (("L['self'].layer1[0].conv1", "layer1.0.conv1"), ("layer2.1", "layer2.1"),
                          ("L['self']._modules['encoder'].layer[3]", "encoder.layer.3")):
        node.meta["nn_module_stack"] = {"k": (spelled, nn.Module)}
        assert module_path(node) == path


# ---------------------------------------------------------------- before / after


@pytest.mark.parametrize("level", ["fx", "export"])
def test_bn_fold_drops_exactly_the_batch_norms_share(level):
    model, inputs = resnet_tiny_with_inputs()
    gm, args = capture_with_inputs(model, inputs, level)
    result = rewrite.load("rules/fusion.rw").apply(gm, example_inputs=args)
    assert result.counts["conv_bn"] == 17
    torch.testing.assert_close(result.graph_module(*args), model(*inputs))
    report = result.report()
    before, after = report.before, report.after
    bns = [n for n in before.nodes if n.op == "batch_norm"]
    assert len(bns) == 17 and not [n for n in after.nodes if n.op == "batch_norm"]
    assert after.totals.flops == before.totals.flops  # the convs' FLOPs are unchanged by the fold
    assert report.delta("elementwise") == -sum(n.elementwise for n in bns)
    assert report.delta("bytes_written") == -sum(n.bytes_written for n in bns)
    assert report.op_changes()["batch_norm"] == (17, 0)
    created = [n for n in after.nodes if n.rule]
    assert created and {n.rule for n in created} == {"conv_bn"}
    assert all(re.fullmatch(r".*fusion\.rw:\d+:\d+", n.rule_at) for n in created)
    table = report.table()
    assert "FLOPs" in table and "batch_norm" in table
    assert report.to_dict()["rules"] == {"conv_bn": 17}


def test_compare_of_identical_graphs_is_all_equal():
    model, inputs = resnet_tiny_with_inputs()
    a = analyze(fx.symbolic_trace(model), inputs)
    c = compare(a, a)
    assert all(c.delta(f) == 0 for f in ("flops", "nodes", "peak_bytes"))
    assert not c.op_changes()


# ---------------------------------------------------------------- rewrite stats


_MODEL = "rewrite.examples.cnn:resnet_tiny_with_inputs"


def test_stats_json_schema(capsys):
    assert main(["stats", "--model", _MODEL, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"nodes", "totals", "peak_node", "input_bytes", "groups"}
    assert set(data["totals"]) == {"nodes", "flops", "elementwise", "bytes_read", "bytes_written", "param_bytes",
                                   "peak_bytes", "casts", "int8_ops", "intensity"}
    node = data["nodes"][1]
    assert set(node) >= {"name", "op", "module", "shape", "dtype", "flops", "bytes_read", "bytes_written",
                         "param_bytes", "intensity", "alias", "rule"}
    model, inputs = resnet_tiny_with_inputs()
    assert data["totals"]["flops"] == _eager_flops(model, inputs)


@pytest.mark.parametrize("by", ["module", "op"])
def test_stats_table_by(capsys, by):
    assert main(["stats", "--model", _MODEL, "--capture", "export", "--by", by]) == 0
    out = capsys.readouterr().out
    assert ("layer1" if by == "module" else "conv") in out and "peak activations" in out


def test_stats_bad_usage(capsys):
    assert main(["stats", "--model", "no_such_module:f"]) == 2
    assert "cannot load" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        main(["stats", "--model", _MODEL, "--by", "shape"])
    assert err.value.code == 2


def test_apply_report(capsys):
    code = main(["apply", "rules/fusion.rw", "--model", _MODEL, "--report"])
    assert code == 0
    out = capsys.readouterr().out
    assert "peak activations" in out and "elementwise ops" in out


# ---------------------------------------------------------------- progress


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_only_on_a_terminal():
    from rewrite.analysis.progress import progress

    quiet = _Stream(tty=False)
    bar = progress(10, "analyze", stream=quiet)
    bar.update(10)
    bar.close()
    assert quiet.getvalue() == ""
    tqdm = pytest.importorskip("tqdm")
    shown = progress(10, "analyze", stream=_Stream(tty=True))
    assert isinstance(shown, tqdm.tqdm)
    shown.close()
    assert not isinstance(progress(10, "analyze", enabled=False, stream=_Stream(tty=True)), tqdm.tqdm)


def test_apply_report_refuses_dynamo(capsys):
    assert main(["apply", "rules/fusion.rw", "--model", _MODEL, "--capture", "dynamo", "--report"]) == 2
    assert "--report needs --capture fx or export" in capsys.readouterr().err


def test_int8_kernels_keep_the_float_flops_and_quarter_the_weights():
    from rewrite.flows.quant import quantize

    model, inputs = resnet_tiny_with_inputs()
    calibration = [(torch.randn_like(inputs[0]),) for _ in range(2)]
    int8 = quantize(model, calibration, inputs, form="int8")
    before, after = analyze(fx.symbolic_trace(model), inputs), analyze(int8, inputs)
    assert after.totals.flops == before.totals.flops  # each int8 conv/linear counted as its float op
    convs = [n for n in after.nodes if n.op == "QuantizedConv"]
    assert len(convs) == 17 and all(n.flops > 0 and n.param_bytes > 0 for n in convs)
    float_weights = sum(p.numel() for name, p in model.named_parameters()
                        if name.endswith("weight") and p.dim() > 1)
    assert after.totals.param_bytes < before.totals.param_bytes / 3
    assert after.totals.param_bytes >= float_weights  # one byte per weight, plus biases
    assert after.totals.int8_ops >= 18


def test_amp_report_counts_the_casts_it_inserted():
    hf = pytest.importorskip("rewrite.examples.hf")
    pytest.importorskip("transformers")
    model, inputs = hf.hf_bert()
    gm, args = capture_with_inputs(model, inputs, "export")
    result = rewrite.load("rules/amp_fp16.rw").apply(gm, example_inputs=args, check=False)
    report = result.report()
    casts = [n for n in result.graph_module.graph.nodes if n.target == torch.ops.aten.to.dtype]
    assert report.after.totals.casts == len(casts) > 0 and report.before.totals.casts == 0
    assert report.after.totals.flops == report.before.totals.flops
    assert any(n.dtype == "float16" for n in report.after.nodes if n.op == "linear")
    assert report.delta("param_bytes") < 0  # weights stored in float16


def test_readme_samples(capsys):
    """The figures the README shows for resnet_tiny."""
    assert main(["stats", "--model", _MODEL, "--limit", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"conv1 +conv +2x8x16x16 +1\.20M +0 +29\.28k +16\.38k +4\.70k", out)
    assert ("nodes 55  FLOPs 2.93M  elementwise 53.50k  read 887.51 KiB  written 310.58 KiB  params 521.01 KiB  "
            "peak activations 48.00 KiB (at layer1_0_downsample_1)") in out
    assert main(["apply", "rules/fusion.rw", "--model", _MODEL, "--report"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"elementwise ops +53\.504k +27\.520k +-48\.6%", out)
    assert re.search(r"parameters +521\.01 KiB +506\.85 KiB +-2\.7%", out)


def test_analyze_leaves_a_dynamo_captures_lifted_state_alone():
    """dynamo passes the model's own parameters and buffers as inputs: a train-mode
    BatchNorm must not update the caller's running statistics."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)).train()
    x = torch.randn(2, 3, 6, 6)
    gm, inputs = capture_with_inputs(model, (x,), "dynamo")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    given = [t.clone() for t in inputs]
    a = analyze(gm, inputs)
    assert a.totals.flops > 0
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(t, g) for t, g in zip(inputs, given))


class _Cond(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        y = self.fc(x)
        return torch.cond(y.sum() > 1e9, lambda t: t @ self.w, lambda t: t.sin(), (y,)) * 2.0


def test_cond_counts_its_costlier_branch_as_flop_counter_mode_does():
    x = torch.randn(3, 4)
    gm = torch.export.export(_Cond().eval(), (x,)).module()
    a = analyze(gm, (x,))
    assert a.totals.flops == 2 * (2 * 3 * 4 * 4)  # the linear, and the matmul of the branch not taken
    assert main(["stats", "--model", "tests.test_analysis:_cond_with_inputs", "--capture", "export"]) == 0


def _cond_with_inputs():
    return _Cond().eval(), (torch.randn(3, 4),)


def test_int8_matmul_keeps_the_float_flops():
    import rewrite.quant as rq

    class Scores(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            return self.q(x) @ self.k(x).transpose(-1, -2)

    x = torch.randn(2, 8, 16)
    observed = rq.prepare(Scores().eval(), (x,))
    rq.calibrate(observed, [(torch.randn(2, 8, 16),) for _ in range(2)])
    int8 = rq.convert(observed)
    matmuls = [n for n in analyze(int8, (x,)).nodes if n.op == "QuantizedBinary"]
    assert len(matmuls) == 1 and matmuls[0].flops == 2 * 2 * 8 * 8 * 16
    assert analyze(int8, (x,)).totals.flops == analyze(observed, (x,)).totals.flops


@torch.library.custom_op("rwanalysis::opaque_mm", mutates_args=())
def _opaque_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


@_opaque_mm.register_fake
def _(a, b):
    return a.new_empty(a.shape[0], b.shape[1])


# probe AL F4: a custom op's kernel (a matmul here) was counted as 0 FLOPs without a word
@pytest.mark.parametrize("level", ["fx", "export"])
def test_a_custom_op_without_a_flop_formula_is_said_to_be_uncounted(level):
    class M(nn.Module):
        def forward(self, a, b):
            return torch.ops.rwanalysis.opaque_mm(a, b) + a @ b

    inputs = (torch.randn(8, 16), torch.randn(16, 4))
    gm, args = capture_with_inputs(M(), inputs, level)
    with pytest.warns(UserWarning, match="rwanalysis::opaque_mm has no FLOP formula"):
        analysis = analyze(gm, args)
    assert analysis.totals.flops == 2 * 8 * 16 * 4  # the visible matmul only
