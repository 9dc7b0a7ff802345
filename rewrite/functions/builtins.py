"""Built-in predicates, queries and rewrite-time functions that rule files may name.

Predicates and queries receive ``rewrite.engine.facts.Value`` objects. One that cannot
tell (no shape information on the node) returns None: the fact is *unknown*, and the
where clause is evaluated in three-valued logic (``not unknown`` and any comparison
with an unknown side stay unknown), so a rule whose constraint cannot be decided
does not fire, negated or not.

Rewrite-time constants use torch's own math (``torch.nn.utils.fusion``) rather than
hand-written formulas.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.utils import fusion as _fusion

from rewrite.engine.facts import Value
from rewrite.functions.registry import (
    register_constant,
    register_module,
    register_predicate,
    register_query,
)

__all__: list = []  # everything here is reached through the registry

# ---------------------------------------------------------------- predicates


@register_predicate()
def const(*values: Value) -> bool:
    """All arguments are constants: parameters, buffers or literals."""
    return all(v.is_const for v in values)


@register_predicate()
def is_param(x: Value) -> bool:
    """A parameter of the module (not a buffer, not a literal)."""
    return x.qualname is not None and x.qualname in x.facts.param_names


@register_predicate()
def is_buffer(x: Value) -> bool:
    """A buffer of the module (running statistics, frozen weights)."""
    return x.qualname is not None and x.qualname not in x.facts.param_names


@register_predicate()
def is_literal(x: Value) -> bool:
    """A literal written in the graph (int, float, bool, None, tuple...)."""
    return x.is_literal


@register_predicate()
def is_none(x: Value) -> bool:
    """The literal None (e.g. a conv without bias)."""
    return x.is_literal and x.operand is None


@register_predicate()
def is_tensor(x: Value) -> bool:
    """A tensor: a graph value or a constant tensor."""
    return x.meta is not None or x.node is not None


@register_predicate()
def single_use(x: Value) -> bool:
    """The node has exactly one user."""
    return x.node is not None and x.users == 1


@register_predicate()
def is_float(x: Value) -> bool:
    """A floating-point tensor (known from shape information)."""
    m = x.meta
    if m is None:
        return False if x.is_literal else None  # a literal is no tensor; a graph value: unknown
    return m.dtype.is_floating_point


@register_predicate()
def same_shape(a: Value, b: Value) -> bool:
    """Both tensors have the same, known shape."""
    ma, mb = a.meta, b.meta
    if ma is None or mb is None:
        return False if a.is_literal or b.is_literal else None
    return tuple(ma.shape) == tuple(mb.shape)


@register_predicate()
def same_dtype(a: Value, b: Value) -> bool:
    """Both tensors have the same, known dtype."""
    ma, mb = a.meta, b.meta
    if ma is None or mb is None:
        return False if a.is_literal or b.is_literal else None
    return ma.dtype == mb.dtype


@register_predicate()
def is_observer(x: Value) -> bool:
    """The value is produced by a quantization observer or stub module."""
    node = x.node
    if node is None or node.op != "call_module":
        return False
    mod = x.facts.gm.get_submodule(node.target)
    from torch.ao.quantization import DeQuantStub, QuantStub
    from torch.ao.quantization.observer import ObserverBase

    return isinstance(mod, (ObserverBase, QuantStub, DeQuantStub))


@register_predicate()
def is_identity_perm(dims: Value) -> bool:
    """A permutation literal that leaves every dim in place: (0, 1, 2, ...)."""
    d = dims.literal
    return isinstance(d, (list, tuple)) and list(d) == list(range(len(d)))


@register_predicate()
def perms_cancel(a: Value, b: Value) -> bool:
    """Applying permutation ``a`` then ``b`` gives the identity."""
    pa, pb = a.literal, b.literal
    if not isinstance(pa, (list, tuple)) or not isinstance(pb, (list, tuple)) or len(pa) != len(pb):
        return False
    n = len(pa)
    try:
        return [pa[pb[i] % n] % n for i in range(n)] == list(range(n))
    except (TypeError, IndexError):
        return False


@register_predicate()
def is_noop_transpose(x: Value, d0: Value, d1: Value) -> bool:
    """``transpose(x, d0, d1)`` with d0 and d1 the same dim (rank known)."""
    m = x.meta
    a, b = d0.literal, d1.literal
    if not isinstance(a, int) or not isinstance(b, int):
        return False
    if m is None:
        return None
    return a % len(m.shape) == b % len(m.shape)


@register_predicate()
def transposes_cancel(x: Value, a0: Value, a1: Value, b0: Value, b1: Value) -> bool:
    """``transpose(transpose(x, a0, a1), b0, b1)`` is the identity: same dim pair."""
    m = x.meta
    dims = [v.literal for v in (a0, a1, b0, b1)]
    if not all(isinstance(d, int) for d in dims):
        return False
    if m is None:
        return None
    r = len(m.shape)
    return {dims[0] % r, dims[1] % r} == {dims[2] % r, dims[3] % r}


@register_predicate()
def reshape_is_noop(x: Value, shape: Value) -> bool:
    """Reshaping ``x`` to ``shape`` keeps its known shape exactly."""
    m, s = x.meta, shape.literal
    if not isinstance(s, (list, tuple)) or not all(isinstance(d, int) for d in s):
        return False
    if m is None:
        return None
    have = tuple(m.shape)
    if len(s) != len(have) or sum(1 for d in s if d == -1) > 1:
        return False
    return all(d == h or d == -1 for d, h in zip(s, have))


@register_predicate()
def broadcasts_to(x: Value, y: Value) -> bool:
    """``y`` (a tensor or scalar) broadcast against ``x`` leaves x's known shape and
    dtype unchanged, so ``x + 0``-style identities are exact."""
    mx = x.meta
    if mx is None:
        return False if x.is_literal else None
    my = y.meta
    if my is None:
        return y.is_literal and isinstance(y.operand, (int, float)) and not isinstance(y.operand, bool)
    try:
        shape = torch.broadcast_shapes(tuple(mx.shape), tuple(my.shape))
    except RuntimeError:
        return False
    return tuple(shape) == tuple(mx.shape) and torch.promote_types(mx.dtype, my.dtype) == mx.dtype


_FLOAT_WIDTH = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
_INT_BITS = {torch.bool: 1, torch.uint8: 8, torch.int8: 8, torch.int16: 16, torch.int32: 32, torch.int64: 64}


@register_predicate()
def lossless_cast(x: Value, to: Value) -> bool:
    """Casting ``x`` (dtype known) to dtype ``to`` keeps every value exactly, so a
    cast back restores it (bf16 -> f32, f16 -> f32, f32 -> f64, int8 -> int32...)."""
    m, target = x.meta, to.literal
    if not isinstance(target, torch.dtype):
        return False
    if m is None:
        return False if x.is_literal else None
    src = m.dtype
    if src == target:
        return True
    if src in _FLOAT_WIDTH and target in _FLOAT_WIDTH:
        # f16 and bf16 are not subsets of each other; both fit in f32.
        return _FLOAT_WIDTH[target] > _FLOAT_WIDTH[src]
    if src in _INT_BITS and target in _INT_BITS:
        signed_src, signed_dst = src not in (torch.bool, torch.uint8), target not in (torch.bool, torch.uint8)
        if signed_src and not signed_dst:
            return False
        return _INT_BITS[target] > _INT_BITS[src] or (target == src)
    if src in _INT_BITS and target in _FLOAT_WIDTH:
        mantissa = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}[target]
        return _INT_BITS[src] <= mantissa
    return False


# ---------------------------------------------------------------- queries


@register_query()
def users(x: Value) -> int:
    """Number of users of the node (0 for constants and literals)."""
    return x.users


@register_query()
def dtype(x: Value) -> Any:
    """The tensor's dtype, or None when unknown."""
    m = x.meta
    return None if m is None else m.dtype


@register_query()
def rank(x: Value) -> Any:
    """The tensor's number of dims, or None when unknown."""
    m = x.meta
    return None if m is None else len(m.shape)


@register_query()
def shape(x: Value) -> Any:
    """The tensor's shape as a tuple, or None when unknown."""
    m = x.meta
    return None if m is None else tuple(m.shape)


@register_query()
def numel(x: Value) -> Any:
    """The tensor's number of elements, or None when unknown."""
    m = x.meta
    if m is None:
        return None
    n = 1
    for d in m.shape:
        n *= d
    return n


@register_query()
def device(x: Value) -> Any:
    """The tensor's device type as a string (``"cpu"``, ``"cuda"``), or None."""
    m = x.meta
    dev = getattr(m, "device", None)
    return None if dev is None else torch.device(dev).type


@register_query()
def value(x: Value) -> Any:
    """The literal itself (for comparing a bound literal: ``value(p) == 0.0``)."""
    return x.literal


# ---------------------------------------------------------------- constants (rewrite time)


def _memo_last(fn: Any) -> Any:
    """Remember the last result: a fold computes weight and bias in two calls
    with the same arguments, and torch's math returns both at once."""
    last: list = [None, None, None]

    def wrapper(*args: Any) -> Any:
        key = tuple(id(a) if isinstance(a, torch.Tensor) else a for a in args)
        if last[0] != key:
            # keep the arguments alive so their ids cannot be reused by other tensors
            last[0], last[1], last[2] = key, fn(*args), args
        return last[1]

    return wrapper


@_memo_last
def _conv_bn(w: Any, b: Any, mean: Any, var: Any, gamma: Any, beta: Any, eps: float, transpose: bool) -> tuple:
    return tuple(t.detach() for t in _fusion.fuse_conv_bn_weights(w, b, mean, var, eps, gamma, beta, transpose))


@_memo_last
def _linear_bn(w: Any, b: Any, mean: Any, var: Any, gamma: Any, beta: Any, eps: float) -> tuple:
    if gamma is None:
        gamma = torch.ones_like(mean)
    if beta is None:
        beta = torch.zeros_like(mean)
    return tuple(t.detach() for t in _fusion.fuse_linear_bn_weights(w, b, mean, var, eps, gamma, beta))


@register_constant()
def conv_bn_weight(w: Any, b: Any, mean: Any, var: Any, gamma: Any, beta: Any, eps: float) -> Any:
    """Weight of ``conv`` followed by eval-mode ``batch_norm``, folded (torch's math)."""
    return _conv_bn(w, b, mean, var, gamma, beta, eps, False)[0]


@register_constant()
def conv_bn_bias(w: Any, b: Any, mean: Any, var: Any, gamma: Any, beta: Any, eps: float) -> Any:
    """Bias of ``conv`` followed by eval-mode ``batch_norm``, folded (torch's math)."""
    return _conv_bn(w, b, mean, var, gamma, beta, eps, False)[1]


@register_constant()
def conv_transpose_bn_weight(w: Any, b: Any, mean: Any, var: Any, gamma: Any, beta: Any, eps: float) -> Any:
    """Weight of ``conv_transpose`` (groups=1) followed by ``batch_norm``, folded."""
    return _conv_bn(w, b, mean, var, gamma, beta, eps, True)[0]


@register_constant()
def conv_transpose_bn_bias(w: Any, b: Any, mean: Any, var: Any, gamma: Any, beta: Any, eps: float) -> Any:
    """Bias of ``conv_transpose`` (groups=1) followed by ``batch_norm``, folded."""
    return _conv_bn(w, b, mean, var, gamma, beta, eps, True)[1]


@register_constant()
def linear_bn_weight(w: Any, b: Any, mean: Any, var: Any, gamma: Any, beta: Any, eps: float) -> Any:
    """Weight of ``linear`` followed by eval-mode ``batch_norm`` (2-d input), folded."""
    return _linear_bn(w, b, mean, var, gamma, beta, eps)[0]


@register_constant()
def linear_bn_bias(w: Any, b: Any, mean: Any, var: Any, gamma: Any, beta: Any, eps: float) -> Any:
    """Bias of ``linear`` followed by eval-mode ``batch_norm`` (2-d input), folded."""
    return _linear_bn(w, b, mean, var, gamma, beta, eps)[1]


@register_constant()
def cast(t: Any, dtype: Any) -> Any:
    """A constant tensor converted to ``dtype`` once, at rewrite time."""
    return t.to(dtype) if isinstance(t, torch.Tensor) else t


# ---------------------------------------------------------------- modules (inserted)


@register_module(inputs=("x",))
def minmax_observer(x: Any = None) -> torch.nn.Module:
    """torch's per-tensor affine ``MinMaxObserver`` (records the range it sees)."""
    from torch.ao.quantization.observer import MinMaxObserver

    return MinMaxObserver()


@register_module(inputs=("x",))
def histogram_observer(x: Any = None) -> torch.nn.Module:
    """torch's ``HistogramObserver`` (per-tensor affine, better ranges than min/max)."""
    from torch.ao.quantization.observer import HistogramObserver

    return HistogramObserver()
