"""How many results an op or a node has: what multi-output patterns check.

A pattern may bind the results of an op that returns several values
(``split(x, 2, 0) as (a, b)``); the graph reads them through
``operator.getitem(node, i)``. The rule fires only where the number of results is
the one the rule was written for, so this module answers, from what is known:

* for an op a rule names (``output_kind``): from torch's schemas, one result
  (``Tensor``), a fixed number (``(Tensor, Tensor)``: ``aten.max.dim``) or a list
  whose length depends on the arguments (``Tensor[]``: ``aten.split.Tensor``);
  torch functions and ``Tensor`` methods answer from the aten op of the same name
  when all its overloads agree;
* for a node (``result_count``): a fixed schema count, else the length of the
  tuple its recorded value (``meta['val']`` or recorded facts) holds; None when
  unknown, and an unknown count never lets a rule fire where it matters.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch
import torch.fx as fx

from rewrite.engine.facts import tensor_meta_of
from rewrite.ops.base import GetitemForm
from rewrite.ops.effects import op_name

__all__ = [
    "ONE", "LIST", "output_kind", "single_output", "fixed_count", "result_count", "getitem_users", "results_opdef",
]

#: an op returning one tensor
ONE = "one"
#: an op returning a list of tensors whose length depends on its arguments
LIST = "list"


def _returns_kind(schema: Any) -> Any:
    returns = schema.returns
    if len(returns) == 1:
        kind = returns[0].type.kind()
        return LIST if kind == "ListType" else ONE
    return len(returns) if returns else None


@functools.lru_cache(maxsize=None)
def _packet_kind(name: str) -> Any:
    """The result kind shared by every overload of ``aten.<name>``, or None."""
    packet = getattr(torch.ops.aten, name, None) if name and not name.startswith("__") else None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return None
    kinds = set()
    for overload in packet.overloads():
        schema = getattr(packet, overload)._schema
        if any(a.is_out for a in schema.arguments):
            continue  # out= variants return their out arguments
        kinds.add(_returns_kind(schema))
    return kinds.pop() if len(kinds) == 1 else None


def _target_kind(target: Any) -> Any:
    if isinstance(target, torch._ops.OpOverload):
        return _returns_kind(target._schema)
    if target is operator.getitem:
        return ONE
    return _packet_kind(op_name(target))


def output_kind(opdef: Any) -> Any:
    """``ONE``, ``LIST``, a fixed count (int > 1), or None (unknown or the op's
    surfaces disagree) for the results of ``opdef`` as a rule names it."""
    kinds = set()
    for form in opdef.forms:
        if isinstance(form, GetitemForm):
            kinds.add(ONE)  # one result of a multi-output op
            continue
        target = getattr(form, "target", None) or getattr(form, "method", None)
        if target is None:  # a module: one output
            kinds.add(ONE)
            continue
        kinds.add(_target_kind(target))
    return kinds.pop() if len(kinds) == 1 else None


def single_output(opdef: Any) -> bool:
    """The schema says every surface of ``opdef`` returns one tensor."""
    return output_kind(opdef) == ONE


def fixed_count(opdef: Any) -> int | None:
    """The number of results every surface of ``opdef`` returns, when fixed."""
    kind = output_kind(opdef)
    return kind if isinstance(kind, int) else None


def result_count(node: fx.Node, facts: Any = None) -> int | None:
    """How many results ``node`` produces: its schema's fixed count, else the
    length of its recorded tuple value (asking ``facts`` to record one on graphs
    that carry none); None when unknown."""
    if node.op == "call_function":
        kind = _target_kind(node.target)
        if isinstance(kind, int):
            return kind
        if kind == ONE:
            return None
    if facts is not None:
        facts.meta(node)  # records facts (a tuple of them) on graphs without
    value = tensor_meta_of(node)
    if isinstance(value, (tuple, list)):
        return len(value)
    return None


def getitem_users(node: fx.Node) -> dict | None:
    """``{index: [getitem nodes]}`` of ``node``'s users that read one result;
    None when some user reads the value otherwise (returns the whole tuple,
    passes it on, or indexes it with something other than an int)."""
    out: dict = {}
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem or len(user.args) != 2 \
                or user.args[0] is not node or user.kwargs:
            return None
        index = user.args[1]
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            return None
        out.setdefault(index, []).append(user)
    return out


def results_opdef(name: str, opdef: Any) -> Any:
    """The op a tuple binding ``name(...) as (a, b)`` matches: ``opdef`` itself,
    except for a qualified name the vocabulary reads as one result of a
    multi-output op (``aten.native_layer_norm`` binds as ``layer_norm`` through
    ``getitem(..., 0)``), which is then the multi-output op as its schema says."""
    if not opdef.forms or not all(isinstance(f, GetitemForm) for f in opdef.forms):
        return opdef
    from rewrite.ops.generic import generic_opdef
    from rewrite.ops.resolve import normalize_qualname

    qualname = normalize_qualname(name)
    return (generic_opdef(qualname) if qualname is not None else None) or opdef
