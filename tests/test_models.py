"""Fusion on whole models, at every capture level, including models we did not write.

For each model: (a) no foldable batch norm survives (and none at all where every
BN follows a conv), (b) the fused graph computes what the original computes on
fresh random inputs, (c) ``apply`` left its input GraphModule untouched, (d)
``result.counts`` reports one fold per removed batch norm.

Models marked ``slow`` take a few seconds each; ``-m "not slow"`` skips them.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import fx

import rewrite
from rewrite.trust.check import assert_equivalent
from rewrite.examples import capture_with_inputs
from rewrite.examples.cnn import DemoCNN, demo_cnn_with_inputs, resnet50_with_inputs, resnet_tiny_with_inputs
from rewrite.examples.graph_stats import count_batch_norms, count_foldable_batch_norms

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)


@pytest.fixture(scope="module")
def fusion():
    return rewrite.load("rules/fusion.rw")


def bn_folds(counts: dict) -> int:
    """Number of batch norms folded: the fusion rules that fold BN end in ``_bn``."""
    return sum(n for name, n in counts.items() if name.endswith("_bn"))


def snapshot(gm: fx.GraphModule):
    return (gm.code, str(gm.graph),
            {k: v.detach().clone() for k, v in gm.state_dict().items()})


def assert_unchanged(gm: fx.GraphModule, before) -> None:
    code, graph, state = before
    assert gm.code == code, "apply() changed its input's code"
    assert str(gm.graph) == graph, "apply() changed its input's graph"
    now = gm.state_dict()
    assert now.keys() == state.keys(), "apply() added or removed parameters/buffers of its input"
    for k, v in state.items():
        assert torch.equal(now[k], v), f"apply() changed {k} of its input"


def freeze_dynamo(gm: fx.GraphModule, inputs):
    """Dynamo lifts parameters to placeholders; freeze them (as the backend does) on a copy.

    Dynamo drops ``meta["grapharg"]`` after compiling; ``capture_dynamo`` kept its
    source as ``meta["dynamo_source"]``, from which we restore what the backend saw.
    """
    from types import SimpleNamespace

    from rewrite.flows.dynamo import freeze_parameters

    gm = copy.deepcopy(gm)
    for node in gm.graph.nodes:
        if node.op == "placeholder" and "grapharg" not in node.meta and "dynamo_source" in node.meta:
            node.meta["grapharg"] = SimpleNamespace(source=node.meta["dynamo_source"])
    _, kept = freeze_parameters(gm, list(inputs))
    return gm, tuple(kept)


def run_fusion(fusion, model, inputs, level, *, bn_left, folds):
    """Capture, fuse, and check (a)-(d). ``bn_left``: batch norms expected to remain."""
    gm, args = capture_with_inputs(model, inputs, level)
    if level == "dynamo":
        gm, args = freeze_dynamo(gm, args)
    bn_before = count_batch_norms(gm)
    before = snapshot(gm)

    result = fusion.apply(gm, example_inputs=args)
    fused = result.graph_module

    assert fused is not gm
    assert count_foldable_batch_norms(fused) == 0, fused.code
    assert count_batch_norms(fused) == bn_left
    assert bn_folds(result.counts) == bn_before - bn_left == folds, result.counts
    assert_unchanged(gm, before)
    # fresh random inputs (different seed from apply's own check), against the capture
    assert_equivalent(gm, fused, args, seed=1234, trials=3)
    if level != "dynamo":
        # and against the eager model, which also checks the capture itself
        assert_equivalent(model, fused, args, seed=4321, trials=2)
    return result


# ---------------------------------------------------------------- hand-written CNNs


@pytest.mark.parametrize("level", ["fx", "export", "export_core", "dynamo"])
def test_demo_cnn(fusion, level):
    model, inputs = demo_cnn_with_inputs()
    result = run_fusion(fusion, model, inputs, level,
                        bn_left=DemoCNN.UNFOLDABLE, folds=DemoCNN.FOLDABLE)
    assert result.counts.get("conv_bn") == 4
    assert result.counts.get("conv_transpose_bn") == 1
    # linear is addmm in core ATen
    assert result.counts.get("linear_bn", 0) + result.counts.get("addmm_bn", 0) == 1
    assert eval_noops(result.graph_module) == [], "dropout / identity left in an eval graph"


def eval_noops(gm: fx.GraphModule) -> list:
    """Dropout and identity nodes, which do nothing in eval mode, at any level."""
    found = []
    for n in gm.graph.nodes:
        if n.op == "call_module":
            if isinstance(gm.get_submodule(n.target), (torch.nn.Dropout, torch.nn.Identity)):
                found.append(n.name)
        elif n.op == "call_function" and n.target in (
                torch.nn.functional.dropout, torch.dropout, torch.ops.aten.dropout.default):
            found.append(n.name)
    return found


@pytest.mark.parametrize("level", ["fx", "export", "export_core", "dynamo"])
def test_resnet_tiny(fusion, level):
    model, inputs = resnet_tiny_with_inputs()
    result = run_fusion(fusion, model, inputs, level, bn_left=0, folds=17)
    assert result.counts.get("conv_bn") == 17


@pytest.mark.slow
def test_resnet50_symbolic_trace(fusion):
    model, inputs = resnet50_with_inputs(batch=1, size=64)
    result = run_fusion(fusion, model, inputs, "fx", bn_left=0, folds=53)
    assert result.counts.get("conv_bn") == 53


def test_apply_accepts_module_and_keeps_it(fusion):
    model, inputs = demo_cnn_with_inputs()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    result = fusion.apply(model, example_inputs=inputs)
    assert bn_folds(result.counts) == DemoCNN.FOLDABLE
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert not model.training


# ---------------------------------------------------------------- transformers models

HF_CASES = [
    # builder name, BN count (all follow a conv, so all must fold), slow
    ("hf_resnet", 16, False),
    ("hf_convnext", 0, False),
    ("hf_mobilenet_v2", 52, True),
    ("hf_bert", 0, False),
    ("hf_gpt2", 0, False),
]


@pytest.mark.parametrize(
    "name,bns",
    [pytest.param(n, b, id=n, marks=[pytest.mark.slow] if slow else []) for n, b, slow in HF_CASES],
)
def test_transformers_export(fusion, name, bns):
    pytest.importorskip("transformers")
    from rewrite.examples import hf

    model, inputs = hf.MODELS[name]()
    result = run_fusion(fusion, model, inputs, "export", bn_left=0, folds=bns)
    if bns:
        assert result.counts.get("conv_bn") == bns


# ---------------------------------------------------------------- torch.compile backend


@pytest.mark.parametrize("builder,folds", [(demo_cnn_with_inputs, DemoCNN.FOLDABLE),
                                           (resnet_tiny_with_inputs, 17)],
                         ids=["demo_cnn", "resnet_tiny"])
def test_torch_compile_backend(fusion, builder, folds):
    import torch._dynamo

    model, inputs = builder()
    results = []
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=rewrite.backend(fusion, on_result=results.append))
        with torch.no_grad():
            got = compiled(*inputs)
            want = model(*inputs)
        assert len(results) == 1, "expected one dynamo graph (no graph breaks)"
        assert bn_folds(results[0].counts) == folds
        assert count_foldable_batch_norms(results[0].graph_module) == 0
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
        # fresh inputs through the compiled function (same shapes: no recompile)
        assert_equivalent(model, compiled, inputs, seed=99, trials=3)
        assert len(results) == 1
    finally:
        torch._dynamo.reset()


# ---------------------------------------------------------------- capture helpers


@pytest.mark.parametrize("level", ["fx", "export", "export_core", "dynamo"])
def test_capture_levels_compute_the_model(level):
    from rewrite.capture import lifted_state_positions

    model, inputs = demo_cnn_with_inputs()
    gm, args = capture_with_inputs(model, inputs, level)
    assert isinstance(gm, fx.GraphModule)
    if level == "dynamo":
        fixed = lifted_state_positions(gm)
        assert len(fixed) == len(args) - 1  # everything but x is module state
        (xi,) = [i for i in range(len(args)) if i not in fixed]
        # the raw dynamo graph returns a 1-tuple and takes the state as inputs
        assert_equivalent(lambda *a: (model(a[xi]),), gm, args, fixed_inputs=fixed)
    else:
        assert_equivalent(model, gm, args)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_batch_norm_without_running_statistics_is_not_counted_foldable(capture):
    x = torch.randn(1, 3, 8, 8)
    for kwargs, expect in (({}, 1), ({"track_running_stats": False}, 0)):
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4, **kwargs)).eval()
        gm = torch.fx.symbolic_trace(model) if capture == "fx" else torch.export.export(model, (x,)).module()
        assert count_batch_norms(gm) == 1
        assert count_foldable_batch_norms(gm) == expect
