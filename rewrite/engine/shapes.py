"""Cheap facts for new elementwise nodes: the output of ``neg(x)``, ``x - y`` or
``silu(x)`` is a fresh tensor exactly like its input (shape, dtype, strides, device),
so its FakeTensor ``val`` is built directly instead of dispatching the op through
the fake mode (about 20 us instead of 150-250 us per node; a rewrite creates one
or two such nodes per application and every one needs a ``val`` by the end).

Only the cases where the answer is certain take this path: every tensor input has
the same shape, dtype and device and exactly the canonical contiguous (or
channels_last) strides, so TensorIterator's output strides are those strides too;
scalars are plain Python numbers that cannot change the result dtype. Anything
else (broadcasting, type promotion, views, integer inputs to a float-valued op)
returns None and the caller runs the op on fake tensors; one broadcast is certain
too: a binary op of two contiguous tensors of one dtype, one of full size
(``x + bias``), is laid out as that one. A cast of such a tensor
from one floating dtype to another (``aten.to.dtype``, ``aten._to_copy``: what the
AMP rules insert around every op) is the same tensor in the new dtype (``cast_of``).
A ``view``/``reshape`` of a contiguous tensor to a static shape is a view of its
memory with the new shape's contiguous strides (``view_of``): built as the fake
mode builds a cached view, sharing the input's storage, so passes that read
aliasing from ``meta['val']`` (Inductor's reinplacing) see what dispatch gives.
``tests/test_shapes.py`` compares every shortcut with the real propagation.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["cast_of", "fresh_cast", "like_input", "fresh_like", "view_of", "fresh_view", "fresh_constant",
           "layout_of", "addressing", "symbolic_dense_order", "symbolic_strides", "sizes_differ"]

aten = torch.ops.aten

#: Ops whose result has their input's metadata for any real dtype (bool aside).
_SAME_ANY = {
    aten.neg.default, aten.abs.default, aten.relu.default,
    torch.neg, torch.abs, torch.relu, F.relu, operator.neg, operator.abs,
    "neg", "abs", "relu",
}
#: Ops whose result has their input's metadata when the input is floating point
#: (an integer input gives a float result, or is refused).
_SAME_FLOAT = {
    aten.sigmoid.default, aten.tanh.default, aten.silu.default, aten.gelu.default, aten.exp.default,
    aten.log.default, aten.sin.default, aten.cos.default, aten.erf.default, aten.sqrt.default,
    aten.rsqrt.default, aten.reciprocal.default, aten.hardswish.default, aten.hardsigmoid.default,
    aten.leaky_relu.default, aten.hardtanh.default, aten.elu.default, aten.mish.default,
    aten.softplus.default,
    torch.sigmoid, torch.tanh, torch.exp, torch.log, torch.sin, torch.cos, torch.erf, torch.sqrt,
    torch.rsqrt, torch.reciprocal, F.silu, F.gelu, F.hardswish, F.hardsigmoid, F.leaky_relu, F.hardtanh,
    F.elu, F.mish, F.softplus,
    "sigmoid", "tanh", "exp", "log", "sin", "cos", "erf", "sqrt", "rsqrt", "reciprocal",
}
#: Binary arithmetic: the result is like the inputs when they all agree (and are
#: floating point: integer division and bool arithmetic promote).
_SAME_BINARY_FLOAT = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.maximum.default,
    aten.minimum.default,
    torch.add, torch.sub, torch.mul, torch.div, torch.maximum, torch.minimum,
    operator.add, operator.sub, operator.mul, operator.truediv,
    "add", "sub", "mul", "div",
}
_TENSORS_ONLY = {aten.maximum.default, aten.minimum.default, torch.maximum, torch.minimum}
#: Keyword arguments that do not change the result's metadata.
_HARMLESS_KWARGS = frozenset({"alpha", "approximate", "negative_slope", "min_val", "max_val", "beta",
                              "threshold"})


def _canonical_strides(shape: tuple, channels_last: bool) -> tuple:
    """Contiguous (or channels_last) strides of ``shape``; a symbolic size counts as
    its product (a ShapeEnv assumes a size is at least 2, as recorded strides do)."""
    if channels_last:
        n, c, h, w = shape
        return (h * w * c, 1, w * c, c)
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step = step * (size if isinstance(size, torch.SymInt) else max(size, 1))
    return tuple(reversed(strides))


def _dense(t: Any) -> bool:
    """Strides exactly the canonical contiguous or channels_last ones (not merely
    ``is_contiguous``, which ignores the strides of size-1 dimensions)."""
    shape, stride = tuple(t.shape), tuple(t.stride())
    if any(not isinstance(s, int) for s in shape + stride):
        return False  # symbolic sizes: leave them to the real propagation
    if stride == _canonical_strides(shape, False):
        return True
    return len(shape) == 4 and stride == _canonical_strides(shape, True)


def _kind(node: fx.Node) -> Any:
    key = node.target
    try:
        if key in _SAME_ANY:
            return "any"
        if key in _SAME_FLOAT:
            return "float"
        if key in _SAME_BINARY_FLOAT:
            return "binary"
    except TypeError:  # an unhashable target
        return None
    return None


def like_input(node: fx.Node, values: dict) -> Any:
    """The input FakeTensor whose metadata ``node``'s result certainly has, or None.
    ``values``: each input node -> its FakeTensor (or other known value)."""
    if node.op not in ("call_function", "call_method"):
        return None
    kind = _kind(node)
    if kind is None or any(k not in _HARMLESS_KWARGS for k in node.kwargs):
        return None
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    tensors = []
    for i, a in enumerate(list(node.args) + list(node.kwargs.values())):
        if isinstance(a, fx.Node):
            v = values.get(a)
            if not isinstance(v, FakeTensor):
                return None
            tensors.append(v)
        elif type(a) is bool and kind != "binary":
            return None  # F.relu(x, True): an in-place flag, the result is the input itself
        elif type(a) is str and i >= len(node.args):
            continue  # gelu's approximate="tanh"
        elif type(a) not in (bool, int, float):
            return None
    first = tensors[0]
    if kind == "binary" and (len(node.args) != 2 or (len(tensors) == 1 and node.target in _TENSORS_ONLY)):
        return None
    if kind != "binary" and len(tensors) != 1:
        return None
    dtype = first.dtype
    if kind == "any" and (dtype.is_complex or dtype == torch.bool):
        return None
    if kind in ("float", "binary") and not dtype.is_floating_point:
        return None
    if any(t.requires_grad for t in tensors) or not _dense(first):
        return None  # _dense first: comparing symbolic sizes would guard on the example's
    for t in tensors[1:]:
        if (any(not isinstance(s, int) for s in t.shape) or t.shape != first.shape or t.dtype != dtype
                or t.device != first.device or t.stride() != first.stride()):
            return _broadcast_like(tensors) if kind == "binary" else None
    return first


def _broadcast_like(tensors: list) -> Any:
    """Of two contiguous tensors of one floating dtype and device where one's shape
    is what both broadcast to (``x + bias``: (8, 16) and (16,) or (1, 16)), that one:
    TensorIterator lays the result out as its one full-size contiguous operand
    (``tests/test_shapes.py`` checks it against dispatch, size-1 dims included).
    None otherwise (both broadcast, channels_last, promotion)."""
    if len(tensors) != 2:
        return None
    a, b = tensors
    if a.dtype != b.dtype or a.device != b.device:
        return None
    for t in (a, b):
        shape = tuple(t.shape)
        if any(not isinstance(s, int) for s in shape) or tuple(t.stride()) != _canonical_strides(shape, False):
            return None
    big, small = (a, b) if a.dim() >= b.dim() else (b, a)
    offset = big.dim() - small.dim()
    if any(s != 1 and s != d for s, d in zip(small.shape, big.shape[offset:])):
        return None  # small does not broadcast to big's shape: both grow, or they do not broadcast
    return big


def fresh_like(t: FakeTensor) -> FakeTensor:
    """A new FakeTensor with ``t``'s shape, strides, dtype and device, in its mode."""
    return fresh_cast(t, t.dtype)


#: Casts whose result is a new tensor like the input but for its dtype (aten.to.dtype
#: only when the dtype changes: to the same dtype it returns the input itself).
_CASTS = {aten.to.dtype, aten._to_copy.default}
#: A cast's other arguments, at the values that leave the result like the input.
_CAST_NEUTRAL = {"non_blocking": (False,), "copy": (False, True), "memory_format": (None, torch.preserve_format),
                 "layout": (None, torch.strided), "pin_memory": (None, False), "device": (None,)}


def cast_of(node: fx.Node, values: dict) -> Any:
    """``(input FakeTensor, dtype)`` when ``node`` casts a densely strided floating
    tensor to another floating dtype and nothing else (``aten.to.dtype(x, dtype)``,
    ``aten._to_copy(x, dtype=...)``): the result has the input's shape, strides and
    device in the new dtype. None otherwise (the caller runs the op on fake tensors)."""
    target = node.target
    if node.op != "call_function" or target not in _CASTS or not node.args:
        return None
    x = values.get(node.args[0]) if isinstance(node.args[0], fx.Node) else None
    if not isinstance(x, FakeTensor):
        return None
    kwargs = dict(node.kwargs)
    if target is aten.to.dtype:
        if len(node.args) < 2:
            return None
        dtype = node.args[1]
        rest = dict(zip(("non_blocking", "copy", "memory_format"), node.args[2:]))
        if len(node.args) > 5 or set(rest) & set(kwargs):
            return None
        kwargs.update(rest)
    else:
        if len(node.args) != 1:
            return None
        dtype = kwargs.pop("dtype", None)
    if not isinstance(dtype, torch.dtype) or dtype == x.dtype:
        return None
    if not (dtype.is_floating_point and x.dtype.is_floating_point):
        return None
    for key, value in kwargs.items():
        if key not in _CAST_NEUTRAL or not any(value is v or (value == v and type(value) is type(v))
                                               for v in _CAST_NEUTRAL[key]):
            return None
    if x.requires_grad or not _dense(x):
        return None
    return x, dtype


def fresh_cast(t: FakeTensor, dtype: torch.dtype) -> FakeTensor:
    """A new FakeTensor with ``t``'s shape, strides and device in ``dtype``."""
    meta = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=dtype, device="meta")
    return FakeTensor(t.fake_mode, meta, t.device)


def fresh_constant(t: torch.Tensor, mode: Any) -> "FakeTensor | None":
    """The FakeTensor of a constant a rewrite just made (a folded weight: a fresh,
    dense tensor that is nobody's view, or the Parameter registered around it),
    built directly in ``mode`` with its shape, strides, dtype, device and
    ``requires_grad`` (a Parameter's FakeTensor passes for a Parameter), as
    ``mode.from_tensor(t, static_shapes=True)`` would make it (which describes and
    memoizes the real tensor: ~0.3 ms, twice per conv-bn fold). None for anything
    else (a view, a quantized or sparse tensor, another subclass): the caller
    converts it."""
    is_param = t.__class__ is torch.nn.Parameter
    if (not is_param and t.__class__ is not torch.Tensor) or t.layout != torch.strided or t.is_quantized \
            or t._base is not None:
        return None
    meta = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta",
                               requires_grad=t.requires_grad)
    return FakeTensor(mode, meta, t.device, _is_param=is_param)


#: Ops that view a contiguous input under a new shape (reshape is a view then).
_VIEWS = {aten.view.default, aten.reshape.default}


def view_of(node: fx.Node, values: dict) -> Any:
    """``(input FakeTensor, shape)`` when ``node`` is ``aten.view``/``aten.reshape``
    of a tensor with exactly the contiguous strides of its static shape, to a
    shape of ints (one may be -1) with as many elements; None otherwise."""
    if node.op != "call_function" or node.target not in _VIEWS or node.kwargs or len(node.args) != 2:
        return None
    source, sizes = node.args
    x = values.get(source) if isinstance(source, fx.Node) else None
    if not isinstance(x, FakeTensor) or x.layout != torch.strided or x.requires_grad:
        return None
    if not isinstance(sizes, (list, tuple)) or any(type(s) is not int for s in sizes):
        return None
    shape, stride = tuple(x.shape), tuple(x.stride())
    if any(not isinstance(s, int) for s in shape + stride) or stride != _canonical_strides(shape, False):
        return None
    numel = math.prod(shape)
    free = [i for i, s in enumerate(sizes) if s == -1]
    if numel == 0 or len(free) > 1 or any(s < -1 for s in sizes):
        return None
    known = math.prod(s for s in sizes if s != -1)
    sizes = list(sizes)
    if free:
        if known == 0 or numel % known:
            return None
        sizes[free[0]] = numel // known
    elif known != numel:
        return None
    return x, tuple(sizes)


def fresh_view(t: FakeTensor, shape: tuple) -> FakeTensor:
    """A FakeTensor viewing ``t``'s memory (same storage and offset) with ``shape``
    and its contiguous strides, in ``t``'s mode."""
    stride = _canonical_strides(shape, False)
    meta = torch.empty_strided(shape, stride, dtype=t.dtype, device="meta")
    meta.set_(t.untyped_storage(), t.storage_offset(), shape, stride)
    return FakeTensor(t.fake_mode, meta, t.device)


def layout_of(meta: Any) -> str | None:
    """``"contiguous"``, ``"channels_last"``, ``"channels_last_3d"``, ``"strided"``
    (anything else), or None when the facts do not say."""
    if meta is None:
        return None
    recorded = getattr(meta, "contiguous", None)
    if isinstance(recorded, bool):  # TensorFacts: contiguity only
        return "contiguous" if recorded else "strided"
    if not isinstance(meta, torch.Tensor) or meta.layout != torch.strided:
        return None
    shape, stride = tuple(meta.shape), tuple(meta.stride())
    if symbolic_strides(meta):
        known = _symbolic_layout(shape, stride)
        if known is not None:
            return known
    try:  # sizes known only from data (unbacked) answer no question here: a RuntimeError
        if meta.numel() < 2:
            return None
        if meta.is_contiguous():
            return "contiguous"
        if meta.dim() == 4 and meta.is_contiguous(memory_format=torch.channels_last):
            return "channels_last"
        if meta.dim() == 5 and meta.is_contiguous(memory_format=torch.channels_last_3d):
            return "channels_last_3d"
    except (RuntimeError, NotImplementedError):  # symbolic strides, unbacked sizes
        return None
    return "strided"


def symbolic_strides(t: torch.Tensor) -> bool:
    """Whether a strided tensor's sizes or strides hold symbols (a dynamic capture's)."""
    return any(isinstance(v, torch.SymInt) for v in (*t.shape, *t.stride()))


def _symbolic_layout(shape: tuple, stride: tuple) -> str | None:
    """``layout_of`` a tensor with symbolic sizes or strides: a layout whose strides
    are, expression for expression, the canonical ones of its shape (what a kernel
    that lays its result out afresh records: ``(3*s0*s1, s0*s1, s0, 1)``) is that
    layout at every size (``is_contiguous`` would ask whether sizes are 1, which
    holds for some sizes and not others: undecidable while a where clause asks);
    None for anything else, which ``layout_of`` then asks torch."""
    candidates = [("contiguous", _canonical_strides(shape, False))]
    if len(shape) == 4:
        candidates.append(("channels_last", _canonical_strides(shape, True)))
    if len(shape) == 5:
        n, c, d, h, w = shape
        candidates.append(("channels_last_3d", (d * h * w * c, 1, h * w * c, w * c, c)))
    for name, want in candidates:
        if all(_same_size(a, b) for a, b in zip(stride, want)):
            return name
    return None


def symbolic_dense_order(meta: Any) -> tuple | None:
    """For a tensor with symbolic sizes or strides laid out densely in some order of
    its dimensions (``x.flatten(2).transpose(1, 2)`` of a dynamic batch: strides
    ``(8*s0, 1, 8)``), that order, outermost first: read from the example's sizes
    (the hints; no guard is added) and kept only when every stride is, expression for
    expression, the product of the sizes inside it in that order, so that it holds
    at every size. None otherwise."""
    from rewrite.engine.symbolic import size_hint

    shape, stride = tuple(meta.shape), tuple(meta.stride())
    hints = [size_hint(st) for st in stride]
    order = sorted(range(len(shape)), key=lambda d: (-hints[d], d))
    expected: Any = 1
    for dim in reversed(order):
        size = shape[dim]
        if isinstance(size, int) and size <= 1:
            continue  # one element along it: its stride addresses nothing
        if not _same_size(stride[dim], expected):
            return None
        expected = expected * size
    return tuple(order)


def _same_size(a: Any, b: Any) -> bool:
    """Whether two sizes are the same number for every value of their symbols
    (asked of the expressions: no guard is added)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001 - an expression the ShapeEnv cannot compare: not the same
        return False


def sizes_differ(a: Any, b: Any) -> bool:
    """Two sizes, either symbolic, not known to be equal at every size the program
    takes (asked without adding a guard): a literal 4 against ``s0`` differs, since
    it is right only when ``s0`` is 4. A size that depends on data (an unbacked
    ``u0``: ``nonzero``, ``masked_select``) is known to nobody: two such differ only
    when known to (a recomputed ``masked_select`` gets a fresh ``u1``), and one such
    against a size the program knows differs unless known equal."""
    if isinstance(a, int) and isinstance(b, int):
        return a != b
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true

    try:
        unbacked = bool(free_unbacked_symbols(a)), bool(free_unbacked_symbols(b))
        if all(unbacked):
            return bool(statically_known_true(a != b))
    except Exception:  # noqa: BLE001 - sizes from two ShapeEnvs: not known
        return False
    return not _same_size(a, b)  # one known size against one data decides (x[x != 0] for x): unknown


def addressing(meta: Any) -> tuple | None:
    """The strides of ``meta`` (a tensor, or recorded facts) where they matter:
    dimensions of size 1 address one element, so theirs are None; None when not
    recorded or symbolic. Two values with equal addressing are laid out alike."""
    stride = getattr(meta, "stride", None)
    try:
        stride = tuple(stride() if callable(stride) else stride)
        shape = tuple(meta.shape)
        if any(isinstance(v, torch.SymInt) for v in (*stride, *shape)):
            return None  # int() would guard the graph's ShapeEnv on the example's sizes
        return tuple(int(st) if int(n) > 1 else None for n, st in zip(shape, stride))
    except (TypeError, ValueError, RuntimeError, NotImplementedError):
        return None
