"""The op vocabulary: look ops up by name, bind graph nodes to them.

The table lives in ``rewrite.ops.table_nn`` (layers) and ``rewrite.ops.table_tensor``
(tensor ops); adding an op is adding one ``op(...)`` entry there. This module indexes
the table once, at import:

* by node key (``node_key``: target, method name or module class), so binding a node
  is one dict lookup plus the few forms that share its target;
* by qualified name (``F.relu``, ``aten.conv2d.default``, ``nn.Conv2d``), so a rule
  can pin one spelling.

Example::

    >>> gm = torch.fx.symbolic_trace(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()))
    >>> [bind_node(n, gm) for n in gm.graph.nodes if n.op == "call_module"]
    [(Bound(op='conv', args={'input': input_1, 'weight': ConstRef('0.weight'), ...}),),
     (Bound(op='relu', args={'input': _0}),)]
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import torch
import torch.fx as fx

from rewrite.ops import table_nn, table_tensor
from rewrite.ops.base import CALL_OPS, Emitter, MethodForm, OpDef, node_key, nodes_by_target
from rewrite.ops.builders import emittable
from rewrite.ops.custom import INTERNAL_NAMESPACES, Refusal, refusal
from rewrite.ops.effects import written_args
from rewrite.ops.forms import EmitError, call_for
from rewrite.ops.generic import generic_opdef
from rewrite.ops.resolve import normalize_qualname

__all__ = [
    "OPS", "in_vocabulary", "lookup_op", "op_refusal", "op_names", "forms_for_key", "forms_for_node", "bind_node", "detect_dialect",
    "mutates_input", "nodes_by_target", "CALL_OPS",
]

OPS: dict = {o.name: o for o in (*table_nn.OPS, *table_tensor.OPS)}


def _build_indexes() -> tuple:
    by_key: dict = {}
    by_name: dict = {}
    for opdef in OPS.values():
        for form in opdef.forms:
            by_key.setdefault(form.key, []).append((opdef, form))
            if getattr(form, "named", True):
                for q in (form.qualname, *form.aliases):
                    by_name.setdefault(q, []).append((opdef, form))
    return ({k: tuple(v) for k, v in by_key.items()}, {k: tuple(v) for k, v in by_name.items()})


_BY_KEY, _BY_QUALNAME = _build_indexes()


def op_names() -> list:
    """The canonical op names, sorted (what a rule file may call unqualified)."""
    return sorted(OPS)


def forms_for_key(key: Any) -> tuple:
    """``(OpDef, form)`` pairs that may bind a node with this ``node_key``."""
    try:
        return _BY_KEY.get(key, ())
    except TypeError:  # an unhashable target
        return ()


_BY_FUNCTION: dict = {}  # id(call_function target) -> (target, forms): an OpOverload hashes in Python


def forms_for_node(node: fx.Node, gm: Any) -> tuple:
    """``forms_for_key(node_key(node, gm))``, looked up by the target's identity
    for ``call_function`` nodes (every node of an export graph)."""
    if node.op != "call_function":
        return forms_for_key(node_key(node, gm))
    target = node.target
    hit = _BY_FUNCTION.get(id(target))
    if hit is None or hit[0] is not target:
        if len(_BY_FUNCTION) > 4096:
            _BY_FUNCTION.clear()
        hit = _BY_FUNCTION[id(target)] = (target, forms_for_key(("call_function", target)))
    return hit[1]


def bind_node(node: fx.Node, gm: Any) -> tuple:
    """Every canonical binding of ``node``: a tuple of ``Bound``, usually one.

    A ``getitem`` of ``_native_batch_norm_legit_no_training`` binds both as ``getitem``
    and as ``batch_norm``; ``aten.hardtanh(x, 0, 6)`` as ``hardtanh`` and ``relu6``.
    Placeholders, outputs, attributes, unknown targets and modules the vocabulary
    does not know (``torch.export``'s ``_guards_fn``) bind to nothing.
    """
    if node.op not in CALL_OPS:
        return ()
    out = []
    for opdef, form in forms_for_node(node, gm):
        bound = form.bind(node, gm, opdef)
        if bound is not None:
            out.append(bound)
    return tuple(out)


def detect_dialect(gm: Any) -> str:
    """``"aten"`` for ``torch.export`` graphs (call_function targets are
    ``OpOverload``s), ``"torch"`` for ``symbolic_trace`` and dynamo graphs."""
    aten = torch_level = 0
    modules = []
    for op, target, nodes in nodes_by_target(gm.graph):
        if op == "call_function":
            if isinstance(target, torch._ops.HigherOrderOperator) or (
                    isinstance(target, torch._ops.OpOverload) and target.namespace in INTERNAL_NAMESPACES):
                aten += len(nodes)  # a custom op's overload is what every capture level records: no vote
            elif getattr(target, "__module__", None) not in ("_operator", "operator", "builtins", "math"):
                torch_level += len(nodes)
        elif op == "call_method":
            torch_level += len(nodes)
        elif op == "call_module":
            modules.extend(nodes)
    # module calls the vocabulary reads vote torch too: counted (a look-up each) only
    # while they could still decide
    for node in modules:
        if not aten or torch_level > aten:
            break
        if forms_for_key(node_key(node, gm)):
            torch_level += 1
    return "aten" if aten and aten >= torch_level else "torch"


def mutates_input(node: fx.Node, gm: Any) -> bool:
    """Whether ``node`` writes into its first argument (``x.relu_()``, ``x += y``,
    ``F.relu(x, inplace=True)``, ``nn.ReLU(inplace=True)``, ``aten.relu_``): the
    in-place twins bind to the same canonical op, and a rewrite that replaces one
    must keep that write visible to the argument's other users."""
    return 0 in written_args(node, gm)


# ---- names -------------------------------------------------------------------


def _targets(forms: tuple) -> set:
    out = set()
    for form in forms:
        if isinstance(form, MethodForm):
            out.add(getattr(torch.Tensor, form.method))
        elif hasattr(form, "target"):
            out.add(form.target)
    return out


def _restricted_emitter(opdef: OpDef, forms: tuple, dialect: str) -> Emitter:
    """Emit exactly the named surface: the canonical choice when it is one of the
    named targets (``aten.conv2d`` keeps its ``.padding`` overload for string
    padding), else the first named ``call_function`` surface."""
    targets = _targets(forms)
    own = list(emittable(forms).values())

    def choose(args: dict, facts: Any = None) -> tuple:
        try:
            call = opdef.emit[dialect](args, facts)
            if not own or call[0] in targets:
                return call
        except EmitError:
            if not own:
                raise
        full = opdef.normalize_call((), dict(args))
        if full is None:
            raise EmitError(f"{opdef.name}: arguments {sorted(args)} do not fit {opdef.param_names}")
        return call_for(own[0], full, opdef)

    return Emitter(choose)


def _restricted(opdef: OpDef, forms: tuple) -> OpDef:
    return attrs.evolve(opdef, forms=forms, qualified=True, emit={
        d: _restricted_emitter(opdef, forms, d) for d in ("torch", "aten")})


def _named(qualname: str) -> tuple:
    """Forms written as ``qualname``; an aten packet (``aten.conv2d``) names all
    its overloads in the table."""
    hits = _BY_QUALNAME.get(qualname, ())
    if not hits and qualname.startswith("aten.") and qualname.count(".") == 1:
        prefix = qualname + "."
        hits = tuple(h for q, hs in _BY_QUALNAME.items() if q.startswith(prefix) and q.count(".") == 2
                     for h in hs)
    return hits


@functools.lru_cache(maxsize=1024)
def _pinned(qualname: str) -> OpDef | None:
    """The vocabulary op restricted to the surface ``qualname`` names, if one does."""
    hits = _named(qualname)
    if len({opdef.name for opdef, _ in hits}) != 1:
        return None
    return _restricted(hits[0][0], tuple(form for _, form in hits))


def lookup_op(name: str) -> OpDef | None:
    """The ``OpDef`` a rule file means by ``name``, or None.

    Args:
        name: a canonical op (``conv``) or a qualified name: ``aten.conv2d``,
            ``aten.conv2d.default``, ``torch.ops.aten.conv2d.default``, ``F.relu``,
            ``torch.nn.functional.relu``, ``torch.relu``, ``nn.Conv2d``,
            ``torch.nn.Conv2d``, ``Tensor.clamp``, ``operator.add``.

    Returns:
        For a canonical name, the op with all its surfaces. For a qualified name of
        a vocabulary surface, the same op (same name and parameters) restricted to
        that surface and emitting exactly that target. For another torch op on the
        allowlist (see ``rewrite.ops.generic``), an op built from its schema. None
        for anything else, including every name with a dunder.

    Example::

        >>> lookup_op("aten.conv2d").forms   # only aten.conv2d.default / .padding
        >>> lookup_op("os.system") is None
        True
    """
    if name in OPS:
        return OPS[name]
    qualname = normalize_qualname(name)
    if qualname is None:
        return None
    pinned = _pinned(qualname)
    if pinned is not None or qualname.startswith("nn."):
        return pinned
    # built afresh each time, so only canonical ops satisfy lookup_op(op.name) is op
    return generic_opdef(qualname)


def in_vocabulary(name: str) -> bool:
    """``name`` is a canonical op or names a surface of one (``aten.conv2d``,
    ``F.relu``): an op whose meaning the vocabulary states, not one built from a schema."""
    if name in OPS:
        return True
    qualname = normalize_qualname(name)
    return qualname is not None and _pinned(qualname) is not None


def op_refusal(name: str) -> Refusal | None:
    """Why ``name``, which ``lookup_op`` does not resolve, is not an op when it names
    a ``torch.library`` op (refused: it mutates, has side effects...; or its library
    is not registered): the diagnostic's message and hint. None otherwise."""
    qualname = normalize_qualname(name)
    return None if qualname is None else refusal(qualname)
