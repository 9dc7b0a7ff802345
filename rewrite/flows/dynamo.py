"""A ``torch.compile`` backend that applies a rule set to dynamo graphs.

Dynamo passes parameters and buffers to the graph as inputs (placeholders), so a
folding rule would see them as runtime values and never fire. The backend freezes
them first: every placeholder whose source is a module parameter or buffer becomes a
constant attribute of the graph (``get_attr``), as Inductor's freezing does. The
compiled function then ignores those inputs; later in-place updates of the model's
parameters are not seen (compile again after changing weights).

Example::

    fused = torch.compile(model.eval(), backend=rewrite.backend(rewrite.load("rules/fusion.rw")))
    fused(x)
"""

from __future__ import annotations

import copy
import re
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

__all__ = ["backend", "freeze_parameters"]


def _is_module_state(node: fx.Node, example: Any) -> bool:
    # While the backend runs, meta["grapharg"] says where an input came from; dynamo
    # deletes it after compiling but keeps node._dynamo_source; recorders may have
    # saved it as meta["dynamo_source"].
    source = getattr(node.meta.get("grapharg"), "source", None)
    if source is None:
        source = getattr(node, "_dynamo_source", None) or node.meta.get("dynamo_source")
    if source is not None:
        text = str(source)
        return "_parameters" in text or "_buffers" in text or "ParamBufferSource" in text
    return isinstance(example, torch.nn.Parameter)


def freeze_parameters(gm: fx.GraphModule, example_inputs: list) -> tuple:
    """Turn placeholders fed by module parameters/buffers into ``get_attr`` constants.

    Returns ``(kept_indices, kept_example_inputs)``: the positions of the inputs the
    frozen graph still takes, and their example values. Mutates ``gm``.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    kept = []
    first_real = next((n for n in gm.graph.nodes if n.op != "placeholder"), None)
    for i, (node, example) in enumerate(zip(placeholders, example_inputs)):
        if not isinstance(example, torch.Tensor) or not _is_module_state(node, example):
            kept.append(i)
            continue
        name = re.sub(r"\W", "_", node.target).strip("_") or f"frozen_{i}"
        while hasattr(gm, name):
            name += "_"
        gm.register_buffer(name, example.detach())
        with gm.graph.inserting_before(first_real):
            attr = gm.graph.get_attr(name)
        attr.meta.update({k: v for k, v in node.meta.items() if k in ("val", "example_value", "tensor_meta")})
        node.replace_all_uses_with(attr)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return tuple(kept), [example_inputs[i] for i in kept]


def backend(rules: Any, *, check: bool = True, on_result: Callable | None = None, **apply_options: Any) -> Callable:
    """A ``torch.compile`` backend applying ``rules`` (a RuleSet) to each graph.

    Args:
        rules: the RuleSet to apply.
        check: run the randomized equivalence check on each graph.
        on_result: called with each ``RewriteResult`` (for logging or tests).
        apply_options: passed to ``RuleSet.apply`` (``rtol``, ``atol``, ``trials``,
            ``on_mismatch``...), e.g. looser tolerances for mixed precision.
    """

    def compile_fn(gm: fx.GraphModule, example_inputs: list) -> Callable:
        # Dynamo reads the graph it handed us after we return: work on a copy (of
        # the graph: parameters are shared until apply's own copy; code generated
        # only for the final graph, on its first call).
        gm = _LazyGraphModule(gm, copy.deepcopy(gm.graph))
        kept, kept_inputs = freeze_parameters(gm, list(example_inputs))
        result = rules.apply(gm, example_inputs=tuple(kept_inputs), check=check, **apply_options)
        if on_result is not None:
            on_result(result)
        rewritten = result.graph_module

        def run(*args: Any) -> Any:
            return rewritten(*[args[i] for i in kept])

        return run

    return compile_fn
