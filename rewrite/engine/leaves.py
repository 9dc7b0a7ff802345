"""Warn when ``symbolic_trace`` hid ops a rule set would rewrite inside leaf modules.

``torch.fx.symbolic_trace`` keeps every ``torch.nn`` module as one ``call_module``
node. The vocabulary reads the common ones (``nn.Linear`` is ``linear``), but a
composite such as ``nn.TransformerEncoder`` or ``nn.MultiheadAttention`` is opaque:
the eight linears inside a two-layer encoder are invisible to a rule set rooted at
``linear``, which then rewrites 1 of 8 without a word. ``torch.export`` traces
through them, so the warning names the modules, the ops they hide, and that fix.
"""

from __future__ import annotations

import collections
from typing import Iterable

import torch.fx as fx

from rewrite.capture import hooked

__all__ = ["LeafModuleWarning", "hidden_ops", "leaf_warning"]


class LeafModuleWarning(UserWarning):
    """Leaf modules of the captured graph contain ops the rule set rewrites."""


def _ops_of_module_type(cls: type) -> tuple:
    """The ops a module of type ``cls`` computes, through its nearest known base
    (``NonDynamicallyQuantizableLinear``, MultiheadAttention's ``out_proj``, is a linear)."""
    from rewrite.ops.vocabulary import forms_for_key

    for base in cls.__mro__:
        forms = forms_for_key(("call_module", base))
        if forms:
            return tuple(dict.fromkeys(opdef.name for opdef, _ in forms))
    return ()


def hidden_ops(gm: fx.GraphModule, root_ops: Iterable[str]) -> dict:
    """``{qualname: Counter(op -> count)}`` for each ``call_module`` node the
    vocabulary cannot read whose submodules compute ops in ``root_ops``. A lower
    bound: ops a module computes from its own parameters (MultiheadAttention's
    input projection) have no submodule to count."""
    from rewrite.ops import bind_node
    from rewrite.ops.base import submodule

    wanted = frozenset(root_ops)
    out: dict = {}
    seen: set = set()
    for node in gm.graph.find_nodes(op="call_module"):
        if node.target in seen:
            continue
        seen.add(node.target)
        try:
            module = submodule(gm, node.target)
        except AttributeError:
            continue
        if not module._modules or bind_node(node, gm):
            continue  # nothing inside it, or the vocabulary reads it as an op
        inside: collections.Counter = collections.Counter()
        for sub in module.modules():
            if sub is module:
                continue
            for op in _ops_of_module_type(type(sub)):
                if op in wanted:
                    inside[op] += 1
        if inside:
            out[node.target] = inside
    return out


def leaf_warning(gm: fx.GraphModule, root_ops: Iterable[str]) -> str | None:
    """The warning text for ``hidden_ops`` (None when nothing is hidden)."""
    hidden = hidden_ops(gm, root_ops)
    if not hidden:
        return None
    hooks = {q for q in hidden if hooked(gm.get_submodule(q))}
    texts = []
    for group, why, advice in (
            ([q for q in hidden if q not in hooks], "torch.fx.symbolic_trace keeps torch.nn modules as single calls",
             "Capture with torch.export (torch.export.export(model, inputs).module(), capture='export', "
             "--capture export) to rewrite inside them."),
            ([q for q in hidden if q in hooks], "they are kept as single calls because the caller registered hooks "
             "on them, which run on every call only so", "Remove the hooks while rewriting to rewrite inside them "
             "(a torch.export capture would run them once, at capture time, and never again).")):
        if not group:
            continue
        types = collections.Counter(type(gm.get_submodule(q)).__name__ for q in group)
        ops = sum((hidden[q] for q in group), collections.Counter())
        shown = ", ".join(f"{t} x{n}" for t, n in sorted(types.items()))
        hid = ", ".join(f"{op} x{n}" for op, n in sorted(ops.items()))
        texts.append(f"{len(group)} leaf module(s) of the captured graph ({shown}) hide at least "
                     f"{sum(ops.values())} op(s) this rule set rewrites ({hid}): {why}. {advice}")
    return "rewrite: " + " And ".join(texts)
