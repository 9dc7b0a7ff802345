"""The op vocabulary's data model: canonical ops, their surface forms, and emission.

A canonical op (``conv``, ``add``, ``batch_norm``) has one signature (``Param``s in
order, with defaults). Every way a captured graph can spell it is a *surface form*
that binds an ``fx.Node`` to that signature:

* ``FunctionForm``: ``call_function`` on a torch function, ``operator`` function or
  aten overload (``torch.conv2d``, ``F.conv2d``, ``aten.conv2d.default``);
* ``MethodForm``: ``call_method`` (``x.add(y)``, ``x.view(...)``);
* ``ModuleForm``: ``call_module`` on an ``nn`` module, whose parameters become
  ``ConstRef`` operands so rules can fold them (``nn.Conv2d`` -> ``conv(x, weight, ...)``);
* ``GetitemForm``: ``getitem(multi_output_op(...), i)`` (core ATen's
  ``_native_batch_norm_legit_no_training``) where the inner node is consumed too.

Binding yields a ``Bound``: operands by canonical parameter name, defaults filled in,
so ``x.add(y)``, ``torch.add(x, y)``, ``x + y`` and ``aten.add.Tensor(x, y)`` all bind
to ``add(input=x, other=y, alpha=1)``.

Emission is the reverse: an ``Emitter`` turns canonical arguments into a node in the
dialect of the graph being rewritten (``"torch"`` for symbolic_trace and dynamo graphs,
``"aten"`` for torch.export graphs).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import attrs
import torch
import torch.fx as fx
from torch.nn.modules import module as nn_module

__all__ = [
    "REQUIRED", "Param", "Instances", "OpDef", "ConstRef", "Bound", "Form", "FunctionForm", "attribute",
    "MethodForm", "ModuleForm", "GetitemForm", "Emitter", "node_key", "bind_signature", "by_identity",
    "CALL_OPS", "nodes_by_target",
]


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


@attrs.frozen
class Param:
    """One parameter of a canonical op. ``tensor`` marks operands that are tensors
    (graph values or constants) rather than attribute literals (stride, dim)."""

    name: str
    default: Any = REQUIRED
    tensor: bool = False


@attrs.frozen
class ConstRef:
    """A constant tensor reached by attribute path from the root module
    (``layer1.0.conv1.weight``); what module parameters become under ``ModuleForm``."""

    qualname: str


@attrs.frozen
class Bound:
    """A node bound to a canonical op: ``args`` by parameter name (every parameter
    present, defaults filled), plus ``interior`` nodes the form consumed besides the
    node itself (they must have no other users for a match to hold)."""

    op: str
    args: dict
    interior: tuple = ()


def by_identity(table: dict, obj: Any, compute: Callable[[Any], Any]) -> Any:
    """``compute(obj)``, kept in ``table`` under ``id(obj)`` (with ``obj`` itself, so a
    recycled id is never mistaken for it): for keys that hash slowly (an
    ``OpOverload`` hashes in Python) or not at all (a tensor)."""
    hit = table.get(id(obj))
    if hit is None or hit[0] is not obj:
        hit = table[id(obj)] = (obj, compute(obj))
    return hit[1]


#: The node ops that call something (what rules can match at).
CALL_OPS = frozenset({"call_function", "call_method", "call_module"})


def nodes_by_target(graph: Any) -> Any:
    """``(op, target, nodes)`` groups of a graph's call nodes (target None for
    methods and modules), read from the graph's own find_nodes index, so a 10k-node
    graph costs one look per distinct target rather than one per node."""
    table = getattr(getattr(graph, "_find_nodes_lookup_table", None), "table", None)
    if table is None:  # another torch: group by hand
        table = {}
        for node in graph.nodes:
            key = (node.op, node.target if node.op == "call_function" else None)
            table.setdefault(key, {})[node] = None
    for (op, target), nodes in list(table.items()):
        if op in CALL_OPS and nodes:
            yield op, target, nodes


def submodule(gm: Any, target: str) -> Any:
    """``gm.get_submodule(target)`` through the module tables directly (no
    ``Module.__getattr__`` per path step: symbolic_trace graphs ask once per
    ``call_module`` node and rule). Raises AttributeError like get_submodule."""
    module = gm
    try:
        for part in target.split("."):
            module = module._modules[part]
    except (KeyError, AttributeError):
        return gm.get_submodule(target)
    if module is None:
        return gm.get_submodule(target)
    return module


def attribute(root: Any, qualname: str) -> Any:
    """``root.a.b.c`` by dotted name, as get_attr nodes and constants name them:
    through the module tables (parameters, buffers, submodules) without
    ``Module.__getattr__``, other attributes by ``getattr``. Raises AttributeError."""
    obj = root
    for part in qualname.split("."):
        tables = getattr(obj, "__dict__", None)
        if isinstance(obj, torch.nn.Module) and tables is not None:
            found = tables["_parameters"].get(part)
            if found is None:
                found = tables["_buffers"].get(part)
                if found is None:
                    found = tables["_modules"].get(part)
            if found is not None:
                obj = found
                continue
        obj = getattr(obj, part)
    return obj


def node_key(node: fx.Node, gm: Any) -> Any:
    """The index key of a node: what forms are looked up by.

    ``("call_function", target)``, ``("call_method", name)``, ``("call_module", cls)``
    (``cls`` None for a module with hooks: no form binds it).
    """
    if node.op == "call_module":
        try:
            module = submodule(gm, node.target)
        except AttributeError:
            return ("call_module", None)
        if _hooked(module):
            return ("call_module", None)  # a hook runs code no rule knows: the call binds to nothing
        return ("call_module", type(module))
    return (node.op, node.target)


def _hooked(module: Any) -> bool:
    """A hook of the module's own, or a global one, runs around its forward."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module.__dict__.get("_backward_pre_hooks") or nn_module._global_forward_hooks
                or nn_module._global_forward_pre_hooks or nn_module._global_backward_hooks
                or nn_module._global_backward_pre_hooks or nn_module._global_forward_hooks_always_called)


@attrs.frozen
class Instances:
    """How rule verification builds calls of an op (``rewrite.trust.instances``).

    Attributes:
        family: the generator that draws the op's arguments from the shapes it
            is given (``"unary"``, ``"binary"``, ``"conv"``, ...); the families are
            listed in ``rewrite.trust.instances.FAMILIES``. A new op of a known
            shape names a family here and needs nothing else.
        input_range: (lo, hi) of values drawn for its tensor operands: the op's
            domain (``sqrt``: positive).
        literals: ``(param, values)`` pairs: attribute values verification samples
            (``("eps", (1e-5, 1e-3))``). A tuple of values is sampled from; ``bool``
            draws both truth values.
        operand_ranges: ``(param, range)`` pairs the equivalence check keeps its
            random inputs in when a placeholder feeds that operand: ``"positive"``
            (a running variance) or ``"index:<param>"`` (an index below the row
            count of that operand: an embedding's indices).
    """

    family: str
    input_range: tuple = (-4.0, 4.0)
    literals: tuple = ()
    operand_ranges: tuple = ()


@attrs.frozen
class OpDef:
    """A canonical op.

    Attributes:
        name: the canonical name used in rule files.
        params: the signature, in positional order.
        commutative: the first two tensor params may be swapped when matching.
        elementwise: output shape is the broadcast of the tensor inputs.
        forms: every surface form that binds to this op (filled by the vocabulary).
        emit: dialect name -> Emitter ("torch", "aten").
        doc: one line for ``rewrite explain`` and the README's op table.
        qualified: a qualified name's op (``aten.add.Tensor``, ``torch.cumsum``):
            it matches and emits exactly its target, not every spelling.
        writes: ``(param, flag)`` pairs: parameters the emitted op writes in place,
            when parameter ``flag`` is true (None: always); ``batch_norm`` writes
            its running statistics in training mode. See ``rewrite.ops.effects``.
        instances: how verification builds calls of it (``Instances``); None: no
            generator (rules matching it are reported unverified).
    """

    name: str
    params: tuple
    commutative: bool = False
    elementwise: bool = False
    forms: tuple = ()
    emit: dict = attrs.field(factory=dict)
    doc: str = ""
    writes: tuple = ()
    qualified: bool = False
    instances: Instances | None = None

    @functools.cached_property
    def param_names(self) -> tuple:
        return tuple(p.name for p in self.params)

    @functools.cached_property
    def _commuting(self) -> dict | None:
        names = [p.name for p in self.params if p.tensor][:2]
        if not self.commutative or len(names) < 2:
            return None
        return {names[0]: names[1], names[1]: names[0]}

    def commuted(self, args: tuple) -> tuple | None:
        """``(name, value)`` pairs with the two commuting operands swapped (the first
        two tensor parameters of a commutative op); None when the op does not commute.
        The one place the matcher and its prefilter learn argument orders from."""
        swap = self._commuting
        if swap is None:
            return None
        return tuple((swap.get(name, name), value) for name, value in args)

    def param(self, name: str) -> Param | None:
        for p in self.params:
            if p.name == name:
                return p
        return None

    def normalize_call(self, args: tuple, kwargs: dict) -> dict | None:
        """Bind positional/keyword arguments written against this signature;
        fill defaults. None when they do not fit (too many, unknown keyword, missing)."""
        names = self.param_names
        if len(args) > len(names):
            return None
        out = dict(zip(names, args))
        for k, v in kwargs.items():
            if k not in names or k in out:
                return None
            out[k] = v
        for p in self.params:
            if p.name not in out:
                if p.default is REQUIRED:
                    return None
                out[p.name] = p.default
        return out


def bind_signature(signature: tuple, args: tuple, kwargs: dict) -> dict | None:
    """Map a call's args/kwargs onto the form's own signature (target's names)."""
    if len(args) > len(signature):
        return None
    out = dict(zip(signature, args))
    for k, v in kwargs.items():
        if k in out or k not in signature:
            return None
        out[k] = v
    return out


_MISSING = object()


@attrs.frozen
class _FormBase:
    """Shared binding for forms that call a target with its own signature.

    ``signature``: the target's parameter names in positional order; ``defaults``:
    the target's defaults for parameters that guards look at; ``rename``: target
    name -> canonical name; ``fixed``: canonical args the form implies (e.g.
    ``aten.conv2d`` implies nothing, ``F.relu6`` may fix bounds); ``guards``: target
    params that must have a given value for the node to be this op (``transposed``
    of ``aten.convolution``); ``ignore``: target params dropped (``inplace``).
    """

    op: str
    signature: tuple = ()
    rename: dict = attrs.field(factory=dict)
    fixed: dict = attrs.field(factory=dict)
    guards: dict = attrs.field(factory=dict)
    defaults: dict = attrs.field(factory=dict)
    ignore: frozenset = frozenset()

    def _normalize(self, args: tuple, kwargs: dict, opdef: OpDef) -> dict | None:
        raw = bind_signature(self.signature, args, kwargs)
        if raw is None:
            return None
        for name, expected in self.guards.items():
            value = raw.pop(name, self.defaults.get(name, _MISSING))
            if value is _MISSING or value != expected:
                return None
        out = {self.rename.get(k, k): v for k, v in raw.items() if k not in self.ignore}
        out.update(self.fixed)
        return opdef.normalize_call((), out)


@attrs.frozen
class FunctionForm(_FormBase):
    """``call_function`` of ``target``."""

    target: Any = None

    @property
    def key(self) -> tuple:
        return ("call_function", self.target)

    def bind(self, node: fx.Node, gm: Any, opdef: OpDef) -> Bound | None:
        args = self._normalize(node.args, node.kwargs, opdef)
        return None if args is None else Bound(self.op, args)


@attrs.frozen
class MethodForm(_FormBase):
    """``call_method`` named ``method``; ``signature`` starts with ``self``."""

    method: str = ""

    @property
    def key(self) -> tuple:
        return ("call_method", self.method)

    def bind(self, node: fx.Node, gm: Any, opdef: OpDef) -> Bound | None:
        args = self._normalize(node.args, node.kwargs, opdef)
        return None if args is None else Bound(self.op, args)


@attrs.frozen
class ModuleForm:
    """``call_module`` of an instance of ``module_cls``; ``extract(module, node,
    qualname)`` returns canonical args (module tensors as ``ConstRef``) or None."""

    op: str
    module_cls: type
    extract: Callable

    @property
    def key(self) -> tuple:
        return ("call_module", self.module_cls)

    def bind(self, node: fx.Node, gm: Any, opdef: OpDef) -> Bound | None:
        module = submodule(gm, node.target)
        raw = self.extract(module, node, node.target)
        if raw is None:
            return None
        args = opdef.normalize_call((), raw)
        return None if args is None else Bound(self.op, args)


@attrs.frozen
class GetitemForm(_FormBase):
    """``operator.getitem(inner_target(...), index)``: a multi-output op's result."""

    inner_target: Any = None
    index: int = 0

    @property
    def key(self) -> tuple:
        import operator

        return ("call_function", operator.getitem)

    def bind(self, node: fx.Node, gm: Any, opdef: OpDef) -> Bound | None:
        if len(node.args) != 2 or node.args[1] != self.index:
            return None
        inner = node.args[0]
        if not isinstance(inner, fx.Node) or inner.op != "call_function" or inner.target is not self.inner_target:
            return None
        args = self._normalize(inner.args, inner.kwargs, opdef)
        return None if args is None else Bound(self.op, args, interior=(inner,))


Form = FunctionForm | MethodForm | ModuleForm | GetitemForm


@attrs.frozen
class Emitter:
    """How to build an op in one dialect.

    ``choose(args) -> (target, args_tuple, kwargs_dict)`` gets canonical args whose
    values are already graph values (Nodes or literals) and ``facts`` (a callable
    giving ``meta['val']``-like info for a value, for choices such as conv rank).
    The result is passed to ``graph.call_function``.
    """

    choose: Callable

    def __call__(self, args: dict, facts: Callable) -> tuple:
        return self.choose(args, facts)
