"""What running a module's Python changes besides tensors, saved and put back.

Tracing a model with ``torch.fx.symbolic_trace`` runs its ``forward`` on the caller's
own module objects, and the check runs an eager model as its reference: a forward
that sets an attribute (``self.calls += 1``, a rotary cache ``self._cos = ...`` that
tracing fills with a Proxy) or appends to a list it keeps (``self.seen.append(x)``)
changes the caller's model. ``AttributeSnapshot`` records every submodule's attribute
dict and the contents of the containers it holds (lists, dicts, sets: the
parameter, buffer and submodule tables among them), and ``restore`` puts back what
changed, in place (the same objects), as often as needed.
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Iterable
from typing import Any

import torch
from torch import fx
from torch.nn.parameter import UninitializedTensorMixin

__all__ = ["AttributeSnapshot", "CONTAINERS", "TensorValues", "same_entries", "version_of"]

_ABSENT = object()  # an attribute a module did not have
#: the containers whose contents a snapshot keeps (a copy of each: ``copy()``), by
#: exact type in a module's attributes; a hook's (``reachable_containers``) by kind:
#: a ``defaultdict``, a ``Counter``
_CONTAINERS = (dict, collections.OrderedDict, list, set)
CONTAINERS = (dict, list, set, collections.deque)


def same_entries(now: dict, saved: dict) -> bool:
    """The same keys holding the same objects (never compares values: tensors). At C
    speed when the order is unchanged, as after almost every run (a root module of
    a 10k-node graph holds thousands of attributes, looked at after every run)."""
    if len(now) != len(saved):
        return False
    if all(map(operator.is_, now.values(), saved.values())) and all(map(operator.eq, now, saved)):
        return True
    return not any(now.get(k, _ABSENT) is not v for k, v in saved.items())


def _same_contents(container: Any, saved: Any) -> bool:
    if isinstance(container, dict):
        return same_entries(container, saved)
    if isinstance(container, (list, collections.deque)):
        return len(container) == len(saved) and all(map(operator.is_, container, saved))
    return container == saved  # a set: its members by identity first


def _put_back(container: Any, saved: Any) -> None:
    if isinstance(container, list):
        container[:] = saved
    elif isinstance(container, collections.deque):
        container.clear()
        container.extend(saved)
    else:
        container.clear()
        container.update(saved)


class AttributeSnapshot:
    """Every given module's attributes and the contents of the containers they hold,
    as they are now."""

    def __init__(self, modules: Iterable[Any], containers: Iterable[Any] = ()) -> None:
        """``containers``: lists, dicts and sets held elsewhere whose contents are put
        back too (a feature list a caller's hook closes over and appends to)."""
        self._entries = []
        self._generators = []  # a module's own torch.Generator: its state, put back too
        held = tuple((c, c.copy()) for c in containers if isinstance(c, CONTAINERS))
        if held:
            self._entries.append((None, None, held))
        for m in modules:
            attributes = m.__dict__.copy()
            held = tuple((v, v.copy()) for v in attributes.values() if type(v) in _CONTAINERS)
            self._entries.append((m, attributes, held))
            self._generators += [(v, v.get_state()) for v in attributes.values()
                                 if isinstance(v, torch.Generator) and v.device.type == "cpu"]

    def restore(self, code: frozenset = frozenset()) -> bool:
        """Put back what changed; ``code``: the attributes a GraphModule's generated
        code lives in, left as they are on GraphModules (they follow its graph, and a
        lazily compiled module sets them on its first run). Returns whether anything
        had changed."""
        changed = False
        for m, attributes, held in self._entries:
            if m is None:  # containers only
                for container, contents in held:
                    if not _same_contents(container, contents):
                        _put_back(container, contents)
                        changed = True
                continue
            now = m.__dict__
            keep = code if isinstance(m, fx.GraphModule) else ()
            if not same_entries(now, attributes):
                for key in [k for k in now if k not in attributes and k not in keep]:
                    del now[key]
                    changed = True
                for key, value in attributes.items():
                    if key not in keep and now.get(key, _ABSENT) is not value:
                        now[key] = value
                        changed = True
            for container, contents in held:
                if not _same_contents(container, contents):
                    _put_back(container, contents)
                    changed = True
        for generator, state in self._generators:
            if not torch.equal(generator.get_state(), state):
                generator.set_state(state)
                changed = True
        return changed


class TensorValues:
    """The values of the tensors some modules hold (buffers, plain tensor attributes
    such as ``self.offset``, tensors in the lists, dicts and objects they hold, such
    as a static KV cache ``self.cache[0]``, and, when ``parameters``, parameters),
    copied now; ``restore`` writes back those a run changed in place. A capture that
    runs the caller's forward for real (a non-strict export, dynamo's recording run)
    leaves ``self.offset.add_(1)`` done otherwise: ``AttributeSnapshot`` puts back
    which object an attribute holds, not what the object holds. Parameters cost a
    copy of the weights: only dynamo's run writes them (non-strict export traces
    them as fakes)."""

    def __init__(self, modules: Iterable[Any], parameters: bool = False) -> None:
        from rewrite.trust.held import held_tensors

        self._saved: list = []
        seen: set = set()
        for m in modules:
            tensors = [*m._buffers.values(), *(m._parameters.values() if parameters else ())]
            for key, v in vars(m).items():
                if key in _MODULE_TABLES or isinstance(v, (torch.nn.Module, type)) or callable(v):
                    continue  # its parameter, buffer and submodule tables, hooks: not state a forward writes
                if isinstance(v, torch.Tensor):
                    tensors.append(v)
                elif v is not None and not isinstance(v, (str, int, float, bool)):
                    try:  # a list, dict, dataclass or cache object holding tensors (a static KV cache)
                        tensors.extend(held_tensors(v))
                    except (TypeError, RecursionError):  # too many objects to walk: left as they are
                        pass
            for t in tensors:
                if not isinstance(t, torch.Tensor) or id(t) in seen or t.layout != torch.strided \
                        or getattr(t, "is_nested", False) or t.is_quantized or t.is_sparse \
                        or isinstance(t, UninitializedTensorMixin) or t.device.type == "meta":
                    continue  # (a lazy module's parameter has no values yet: its run makes them)
                seen.add(id(t))
                self._saved.append((t, version_of(t), t.detach().clone()))

    def restore(self) -> bool:
        """Put back the values a run changed; returns whether any had changed. A
        tensor whose version and bits are unchanged is not written (NaN included)."""
        changed = False
        with torch.no_grad():
            for t, version, copy in self._saved:
                if version_of(t) == version and _same_bits(t, copy):
                    continue
                try:
                    t.detach().copy_(copy)
                except RuntimeError:  # a tensor whose elements share memory (an expand): its values as they are
                    continue
                changed = True
        return changed


#: an ``nn.Module``'s own tables and hook dicts (``vars(nn.Module())``), never walked:
#: what they hold are its parameters (copied only when asked), submodules and hooks
_MODULE_TABLES = frozenset(vars(torch.nn.Module()))


def version_of(t: torch.Tensor) -> int | None:
    """``t``'s version counter; None for an inference tensor, which has none."""
    try:
        return t._version
    except RuntimeError:
        return None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where NaN (an untouched NaN is no write)."""
    a = a.detach()
    try:
        if torch.equal(a, b):
            return True
    except (RuntimeError, NotImplementedError):  # a kind torch cannot compare: taken as unchanged
        return True
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return False
