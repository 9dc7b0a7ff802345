"""Post-training static int8 quantization, built from rule files.

    import rewrite.quant as rq

    observed = rq.prepare(model, (x,))             # rules/fusion.rw, then rules/quant/observe.rw
    rq.calibrate(observed, batches)                 # observers record activation ranges
    int8 = rq.convert(observed)                     # quant/convert.rw (QDQ), quant/lower.rw (int8 kernels)
    print(rq.accuracy_report(observed, int8, held_out))   # per-layer and output SQNR
    print(rq.coverage(int8))                        # convs/linears in int8, and why others are not

    int8 = rq.quantize(model, batches)              # the same in one call

    qdq = rq.convert(observed, form="qdq")          # the PT2E form: quantized_decomposed ops
    rq.export(qdq, (x,), "model.pt2")               # torch.export, saved as .pt2
    rq.export_onnx(qdq, (x,), "model.onnx")         # QuantizeLinear/DequantizeLinear, for onnxruntime

Two forms of the same quantization (same points, parameters and int8 weights):
``form="int8"`` (the default) runs ``torch.ops.quantized`` kernels with prepacked
weights in eager; ``form="qdq"`` (``convert.rw``'s ruleset ``qdq``) writes the
representation the PyTorch 2 export ecosystem uses, ``torch.ops.quantized_decomposed``
quantize/dequantize pairs on plain uint8/int8 tensors around float ops, which
``torch.export`` captures and ``torch.onnx.export`` turns into QuantizeLinear /
DequantizeLinear pairs that onnxruntime (and TensorRT) fuse into int8 kernels.

Every step is a rule set (``rules/quant/*.rw``) applied with ``RuleSet.apply``; the
Python here captures the model, runs the rule sets in order, and does the two things
a rule cannot:

* **Reading an observer.** A replacement may pass constants and literals to
  rewrite-time functions, never a graph value, and an observer is a ``call_module``
  node. So ``convert`` first replaces each calibrated observer by the function it now
  stands for, ``fake_quantize_per_tensor_affine(x, scale, zero_point, qmin, qmax)``
  with literal parameters, and ``convert.rw`` turns those into quantize/dequantize
  pairs.
* **Sharing an observer.** Input rules observe a tensor per consumer (a replacement
  cannot name an existing node it did not match), so ``prepare`` merges observers
  that watch the same tensor with the same configuration.

Numerical checks: the rule sets that change numbers (convert, lower) run with
``check=False``; ``convert`` instead compares the lowered int8 model with the
reference QDQ model (``convert(..., lower=False)``) by SQNR and raises
``QuantizationError`` when they disagree. ``accuracy_report`` judges int8 against
fp32 by SQNR, per quantized tensor and per output. ``coverage`` counts the convs and
linears that run as int8 kernels and names every one left in float with the reason
(``convert`` records it, the accuracy report prints it).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import math
import operator
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Iterable, Sequence

import attrs
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from rewrite.capture import file_object_problem, file_problem, is_path
from rewrite.functions.quant import (
    DECOMPOSED_DEQUANTIZE,
    DECOMPOSED_QUANTIZE,
    QuantizedModule,
    is_dequantize,
    is_observer_node,
    is_quantize,
    module_path,
)
from rewrite.trust.rng import seeded
from rewrite.trust.modes import fake_mode_off, one_thread_at_a_time

__all__ = [
    "prepare", "calibrate", "convert", "quantize", "accuracy_report", "sqnr", "QuantizationError",
    "QuantPoint", "LayerSQNR", "AccuracyReport", "quant_rules", "quantize_command",
    "add_quantize_arguments", "save", "BACKENDS", "coverage", "Coverage", "FloatLayer", "FORMS",
    "export", "export_onnx", "run_onnx", "merge_duplicate_points", "record_shapes", "require_batches",
    "run_calibration_batch", "batch_failed",
]

BACKENDS = ("x86", "onednn", "fbgemm")
#: what ``convert`` emits: int8 kernels (eager) or the PT2E QDQ form (export, ONNX)
FORMS = ("int8", "qdq")
_META = "rewrite.quant"
_MARK = "rewrite.quant.observer"  # source_fn_stack entry: (observer name, _MARK)


def _observer_of(node: fx.Node) -> str | None:
    """The observer a node's value stands for (see ``_freeze_observers``), or None."""
    for entry in reversed(node.meta.get("source_fn_stack") or ()):
        if isinstance(entry, tuple) and len(entry) == 2 and entry[1] == _MARK:
            return entry[0]
    return None


class QuantizationError(RuntimeError):
    """Quantization could not proceed (no calibration data) or the lowered int8
    model disagrees with its reference QDQ model."""


@attrs.frozen
class QuantPoint:
    """A tensor the model quantizes: the observer that watched it, the layer and op
    that compute it, and its calibrated parameters."""

    observer: str
    layer: str
    op: str
    scale: float
    zero_point: int
    dtype: Any


# ---------------------------------------------------------------- rule files


def _quant_dir() -> Path:
    import rewrite

    return rewrite.rules_dir() / "quant"


@functools.lru_cache(maxsize=None)
def _load(path: str) -> Any:
    import rewrite

    return rewrite.load(path)


def quant_rules(name: str, ruleset: str | None = None) -> Any:
    """A shipped rule file of ``rules/quant/`` (``"observe"``, ``"convert"``,
    ``"lower"``), or the ``ruleset`` declared in it."""
    rules = _load(str(_quant_dir() / f"{name}.rw"))
    return rules[ruleset] if ruleset else rules


def _as_rules(rules: Any, default: str, ruleset: str | None = None) -> Any:
    import rewrite

    if rules is None:
        return quant_rules(default, ruleset)
    if isinstance(rules, (str, Path)):
        loaded = rewrite.load(rules)
        return loaded[ruleset] if ruleset and ruleset in loaded.sets else loaded
    return rules


# ---------------------------------------------------------------- helpers


def _set_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend not in torch.backends.quantized.supported_engines:
        raise QuantizationError(f"this torch build has no {backend!r} quantized engine")
    torch.backends.quantized.engine = backend


def _as_args(batch: Any) -> tuple:
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


def _capture(model: Any, example_inputs: tuple, capture: str) -> fx.GraphModule:
    from rewrite.capture import capture as capture_at

    if isinstance(model, torch.export.ExportedProgram):
        model = model.module()  # the module it runs as, as RuleSet.apply takes it
    if isinstance(model, fx.GraphModule):
        return model
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"quantization takes an nn.Module, a GraphModule or an ExportedProgram, not "
                        f"{type(model).__name__}")
    if capture not in ("fx", "export"):
        raise ValueError(f"capture must be 'fx' or 'export', got {capture!r}")
    if any(m.training for m in model.modules()):
        # quantization captures eval mode; the caller's model keeps its own mode (a
        # symbolic_trace graph shares submodules with it, so flipping them back after
        # the capture would flip the graph too): capture an eval-mode copy
        model = copy.deepcopy(model).eval()
    gm = capture_at(model, example_inputs, capture)
    if capture == "fx":  # fx records one path through the forward's Python: the inputs' own?
        from rewrite.ruleset import confirm_capture

        confirm_capture(model, gm, example_inputs)
    return gm


def record_shapes(gm: fx.GraphModule, args: tuple) -> None:
    """Give every node shape facts (``meta["tensor_meta"]``) by running the example
    inputs once. The observe rules ask ``activation(x)`` everywhere, and a graph
    that an earlier rule set rewrote records facts only on the nodes it created
    (the engine then no longer records the rest from the example inputs)."""
    from torch.fx.passes.shape_prop import ShapeProp
    from rewrite.trust.check import preserved_state
    from rewrite.trust.rng import seeded

    # a run for facts only: the caller's inputs, the model's state (a buffer the
    # forward updates, shared with the caller's model) and random stream (a train-mode
    # dropout draws) are left as they were
    args = pytree.tree_map_only(torch.Tensor, lambda t: t.clone(), args)
    with torch.no_grad(), preserved_state(gm, runs_only=True), seeded(0):
        ShapeProp(gm).propagate(*args)


def _observer_config(mod: Any) -> tuple:
    return (type(mod), getattr(mod, "dtype", None), getattr(mod, "qscheme", None),
            getattr(mod, "reduce_range", None), getattr(mod, "quant_min", None),
            getattr(mod, "quant_max", None), getattr(mod, "bins", None))


def merge_duplicate_points(gm: fx.GraphModule, is_point: Any, config: Any) -> int:
    """One quantization point per tensor: a point module (``is_point(node, gm)``:
    an observer, a fake quantizer) that watches the same value as an earlier one
    with the same ``config(module)``, or watches such a point's output, is replaced
    by it. Returns how many were merged."""
    merged = 0
    first: dict = {}
    for node in list(gm.graph.nodes):
        if not is_point(node, gm):
            continue
        key = config(gm.get_submodule(node.target))
        src = node.args[0]
        if is_point(src, gm) and config(gm.get_submodule(src.target)) == key:
            keep = src
        else:
            keep = first.get((src, key))
        if keep is None:
            first[(src, key)] = node
            continue
        node.replace_all_uses_with(keep)
        gm.graph.erase_node(node)
        merged += 1
    if merged:
        gm.delete_all_unused_submodules()
        gm.graph.lint()
        gm.recompile()
    return merged


def _merge_observers(gm: fx.GraphModule) -> int:
    """One observer per tensor (see ``merge_duplicate_points``)."""
    return merge_duplicate_points(gm, is_observer_node, _observer_config)


def _reset_observer(mod: Any) -> None:
    """Forget what an observer saw (the equivalence check ran random inputs through it)."""
    if hasattr(mod, "histogram"):
        mod.histogram = torch.zeros_like(mod.histogram)
        mod.min_val = torch.tensor(float("inf"))
        mod.max_val = torch.tensor(float("-inf"))
        return
    try:
        mod.reset_min_max_vals()
    except NotImplementedError:
        pass


def _observers(gm: fx.GraphModule) -> list:
    return [n for n in gm.graph.nodes if is_observer_node(n, gm)]


def _const_name(operand: Any) -> str | None:
    from rewrite.ops.base import ConstRef

    if isinstance(operand, ConstRef):
        return operand.qualname
    if isinstance(operand, fx.Node) and operand.op == "get_attr":
        return str(operand.target)
    return None


def _layer_of_weight(qualname: str, node: fx.Node) -> str:
    """The dotted module path of a conv/linear from its weight's attribute name:
    ``layer1.0.conv1.weight``, or a folded weight ``layer1_0_conv1_weight_conv_bn_weight``
    matched against the node's ``nn_module_stack`` (which names the batch norm)."""
    if qualname.endswith(".weight"):
        return qualname[: -len(".weight")]
    cut = qualname.find("_weight")
    flat = qualname[:cut] if cut > 0 else qualname
    path = module_path(node) or ""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:i])
        prefix = parent.replace(".", "_") + "_"
        if flat.startswith(prefix):
            return parent + "." + flat[len(prefix):]
    return flat


def _describe(node: Any, gm: fx.GraphModule) -> tuple:
    """(layer, op) of the value an observer watches, for the accuracy report."""
    from rewrite.ops import bind_node

    if not isinstance(node, fx.Node):
        return ("?", "?")
    if node.op == "placeholder":
        return (node.name, "input")
    bound = {b.op: b for b in bind_node(node, gm)} if node.op.startswith("call_") else {}
    act = next((op for op in ("relu", "relu6", "hardtanh") if op in bound), None)
    if act is not None:
        inner = bound[act].args.get("input")
        inner_layer, inner_op = _describe(inner, gm)
        if inner_op in ("conv", "linear", "add", "mul"):
            return (inner_layer, f"{inner_op}+{act}")
    for op in ("conv", "linear"):
        if op in bound:
            name = _const_name(bound[op].args.get("weight"))
            return (_layer_of_weight(name, node) if name else (module_path(node) or node.name), op)
    op = next(iter(bound), None) or str(getattr(node.target, "__name__", node.target))
    return (module_path(node) or node.name, op)


def _qparams(mod: Any, name: str) -> tuple:
    """(scale, zero_point) an observer computes; remembered on the observer until it
    sees more data (HistogramObserver's range search is convert's slowest step)."""
    low, high = getattr(mod, "min_val", torch.tensor(0.0)), getattr(mod, "max_val", torch.tensor(0.0))
    if low.isnan().any() or high.isnan().any():
        raise QuantizationError(
            f"observer {name!r} saw NaN values: a calibration batch (or the model on it) has NaNs")
    if not torch.isfinite(low).all():
        raise QuantizationError(
            f"observer {name!r} saw no data, or only NaN and infinite values: run calibration batches "
            "(finite ones) through the prepared model before convert()")
    if mod.qscheme not in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        raise QuantizationError(f"observer {name!r}: activations are quantized per tensor only")
    state = tuple(float(t.double().sum()) for t in (mod.min_val, mod.max_val, getattr(mod, "histogram", mod.min_val)))
    cached = getattr(mod, "_rewrite_qparams", None)
    if cached is not None and cached[0] == state:
        return cached[1]
    scale, zero_point = mod.calculate_qparams()
    result = (float(scale.reshape(-1)[0]), int(zero_point.reshape(-1)[0]))
    mod._rewrite_qparams = (state, result)
    return result


def _freeze_observers(gm: fx.GraphModule, qparams: dict) -> list:
    """Replace each calibrated observer by ``fake_quantize_per_tensor_affine`` with
    its parameters (``qparams``: observer name -> (scale, zero point)) as literals,
    what convert.rw matches. Returns the QuantPoints."""
    from rewrite.ops import detect_dialect

    aten = detect_dialect(gm) == "aten"
    target = torch.ops.aten.fake_quantize_per_tensor_affine.default if aten else torch.fake_quantize_per_tensor_affine
    points = []
    for node in _observers(gm):
        mod = gm.get_submodule(node.target)
        scale, zero_point = qparams[str(node.target)]
        info = torch.iinfo(mod.dtype)
        src = node.args[0]
        layer, op = _describe(src, gm)
        points.append(QuantPoint(str(node.target), layer, op, scale, zero_point, mod.dtype))
        with gm.graph.inserting_before(node):
            fq = gm.graph.call_function(target, (src, scale, zero_point, info.min, info.max))
        fq.meta.update({k: v for k, v in node.meta.items() if k != "rewrite_facts"})
        # provenance: rewrites carry source_fn_stack from the node they replace to the
        # nodes they create, so the int8 kernel writing this tensor will say which
        # observer it stands for (module names, accuracy report)
        fq.meta["source_fn_stack"] = list(node.meta.get("source_fn_stack", [])) + [(str(node.target), _MARK)]
        node.replace_all_uses_with(fq)
        gm.graph.erase_node(node)
    gm.delete_all_unused_submodules()
    gm.graph.lint()
    gm.recompile()
    return points


def _name_int8_modules(gm: fx.GraphModule, points: list) -> None:
    """Name each int8 module after the layer whose output it writes:
    ``quantized_conv_quantize_per_tensor_3`` becomes ``layer1_0_conv1_conv_relu``."""
    import re

    by_observer = {p.observer: p for p in points}
    taken = {name for name, _ in gm.named_modules()}
    changed = False
    for node in gm.graph.nodes:
        if node.op != "call_module" or not isinstance(gm.get_submodule(node.target), QuantizedModule):
            continue
        point = by_observer.get(_observer_of(node))
        if point is None:
            continue
        base = re.sub(r"\W", "_", f"{point.layer}_{point.op}")
        name, i = base, 1
        while name in taken:
            name, i = f"{base}_{i}", i + 1
        taken.add(name)
        mod = gm.get_submodule(node.target)
        gm.delete_submodule(str(node.target))
        gm.add_submodule(name, mod)
        node.target = name
        if hasattr(node, "_rename"):  # the value's name in the generated code too
            node._rename(name)
        changed = True
    if changed:
        gm.recompile()


# ---------------------------------------------------------------- API


@one_thread_at_a_time()
@fake_mode_off()
def prepare(
    model: Any,
    example_inputs: Any,
    *,
    backend: str = "x86",
    capture: str = "fx",
    observe: Any = None,
    ruleset: str | None = None,
    fuse: bool = True,
    check: bool = True,
    input_ranges: dict | None = None,
    fixed_inputs: tuple = (),
) -> fx.GraphModule:
    """Capture ``model``, fold batch norms (``rules/fusion.rw``) and insert observers
    (``rules/quant/observe.rw``).

    Args:
        model: an ``nn.Module`` (captured with ``capture``) or a ``GraphModule``
            (from ``torch.fx.symbolic_trace`` or ``torch.export.export(...).module()``).
        example_inputs: a tuple of inputs (or one tensor).
        backend: ``"x86"`` (fbgemm and onednn kernels), ``"onednn"`` or ``"fbgemm"``:
            sets ``torch.backends.quantized.engine``, which prepacks the weights.
        capture: ``"fx"`` (symbolic_trace) or ``"export"`` (``torch.export``, non-strict).
        observe: your own observe rule file (path or RuleSet) instead of the shipped one.
        ruleset: which ruleset of the observe file: ``"main"`` (conv, linear, add,
            mul, cat, matmul), ``"onednn"`` (the same, leaving the conv before a
            residual add unobserved: onednn computes conv + add in one kernel) or
            ``"linear"`` (linear layers only: transformers). Default: ``"onednn"``
            for the onednn backend, else ``"main"``.
        fuse: run ``rules/fusion.rw`` first.
        check: check the fused and observed graphs against the model (the
            observers are reset afterwards, so the check calibrates nothing).
        input_ranges, fixed_inputs: for that check's random trials, as ``apply``
            takes them: inputs the model accepts only some values of (an
            ``EmbeddingBag``'s offsets: ``fixed_inputs=[1]``).

    Returns:
        The observed GraphModule. Run calibration batches through it
        (``calibrate``), then ``convert`` it.
    """
    import rewrite

    _refuse_flow_output(model, "prepare")
    _set_backend(backend)
    if ruleset is None:
        ruleset = "onednn" if backend == "onednn" else "main"
    args = _as_args(example_inputs)
    gm = _capture(model, args, capture)
    # quantization makes an inference model: the weights are read as constants (folded,
    # observed, then rounded), whatever mode an exported graph's module reports
    if fuse:
        gm = rewrite.load(rewrite.rules_dir() / "fusion.rw").apply(
            gm, args, check=check, training=False, input_ranges=input_ranges, fixed_inputs=fixed_inputs).graph_module
    elif gm is model:  # the shape facts go on a copy: the caller's graph is left as it was
        from rewrite.engine.workspace import shared_copy

        gm = shared_copy(gm)
    record_shapes(gm, args)
    result = _as_rules(observe, "observe", ruleset).apply(gm, args, check=check, trials=1, training=False,
                                                          input_ranges=input_ranges, fixed_inputs=fixed_inputs)
    observed = result.graph_module
    merged = _merge_observers(observed)
    for node in _observers(observed):
        _reset_observer(observed.get_submodule(node.target))
    observed.meta[_META] = {
        "backend": backend, "ruleset": ruleset, "example_inputs": args, "observe_counts": dict(result.counts),
        "merged_observers": merged,
    }
    return observed


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _refuse_flow_output(model: Any, step: str) -> None:
    """``step`` takes a float model: one ``prepare`` or ``convert`` made already would
    be observed twice, or its int8 kernels observed as float layers."""
    if not isinstance(model, fx.GraphModule):
        return
    state = getattr(model, "meta", {}).get(_META)
    made = None if state is None else \
        "converted (an int8 or QDQ model)" if "points" in state else "prepared (an observed model)"
    if made is None and _qat_nodes(model):
        made = "prepared for QAT (prepare_qat's model: convert it with rewrite.qat.convert)"
    if made is not None:
        raise TypeError(f"{step} takes a float model; this one is already {made}: pass the model it was made from")


def _qat_nodes(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` runs fake quantizers or QAT layers (``prepare_qat``'s model)."""
    from rewrite.functions.qat import is_fake_quant_node, is_qat_layer_node

    return any(is_fake_quant_node(n, gm) or is_qat_layer_node(n, gm) for n in gm.graph.find_nodes(op="call_module"))


def _require_converted(int8: Any, step: str) -> None:
    """``step`` takes a GraphModule; not a plain module nor an observed one."""
    if not isinstance(int8, fx.GraphModule):
        raise TypeError(f"{step} takes the int8 GraphModule that convert() or quantize() returned, "
                        f"not {type(int8).__name__}")
    if _observers(int8):
        raise TypeError(f"{step} takes the int8 model convert() returned, not the observed model prepare() "
                        "returned (its observers are still in)")
    if _qat_nodes(int8):
        raise TypeError(f"{step} takes the int8 model convert() returned, not the QAT model prepare_qat() "
                        "returned (convert it with rewrite.qat.convert first)")


def _require_prepared(observed: Any, step: str) -> None:
    """``step`` takes the GraphModule ``prepare`` returned (its metadata says what it observes)."""
    if not isinstance(observed, fx.GraphModule) or _META not in getattr(observed, "meta", {}):
        raise TypeError(f"{step} takes the observed GraphModule that prepare() returned, "
                        f"not {type(observed).__name__}: observed = rewrite.quant.prepare(model, example_inputs)")


def require_batches(batches: Any, step: str) -> None:
    """Batches are an iterable of batches; one tensor would be iterated along its first dim."""
    if isinstance(batches, torch.Tensor):
        raise TypeError(f"{step} takes an iterable of batches (each a tensor or a tuple of inputs), not one "
                        f"tensor: pass [x]")


@one_thread_at_a_time()
@fake_mode_off()
def calibrate(observed: fx.GraphModule, batches: Iterable) -> int:
    """Run ``batches`` (each a tensor or a tuple of inputs) through the observed
    model so its observers record activation ranges (each on copies: a model that
    writes its input leaves the caller's batches as they were; a train-mode dropout
    draws from a fork of the caller's random stream, left as it was). Returns the
    number of batches."""
    _require_prepared(observed, "calibrate")
    require_batches(batches, "calibrate")
    n = 0
    with torch.no_grad(), torch.random.fork_rng(devices=[]), model_state_kept(
            observed, [observed.get_submodule(node.target) for node in _observers(observed)]):
        for batch in batches:
            run_calibration_batch(observed, _clones(_as_args(batch)), n)
            n += 1
    return n


@contextlib.contextmanager
def model_state_kept(gm: fx.GraphModule, observers: Iterable[torch.nn.Module]) -> Any:
    """Calibration observes; only ``observers`` (and what they hold) may keep what
    the batches wrote. Every other state tensor the forward writes in place (a step
    counter, a cache position) is put back afterwards: the converted model starts
    where the caller's model was, not three batches on."""
    from rewrite.module_state import TensorValues

    kept = {id(m) for o in observers for m in o.modules()}
    values = TensorValues(m for m in gm.modules() if id(m) not in kept)
    try:
        yield
    finally:
        values.restore()


def run_calibration_batch(model: Any, args: tuple, n: int, error: type = None) -> Any:
    """``model(*args)`` for calibration batch ``n``; a batch whose shapes an export
    capture did not allow is an ``error`` (``QuantizationError``) naming torch's
    guard, not its ``AssertionError``."""
    try:
        return model(*args)
    except AssertionError as err:
        if "Guard failed" not in str(err):
            raise batch_failed("calibration", n, err, error) from err
        raise (error or QuantizationError)(
            f"calibration batch {n} does not fit the shapes torch.export captured the model with "
            f"({_first_line(err)}): calibrate with batches shaped like the example inputs, or prepare "
            "with capture='fx'") from err
    except Exception as err:  # noqa: BLE001 - the model's own error on this batch, named
        raise batch_failed("calibration", n, err, error) from err


def batch_failed(kind: str, n: int, err: BaseException, error: type = None) -> Exception:
    """The library's error for a batch the model raised on (a wrong shape or dtype):
    which batch, and torch's first line."""
    return (error or QuantizationError)(
        f"{kind} batch {n} failed in the model: {type(err).__name__}: {_first_line(err)} (give batches shaped "
        "and typed like the example inputs)")


@one_thread_at_a_time()
@fake_mode_off()
def convert(
    observed: fx.GraphModule,
    *,
    lower: bool = True,
    check: bool = True,
    convert_rules: Any = None,
    lower_rules: Any = None,
    min_qdq_sqnr: float = 25.0,
    reference: bool = False,
    form: str = "int8",
) -> Any:
    """Turn a calibrated observed model into an int8 model.

    Steps: calibrated observers become fake-quant functions (see the module doc),
    ``rules/quant/convert.rw`` makes the reference QDQ model, ``rules/quant/lower.rw``
    rewrites QDQ patterns into ``torch.ops.quantized`` kernels with prepacked weights.

    Args:
        observed: what ``prepare`` returned, after calibration (not modified).
        lower: False returns the reference QDQ model (float kernels, int8 rounding).
        check: compare the int8 model with the QDQ model on the example inputs;
            raise ``QuantizationError`` when their SQNR is below ``min_qdq_sqnr`` dB.
        convert_rules, lower_rules: your own rule files (path or RuleSet).
        reference: also return the reference QDQ model: ``(int8, qdq)``.
        form: ``"int8"`` (int8 kernels, the steps above) or ``"qdq"``: the PT2E
            form (``convert.rw``'s ruleset ``qdq``: ``quantized_decomposed``
            quantize/dequantize on plain uint8/int8 tensors, int8 weights as
            constants with per-channel scales; nothing lowered), which
            ``export`` and ``export_onnx`` take. ``check`` then compares it with
            the reference QDQ model, ``lower`` and ``lower_rules`` do not apply.

    Returns:
        A GraphModule; ``gm.meta["rewrite.quant"]`` holds the quantization points,
        rule counts, the ``coverage`` (convs and linears lowered to int8, and those
        left in float with the reason) and the QDQ-vs-int8 SQNR when checked.
    """
    _require_prepared(observed, "convert")
    state = dict(observed.meta.get(_META, {}))
    backend = state.get("backend", torch.backends.quantized.engine)
    _set_backend(backend)
    args = state.get("example_inputs")
    qparams = {str(n.target): _qparams(observed.get_submodule(n.target), str(n.target)) for n in _observers(observed)}
    gm = copy.deepcopy(observed)
    # an inference model: new constants derived from parameters (the int8 weights)
    # would otherwise inherit requires_grad, which int8 tensors cannot have
    gm.requires_grad_(False)
    points = _freeze_observers(gm, qparams)
    if form not in FORMS:
        raise ValueError(f"unknown form {form!r}; expected one of {FORMS}")
    if form == "qdq":
        return _convert_pt2e(gm, args, state, points, convert_rules, check, min_qdq_sqnr)
    qdq_result = _as_rules(convert_rules, "convert").apply(gm, args, check=False)
    qdq = qdq_result.graph_module
    state.update(points=points, convert_counts=dict(qdq_result.counts))
    if not lower:
        qdq.meta[_META] = state
        return qdq
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that quantized dtypes are deprecated
        low_result = _as_rules(lower_rules, "lower").apply(qdq, args, check=False)
    int8 = low_result.graph_module
    if check and args is not None:
        try:
            with torch.no_grad(), _checking(qdq, int8):
                ref, out = _runs_alike(qdq, int8, args)
        except Exception:  # noqa: BLE001 - a lowering the model cannot run: found and left out below
            low_result, int8 = _lower_what_runs(qdq, args, lower_rules)
            with torch.no_grad(), _checking(qdq, int8):
                ref, out = _runs_alike(qdq, int8, args)
    _name_int8_modules(int8, points)
    state.update(lower_counts=dict(low_result.counts), coverage=coverage(int8))
    if check and args is not None:
        pairs = _float_pairs(ref, out)
        # integer outputs (argmax, indices) downstream of int8 kernels: the share of
        # elements equal to the QDQ reference's
        agreement = _agreement(ref, out)
        if agreement is not None:
            state["qdq_agreement"] = agreement
            if agreement < _MIN_AGREEMENT:
                raise QuantizationError(
                    f"the int8 model's integer outputs agree with its reference QDQ model on "
                    f"{agreement:.1%} of elements < {_MIN_AGREEMENT:.0%}")
        state["qdq_sqnr"] = _require_sqnr(pairs, min_qdq_sqnr, "the int8 model",
                                          f"lowering rules: {dict(low_result.counts)}")
    int8.meta[_META] = state
    if reference:
        qdq.meta[_META] = dict(state)
        return int8, qdq
    return int8


def _lower_what_runs(qdq: fx.GraphModule, args: tuple, lower_rules: Any) -> tuple:
    """Lowering again, with the check rolling back each application the int8 model
    cannot run with (an int8 kernel's channels_last output read by a ``view`` that
    another output aliases, so no reshape may take its place): those ops stay in
    float. Returns the result and its module."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized dtypes; "rolled back ..."
        result = _as_rules(lower_rules, "lower").apply(qdq, args, on_mismatch="skip-rule")
    result.graph_module.meta[_ROLLED_BACK] = {r.node: r.rule for r in result.rejected}
    return result, result.graph_module


#: GraphModule.meta key: root node name -> the lowering rule rolled back there
_ROLLED_BACK = "rewrite_quant_rolled_back"


def _checking(*models: fx.GraphModule) -> Any:
    """A check's runs leave no trace: the state the models' forwards write (a step
    counter) is put back afterwards."""
    from rewrite.trust.check import preserved_state

    return preserved_state(*models, runs_only=True)


def _clones(args: tuple) -> tuple:
    """Copies of the example inputs for a check's run (a model may write its input)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.clone(), tuple(args))


def _runs_alike(reference: Any, model: Any, args: tuple) -> tuple:
    """Both models run on copies of ``args``, from one state of the random number
    generators: a random op in the model (ViTMAE's masking noise) draws the same
    numbers in both. The caller's generators are left as they were."""
    with seeded(0):
        expected = reference(*_clones(args))
    with seeded(0):
        return expected, model(*_clones(args))


def _require_sqnr(pairs: Any, floor: float, what: str, rules: str) -> float:
    """The lowest SQNR of (reference, output) pairs; below ``floor`` it is an error."""
    db = min((sqnr(r, o) for r, o in pairs), default=math.inf)
    if not db >= floor:  # NaN too
        raise QuantizationError(f"{what} disagrees with its reference QDQ model: SQNR {db:.1f} dB "
                                f"< {floor} dB ({rules})")
    return db


def _convert_pt2e(gm: fx.GraphModule, args: Any, state: dict, points: list, convert_rules: Any,
                  check: bool, min_sqnr: float) -> fx.GraphModule:
    """``convert``'s ``form="qdq"``: convert.rw's ruleset ``qdq`` on the frozen observers."""
    result = _as_rules(convert_rules, "convert", "qdq").apply(gm, args, check=False)
    pt2e = result.graph_module
    state.update(points=points, convert_counts=dict(result.counts), form="qdq", coverage=coverage(pt2e))
    if check and args is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # quantized dtypes are deprecated
            ref = _as_rules(convert_rules, "convert").apply(gm, args, check=False).graph_module
        with torch.no_grad(), _checking(ref, pt2e):
            pairs = _float_pairs(*_runs_alike(ref, pt2e, args))
        state["reference_sqnr"] = _require_sqnr(pairs, min_sqnr, "the QDQ (PT2E) model",
                                                f"rules: {dict(result.counts)}")
    pt2e.meta[_META] = state
    return pt2e


@one_thread_at_a_time()
@fake_mode_off()
def quantize(
    model: Any,
    calibration_batches: Iterable,
    example_inputs: Any = None,
    **options: Any,
) -> fx.GraphModule:
    """``prepare`` + ``calibrate`` + ``convert`` in one call.

    ``example_inputs`` defaults to the first calibration batch; ``options`` go to
    ``prepare`` (``backend``, ``capture``, ``observe``, ``ruleset``, ``fuse``,
    ``check``, ``input_ranges``, ``fixed_inputs``) and ``convert`` (``form``, ``lower``, ``convert_rules``,
    ``lower_rules``, ``min_qdq_sqnr``, ``reference``): ``form="qdq"`` returns the
    PT2E QDQ form, which ``export`` and ``export_onnx`` take.
    """
    require_batches(calibration_batches, "quantize")
    batches = list(calibration_batches)
    if not batches:
        raise QuantizationError("quantize needs at least one calibration batch")
    if example_inputs is None:
        example_inputs = _as_args(batches[0])
    convert_keys = {"lower", "convert_rules", "lower_rules", "min_qdq_sqnr", "reference", "form"}
    conv_opts = {k: v for k, v in options.items() if k in convert_keys}
    prep_opts = {k: v for k, v in options.items() if k not in convert_keys}
    if "check" in prep_opts:
        conv_opts["check"] = prep_opts["check"]
    observed = prepare(model, example_inputs, **prep_opts)
    calibrate(observed, batches)
    return convert(observed, **conv_opts)


# ---------------------------------------------------------------- coverage

#: canonical ops the report counts, with the words it uses for them
_LAYER_OPS = {"conv": ("conv", "convs"), "conv_transpose": ("transposed conv", "transposed convs"),
              "linear": ("linear", "linears")}


@attrs.frozen
class FloatLayer:
    """A conv or linear the int8 model still computes in float, and why."""

    layer: str  #: the module's dotted path (``blocks.3.conv``), else the node's name
    op: str     #: ``conv``, ``conv_transpose`` or ``linear``
    reason: str


@attrs.frozen
class Coverage:
    """How many convs and linears an int8 model runs as int8 kernels, out of how
    many, and every one left in float with the reason."""

    lowered: tuple    #: ((op, count), ...) lowered to int8 kernels
    left_float: tuple  #: FloatLayer, in graph order

    def count(self, op: str | None = None) -> tuple:
        """(lowered, total) for one op (``"conv"``, ``"linear"``...) or all of them."""
        low = sum(n for o, n in self.lowered if op in (None, o))
        return low, low + sum(1 for f in self.left_float if op in (None, f.op))

    @property
    def summary(self) -> str:
        parts = []
        for op, (one, many) in _LAYER_OPS.items():
            low, total = self.count(op)
            if total:
                parts.append(f"{low} of {total} {one if total == 1 else many}")
        if not parts:
            return "int8 kernels: no convs or linears"
        n = len(self.left_float)
        rest = f"{n} left in float" if n else "none left in float"
        return f"int8 kernels: {', '.join(parts)}; {rest}"

    def __str__(self) -> str:
        lines = [self.summary + (":" if self.left_float else "")]
        width = max([len(f.layer) for f in self.left_float] + [0])
        op_width = max([len(f.op) for f in self.left_float] + [0])
        for f in self.left_float:
            lines.append(f"  {f.layer:<{width}}  {f.op:<{op_width}}  {f.reason}")
        return "\n".join(lines)


def _pt2e_layer(node: fx.Node, bound: Any, gm: fx.GraphModule) -> bool:
    """A conv / linear of the QDQ form that runs as an int8 kernel once a runtime
    fuses its pairs: an int8 constant weight dequantized in the graph, its input
    dequantized and its output quantized."""
    w = bound.args.get("weight")
    if not (isinstance(w, fx.Node) and w.op == "call_function" and w.target in DECOMPOSED_DEQUANTIZE):
        return False
    if _const_tensor(w.args[0], gm) is None:
        return False
    return _quantized_here(bound.args.get("input"), gm, upstream=True) and _quantized_here(node, gm, upstream=False)


def _int8_layer_op(mod: Any) -> str | None:
    from rewrite.functions.quant import QuantizedConv, QuantizedConvAdd, QuantizedLinear

    if isinstance(mod, (QuantizedConv, QuantizedConvAdd)):
        return "conv"
    if isinstance(mod, QuantizedLinear):
        return "linear"
    return None


def _const_tensor(operand: Any, gm: fx.GraphModule) -> Any:
    """The tensor of a constant operand (a ConstRef or a get_attr node), or None."""
    from rewrite.engine.facts import fetch_attr

    name = _const_name(operand)
    if name is None:
        return None
    try:
        value = fetch_attr(gm, name)
    except AttributeError:
        return None
    return value if isinstance(value, torch.Tensor) else None


def _weight_of(operand: Any, gm: fx.GraphModule) -> tuple:
    """(is the weight a constant, its tensor or None): a ConstRef, a get_attr, or
    ``dequantize`` of one (the int8 weight convert made)."""
    from rewrite.functions.quant import ops_of

    t = _const_tensor(operand, gm)
    if t is not None or _const_name(operand) is not None:
        return True, t
    bound = ops_of(operand, gm).get("dequantize")
    if bound is not None:
        inner = bound.args.get("input")
        t = _const_tensor(inner, gm)
        if t is not None or _const_name(inner) is not None:
            return True, (t.dequantize() if t is not None and t.is_quantized else t)
    return False, None


def _quantized_here(node: Any, gm: fx.GraphModule, upstream: bool) -> bool:
    """The value reaching (``upstream``) or leaving a float op is rounded to int8:
    it comes from a ``dequantize`` or a fake-quant (through ops that keep the
    quantization), or it goes into a ``quantize_per_tensor`` or fake-quant
    (through a fusable activation)."""
    from rewrite.functions.quant import ops_of
    from rewrite.functions.quant import passthrough_input

    def rounds(n: Any) -> bool:
        return isinstance(n, fx.Node) and (
            is_quantize(n, gm) or is_dequantize(n, gm)
            or str(getattr(n.target, "__name__", "")).startswith("fake_quantize_per_tensor_affine"))

    if upstream:
        for _ in range(64):
            if node is None or rounds(node):
                return node is not None
            node = passthrough_input(node, gm)
        return False
    frontier = [node]
    for _ in range(3):
        users = [u for n in frontier for u in n.users]
        if any(rounds(u) for u in users):
            return True
        frontier = [u for u in users if {"relu", "hardtanh", "relu6", "add"} & set(ops_of(u, gm))]
        if not frontier:
            return False
    return False


def _shape_facts(node: Any, gm: fx.GraphModule) -> Any:
    """Shape/dtype facts of ``node``, else of the value it rounds (quantize,
    dequantize and fake-quant keep the shape; nodes rules created may have none)."""
    from rewrite.engine.facts import tensor_meta_of
    from rewrite.functions.quant import ops_of

    for _ in range(8):
        if not isinstance(node, fx.Node):
            return None
        meta = tensor_meta_of(node)
        if meta is not None and hasattr(meta, "shape"):
            return meta
        rounding = ("dequantize", "quantize_per_tensor")
        if not (set(ops_of(node, gm)) & set(rounding)
                or str(getattr(node.target, "__name__", "")).startswith("fake_quantize_per_tensor_affine")):
            return None
        node = node.args[0] if node.args else None
    return None


def _float_reason(node: fx.Node, op: str, bound: Any, gm: fx.GraphModule) -> str:
    """Why a conv / linear of the int8 model still runs in float."""
    from rewrite.functions.quant import conv_padding_problem

    rolled_back = gm.meta.get(_ROLLED_BACK, {})
    rule = next((rolled_back[n.name] for n in (node, *node.users) if n.name in rolled_back), None)
    if rule is not None:
        return f"lowered by {rule}, rolled back: the int8 model could not run so (raised or diverged)"
    args = bound.args
    x = args.get("input")
    is_const, w = _weight_of(args.get("weight"), gm)
    if not is_const:
        return "weight is not a constant (computed in the graph or an input)"
    meta = _shape_facts(x, gm)
    dtype = w.dtype if w is not None else getattr(meta, "dtype", None)
    if dtype is not None and dtype != torch.float32:
        return f"dtype {str(dtype).replace('torch.', '')}: int8 kernels take float32"
    if op == "conv_transpose":
        return "transposed conv: no int8 rule lowers it"
    if op == "conv" and w is not None:
        problem = conv_padding_problem(args.get("padding"), tuple(w.shape)[2:], args.get("dilation", 1))
        if problem is not None:
            return problem
    shape = getattr(meta, "shape", None)
    if op == "linear" and shape is not None and len(shape) < 2:
        return f"input of rank {len(shape)}: the int8 linear kernel takes rank >= 2"
    q_in, q_out = _quantized_here(x, gm, upstream=True), _quantized_here(node, gm, upstream=False)
    if not q_in or not q_out:
        which = "input and output" if not q_in and not q_out else "input" if not q_in else "output"
        return f"not observed: the observe rules left out its {which}"
    return "no lowering rule matched"


#: ops through which a product's right operand is still its constant weight, laid out
#: otherwise (``w.T``, ``w.transpose(0, 1)``, ``w.permute(1, 0)``)
_WEIGHT_VIEWS = ("numpy_T", "t", "transpose", "permute", "contiguous", "clone")


#: products and the operands that may be a layer's constant weight
_PRODUCT_WEIGHTS = {"matmul": ("input", "other"), "mm": ("input", "mat2"), "bmm": ("input", "mat2"),
                    "einsum": ("tensors",)}


def _constant_weight_product(bound: dict, gm: fx.GraphModule) -> bool:
    """A matrix product (``matmul``, ``mm``, ``bmm``, ``einsum``) with a constant
    floating-point weight of rank >= 2 among its operands, possibly through
    transposes: a linear layer (or a mixture of experts' stacked ones) the rules
    did not see as one."""
    for op, names in _PRODUCT_WEIGHTS.items():
        if op not in bound:
            continue
        operands = []
        for name in names:
            value = bound[op].args.get(name)
            operands.extend(value if isinstance(value, (list, tuple)) else [value])
        if any(_constant_weight(operand, gm) for operand in operands):
            return True
    return False


def _constant_weight(operand: Any, gm: fx.GraphModule) -> bool:
    """``operand`` is a constant floating-point tensor of rank >= 2, or a transpose
    or copy of one."""
    from rewrite.functions.quant import ops_of

    for _ in range(4):
        if not isinstance(operand, fx.Node):
            return False
        weight = _const_tensor(operand, gm)
        if weight is not None:
            return weight.dim() >= 2 and weight.is_floating_point()
        view = next((b for name, b in ops_of(operand, gm).items() if name in _WEIGHT_VIEWS), None)
        if view is None:
            return False
        operand = view.args.get("input")
    return False


def _module_kind(mod: Any) -> str | None:
    if isinstance(mod, torch.nn.modules.conv._ConvTransposeNd):
        return "conv_transpose"
    if isinstance(mod, torch.nn.modules.conv._ConvNd):
        return "conv"
    if isinstance(mod, torch.nn.Linear):
        return "linear"
    return None


def coverage(int8: fx.GraphModule) -> Coverage:
    """Count the convs and linears of an int8 model that run as int8 kernels, and
    name every one left in float with the reason: its padding (an asymmetric
    ``"same"``), its dtype, a weight that is not a constant, a transposed conv,
    a layer the observe rules left out, one inside a module the capture kept
    whole (``call_module`` of a leaf module the rules cannot see into)...
    ``convert`` records it in ``int8.meta["rewrite.quant"]["coverage"]``."""
    from rewrite.functions.quant import QuantizedPad, module_path
    from rewrite.ops import bind_node

    _require_converted(int8, "coverage")
    lowered: dict = {}
    left: list = []
    for node in int8.graph.nodes:
        if node.op == "call_module":
            try:
                mod = int8.get_submodule(node.target)
            except AttributeError:
                continue
            kind = _int8_layer_op(mod)
            if kind is not None:
                lowered[kind] = lowered.get(kind, 0) + 1
                continue
            if isinstance(mod, (QuantizedModule, QuantizedPad)) or is_observer_node(node, int8):
                continue
        if not node.op.startswith("call_"):
            continue
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            left.extend(_layers_inside(node, int8))
            continue
        bound = {b.op: b for b in bind_node(node, int8)}
        op = next((o for o in _LAYER_OPS if o in bound), None)
        if op is not None and _pt2e_layer(node, bound[op], int8):
            lowered[op] = lowered.get(op, 0) + 1
            continue
        if op is not None:
            left.append(FloatLayer(module_path(node) or node.name, op, _float_reason(node, op, bound[op], int8)))
            continue
        if _constant_weight_product(bound, int8):
            left.append(FloatLayer(module_path(node) or node.name, "linear",
                                   "a product with a constant weight in a spelling no rule turns into a "
                                   "linear (observe.rw's layers: x @ w.T, x @ w.t(), addmm)"))
            continue
        if node.op == "call_module" and not bound:
            # a leaf module: the graph calls it whole, its convs and linears unseen
            mod = int8.get_submodule(node.target)
            for sub, child in mod.named_modules():
                kind = _module_kind(child)
                if kind is not None:
                    name = f"{node.target}.{sub}" if sub else str(node.target)
                    left.append(FloatLayer(name, kind, _unbound_module_reason(node.target, mod, sub)))
    return Coverage(tuple(sorted(lowered.items(), key=lambda kv: list(_LAYER_OPS).index(kv[0]))), tuple(left))


def _layers_inside(node: fx.Node, gm: fx.GraphModule) -> list:
    """The convs and linears of the subgraphs a higher-order op runs (export's
    ``wrap_with_set_grad_enabled`` for a ``torch.no_grad()`` block), which no rule
    enters: each stays float."""
    from rewrite.functions.quant import module_path
    from rewrite.ops import bind_node

    hop = getattr(node.target, "__name__", str(node.target))
    found: list = []
    todo = [_attr(gm, str(a.target)) for a in node.all_input_nodes if a.op == "get_attr"]
    while todo:
        sub = todo.pop()
        if not isinstance(sub, fx.GraphModule):
            continue
        for inner in sub.graph.nodes:
            if inner.op == "get_attr":
                todo.append(_attr(sub, str(inner.target)))
            if not inner.op.startswith("call_"):
                continue
            op = next((o for o in _LAYER_OPS if o in {b.op for b in bind_node(inner, sub)}), None)
            if op is not None:
                found.append(FloatLayer(module_path(inner) or f"{node.name}.{inner.name}", op, (
                    f"not observed: inside higher-order op {hop} (a torch.no_grad() block, a cond or a "
                    "checkpoint in an export capture), whose subgraph the rules do not enter")))
    return found


def _unbound_module_reason(target: str, mod: torch.nn.Module, sub: str) -> str:
    """Why a layer in a module the graph calls whole stays float: a layer module the
    vocabulary does not bind as configured (a conv padding by reflection), or a layer
    inside a leaf module."""
    if sub:
        return f"not observed: inside leaf module {target} ({type(mod).__name__}), which the graph calls whole"
    mode = getattr(mod, "padding_mode", "zeros")
    if mode != "zeros":
        return (f"not observed: a {type(mod).__name__} with padding_mode={mode!r}, which the rules do not bind "
                "as one module; capture with torch.export, which spells the padding out as its own op")
    return f"not observed: a {type(mod).__name__} module the rules do not bind as configured"


# ---------------------------------------------------------------- accuracy


def sqnr(reference: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``20 log10(|ref| / |ref - test|)``
    (inf when equal) over the reference's finite elements; its infinities and NaNs (a
    ``masked_fill(-inf)`` of logits) must be the test's too, else -inf, as for a test
    that is not finite where the reference is."""
    ref = reference.detach().double()
    test = test.detach().dequantize().double() if test.is_quantized else test.detach().double()
    finite = torch.isfinite(ref)
    if not torch.equal(finite, torch.isfinite(test)):
        return -math.inf
    if not finite.all():
        off_ref, off_test = ref[~finite], test[~finite]
        if not ((off_ref == off_test) | (off_ref.isnan() & off_test.isnan())).all():
            return -math.inf
        ref, test = ref[finite], test[finite]
    noise = (ref - test).norm()
    if noise == 0:
        return math.inf
    return float(20 * torch.log10(ref.norm() / noise))


#: The int8 model's integer outputs must equal its QDQ reference's on this share of elements.
_MIN_AGREEMENT = 0.9


def _agreement(ref: Any, out: Any) -> float | None:
    """The smallest share of equal elements over the integer/bool outputs, or None."""
    a = [t for t in pytree.tree_leaves(ref) if isinstance(t, torch.Tensor)]
    b = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    shares = [float((x == y).float().mean()) for x, y in zip(a, b)
              if not x.is_floating_point() and not x.is_complex() and x.shape == y.shape and x.numel()]
    return min(shares) if shares else None


def _float_pairs(ref: Any, out: Any) -> list:
    a = [t for t in pytree.tree_leaves(ref) if isinstance(t, torch.Tensor)]
    b = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    if len(a) != len(b):
        raise QuantizationError(f"the models return {len(a)} and {len(b)} tensors")
    return [(x, y) for x, y in zip(a, b) if x.is_floating_point()]


class _FloatRun(fx.Interpreter):
    """Runs an observed model as the fp32 model it wraps: observers pass their
    input through without recording it; their inputs are kept by observer name."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict = {}

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        node = self.current_node if hasattr(self, "current_node") else None
        if node is not None and is_observer_node(node, self.module):
            # a copy: in-place ops after the observer (export keeps add_, relu_) change it
            self.values[str(target)] = args[0].detach().clone()
            return args[0]
        return super().call_module(target, args, kwargs)

    def run_node(self, n: fx.Node) -> Any:
        self.current_node = n
        return super().run_node(n)


class _Int8Run(fx.Interpreter):
    """Runs an int8 model keeping, per observer, the int8 tensor that stands for
    what it watched: the last quantized value of the nodes marked with it (a kernel,
    then maybe a clamp on its output)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        name = _observer_of(n)
        if name is not None and isinstance(out, torch.Tensor):
            if out.is_quantized:
                self.values[name] = out.dequantize()
            elif n.op == "call_function" and n.target in DECOMPOSED_DEQUANTIZE:  # the QDQ form
                self.values[name] = out
        return out


@attrs.frozen
class LayerSQNR:
    """SQNR of one quantized tensor (or output) of the int8 model against fp32."""

    layer: str
    op: str
    sqnr: float
    flagged: bool


@attrs.frozen
class AccuracyReport:
    """Per-layer and output SQNR of an int8 model against its fp32 model, and
    its ``coverage``: the SQNR says nothing of the layers left in float."""

    layers: tuple
    outputs: tuple
    flag_below: float
    coverage: Coverage | None = None

    @property
    def output_sqnr(self) -> float:
        """The worst output SQNR, in dB."""
        return min((o.sqnr for o in self.outputs), default=math.inf)

    @property
    def flagged(self) -> tuple:
        return tuple(r for r in self.layers + self.outputs if r.flagged)

    def __str__(self) -> str:
        width = max([len(r.layer) for r in self.layers + self.outputs] + [5])
        lines = [f"{'layer':<{width}}  {'op':<16} {'SQNR dB':>8}"]
        for r in self.layers + self.outputs:
            mark = "  <-- poor" if r.flagged else ""
            lines.append(f"{r.layer:<{width}}  {r.op:<16} {r.sqnr:>8.1f}{mark}")
        lines.append(f"output SQNR {self.output_sqnr:.1f} dB; {len(self.flagged)} tensor(s) below "
                     f"{self.flag_below:g} dB")
        if self.coverage is not None:
            lines.append(str(self.coverage))
        return "\n".join(lines)


@one_thread_at_a_time()
@fake_mode_off()
def accuracy_report(
    observed: fx.GraphModule,
    int8: fx.GraphModule,
    batches: Iterable,
    *,
    flag_below: float = 20.0,
) -> AccuracyReport:
    """SQNR of the int8 model against fp32 on held-out ``batches``, for every
    tensor the model quantizes (the output of each int8 conv, linear, add...) and
    for every float output; entries below ``flag_below`` dB are flagged. The
    report also carries the int8 model's ``coverage`` (convs and linears left in
    float, with the reason), and prints it last.

    ``observed`` (from ``prepare``) supplies the fp32 values: its observers are
    bypassed, nothing is recorded. The int8 model's nodes say which observer's
    tensor they compute (``convert`` marks them).
    """
    _require_prepared(observed, "accuracy_report")
    if "points" in observed.meta[_META]:
        raise TypeError("accuracy_report takes the observed model first, then the int8 model: "
                        "accuracy_report(observed, int8, batches)")
    _require_converted(int8, "accuracy_report")
    require_batches(batches, "accuracy_report")
    points = int8.meta.get(_META, {}).get("points", [])
    sig: dict = {}
    noise: dict = {}

    def add(key: Any, ref: torch.Tensor, test: torch.Tensor) -> None:
        r, t = ref.detach().double(), test.detach().double()
        finite = torch.isfinite(r)
        if not finite.all():  # as sqnr: -inf logits must be the test's too, the rest compared
            off_r, off_t = r[~finite], t[~finite]
            same = bool(((off_r == off_t) | (off_r.isnan() & off_t.isnan())).all())
            r, t = r[finite], t[finite]
            if not same:
                noise[key] = math.inf
        sig[key] = sig.get(key, 0.0) + float((r * r).sum())
        noise[key] = noise.get(key, 0.0) + float(((r - t) ** 2).sum())

    n_out = 0
    with torch.no_grad():
        for i, batch in enumerate(batches):
            args = _as_args(batch)
            fl, q = _FloatRun(observed), _Int8Run(int8)
            # each run on its own copies: a model that writes its input would give the
            # second run what the first wrote, and the caller's batches would change
            try:
                with seeded(i):  # a random op (ViTMAE's masking noise) draws alike in both
                    ref = fl.run(*_clones(args))
                with seeded(i):
                    out = q.run(*_clones(args))
            except Exception as err:  # noqa: BLE001 - the model's own error on this batch, named
                raise batch_failed("held-out", i, err) from err
            for p in points:
                ref_t, test = fl.values.get(p.observer), q.values.get(p.observer)
                if ref_t is not None and test is not None and tuple(ref_t.shape) == tuple(test.shape):
                    add(p.observer, ref_t, test)
            pairs = _float_pairs(ref, out)
            n_out = len(pairs)
            for i, (r, o) in enumerate(pairs):
                add(("output", i), r, o.dequantize() if o.is_quantized else o)
    if not sig and not n_out:
        raise ValueError("accuracy_report got no held-out batches: pass a list of batches (each a tensor or a "
                         "tuple of inputs) unlike the calibration ones")

    def db(key: Any) -> float:
        return math.inf if noise[key] == 0 else 10 * math.log10(sig[key] / noise[key]) if sig[key] else -math.inf

    layers = tuple(
        LayerSQNR(p.layer, p.op, db(p.observer), db(p.observer) < flag_below)
        for p in points if p.observer in sig)
    outputs = tuple(
        LayerSQNR(f"output[{i}]", "", db(("output", i)), db(("output", i)) < flag_below)
        for i in range(n_out))
    cov = int8.meta.get(_META, {}).get("coverage")
    return AccuracyReport(layers, outputs, flag_below, cov if cov is not None else coverage(int8))


# ---------------------------------------------------------------- export


def _unexportable(gm: fx.GraphModule) -> tuple | None:
    """(node, why) for the first node of ``gm`` that torch.export cannot capture:
    an int8 kernel module holding torch's packed weights (a ScriptObject export
    cannot flatten), or an op on a quantized (quint8/qint8) tensor, which has no
    meta kernel."""
    for node in gm.graph.nodes:  # the int8 kernels first: the reason the int8 form cannot export
        if node.op == "call_module":
            try:
                mod = gm.get_submodule(node.target)
            except AttributeError:
                continue
            if isinstance(mod, QuantizedModule):
                packed = " with packed weights" if "_packed" in vars(mod) else ""
                return node, f"calls torch.ops.quantized.{mod.op_name}{packed}"
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            try:
                value = _attr(gm, str(node.target))
            except AttributeError:
                continue
            if isinstance(value, torch.Tensor) and value.is_quantized:
                return node, f"reads a quantized ({value.dtype}) constant"
        if node.op == "call_function" and getattr(node.target, "__name__", "") in (
                "quantize_per_tensor", "quantize_per_channel") and node.target not in DECOMPOSED_QUANTIZE:
            return node, "makes a quantized tensor (torch.quantize_per_tensor)"
    return None


def _attr(gm: fx.GraphModule, name: str) -> Any:
    from rewrite.engine.facts import fetch_attr

    return fetch_attr(gm, name)


def export(gm: fx.GraphModule, example_inputs: Any = None, path: Any = None) -> Any:
    """Re-capture a quantized model with ``torch.export`` (non-strict); save it as
    ``.pt2`` when ``path`` is given (``torch.export.load`` reads it back).

    The QDQ form (``convert(..., form="qdq")``) exports. The int8-kernel form does
    not: its modules call ``torch.ops.quantized`` kernels on packed weights, which
    torch.export cannot flatten; the error names the first such node and points to
    ``form="qdq"``.

    Args:
        gm: a model from ``convert`` (or any GraphModule).
        example_inputs: a tuple of inputs; default: those ``prepare`` recorded.
        path: where to ``torch.export.save`` the program, or None.

    Returns:
        The ``torch.export.ExportedProgram``.
    """
    from rewrite.capture import export_keeping_sizes, require_graph_module, write_atomically

    require_graph_module(gm, "rewrite.quant.export")
    _check_target(path, ".pt2")
    args = _as_args(example_inputs) if example_inputs is not None else gm.meta.get(_META, {}).get("example_inputs")
    if args is None:
        raise QuantizationError("export needs example inputs (none given, none recorded by prepare)")

    bad = _unexportable(gm)
    if bad is not None:
        node, why = bad
        raise QuantizationError(
            f"torch.export cannot capture node {node.name!r}: it {why}; "
            "convert(..., form=\"qdq\") gives the exportable QDQ form")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            program = export_keeping_sizes(gm, tuple(args))
    except Exception as err:  # noqa: BLE001  (torch.export raises many types)
        raise QuantizationError(f"torch.export could not capture the model: {_first_line(err)}") from err
    if path is not None:
        if is_path(path):
            write_atomically(path, lambda f: torch.export.save(program, f))
        else:  # a file object, as torch.export.save takes
            torch.export.save(program, path)
    return program


def _check_target(path: Any, suffix: str) -> None:
    """A file to write a ``suffix`` file at, before any work (``rewrite.capture.file_problem``)."""
    if path is None:  # nothing to write
        return
    problem = file_problem(path, suffix) if is_path(path) else file_object_problem(path)
    if problem is not None:
        raise ValueError(f"{path}: {problem}")


def _require_onnx() -> None:
    missing = [m for m in ("onnx", "onnxscript", "onnxruntime") if _missing(m)]
    if missing:
        raise QuantizationError(
            f"ONNX export needs {', '.join(missing)}: pip install -c constraints.txt \"torch-rewrite[onnx]\"")


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


def export_onnx(gm: fx.GraphModule, example_inputs: Any = None, path: Any = "model.onnx", *,
                opset: int | None = None) -> Path:
    """Export the QDQ form to ONNX (``torch.onnx.export(..., dynamo=True)`` of the
    ``export``-ed program): each quantize/dequantize pair becomes a QuantizeLinear /
    DequantizeLinear pair, int8 weights become int8 initializers with their
    per-channel scales, ready for onnxruntime (its CPU provider fuses the pairs
    into int8 kernels) or TensorRT. Needs the ``onnx`` extra. Returns ``path`` (a file
    object, such as ``io.BytesIO``, gets the serialized model, weights inside).

    Raises:
        QuantizationError: torch.export or torch.onnx cannot convert the model (the
            message names the op torch.onnx has no function for).
    """
    from rewrite.capture import require_graph_module

    require_graph_module(gm, "rewrite.quant.export_onnx")
    _check_target(path, ".onnx")
    _require_onnx()
    program = export(gm, example_inputs)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            onnx_program = torch.onnx.export(program, dynamo=True, verbose=False,
                                             **({"opset_version": opset} if opset else {}))
    except Exception as err:  # noqa: BLE001  (torch.onnx raises its own many types)
        raise QuantizationError(f"torch.onnx cannot convert the model: {_onnx_reason(err)}") from err
    # the inputs export made constants (an int, a flag): run_onnx refuses other values
    baked = [[k, v if isinstance(v, (bool, int, float, str, type(None))) else repr(v)]
             for k, v in enumerate(_as_args(example_inputs) if example_inputs is not None else ())
             if not isinstance(v, torch.Tensor)]
    if baked:
        onnx_program.model.metadata_props[_BAKED_KEY] = json.dumps(baked)
    if not is_path(path):
        path.write(onnx_program.model_proto.SerializeToString())
        return path
    # written in place: a large model's weights go to a file named after it (external data)
    try:
        onnx_program.save(str(path))
    except OSError as err:  # a dangling link, a full disk: after the checks before any work
        raise QuantizationError(f"cannot write {str(path)!r}: {err.strerror or err}") from err
    return Path(path)


def _onnx_reason(err: BaseException) -> str:
    """The line of torch.onnx's long report that says what it lacks (``No ONNX function
    found for <OpOverload(op='aten._adaptive_avg_pool3d', ...)>``), else its first."""
    found = re.search(r"No ONNX function found for <[^>]*>", str(err))
    return found.group(0) if found else f"{type(err).__name__}: {_first_line(err)}"


#: ONNX metadata key: the non-tensor inputs the exported program holds as constants
_BAKED_KEY = "rewrite.baked_inputs"


def run_onnx(path: Any, inputs: Any, *, threads: int | None = None) -> list:
    """Run an ONNX model with onnxruntime's CPU execution provider on ``inputs``
    (a tensor or tuple of tensors, fed in order); returns its outputs as tensors.
    ``QuantizationError`` when the file is missing or not a model onnxruntime loads."""
    _require_onnx()
    import onnxruntime as ort

    if threads is not None:
        try:
            count = operator.index(threads) if not isinstance(threads, bool) else None  # numpy ints too
        except TypeError:
            count = None
        if count is None or not 1 <= count < 2 ** 31:
            raise QuantizationError(f"run_onnx: threads is a positive int (below 2**31) or None (onnxruntime's "
                                    f"default), not {threads!r}")
        threads = count
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    if not is_path(path):
        raise QuantizationError(f"run_onnx takes the path of an .onnx file, not {type(path).__name__}")
    if not Path(path).is_file():
        raise QuantizationError(f"{path}: {'a folder, not an' if Path(path).is_dir() else 'no such'} ONNX file")
    try:
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as err:  # noqa: BLE001  (onnxruntime's own pybind error types)
        raise QuantizationError(f"onnxruntime cannot load {path}: {_first_line(err)}") from err
    baked = sess.get_modelmeta().custom_metadata_map.get(_BAKED_KEY)
    feed = _onnx_feed(sess.get_inputs(), _as_args(inputs), dict(json.loads(baked)) if baked else None)
    return [torch.from_numpy(o) for o in sess.run(None, feed)]


def _same_baked(baked: Any, given: Any) -> bool:
    """A value given for an input the export baked in, as it was (3 and 3.0 alike)."""
    if isinstance(baked, (bool, int, float, str, type(None))):
        try:
            return bool(baked == given) and (type(baked) is bool) == isinstance(given, bool)
        except Exception:  # noqa: BLE001 - a value that does not compare: not the same
            return False
    return baked == repr(given)


#: onnxruntime's tensor type names for the torch dtypes a feed may hold
_ONNX_TYPES = {torch.float32: "tensor(float)", torch.float64: "tensor(double)", torch.float16: "tensor(float16)",
               torch.bfloat16: "tensor(bfloat16)", torch.int64: "tensor(int64)", torch.int32: "tensor(int32)",
               torch.int8: "tensor(int8)", torch.uint8: "tensor(uint8)", torch.bool: "tensor(bool)"}


def _onnx_feed(expected: Sequence[Any], given: tuple, baked: dict | None = None) -> dict:
    """The session's inputs, by name, from ``given`` in order; a ``QuantizationError``
    that compares the two (count, dtype, fixed sizes) instead of onnxruntime's own.
    Inputs that are not tensors (``forward(x, n=3)``'s int) are left out when the
    tensors alone are as many as the model's inputs: torch.export made them constants
    of the program, which takes no input for them. ``baked``: position -> repr of
    the value each had at export (``export_onnx``): another value is refused."""
    tensors = tuple(t for t in given if isinstance(t, torch.Tensor))
    if len(given) != len(expected) and len(tensors) == len(expected) and baked is not None:
        for k, v in enumerate(given):
            if isinstance(v, torch.Tensor):
                continue
            if k not in baked:
                raise QuantizationError(f"input {k} ({v!r}) is not an input of the ONNX model: it was exported "
                                        "without it (its default is fixed in the program)")
            if not _same_baked(baked[k], v):
                raise QuantizationError(f"input {k} is fixed in the ONNX model at the value it was exported with "
                                        f"({baked[k]!r}), not {v!r}: export again with this value")
        given = tensors
    if len(given) != len(expected):
        names = ", ".join(i.name for i in expected)
        raise QuantizationError(f"the ONNX model takes {len(expected)} input(s) ({names}); {len(given)} were given")
    feed = {}
    for k, (spec, t) in enumerate(zip(expected, given)):
        if not isinstance(t, torch.Tensor):
            raise QuantizationError(f"ONNX input {k} ({spec.name}): expected a tensor, got {type(t).__name__}")
        want = spec.type
        if _ONNX_TYPES.get(t.dtype, str(t.dtype)) != want:
            raise QuantizationError(f"ONNX input {k} ({spec.name}): the model takes {want}, "
                                    f"given {str(t.dtype).replace('torch.', '')}")
        shape = list(spec.shape)
        fixed = len(shape) == t.dim() and all(not isinstance(d, int) or d == n for d, n in zip(shape, t.shape))
        if not fixed:
            dims = ", ".join(str(d) if isinstance(d, int) else (d or "?") for d in shape)
            raise QuantizationError(
                f"ONNX input {k} ({spec.name}): the model takes shape [{dims}], given {list(t.shape)} (sizes are "
                "fixed at the export's example inputs: pad a smaller last batch, or export one of its size)")
        feed[spec.name] = t.detach().cpu().numpy()
    return feed


# ---------------------------------------------------------------- command line


def save(gm: fx.GraphModule, path: Any) -> None:
    """``torch.save`` an int8 GraphModule (its prepacked weights pickle), as
    ``rewrite.capture.picklable`` makes it: ``gm`` is not changed; from an export
    capture, without export's input guard (the saved module does not check its
    inputs' shapes)."""
    from rewrite.capture import picklable, write_atomically

    _check_target(path, ".pt")
    plain = picklable(gm)
    if is_path(path):
        write_atomically(path, lambda f: torch.save(plain, f))
    else:  # a file object (io.BytesIO), as torch.save takes
        torch.save(plain, path)


def add_quantize_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``rewrite quantize`` (see ``quantize_command``)."""
    from rewrite.arguments import non_negative_int, positive_int

    p.add_argument("--model", required=True, help="module:callable returning (model, example_inputs)")
    p.add_argument("--capture", choices=("fx", "export"), default="fx")
    p.add_argument("--backend", choices=BACKENDS, default="x86")
    p.add_argument("--ruleset", help="ruleset of the observe rules: main (all ops), onednn, or linear "
                                      "(linear layers only); default: onednn for that backend, else main")
    p.add_argument("--observe", help="your own observe rule file instead of rules/quant/observe.rw")
    p.add_argument("--calibration", type=non_negative_int, default=8, metavar="N",
                   help="calibrate on the example inputs and N random batches shaped like them")
    p.add_argument("--held-out", type=positive_int, default=4, metavar="N",
                   help="report SQNR on N other random batches")
    p.add_argument("--flag-below", type=float, default=20.0, help="flag tensors below this SQNR (dB)")
    p.add_argument("--no-check", action="store_true",
                   help="skip the equivalence checks (fused and observed vs float, int8 vs QDQ)")
    p.add_argument("--save", help="torch.save the int8 GraphModule here")
    p.add_argument("--pt2", metavar="PATH", help="also convert to the QDQ form and save its torch.export program here")
    p.add_argument("--onnx", metavar="PATH",
                   help="also convert to the QDQ form, export it to ONNX here (QuantizeLinear/DequantizeLinear) "
                        "and run it in onnxruntime on the held-out batches (needs the onnx extra)")
    return p


def quantize_command(args: argparse.Namespace) -> int:
    """``rewrite quantize --model pkg.mod:factory [--capture export] ...``: quantize
    the model, print the rule counts and the accuracy report, optionally save it.
    Exit 0 on success, 1 when quantization fails its check."""
    from rewrite.trust.check import generate_inputs
    from rewrite.trust.runnable import load_runnable_model

    from rewrite.capture import file_problem

    for option, suffix in (("save", ".pt"), ("pt2", ".pt2"), ("onnx", ".onnx")):  # before any work
        path = getattr(args, option, None)
        problem = path and file_problem(path, suffix)
        if problem:
            print(f"rewrite: error: --{option} {path}: {problem}", file=sys.stderr)
            return 2
    if args.ruleset:
        try:
            _as_rules(args.observe, "observe", args.ruleset)
        except KeyError as err:
            print(f"rewrite: error: --ruleset {args.ruleset}: {err.args[0]}", file=sys.stderr)
            return 2
    model, inputs = load_runnable_model(args.model)
    calib = [generate_inputs(inputs, seed=1000 + i) for i in range(args.calibration)]
    held = [generate_inputs(inputs, seed=2000 + i) for i in range(args.held_out)]
    try:
        observed = prepare(model, inputs, backend=args.backend, capture=args.capture,
                           observe=args.observe, ruleset=args.ruleset, check=not args.no_check)
        calibrate(observed, [inputs] + calib)
        int8 = convert(observed, check=not args.no_check)
    except QuantizationError as err:
        print(f"rewrite: error: {err}", file=sys.stderr)
        return 1
    state = int8.meta[_META]
    for step in ("observe_counts", "convert_counts", "lower_counts"):
        counts = ", ".join(f"{k} x{v}" for k, v in sorted(state.get(step, {}).items())) or "none"
        print(f"{step.split('_')[0]}: {counts}")
    print(f"int8 vs QDQ reference: SQNR {state.get('qdq_sqnr', float('nan')):.1f} dB")
    print()
    print(accuracy_report(observed, int8, held, flag_below=args.flag_below))
    if args.save:
        save(int8, args.save)
        print(f"saved the int8 GraphModule to {args.save}")
    if args.pt2 or args.onnx:
        try:
            _export_command(args, observed, int8, inputs, held)
        except QuantizationError as err:
            print(f"rewrite: error: {err}", file=sys.stderr)
            return 1
    return 0


def _export_command(args: argparse.Namespace, observed: fx.GraphModule, int8: fx.GraphModule,
                    inputs: tuple, held: list) -> None:
    """``--pt2`` / ``--onnx``: the QDQ form of the same calibration, exported; its
    SQNR against the int8 kernels and, for ONNX, onnxruntime's against eager."""
    if args.onnx:
        _require_onnx()
    qdq = convert(observed, form="qdq", check=not args.no_check)
    with torch.no_grad():
        pairs = [p for b in held for p in _float_pairs(int8(*_as_args(b)), qdq(*_as_args(b)))]
    db = min((sqnr(r, o) for r, o in pairs), default=math.inf)
    print(f"\nQDQ form: {qdq.meta[_META]['coverage'].summary}; vs the int8 kernels: SQNR {db:.1f} dB")
    if args.pt2:
        export(qdq, inputs, args.pt2)
        print(f"saved the QDQ form's torch.export program to {args.pt2}")
    if args.onnx:
        import onnx

        export_onnx(qdq, inputs, args.onnx)
        ops = [n.op_type for n in onnx.load(args.onnx).graph.node]
        with torch.no_grad():
            ort = [sqnr(r, o) for b in held for r, o in zip(
                [t for t in pytree.tree_leaves(qdq(*_as_args(b))) if isinstance(t, torch.Tensor)],
                run_onnx(args.onnx, b))]
        print(f"saved ONNX to {args.onnx}: {ops.count('QuantizeLinear')} QuantizeLinear, "
              f"{ops.count('DequantizeLinear')} DequantizeLinear; onnxruntime vs eager QDQ: "
              f"SQNR {min(ort, default=math.inf):.1f} dB")


def _main(argv: Sequence[str] | None = None) -> int:  # python -m rewrite.quant
    from rewrite.capture import ModelSpecError

    parser = add_quantize_arguments(argparse.ArgumentParser(prog="rewrite quantize"))
    try:
        return quantize_command(parser.parse_args(argv))
    except ModelSpecError as err:
        print(f"rewrite: error: {err}", file=sys.stderr)
        return 2


#: Quantization-aware training lives in ``rewrite.qat`` (rewrite/flows/qat.py), which
#: imports this module; these names are lazy attributes resolved on first use.
_QAT_NAMES = {"prepare_qat": "prepare_qat", "convert_qat": "convert", "calibrate_qat": "calibrate"}


def __getattr__(name: str) -> Any:  # rewrite.quant.prepare_qat -> rewrite.qat.prepare_qat
    if name in _QAT_NAMES:
        import importlib

        return getattr(importlib.import_module("rewrite.flows.qat"), _QAT_NAMES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    raise SystemExit(_main())
