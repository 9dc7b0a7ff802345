"""What a hook can reach: the tensors Python code registered on a module may write.

A forward hook is code no schema describes. It is given its module, its inputs and
(a forward hook) its output, and it may write anything else it holds: a counter on
the root module it closes over (``gm.seen.add_(1)``), another layer's weight it
clamps (``model.conv.weight.data.clamp_(...)``). ``state_writes`` must count what a
hook can reach among the written state, or the check does not put it back after its
runs and constant folds read a weight the hook rewrites.

``reachable_tensors(fn)`` walks what ``fn`` holds: its closure, defaults, the
globals its code names, a bound method's object, a ``functools.partial``'s parts,
and from there what every object refers to (``gc.get_referents``: containers,
attributes, C objects such as a ``deque`` or a bound ``t.__setitem__``). It answers
every tensor found, or None when the walk cannot be bounded (too many objects, an
object that fails when looked into, a suspended frame): the caller then treats
every state tensor as written. A feature hook appending to a list it closes over reaches no
tensor of the model and costs nothing.
"""

from __future__ import annotations

import dis
import functools
import gc
import random
import sys
import types
import weakref
from typing import Any, Iterator, Optional

import torch

from rewrite.module_state import CONTAINERS

__all__ = ["generator_types", "reachable_containers", "reachable_generators", "reachable_tensors", "storage_key",
           "view_over"]

#: objects visited before the walk gives up (None: everything may be written)
_LIMIT = 20000

_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.memory_format,
          torch.layout, type(Ellipsis), range, slice, types.GetSetDescriptorType, types.MemberDescriptorType,
          types.WrapperDescriptorType, types.MethodDescriptorType, types.ClassMethodDescriptorType,
          types.CodeType)

#: objects whose references the walk cannot follow (a suspended frame's locals)
_OPAQUE = (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType, types.FrameType)

#: classes and functions of these packages hold no model (their globals are not walked)
_LIBRARIES = ("torch", "numpy", "rewrite", "transformers", "functorch", "builtins")


def storage_key(t: torch.Tensor) -> Any:
    """What identifies ``t``'s memory (tensors with the same key share it), or None
    when it has none to share (empty, quantized, sparse, a subclass)."""
    if t.__class__ not in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer) or t.layout != torch.strided \
            or t.is_quantized or t.device.type == "meta":  # a meta tensor's memory is nowhere (address 0)
        return None
    try:
        storage = t.untyped_storage()
        return (t.device, storage.data_ptr()) if storage.nbytes() else None
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def view_over(memory: torch.UntypedStorage, t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``memory`` (a copy of ``t``'s storage) laid out as ``t`` is in its
    own: dtype, offset, sizes and strides, and a negative or conjugate view's bit,
    which is what its readers see."""
    out = torch.empty(0, dtype=t.dtype, device=t.device).set_(memory, t.storage_offset(), t.size(), t.stride())
    if t.is_neg():
        out = torch._neg_view(out)
    return out.conj() if t.is_conj() else out


def reachable_tensors(fn: Any, seen: Optional[set] = None) -> Optional[list]:
    """Every tensor ``fn`` can reach, or None when that is unbounded. ``seen``: the
    ids of objects an earlier walk went through (shared, it grows): they and what
    they reach are not walked again, so only tensors new to it are answered."""
    from torch._subclasses.fake_tensor import FakeTensor

    found: list = []

    def visit(obj: Any) -> Optional[bool]:
        if not isinstance(obj, torch.Tensor):
            return True
        if isinstance(obj, FakeTensor):
            return False  # a graph's metadata: no memory of the caller's
        if obj.__class__ not in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer):
            return None  # a subclass may hold tensors of its own
        found.append(obj)
        return False

    return found if _walk(fn, set() if seen is None else seen, visit) else None


def reachable_containers(fn: Any, seen: Optional[set] = None) -> Optional[list]:
    """The lists, dicts, sets and deques ``fn`` can reach outside modules, graphs and
    tensors (a feature list a hook closes over, a recorder object's own attributes),
    or None when that is unbounded. A module's attributes, its graph and its nodes'
    metadata are what a module snapshot and the rewrite keep: not walked."""
    found: list = []
    taken: set = set()  # ids of the containers found

    def take(container: Any) -> None:
        if id(container) not in taken:
            taken.add(id(container))
            found.append(container)

    def visit(obj: Any) -> bool:
        if isinstance(obj, (torch.Tensor, torch.nn.Module, torch.fx.Graph, torch.fx.Node)):
            return False
        if isinstance(obj, CONTAINERS):
            take(obj)
        elif not isinstance(obj, (type, types.ModuleType, types.FunctionType, types.MethodType)):
            # an object's own attributes (a recorder's ``self.calls += 1``): its __dict__,
            # which Python 3.11 keeps inline, unseen by gc, until it is asked for
            try:
                attributes = object.__getattribute__(obj, "__dict__")
            except Exception:  # noqa: BLE001 - slots only, or a __dict__ that cannot be read
                attributes = None
            if type(attributes) is dict:
                take(attributes)
        return True

    return found if _walk(fn, set() if seen is None else seen, visit) else None


def reachable_generators(fn: Any, seen: Optional[set] = None) -> list:
    """The random number generator objects ``fn`` can reach (``generator_types``: a
    module-level ``numpy.random.default_rng()``, a ``random.Random``, a
    ``torch.Generator`` a helper draws from), best-effort: an unbounded walk answers
    what it found before it stopped."""
    found: list = []
    kinds = generator_types()
    numpy = sys.modules.get("numpy")
    # the global generators: ``rewrite.trust.rng.seeded`` seeds them for each run
    seeded = {id(torch.default_generator), id(getattr(random, "_inst", None))}
    if numpy is not None:
        seeded.add(id(getattr(numpy.random.mtrand, "_rand", None)))

    def visit(obj: Any) -> bool:
        if isinstance(obj, kinds):
            if id(obj) not in seeded:
                found.append(obj)
            return False
        return not isinstance(obj, (torch.Tensor, torch.fx.Graph, torch.fx.Node))

    _walk(fn, set() if seen is None else seen, visit)
    return found


def generator_types() -> tuple:
    """The classes of random generator objects whose state can be read and put back:
    torch's, Python's and, once imported, numpy's."""
    kinds: tuple = (torch.Generator, random.Random)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kinds += (numpy.random.Generator, numpy.random.RandomState)
    return kinds


def _walk(fn: Any, seen: set, visit: Any) -> bool:
    """Go through what ``fn`` holds (``_held``), each object once (``seen``: ids,
    shared between walks), asking ``visit(obj)`` whether to go into it (True), not
    (False), or to stop: the walk is unbounded (None). False when unbounded: past
    ``_LIMIT`` objects, or an object that cannot be looked into."""
    start = len(seen)
    stack = [fn]
    while stack:
        obj = stack.pop()
        if isinstance(obj, _ATOMS) or id(obj) in seen or _numpy_value(obj):
            continue
        seen.add(id(obj))
        if len(seen) - start > _LIMIT:
            return False
        into = visit(obj)
        if into is None:
            return False
        if not into:
            continue
        try:
            children = _held(obj)
        except Exception:  # noqa: BLE001 - an object that fails when looked into: unbounded
            return False
        if children is None:
            return False
        stack.extend(children)
    return True


def _held(obj: Any) -> Optional[list]:
    """What ``obj`` holds that a call of it, or code given it, can reach; None when
    that cannot be told."""
    if isinstance(obj, types.ModuleType):
        return [] if _library(obj) else list(vars(obj).values())
    if isinstance(obj, _OPAQUE):
        return None
    if isinstance(obj, types.FunctionType):  # not its whole module: the globals its code names
        held = [c.cell_contents for c in (obj.__closure__ or ()) if _filled(c)]
        held += list(obj.__defaults__ or ()) + list((obj.__kwdefaults__ or {}).values())
        if not _library(sys.modules.get(obj.__module__ or "")):  # a library's globals hold no model
            held += [obj.__globals__[name] for name in _names(obj.__code__) if name in obj.__globals__]
        return held + list(obj.__dict__.values())
    if isinstance(obj, type):  # a user's class: its methods and class attributes
        return [] if _library(sys.modules.get(obj.__module__ or "")) else list(obj.__dict__.values())
    if isinstance(obj, types.BuiltinFunctionType):  # also a C method bound to its object (``t.add_``)
        return [obj.__self__]
    if isinstance(obj, weakref.ref):
        return [obj()]
    # anything else: what it refers to (a dict's keys and values, an instance's __dict__
    # or slots and its class, a partial's function and arguments, a deque's items)
    return list(gc.get_referents(obj)) + [type(obj)]


def _library(module: Optional[types.ModuleType]) -> bool:
    """A module of the standard library or an installed package (``site-packages``),
    whose globals hold no model of the caller's; the caller's own modules (a script
    holding a model in a global, ``__main__`` of a notebook or ``python -c``) are
    walked, and so is an unknown one."""
    if module is None:
        return False
    name = module.__name__.partition(".")[0]
    if name in sys.stdlib_module_names or name in _LIBRARIES or name in sys.builtin_module_names:
        return True
    return "-packages" in (getattr(module, "__file__", None) or "")


def _numpy_value(obj: Any) -> bool:
    """A numpy array or scalar: data, not references (an array ``torch.from_numpy``
    shares with a buffer is beyond this walk)."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(obj, (numpy.ndarray, numpy.generic))


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell (a name assigned after the closure was made)
        return False
    return True


def _names(code: types.CodeType) -> Iterator[str]:
    """Global names ``code`` and the code nested in it (comprehensions, inner functions)
    read or write: not its attribute names (``self.model(x)`` names no global
    ``model``), which ``co_names`` holds too."""
    yield from _global_names(code)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


@functools.lru_cache(maxsize=4096)
def _global_names(code: types.CodeType) -> tuple:
    return tuple({i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_OPS})


_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL", "STORE_NAME"})
