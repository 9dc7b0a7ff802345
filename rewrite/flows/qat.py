"""Quantization-aware training, built from rule files.

    import rewrite.qat as rqat            # also rewrite.quant.prepare_qat / convert_qat

    qat = rqat.prepare_qat(model, (x,))           # rules/quant/qat.rw: fake quantizers, QAT layers
    opt = torch.optim.SGD(qat.parameters(), lr=1e-3)
    for x, y in batches:                          # ordinary training: qat is a GraphModule
        loss = F.cross_entropy(qat(x), y)         # in train mode; gradients pass the
        opt.zero_grad(); loss.backward(); opt.step()   # fake quantizers (straight-through)
    int8 = rqat.convert(qat)                      # the same int8 kernels as rewrite.quant.convert

``prepare_qat`` captures the model (``symbolic_trace`` or ``torch.export``), runs a
ruleset of ``rules/quant/qat.rw`` on it and returns the result in training mode:

* activation fake quantizers (torch's ``FakeQuantize``) where ``rules/quant/observe.rw``
  puts observers, after the activation an int8 kernel fuses and after the batch
  norm of a conv;
* each quantized conv or linear replaced by a module that holds its weight as a
  trainable parameter and fake-quantizes it on every call (8 bits, ruleset ``main``;
  4 bits, ruleset ``w4``; per channel, symmetric). A conv and the batch norm after
  it become one module that simulates the fold as torch.ao's ``ConvBn2d`` does: the
  batch norm is NOT folded into constants (it keeps training on batch statistics);
  its running statistics scale the weight that is fake-quantized, so in eval mode
  the module computes exactly the folded conv the int8 model runs.

The fake quantizers' ranges are initialised from the example inputs (or the
``calibration`` batches) with batch norms in eval mode, as PTQ would calibrate.
In training mode the activation ranges follow a moving average; in eval mode they
stay fixed. The weight ranges are always those of the current weight.

``convert`` does what a rule cannot, reading module state: each QAT layer becomes
``conv(x, dequantize(w_int8), b)`` with the weight rounded as its fake quantizer
rounds it (batch norm folded with its running statistics), and each activation fake
quantizer an observer frozen at its scale and zero point. ``rewrite.quant.convert``
then applies ``rules/quant/convert.rw`` and ``lower.rw``: the same int8 kernels,
the same checks (int8 vs its QDQ reference by SQNR), the same coverage report.
Weights of fewer than 8 bits are stored in int8 kernels using 2**bits levels.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch.ao.quantization.observer import ObserverBase

from rewrite.capture import INFERENCE_KEY
from rewrite.engine.replace import SOURCES_KEY
from rewrite.flows import quant as ptq
from rewrite.functions.qat import QATLayer, is_fake_quant_node, is_qat_layer_node
from rewrite.trust.modes import fake_mode_off, one_thread_at_a_time

__all__ = [
    "prepare_qat", "calibrate", "convert", "qat_rules", "fake_quant_nodes", "qat_layers",
    "FrozenObserver", "QATError",
]

_META = "rewrite.qat"


class QATError(RuntimeError):
    """The QAT flow cannot proceed (bad arguments, a model without fake quantizers)."""


def qat_rules(ruleset: str | None = None) -> Any:
    """The shipped ``rules/quant/qat.rw``, or one of its rulesets (``"main"``: 8-bit
    weights, ``"w4"``: 4-bit weights)."""
    return ptq.quant_rules("qat", ruleset)


def fake_quant_nodes(gm: fx.GraphModule) -> list:
    """The ``call_module`` nodes of activation fake quantizers, in graph order."""
    return [n for n in gm.graph.nodes if is_fake_quant_node(n, gm)]


def qat_layers(gm: fx.GraphModule) -> list:
    """The ``call_module`` nodes of QAT convs and linears (``QATLayer``), in graph order."""
    return [n for n in gm.graph.nodes if is_qat_layer_node(n, gm)]


def _fq_config(mod: Any) -> tuple:
    obs = mod.activation_post_process
    return (type(mod), type(obs), mod.dtype, mod.qscheme, mod.quant_min, mod.quant_max)


def _merge_fake_quants(gm: fx.GraphModule) -> int:
    """One fake quantizer per tensor: the input rules insert one per consumer (see
    ``rewrite.quant.merge_duplicate_points``)."""
    return ptq.merge_duplicate_points(gm, is_fake_quant_node, _fq_config)


def _capture(model: Any, args: tuple, capture: str) -> fx.GraphModule:
    from rewrite.capture import capture as capture_at

    if capture not in ("fx", "export"):
        raise ValueError(f"capture must be 'fx' or 'export', got {capture!r}")
    if isinstance(model, fx.GraphModule):
        gm = copy.deepcopy(model)
        _allow_train_eval(gm)
        gm.eval()  # batch norms read as they will be folded: with running statistics
    elif isinstance(model, torch.nn.Module):
        # a copy in eval mode: batch norms are captured with their running statistics,
        # and the caller's model keeps its mode (the input is never modified)
        model = copy.deepcopy(model).eval()
        gm = capture_at(model, args, capture)
        if capture == "fx":  # symbolic_trace drops what Python decides (a no_grad block): as PTQ checks
            from rewrite.ruleset import confirm_capture

            confirm_capture(model, gm, args)
    else:
        raise TypeError(f"prepare_qat takes an nn.Module or a GraphModule, got {type(model).__name__}")
    _allow_train_eval(gm)
    return gm


def _allow_train_eval(gm: fx.GraphModule) -> None:
    """``torch.export``'s module refuses ``train()`` / ``eval()``; a QAT model needs
    both (batch norms and fake quantizers behave differently in each)."""
    for name in ("train", "eval"):
        if name in vars(gm):
            delattr(gm, name)


_TORCH_BATCH_NORMS = {f"torch.nn.modules.batchnorm.BatchNorm{d}d": getattr(torch.nn, f"BatchNorm{d}d")
                      for d in (1, 2, 3)}
_BATCH_NORM_RANKS = {torch.nn.BatchNorm1d: (2, 3), torch.nn.BatchNorm2d: (4,), torch.nn.BatchNorm3d: (5,)}
# a torch dropout module's exported call in eval mode: aten op -> the module classes it comes from
_DROPOUTS = {
    torch.ops.aten.dropout.default: (torch.nn.Dropout,),
    torch.ops.aten.feature_dropout.default: (torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d),
    torch.ops.aten.alpha_dropout.default: (torch.nn.AlphaDropout,),
    torch.ops.aten.feature_alpha_dropout.default: (torch.nn.FeatureAlphaDropout,),
}
_SWITCHABLE = "rewrite.qat.switchable"  # node meta of the modules made: the aten op they were


def _module_class(node: fx.Node) -> Any:
    """The class an exported node's innermost module was, as ``nn_module_stack``
    names it (a qualified name), or None."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    _, kind = list(stack.values())[-1]
    return kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}"


def _switchable_batch_norm(gm: fx.GraphModule, node: fx.Node) -> Any:
    """A torch batch norm module for an eval-mode ``aten.batch_norm`` call of one,
    holding the graph's own weight, bias and running statistics (the same tensors:
    the optimizer trains them), or None where a fact is unknown: a momentum of 0
    (also what ``momentum=None`` exports as), a user's subclass, statistics that are
    not graph attributes, an input of unknown rank."""
    if len(node.args) != 9 or node.kwargs:
        return None
    x, weight, bias, mean, var, training, momentum, eps, _ = node.args
    cls = _TORCH_BATCH_NORMS.get(_module_class(node))
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    tensors = [a for a in (weight, bias, mean, var) if a is not None]
    if training is not False or cls is None or not isinstance(momentum, float) or momentum <= 0 \
            or not isinstance(eps, float) or (weight is None) != (bias is None) or mean is None or var is None \
            or not all(isinstance(a, fx.Node) and a.op == "get_attr" for a in tensors) \
            or not isinstance(val, torch.Tensor) or val.dim() not in _BATCH_NORM_RANKS[cls]:
        return None
    stats = [_attr(gm, a.target) for a in (mean, var)]
    features = stats[0].shape[0] if isinstance(stats[0], torch.Tensor) and stats[0].dim() == 1 else -1
    if features < 1 or any(not isinstance(t, torch.Tensor) or t.shape != (features,) for t in stats):
        return None
    mod = cls(features, eps=eps, momentum=momentum, affine=weight is not None,
              dtype=stats[0].dtype, device=stats[0].device)
    if weight is not None:
        params = [_attr(gm, a.target) for a in (weight, bias)]
        if not all(isinstance(p, torch.nn.Parameter) and p.shape == (features,) for p in params):
            return None
        mod.weight, mod.bias = params
    mod.running_mean, mod.running_var = stats
    return mod


def _switchable_dropout(node: fx.Node) -> Any:
    """A torch dropout module for an eval-mode exported call of one, or None."""
    if len(node.args) != 3 or node.kwargs or node.args[2] is not False or not isinstance(node.args[1], float):
        return None
    for cls in _DROPOUTS[node.target]:
        if _module_class(node) == f"{cls.__module__}.{cls.__qualname__}":
            return cls(node.args[1])
    return None


def _switchable_modules(gm: fx.GraphModule) -> list[str]:
    """An exported model's modules that behave differently in training, captured
    in eval mode, are calls with ``training=False`` baked in: the batch norms the
    QAT rules did not fold (a BatchNorm1d after a linear, one after a ReLU) would
    keep normalising with their running statistics and dropouts would never drop
    while the QAT model trains, where the model's own modules (and ``capture="fx"``)
    follow ``train()``. Each such call becomes a call of a module of the torch class
    it came from (its ``nn_module_stack``), so ``train()`` / ``eval()`` switch it;
    a call whose facts are unknown stays. Returns the new modules' names
    (``convert`` turns them back into the eval-mode calls)."""
    made = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten.batch_norm.default:
            mod = _switchable_batch_norm(gm, node)
        elif node.target in _DROPOUTS:
            mod = _switchable_dropout(node)
        else:
            continue
        if mod is None:
            continue
        name = _free_name(gm, f"trainable_{node.name}")
        gm.add_submodule(name, mod)
        with gm.graph.inserting_before(node):
            call = gm.graph.call_module(name, (node.args[0],))
        call.meta.update({k: v for k, v in node.meta.items() if k in ("val", "tensor_meta", "nn_module_stack",
                                                                         "stack_trace")})
        call.meta[_SWITCHABLE] = node.target
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        made.append(name)
    if made:
        gm.graph.lint()
        gm.recompile()
    return made


def _eval_mode_calls(gm: fx.GraphModule, names: Iterable[str]) -> None:
    """``convert``: the modules ``_switchable_modules`` made become the eval-mode
    aten calls again, the form ``rewrite.quant.convert`` reads in an exported graph
    (with the trained weights and statistics)."""
    names = set(names)
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or node.target not in names:
            continue
        mod = gm.get_submodule(node.target)
        with gm.graph.inserting_before(node):
            if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm):
                attrs = []
                for attr in ("weight", "bias", "running_mean", "running_var"):
                    tensor = getattr(mod, attr)
                    path = None if tensor is None else _free_name(gm, f"{node.target}_{attr}")
                    if path is not None:
                        gm.register_buffer(path, tensor.detach().clone())
                    attrs.append(None if path is None else gm.graph.get_attr(path))
                call = gm.graph.call_function(torch.ops.aten.batch_norm.default, (
                    node.args[0], *attrs, False, float(mod.momentum), float(mod.eps), False))
            else:
                call = gm.graph.call_function(node.meta[_SWITCHABLE], (node.args[0], float(mod.p), False))
        call.meta.update({k: v for k, v in node.meta.items() if k != _SWITCHABLE})
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
    gm.delete_all_unused_submodules()
    gm.graph.lint()
    gm.recompile()


def _attr(gm: fx.GraphModule, path: str) -> Any:
    owner, _, leaf = str(path).rpartition(".")
    try:
        return getattr(gm.get_submodule(owner) if owner else gm, leaf, None)
    except AttributeError:
        return None


def _free_name(gm: fx.GraphModule, base: str) -> str:
    base = base.replace(".", "_")
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name


def _drop_unused_attributes(gm: fx.GraphModule) -> None:
    """Erase ``get_attr`` nodes nothing reads (the weights of a layer the rules
    replaced) and the submodules no node uses: the QAT model's parameters are the
    ones it trains."""
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)
    gm.delete_all_unused_submodules()
    used = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    for name, _ in list(gm.named_parameters(recurse=False)) + list(gm.named_buffers(recurse=False)):
        if name not in used:
            delattr(gm, name)
    gm.graph.lint()
    gm.recompile()


def _tie_to_sources(captured: fx.GraphModule, qat: fx.GraphModule) -> int:
    """Each QAT layer trains the model's own parameter (of ``captured``, the flow's
    private copy of the model) instead of the copy the rule built it with, where that
    parameter is float32 and the copy still equals it: a weight tied between two
    layers (GPT-2's head and embeddings), or a layer called twice, stays one
    parameter. Returns how many parameters were tied back."""
    tied = 0
    for node in qat_layers(qat):
        mod = qat.get_submodule(node.target)
        for attr, path in node.meta.get(SOURCES_KEY, {}).items():
            mine = getattr(mod, attr, None)
            if not isinstance(mine, torch.nn.Parameter):
                continue
            try:
                source = captured.get_parameter(path)
            except AttributeError:  # a buffer or a constant: the copy is the layer's own
                continue
            if source.dtype == torch.float32 and source.shape == mine.shape and torch.equal(source, mine) \
                    and source.requires_grad == mine.requires_grad:
                setattr(mod, attr, source)
                tied += 1
    return tied


_BATCH_NORM_SOURCES = ("mean", "var", "gamma", "beta")


def _share_batch_norms(qat: fx.GraphModule) -> int:
    """QAT conv + batch norm layers built from one batch norm of the model (called
    after two convs) share one batch norm module, as the model has one: one gamma
    and beta to train, one set of running statistics that both calls update (and
    ``convert`` folds into both convs). Only where the copies still agree (values
    and settings). Returns how many batch norms were shared."""
    first: dict = {}
    shared = 0
    for node in qat_layers(qat):
        mod = qat.get_submodule(node.target)
        bn = getattr(mod, "bn", None)
        sources = node.meta.get(SOURCES_KEY, {})
        if not isinstance(bn, torch.nn.modules.batchnorm._BatchNorm) \
                or any(sources.get(k) is None for k in _BATCH_NORM_SOURCES):
            continue
        key = tuple(sources[k] for k in _BATCH_NORM_SOURCES)
        other = first.setdefault(key, bn)
        if other is bn or type(other) is not type(bn) or (other.eps, other.momentum, other.num_features) != (
                bn.eps, bn.momentum, bn.num_features):
            continue
        mine, theirs = bn.state_dict(), other.state_dict()
        if mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine) and all(
                a.requires_grad == b.requires_grad for a, b in zip(bn.parameters(), other.parameters())):
            mod.bn = other
            shared += 1
    return shared


def _name_layers(captured: fx.GraphModule, qat: fx.GraphModule) -> None:
    """Give each QAT layer the dotted path of the conv / linear it replaced
    (``module.layer = "conv1"``), found by its weight among the captured model's
    parameters: ``convert`` names the int8 modules after it, as PTQ does (a conv's
    QAT module otherwise carries its batch norm's path, the node the rule rewrote)."""
    params = [(name, t) for name, t in captured.named_parameters() if name.endswith("weight")]
    for node in qat_layers(qat):
        mod = qat.get_submodule(node.target)
        same = [name for name, t in params if t.shape == mod.weight.shape and torch.equal(t, mod.weight)]
        if len(same) == 1:
            mod.layer = same[0][: -len(".weight")] if same[0].endswith(".weight") else same[0]


@one_thread_at_a_time()
@fake_mode_off()
def prepare_qat(
    model: Any,
    example_inputs: Any,
    *,
    ruleset: str = "main",
    rules: Any = None,
    backend: str = "x86",
    capture: str = "fx",
    calibration: Iterable | None = None,
    check: bool = False,
) -> fx.GraphModule:
    """Capture ``model`` and make it trainable with simulated quantization.

    Args:
        model: an ``nn.Module`` (captured with ``capture``; not modified) or a
            ``GraphModule`` (from ``torch.fx.symbolic_trace`` or
            ``torch.export.export(...).module()``; copied).
        example_inputs: a tuple of inputs (or one tensor).
        ruleset: which ruleset of the rule file: ``"main"`` (8-bit weights and
            activations) or ``"w4"`` (4-bit weights, 8-bit activations).
        rules: your own rule file (path or RuleSet) instead of ``rules/quant/qat.rw``:
            the policy (layers to skip, bit widths, per-tensor weights, observer kind).
        backend: the int8 engine ``convert`` will use (``rewrite.quant.BACKENDS``).
        capture: ``"fx"`` (symbolic_trace) or ``"export"`` (``torch.export``, non-strict).
        calibration: batches that initialise the fake quantizers' ranges (default:
            the example inputs), run with batch norms in eval mode.
        check: run the rewrite's equivalence check (every QAT rule is an intentional
            change, so it compares little; off by default).

    Returns:
        A GraphModule in training mode: fake quantizers (``fake_quant_nodes``) and
        QAT convs / linears (``qat_layers``) whose parameters are new tensors (the
        model's are copied), trainable with any optimizer. Its
        ``meta["rewrite.qat"]`` records the backend, ruleset, example inputs and
        rule counts for ``convert``.
    """
    import rewrite

    if backend not in ptq.BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {ptq.BACKENDS}")
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    loaded = qat_rules() if rules is None else rules if hasattr(rules, "sets") else rewrite.load(rules)
    if ruleset not in loaded.sets:
        raise ValueError(f"no ruleset {ruleset!r} in the QAT rules; they have {sorted(loaded.sets)}")
    gm = _capture(model, args, capture)
    ptq.record_shapes(gm, args)
    # linear layers written as addmm (transformers' Conv1D) become linear first, as
    # rewrite.quant.prepare does (observe.rw's ruleset layers: exact)
    # the captured graph is read in eval mode: its weights are the constants the QAT
    # layers copy into new trainable parameters (an exported one reports training mode)
    layers = ptq.quant_rules("observe", "layers").apply(gm, args, check=check, trials=1, training=False)
    if layers.counts:
        gm = layers.graph_module
        ptq.record_shapes(gm, args)
    result = loaded[ruleset].apply(gm, args, check=check, trials=1, training=False)
    qat = result.graph_module
    qat.meta.pop(INFERENCE_KEY, None)  # read as inference, made to be trained
    _name_layers(gm, qat)
    _tie_to_sources(gm, qat)
    _share_batch_norms(qat)
    _allow_train_eval(qat)
    switchable = _switchable_modules(qat)
    _drop_unused_attributes(qat)
    merged = _merge_fake_quants(qat)
    if not fake_quant_nodes(qat):
        dtypes = sorted({str(t.dtype).replace("torch.", "") for t in pytree.tree_leaves(args)
                         if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float32})
        if dtypes:
            raise QATError(f"the QAT rules inserted no fake quantizer: the inputs are {', '.join(dtypes)}, and "
                           "int8 kernels and fake quantizers take float32 (convert the model with .float())")
        left = ptq.coverage(gm).left_float
        if left:
            # convs and linears the rules cannot quantize (inside a leaf module the
            # capture calls whole, a transposed conv...): named, as coverage names them
            named = "; ".join(f"{f.layer} ({f.op}): {f.reason}" for f in left)
            raise QATError(f"the QAT rules inserted no fake quantizer: every conv and linear of the model "
                           f"stays float: {named}")
        raise QATError("the QAT rules inserted no fake quantizer: the model has no conv, linear, add, "
                       "mul, cat or matmul they quantize")
    qat.meta[_META] = {"backend": backend, "ruleset": ruleset, "example_inputs": args,
                       "counts": dict(result.counts), "merged": merged,
                       "switchable": switchable}
    # the example inputs on copies: a model that writes its input must not write the caller's
    calibrate(qat, [_copies(args)] if calibration is None else calibration)
    qat.train()
    return qat


def _copies(args: tuple) -> tuple:
    """Copies of a batch's tensors, nested ones too: a model that writes its input
    must not write the caller's."""
    return tuple(pytree.tree_map_only(torch.Tensor, lambda t: t.clone(), tuple(args)))


@one_thread_at_a_time()
@fake_mode_off()
def calibrate(qat: fx.GraphModule, batches: Iterable) -> int:
    """Set the fake quantizers' ranges from ``batches`` (each a tensor or a tuple
    of inputs) as PTQ calibrates: batch norms in eval mode (their statistics
    unchanged), fake quantizers observing, no gradients. The model's mode is
    restored. Returns the number of batches."""
    ptq.require_batches(batches, "calibrate")
    modes = {m: m.training for m in qat.modules()}
    qat.eval()
    for node in fake_quant_nodes(qat):
        mod = qat.get_submodule(node.target)
        mod.train()
        mod.activation_post_process.reset_min_max_vals()
    n = 0
    try:
        with torch.no_grad(), ptq.model_state_kept(qat, [qat.get_submodule(node.target)
                                                        for node in fake_quant_nodes(qat)]):
            for batch in batches:
                ptq.run_calibration_batch(qat, _copies(tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)),
                                          n, QATError)
                n += 1
    finally:
        for m, mode in modes.items():
            m.training = mode
    if n == 0:
        raise QATError("calibrate got no batch: the fake quantizers need at least one to set their ranges")
    return n


class FrozenObserver(ObserverBase):
    """An observer that has already decided: it returns its input and reports the
    scale and zero point a trained fake quantizer ended with. ``convert`` puts one
    where each activation fake quantizer was, for ``rewrite.quant.convert``."""

    def __init__(self, scale: float, zero_point: int, dtype: Any, quant_min: int, quant_max: int) -> None:
        super().__init__(dtype=dtype)
        self.qscheme = torch.per_tensor_affine
        self.quant_min, self.quant_max = int(quant_min), int(quant_max)
        self.register_buffer("scale", torch.tensor([float(scale)]))
        self.register_buffer("zero_point", torch.tensor([int(zero_point)]))
        # the range these parameters represent (finite: "this observer saw data")
        self.register_buffer("min_val", torch.tensor((quant_min - zero_point) * float(scale)))
        self.register_buffer("max_val", torch.tensor((quant_max - zero_point) * float(scale)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    @torch.jit.export
    def calculate_qparams(self) -> tuple:
        return self.scale.clone(), self.zero_point.clone()

    def extra_repr(self) -> str:
        return f"scale={float(self.scale):.6g}, zero_point={int(self.zero_point)}"


def _freeze_layer(gm: fx.GraphModule, node: fx.Node, aten: bool, qdq: bool = False) -> None:
    """``QATLayer`` call -> ``conv(x, dequantize(w_int8), b)`` / ``linear(...)``; with
    ``qdq`` (the PT2E form ``export`` and ``export_onnx`` take) the weight is a plain
    int8 tensor read through ``quantized_decomposed.dequantize_per_channel`` /
    ``_per_tensor`` with its scales, as ``convert.rw``'s ``conv_weight_pt2e`` writes it."""
    mod: QATLayer = gm.get_submodule(node.target)
    try:
        q, bias = mod.frozen()
    except ValueError as err:
        raise QATError(f"{node.target}: {err}") from None
    base = str(node.target).replace(".", "_")
    wname, bname = f"{base}_weight_int8", f"{base}_bias"
    gm.register_buffer(wname, q.int_repr() if qdq else q)
    if bias is not None:
        gm.register_buffer(bname, bias)
    with gm.graph.inserting_before(node):
        w = gm.graph.get_attr(wname)
        if qdq:
            wd = _pt2e_dequantize(gm, w, q, base, mod.weight_fake_quant)
        else:
            wd = gm.graph.call_function(torch.ops.aten.dequantize.self if aten else torch.dequantize, (w,))
        b = gm.graph.get_attr(bname) if bias is not None else None
        if mod.kind == "conv":
            target = getattr(torch.ops.aten, f"conv{mod.rank}d").default if aten else getattr(torch, f"conv{mod.rank}d")
            padding = mod.padding
            if isinstance(padding, str) and aten:
                target = getattr(torch.ops.aten, f"conv{mod.rank}d").padding
            new = gm.graph.call_function(target, (node.args[0], wd, b, _listed(mod.stride, aten, mod.rank),
                                                  _listed(padding, aten, mod.rank), _listed(mod.dilation, aten, mod.rank), mod.groups))
        else:
            target = torch.ops.aten.linear.default if aten else torch.nn.functional.linear
            new = gm.graph.call_function(target, (node.args[0], wd, b))
    new.meta.update({k: v for k, v in node.meta.items() if k != "rewrite_facts"})
    layer = getattr(mod, "layer", None)
    if layer:  # what the int8 module is named after (rewrite.functions.quant.module_path)
        stack = dict(new.meta.get("nn_module_stack") or {})
        stack[f"rewrite.qat.{layer}"] = (layer, "Conv" if mod.kind == "conv" else "Linear")
        new.meta["nn_module_stack"] = stack
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def _pt2e_dequantize(gm: fx.GraphModule, w: fx.Node, q: torch.Tensor, base: str, fq: Any) -> fx.Node:
    """``quantized_decomposed.dequantize_per_*(w, ...)`` of the int8 weight ``w``
    read as ``q`` (a per-channel or per-tensor ``qint8``) within ``fq``'s range."""
    import torch.ao.quantization.fx._decomposed  # noqa: F401 - registers quantized_decomposed

    ops = torch.ops.quantized_decomposed
    lo, hi = fq.quant_min, fq.quant_max
    if q.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
        scales, zps = f"{base}_weight_scales", f"{base}_weight_zero_points"
        gm.register_buffer(scales, q.q_per_channel_scales().float())
        gm.register_buffer(zps, q.q_per_channel_zero_points().long())
        args = (w, gm.graph.get_attr(scales), gm.graph.get_attr(zps), q.q_per_channel_axis(), lo, hi, torch.int8)
        return gm.graph.call_function(ops.dequantize_per_channel.default, args)
    return gm.graph.call_function(ops.dequantize_per_tensor.default,
                                  (w, float(q.q_scale()), int(q.q_zero_point()), lo, hi, torch.int8))


def _listed(value: Any, aten: bool, rank: int) -> Any:
    """A conv's stride / padding / dilation as the op takes it: aten wants one int
    per spatial dim in a list."""
    if not aten or isinstance(value, str):
        return value
    if isinstance(value, int):
        return [value] * rank
    return list(value) if len(value) == rank else list(value) * rank


@one_thread_at_a_time()
@fake_mode_off()
def convert(qat: fx.GraphModule, **options: Any) -> Any:
    """Turn a trained QAT model into an int8 model with ``rewrite.quant.convert``.

    Args:
        qat: what ``prepare_qat`` returned, trained (not modified).
        options: passed to ``rewrite.quant.convert`` (``lower=False`` for the
            reference QDQ model, ``check``, ``min_qdq_sqnr``, ``reference``...).

    Returns:
        What ``rewrite.quant.convert`` returns: the GraphModule running the same
        ``torch.ops.quantized`` kernels as a PTQ model, its
        ``meta["rewrite.quant"]`` with the quantization points, rule counts and
        coverage. Its outputs match ``qat.eval()``'s within int8 kernel rounding.
    """
    from rewrite.ops import detect_dialect

    state = qat.meta.get(_META) if isinstance(qat, fx.GraphModule) else None
    if state is None:
        raise QATError("convert takes the GraphModule prepare_qat returned (it has no QAT metadata)")
    gm = copy.deepcopy(qat)
    _allow_train_eval(gm)
    _eval_mode_calls(gm, state.get("switchable", ()))
    gm.eval()
    gm.requires_grad_(False)
    aten = detect_dialect(gm) == "aten"
    qdq = options.get("form") == "qdq"
    for node in qat_layers(gm):
        _freeze_layer(gm, node, aten, qdq)
    for node in fake_quant_nodes(gm):
        fq = gm.get_submodule(node.target)
        scale, zp = fq.scale, fq.zero_point
        frozen = FrozenObserver(float(scale.reshape(-1)[0]), int(zp.reshape(-1)[0]), fq.dtype,
                                fq.quant_min, fq.quant_max)
        parent, _, leaf = str(node.target).rpartition(".")
        setattr(gm.get_submodule(parent) if parent else gm, leaf, frozen)
    gm.delete_all_unused_submodules()
    gm.graph.lint()
    gm.recompile()
    gm.meta["rewrite.quant"] = {  # what rewrite.quant.prepare records for its convert
        "backend": state["backend"], "ruleset": state["ruleset"], "example_inputs": state["example_inputs"]}
    return ptq.convert(gm, **options)
