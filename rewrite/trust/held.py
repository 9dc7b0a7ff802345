"""Tensors an example input holds inside an object torch's pytree does not flatten.

A model may take its inputs in a dataclass, a ``types.SimpleNamespace``, a ``dict``
subclass or a ``collections.UserDict`` (transformers' ``BatchEncoding`` is one):
``symbolic_trace`` traces through the attribute reads, but ``torch.utils._pytree``
sees the object as one opaque leaf. The check must still copy those tensors before
running the model (a forward that writes its input must not write the caller's),
draw random values for them (or every random trial equals the example) and compare
what the runs wrote into them. ``held_tensors`` finds them, in an order that a deep
copy of the object repeats; ``map_held`` deep-copies the object with each of them
replaced; ``input_leaves`` is pytree's leaves with such objects opened.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import types
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

__all__ = ["generator_copy", "held_tensors", "input_leaves", "laid_out_copy", "map_held"]

_ATOMS = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format, type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType,
          torch.SymInt, torch.SymFloat, torch.SymBool)  # a symbolic size: its shape environment holds no input
_MAX_OBJECTS = 10_000  # objects looked into per input, at most (a tokenizer's tables are not inputs)


def _children(obj: Any) -> list | None:
    """The values ``obj`` holds, in a fixed order, or None for an object not looked into."""
    if isinstance(obj, (list, tuple)):
        return list(obj)
    if isinstance(obj, collections.UserDict):
        return list(obj.data.values())
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, (torch.nn.Module, set, frozenset)) or isinstance(obj, _ATOMS):
        return None  # a module's tensors are its state; a set has no order a copy repeats
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = [f.name for f in dataclasses.fields(obj)]
        extra = getattr(obj, "__dict__", {})
        return [getattr(obj, n, None) for n in names] + [v for k, v in extra.items() if k not in names]
    found = list(vars(obj).values()) if isinstance(getattr(obj, "__dict__", None), dict) else []
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                found.append(getattr(obj, name))
    return found


def held_tensors(obj: Any, generators: bool = False) -> list:
    """The tensors ``obj`` holds through its attributes, items and slots (each once,
    in the order met), or ``[]``; with ``generators``, the ``torch.Generator``s too. A
    tensor itself is not "held"."""
    if isinstance(obj, torch.Tensor):
        return []
    found: list = []
    seen: set = set()
    todo = [obj]
    while todo:
        value = todo.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if len(seen) > _MAX_OBJECTS:
            raise TypeError(f"an example input of type {type(obj).__name__} holds more than {_MAX_OBJECTS} "
                            "objects: pass the model's tensors positionally, or in a dict, list or tuple")
        if isinstance(value, torch.Tensor) or (generators and isinstance(value, torch.Generator)):
            found.append(value)
            continue
        children = _children(value)
        if children:
            todo.extend(reversed(children))
    return found


def map_held(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """A deep copy of ``obj`` in which each tensor it holds is ``fn(tensor)`` (a
    tensor held twice is one value in the copy), or ``obj`` itself when it holds none.
    A ``torch.Generator`` it holds (``opts.g``) is a copy at its state: a run given the
    copy draws what it would, and the caller's generator stays where it was."""
    held = held_tensors(obj, generators=True)
    if not held:
        return obj
    copies = {id(t): generator_copy(t) if isinstance(t, torch.Generator) else fn(t) for t in held}

    def memo() -> dict:
        # each attempt its own: a failed one leaves half-made copies in the memo it used
        # (a dict emptied of what came after a lock), which a second would hand out
        fresh = dict(copies)
        fresh[id(fresh)] = [obj, held]  # copy.deepcopy's keep-alive list: the ids above stay valid
        return fresh

    try:
        return copy.deepcopy(obj, memo())
    except Exception:  # noqa: BLE001 - a class whose __getattr__ answers for __deepcopy__ with a KeyError
        pass
    try:  # what deepcopy does for an object without __deepcopy__, asked directly
        return copy._reconstruct(obj, memo(), *obj.__reduce_ex__(4))
    except Exception as err:  # noqa: BLE001 - any object that refuses to be copied
        raise TypeError(
            f"an example input of type {type(obj).__name__} holds tensors, and the check cannot copy it "
            f"({type(err).__name__}: {err}): pass its tensors positionally, or in a dict, list or tuple "
            "(or pass check=False and compare the result yourself)") from err


def input_leaves(tree: Any) -> list:
    """``pytree.tree_leaves(tree)``, each object that holds tensors replaced by them."""
    out: list = []
    for leaf in pytree.tree_leaves(tree):
        held = held_tensors(leaf) if not isinstance(leaf, torch.Tensor) else ()
        if held:
            out.extend(held)
        else:
            out.append(leaf)
    return out


def generator_copy(g: torch.Generator) -> torch.Generator:
    """A generator at ``g``'s state: a run given it draws what it would from ``g``,
    and the caller's ``g`` stays where it was."""
    copy_ = torch.Generator(device=g.device)
    copy_.set_state(g.get_state())
    return copy_


def laid_out_copy(tree: Any) -> Any:
    """Copies of the tensors in ``tree`` with their own strides (a sliced or
    channels_last input stays one; ``is_contiguous`` is a fact about it), each in
    memory spanning only what it addresses: a 40-byte view of a 200 MB tensor is not
    the 200 MB ``inputs_copy`` copies to keep its storage offset and what it shares.
    For what only reads layouts (recording facts, ``analyze``)."""
    def one(t: Any) -> Any:
        if isinstance(t, torch.Generator):
            return generator_copy(t)
        if not isinstance(t, torch.Tensor):
            return map_held(t, one)
        if t.requires_grad or type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided \
                or t.is_quantized or t.is_conj() or t.is_neg():
            return t.clone()
        try:
            with torch.no_grad():
                return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device).copy_(t)
        except RuntimeError:  # strides that overlap (an expand): a dense copy
            return t.clone()

    return pytree.tree_map(one, tree)
