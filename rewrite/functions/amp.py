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
import torch.fx as fx

from rewrite.engine.facts import Value, tensor_meta_of
from rewrite.engine.replace import RULE_KEY as _MADE_BY_RULE  # nodes without it are the model's own
from rewrite.engine.shapes import layout_of
from rewrite.functions.builtins import overflows
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


def _model_layout(meta: Any) -> str | None:
    """``layout_of`` a node's recorded facts, telling channels_last apart from other
    strides also where the facts record strides without a tensor (``TensorFacts``)."""
    layout = layout_of(meta)
    stride, shape = getattr(meta, "stride", None), getattr(meta, "shape", None)
    if layout == "strided" and isinstance(stride, tuple) and shape is not None and len(shape) in (4, 5):
        probe = torch.empty_strided(tuple(shape), stride, device="meta")
        fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
        if probe.is_contiguous(memory_format=fmt):
            return "channels_last" if len(shape) == 4 else "channels_last_3d"
    return layout


#: ops whose output is a new contiguous tensor whatever their inputs' layouts
_FRESH_CONTIGUOUS = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "contiguous"})


def _layout_source(node: fx.Node, x: Value) -> str | None:
    """``"fresh"``: ``node`` computes a new contiguous tensor (a matrix product);
    ``"relaid"``: a convolution whose constant weight is not contiguous (the
    channels_last weights of ``cast_channels_last``); None: neither."""
    from rewrite.ops import bind_node

    bound = {b.op: b for b in bind_node(node, x.facts.gm)}
    if bound.keys() & _FRESH_CONTIGUOUS:
        return "fresh"
    if "conv" in bound:
        w = bound["conv"].args.get("weight")
        t = x.facts.constant_of(w) if w is not None and x.facts.is_const(w) else None
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_contiguous():
            return "relaid"
    return None


@register_predicate()
def model_contiguous(y: Value) -> bool | None:
    """``y`` stands for a value the model laid out contiguously, which the rules may
    have laid out otherwise: a value leaving the lowered region gets that layout back.

    A value of the model's own: its recorded facts say (``contiguous(y)`` is then a
    no-op). A value the rules computed: a convolution with a non-contiguous constant
    weight (``cast_channels_last``) computes it, directly or through other new nodes
    (its output is channels_last at run time, what the fallthrough ops keep; a matrix
    product in between makes a new contiguous tensor), and no value the model
    computed that it reads is channels_last (a channels_last model's convolutions are
    channels_last already). Shape inference is no guide here: on meta tensors a
    convolution ignores its weight's layout, under a FakeTensor mode it follows it."""
    node = y.node
    if node is None:
        return False if y.is_literal else None
    if _MADE_BY_RULE not in node.meta:
        layout = layout_of(y.meta)
        return None if layout is None else layout == "contiguous"
    gm = y.facts.gm
    if not any(isinstance(t := y.facts.constant_of(n), torch.Tensor) and t.layout == torch.strided
               and not t.is_contiguous() for n in gm.graph.find_nodes(op="get_attr")):
        return False  # no strided weight: every value is laid out as the model's
    relaid, seen, todo = False, {node}, [node]
    while todo:
        n = todo.pop()
        if n.op == "get_attr":
            continue
        if _MADE_BY_RULE not in n.meta:  # a value the model computed, read by the region
            if _model_layout(tensor_meta_of(n)) in ("channels_last", "channels_last_3d"):
                return False
            continue
        source = _layout_source(n, y)
        if source == "fresh":  # laid out as the model's whatever it reads
            continue
        relaid = relaid or source == "relaid"
        for i in n.all_input_nodes:
            if i not in seen:
                seen.add(i)
                todo.append(i)
    return relaid


@register_predicate(local=True)
def lowp_conv_broken(x: Value, w: Value, dtype: Value) -> bool | None:
    """A conv torch may compute wrongly in ``dtype``: torch 2.13's CPU bfloat16 conv3d
    returns values off by as much as the output's own scale over an input of depth 1
    with a deeper kernel, and NaN on other small shapes verification drew (a
    (2, 1, 3, 2, 1) output): every bfloat16 conv3d keeps float32 (float16 and the
    2-d and 1-d convs are right). None when a shape is unknown."""
    mx, mw = x.meta, w.meta
    if mx is None or mw is None:
        return None
    return dtype.literal == torch.bfloat16 and len(mw.shape) == 5  # the weight's: an unbatched input is 4-d


@register_predicate()
def fits(x: Value, dtype: Value) -> bool | None:
    """None, or a number ``dtype`` holds without overflow (within its largest finite
    value, or an infinity) and without underflow (a nonzero value stays within one
    rounding of itself): a clamp bound or pad value moved into float16 must not turn
    into inf (65504 is float16's largest value) nor into 0 (``clamp(min=1e-8)``)."""
    if x.is_literal and x.operand is None:
        return True
    if not (x.is_literal and isinstance(x.operand, (int, float)) and not isinstance(x.operand, bool)):
        return None if not x.is_literal else False
    target = dtype.literal if dtype.is_literal else None
    if not isinstance(target, torch.dtype) or not target.is_floating_point:
        return None
    v = float(x.operand)
    if math.isinf(v) or v == 0:
        return True
    info = torch.finfo(target)
    if abs(v) > info.max:
        return False
    # a bound that rounds to 0 or far from itself (clamp(min=1e-8) in float16 is
    # clamp(min=0): a log after it gives -inf) does not fit either
    rounded = float(torch.tensor(v, dtype=torch.float64).to(target))
    return rounded != 0 and abs(rounded - v) <= info.eps * abs(v)


@register_predicate()
def constants_fit(dtype: Value, *values: Value) -> bool | None:
    """Every constant tensor among ``values`` converts to ``dtype`` without a finite
    value overflowing to inf; graph values and literals pass (that what they hold
    fits is autocast's contract). A rule casting an operand at run time asks it:
    where the fold ``cast`` refuses a constant (a bias of -1e5 in float16), the run
    time cast would make the same inf."""
    target = dtype.literal if dtype.is_literal else None
    if not isinstance(target, torch.dtype) or not target.is_floating_point:
        return None
    for v in values:
        if not v.is_const or v.is_literal:
            continue
        if overflows(v.facts.constant_of(v.operand), target):
            return False
    return True


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
