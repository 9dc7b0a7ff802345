"""Reuse the original's values where a rewrite left the computation as it was.

The check runs the original and the rewrite on the same inputs, a few times. Most
nodes of a rewritten graph are the original's, untouched by any rule: the same op
on the same values. For those, the rewrite's run takes the value the original's
run computed instead of computing it again, when that is exactly what computing it
would give:

- the op is a pure, deterministic ATen op whose result is fresh memory (its
  schema writes nothing and returns no alias; its tags say it draws no random
  numbers and may neither alias nor mutate);
- the node is the original's node of the same name, with the same target and the
  same literal arguments;
- each of its inputs is the very value the original's node read, or one known to
  be bitwise the same: computed by such a reused step, or compared once (dtype,
  shape, strides, offset and every bit: ``-0.0`` is not ``0.0``).

A view of such values (``reshape``, ``transpose``, ``getitem``) is computed again,
on the rewrite's own tensors (what it shares memory with is part of what the check
compares), and is then known to hold the same bits. So the comparison downstream
of a rewrite that changed no bit (``x * 1 => x``) costs a dictionary look-up per
node, and a rewrite that changed values recomputes what depends on them, as
before. Nothing is reused when either graph writes in place (a reused value must
stay what the original computed), when a node is not a plain function call (a
module may keep state), or when the original's values would not fit
``MAX_RECORDED_BYTES``.
"""

from __future__ import annotations

import operator
import struct
from typing import Any, Dict, Optional

import torch
from torch import fx
from torch._ops import OpOverload
from torch.utils import _pytree as pytree

from rewrite.engine.aliasing import graph_writes
from rewrite.ops.effects import may_alias, may_alias_any_argument
from rewrite.ops.base import by_identity

__all__ = ["MAX_RECORDED_BYTES", "Recording", "ReusePlan", "bitwise_same", "inputs_same", "record_plan", "recordable"]

#: the most memory the original's values of one trial may take to be kept for reuse
MAX_RECORDED_BYTES = 64 * 2**20

_FRESH, _VIEW = "fresh", "view"
_EXCLUDED_TAGS = frozenset(getattr(torch.Tag, name) for name in (
    "nondeterministic_seeded", "nondeterministic_bitwise", "maybe_aliasing_or_mutating", "inplace_view")
    if hasattr(torch.Tag, name))
_KINDS: dict = {}  # id(target) -> (target, _FRESH, _VIEW or None)
_SLOT = object()  # a value the recording does not hold
_BATCH_NORM = torch.ops.aten.batch_norm.default
_NODE = fx.Node
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _kind(target: Any) -> Optional[str]:
    """``_FRESH`` (a pure op returning fresh memory), ``_VIEW`` (a pure op that may
    return a view of an input) or None (anything else: computed, never trusted)."""
    return by_identity(_KINDS, target, _kind_of)


def _kind_of(target: Any) -> Optional[str]:
    if target is operator.getitem:
        return _VIEW
    if type(target) is not OpOverload:
        return None
    schema = target._schema
    if schema.is_mutable or _EXCLUDED_TAGS.intersection(target.tags):
        return None
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return None
    return _VIEW if any(r.alias_info is not None for r in schema.returns) else _FRESH


def _node_kind(node: fx.Node, gm: fx.GraphModule) -> Optional[str]:
    """``_kind`` of the node's target, with batch norm in inference a pure op (its
    tags say it may write, for the running statistics training updates), and an op
    whose schema promises fresh memory but which may hand back an input or a view of
    one (``type_as``, ``einsum("ij->ji")``, ``sum_to_size``, ``broadcast_tensors``:
    the engine's alias analysis says so) a view: what the rewrite's outputs share
    must be the rewrite's own, so it is recomputed."""
    kind = _kind(node.target)
    if kind is None and node.target is _BATCH_NORM and len(node.args) > 5 and node.args[5] is False:
        kind = _FRESH
    if kind == _FRESH and (may_alias(node, gm) or may_alias_any_argument(node, gm)):
        kind = _VIEW
    return kind


def _functional(gm: fx.GraphModule) -> bool:
    """No node writes in place, and every call is a plain function call (a module
    may keep state): a reused value stays what the original computed."""
    return not any(n.op in ("call_module", "call_method") and not _export_guard(n) for n in gm.graph.nodes) \
        and not graph_writes(gm)


def _export_guard(node: fx.Node) -> bool:
    """torch.export's guard call (``_guards_fn``): it checks the inputs, returns
    nothing and keeps no state."""
    return node.op == "call_module" and node.target == "_guards_fn" and not node.users


def _aligned(mine: tuple, theirs: tuple, pairs: list) -> bool:
    """Whether two nodes' argument tuples (or keyword dicts) are the same but for
    the values they read: the same literals (of the same types; floats by their
    bits) in the same containers, values where values are; appends each (own
    value, original's value) to ``pairs``. Flat arguments of values, ints, bools
    and None (most) take no call per item."""
    if type(mine) is dict:
        return mine.keys() == theirs.keys() and _aligned(tuple(mine.values()), tuple(theirs.values()), pairs)
    if len(mine) != len(theirs):
        return False
    for a, b in zip(mine, theirs):
        kind = type(a)
        if kind is _NODE:
            if type(b) is not _NODE:
                return False
            pairs.append((a, b))
        elif a is b:  # a copied graph shares its literals
            continue
        elif kind is not type(b):
            return False
        elif kind is int or kind is bool:
            if a != b:
                return False
        elif a is not None and not _aligned_value(a, b, pairs):
            return False
    return True


def _aligned_value(mine: Any, theirs: Any, pairs: list) -> bool:
    """``_aligned`` for one argument of the same type on both sides."""
    if isinstance(mine, fx.Node):
        pairs.append((mine, theirs))
        return True
    if isinstance(mine, (tuple, list, dict)):
        return _aligned(mine, theirs, pairs)
    if type(mine) is float:
        return struct.pack("<d", mine) == struct.pack("<d", theirs)
    if mine is theirs:
        return True
    try:
        return bool(mine == theirs)
    except Exception:  # noqa: BLE001 - not comparable: not known to be the same
        return False


def recordable(gm: Any) -> bool:
    """Whether the values of a run of ``gm`` can serve a rewrite's run: a
    GraphModule of plain function calls, none writing in place, whose values (by
    its metadata) fit ``MAX_RECORDED_BYTES``."""
    if not isinstance(gm, fx.GraphModule) or not _functional(gm):
        return False
    total = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        val = node.meta.get("val", _SLOT)
        if val is _SLOT:
            return False  # no metadata: the size is not known
        for t in (val,) if isinstance(val, torch.Tensor) else pytree.tree_leaves(val):
            if isinstance(t, torch.Tensor):
                numel = t.numel()
                if isinstance(numel, torch.SymInt):  # int() would guard the graph's ShapeEnv
                    numel = numel.node.hint
                    if numel is None:
                        return False  # no example size: not known to fit
                total += int(numel) * t.element_size()
    return total <= MAX_RECORDED_BYTES


def record_plan(gm: fx.GraphModule) -> Dict[str, tuple]:
    """What each call node of ``gm`` computes from: name -> (the node, its target,
    its arguments, its keyword arguments). Taken before an in-place rewrite changes
    the graph (which gives a node it rewires new argument tuples)."""
    plan: Dict[str, tuple] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            plan[node.name] = (node, node.target, node.args, node.kwargs)
    return plan


class Recording:
    """The values of one run of the original by node (``plan``: ``record_plan`` of
    its graph), and whether gradients were enabled (a value computed with them
    carries its autograd history). ``observe`` is what the runner calls per node."""

    def __init__(self, plan: Dict[str, tuple]) -> None:
        self.plan = plan
        self.values: Dict[fx.Node, Any] = {}
        self.observe = self.values.__setitem__
        self.grad = False
        self.complete = False

    def start(self) -> None:
        self.values.clear()
        self.grad = torch.is_grad_enabled()
        self.complete = False


class ReusePlan:
    """Per step of a rewrite's ``GraphRunner`` (same order; ``how(i)``), how it may
    reuse the values of a ``Recording`` made with ``plan``: None (compute it), or ``(fresh,
    original, pairs)``: the original's node ``original`` computed it from the
    values of ``pairs`` ((own input node, the original's input node, whether to
    compare their bits), ...); ``fresh``: take its value, else compute it and know
    it equal."""

    def __init__(self, gm: fx.GraphModule, steps: list, plan: Dict[str, tuple]) -> None:
        self.plan = plan
        self._gm = gm
        self._nodes = [step[0] for step in steps]
        self._entries = plan if _functional(gm) else {}
        self._steps: list = []  # decided so far, in order (a run that gives up decides no more)
        self._matched: dict = {}  # node -> the original's node it stands for
        #: the steps that compute something (calls), what reuse can save
        self.computing = sum(1 for n in self._nodes if n.op.startswith("call_"))

    def how(self, i: int) -> Optional[tuple]:
        """Step ``i``'s entry, decided on first asking (steps in order: a step's
        inputs are decided before it)."""
        steps = self._steps
        while len(steps) <= i:
            steps.append(self._decide(self._nodes[len(steps)]))
        return steps[i]

    def _decide(self, node: fx.Node) -> Optional[tuple]:
        entry = self._entries.get(node.name) if node.op == "call_function" else None
        if entry is None or entry[1] is not node.target:
            return None
        kind = _node_kind(node, self._gm)
        pairs: list = []
        if kind is None or not (_aligned(node.args, entry[2], pairs) and _aligned(node.kwargs, entry[3], pairs)):
            return None
        matched = self._matched
        matched[node] = entry[0]
        # an input that is itself a matched step, read where the original read its
        # own original, holds the original's value unless it was computed again
        # because its own inputs differed: comparing its bits would then find them
        # different (and cost a comparison at every step downstream of a change);
        # an input a rewrite put in another's place is compared
        return (kind == _FRESH, entry[0], tuple((n, theirs, matched.get(n) is not theirs) for n, theirs in pairs))

    def usable(self, recording: Recording) -> bool:
        """The recording is whole, made with this plan, in the grad mode now in force."""
        return (bool(self._entries) and recording.complete and recording.plan is self.plan
                and recording.grad == torch.is_grad_enabled())


def inputs_same(how: tuple, values: dict, env: dict, same: set) -> bool:
    """Every input of a step (``ReusePlan.how``) holds the original's value
    (``values``, a ``Recording``'s) or the same bits; ``same``: the pairs known to."""
    for node, theirs_node, testable in how[2]:
        mine = env[node]
        theirs = values.get(theirs_node, _SLOT)
        if mine is theirs or (node, theirs_node) in same:
            continue
        if not testable or theirs is _SLOT or not bitwise_same(mine, theirs):
            return False
        same.add((node, theirs_node))
    return True


def bitwise_same(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are interchangeable as inputs of a deterministic op: plain
    tensors of the same dtype, device, shape, strides and offset holding the same
    bits, or the same Python scalars, or sequences of such."""
    if type(a) is not type(b):
        return False
    if type(a) is torch.Tensor:
        if (a.dtype != b.dtype or a.device != b.device or a.layout != torch.strided or b.layout != torch.strided
                or a.shape != b.shape or a.stride() != b.stride() or a.storage_offset() != b.storage_offset()
                or a.requires_grad != b.requires_grad or a.is_quantized or a.is_conj() != b.is_conj()
                or a.is_neg() != b.is_neg()):
            return False
        a, b = a.detach(), b.detach()
        if a.is_complex():
            a, b = torch.view_as_real(a), torch.view_as_real(b)
        if a.is_floating_point():  # compare bits: -0.0 differs from 0.0, a NaN equals itself
            bits = _INT_OF_SIZE.get(a.element_size())
            if bits is None:
                return False
            a, b = a.view(bits), b.view(bits)
        return bool(torch.equal(a, b))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(bitwise_same(x, y) for x, y in zip(a, b))
    if type(a) is float:
        return struct.pack("<d", a) == struct.pack("<d", b)
    if type(a) in (int, bool, str, type(None), torch.dtype, torch.device):
        return a == b
    return False
