"""Predicates and rewrite-time functions of the transformer rules (``rules/transformer.rw``).

The rules turn attention, RMSNorm, LayerNorm and tanh-GELU written out op by op into
the one op torch has for each. Each rewrite holds only for particular shapes and
arguments (softmax over the last dim, a transpose of the last two dims, a mask that
broadcasts to the scores, a norm weight of the normalized size), and the facts for
that live here. Like every predicate, these return None when the graph does not
say (no shape information), so a rule whose fact is unknown does not fire.
"""

from __future__ import annotations

import math

from typing import Any

import torch

from rewrite.engine.aliasing import graph_writes, storage_base
from rewrite.engine.facts import Value
from rewrite.functions.registry import register_constant, register_predicate
from rewrite.ops.base import ConstRef
from rewrite.ops.effects import written_nodes

__all__: list = []  # everything here is reached through the registry


def _one_dim(d: Any) -> int | None:
    """The dim of a reduction or softmax argument: ``-1``, ``[-1]`` or ``(2,)``."""
    if isinstance(d, (list, tuple)):
        if len(d) != 1:
            return None
        d = d[0]
    if isinstance(d, bool) or not isinstance(d, int):
        return None
    return d


def _shape(x: Value) -> tuple | None:
    m = x.meta
    return None if m is None else tuple(m.shape)


@register_predicate()
def last_dim(x: Value, dim: Value) -> bool:
    """``dim`` (an int or a one-element list, as reductions spell it) is the last dim
    of ``x`` (rank known): ``softmax(x, -1)``, ``mean(x, [3], True)`` on a 4-d x."""
    d = _one_dim(dim.literal) if dim.is_literal else None
    if d is None:
        return False
    s = _shape(x)
    if s is None:
        return False if x.is_literal else None
    return len(s) >= 1 and d in (-1, len(s) - 1)


@register_predicate()
def minus_one(dim: Value) -> bool:
    """``dim`` is written ``-1`` (or ``[-1]``): the canonical spelling of "the last
    dim" the transformer rules rewrite the other spellings to."""
    return dim.is_literal and _one_dim(dim.literal) == -1


@register_predicate()
def swaps_last_two(x: Value, dim0: Value, dim1: Value) -> bool:
    """``transpose(x, dim0, dim1)`` swaps the last two dims of ``x`` (rank >= 2):
    ``k.transpose(-1, -2)``, ``k.transpose(2, 3)`` on a 4-d k."""
    a, b = dim0.literal, dim1.literal
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (a, b)):
        return False
    s = _shape(x)
    if s is None:
        return None
    r = len(s)
    if r < 2 or not (-r <= a < r and -r <= b < r):
        return False
    return {a % r, b % r} == {r - 2, r - 1}


@register_predicate()
def attention_operands(q: Value, k: Value, v: Value) -> bool:
    """q ``(..., L, E)``, k ``(..., S, E)``, v ``(..., S, Ev)``: one floating dtype,
    one rank >= 2 and the same leading (batch, head) dims, so that
    ``softmax(q @ k.T) @ v`` and ``scaled_dot_product_attention(q, k, v)`` take the
    same tensors (sdpa does not broadcast k and v over heads as matmul does: grouped
    key/value heads are not this)."""
    mq, mk, mv = q.meta, k.meta, v.meta
    if mq is None or mk is None or mv is None:
        return None
    sq, sk, sv = tuple(mq.shape), tuple(mk.shape), tuple(mv.shape)
    if not (mq.dtype == mk.dtype == mv.dtype and mq.dtype.is_floating_point):
        return False
    if not (len(sq) == len(sk) == len(sv) >= 2):
        return False
    return sq[:-2] == sk[:-2] == sv[:-2] and sq[-1] == sk[-1] and sk[-2] == sv[-2]


@register_predicate()
def additive_mask(mask: Value, scores: Value) -> bool:
    """``mask`` is a floating tensor of the scores' dtype whose broadcast against the
    scores leaves their shape unchanged: ``scores + mask`` is what sdpa computes for
    a float ``attn_mask``. (A bool mask, or a number, is not this; nor a mask of rank
    0 or 1, which broadcasts against the scores but which sdpa refuses.)"""
    return _adds_to_scores(mask, scores, 2)


@register_predicate()
def additive_bias(bias: Value, scores: Value) -> bool:
    """``additive_mask`` of any rank: a bias added to the scores before a mask that
    ``additive_mask`` accepts (T5's position bias), whose sum then has that mask's
    rank at least."""
    return _adds_to_scores(bias, scores, 0)


def _adds_to_scores(mask: Value, scores: Value, min_rank: int) -> bool | None:
    mm, ms = mask.meta, scores.meta
    if mm is None or ms is None:
        return False if mask.is_literal or scores.is_literal else None
    if mm.dtype != ms.dtype or not mm.dtype.is_floating_point or not min_rank <= len(mm.shape) <= len(ms.shape):
        return False
    try:
        shape = torch.broadcast_shapes(tuple(mm.shape), tuple(ms.shape))
    except RuntimeError:
        return False
    return tuple(shape) == tuple(ms.shape)


@register_predicate()
def positive_number(x: Value) -> bool:
    """A Python int or float literal greater than 0 (not a bool): an attention
    scale (sdpa's math kernel scales q and k by its square root) or a norm's eps."""
    v = x.literal if x.is_literal else None
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


@register_predicate()
def positive_scalar(x: Value) -> bool:
    """A positive number: a literal (as ``positive_number``) or a constant 0-d tensor
    (an eps kept in a buffer). A 0-d tensor never changes the dtype of the tensor it
    is added to, so ``mean(x^2) + eps`` keeps x's dtype either way."""
    if x.is_literal:
        return positive_number(x)
    if not x.is_const:
        return None if x.meta is None else False  # a graph value: its number is not known
    t = x.facts.constant_of(x.operand)
    return (isinstance(t, torch.Tensor) and t.dim() == 0 and t.dtype != torch.bool
            and not t.is_complex() and bool(t > 0))


@register_predicate()
def keeps_dtype(x: Value, dtype: Value) -> bool:
    """A ``dtype=`` argument (softmax's) that changes nothing: None, or ``x``'s own
    dtype (HF's ``softmax(x, dim=-1, dtype=torch.float32)`` on a float32 x)."""
    d = dtype.literal if dtype.is_literal else None
    if d is None:
        return dtype.is_literal
    if not isinstance(d, torch.dtype):
        return False
    m = x.meta
    return None if m is None else m.dtype == d


@register_predicate()
def norm_weight(w: Value, x: Value) -> bool:
    """``w`` is a 1-d tensor of ``x``'s last-dim size and dtype: the per-feature
    weight (or bias) ``rms_norm``/``layer_norm`` take for ``normalized_shape=[d]``."""
    mw, mx = w.meta, x.meta
    if mw is None or mx is None:
        return False if w.is_literal or x.is_literal else None
    return (len(mw.shape) == 1 and len(mx.shape) >= 1 and mw.shape[0] == mx.shape[-1]
            and mw.dtype == mx.dtype and mx.dtype.is_floating_point)


@register_constant()
def norm_shape(w: Any) -> Any:
    """``normalized_shape`` for a norm whose per-feature weight is ``w``: ``[len(w)]``."""
    return list(w.shape)


@register_constant()
def as_number(x: Any) -> Any:
    """A number or a 0-d tensor as a Python float: ops' ``eps=`` takes a number."""
    return float(x)


@register_constant()
def inverse(x: Any) -> Any:
    """``1 / x`` of a number, at rewrite time: ``scores / sqrt(d)`` is sdpa's
    ``scale=1 / sqrt(d)``."""
    return 1.0 / x


# -- masks that never hold -inf
#
# softmax over a row of scores that is -inf throughout is NaN (0/0) in the written-out
# attention and 0 in scaled_dot_product_attention, so a mask that may mask a whole row
# with -inf (``masked_fill(zeros, ~keep, -inf)`` of a padding mask) cannot go into sdpa
# unchanged. What can be proved from the graph is that a mask holds no -inf at all:
# transformers' masks are ``where(keep, 0, finfo.min)``, finite by construction.

# ops whose every output element is an element of a floating input or a number
# argument (or 0: tril/triu): selection, views, copies, joins, gathers
_SELECTING = frozenset({
    "expand", "expand_as", "view", "view_as", "reshape", "reshape_as", "_unsafe_view", "unsqueeze",
    "squeeze", "permute", "transpose", "t", "numpy_T", "contiguous", "clone", "slice", "select",
    "narrow", "flatten", "unflatten", "alias", "detach", "lift_fresh_copy", "repeat", "tile",
    "index_select", "gather", "take", "getitem", "cat", "concat", "concatenate", "stack", "tril",
    "triu", "where", "masked_fill", "embedding", "flip", "roll", "movedim", "moveaxis", "swapaxes",
    "swapdims",
})
# ops that take integer tensors as positions, never as values
_INDEXING = frozenset({"index_select", "gather", "take", "getitem", "embedding"})
# ops that fill a new tensor with their number arguments only
_FILLING = frozenset({"zeros", "ones", "zeros_like", "ones_like", "new_zeros", "new_ones", "full",
                      "full_like", "new_full", "fill", "scalar_tensor"})
# ops whose output is their input converted to the output's dtype
_CASTING = frozenset({"to", "_to_copy", "type", "type_as", "float", "double", "half", "bfloat16"})
# ...of which those whose number arguments are sizes only, and selections that fill
# with a number argument
_FILLING_NOTHING = frozenset({"zeros", "ones", "zeros_like", "ones_like", "new_zeros", "new_ones"})
_FILLING_WITH = frozenset({"where", "masked_fill"})
_MASK_WALK_LIMIT = 64  # nodes looked at, at most: past it the mask is not known


def _op_name(node: Any) -> str | None:
    """What ``node`` computes, by name, the same in every dialect: ``aten.where.self``,
    ``torch.where`` and ``x.where`` are all ``"where"``."""
    target = node.target
    if node.op == "call_method":
        return target if isinstance(target, str) else None
    if node.op != "call_function":
        return None
    packet = getattr(target, "overloadpacket", None)
    name = getattr(packet if packet is not None else target, "__name__", None)
    return name.rstrip("_") if name == "masked_fill_" else name


def _holds_finitely(dtype: torch.dtype, source: torch.dtype) -> bool:
    """Every finite value of ``source`` converts to a finite value of ``dtype``."""
    if source == dtype or source == torch.bool:
        return True
    if not dtype.is_floating_point:
        return True  # an integer or bool result holds no -inf
    if source.is_floating_point:
        return torch.finfo(source).max <= torch.finfo(dtype).max and (
            source != torch.float32 or dtype != torch.bfloat16)  # float32's max rounds up to inf there
    if source.is_complex:
        return False
    return torch.iinfo(source).max <= torch.finfo(dtype).max


def _finite_number(v: int | float, dtype: torch.dtype) -> bool:
    """A number that stays finite converted to ``dtype`` (-3.4e38 is -inf in float16)."""
    return not dtype.is_floating_point or bool(torch.isfinite(torch.tensor(float(v), dtype=torch.float64).to(dtype)))


def _no_minus_inf(x: Value) -> bool | None:
    """True when no element of ``x`` can be -inf, from how the graph computes it;
    None when that is not known."""
    return _every_value(x, _finite_number, lambda t: not bool(torch.isneginf(t).any()), integers=True)


def _every_value(x: Value, number_ok: Any, tensor_ok: Any, integers: bool) -> bool | None:
    """True when every value ``x`` can hold passes the checks, from how the graph
    computes it: ``number_ok(v, dtype)`` for each number a fill or selection puts in
    it, ``tensor_ok(t)`` for each constant it reads; ``integers``: values converted
    from an integer tensor (of unknown size) are allowed. None when not known."""
    facts = x.facts
    gm = facts.gm
    # a write in place may put -inf into a value after it is computed: the memory of
    # every value written (T5's bucket arithmetic writes integers in place)
    written = {storage_base(w, gm) for n in gm.graph.nodes for w in written_nodes(n, gm)} \
        if graph_writes(gm) else ()
    todo, seen = [x.operand], set()
    while todo:
        operand = todo.pop()
        if isinstance(operand, ConstRef):  # a module's tensor (symbolic_trace's call_module operands)
            t = facts.constant_of(operand) if facts.is_const(operand) else None
            if not isinstance(t, torch.Tensor) or not tensor_ok(t):
                return None
            continue
        if not isinstance(operand, torch.fx.Node):
            return None  # (a literal is never_minus_inf's to answer; only nodes are queued)
        if operand in seen:
            continue
        seen.add(operand)
        if len(seen) > _MASK_WALK_LIMIT:
            return None
        meta = facts.meta(operand)
        if meta is None:
            return None
        dtype = meta.dtype
        if dtype.is_complex:
            return None
        if not dtype.is_floating_point:
            continue  # integers and bools hold no -inf (a conversion of them is looked at)
        if written and storage_base(operand, gm) in written:
            return None
        if operand.op == "get_attr":
            if not facts.is_const(operand):
                return None  # the graph writes it: its values when it is read are not these
            t = facts.constant_of(operand)
            if not isinstance(t, torch.Tensor) or not tensor_ok(t):
                return None
            continue
        name = _op_name(operand)
        # the numbers that become values (a fill's, where's, masked_fill's: not sizes,
        # dims or positions, and no list of them)
        numbers = [v for v in (*operand.args, *operand.kwargs.values())
                   if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if name in _FILLING:
            if name not in _FILLING_NOTHING and not all(number_ok(v, dtype) for v in numbers):
                return None
            todo.extend(n for n in operand.all_input_nodes if name == "fill")
            continue
        if name in _CASTING:
            source = operand.args[0] if operand.args else None
            sm = facts.meta(source) if isinstance(source, torch.fx.Node) else None
            if sm is None or not _holds_finitely(dtype, sm.dtype) or (
                    not integers and not sm.dtype.is_floating_point and sm.dtype != torch.bool):
                return None
            todo.append(source)
            continue
        if name not in _SELECTING:
            return None
        if name == "where" and not operand.kwargs and len(operand.args) == 3 and _always_true(operand.args[0]):
            # a condition true everywhere (ViT's ``where(arange(n) >= 0, 0, finfo.min)``):
            # only the first choice becomes values
            chosen = operand.args[1]
            if isinstance(chosen, torch.fx.Node):
                todo.append(chosen)
            elif not (isinstance(chosen, (int, float)) and not isinstance(chosen, bool)
                      and number_ok(chosen, dtype)):
                return None
            continue
        if name in _FILLING_WITH and not all(number_ok(v, dtype) for v in numbers):
            return None
        for arg in operand.all_input_nodes:
            am = facts.meta(arg)
            if am is None:
                return None
            if am.dtype.is_floating_point:
                todo.append(arg)
            elif name not in _INDEXING and (not _holds_finitely(dtype, am.dtype) or (
                    not integers and am.dtype != torch.bool)):
                return None  # integer values that a half-precision result may not hold
    return True


#: a mask value at least this large rounds every attention score away in float32 too
_HUGE = 2.0 ** 100
#: a bias below 2**(mantissa bits - 5) is of the size of the scores it is added to:
#: the sum's rounding step stays at most 2**-5 (float16: below 32; bfloat16: below 4),
#: as the scores' own precision; past it, a value swamps them (a mask's -10000 or -65504)
_SCORE_SIZED = {torch.float16: 2.0 ** (10 - 5), torch.bfloat16: 2.0 ** (7 - 5)}


def _rounds_alike(v: float, dtype: torch.dtype) -> bool:
    """Adding ``v`` to attention scores in half precision keeps what float32 keeps:
    a value of the scores' own size, or one so large that float32 rounds them away
    too (bfloat16's ``finfo.min``)."""
    return abs(v) < _score_sized(dtype) or abs(v) >= _HUGE or math.isnan(v)


def _score_sized(dtype: torch.dtype) -> float:
    """The bound for ``dtype``; for another (a float32 value on its way into a
    bfloat16 mask) the smaller one."""
    return _SCORE_SIZED.get(dtype, min(_SCORE_SIZED.values()))


def _number_rounds_alike(v: int | float, dtype: torch.dtype) -> bool:
    return _rounds_alike(float(torch.tensor(float(v), dtype=torch.float64).to(dtype)), dtype)


def _tensor_rounds_alike(t: torch.Tensor) -> bool:
    if not t.is_floating_point():
        return False
    a = t.detach().abs()
    return not bool(((a >= _score_sized(t.dtype)) & (a < _HUGE)).any())


@register_predicate()
def mask_rounds_alike(m: Value, q: Value) -> bool:
    """Adding the mask ``m`` to the scores of queries ``q`` rounds them in ``q``'s
    dtype as ``scaled_dot_product_attention`` does: always in float32 and float64; in
    float16 and bfloat16, where the CPU kernel adds the mask in float32, only when
    every value ``m`` can hold is of the scores' own size (below 32 in float16, 4 in
    bfloat16) or so large that float32 rounds the scores away too. Else a row masked throughout differs: float16's ``finfo.min``
    (-65504) rounds a fully padded row's scores to one value in the written-out
    softmax (a uniform average) while the kernel keeps them (probe X F1: a float16 T5
    encoder off by 1.7 on a padded sequence). bfloat16's ``finfo.min`` is large
    enough. Unknown values: the rule does not fire."""
    meta = q.meta
    if meta is None or not meta.dtype.is_floating_point:
        return False
    if meta.dtype in (torch.float32, torch.float64):
        return True
    if m.is_literal:
        v = m.literal
        return isinstance(v, (int, float)) and not isinstance(v, bool) and _number_rounds_alike(v, meta.dtype)
    return bool(_every_value(m, _number_rounds_alike, _tensor_rounds_alike, integers=False))


#: comparisons a condition may be made of, and when each holds for every value in [low, high]
_HOLDS_FOR_RANGE = {"ge": lambda low, high, k: low >= k, "gt": lambda low, high, k: low > k,
                    "le": lambda low, high, k: high <= k, "lt": lambda low, high, k: high < k}
#: ops whose values are some of their first argument's (views, selections)
_SAME_VALUES = frozenset({"unsqueeze", "expand", "view", "reshape", "_unsafe_view", "slice", "select", "squeeze",
                          "permute", "transpose", "contiguous", "clone", "alias"})


def _always_true(cond: Any, depth: int = 0) -> bool:
    """``cond`` is a comparison that holds for every element, from the range of the
    values it compares (an ``arange``, shifted by a number, through views): False
    when not proven."""
    if not isinstance(cond, torch.fx.Node) or cond.op != "call_function" or depth > 16:
        return False
    if _op_name(cond) in _SAME_VALUES and cond.args:  # a view of the comparison (its expand)
        return _always_true(cond.args[0], depth + 1)
    if cond.kwargs or len(cond.args) != 2:
        return False
    name, (x, k) = _op_name(cond), cond.args
    if name not in _HOLDS_FOR_RANGE or isinstance(k, bool) or not isinstance(k, (int, float)):
        return False
    span = _value_range(x, depth)
    return span is not None and _HOLDS_FOR_RANGE[name](span[0], span[1], k)


def _value_range(x: Any, depth: int = 0) -> tuple | None:
    """(low, high) bounding every value of ``x``, for an integer ``arange`` of literal
    bounds shifted by numbers and seen through views; None when not known."""
    if not isinstance(x, torch.fx.Node) or depth > 16 or x.op != "call_function":
        return None
    name = _op_name(x)
    if name == "arange":
        bounds = x.args
        step = x.kwargs.get("step", bounds[2] if len(bounds) > 2 else 1)
        if step != 1 or not bounds or not all(type(b) is int for b in bounds[:2]):
            return None
        start, end = (0, bounds[0]) if len(bounds) == 1 else (bounds[0], bounds[1])
        return (start, end - 1) if end > start else None
    if name in ("add", "sub") and len(x.args) == 2 and not x.kwargs:
        c = x.args[1]
        if isinstance(c, bool) or not isinstance(c, (int, float)):
            return None
        span = _value_range(x.args[0], depth + 1)
        if span is None:
            return None
        shift = c if name == "add" else -c
        return (span[0] + shift, span[1] + shift)
    if name in _SAME_VALUES and x.args:
        return _value_range(x.args[0], depth + 1)
    return None


@register_predicate()
def never_minus_inf(x: Value) -> bool:
    """No element of ``x`` can be -inf, as far as the graph shows: a constant without
    -inf, a finite fill (``zeros``, ``full(..., finfo.min)``), or a selection of such
    values (``where``, ``masked_fill`` with a finite value, views, ``cat``, ``embedding``
    of a constant table, conversions that cannot overflow). A mask in the attention
    rules must be: a query row masked with -inf throughout is NaN in the written-out
    softmax and 0 in ``scaled_dot_product_attention``. Anything else (a graph input, an
    arithmetic op that may overflow) is not known: the rule does not fire."""
    if x.is_literal:
        v = x.literal
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v != float("-inf")
    return _no_minus_inf(x)
