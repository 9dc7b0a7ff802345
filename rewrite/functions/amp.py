"""Rewrite-time functions and predicates of the AMP rule sets (``rules/amp_bf16.rw``,
``rules/amp_fp16.rw``).

The rule sets express ``torch.autocast``'s policy as graph rewrites: casts become
real ``to`` nodes, and casts of constant weights are computed once, at rewrite time,
by ``cast`` (``rewrite.functions.builtins``) or ``cast_channels_last`` below.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rewrite.engine.facts import Value
from rewrite.functions.registry import register_constant, register_predicate

__all__ = ["einsum_contracts"]  # the rest is reached through the registry


@register_predicate()
def is_number(x: Value) -> bool:
    """A Python int or float literal (not a bool): a scalar operand of an
    elementwise op, which keeps a tensor's dtype under type promotion."""
    return x.is_literal and isinstance(x.operand, (int, float)) and not isinstance(x.operand, bool)


@register_constant()
def cast_channels_last(t: Any, dtype: Any) -> Any:
    """A constant converted to ``dtype`` once, at rewrite time; a 4-d tensor (a 2-d
    convolution's weight) is also laid out channels_last.

    A channels_last weight makes torch's CPU convolution (oneDNN) produce
    channels_last outputs, which the following elementwise ops keep and the next
    convolution takes without reordering: in bfloat16 this is oneDNN's fast path.
    The values are those of ``cast(t, dtype)``; only the strides differ.
    """
    if not isinstance(t, torch.Tensor):
        return t
    out = t.to(dtype)
    if out.dim() == 4:
        out = out.contiguous(memory_format=torch.channels_last)
    return out


@register_predicate()
def fits(x: Value, dtype: Value) -> bool | None:
    """None, or a number ``dtype`` holds without overflow (within its largest finite
    value, or an infinity): a clamp bound or pad value moved into float16 must not
    turn into inf (65504 is float16's largest value)."""
    if x.is_literal and x.operand is None:
        return True
    if not (x.is_literal and isinstance(x.operand, (int, float)) and not isinstance(x.operand, bool)):
        return None if not x.is_literal else False
    target = dtype.literal if dtype.is_literal else None
    if not isinstance(target, torch.dtype) or not target.is_floating_point:
        return None
    v = float(x.operand)
    return math.isinf(v) or abs(v) <= torch.finfo(target).max


def _einsum_terms(equation: str) -> tuple[list[str], str] | None:
    """The operand index strings and the output's of an einsum equation (the
    implicit output: indices written once, sorted); None if it is not one."""
    eq = equation.replace(" ", "").replace("...", "")
    lhs, arrow, out = eq.partition("->")
    terms = lhs.split(",")
    if not all(t.isalpha() or t == "" for t in terms + [out]):
        return None
    if not arrow:
        letters = "".join(terms)
        out = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    return terms, out


def einsum_contracts(equation: str) -> bool:
    """A two-operand einsum equation with an index both operands share and the
    output drops ("bij,bjk->bik"): torch's CPU einsum computes it with bmm, which
    CPU autocast runs in bfloat16. Without one ("i,j->ij", "i,i->i") it is a mul,
    which autocast leaves in float32."""
    parsed = _einsum_terms(equation)
    if parsed is None or len(parsed[0]) != 2:
        return False
    (a, b), out = parsed
    return bool((set(a) & set(b)) - set(out))


@register_predicate()
def contracts(equation: Value) -> bool | None:
    """A two-operand einsum equation with a summed index both operands share
    (``einsum_contracts``): the einsums autocast runs in lower precision on CPU."""
    if not (equation.is_literal and isinstance(equation.operand, str)):
        return None
    return einsum_contracts(equation.operand)
