"""Run a lazily compiled GraphModule node by node, without generating its code.

The check runs a fresh rewrite a few times, and generating and compiling the
Python code of a 10k-node graph (what a lazily compiled GraphModule's first call
does) costs as much as four or five runs of it. A ``GraphRunner`` plans the run
once (what each node calls, which values die after it) and then makes the same
calls the generated ``forward`` would, in the same order, with the same input and
output processing (export's pytree flattening): about 10-25% slower than the
generated code on small tensors, and nothing to compile. The code is still
generated when the caller first calls the result, as with ``check=False``.

``running_as_graph`` puts the runner in place of the module's ``forward`` for a
block: the module's own ``__call__`` still runs around it, so its hooks (export's
input checks) see the call as they would otherwise.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Tuple

from torch import fx
from torch._ops import OpOverload
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.graph import CodeGen, _PyTreeCodeGen
from torch.fx.node import map_arg

from rewrite.ops.base import attribute
from rewrite.trust.reuse import inputs_same

__all__ = ["GraphRunner", "active_runner", "running_as_graph", "runs_generated_code", "waits_for_code"]

_KNOWN_CODEGENS = (CodeGen, _PyTreeCodeGen)
#: a reusing run stops trying once this many steps in, under a quarter were reused
_GIVE_UP_AFTER = 64

# What a step does (_CALL_LISTS: a call whose arguments hold lists or dicts;
# _CALL_POSITIONAL: a call without keyword arguments, the commonest)
_CALL_POSITIONAL, _CALL, _CALL_METHOD, _GET_ATTR, _PLACEHOLDER, _VARARGS, _OUTPUT, _CALL_LISTS = range(8)


def waits_for_code(fn: Any) -> bool:
    """Whether ``fn`` is a lazily compiled GraphModule whose code is not generated
    yet, whose ``forward`` is the generated one (nothing overrides it), and whose
    calling convention the runner knows (plain, or export's pytree flattening; not
    Inductor's boxed one, which takes a list and empties it)."""
    return (isinstance(fn, _LazyGraphModule) and "forward" not in vars(fn)
            and type(fn.graph._codegen) in _KNOWN_CODEGENS and type(fn)._needs_recompile())


class GraphRunner:
    """``gm.forward`` as a plan over ``gm.graph``; the graph must not change while
    the runner is in use. Values are dropped after their last use, as the generated
    code does, so a run holds no more memory than the generated ``forward`` would."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm, self.codegen = gm, gm.graph._codegen
        nodes = list(gm.graph.nodes)
        last_use: dict = {}
        for i, node in enumerate(nodes):
            for used in node._input_nodes:
                last_use[used] = i
        dies_after: List[list] = [[] for _ in nodes]
        for node, i in last_use.items():
            if nodes[i].op != "output":
                dies_after[i].append(node)
        self.steps = [_step(gm, node, tuple(dead)) for node, dead in zip(nodes, dies_after)]
        #: a ``rewrite.trust.reuse.Recording`` the next runs fill, or None
        self.recording: Any = None
        #: ``(ReusePlan, Recording)`` (``rewrite.trust.reuse``): the next runs take
        #: values from the recording where the plan says they may; or None
        self.reuse: Any = None
        self.reused = 0  # values the last run took from a recording

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """What ``gm.forward(*args)`` returns (called by keyword: the generated code's)."""
        if kwargs:
            if isinstance(self.gm, _LazyGraphModule):
                self.gm.real_recompile()
            return type(self.gm).forward(self.gm, *args, **kwargs)
        recording = self.recording
        if recording is not None:
            recording.start()
            out = self.observed(recording.observe, *args)
            recording.complete = True
            return out
        self.reused = 0
        if self.reuse is not None and self.reuse[0].usable(self.reuse[1]):
            return self._reusing(*self.reuse, args)
        return self.observed(None, *args)

    def observed(self, observe: Any, *args: Any) -> Any:
        """``self(*args)``, telling ``observe(node, value)`` (unless None) every node's
        value but the output's as it is computed: what recording facts on a graph
        that carries none needs, at the runner's speed rather than an Interpreter's."""
        env: dict = {}
        get = env.__getitem__
        inputs: Iterator[Any] = iter(self.codegen.process_inputs(*args))
        for node, kind, target, a, kw, dead in self.steps:
            # the commonest kinds inline (a call per node costs ~2% of a run)
            if kind == _CALL_POSITIONAL:
                value = target(*map_arg(a, get))
            elif kind == _GET_ATTR:
                value = target
            elif kind == _CALL:
                value = target(*map_arg(a, get), **map_arg(kw, get))
            elif kind == _OUTPUT:
                return self.codegen.process_outputs(plain(map_arg(a, get)[0]))
            else:
                value = _rare_step(kind, target, a, kw, get, inputs)
            env[node] = value
            if observe is not None:
                observe(node, value)
            for gone in dead:
                del env[gone]
        raise RuntimeError("graph without an output node")

    def _reusing(self, plan: Any, recording: Any, args: tuple) -> Any:
        """``self(*args)`` taking from ``recording`` the values the original
        computed where ``plan`` says they are certainly what this run would compute
        (``rewrite.trust.reuse``); every other step as ``observed`` makes it."""
        env: dict = {}
        get = env.__getitem__
        same: set = set()  # (own node, original's node) known to hold the same bits, this run
        values = recording.values
        inputs: Iterator[Any] = iter(self.codegen.process_inputs(*args))
        tried = 0  # steps that might have been reused; -1: given up
        for i, (node, kind, target, a, kw, dead) in enumerate(self.steps):
            how = plan.how(i) if tried >= 0 else None
            if how is not None:
                tried += 1
                if tried > _GIVE_UP_AFTER and self.reused * 4 < tried:
                    tried = -1  # a change early on: all that follows is computed anew, untried
                    how = None
            if how is not None and inputs_same(how, values, env, same):
                if how[0]:  # a pure op's fresh result: the original's
                    env[node] = values[how[1]]
                    self.reused += 1
                    for gone in dead:
                        del env[gone]
                    continue
                same.add((node, how[1]))  # a view of the same bits: computed, known equal
            if kind == _CALL_POSITIONAL:
                value = target(*map_arg(a, get))
            elif kind == _OUTPUT:
                return self.codegen.process_outputs(plain(map_arg(a, get)[0]))
            else:
                value = target if kind == _GET_ATTR else _rare_step(kind, target, a, kw, get, inputs)
            env[node] = value
            for gone in dead:
                del env[gone]
        raise RuntimeError("graph without an output node")


def _rare_step(kind: int, target: Any, a: Any, kw: Any, get: Any, inputs: Iterator[Any]) -> Any:
    """The value of a step of a kind other than a positional call, an attribute or
    the output."""
    if kind == _CALL:
        return target(*map_arg(a, get), **map_arg(kw, get))
    if kind == _CALL_LISTS:
        return target(*plain(map_arg(a, get)), **plain(map_arg(kw, get)))
    if kind == _CALL_METHOD:
        self_obj, *rest = map_arg(a, get)
        return getattr(self_obj, target)(*rest, **map_arg(kw, get))
    if kind == _PLACEHOLDER:
        value = next(inputs, _MISSING)
        if value is _MISSING:
            if a is _MISSING:
                raise TypeError(f"forward() missing required argument {target!r}")
            value = a
        return value
    if kind == _VARARGS:
        return tuple(inputs)
    raise RuntimeError(f"unknown step kind {kind}")  # pragma: no cover


def runs_generated_code(fn: Any) -> bool:
    """Whether ``fn`` is a GraphModule whose ``forward`` is the code fx generates
    from its graph (generated or waiting to be), in a calling convention the runner
    knows: running its graph node by node is then calling it."""
    if not isinstance(fn, fx.GraphModule) or "forward" in vars(fn) \
            or type(fn.graph._codegen) not in _KNOWN_CODEGENS:
        return False
    if waits_for_code(fn):
        return True
    code = getattr(getattr(type(fn).forward, "__code__", None), "co_filename", "")
    return code.startswith("<eval_with_key>")


def active_runner(fn: Any) -> "GraphRunner | None":
    """The runner ``running_as_graph`` put in place of ``fn``'s forward, if any."""
    runner = vars(fn).get("forward") if isinstance(fn, fx.GraphModule) else None
    return runner if isinstance(runner, GraphRunner) else None


@contextlib.contextmanager
def running_as_graph(fn: Any, force: bool = False, runner: "GraphRunner | None" = None) -> Iterator[Any]:
    """Within the block, calling ``fn`` (a module waiting for its code) runs its graph
    through a ``GraphRunner`` instead of generating the code first; anything else is
    called as it is. ``force``: a module whose code is generated runs through a
    runner too (to record or reuse values: ``rewrite.trust.reuse``). ``runner``: the
    one to use (built for ``fn``'s graph as it is). The module is left as it was."""
    if not (waits_for_code(fn) or (force and runs_generated_code(fn))):
        yield fn
        return
    if runner is None:
        try:
            runner = GraphRunner(fn)
        except NotImplementedError:  # a graph the plan does not cover: the generated code
            yield fn
            return
    # An instance attribute shadows the class's stand-in forward; Module.__call__
    # (hooks included) calls it.
    fn.__dict__["forward"] = runner
    try:
        yield fn
    finally:
        fn.__dict__.pop("forward", None)


def call_with(fn: Any, args: Any) -> Any:
    """``fn`` called on example inputs as the check keeps them: a dict as keyword
    arguments, a tuple or list as positional ones, anything else as the one argument."""
    if isinstance(args, dict):
        return fn(**args)
    if isinstance(args, (tuple, list)):
        return fn(*args)
    return fn(args)


def _holds_lists(value: Any) -> bool:
    if isinstance(value, (list, dict)):
        return True
    if isinstance(value, tuple):
        for v in value:
            if isinstance(v, (list, dict, tuple)) and _holds_lists(v):
                return True
    return False


def plain(value: Any) -> Any:
    """``value`` with fx's immutable lists and dicts (what ``map_arg`` builds) made
    the plain ones the generated code builds (``[a, b]``, ``{"k": v}``): a caller or a
    function may tell them apart (an output's pytree structure, ``list.append``)."""
    if isinstance(value, list):  # most hold no container (a shape): no call per element
        return [plain(v) if isinstance(v, _CONTAINERS) else v for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        items = [plain(v) if isinstance(v, _CONTAINERS) else v for v in value]
        if type(value) is tuple:
            return tuple(items)
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


_CONTAINERS = (list, dict, tuple)


def _method(name: str) -> Any:
    def call(self_obj: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self_obj, name)(*args, **kwargs)
    return call


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


def _step(gm: fx.GraphModule, node: fx.Node, dead: Tuple[fx.Node, ...]) -> tuple:
    op, target = node.op, node.target
    if op == "placeholder":
        if str(target).startswith("**"):
            raise NotImplementedError("a placeholder for **kwargs")
        kind = _VARARGS if str(target).startswith("*") else _PLACEHOLDER
        return (node, kind, target, node.args[0] if node.args else _MISSING, None, dead)
    if op == "get_attr":
        return (node, _GET_ATTR, attribute(gm, target), None, None, dead)
    # the keyword table itself is unpacked (``**``): only its values count
    lists = _holds_lists(node.args) or _holds_lists(tuple(node.kwargs.values()))
    call = _CALL_LISTS if lists else _CALL if node.kwargs else _CALL_POSITIONAL
    if op == "call_function":
        # an OpOverload's __call__ is a Python frame around its C++ callable
        return (node, call, target._op if type(target) is OpOverload else target, node.args, node.kwargs, dead)
    if op == "call_module":
        return (node, call, attribute(gm, target), node.args, node.kwargs, dead)
    if op == "call_method":
        if lists:
            return (node, _CALL_LISTS, _method(target), node.args,
                    node.kwargs, dead)
        return (node, _CALL_METHOD, target, node.args, node.kwargs, dead)
    if op == "output":
        return (node, _OUTPUT, None, node.args, None, dead)
    raise NotImplementedError(f"node op {op!r}")
