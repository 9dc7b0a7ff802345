"""Predicates, rewrite-time functions and int8 modules of the quantization rule sets.

The rule files in ``rules/quant/`` name these (see ``rewrite.quant`` for the flow):

* ``observe.rw`` inserts ``activation_observer`` modules (torch's ``HistogramObserver``)
  where int8 kernels will read and write, asking ``observed``, ``output_observed``,
  ``feeds`` and ``produced_by`` where observers already are;
* ``convert.rw`` turns calibrated observers into ``quantize_per_tensor``/``dequantize``
  pairs and quantizes weights once (``quantize_weight``: torch's
  ``PerChannelMinMaxObserver``, per-channel symmetric int8);
* ``convert.rw``'s ruleset ``qdq`` writes the same quantization in the PT2E form
  instead (``torch.ops.quantized_decomposed`` quantize/dequantize on plain int8 and
  uint8 tensors; weights as int8 constants with their per-channel scales:
  ``weight_int8``, ``weight_scales``, ``weight_zero_points``, ``int_dtype``), which
  ``torch.export`` and ONNX export read;
* ``lower.rw`` replaces QDQ patterns by modules that call ``torch.ops.quantized``
  kernels with weights prepacked at rewrite time (``quantized_conv``,
  ``quantized_linear``, ``quantized_add``...), and removes redundant pairs
  (``has_qparams``).

Policy predicates for user rule files: ``module_name_matches(x, "layer4.*")`` and
``module_type_is(x, "Conv2d")`` look at the module a node came from
(``nn_module_stack``, or the ``call_module`` target).

The int8 modules hold torch's prepacked weights (``torch.ScriptObject``s, which
deep-copy and pickle); their ``forward`` is one ``torch.ops.quantized`` call.
"""

from __future__ import annotations

import fnmatch
import functools
import math
import struct
import warnings
import weakref
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch import nn
from torch.ao.quantization import observer as _observer

from rewrite.capture import normalize_module_path
from rewrite.engine.facts import Value, tensor_meta_of
from rewrite.functions.registry import (
    register_constant,
    register_module,
    register_predicate,
    register_query,
)

__all__ = [
    "PASSTHROUGH_OPS", "QuantizedModule", "QuantizedConv", "QuantizedConvAdd", "QuantizedLinear",
    "QuantizedBinary", "QuantizedCat", "QuantizedPad", "is_observer_node", "module_path", "module_type", "qparams_of",
    "passthrough_input", "vnni_available", "FiniteHistogramObserver", "FiniteMinMaxObserver",
    "FiniteMovingAverageMinMaxObserver", "conv_padding_ints", "conv_padding_problem",
    "DECOMPOSED_QUANTIZE", "DECOMPOSED_DEQUANTIZE", "is_quantize", "is_dequantize", "reaches",
]

#: Ops that run on quantized tensors with their input's scale and zero point: an
#: observed value stays observed through them, and ``lower.rw`` runs them on int8.
PASSTHROUGH_OPS = frozenset({
    "max_pool2d", "adaptive_avg_pool2d", "avg_pool2d", "relu", "hardtanh", "relu6", "flatten",
    "reshape", "view", "permute", "transpose", "contiguous", "identity", "squeeze",
    "unsqueeze", "clone",
})

#: Ops whose output an activation after them (relu, clamp) may be fused into.
_FUSABLE = ("conv", "linear", "add", "mul")
_ACTIVATIONS = ("relu", "hardtanh", "relu6")


# ---------------------------------------------------------------- graph helpers


def _gm(x: Value) -> Any:
    return x.facts.gm


def ops_of(node: Any, gm: Any) -> dict:
    """Canonical op name -> Bound for every vocabulary binding of ``node``."""
    if not isinstance(node, fx.Node) or not node.op.startswith("call_"):
        return {}
    from rewrite.ops import bind_node

    return {b.op: b for b in bind_node(node, gm)}


def _decomposed(*names: str) -> frozenset:
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers the ops)

    ops = torch.ops.quantized_decomposed
    return frozenset(getattr(getattr(ops, n), o) for n in names for o in getattr(ops, n).overloads())


#: The PT2E quantize / dequantize ops (``torch.ops.quantized_decomposed``), every overload.
DECOMPOSED_QUANTIZE = _decomposed("quantize_per_tensor", "quantize_per_channel")
DECOMPOSED_DEQUANTIZE = _decomposed("dequantize_per_tensor", "dequantize_per_channel")


def is_quantize(node: Any, gm: Any) -> bool:
    """``node`` rounds a float tensor to int8: ``quantize_per_tensor`` (a quantized
    tensor) or its PT2E form (a plain int8/uint8 tensor)."""
    return isinstance(node, fx.Node) and (
        (node.op == "call_function" and node.target in DECOMPOSED_QUANTIZE)
        or "quantize_per_tensor" in ops_of(node, gm))


def is_dequantize(node: Any, gm: Any) -> bool:
    """``node`` turns int8 back into float: ``dequantize`` or its PT2E form."""
    return isinstance(node, fx.Node) and (
        (node.op == "call_function" and node.target in DECOMPOSED_DEQUANTIZE)
        or "dequantize" in ops_of(node, gm))


def is_observer_node(node: Any, gm: Any) -> bool:
    """``node`` calls a torch quantization observer module."""
    if not isinstance(node, fx.Node) or node.op != "call_module":
        return False
    from torch.ao.quantization.observer import ObserverBase

    try:
        return isinstance(gm.get_submodule(node.target), ObserverBase)
    except AttributeError:
        return False


def passthrough_input(node: Any, gm: Any) -> Any:
    """The tensor input of ``node`` when it is a passthrough op (its output keeps
    the input's quantization parameters), else None. Constant zero padding counts,
    in every spelling the vocabulary's ``pad`` knows (``F.pad``, ``aten.pad``,
    ``constant_pad_nd``), which is what ``lower.rw``'s ``int8_pad`` runs on int8: a
    spelling it does not know is no passthrough, so the observe rules observe what
    comes out of it."""
    if not isinstance(node, fx.Node):
        return None
    ops = ops_of(node, gm)
    pad = ops.get("pad")
    if pad is not None:
        mode, value = pad.args.get("mode", "constant"), pad.args.get("value")
        zero = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0)
        return pad.args.get("input") if mode == "constant" and zero else None
    for op, bound in ops.items():
        if op in PASSTHROUGH_OPS:
            return bound.args.get("input")
    return None


def _observed(node: Any, gm: Any) -> bool:
    for _ in range(64):
        if is_observer_node(node, gm):
            return True
        node = passthrough_input(node, gm)
        if node is None:
            return False
    return False


def _single_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def module_path(node: fx.Node, gm: Any = None) -> str | None:
    """Dotted path of the module ``node`` came from (``layer4.0.conv1``): the
    ``call_module`` target of an original module, else the innermost entry of
    ``nn_module_stack`` (symbolic_trace and torch.export record it)."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        path = path[len("L__self__"):] if path.startswith("L__self__") else path
        return normalize_module_path(path.split("@")[0])  # dynamo's L['self'].layers[0] is layers.0
    if node.op == "call_module":
        return str(node.target)
    return None


def module_type(node: fx.Node, gm: Any = None) -> str | None:
    """Class name of the module ``node`` came from (``Conv2d``), or None."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        cls = list(stack.values())[-1][1]
        name = cls if isinstance(cls, str) else getattr(cls, "__qualname__", str(cls))
        return name.rsplit(".", 1)[-1]
    if node.op == "call_module" and gm is not None:
        try:
            return type(gm.get_submodule(node.target)).__name__
        except AttributeError:
            return None
    return None


def qparams_of(node: Any, gm: Any) -> tuple | None:
    """``(scale, zero_point)`` of the quantized tensor ``node`` computes, when the
    graph says it: an int8 module, a ``quantize_per_tensor`` with literal
    parameters, or a passthrough op of such a value."""
    for _ in range(64):
        if not isinstance(node, fx.Node):
            return None
        if node.op == "call_module":
            try:
                mod = gm.get_submodule(node.target)
            except AttributeError:
                return None
            return (mod.scale, mod.zero_point) if isinstance(mod, QuantizedModule) else None
        bound = ops_of(node, gm).get("quantize_per_tensor")
        if bound is not None:
            s, z = bound.args["scale"], bound.args["zero_point"]
            return (float(s), int(z)) if isinstance(s, (int, float)) and isinstance(z, int) else None
        node = passthrough_input(node, gm)
    return None


# ---------------------------------------------------------------- predicates


def _meta(x: Value) -> Any:
    """Shape facts of ``x``; an observer returns its input, so it has its input's
    facts (the engine copies facts onto an inserted module only when its input
    already has them)."""
    node, gm = x.node, _gm(x)
    if node is None:
        return x.meta
    while is_observer_node(node, gm) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return x.facts.meta(node)


@register_predicate()
def activation(x: Value) -> bool:
    """A float32 tensor computed by the graph from its inputs or weights (not a
    weight or literal): what activation observers watch. Not a value the graph
    computes from nothing but literals (``cumsum(ones(ids.shape))``: position ids on
    their way to ``.long()``, which int8 rounding would shift by one), and not
    another float dtype (int8 kernels and torch's observers take float32), and not
    an empty tensor (an empty KV cache concatenated in front of the keys: an observer
    on it would see no data to calibrate)."""
    node = x.node
    if node is None or node.op == "get_attr":
        return False
    m = _meta(x)
    if m is None or getattr(m, "dtype", None) is None:
        return None  # unknown: the where clause does not hold
    if any(isinstance(d, int) and d == 0 for d in getattr(m, "shape", ())):
        return False
    return m.dtype == torch.float32 and _from_inputs_or_weights(node)


def _from_inputs_or_weights(node: fx.Node) -> bool:
    """``node`` reads, through the graph, a graph input, a weight or a module call:
    it is not computed from literals alone. Worked out once per node of a graph."""
    known = _SOURCED.setdefault(node.graph, {})
    stack = [node]
    while stack:
        n = stack[-1]
        if n in known:
            stack.pop()
            continue
        if n.op in ("placeholder", "get_attr", "call_module") or _reads_metadata(n):
            known[n] = _float_source(n)
            stack.pop()
            continue
        pending = [i for i in n.all_input_nodes if i not in known]
        if pending:
            stack.extend(pending)
            continue
        known[n] = any(known[i] for i in n.all_input_nodes)
        stack.pop()
    return known[node]


def _reads_metadata(node: fx.Node) -> bool:
    """``x.shape``, ``x.size()``, ``x.dtype``, ``aten.sym_size``: what a value's
    metadata says, not its data."""
    target = node.target
    if node.op == "call_function" and target is getattr:
        return True
    if node.op == "call_method" and target in ("size", "dim", "numel"):
        return True
    return node.op == "call_function" and str(getattr(target, "__name__", "")).startswith("sym_size")


def _float_source(node: fx.Node) -> bool:
    """A graph input whose recorded dtype is floating (or unknown), a weight or a
    module call; not metadata."""
    if _reads_metadata(node):
        return False
    if node.op != "placeholder":
        return True
    meta = tensor_meta_of(node)
    dtype = getattr(meta, "dtype", None)
    return dtype is None or dtype.is_floating_point


_SOURCED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # graph -> {node: _from_inputs_or_weights}


@register_predicate()
def shapes_equal(a: Value, b: Value) -> bool:
    """Both tensors have the same known shape (seeing through observers)."""
    ma, mb = _meta(a), _meta(b)
    if ma is None or mb is None:
        return False if a.is_literal or b.is_literal else None
    return tuple(ma.shape) == tuple(mb.shape)


@register_predicate()
def observed(x: Value) -> bool:
    """``x`` comes out of an observer, directly or through passthrough ops (pooling,
    relu, reshapes, zero padding) that keep its quantization parameters."""
    return _observed(x.node, _gm(x))


@register_predicate()
def output_observed(x: Value) -> bool:
    """Every user of ``x`` is an observer (and it has at least one)."""
    node = x.node
    return node is not None and bool(node.users) and all(is_observer_node(u, _gm(x)) for u in node.users)


@register_predicate(op_names_from=1)
def feeds(x: Value, *ops: Value) -> bool:
    """``x`` has exactly one user and it is one of the named ops: ``feeds(c, "relu")``."""
    node = x.node
    user = _single_user(node) if node is not None else None
    return user is not None and bool(set(ops_of(user, _gm(x))) & {o.literal for o in ops})


@register_predicate(op_names_from=1)
def produced_by(x: Value, *ops: Value) -> bool:
    """``x`` is the output of one of the named ops: ``produced_by(y, "conv", "linear")``."""
    return bool(set(ops_of(x.node, _gm(x))) & {o.literal for o in ops})


def reaches(node: Any, gm: Any, hit: Any, step: Any = None, limit: int = 64) -> bool:
    """``hit(node, gm)`` holds for ``node`` or for what it reads through at most
    ``limit`` passthrough steps (``step(node, gm)``: ``passthrough_input`` unless given)."""
    step = step or passthrough_input
    for _ in range(limit):
        if node is None:
            return False
        if hit(node, gm):
            return True
        node = step(node, gm)
    return False


@register_predicate()
def dequantized(x: Value) -> bool:
    """``x`` is a ``dequantize`` output, directly or through passthrough ops."""
    return reaches(x.node, _gm(x), is_dequantize)


@register_predicate()
def output_quantized(x: Value) -> bool:
    """Every user of ``x`` quantizes it, or its one user is a fusable activation
    (relu, hardtanh, relu6) or a residual ``add`` (then maybe relu) whose users
    all quantize: what one int8 kernel computes."""
    node, gm = x.node, _gm(x)
    if node is None or not node.users:
        return False

    def all_quantize(n: fx.Node) -> bool:
        return bool(n.users) and all(is_quantize(u, gm) for u in n.users)

    for _ in range(3):
        if all_quantize(node):
            return True
        node = _single_user(node)
        if node is None or not set(ops_of(node, gm)) & {*_ACTIVATIONS, "add"}:
            return False
    return False


def _fused_add_of(node: fx.Node, gm: Any) -> fx.Node | None:
    """The ``add`` a conv output may be fused into (onednn's conv2d_add): the
    conv's only user, adding another activation of the same shape. When both
    operands are such convs, only the later one in graph order fuses."""
    user = _single_user(node)
    bound = ops_of(user, gm).get("add") if user is not None else None
    if bound is None or bound.args.get("alpha", 1) != 1:
        return None
    a, b = bound.args.get("input"), bound.args.get("other")
    other = b if a is node else a if b is node else None
    if not isinstance(other, fx.Node) or other is node:
        return None
    if "conv" in ops_of(other, gm) and _single_user(other) is user:
        order = {n: i for i, n in enumerate(node.graph.nodes)}
        if order[other] > order[node]:
            return None
    return user


@register_predicate()
def fuses_add(x: Value) -> bool:
    """``x`` is a conv output that onednn's ``conv2d_add`` fuses into the ``add``
    after it (see ``rules/quant/observe.rw``, ruleset ``onednn``)."""
    node, gm = x.node, _gm(x)
    return node is not None and "conv" in ops_of(node, gm) and _fused_add_of(node, gm) is not None


@register_predicate()
def has_qparams(x: Value, scale: Value, zero_point: Value) -> bool:
    """``x`` is a quantized tensor known to have this scale and zero point."""
    q = qparams_of(x.node, _gm(x))
    s, z = scale.literal, zero_point.literal
    if q is None or not isinstance(s, (int, float)) or not isinstance(z, int):
        return False
    return math.isclose(q[0], float(s), rel_tol=1e-9, abs_tol=0.0) and q[1] == z


@register_predicate()
def module_name_matches(x: Value, pattern: Value) -> bool:
    """The module ``x`` came from has a dotted path matching the glob ``pattern``
    (``"layer4.*"``, ``"*.downsample.*"``, ``"classifier"``)."""
    node, pat = x.node, pattern.literal
    if node is None or not isinstance(pat, str):
        return False
    path = module_path(node, _gm(x))
    return path is not None and fnmatch.fnmatchcase(path, pat)


@register_predicate()
def module_type_is(x: Value, *names: Value) -> bool:
    """The module ``x`` came from is of one of the named classes (``"Conv2d"``,
    ``"BertSelfAttention"``; the class name without its module)."""
    node = x.node
    if node is None:
        return False
    kind = module_type(node, _gm(x))
    return kind is not None and kind in {n.literal for n in names}


@register_predicate()
def symmetric_pad(x: Value, pad: Value) -> bool:
    """``pad`` (last dim first: left, right, top, bottom...) pads exactly the spatial
    dims of the conv input ``x`` and as much before as after each: the conv's own
    ``padding`` can do it."""
    p, m = pad.literal, _meta(x)
    if not (isinstance(p, (list, tuple)) and len(p) in (2, 4, 6) and all(isinstance(v, int) and v >= 0 for v in p)
            and all(p[i] == p[i + 1] for i in range(0, len(p), 2))):
        return False
    return None if m is None else len(m.shape) == len(p) // 2 + 2


@register_constant()
def conv_padding(pad: Any) -> Any:
    """The conv ``padding`` (first spatial dim first) equal to a symmetric ``pad`` list."""
    return tuple(pad[i] for i in range(len(pad) - 2, -1, -2))


def conv_padding_problem(padding: Any, kernel: Any, dilation: Any = 1) -> str | None:
    """Why an int8 conv kernel cannot take a conv's ``padding``, or None when it can.

    The kernels take integer padding, as much before as after each spatial dim.
    ``"valid"`` is 0. ``"same"`` (stride 1) pads ``dilation * (kernel - 1)`` in all,
    torch putting the odd one after: symmetric, ``dilation * (kernel - 1) // 2`` on
    each side, only where that total is even (an odd kernel, or an even dilation)."""
    if not isinstance(padding, str):
        return None
    if padding == "valid":
        return None
    if padding != "same":
        return f"padding {padding!r}"
    kernel = tuple(int(k) for k in kernel)
    try:
        dil = _per_dim(dilation, len(kernel), "dilation")
    except ValueError:
        return f"dilation {dilation!r}"
    totals = [d * (k - 1) for k, d in zip(kernel, dil)]
    if all(t % 2 == 0 for t in totals):
        return None
    before = [t // 2 for t in totals]
    after = [t - b for t, b in zip(totals, before)]
    shape = "x".join(map(str, kernel))
    return (f"asymmetric 'same' padding: kernel {shape}, dilation {'x'.join(map(str, dil))} pads "
            f"{tuple(before)} before, {tuple(after)} after")


def conv_padding_ints(padding: Any, kernel: Any, dilation: Any = 1) -> list:
    """A conv's ``padding`` as one int per spatial dim, what int8 kernels take:
    ints as they are, ``"valid"`` 0, symmetric ``"same"`` ``dilation * (kernel - 1) // 2``.
    Raises ``ValueError`` with the reason (``conv_padding_problem``) otherwise."""
    rank = len(tuple(kernel))
    problem = conv_padding_problem(padding, kernel, dilation)
    if problem is not None:
        raise ValueError(f"quantized conv: {problem}")
    if padding == "valid":
        return [0] * rank
    if padding == "same":
        return [d * (int(k) - 1) // 2 for k, d in zip(kernel, _per_dim(dilation, rank, "dilation"))]
    return _per_dim(padding, rank, "padding")


@register_predicate()
def int8_padding(w: Value, padding: Value, dilation: Value) -> bool:
    """The padding of a conv with weight ``w`` is one an int8 kernel takes: integers,
    ``"valid"``, or ``"same"`` that pads as much before as after each dim (see
    ``conv_padding_problem``; an even kernel's "same" pads one more after)."""
    p = padding.literal
    if not isinstance(p, str):
        return True
    m = w.meta
    shape = getattr(m, "shape", None) if m is not None else None
    if shape is None or len(shape) < 3:
        return None  # unknown: the where clause does not hold
    return conv_padding_problem(p, tuple(shape)[2:], dilation.literal) is None


@register_query()
def module_name(x: Value) -> str | None:
    """The dotted path of the module ``x`` came from, or None."""
    return None if x.node is None else module_path(x.node, _gm(x))


# ---------------------------------------------------------------- rewrite-time constants

_WEIGHT_SCHEMES = ("per_channel_symmetric", "per_channel_affine", "per_tensor_symmetric", "per_tensor_affine")


def _weight_observer(scheme: str) -> Any:
    from torch.ao.quantization.observer import MinMaxObserver, PerChannelMinMaxObserver

    if scheme == "per_channel_symmetric":
        return PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
    if scheme == "per_channel_affine":
        return PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_affine)
    if scheme == "per_tensor_symmetric":
        return MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    if scheme == "per_tensor_affine":
        return MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_affine)
    raise ValueError(f"unknown weight scheme {scheme!r}; expected one of {_WEIGHT_SCHEMES}")


@register_constant()
def mat_weight(w: Any) -> Any:
    """The ``linear`` weight (out_features x in_features) of a matrix ``w`` that
    ``addmm(b, x, w)`` multiplies on the right: ``w`` transposed, contiguous
    (transformers' ``Conv1D``, GPT-2's linear layers, stores it that way)."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise TypeError("mat_weight takes a 2-d weight tensor")
    return w.detach().t().contiguous()


@register_constant(choices={"scheme": ("per_channel_symmetric", "per_channel_affine", "per_tensor_symmetric",
                                        "per_tensor_affine")})
def quantize_weight(w: Any, scheme: str = "per_channel_symmetric") -> Any:
    """A float weight quantized to int8 once, at rewrite time, with the parameters
    torch's weight observer computes: ``"per_channel_symmetric"`` (torch's
    ``PerChannelMinMaxObserver``, output channels on dim 0; what the x86 and onednn
    kernels prefer), ``"per_channel_affine"``, ``"per_tensor_symmetric"``,
    ``"per_tensor_affine"``."""
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise TypeError("quantize_weight takes a float weight tensor")
    w = w.detach().float()
    obs = _weight_observer(scheme)
    obs(w)
    scale, zero_point = obs.calculate_qparams()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if scheme.startswith("per_channel"):
            return torch.quantize_per_channel(w, scale.double(), zero_point.long(), 0, torch.qint8)
        return torch.quantize_per_tensor(w, float(scale), int(zero_point), torch.qint8)


def _weight_qparams(w: Any, scheme: str) -> tuple:
    """(int8 values, float32 scales, int64 zero points) of ``quantize_weight(w,
    scheme)`` for a per-channel scheme: the same numbers the int8 kernels use."""
    if not scheme.startswith("per_channel"):
        raise ValueError(f"the qdq weight functions take a per-channel scheme, got {scheme!r}")
    q = quantize_weight(w, scheme)
    return (q.int_repr(), q.q_per_channel_scales().float(), q.q_per_channel_zero_points().long())


@register_constant()
def weight_int8(w: Any, scheme: str = "per_channel_symmetric") -> Any:
    """The int8 values (a plain ``torch.int8`` tensor) of ``quantize_weight(w, scheme)``,
    output channels on dim 0: the weight of the PT2E QDQ form."""
    return _weight_qparams(w, scheme)[0]


@register_constant()
def weight_scales(w: Any, scheme: str = "per_channel_symmetric") -> Any:
    """The per-channel scales (float32) of ``quantize_weight(w, scheme)``."""
    return _weight_qparams(w, scheme)[1]


@register_constant()
def weight_zero_points(w: Any, scheme: str = "per_channel_symmetric") -> Any:
    """The per-channel zero points (int64) of ``quantize_weight(w, scheme)``."""
    return _weight_qparams(w, scheme)[2]


@register_constant()
def int_dtype(quant_min: int, quant_max: int) -> Any:
    """The plain integer dtype whose range is ``[quant_min, quant_max]``, what the
    PT2E ops store: ``torch.uint8`` for 0..255, ``torch.int8`` for -128..127."""
    if (quant_min, quant_max) == (0, 255):
        return torch.uint8
    if (quant_min, quant_max) == (-128, 127):
        return torch.int8
    raise ValueError(f"no 8-bit integer dtype has the range [{quant_min}, {quant_max}]")


@register_constant()
def quant_dtype(quant_min: int, quant_max: int) -> Any:
    """The quantized dtype whose range is ``[quant_min, quant_max]``: ``torch.quint8``
    for 0..255, ``torch.qint8`` for -128..127."""
    if (quant_min, quant_max) == (0, 255):
        return torch.quint8
    if (quant_min, quant_max) == (-128, 127):
        return torch.qint8
    if (quant_min, quant_max) == (-(2 ** 31), 2 ** 31 - 1):
        return torch.qint32
    raise ValueError(f"no quantized dtype has the range [{quant_min}, {quant_max}]")


# ---------------------------------------------------------------- observers (inserted)


@functools.lru_cache(maxsize=1)
def vnni_available() -> bool:
    """The CPU has int8 dot-product instructions (AVX512-VNNI or AVX-VNNI, read from
    ``/proc/cpuinfo``): int8 kernels do not saturate and activations can use the
    full 8 bits. False when it cannot tell."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"})
    except OSError:
        pass
    return False


class _FiniteOnly:
    """Observers that record only the finite values they see, in float32 at least:
    torch's raise on NaN (``torch.histc``) or let it poison their range, and
    overflow on float16's largest values (their histogram's arithmetic in the
    input's dtype); the model's output is the input, unchanged, either way."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.detach()
        if d.dtype in (torch.float16, torch.bfloat16):
            d = d.float()
        if d.is_floating_point() and not bool(torch.isfinite(d).all()):
            d = d[torch.isfinite(d)]
            if not d.numel():
                return x
        super().forward(d)  # type: ignore[misc]
        return x


class FiniteHistogramObserver(_FiniteOnly, _observer.HistogramObserver):
    """torch's ``HistogramObserver``, recording finite values only."""

    def _non_linear_param_search(self) -> tuple[torch.Tensor, torch.Tensor]:
        """torch's search (``HistogramObserver._non_linear_param_search``), step for
        step, with the cumulative histogram read once into numbers: torch indexes it
        as a tensor at each of up to 100000 steps (0.6 s per observer on a MobileViT's
        activations, 195 observers). Each comparison is made as torch makes it, in the
        histogram's dtype (the bound rounded to it); the quantization error is torch's
        own (``_compute_quantization_error``). The same bins as torch:
        ``tests/test_quant.py``."""
        if self.histogram.size()[0] != self.bins:
            raise AssertionError("bins mismatch")
        bin_width = (self.max_val - self.min_val) / self.bins
        total = torch.sum(self.histogram).item()
        cumulative = torch.cumsum(self.histogram, dim=0)
        c_sum = cumulative.tolist()
        rounded = _rounder(cumulative.dtype)
        stepsize, alpha, beta = 1e-5, 0.0, 1.0
        start_bin, end_bin = 0, self.bins - 1
        norm_min = float("inf")
        while alpha < beta:
            next_alpha, next_beta = alpha + stepsize, beta - stepsize
            low, high = rounded(next_alpha * total), rounded(next_beta * total)
            left, right = start_bin, end_bin
            while left < end_bin and c_sum[left] < low:
                left += 1
            while right > start_bin and c_sum[right] > high:
                right -= 1
            next_start_bin, next_end_bin = start_bin, end_bin
            if (left - start_bin) > (end_bin - right):
                next_start_bin, alpha = left, next_alpha
            else:
                next_end_bin, beta = right, next_beta
            if next_start_bin == start_bin and next_end_bin == end_bin:
                continue
            norm = self._compute_quantization_error(next_start_bin, next_end_bin)
            if norm > norm_min:
                break
            norm_min, start_bin, end_bin = norm, next_start_bin, next_end_bin
        return self.min_val + bin_width * start_bin, self.min_val + bin_width * (end_bin + 1)


def _rounder(dtype: torch.dtype) -> Any:
    """A Python float rounded to ``dtype`` as torch rounds a number it compares with a
    tensor of that dtype (float32: to the nearest float32)."""
    if dtype == torch.float64:
        return float
    if dtype == torch.float32:
        return lambda v: struct.unpack("f", struct.pack("f", v))[0] if abs(v) < 3.4e38 else float(
            torch.tensor(v, dtype=torch.float64).to(dtype))
    return lambda v: float(torch.tensor(v, dtype=torch.float64).to(dtype))


class FiniteMinMaxObserver(_FiniteOnly, _observer.MinMaxObserver):
    """torch's ``MinMaxObserver``, recording finite values only."""


class FiniteMovingAverageMinMaxObserver(_FiniteOnly, _observer.MovingAverageMinMaxObserver):
    """torch's ``MovingAverageMinMaxObserver``, recording finite values only."""


_OBSERVERS = {"histogram": FiniteHistogramObserver, "minmax": FiniteMinMaxObserver,
              "moving_average": FiniteMovingAverageMinMaxObserver}


@register_module(inputs=("x",), choices={"kind": ("histogram", "minmax", "moving_average")})
def activation_observer(x: Any = None, kind: str = "histogram") -> nn.Module:
    """The default activation observer: torch's per-tensor affine ``quint8``
    ``HistogramObserver`` (``kind="histogram"``), ``MinMaxObserver`` (``"minmax"``)
    or ``MovingAverageMinMaxObserver`` (``"moving_average"``), recording finite
    values only. The range is reduced to 7 bits only on CPUs without VNNI, where
    fbgemm's int8 kernels can saturate."""
    if kind not in _OBSERVERS:
        raise ValueError(f"unknown observer kind {kind!r}; expected histogram, minmax or moving_average")
    return _OBSERVERS[kind](reduce_range=not vnni_available())


# ---------------------------------------------------------------- int8 modules


class QuantizedModule(nn.Module):
    """Base of the int8 modules ``lower.rw`` inserts: output ``scale`` and
    ``zero_point`` (what ``has_qparams`` and the accuracy report read)."""

    def __init__(self, scale: float, zero_point: int, op_name: str = "") -> None:
        super().__init__()
        self.scale = float(scale)
        self.zero_point = int(zero_point)
        self.op_name = op_name
        self._op = getattr(torch.ops.quantized, op_name) if op_name else None

    def extra_repr(self) -> str:
        return f"scale={self.scale:.6g}, zero_point={self.zero_point}"

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        """A strict load (the default) is refused, loudly: the int8 weights are prepacked
        and the activations' scales are literals of the graph's code, none of them in a
        state dict (``state_dict()`` has nothing of them), so it would change nothing and
        report success. Reported as a missing key that says so (torch hands every module
        ``strict=True``: a ``strict=False`` load, a head-only checkpoint, gets it back in
        its result instead). Save and load the whole model (``torch.save(model)``, a
        ``.pt2`` or ONNX export)."""
        missing_keys.append(f"{prefix}int8_weights (an int8 module made by rewrite.quant takes nothing from a state "
                            "dict: save and load the whole model, torch.save(model))")

    # torch.ops callables do not pickle: save the name, look the op up again on load
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_op", None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._op = getattr(torch.ops.quantized, self.op_name) if self.op_name else None


def _per_dim(value: Any, rank: int, name: str) -> list:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value] * rank
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        if len(value) == 1:
            return list(value) * rank
        if len(value) == rank:
            return list(value)
    raise ValueError(f"quantized conv: unsupported {name} {value!r}")


def _quantized_weight(w: Any) -> torch.Tensor:
    if not isinstance(w, torch.Tensor):
        raise TypeError("expected a weight tensor")
    if not w.is_quantized:  # a float weight: quantize it with the default scheme
        w = quantize_weight(w)
    return w.detach()


def _reads_padding_only(n: int, kernel: int, stride: int, pad: int, dilation: int) -> bool:
    """Some output position of a conv along a dim of ``n`` inputs has every tap in
    the padding (a 1x1 conv padded by 1, a dilated kernel over a size-1 dim)."""
    out = (n + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1
    return any(all(not 0 <= o * stride - pad + j * dilation < n for j in range(kernel)) for o in range(max(out, 0)))


def _depth_of_one(spatial: tuple, kernel: tuple) -> bool:
    """A 3-d conv over an input of depth 1 with a kernel deeper than 1: the x86 and
    onednn engines' int8 conv3d returns wrong values there (off by up to the whole
    int8 range, torch 2.13; with one thread or two), though every window reads the
    input; depth 2 and the other dims are right."""
    return len(kernel) == 3 and spatial[0] == 1 and kernel[0] > 1


class _PaddedWindows:
    """The int8 convs of the x86 and onednn engines return wrong values (and can
    crash) where a window lies wholly in the padding: their zero-point compensation
    assumes every window reads the input; their conv3d also errs over an input of
    depth 1 (``_depth_of_one``). On such input shapes (known per call, remembered per
    shape) the module computes what it replaced instead: dequantize, the float conv,
    quantize. ``window``: (stride, padding, dilation, groups) per spatial dim, as
    packed."""

    def _init_window(self, window: tuple, kernel: tuple) -> None:
        self.window, self.kernel = window, tuple(kernel)
        self._padded_only: dict = {}

    def _needs_reference(self, x: torch.Tensor) -> bool:
        window = getattr(self, "window", None)
        if window is None:
            return False
        spatial = tuple(x.shape[2:])
        hit = self._padded_only.get(spatial)
        if hit is None:
            stride, padding, dilation, _ = window
            hit = _depth_of_one(spatial, self.kernel) or any(
                _reads_padding_only(n, k, s, p, d)
                for n, k, s, p, d in zip(spatial, self.kernel, stride, padding, dilation))
            self._padded_only[spatial] = hit
        return hit

    def _reference(self, x: torch.Tensor, accum: torch.Tensor | None = None) -> torch.Tensor:
        stride, padding, dilation, groups = self.window
        rank = len(self.kernel)
        w, b = getattr(torch.ops.quantized, f"conv{rank}d_unpack")(self._packed)
        conv = getattr(torch.nn.functional, f"conv{rank}d")
        # strides made afresh: torch's float conv crashes on these windows too when an
        # operand reads as channels-last (a 1x1 weight's strides can)
        fresh = torch.contiguous_format
        y = conv(x.dequantize().clone(memory_format=fresh), w.dequantize().clone(memory_format=fresh), b, stride,
                 padding, dilation, groups)
        if accum is not None:
            y = y + accum.dequantize()
        if self.relu:
            y = torch.relu(y)
        return torch.quantize_per_tensor(y, self.scale, self.zero_point, x.dtype)


class QuantizedConv(_PaddedWindows, QuantizedModule):
    """``quantized::conv{1,2,3}d[_relu]`` with a weight prepacked once."""

    def __init__(self, packed: Any, rank: int, scale: float, zero_point: int, relu: bool,
                 weight_shape: tuple, window: tuple | None = None) -> None:
        super().__init__(scale, zero_point, f"conv{rank}d{'_relu' if relu else ''}")
        self._packed = packed
        self.rank = rank
        self.relu = relu
        self.weight_shape = tuple(weight_shape)
        self._init_window(window, self.weight_shape[2:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._needs_reference(x):
            return self._reference(x)
        return self._op(x, self._packed, self.scale, self.zero_point)

    def extra_repr(self) -> str:
        return f"weight={list(self.weight_shape)}, relu={self.relu}, " + super().extra_repr()


class QuantizedConvAdd(_PaddedWindows, QuantizedModule):
    """onednn's ``quantized::conv2d_add[_relu]``: ``relu(conv(x) + accum)`` in one
    kernel (the residual add of a ResNet block fused into its last conv)."""

    def __init__(self, packed: Any, scale: float, zero_point: int, relu: bool, weight_shape: tuple,
                 window: tuple | None = None) -> None:
        super().__init__(scale, zero_point, "conv2d_add_relu" if relu else "conv2d_add")
        self._packed = packed
        self.relu = relu
        self.weight_shape = tuple(weight_shape)
        self._init_window(window, self.weight_shape[2:])

    def forward(self, x: torch.Tensor, accum: torch.Tensor) -> torch.Tensor:
        if self._needs_reference(x):
            return self._reference(x, accum)
        # onednn reads the accumulator in the input's memory format, and may sum into
        # its memory and return it (channels_last; a 1x1 map in either layout): always
        # a copy, so the value (read again later, or the conv's own input) stays
        fmt = torch.channels_last if x.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
        laid = accum.contiguous(memory_format=fmt)
        accum = laid if laid is not accum else accum.clone(memory_format=fmt)
        return self._op(x, accum, self._packed, self.scale, self.zero_point)

    def extra_repr(self) -> str:
        return f"weight={list(self.weight_shape)}, relu={self.relu}, " + super().extra_repr()


class QuantizedLinear(QuantizedModule):
    """``quantized::linear[_relu]`` with a weight prepacked once."""

    def __init__(self, packed: Any, scale: float, zero_point: int, relu: bool, weight_shape: tuple) -> None:
        super().__init__(scale, zero_point, "linear_relu" if relu else "linear")
        self._packed = packed
        self.relu = relu
        self.weight_shape = tuple(weight_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self._packed, self.scale, self.zero_point)

    def extra_repr(self) -> str:
        return f"weight={list(self.weight_shape)}, relu={self.relu}, " + super().extra_repr()


class QuantizedBinary(QuantizedModule):
    """``quantized::add``, ``add_relu``, ``mul``, ``mul_relu``, ``matmul``."""

    def __init__(self, op: str, scale: float, zero_point: int) -> None:
        super().__init__(scale, zero_point, op)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self._op(a, b, self.scale, self.zero_point)

    def extra_repr(self) -> str:
        return f"op={self.op_name}, " + super().extra_repr()


class QuantizedCat(QuantizedModule):
    """``quantized::cat`` of int8 tensors into one with its own parameters."""

    def __init__(self, dim: int, scale: float, zero_point: int) -> None:
        super().__init__(scale, zero_point, "cat")
        self.dim = dim

    def forward(self, tensors: list) -> torch.Tensor:
        return self._op(list(tensors), self.dim, self.scale, self.zero_point)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, " + super().extra_repr()


class QuantizedPad(nn.Module):
    """Constant zero padding of an int8 tensor, done on its integer representation
    (padding with the zero point): exact, and several times faster than
    ``constant_pad_nd`` on a quantized tensor, which fills through float."""

    def __init__(self, pad: tuple) -> None:
        super().__init__()
        self.pad = tuple(pad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        zero_point = x.q_zero_point()
        padded = torch.nn.functional.pad(x.int_repr(), self.pad, value=zero_point)
        return torch._make_per_tensor_quantized_tensor(padded, x.q_scale(), zero_point)

    def extra_repr(self) -> str:
        return f"pad={list(self.pad)}"


@register_module(inputs=("x",))
def quantized_pad(x: Any = None, pad: Any = ()) -> nn.Module:
    """Zero padding (``F.pad`` amounts, last dim first) of a per-tensor int8 tensor."""
    if not isinstance(pad, (list, tuple)) or not all(isinstance(v, int) for v in pad):
        raise ValueError(f"quantized_pad: pad must be a list of ints, got {pad!r}")
    return QuantizedPad(tuple(pad))


def _check_qparams(scale: Any, zero_point: Any) -> None:
    if not isinstance(scale, (int, float)) or not isinstance(zero_point, int):
        raise TypeError(f"output scale/zero_point must be literals, got {scale!r}, {zero_point!r}")


@register_module(inputs=("x",))
def quantized_conv(x: Any = None, weight: Any = None, bias: Any = None, stride: Any = 1, padding: Any = 0,
                   dilation: Any = 1, groups: int = 1, scale: float = 1.0, zero_point: int = 0,
                   relu: bool = False) -> nn.Module:
    """An int8 conv (1d/2d/3d, optionally fused with relu): the weight (already
    quantized by ``quantize_weight``, or float) is prepacked for the current
    ``torch.backends.quantized.engine`` once; output ``scale``/``zero_point``.
    ``padding``: ints, ``"valid"``, or ``"same"`` where symmetric (``int8_padding``)."""
    _check_qparams(scale, zero_point)
    w = _quantized_weight(weight)
    rank = w.dim() - 2
    if rank not in (1, 2, 3):
        raise ValueError(f"quantized conv: weight of rank {w.dim()}")
    pd = conv_padding_ints(padding, w.shape[2:], dilation)  # "valid", symmetric "same" too
    st, dl = (_per_dim(v, rank, n) for v, n in ((stride, "stride"), (dilation, "dilation")))
    b = None if bias is None else bias.detach().float()
    if rank == 1:  # conv1d packs as a 2d conv over a height of 1
        packed = torch.ops.quantized.conv1d_prepack(w, b, st, pd, dl, groups)
    else:
        packed = getattr(torch.ops.quantized, f"conv{rank}d_prepack")(w, b, st, pd, dl, groups)
    return QuantizedConv(packed, rank, scale, zero_point, bool(relu), tuple(w.shape), (st, pd, dl, groups))


@register_module(inputs=("x", "accum"))
def quantized_conv_add(x: Any = None, accum: Any = None, weight: Any = None, bias: Any = None,
                       stride: Any = 1, padding: Any = 0, dilation: Any = 1, groups: int = 1,
                       scale: float = 1.0, zero_point: int = 0, relu: bool = False) -> nn.Module:
    """onednn's fused ``relu(conv2d(x) + accum)`` (``relu=False``: no relu); needs
    ``torch.backends.quantized.engine == "onednn"`` when packing and running."""
    _check_qparams(scale, zero_point)
    if torch.backends.quantized.engine != "onednn":
        raise RuntimeError("quantized_conv_add needs the onednn engine")
    w = _quantized_weight(weight)
    if w.dim() != 4:
        raise ValueError("quantized_conv_add: 2d convs only")
    pd = conv_padding_ints(padding, w.shape[2:], dilation)
    st, dl = (_per_dim(v, 2, n) for v, n in ((stride, "stride"), (dilation, "dilation")))
    b = None if bias is None else bias.detach().float()
    packed = torch.ops.quantized.conv2d_prepack(w, b, st, pd, dl, groups)
    return QuantizedConvAdd(packed, scale, zero_point, bool(relu), tuple(w.shape), (st, pd, dl, groups))


@register_module(inputs=("x",))
def quantized_linear(x: Any = None, weight: Any = None, bias: Any = None, scale: float = 1.0,
                     zero_point: int = 0, relu: bool = False) -> nn.Module:
    """An int8 linear (optionally fused with relu), weight prepacked once."""
    _check_qparams(scale, zero_point)
    w = _quantized_weight(weight)
    b = None if bias is None else bias.detach().float()
    packed = torch.ops.quantized.linear_prepack(w, b)
    return QuantizedLinear(packed, scale, zero_point, bool(relu), tuple(w.shape))


@register_module(inputs=("a", "b"))
def quantized_add(a: Any = None, b: Any = None, scale: float = 1.0, zero_point: int = 0,
                  relu: bool = False) -> nn.Module:
    """``quantized::add`` (``add_relu`` with ``relu=True``) of two int8 tensors."""
    _check_qparams(scale, zero_point)
    return QuantizedBinary("add_relu" if relu else "add", scale, zero_point)


@register_module(inputs=("a", "b"))
def quantized_mul(a: Any = None, b: Any = None, scale: float = 1.0, zero_point: int = 0,
                  relu: bool = False) -> nn.Module:
    """``quantized::mul`` (``mul_relu`` with ``relu=True``) of two int8 tensors."""
    _check_qparams(scale, zero_point)
    return QuantizedBinary("mul_relu" if relu else "mul", scale, zero_point)


@register_module(inputs=("a", "b"))
def quantized_matmul(a: Any = None, b: Any = None, scale: float = 1.0, zero_point: int = 0) -> nn.Module:
    """``quantized::matmul`` of two int8 tensors."""
    _check_qparams(scale, zero_point)
    return QuantizedBinary("matmul", scale, zero_point)


@register_module(inputs=("tensors",))
def quantized_cat(tensors: Any = None, dim: int = 0, scale: float = 1.0, zero_point: int = 0) -> nn.Module:
    """``quantized::cat`` of a list of int8 tensors, requantized to ``scale``/``zero_point``."""
    _check_qparams(scale, zero_point)
    return QuantizedCat(int(dim), scale, zero_point)


def quantized_modules(gm: nn.Module) -> Iterable:
    """``(name, module)`` for every int8 module of ``gm``."""
    return ((n, m) for n, m in gm.named_modules() if isinstance(m, QuantizedModule))
