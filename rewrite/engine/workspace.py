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
import functools
import gc
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from torch import fx
from torch.fx._lazy_graph_module import _LazyGraphModule

__all__ = ["check_touched", "compile_now", "gc_paused", "working_copy"]


def working_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A deep copy of ``gm`` (graph, parameters, buffers, submodules) whose code is
    generated lazily. ``torch.export``'s modules stay ``_StatefulGraphModule``s (a
    lazy subclass of it); other GraphModule subclasses keep their type and are
    compiled eagerly, as ``copy.deepcopy`` does."""
    base = next(t for t in type(gm).__mro__ if t.__qualname__.rpartition(".")[2] != "GraphModuleImpl")
    lazy_type = _lazy_type_for(base)
    if lazy_type is None:
        return copy.deepcopy(gm)
    # GraphModule.__deepcopy__ builds the copy with the type of the object copied:
    # copy a lazy shell that shares the original's attributes (read, never written).
    shell = lazy_type.__new__(lazy_type)
    object.__setattr__(shell, "__dict__", gm.__dict__)
    return copy.deepcopy(shell, _Alias(id(gm), id(shell)))


class _Alias(dict):
    """A deepcopy memo in which one object stands for another: attributes that refer
    back to the original module (``torch.export`` modules keep bound ``train`` and
    ``eval`` methods) map to the copy, as in ``copy.deepcopy(gm)``, instead of
    copying the whole module a second time."""

    def __init__(self, original: int, stand_in: int) -> None:
        super().__init__()
        self._original, self._stand_in = original, stand_in

    def get(self, key: Any, default: Any = None) -> Any:
        return super().get(self._stand_in if key == self._original else key, default)


class _LazyModule(_LazyGraphModule):
    """A ``_LazyGraphModule`` whose first call runs forward hooks once.

    torch's lazy forward compiles, then calls the module again (``self(...)``), so
    forward hooks registered on the result would run twice on that first call; here
    it calls the freshly generated ``forward`` directly.
    """

    def _lazy_forward(self, *args: Any, **kwargs: Any) -> Any:
        self.real_recompile()
        return type(self).forward(self, *args, **kwargs)

    forward = _lazy_forward


def _lazy_type_for(base: type) -> type | None:
    """The lazily compiled type a working copy of a ``base`` module gets, or None."""
    if base in (fx.GraphModule, _LazyGraphModule, _LazyModule):
        return _LazyModule
    if base.__module__ == "torch.export._unlift" and base.__name__ == "_StatefulGraphModule":
        return _lazy_stateful_type(base)
    if getattr(base, "_lazy_stateful", False):
        return base
    return None


@functools.cache
def _lazy_stateful_type(stateful: type) -> type:
    # Built on first use: importing torch.export's module imports dynamo (~1 s).
    return type("_LazyStatefulGraphModule", (_LazyModule, stateful), {
        "__doc__": "``torch.export(...).module()``'s type, compiled on first use.",
        "__module__": __name__,
        "_lazy_stateful": True,
    })


_gc_lock = threading.Lock()
_gc_depth = 0  # blocks inside gc_paused, over all threads
_gc_was_enabled = False  # the collector's state when the outermost block began


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block; the state from before the
    outermost block (over all threads) is restored when the last one ends."""
    global _gc_depth, _gc_was_enabled
    with _gc_lock:
        if _gc_depth == 0:
            _gc_was_enabled = gc.isenabled()
        _gc_depth += 1
        gc.disable()
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0 and _gc_was_enabled:
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
