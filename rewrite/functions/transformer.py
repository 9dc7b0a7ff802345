"""Predicates and rewrite-time functions of the transformer rules (``rules/transformer.rw``).

The rules turn attention, RMSNorm, LayerNorm and tanh-GELU written out op by op into
the one op torch has for each. Each rewrite holds only for particular shapes and
arguments (softmax over the last dim, a transpose of the last two dims, a mask that
broadcasts to the scores, a norm weight of the normalized size), and the facts for
that live here. Like every predicate, these return None when the graph does not
say (no shape information), so a rule whose fact is unknown does not fire.
"""

from __future__ import annotations

from typing import Any

import torch

from rewrite.engine.facts import Value
from rewrite.functions.registry import register_constant, register_predicate

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
