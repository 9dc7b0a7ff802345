"""The working copy a rewrite runs on: made cheaply, checked locally, compiled late.

``apply`` never mutates its input, so every rewrite starts from a copy. Two costs of
a plain ``copy.deepcopy(gm)`` are not rewriting: ``GraphModule.__init__`` generates
and compiles the Python ``forward`` of the copy (half of a deep copy's time, most
of its peak memory), and the result is compiled again after the rewrite. Here the
copy is a ``torch.fx._lazy_graph_module._LazyGraphModule`` (what Inductor uses for
the same reason): its code is generated on first call, on ``.code``, ``print`` or
``torch.save``, once, for the final graph.

``apply`` itself uses ``shared_copy``: the graph is copied, the tensors shared (no
rule writes a tensor; a changed constant is a new one). ``Journal`` is the undo
journal of a rewrite made in place (``apply(..., inplace=True)``, and every replay
of a transaction): it puts the module back exactly after a failure.

``gc_paused`` stops the cyclic garbage collector while a rewrite allocates: a
graph of 10k nodes with FakeTensor metadata holds millions of tracked objects, and
the full collections that ordinary allocation triggers cost as much as matching.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import copy
import functools
import gc
import threading
import types
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.graph import _illegal_names

from rewrite.capture import HOOK_TABLES
from rewrite.ops.effects import (built_module, held_norms, in_place_writers, note_built_module, opaque_code,
                                 opaque_holders, state_writes_and_guesses, writes_state_when_training)
from rewrite.ops.reach import reachable_tensors, view_over

__all__ = ["CODE_ATTRIBUTES", "HOOK_TABLES", "Journal", "check_touched", "compile_now", "gc_paused", "own_module_path",
           "own_state_training_writes", "own_written_state", "shared_copy", "working_copy"]


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

    def __reduce__(self) -> Any:
        """``torch.save`` and ``pickle`` write ``rewrite.capture.picklable(self)``: fx
        pickles a GraphModule as its generated code, whose import of an emitted
        ``torch.Tensor.to`` (``from torch._C import TensorBase.to``) no
        ``torch.load`` can run; a graph holding a higher-order op raises
        ``SaveError`` here rather than loading without it. It loads as a plain
        GraphModule."""
        from rewrite.capture import picklable

        return picklable(self).__reduce__()

    def __prepare_scriptable__(self) -> fx.GraphModule:
        """What ``torch.jit.script`` compiles instead: TorchScript cannot compile a lazy
        GraphModule (its ``code`` property calls ``super()``), so a plain one over a
        copy of the graph, sharing the submodules and tensors, as the module the
        caller traced would be (``rewrite.capture.picklable``: emitted
        ``torch.Tensor.m(x)`` calls become ``x.m()``, which TorchScript reads), with
        the hooks registered on this one."""
        from rewrite.capture import picklable

        plain = picklable(self)
        for table in HOOK_TABLES:
            hooks = getattr(self, table, None)
            if hooks:
                setattr(plain, table, collections.OrderedDict(hooks))
        plain._is_full_backward_hook = self._is_full_backward_hook
        return plain



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


def shared_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` that shares its parameters and buffers: the graph is copied
    (nodes, and ``node.meta`` one level deep, as ``copy.deepcopy`` does), every
    submodule is a shallow copy (its own ``_parameters``/``_buffers``/``_modules``
    tables, the same tensors), and the code is generated lazily. A GraphModule
    among the submodules (the subgraph a higher-order op such as
    ``wrap_with_set_grad_enabled`` or ``cond`` runs) is copied the same way, graph
    included.

    Copy-on-write by construction: a rewrite never writes a tensor in place; a rule
    that changes a constant registers a new tensor under a new name in the copy's
    own tables, and removing an attribute removes it from the copy's table only.
    What the copy costs is the graph: no tensor is copied. Other GraphModule
    subclasses than fx's and torch.export's get ``working_copy`` (a deep copy)."""
    return _graph_module_copy(gm, {})


def own_written_state(gm: fx.GraphModule, training: "bool | None" = None) -> int:
    """Give ``gm`` (a ``shared_copy``) its own copy of every tensor its forward may
    write in place (a step counter, an EMA, a train-mode batch norm's running
    statistics, a running sum a leaf module keeps in a list): running the copy must
    not change the model it was copied from. When what the graph writes is unknown
    (``state_writes`` is None: a hook, a call no schema describes), every buffer and
    plain tensor attribute is copied, except those that require grad (parameters
    and trained tensors stay shared: a forward that writes its weights is beyond
    what anything here can tell, and gradients must reach the caller's). Returns how
    many tensors were copied. Raises ValueError where a written tensor's memory
    overlaps another memory block (two ``torch.from_numpy`` of overlapping arrays):
    no copy could keep both. ``training``: the caller's word on whether the graph
    trains (None: it may where a module of it is in training mode): where it may, the
    weights a user's leaf module or a hook can only be guessed to write stay shared
    (``_own_tensors``)."""
    may_train = training if training is not None else any(m.training for m in gm.modules())
    written, guessed = state_writes_and_guesses(gm)
    return _own_tensors(gm, written, may_train=may_train, guessed=guessed)


def own_state_training_writes(gm: fx.GraphModule) -> int:
    """Give a result its own running statistics where a module it calls writes them
    only in training mode (a torch batch norm or instance norm in eval mode now, or
    one a called module holds: ``TransformerEncoder(..., norm=BatchNorm1d(n))``):
    ``result.train()`` flips the result's own modules, and its runs must not write
    the caller's buffers then either. Done on the final result, so the statistics of
    a batch norm a rule folded away are never copied. Returns how many tensors were
    copied."""
    targets = {node.target for node in gm.graph.find_nodes(op="call_module")}
    if not targets:
        return 0
    by_path = _modules_by_path(gm)
    written = set()
    for target in targets:
        module = by_path.get(target) or gm.get_submodule(target)
        norms = ([module] if writes_state_when_training(module) else []) + held_norms(module)
        for norm in norms:
            written.update(id(t) for t in (norm._buffers.values() if not norm._modules else norm.buffers())
                           if t is not None)
    return _own_tensors(gm, frozenset(written), by_path.values()) if written else 0


def _modules_by_path(gm: torch.nn.Module) -> dict:
    """``dict(gm.named_modules(remove_duplicate=False))`` without its generators; a
    module reachable again (a cycle: a child holding its root) is not gone into twice."""
    found = {"": gm}
    stack = [("", gm)]
    expanded = {id(gm)}
    while stack:
        prefix, module = stack.pop()
        for name, child in module._modules.items():
            if child is not None:
                path = f"{prefix}.{name}" if prefix else name
                if path not in found:
                    found[path] = child
                    if id(child) not in expanded:
                        expanded.add(id(child))
                        stack.append((path, child))
    return found


def _module_tensors(modules: Iterable[torch.nn.Module]) -> tuple:
    """(table, key, tensor, whether a parameter) for every tensor ``modules`` hold
    (each module once; a table is ``_parameters``, ``_buffers`` or the module's
    ``__dict__``): parameters,
    buffers, plain tensor attributes (fx's ``_tensor_constant``s), and the names of
    their attributes that are lists, tuples or dicts holding tensors (a running sum a
    leaf module keeps in ``self.cache[0]``): ``(places, containers)``, containers as
    ``(module's __dict__, name, the tensors inside)``."""
    places: list = []
    containers: list = []
    for module in {id(m): m for m in modules}.values():
        attributes = module.__dict__
        for table, parameters in ((attributes["_parameters"], True), (attributes["_buffers"], False)):
            for name, t in table.items():
                if t is not None:
                    places.append((table, name, t, parameters))
        for name in attributes.keys() - _MODULE_INTERNALS:
            value = attributes[name]
            if isinstance(value, torch.Tensor):
                places.append((attributes, name, value, isinstance(value, torch.nn.Parameter)))
            elif (isinstance(value, _CONTAINERS) and value and not _only_numbers(value)) or _helper_object(value):
                inside = _tensors_inside(value)
                if inside:
                    containers.append((attributes, name, inside))
    return places, containers


#: what every ``nn.Module.__init__`` sets (flags, tables, hook dicts): never a tensor
_MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__)

#: the containers whose tensors a result's copy replaces (rebuilt, never written in place:
#: a nested one may be the caller's), subclasses included (a namedtuple, a dict subclass)
_CONTAINERS = (list, tuple, dict, collections.deque)

#: how deep ``_tensors_inside`` looks into nested containers
_NESTING = 8


def _helper_object(value: Any) -> bool:
    """An object of the user's own class keeping its attributes in a ``__dict__`` (a
    state holder a leaf module writes: ``self.state.total.add_(x)``): looked into and,
    where it holds a tensor the result must own, copied (``copy.copy``) like a list.
    Not a module, a class, a function, or an object of torch's, numpy's or Python's."""
    kind = type(value)
    return kind.__module__ not in _NOT_HELPERS and not kind.__module__.startswith(_LIBRARY_PREFIXES) \
        and not isinstance(value, _NOT_HELPER_KINDS) and type(getattr(value, "__dict__", None)) is dict


_NOT_HELPERS = frozenset({"builtins", "functools", "collections", "typing", "enum", "re", "numpy"})
_LIBRARY_PREFIXES = ("torch.", "numpy.", "rewrite.", "transformers.", "typing.")
_NOT_HELPER_KINDS = (torch.nn.Module, torch.Tensor, type, types.FunctionType, types.MethodType, types.ModuleType,
                     fx.Graph, fx.Node)


def _only_numbers(value: Any) -> bool:
    """A tuple or list of ints (a convolution's ``kernel_size``): nothing to look into."""
    return not isinstance(value, dict) and set(map(type, value)) <= _NUMBERS


_NUMBERS = frozenset({int, float, bool})


def _tensors_inside(value: Any, depth: int = 0, seen: "set | None" = None) -> list:
    """The tensors in nested lists, tuples, dicts and helper objects ``value`` holds (a
    few levels deep, each object once)."""
    seen = set() if seen is None else seen
    seen.add(id(value))
    found = []
    for item in _items(value):
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif depth < _NESTING and id(item) not in seen and (isinstance(item, _CONTAINERS) or _helper_object(item)):
            found += _tensors_inside(item, depth + 1, seen)
    return found


def _items(value: Any) -> Iterable:
    """What a container or helper object holds."""
    if isinstance(value, dict):
        return value.values()
    if isinstance(value, _CONTAINERS):
        return value
    return list(vars(value).values())


def _replaced(value: Any, copies: dict, rebuilt: dict, path: tuple = ()) -> Any:
    """``value`` with every tensor in ``copies`` (by id) replaced by its copy, the
    containers and helper objects on the way rebuilt as the same type (the same
    object where nothing inside changed; one rebuild per object, in ``rebuilt`` by
    id, so two modules sharing a holder share its copy). ValueError for a container
    that holds itself or one that cannot be rebuilt."""
    if isinstance(value, torch.Tensor):
        return copies.get(id(value), value)
    if id(value) in rebuilt:
        return rebuilt[id(value)]
    helper = not isinstance(value, _CONTAINERS) and _helper_object(value)
    if not (helper or isinstance(value, _CONTAINERS)) or len(path) > _NESTING:
        return value
    if id(value) in path:
        raise ValueError(f"a module of the model holds a {type(value).__name__} that contains itself, with a "
                         "tensor its forward writes: a copy cannot own that tensor. Rewrite the model in place "
                         "(inplace=True)")
    rebuilt[id(value)] = result = _rebuilt(value, copies, rebuilt, path + (id(value),), helper)
    return result


def _rebuilt(value: Any, copies: dict, rebuilt: dict, path: tuple, helper: bool) -> Any:
    """``_replaced`` for one container or helper object."""
    if helper:
        attributes = {k: _replaced(v, copies, rebuilt, path) for k, v in vars(value).items()}
        if all(attributes[k] is v for k, v in vars(value).items()):
            return value
        try:
            copied = copy.copy(value)
            shares = copied is value or vars(copied) is vars(value)  # __copy__ returning self, a shared __dict__
            if not shares:
                vars(copied).update(attributes)
        except Exception as error:  # noqa: BLE001 - a class whose copy fails
            raise ValueError(f"a module of the model holds a {type(value).__name__} with a tensor its forward "
                             "writes, which a copy cannot rebuild: rewrite the model in place (inplace=True)"
                             ) from error
        if shares:
            raise ValueError(f"a module of the model holds a {type(value).__name__} with a tensor its forward "
                             "writes, and a copy of it shares its state (its __copy__ or __setstate__): a copy "
                             "of the model cannot own that tensor. Rewrite the model in place (inplace=True)")
        return copied
    if isinstance(value, dict):
        items = {k: _replaced(v, copies, rebuilt, path) for k, v in value.items()}
        if all(items[k] is v for k, v in value.items()):
            return value
    else:
        items = [_replaced(v, copies, rebuilt, path) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
    try:
        if hasattr(value, "_make"):  # a namedtuple
            return value._make(items)
        if isinstance(value, collections.deque):
            return type(value)(items, value.maxlen)
        made = type(value)(items)
    except Exception:  # noqa: BLE001 - a container class with its own constructor
        made = None
    if made is None or (isinstance(made, dict) and list(made) != list(items)):
        raise ValueError(f"a module of the model holds a {type(value).__name__} with a tensor its forward writes, "
                         "which a copy cannot rebuild: rewrite the model in place (inplace=True)")
    if hasattr(value, "__dict__") and not isinstance(value, tuple):
        made.__dict__.update(value.__dict__)
    return made


def _own_tensors(gm: fx.GraphModule, written: "frozenset[int] | None", modules: Any = None,
                 may_train: bool = False, guessed: "frozenset[int]" = frozenset()) -> int:
    """``own_written_state`` for the tensors whose ids are ``written`` (None: every
    buffer and plain tensor attribute that does not require grad). ``modules``:
    ``gm``'s, where known. ``guessed``: the written ids only code nothing reads may
    write (``state_writes_and_guesses``); a graph op or torch's code surely writes
    the others (``w.add_(1)``, an ``Embedding`` with ``max_norm``): those are owned
    whatever they are."""
    if written is not None and not written:
        return 0
    places, containers = _module_tensors(gm.modules() if modules is None else modules)
    held_by_id = {id(t): t for t in [place[2] for place in places] + [t for *_, inside in containers for t in inside]}
    held = list(held_by_id.values())
    extent_of = {id(t): _extent(t) for t in held}
    if written is not None:
        # what requires grad stays the caller's, as when writes are unknown: a user's
        # leaf module counts as writing its weights because nothing reads its code,
        # and gradients of the result must reach the caller's (a forward that writes
        # its own weights in place is beyond what anything here can tell)
        # (unless the module's code names an in-place write: ``self.bias.add_(1)``)
        # (an inference graph's weights are folded into constants: copies serve it)
        trained = {extent_of[id(t)] for t in held if t.requires_grad} - {None} if may_train and guessed else set()
        if trained:
            writers = {id(t) for m in in_place_writers(gm) for t in [*m.parameters(), *m.buffers()]}
            written = frozenset(i for i in written if i not in extent_of or i in writers or i not in guessed or not (
                held_by_id[i].requires_grad or extent_of[i] in trained))
        shared = _refuse_unreached(gm, written, written - extent_of.keys(), extent_of)
        chosen = [t for t in held if id(t) in written and id(t) not in shared]
    else:  # what requires grad (and memory it shares) stays the caller's, as parameters do
        parameters = {id(t) for _, _, t, parameter in places if parameter}
        trained = {extent_of[id(t)] for t in held if t.requires_grad or id(t) in parameters} - {None}
        chosen = [t for t in held if id(t) not in parameters and not isinstance(t, torch.nn.Parameter)
                  and not t.requires_grad and extent_of[id(t)] not in trained]
    if not chosen:
        return 0
    # Tensors sharing memory with a copied one (a second buffer viewing it, fx's
    # ``_tensor_constant`` of ``self.cache.t()``) view the copy's memory as they
    # viewed the original's: the copy's writes must reach its reads.
    keys = {id(t): _key(t, extent_of[id(t)]) for t in chosen}
    extents = {extent_of[id(t)] for t in chosen} - {None}
    for t in held:
        if id(t) not in keys and extent_of[id(t)] in extents:
            keys[id(t)] = _key(t, extent_of[id(t)])
    _refuse_overlaps(held, extent_of, extents, keys)
    views = collections.Counter(keys[id(t)] for t in held if id(t) in keys)
    copies: dict = {}
    fresh_storages: dict = {}

    def own(t: torch.Tensor, key: Any) -> torch.Tensor:
        if key is None:
            clone = _layout_kept_clone(t) if t.is_quantized else t.detach().clone()
        elif views[key] == 1 and t.storage_offset() == 0 and t.is_contiguous() and not t.is_conj() \
                and not t.is_neg() and t.nbytes == extent_of[id(t)][2]:  # alone over its memory
            clone = t.detach().clone()
            if clone.stride() != t.stride():  # a contiguous tensor's size-1 dimensions may have any stride
                clone = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device).copy_(t.detach())
        else:
            if key not in fresh_storages:
                fresh_storages[key] = t.untyped_storage().clone()
            clone = view_over(fresh_storages[key], t)
        if isinstance(t, torch.nn.Parameter):
            return torch.nn.Parameter(clone, t.requires_grad)
        return clone.requires_grad_() if t.requires_grad and t.is_leaf and clone.is_leaf else clone

    for t in held:
        key = keys.get(id(t), False)
        if key is not False and id(t) not in copies:
            copies[id(t)] = own(t, key)
    for table, key, t, _ in places:
        copy_ = copies.get(id(t))
        if copy_ is not None:
            table[key] = copy_
    rebuilt: dict = {}
    for attributes, name, inside in containers:
        if any(id(t) in copies for t in inside):
            attributes[name] = _replaced(attributes[name], copies, rebuilt)
    return len(copies)


def _layout_kept_clone(t: torch.Tensor) -> torch.Tensor:
    """A clone of a quantized tensor with its strides where they are a permutation of
    dense memory (a transposed weight): a quantized ``clone`` comes back contiguous,
    and quantized strides cannot be set."""
    clone = t.clone()
    if clone.stride() == t.stride() and clone.storage_offset() == t.storage_offset():
        return clone
    base = t._base
    if base is not None and t.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        # a strided slice of a dense base (``full[1:, ::2]``): the base copied, viewed alike
        copied = base.clone()
        if copied.stride() == base.stride() and copied.storage_offset() == base.storage_offset():
            try:
                return copied.as_strided(t.size(), t.stride(), t.storage_offset())
            except RuntimeError:
                pass
    if clone.stride() == t.stride():
        return clone
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    try:
        kept = t.permute(order).clone().permute(sorted(range(t.dim()), key=order.__getitem__))
    except RuntimeError:  # per-channel quantized tensors cannot be permuted: values are what matter
        return clone
    return kept if kept.stride() == t.stride() else clone


def _refuse_unreached(gm: fx.GraphModule, written: "frozenset[int]", missed: "frozenset[int]",
                      extent_of: dict) -> "frozenset[int]":
    """ValueError when a tensor the forward writes is one a user's leaf module reaches
    where the copy does not look (``missed``: an object with ``__slots__``, nesting
    deeper than ``_NESTING``) or through another module its attributes hold
    (``self.ctx.owner.calls.add_(1)``): the result's module would still reach the
    caller's tensor, and write it.

    Answers the ids of the written tensors the copy would own (``extent_of``: the
    module tree's tensors, by id) that code also reaches by a path a copy of the
    module tree cannot redirect: the globals that the code the graph runs names (a
    ``torch.fx.wrap``'d function or a leaf module's class reading a registry or a
    module-level holder), code a leaf module holds (a closure, a
    ``functools.partial``, a weakref, a bound method, a lambda over itself). Those
    stay the caller's, as a written tensor no module holds (a global, a closure's
    own tensor) is: the result writes them as the model does. A copy would be
    written by one path and read by the other, and the result's values would drift.
    Not the caller's hooks: a feature hook holding the model reaches every tensor of
    it, and the result must own a training batch norm's statistics (a hook that
    reads them reads the caller's: documented)."""
    modules = [holder[0] for holder in opaque_holders(gm)]
    code = opaque_code(gm) + [type(m) for m in modules]
    if not modules and not code:
        return frozenset()
    reached, through_modules, through_code = _attribute_tensors(modules)
    if any(id(t) in missed for t in reached) or any(id(t) in written for t in through_modules):
        raise ValueError(
            "a leaf module of the model reaches a tensor its forward writes where a copy of the model cannot own "
            "it (through another module its attributes hold, an object with __slots__, or nested deeper than "
            "lists, dicts and plain objects 8 levels down): the result would write the caller's tensor. Register "
            "the module as a submodule, keep the tensor in a buffer or a plain attribute, or rewrite the model in "
            "place (inplace=True)")
    stake = {i for i in written if i in extent_of}
    if not stake:
        return frozenset()
    elsewhere = reachable_tensors(code) or []
    elsewhere += through_code
    places = {extent_of[id(t)] if id(t) in extent_of else _extent(t) for t in elsewhere} - {None}
    ids = {id(t) for t in elsewhere}
    return frozenset(i for i in stake if i in ids or extent_of[i] in places)


def _attribute_tensors(modules: list) -> tuple:
    """The tensors ``modules`` hold through their own attributes, however deep:
    containers, objects' ``__dict__`` and ``__slots__``, and other modules those
    hold (not through classes or the globals their code names); and, apart, those
    reached through such another module, and those reached through code held there
    (a closure, a ``functools.partial``, a weakref, a bound method: what the code
    reaches, globals included)."""
    found: list = []
    through: list = []
    code: list = []
    seen: set = {id(m) for m in modules}
    walked: set = set()  # objects the code walks went through
    stack = [(v, False) for m in modules for k, v in vars(m).items() if k not in _MODULE_INTERNALS]
    while stack and len(seen) < _ATTRIBUTE_WALK:
        value, via_module = stack.pop()
        if id(value) in seen or isinstance(value, (str, bytes, int, float, bool, type(None))):
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            (through if via_module else found).append(value)
        elif isinstance(value, _CODE_KINDS):
            code += reachable_tensors(value, walked) or []
        elif isinstance(value, torch.nn.Module):
            stack.extend((v, True) for v in [*value._parameters.values(), *value._buffers.values(),
                                              *value._modules.values()])
            stack.extend((v, True) for k, v in vars(value).items() if k not in _MODULE_INTERNALS)
        elif isinstance(value, (dict, types.MappingProxyType, list, tuple, set, frozenset, collections.deque)):
            stack.extend((v, via_module) for v in (value.values() if isinstance(value, (dict, types.MappingProxyType))
                                                    else value))
        elif not isinstance(value, _NOT_HELPER_KINDS):
            attributes = getattr(value, "__dict__", None)
            if type(attributes) is dict:
                stack.extend((v, via_module) for v in attributes.values())
            stack.extend((getattr(value, name, None), via_module) for name in getattr(type(value), "__slots__", ()))
    return found, through, code


#: values that hold what they reach as code does (a closure's cells, a partial's
#: arguments, a bound method's object): a copy of the module cannot own it
_CODE_KINDS = (types.FunctionType, types.MethodType, types.BuiltinMethodType, functools.partial, weakref.ref)

_ATTRIBUTE_WALK = 20000  # objects, as rewrite.ops.reach's walks


def _extent(t: torch.Tensor) -> "tuple | None":
    """(device, first byte address, byte size) of the memory block ``t`` is a view of,
    for a tensor that has one (``storage_key``'s), else None. Any class: a subclass
    made with ``as_subclass`` views memory too."""
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        return None
    try:
        storage = t.untyped_storage()
        size = storage.nbytes()
        return (t.device, storage.data_ptr(), size) if size else None
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _key(t: torch.Tensor, extent: "tuple | None") -> Any:
    """``storage_key(t)`` from its ``_extent``: a plain tensor's block, None for a subclass."""
    return extent[:2] if extent is not None and t.__class__ in _PLAIN_TENSORS else None


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)


def _refuse_overlaps(held: list, extent_of: dict, extents: set, keys: dict) -> None:
    """ValueError when a memory block to copy (``extents``) overlaps another block
    without being the same one (``torch.from_numpy`` of an array and of its slice),
    or is viewed by more than one tensor, one of them a subclass ``storage_key``
    cannot follow: one copy per block would leave the result's tensors sharing less
    memory than the caller's (a write that reached a read no longer does), or a
    copy reading memory nobody copied. ``extent_of``: ``_extent`` by tensor id;
    ``keys``: the ``storage_key`` of every tensor over a block in ``extents``."""
    blocks = sorted(extents, key=lambda e: (str(e[0]), e[1]))
    for a, b in zip(blocks, blocks[1:]):
        if a[0] == b[0] and b[1] < a[1] + a[2]:
            _overlap_error(None)
    starts: dict = collections.defaultdict(list)
    for device, start, size in blocks:
        starts[device].append((start, start + size))
    over_block = collections.Counter()
    subclassed = set()
    for t in held:
        extent = extent_of[id(t)]
        if extent is None:
            continue
        if extent in extents:
            over_block[extent] += 1
            if keys[id(t)] is None:
                subclassed.add(extent)
            continue
        device, start, size = extent
        ranges = starts.get(device, ())
        i = bisect.bisect_right(ranges, (start, float("inf"))) - 1
        if any(0 <= j < len(ranges) and ranges[j][0] < start + size and start < ranges[j][1] for j in (i, i + 1)):
            _overlap_error(t)
    if any(over_block[extent] > 1 for extent in subclassed):
        _overlap_error(None)


def _overlap_error(t: Any) -> None:
    what = f"a tensor ({type(t).__name__} of shape {tuple(t.shape)})" if t is not None else "tensors"
    raise ValueError(
        f"the model holds {what} over memory that overlaps a tensor its forward writes through another memory "
        "block or a tensor subclass (torch.from_numpy of overlapping arrays, as_subclass views): a copy of the "
        "model cannot keep which of its tensors share memory. Give those tensors one memory block (clone "
        "them), or rewrite the model in place (inplace=True)")


def _graph_module_copy(gm: fx.GraphModule, memo: dict) -> fx.GraphModule:
    base = next(t for t in type(gm).__mro__ if t.__qualname__.rpartition(".")[2] != "GraphModuleImpl")
    lazy_type = _lazy_type_for(base)
    if lazy_type is None:
        copied = memo[id(gm)] = working_copy(gm)
        return copied
    root = lazy_type.__new__(lazy_type)
    memo[id(gm)] = root
    _fill_shallow(gm, root, memo)
    graph = copy_graph(gm.graph)
    root.__dict__["_graph"] = graph
    graph.owning_module = root
    root.meta = dict(getattr(gm, "meta", {}))
    root.recompile()  # lazy: code is generated on first use
    return root


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """What ``copy.deepcopy(graph)`` returns (same nodes, names, order, types,
    ``node.meta`` copied one level deep, the code generator deep-copied), built
    without ``Graph.create_node``'s per-node work: the names are known to be unique
    and legal already, and the arguments passed its checks when they were created.
    Three to four times faster on a 10k-node graph; a graph this cannot copy that
    way (an unexpected internal layout, a name that would be renamed) is deep-copied."""
    try:
        new = fx.Graph(tracer_cls=graph._tracer_cls)
        namespace, source = new._graph_namespace, graph._graph_namespace
        table, insert = new._find_nodes_lookup_table, new._insert
        # the find_nodes index's entry per target, found once per target: its key
        # hashes the target, in Python for an OpOverload
        entries: dict = {}
        env: dict = {}
        lookup = env.__getitem__
        map_arg = fx.node.map_arg
        set_attribute = object.__setattr__
        for node in graph.nodes:
            name, op = node.name, node.op
            if name in namespace._used_names or name in _illegal_names:
                return copy.deepcopy(graph)
            copied = fx.Node(new, name, op, node.target, map_arg(node.args, lookup),
                             map_arg(node.kwargs, lookup), node.type)
            # Node.__setattr__ would look the node up in the index first (not in it yet)
            set_attribute(copied, "meta", node.meta.copy())
            namespace._used_names.add(name)
            namespace._obj_to_name[copied] = name
            insert(copied)
            entry_key = id(node.target) if op == "call_function" else op
            entry = entries.get(entry_key)
            if entry is None:
                entry = entries[entry_key] = table.table[table._key(copied)]
            entry[copied] = None
            new._len += 1
            env[node] = copied
        namespace._used_names |= source._used_names
        namespace._base_count.update(source._base_count)
        new._codegen = _codegen_copy(graph._codegen)
        return new
    except (AttributeError, TypeError):  # another torch's internals
        return copy.deepcopy(graph)


_PLAIN_CODEGEN_STATE = frozenset({"_body_transformer", "_func_name", "pytree_info"})


def _codegen_copy(codegen: Any) -> Any:
    """What ``copy.deepcopy`` gives for fx's own code generators: their state is a
    name, an optional body transformer and (export's) a ``_PyTreeInfo`` of frozen
    ``TreeSpec``s, so a shallow copy with its own ``orig_args`` list is as
    independent, without deep-copying the specs (an eighth of the copy of GPT-2's
    162-node export graph).
    Other generators are deep-copied."""
    kind = type(codegen)
    if kind not in (fx.graph.CodeGen, fx.graph._PyTreeCodeGen) or not set(vars(codegen)) <= _PLAIN_CODEGEN_STATE \
            or getattr(codegen, "_body_transformer", None) is not None:
        return copy.deepcopy(codegen)
    new = copy.copy(codegen)
    info = getattr(codegen, "pytree_info", None)
    if info is not None:
        new.pytree_info = info._replace(orig_args=list(info.orig_args))
    return new


_TABLES = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")
_OWN_TABLE_TYPES = frozenset({dict, collections.OrderedDict, set, list})


def _shallow_module(m: torch.nn.Module, memo: dict) -> torch.nn.Module:
    if id(m) in memo:
        return memo[id(m)]
    if isinstance(m, fx.GraphModule):  # a subgraph: its own graph and code, as the root's
        return _graph_module_copy(m, memo)
    new = type(m).__new__(type(m))
    memo[id(m)] = new
    _fill_shallow(m, new, memo)
    return new


def own_module_path(gm: fx.GraphModule, path: str, owned: set) -> torch.nn.Module | None:
    """The submodule of ``gm`` at ``path`` (dotted), after each module on the way
    to it (below ``gm``) is replaced in its owner by a copy with tables of its own,
    its children shared (copy-on-write: ``gm``'s submodules may be the objects of the
    eager model it was traced from, which an in-place rewrite must not change).
    ``owned``: ids of the copies made so far (made once). None when a module on the
    way is a GraphModule (its graph is not copied here)."""
    parent = gm
    for part in path.split("."):
        child = parent._modules[part]
        if isinstance(child, fx.GraphModule):
            return None
        if id(child) not in owned:
            copied = type(child).__new__(type(child))
            _fill_shallow(child, copied, None)
            parent._modules[part] = copied
            owned.add(id(copied))
            child = copied
        parent = child
    return parent


def _fill_shallow(m: torch.nn.Module, new: torch.nn.Module, memo: dict | None) -> None:
    """``new`` gets ``m``'s attributes, with tables of its own; its submodules are
    shallow copies too (``memo``: copies made, by id), or with ``memo`` None the
    same objects."""
    if built_module(m):  # the copy of a factory's module is one too
        note_built_module(new)
    d = m.__dict__.copy()
    method = types.MethodType
    for key, value in d.items():  # values replaced in place: the keys do not change
        kind = value.__class__
        if kind in _OWN_TABLE_TYPES:
            # every table of the module (parameters, buffers, submodules, hook
            # registries...) is the copy's own: registering a hook on the result or
            # deleting one of its parameters leaves the input as it was
            d[key] = kind(value) if value else kind()  # an empty OrderedDict copies 2x slower
        elif kind is method and value.__self__ is m:
            # methods bound to the original (torch.export's train/eval) bind to the copy
            d[key] = method(value.__func__, new)
    modules = d.get("_modules")
    if modules is not None and modules is m.__dict__["_modules"]:  # a table type not copied above
        modules = d["_modules"] = dict(modules)
    if modules and memo is not None:
        for key, child in modules.items():
            if child is not None:
                modules[key] = _shallow_module(child, memo)
    d.pop("_graph", None)  # a GraphModule's: its caller sets a copy
    # the copy's attribute dict is ``d`` itself (not a second dict filled from it);
    # object's setter: nn.Module.__setattr__ would look for tables ``new`` lacks yet
    object.__setattr__(new, "__dict__", d)


class Journal:
    """The undo journal of an in-place rewrite: every change a rewrite makes to one
    GraphModule, recorded as it happens, so ``undo`` puts the module back exactly:
    the graph (node order, names, arguments, metadata), parameters, buffers and
    submodules (the same objects, in the same order).

    Graph changes are recorded through the GraphModule's node hooks (create, erase,
    replace-uses), so nothing that edits the graph while the journal is open can
    escape it; module tables are snapshotted when the journal opens (they are small:
    one entry per module); metadata written on nodes that existed before (facts
    recorded from example inputs) through ``note_meta``.

    Cost: proportional to what the rewrite changed, plus one entry per module."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.graph = gm.graph
        self._entries: list = []
        self._meta: list = []  # (node, key) written on pre-existing nodes
        self._replaced_meta: list = []  # (node, key, old value) overwritten on pre-existing nodes
        # users of nodes that lose a user (it is erased, or reads another node):
        # restored in their order (a user regained would otherwise come last)
        self._users: dict = {}
        self._rewired: set = set()  # nodes whose arguments before the first rewire are recorded
        # per key of the graph's find_nodes index that a node joined or left: its nodes
        # before (``find_nodes(sort=False)`` lists them in that order), or _ABSENT
        self._index: dict = {}
        namespace = self.graph._graph_namespace
        self._base_count = dict(namespace._base_count)
        self._modules = _module_snapshots(gm)
        # the root's own attribute values (a hook's counter on it) and its code
        self._root = gm.__dict__.copy()
        self._code = _code_state(gm)
        self._owner: Any = None  # the graph's owner while the journal is open, when not gm
        self._open = False

    @property
    def changed(self) -> bool:
        return bool(self._entries)

    # -- recording

    def open(self) -> "Journal":
        if not self._open:
            # fx calls the node hooks of the graph's owning module: a graph another
            # module was built over (``fx.GraphModule(gm, gm.graph)``) is owned by that
            # one, and its changes would escape the journal
            owner = self.graph.owning_module
            if owner is not self.gm:
                self._owner = (owner,)
                self.graph.owning_module = self.gm
            self.gm._register_create_node_hook(self._on_create)
            self.gm._register_erase_node_hook(self._on_erase)
            self.gm._register_replace_node_hook(self._on_replace)
            self._open = True
        return self

    def close(self) -> None:
        if self._open:
            self.gm._unregister_create_node_hook(self._on_create)
            self.gm._unregister_erase_node_hook(self._on_erase)
            self.gm._unregister_replace_node_hook(self._on_replace)
            if self._owner is not None:
                self.graph.owning_module = self._owner[0]
                self._owner = None
            self._open = False

    def _on_create(self, node: fx.Node) -> None:
        self._entries.append((0, node, None, None, None))
        self._note_index(node)

    def _on_erase(self, node: fx.Node) -> None:
        self._entries.append((1, node, node.prev, node.args, node.kwargs))
        self._note_index(node)
        for i in node.all_input_nodes:
            if i not in self._users:
                self._users[i] = list(i.users)

    def _on_replace(self, old: fx.Node, new: str, user: fx.Node) -> None:
        # only the arguments before the first rewire are needed (``undo``): a reader
        # of thousands of rewritten values (the output) is recorded once, not once
        # per rewrite (which held one copy of its arguments per rewrite)
        if user not in self._rewired:
            self._rewired.add(user)
            self._entries.append((2, user, None, user.args, user.kwargs))
            self._note_index(user)  # undo sets its arguments back, which moves it last in the index
            # undo gives ``user`` its arguments back, which makes it a reader of each
            # of them anew (last): the order of their readers is put back after
            for i in user._input_nodes:
                if i not in self._users:
                    self._users[i] = list(i.users)
        if old not in self._users:
            self._users[old] = list(old.users)

    def _note_index(self, node: fx.Node) -> None:
        """The find_nodes index entry ``node`` is about to join or leave, as it is
        (fx calls the hooks first): a node erased and put back would come last."""
        lookup = self.graph._find_nodes_lookup_table
        key = lookup._key(node)
        if key not in self._index:
            entry = lookup.table.get(key)
            self._index[key] = _ABSENT if entry is None else list(entry)

    def _restore_index(self) -> None:
        table = self.graph._find_nodes_lookup_table.table
        for key, order in self._index.items():
            entry = table.get(key)
            if order is _ABSENT:
                if entry is not None and not entry:
                    del table[key]
            elif entry is None or list(entry) != order:
                entry = table[key]
                entry.clear()
                entry.update(dict.fromkeys(order))
        self._index.clear()

    def note_meta(self, node: fx.Node, key: str) -> None:
        """``node.meta[key]`` is about to be set on a node that existed before: a new
        fact (kept by ``undo(keep_meta=True)``: still true of the graph), or one that
        replaces what the node carried (a layout a rewrite changed: always put back,
        as it is true of the rewritten graph only)."""
        if key not in node.meta:
            self._meta.append((node, key))
        else:
            self._replaced_meta.append((node, key, node.meta[key]))

    # -- undoing

    def undo(self, keep_meta: bool = False) -> None:
        """Put the module back as it was when the journal was made. ``keep_meta``
        keeps metadata recorded on pre-existing nodes (facts of the original graph,
        still true of it: a replay need not record them again)."""
        was_open = self._open
        self.close()
        graph = self.graph
        namespace = graph._graph_namespace
        created = []  # newest first
        for kind, node, prev, args, kwargs in reversed(self._entries):
            if kind == 0:  # created: erased below, once every reader has its old arguments
                created.append(node)
            elif kind == 1:  # erased: back after the node that preceded it
                prev.append(node)
                node._erased = False
                graph._len += 1
                graph._find_nodes_lookup_table.insert(node)
                node.args, node.kwargs = args, kwargs
            else:  # a node made to read other nodes: its arguments before the first change
                node.args, node.kwargs = args, kwargs
        for node in created:  # a created node's readers are older nodes (restored) or newer ones (gone)
            if not node._erased:
                graph.erase_node(node)
            namespace._used_names.discard(node.name)
            namespace._obj_to_name.pop(node, None)
        self._entries.clear()
        self._rewired.clear()
        self._restore_index()
        for node, order in self._users.items():
            users = node.users
            order = [u for u in order if u in users]  # users created meanwhile are gone
            if list(users) != order and len(order) == len(users):
                users.clear()
                users.update(dict.fromkeys(order))
        self._users.clear()
        namespace._base_count.clear()
        namespace._base_count.update(self._base_count)
        for m, tables, keys in self._modules:
            attributes = m.__dict__
            for key, saved in zip(_TABLES, tables):
                current = attributes.get(key) if saved is not _ABSENT else None
                if current is not None and not _same_table(current, saved):
                    current.clear()
                    if saved:
                        current.update(saved)
            if len(attributes) != len(keys) or any(a is not b for a, b in zip(attributes, keys)):
                for key in set(attributes) - set(keys):
                    del attributes[key]
        attributes = self.gm.__dict__
        for key, value in self._root.items():
            if key not in CODE_ATTRIBUTES and attributes.get(key, _ABSENT) is not value:
                attributes[key] = value
        for node, key, value in reversed(self._replaced_meta):
            node.meta[key] = value
        self._replaced_meta.clear()
        if not keep_meta:
            for node, key in reversed(self._meta):
                node.meta.pop(key, None)
            self._meta.clear()
        if was_open:
            self.open()

    def restore_code(self) -> None:
        """Give the module back the code it had when the journal was made (after an
        exact ``undo``, its graph is that code's): a compiled module stays compiled,
        a lazy one stays to be compiled on first use."""
        _set_code_state(self.gm, self._code)


_ABSENT = object()  # a module without that table
#: a GraphModule's generated code: its instance attributes (``GraphModule.recompile``
#: sets them) and its own class's (fx makes a class per instance)
CODE_ATTRIBUTES = ("_code", "_lineno_map", "_prologue_start", "_in_spec", "_out_spec")
_CLASS_CODE_KEYS = ("forward", "__call__", "_wrapped_call")


def _code_state(gm: fx.GraphModule) -> tuple:
    own, cls = gm.__dict__, type(gm).__dict__
    return (tuple((k, own.get(k, _ABSENT)) for k in CODE_ATTRIBUTES),
            tuple((k, cls.get(k, _ABSENT)) for k in _CLASS_CODE_KEYS))


def _set_code_state(gm: fx.GraphModule, state: tuple) -> None:
    own, cls = gm.__dict__, type(gm)
    for key, value in state[0]:
        if value is _ABSENT:
            own.pop(key, None)
        else:
            own[key] = value
    for key, value in state[1]:
        if value is _ABSENT:
            if key in cls.__dict__:
                delattr(cls, key)
        else:
            setattr(cls, key, value)


def _module_snapshots(gm: fx.GraphModule) -> list:
    """Per module under ``gm``: ``(module, its tables, its attribute names)``, what
    ``Journal.undo`` puts back. Kept small, as the journal lives as long as the
    rewrite (on ResNet-50 a copy of every table and a set of names per module held
    1.5x the graph): an empty table is saved as None, a full one as a plain dict or
    set (order kept), and modules with the same attribute names share one tuple."""
    snapshots, seen, todo = [], set(), [gm]
    names: dict = {}
    while todo:
        m = todo.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        attributes = m.__dict__
        tables = tuple(_ABSENT if (t := attributes.get(k, _ABSENT)) is _ABSENT
                       else (set(t) if isinstance(t, set) else dict(t)) if t else None for k in _TABLES)
        keys = tuple(attributes)
        snapshots.append((m, tables, names.setdefault(keys, keys)))
        todo.extend(c for c in attributes.get("_modules", {}).values() if c is not None)
    return snapshots


def _same_table(a: Any, b: Any) -> bool:
    """The same entries, in the same order, the same objects (never compares tensors);
    ``b`` None: empty."""
    if b is None:
        return not a
    if isinstance(a, set):
        return a == b
    return len(a) == len(b) and all(ka == kb and va is vb for (ka, va), (kb, vb) in zip(a.items(), b.items()))
