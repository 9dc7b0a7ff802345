"""The working copy a rewrite runs on: made cheaply, checked locally, compiled late.

``apply`` never mutates its input, so every rewrite starts from a copy. Two costs of
a plain ``copy.deepcopy(gm)`` are not rewriting: ``GraphModule.__init__`` generates
and compiles the Python ``forward`` of the copy (half of a deep copy's time, most
of its peak memory), and the result is compiled again after the rewrite. Here the
copy is a ``torch.fx._lazy_graph_module._LazyGraphModule`` (what Inductor uses for
the same reason): its code is generated on first call, on ``.code``, ``print`` or
``torch.save``, once, for the final graph.

``gc_paused`` stops the cyclic garbage collector while a rewrite allocates: a
graph of 10k nodes with FakeTensor metadata holds millions of tracked objects, and
the full collections that ordinary allocation triggers cost as much as matching.
"""

from __future__ import annotations

import contextlib
import copy
import gc
from typing import Iterable, Iterator

import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

__all__ = ["working_copy", "gc_paused", "check_touched", "compile_now"]


def working_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A deep copy of ``gm`` (graph, parameters, buffers, submodules) whose code is
    generated lazily. Subclasses of GraphModule other than the lazy one keep their
    type (and are compiled eagerly, as ``copy.deepcopy`` does)."""
    base = next(t for t in type(gm).__mro__ if t.__qualname__.rpartition(".")[2] != "GraphModuleImpl")
    if base is _LazyGraphModule or base is not fx.GraphModule:
        return copy.deepcopy(gm)
    # GraphModule.__deepcopy__ builds the copy with the type of the object copied:
    # copy a lazy shell that shares the original's attributes (read, never written).
    shell = _LazyGraphModule.__new__(_LazyGraphModule)
    object.__setattr__(shell, "__dict__", gm.__dict__)
    return copy.deepcopy(shell)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block (restored after, if it was on)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def check_touched(graph: fx.Graph, nodes: Iterable[fx.Node]) -> None:
    """``Graph.lint`` for the nodes a rewrite created: each is in the graph, its
    inputs are live nodes of the same graph defined before it. The untouched rest
    of the graph was valid before and is still. Raises RuntimeError otherwise."""
    for node in nodes:
        if node._erased:
            continue
        if node.graph is not graph:
            raise RuntimeError(f"rewrite created node {node.name!r} in another graph")
        for arg in node.all_input_nodes:
            if arg._erased or arg.graph is not graph:
                raise RuntimeError(f"node {node.name!r} reads {arg.name!r}, which is not in the graph")
            if not arg < node:
                raise RuntimeError(f"node {node.name!r} reads {arg.name!r}, which is defined after it")


def compile_now(gm: fx.GraphModule) -> fx.GraphModule:
    """Generate and compile ``gm``'s code now (a no-op for eager GraphModules)."""
    _LazyGraphModule.force_recompile(gm)
    return gm
