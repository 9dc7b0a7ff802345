"""What an op does besides computing its result: aliasing and in-place writes.

A rewrite may change how a value is computed, never what the caller observes, so
the engine must know which ops return (a view of) an input, and which write into an
argument. This module is the one place that knows, for graph nodes and for ops a
rule file names:

* ``may_alias(node)``: the result may share memory with the first input (views,
  and ops that return their input unchanged when there is nothing to do: no-op
  casts, reshapes of contiguous tensors, eval-mode dropout, in-place ops);
* ``may_alias_any_argument(node)``: a call whose code no schema or name list
  describes (a module or function from outside torch, a higher-order op) may
  return any of its inputs, not only the first;
* ``always_aliases(node)``: the result is always a view of the first input;
* ``written_args(node)``: the arguments a node writes in place;
* ``opdef_writes(opdef)``: the parameters an op named in a replacement writes,
  from torch's schemas (``Tensor(a!) self``) for qualified names and from the
  vocabulary entry (``writes=``) for canonical ops;
* ``opdef_may_alias(opdef)``: a value an op named in a replacement returns may
  share memory with an argument.

Aten overloads answer from their schema (alias annotations); torch functions and
``Tensor`` methods from the aten op of the same name; modules and the few Python
spellings with no schema from the name lists below.
"""

from __future__ import annotations

import builtins
import dis
import functools
import operator
import os
import sys
import types
import weakref
from typing import Any, Iterator, NamedTuple

import torch
import torch.fx as fx
from torch.nn.modules import module as nn_module
from torch.utils import _pytree as pytree

from rewrite.capture import is_export_guard
from rewrite.ops.base import attribute, by_identity, nodes_by_target, submodule
from rewrite.ops.reach import reachable_containers, reachable_generators, reachable_tensors, storage_key

__all__ = [
    "VIEW_NAMES", "ALIASING_NAMES", "ALIASING_MODULES", "FRESH_COMPOSITES", "FRESH_FUNCTIONS", "FRESH_OPERATORS",
    "ANY_INPUT_ALIASING_NAMES", "op_name", "may_alias", "schema_returns_alias",
    "may_alias_any_argument", "note_built_module", "built_module", "always_aliases",
    "written_args", "written_nodes", "target_writes", "flagged_writes", "flag_on", "call_writes",
    "opdef_writes", "opdef_may_alias",
    "module_writes_own_state", "writes_state_when_training", "held_norms", "call_argument",
    "state_writes", "state_writes_and_guesses", "hooked_tensors", "hooked_containers", "hooked_generators", "graph_mode", "opaque_code",
    "opaque_holders", "code_class", "writes_known_buffers", "in_place_writers",
    "lasting_write",
]

#: Ops whose result is always a view of their first input.
VIEW_NAMES = frozenset({
    "view", "view_as", "permute", "transpose", "t", "T", "mT", "expand", "expand_as", "squeeze",
    "unsqueeze", "select", "narrow", "diagonal", "as_strided", "movedim", "moveaxis", "swapaxes",
    "swapdims", "unfold", "detach", "alias", "getitem", "__getitem__", "slice", "unflatten",
    "_reshape_alias", "split", "split_with_sizes", "tensor_split", "chunk", "unbind", "real", "imag",
    "view_as_real", "view_as_complex", "hsplit", "vsplit", "dsplit", "unsafe_split", "unsafe_split_with_sizes",
    "unsafe_chunk", "adjoint", "mH",
})
#: Ops whose result may share memory with their first input: views, and ops that
#: return it unchanged when there is nothing to do (no-op casts, reshapes of
#: contiguous tensors, eval-mode dropout).
ALIASING_NAMES = VIEW_NAMES | {
    "reshape", "reshape_as", "flatten", "ravel", "contiguous", "to", "type", "type_as", "float",
    "double", "half", "bfloat16", "int", "long", "bool", "dropout", "identity", "lift_fresh",
    "_to_copy_noop", "align_as", "rename", "refine_names", "coalesce", "resolve_conj", "resolve_neg",
    "conj", "positive", "requires_grad", "data", "cpu", "cuda", "H", "mH", "adjoint", "atleast_1d", "new",
    "atleast_2d", "atleast_3d", "broadcast_to", "broadcast_tensors", "meshgrid", "vsplit", "hsplit",
    "dsplit", "sum_to_size", "to_dense", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
    "feature_alpha_dropout", "feature_dropout", "_unsafe_view", "dequantize", "lift", "unsafe_split",
    "unsafe_split_with_sizes", "unsafe_chunk", "pos", "new", "as_tensor", "asarray", "as_subclass", "einsum",
    # no alias in their schemas, yet their kernels return the input itself: conj_physical
    # of a real tensor, resize_as, slice_inverse (probe O's scan of every aten op)
    "conj_physical", "resize_as", "slice_inverse",
}
#: CompositeImplicitAutograd aten ops (their schema annotates no alias, yet such an
#: op may return its input: ``aten.dropout`` in eval mode) known to return a new
#: tensor. Any other composite op may alias its input.
FRESH_COMPOSITES = frozenset({
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "linear",
    "bilinear", "matmul", "layer_norm", "batch_norm", "group_norm", "instance_norm", "rms_norm",
    "scaled_dot_product_attention", "softmax", "log_softmax", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
    "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "__and__", "__or__", "__xor__", "prelu", "relu6",
    "clip", "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d",
    "upsample_bilinear2d", "upsample_bicubic2d", "upsample_trilinear3d", "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "where", "max", "min", "var", "std", "var_mean",
    "std_mean", "size", "dim", "numel", "sym_size", "sym_numel", "sym_stride",
})
#: Python-level torch functions with no aten op of their name, known to return a
#: new tensor (any other such name may alias).
FRESH_FUNCTIONS = frozenset({
    "interpolate", "upsample", "upsample_nearest", "upsample_bilinear", "normalize", "softmin",
    "multi_head_attention_forward", "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss",
    "binary_cross_entropy_with_logits", "kl_div", "local_response_norm", "tolist", "item",
})
#: ``operator`` functions known to return a new value (``operator.pos`` returns its
#: tensor itself; the in-place ones, ``iadd``..., write it).
FRESH_OPERATORS = frozenset({
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "neg", "abs", "invert", "inv",
    "and", "or", "xor", "lshift", "rshift", "eq", "ne", "lt", "le", "gt", "ge", "not", "truth", "contains",
    "index", "length_hint",
})
#: Ops that may return (a view of) any of their tensor arguments, given as varargs
#: (``broadcast_tensors(a, b)``) or after a non-tensor first one (``einsum("ij->ji", x)``).
ANY_INPUT_ALIASING_NAMES = frozenset({
    "broadcast_tensors", "atleast_1d", "atleast_2d", "atleast_3d", "meshgrid", "einsum",
    "set", "new",  # z.set_(y) and x.new(y) share y's memory
})
#: Ops that make one argument share another's memory (``z.set_(y)``): every
#: argument counts as written (a later write through ``z`` reaches ``y``).
_WRITES_EVERY_ARGUMENT = frozenset({"set"})
#: Modules whose forward may return its input (or a view of it).
ALIASING_MODULES = frozenset({"Identity", "Flatten", "Unflatten", "Dropout", "Dropout1d", "Dropout2d",
                              "Dropout3d", "AlphaDropout", "FeatureAlphaDropout", "QuantStub",
                              "DeQuantStub"})


def op_name(target: Any) -> str:
    """``view`` for ``x.view``, ``torch.Tensor.view``, ``aten.view.default``, ``x.view_``."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1].rstrip("_")
    return (target if isinstance(target, str) else getattr(target, "__name__", "")).rstrip("_")


def _module(node: fx.Node, gm: Any) -> Any:
    try:
        return submodule(gm, node.target)
    except AttributeError:
        return None


def may_alias(node: fx.Node, gm: Any) -> bool:
    """Whether ``node``'s result may share memory with its first input."""
    target = node.target
    if node.op == "call_module":
        module = _module(node, gm)
        return True if module is None else module_effects(module)[2]
    if node.op not in ("call_function", "call_method"):
        return False
    by_schema, aliases = _target_aliasing(target)
    if aliases and op_name(target) == "einsum" and _einsum_operands(node) > 1:
        return False  # a product of two operands is new memory; one operand may be viewed ("ij->ji")
    return aliases or (not by_schema and bool(written_args(node, gm)))


def _einsum_operands(node: fx.Node) -> int:
    """How many tensor operands an einsum node has (given as varargs or as a list)."""
    rest = node.args[1:]
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        rest = rest[0]
    return len(rest)


def may_alias_any_argument(node: fx.Node, gm: Any) -> bool:
    """Whether ``node``'s result may share memory with any of its inputs, not only
    the first: a call whose code nothing here describes (a module or a Python
    function from outside torch, a higher-order op such as ``cond`` or a wrapped
    subgraph) may return whatever it is given (``pick(a, b): return b``), and so may
    the ops of ``ANY_INPUT_ALIASING_NAMES``."""
    op = node.op
    if op == "call_module":
        module = _module(node, gm)
        return module is None or not _torch_module(module)
    if op not in ("call_function", "call_method"):
        return False
    target = node.target
    if isinstance(target, torch._ops.HigherOrderOperator):
        return True
    if op_name(target) in ANY_INPUT_ALIASING_NAMES:
        return True
    if op == "call_method" or isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return False
    return not _from_torch(target)


def _torch_module(module: Any) -> bool:
    """A module class torch defines (its forward is known), or one a registered
    module factory built (``note_built_module``), not one of the input's own; and
    one that runs only torch's code (``_runs_torch_code_only``)."""
    kind = type(module)
    return built_module(module) or (_module_kind(kind).from_torch and _runs_torch_code_only(module))


def _runs_torch_code_only(module: Any) -> bool:
    """Whether every submodule ``module`` may call is a torch class without hooks of
    its own, and no function it holds comes from elsewhere: a torch wrapper runs
    the code it is given (``nn.DataParallel(model)``, ``nn.TransformerEncoder`` of a
    user's layer, ``TransformerEncoderLayer(activation=my_fn)``)."""
    if not module._modules:  # a leaf, the common case: no submodule to walk
        return not _holds_foreign_function(module)
    for m in module.modules():
        kind = type(m)
        if m is not module and (not built_module(m) and not _module_kind(kind).from_torch
                                or m._forward_hooks or m._forward_pre_hooks):
            return False
        if _holds_foreign_function(m):
            return False
    return True


def _holds_foreign_function(module: Any) -> bool:
    """A function from outside torch among ``module``'s attributes (most hold none
    that can be called: one pass at C speed says so)."""
    values = module.__dict__.values()
    if not any(map(callable, values)):
        return False
    return any(callable(value) and not isinstance(value, (torch.nn.Module, torch.Tensor, type))
               and not _torch_function(value) for value in values)


def _module_setting(module: Any, name: str, default: Any) -> Any:
    """``getattr(module, name, default)`` without ``Module.__getattr__``'s raised
    AttributeError for the usual answer, an attribute the module does not have
    (``inplace`` of a convolution)."""
    own = module.__dict__
    found = own.get(name, _ABSENT)
    if found is not _ABSENT:
        return found
    if hasattr(type(module), name) or name in own.get("_parameters", ()) or name in own.get("_buffers", ()) \
            or name in own.get("_modules", ()):
        return getattr(module, name)
    return default


_ABSENT = object()


def _torch_function(fn: Any) -> bool:
    """A function torch (or Python's ``operator``/``math``) defines."""
    fn = getattr(fn, "func", fn)  # functools.partial
    module = getattr(fn, "__module__", None)
    return isinstance(module, str) and (module == "torch" or module.startswith("torch.")
                                        or module in ("math", "_operator", "operator"))


#: the modules registered module factories built (and the library's copies of them)
_BUILT_MODULES: "weakref.WeakSet" = weakref.WeakSet()
#: the classes of those the library's own factories built (an int8 conv, an observer)
_LIBRARY_BUILT_TYPES: set = set()


def note_built_module(module: Any, by_library: bool = False) -> None:
    """A replacement inserted ``module``, built by a registered module factory
    (``rewrite.register_module``): it computes fresh memory from its inputs, as the
    factory's contract says, unless it is named in ``ALIASING_MODULES``, is an
    observer or is ``inplace``. A user's factory vouches for the instance, not its
    class: another module of that class in a later model (a user's own pass-through
    ``Gate``) is not vouched for. The library's own factories (``by_library``)
    vouch for the class: what it builds is known, and a saved and loaded or
    deep-copied int8 model keeps its rewrites."""
    _BUILT_MODULES.add(module)
    if by_library:
        _LIBRARY_BUILT_TYPES.add(type(module))


def built_module(module: Any) -> bool:
    """``module`` is one ``note_built_module`` was told of, or of a class the
    library's own factories build."""
    if type(module) in _LIBRARY_BUILT_TYPES:
        return True
    try:
        return module in _BUILT_MODULES
    except TypeError:  # an unhashable module class
        return False


def _target_aliasing(target: Any) -> tuple:
    """(answered by a schema, may alias) for a call target, cached by identity: an
    alias walk asks it for every reader of a value (an OpOverload hashes in Python)."""
    key = target if isinstance(target, str) else id(target)
    entry = _ALIASING.get(key)
    if entry is not None and (entry[0] is target or isinstance(target, str)):
        return entry[1]
    if isinstance(target, torch._ops.OpOverload):
        answer = (True, _overload_may_alias(target))
    elif isinstance(target, torch._ops.OpOverloadPacket):  # torch.ops.mylib.f(x): any overload's schema
        answer = (True, any(_overload_may_alias(ov) for ov in _overloads(target)))
    elif isinstance(target, torch._ops.HigherOrderOperator):
        answer = (False, True)  # runs a subgraph, which may return what it is given
    else:
        answer = (False, _python_may_alias(target))
    if len(_ALIASING) > _CACHE_LIMIT:
        _ALIASING.clear()
    _ALIASING[key] = (target, answer)
    return answer


_CACHE_LIMIT = 4096  # distinct call targets remembered (functions of many traced graphs)
_ALIASING: dict = {}  # target (id, or a method name) -> (target, (by schema, may alias))
_WRITES: dict = {}  # id(target) -> (target, target_writes(target))


def _overload_may_alias(overload: Any) -> bool:
    """By its schema's alias annotation; a CompositeImplicitAutograd op without one
    runs Python-level code that may return its input, unless known not to. A few
    ops return their input with no annotation saying so (``_unsafe_view``,
    ``dequantize`` of a float tensor, ``lift``): ``ALIASING_NAMES``."""
    if any(r.alias_info is not None for r in overload._schema.returns):
        return True
    name = op_name(overload)
    if name in ALIASING_NAMES:
        return True
    if name in FRESH_COMPOSITES:
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(overload.name(), "CompositeImplicitAutograd")
    except RuntimeError:  # a TorchScript overload on Python scalars (aten::add.int): no tensor
        return False


def _python_may_alias(target: Any) -> bool:
    """A Python-level call target (a torch function, a ``Tensor`` method or its
    name, an ``operator`` function): by the name lists, else by the aten op of the
    same name (any of its overloads). A name no aten op has is unknown, and a
    function from outside torch (``getattr(x, "T")``, a wrapped user function) may
    return anything it is given: both may alias."""
    if target is operator.getitem or not _from_torch(target):
        return True
    name = op_name(target)
    if name in ALIASING_NAMES:
        return True
    if name in FRESH_COMPOSITES or name in FRESH_FUNCTIONS:
        return False
    if not isinstance(target, str) and getattr(operator, getattr(target, "__name__", ""), None) is target:
        return name not in FRESH_OPERATORS
    from rewrite.ops.resolve import aten_packet  # imported late, as in _named_written

    packet = aten_packet(name)
    return packet is None or any(_overload_may_alias(ov) for ov in _overloads(packet))


def _from_torch(target: Any) -> bool:
    """A torch function or method, or an ``operator``/``math`` function."""
    name = getattr(target, "__name__", "")
    if getattr(operator, name, None) is target:
        return True
    module = getattr(target, "__module__", None) or "torch"  # method descriptors have none
    return module == "torch" or module.startswith("torch.") or module == "math"


def _overloads(packet: Any) -> list:
    """The overloads a call of ``packet`` may dispatch to (a call never picks ``out=``)."""
    found = (getattr(packet, name) for name in packet.overloads())
    return [ov for ov in found if not any(a.is_out for a in ov._schema.arguments)]


def always_aliases(node: fx.Node, gm: Any) -> bool:
    """Whether ``node``'s result is always (a view of) its first input: views, and
    in-place ops (which return the tensor they wrote)."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    if node.op == "call_module":
        return bool(getattr(_module(node, gm), "inplace", False))
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return by_identity(_RETURNS_INPUT, target, _returns_input)
    return op_name(target) in VIEW_NAMES or target is operator.getitem or 0 in written_args(node, gm)


_RETURNS_INPUT: dict = {}  # id(overload) -> (overload, _returns_input(overload))


def _returns_input(overload: Any) -> bool:
    # ``Tensor(a)`` in a schema means *may* alias (``aten.to.dtype`` copies when
    # the dtype changes): only views and in-place ops certainly do. Read once per
    # overload: a schema's ``returns`` builds its argument objects on every read.
    returns = overload._schema.returns
    info = returns[0].alias_info if returns else None
    return info is not None and (info.is_write or op_name(overload) in VIEW_NAMES)


def schema_returns_alias(target: Any) -> bool:
    """Whether an op's schema says a result may share memory with an argument
    (``Tensor(a) -> Tensor(a)``, ``-> (Tensor, Tensor(a))``), for an overload or, at
    the fx level, any overload of a packet: what a custom op declares, whatever its
    name."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        return any(schema_returns_alias(getattr(target, name)) for name in target.overloads())
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return by_identity(_RETURNS_ALIAS, target, _some_return_aliases)


_RETURNS_ALIAS: dict = {}  # id(overload) -> (overload, _some_return_aliases(overload))


def _some_return_aliases(overload: Any) -> bool:
    return any(r.alias_info is not None for r in overload._schema.returns)


_INPLACE_OPERATORS = frozenset(
    name for name in dir(operator)
    if name.startswith("i") and name not in ("index", "indexOf", "invert", "is_", "is_not", "is_none",
                                             "is_not_none", "itemgetter")
)


@functools.lru_cache(maxsize=None)
def _schema_written(overload: Any) -> tuple:
    """(position, name) of the arguments an aten overload writes (``Tensor(a!)``,
    ``out=`` arguments included)."""
    return tuple((i, "input" if a.name == "self" else a.name)
                 for i, a in enumerate(overload._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


@functools.lru_cache(maxsize=None)
def _named_written(name: str) -> tuple:
    """Written arguments of a torch function or ``Tensor`` method called ``name``:
    those of the aten op of the same name, whatever the name
    (``torch.fused_moving_avg_obs_fake_quant`` writes its observer's state); a
    trailing underscore (torch's naming for in-place ops) without a schema writes
    its first argument."""
    from rewrite.ops.resolve import aten_overload

    if name in ("__setitem__", "__delitem__") or (name.startswith("__i") and name.endswith("__")
                                                 and getattr(operator, name, None) is not None):
        return ((0, "input"),)  # x[i] = v; x.__iadd__(y)
    if not name or name.endswith("__"):  # __call__ is no op
        return ()
    overload = aten_overload(name)
    written = _schema_written(overload) if overload is not None else ()
    if not name.endswith("_"):  # _foreach_add_ writes
        return written
    return written or ((0, "input"),)


def target_writes(target: Any) -> tuple:
    """(position, name) of the arguments a call target writes in place. ``target``
    is an aten overload, a torch function, an ``operator`` function, a method
    descriptor (``torch.Tensor.add_``) or a method name (``"add_"``)."""
    if isinstance(target, str):
        return _named_written(target) + tuple(w for w in _always_written(target) if w not in _named_written(target))
    entry = _WRITES.get(id(target))
    if entry is not None and entry[0] is target:
        return entry[1]
    if len(_WRITES) > _CACHE_LIMIT:
        _WRITES.clear()
    written = _target_writes(target)
    written += tuple(w for w in _always_written(target) if w not in written)
    _WRITES[id(target)] = (target, written)
    return written


def _always_written(target: Any) -> tuple:
    """(position, name) of the arguments a target always writes though its schema
    does not say so (``_ALWAYS_WRITES``: ``batch_norm_update_stats`` updates its
    running statistics)."""
    name = target if isinstance(target, str) else op_name(target) if isinstance(
        target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) else getattr(target, "__name__", "")
    if name not in _ALWAYS_WRITES:
        return ()
    written = _FLAGGED_WRITES[name][0]
    if isinstance(target, str):
        from rewrite.ops.resolve import aten_overload

        target = aten_overload(target)
    params = _parameters(target) if target is not None else None
    if params is None:
        return ()
    names = list(params)
    return tuple((names.index(p), "input" if p == "self" else p) for p in written if p in params)


def _target_writes(target: Any) -> tuple:
    if isinstance(target, torch._ops.OpOverload):
        return _schema_written(target)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return tuple(dict.fromkeys(w for ov in _overloads(target) for w in _schema_written(ov)))
    name = getattr(target, "__name__", "")
    if getattr(operator, name, None) is target:
        return ((0, "input"),) if name in _INPLACE_OPERATORS or name in ("setitem", "delitem") else ()
    return _named_written(name)


def written_args(node: fx.Node, gm: Any) -> tuple:
    """Positions of ``node.args`` (and keyword names) the node writes in place:
    ``x.relu_()``, ``x += y``, ``F.relu(x, inplace=True)`` (or ``F.relu(x, True)``),
    ``nn.ReLU(inplace=True)``, ``aten.add_.Tensor``, ``torch.nn.init.normal_(tensor=x)``,
    a training-mode ``batch_norm`` (running statistics: ``flagged_writes``). A call
    whose code nothing here describes may write every argument it is given: a
    higher-order op (``wrap_with_set_grad_enabled`` runs a subgraph), a Python
    function from outside torch (``fx.wrap``), a module of the model's own, a
    container or a module with hooks."""
    op = node.op
    if op == "call_module":
        module = _module(node, gm)
        if module is None or _module_writes_arguments(module):
            return _every_argument(node)
        return _first_argument(node) if _module_setting(module, "inplace", False) else ()
    if op not in ("call_function", "call_method"):
        return ()
    target = node.target
    kwargs = node.kwargs  # a property: read once
    if op == "call_function":
        if _opaque_call(target):
            return _every_argument(node)
        if _inplace_flag(node):
            return _first_argument(node)
    elif kwargs:
        flag = kwargs.get("inplace")
        if flag is not None and flag is not False:
            return _first_argument(node)
    written = target_writes(target)
    if written and op_name(target) in _WRITES_EVERY_ARGUMENT:
        return _every_argument(node)
    flagged = flagged_writes(target) if op == "call_function" else None
    if not written and not kwargs and flagged is None:
        return ()
    out = []
    if flagged is not None and flag_on(node, flagged):  # batch_norm(training=True): running statistics
        for position, name in flagged[0]:
            value = call_argument(node, position, name, None)
            key = position if position < len(node.args) else name
            if value is not None and key not in out:
                out.append(key)
    for position, name in written:
        if position < len(node.args):
            out.append(position)
        elif kwargs:
            key = next((k for k in _keyword_names(target, position, name) if k in kwargs), None)
            if key is not None:
                out.append(key)
    out = list(dict.fromkeys(out))
    if kwargs and kwargs.get("out") is not None and "out" not in out:  # torch.add(x, y, out=z) writes z
        out.append("out")
    return tuple(out)


def call_writes(target: Any) -> str:
    """How a call_function of ``target`` may write an argument, whatever the node:
    ``"never"`` (no schema write, no flag, no ``inplace`` parameter, known code: only
    an ``out=`` keyword could), ``"flag"`` (only through its ``flagged_writes`` flag:
    ``aten.batch_norm``), or ``"node"`` (ask ``written_args`` of each node).
    Worked out once per target: ``graph_writes`` asks it of every target of a graph."""
    return by_identity(_CALL_WRITES, target, _call_writes)


_CALL_WRITES: dict = {}  # id(target) -> (target, call_writes(target))


def _call_writes(target: Any) -> str:
    if target_writes(target) or _opaque_call(target):
        return "node"
    if isinstance(target, torch._ops.OpOverload):
        takes_inplace = any(a.name == "inplace" for a in target._schema.arguments)
    elif isinstance(target, torch._ops.OpOverloadPacket):
        takes_inplace = any(a.name == "inplace" for ov in _overloads(target) for a in ov._schema.arguments)
    else:
        takes_inplace = _inplace_position(target) is not None
    if takes_inplace:
        return "node"
    return "flag" if flagged_writes(target) is not None else "never"


def _every_argument(node: fx.Node) -> tuple:
    return tuple(range(len(node.args))) + tuple(node.kwargs)


def _first_argument(node: fx.Node) -> tuple:
    """The position (or keyword) of a call's first argument: ``F.relu(input=x,
    inplace=True)`` writes ``input``."""
    if node.args:
        return (0,)
    kwargs = node.kwargs
    for key in ("input", "self", "tensor"):
        if key in kwargs:
            return (key,)
    return tuple(kwargs)[:1]


def _opaque_call(target: Any) -> bool:
    """A call_function target whose code nothing here describes: a higher-order op
    (it runs a subgraph) or a Python function from outside torch."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return False
    builtin = getattr(target, "__module__", None) == "builtins"
    if builtin and getattr(target, "__name__", "") not in _WRITING_BUILTINS:
        return False  # getattr(x, "T"), len(x): Python's own read what they are given
    return isinstance(target, torch._ops.HigherOrderOperator) or not _from_torch(target)


#: Python builtins that change what they are given (``setattr(x, "data", y)``).
_WRITING_BUILTINS = frozenset({"setattr", "delattr", "exec", "eval"})


def _module_writes_arguments(module: Any) -> bool:
    """Calling ``module`` may write what it is given beyond what its ``inplace``
    says: a hook (or a global one) may do anything, a container runs modules that
    may be in place, a module of the model's own runs code nothing describes."""
    return module_effects(module)[1]


def _keyword_names(target: Any, position: int, name: str) -> tuple:
    """The keywords a call may pass the parameter at ``position`` by: the schema's
    name (``self`` read as ``input``, both accepted) and the Python target's own
    (``torch.nn.init.normal_(tensor=x)``, ``torch._foreach_add_(self=[x])``)."""
    names = (name, "self") if name == "input" else (name,)
    params = by_identity(_PARAMETERS, target, _parameters) if not isinstance(target, str) else None
    if params is not None and position < len(params):
        own = list(params)[position]
        if own not in names:
            names += (own,)
    return names


_PARAMETERS: dict = {}  # id(target) -> (target, _parameters(target))


def written_nodes(node: fx.Node, gm: Any) -> list:
    """The nodes whose tensors ``node`` writes (``written_args``; every node of a
    written argument: ``out=(values, indices)`` writes both)."""
    positions = written_args(node, gm)
    if not positions:
        return []
    found: list = []
    for position in positions:
        value = node.args[position] if isinstance(position, int) else node.kwargs.get(position)
        fx.node.map_arg(value, found.append)
    return found


def opdef_writes(opdef: Any) -> tuple:
    """``(param, flag)`` pairs: the parameters the op, as a replacement emits it,
    writes in place; ``flag`` names a parameter that must be true for the write to
    happen (``batch_norm`` writes its running statistics only when ``training``),
    or is None. Canonical ops emit their functional form: what their entry's
    ``writes`` says. A qualified name emits exactly its target: what its schema
    says (``aten.mul_.Scalar`` writes ``input``)."""
    out: dict = {}
    if not opdef.qualified:
        out.update(dict(opdef.writes))
    else:
        for form in opdef.forms:
            target = _form_target(form)
            if target is None:
                continue
            rename = getattr(form, "rename", {}) or {}
            for _, name in target_writes(target):
                out.setdefault(rename.get(name, name), None)
    params = set(opdef.param_names)
    for part in opdef.name.split("."):
        written, flag = _FLAGGED_WRITES.get(part, ((), None))
        for name in written:
            if name in params and (flag is None or flag in params):
                out.setdefault(name, flag)
    if "out" in params:  # an out= argument is written whatever the op
        out.setdefault("out", None)
    return tuple(out.items())


#: Ops that write an argument their schema does not annotate: (written parameters,
#: the parameter that must be true (not None, not False) for the write, or None).
_FLAGGED_WRITES = {
    name: (("running_mean", "running_var"), "training")
    for name in ("batch_norm", "native_batch_norm", "_native_batch_norm_legit", "_batch_norm_impl_index",
                 "_batch_norm_with_update", "cudnn_batch_norm", "miopen_batch_norm")
} | {
    "instance_norm": (("running_mean", "running_var"), "use_input_stats"),
    "embedding": (("weight",), "max_norm"),  # renormalizes the rows it reads
    "embedding_bag": (("weight",), "max_norm"),
    "backward": (("self", "tensors", "input"), None),  # accumulates into the leaves' .grad
    "batch_norm_update_stats": (("running_mean", "running_var"), None),
}
#: of those, the ones a graph's call of writes whatever its arguments
_ALWAYS_WRITES = frozenset({"batch_norm_update_stats"})


def flagged_writes(target: Any) -> "tuple | None":
    """For a call target that writes arguments its schema does not annotate
    (``_FLAGGED_WRITES``: ``aten.batch_norm``, ``F.batch_norm``, ``F.instance_norm``,
    ``F.embedding``): ``(((position, name), ...), (flag position, flag name, flag
    default))``, the written parameters and the flag that must be neither False nor
    None for the write; None for every other target. Positions come from the
    target's own signature (``F.batch_norm`` takes the statistics second, the aten
    op fourth)."""
    return by_identity(_FLAGGED, target, _flagged_writes)


def flag_on(node: fx.Node, flagged: tuple) -> bool:
    """Whether ``node``'s flag (``flagged_writes``) is neither False nor None: a
    value the graph computes counts as set."""
    _, (position, name, default) = flagged
    args = node._args  # the property's tuple, without the property call: once per batch_norm per apply
    value = args[position] if position < len(args) else node._kwargs.get(name, default)
    return value is not False and value is not None


_FLAGGED: dict = {}  # id(target) -> (target, flagged_writes(target))


def _flagged_writes(target: Any) -> "tuple | None":
    name = op_name(target) if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) \
        else getattr(target, "__name__", "")
    written, flag = _FLAGGED_WRITES.get(name, ((), None))
    if flag is None:
        return None
    params = _parameters(target)
    if params is None or flag not in params:
        return None
    names = list(params)
    found = tuple((names.index(p), p) for p in written if p in params)
    return (found, (names.index(flag), flag, params[flag])) if found else None


def _parameters(target: Any) -> "dict | None":
    """Parameter name -> default (``inspect.Parameter.empty`` when required) of a
    call target: an aten overload's schema, a Python function's signature, or a
    builtin's aten op of the same name."""
    import inspect

    from rewrite.ops.resolve import aten_overload

    if isinstance(target, torch._ops.OpOverloadPacket):
        overloads = _overloads(target)
        target = overloads[0] if overloads else None
    if not isinstance(target, torch._ops.OpOverload):
        try:
            return {p.name: p.default for p in inspect.signature(target).parameters.values()}
        except (TypeError, ValueError):
            target = aten_overload(getattr(target, "__name__", ""))
    if target is None:
        return None
    return {a.name: (a.default_value if a.has_default_value() else inspect.Parameter.empty)
            for a in target._schema.arguments}


def _form_target(form: Any) -> Any:
    """The call target of a surface form (a method form: its name; a getitem form:
    the multi-output op it reads), or None for modules."""
    for attr in ("inner_target", "target", "method"):
        target = getattr(form, attr, None)
        if target is not None:
            return target
    return None


def opdef_may_alias(opdef: Any) -> bool:
    """Whether a value the op, as a replacement emits it, returns may share memory
    with one of its arguments. Canonical ops: by name (their in-place twins are
    surfaces to match, never emitted); qualified names: by their targets."""
    if opdef_writes(opdef):
        return True
    if not opdef.qualified:
        return opdef.name in ALIASING_NAMES
    for form in opdef.forms:
        target = _form_target(form)
        if isinstance(target, torch._ops.OpOverload):
            if _overload_may_alias(target):  # what the engine asks of a graph's node, too
                return True
        elif target is None or op_name(target) in ALIASING_NAMES or target is operator.getitem:
            return True
    return False


# Module types whose forward writes nothing but its input (``inplace=True``), with
# the exceptions ``module_writes_own_state`` lists: torch's own leaf modules.
_TORCH_MODULES = "torch.nn.modules."


def module_writes_own_state(module: Any) -> bool:
    """Whether calling ``module`` may write its own parameters or buffers: BatchNorm
    and InstanceNorm updating running statistics (training mode), an embedding
    renormalizing rows (``max_norm``), a module with forward hooks, and any module
    that is not one of torch's own leaf modules (a user module, an observer, a
    container, an RNN, a lazy module)."""
    return module_effects(module)[0]


def module_effects(module: Any) -> "tuple[bool, bool, bool]":
    """(``module_writes_own_state``, ``_module_writes_arguments``, whether its result
    may share memory with its input) of a call of ``module``, read at one look: a
    graph walk (``state_writes``) asks all three of every ``call_module`` node."""
    # a hook may do anything (the old spectral_norm updates a buffer)
    hooked = bool(module._forward_hooks or module._forward_pre_hooks or _global_hooks())
    cls = type(module)
    kind = _module_kind(cls)
    code_only = _runs_torch_code_only(module)
    torch_module = built_module(module) or (kind.from_torch and code_only)
    if hooked or not kind.plain_leaf or not code_only:
        own = True
    elif kind.norm:
        own = bool(module.training and module.track_running_stats)
    else:  # a torch module holding a norm (``TransformerEncoder(..., norm=BatchNorm1d(n))``) writes its statistics
        own = _module_setting(module, "max_norm", None) is not None or bool(
            module._modules and any(m.training for m in held_norms(module)))
    aliasing = kind.aliasing or bool(_module_setting(module, "inplace", False)) or not torch_module
    return own, hooked or not torch_module or kind.container, aliasing


class _ModuleKind(NamedTuple):
    """What a module's class tells of its calls, whatever the instance."""

    from_torch: bool  # torch defines it
    plain_leaf: bool  # one of torch's leaf modules (no lazy, RNN or container)
    container: bool  # Sequential, ModuleList, ModuleDict: runs the modules it holds
    norm: bool  # batch or instance norm: running statistics
    aliasing: bool  # may return its input (``ALIASING_MODULES``, an observer)


def _module_kind(kind: type) -> _ModuleKind:
    """Read once per class as it stands (a symbolic_trace graph asks per
    ``call_module`` node; a class patched since, ``MyLayer.forward = ...``, is read
    again)."""
    return _module_kind_of(kind, _user_class_body(kind))


@functools.lru_cache(maxsize=1024)
def _module_kind_of(kind: type, body: tuple) -> _ModuleKind:
    from torch.ao.quantization.observer import ObserverBase

    code = code_class(kind)
    where = code.__module__ or ""
    container = issubclass(kind, (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict))
    special = container or issubclass(kind, (torch.nn.modules.lazy.LazyModuleMixin, torch.nn.RNNBase))
    return _ModuleKind(where.startswith("torch."), where.startswith(_TORCH_MODULES) and not special, container,
                       issubclass(kind, torch.nn.modules.batchnorm._NormBase),
                       code.__name__ in ALIASING_MODULES or issubclass(kind, ObserverBase))


def code_class(kind: type) -> type:
    """The class whose code a call of a ``kind`` module runs: ``kind`` itself, or,
    for a user's subclass of a torch module that adds nothing that runs but its own
    ``__init__`` and plain class data (``class MyLayer(nn.TransformerEncoderLayer):
    pass``), the torch class it derives from: its forward is torch's, and so are its
    effects. What its ``__init__`` sets is the instance's (a foreign function, a
    hook, a user's submodule), which the instance checks see."""
    return _code_class_of(kind, _user_class_body(kind))


@functools.lru_cache(maxsize=1024)
def _code_class_of(kind: type, body: tuple) -> type:
    for base in kind.__mro__:
        if (base.__module__ or "").startswith("torch."):
            return base
        if not all(name in _CLASS_BOOKKEEPING or not (callable(value) or hasattr(type(value), "__get__"))
                   for name, value in vars(base).items()):
            return kind
    return kind


def _user_class_body(kind: type) -> tuple:
    """What the classes of ``kind``'s MRO before torch's hold, by identity: the key
    of the cached answers, so a class changed after a first answer is read again."""
    body: list = []
    for base in kind.__mro__:
        if (base.__module__ or "").startswith("torch."):
            break
        body.extend(map(_Held, vars(base).values()))
    return tuple(body)


class _Held:
    """A class-body value in a cache key: equal only to itself, and held, so its id
    cannot pass to a new function while the key lives; a function with the code it
    has now (IPython's autoreload swaps ``__code__``)."""

    __slots__ = ("value", "code")

    def __init__(self, value: Any) -> None:
        self.value = value
        self.code = getattr(getattr(value, "__func__", value), "__code__", None)

    def __hash__(self) -> int:
        return hash((id(self.value), id(self.code)))

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Held) and other.value is self.value and other.code is self.code


#: what every class body holds, or may hold without changing what a call runs
_CLASS_BOOKKEEPING = frozenset({"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__",
                                "__init__", "__firstlineno__", "__static_attributes__", "__orig_bases__",
                                "__parameters__", "__annotate__"})


#: dropout spellings, and where their "drop" flag sits: (position, keyword, default)
_DROPOUTS = {"dropout": (2, "train", None), "native_dropout": (2, "train", None),
             "feature_dropout": (2, "train", None), "alpha_dropout": (2, "train", None),
             "feature_alpha_dropout": (2, "train", None), "dropout1d": (2, "training", True),
             "dropout2d": (2, "training", True), "dropout3d": (2, "training", True)}


def graph_trains(gm: Any) -> bool:
    """Whether ``gm``'s graph is known to run in training mode (``graph_mode``)."""
    return graph_mode(gm) is True


def graph_mode(gm: Any) -> bool | None:
    """True when ``gm``'s graph runs in training mode: a batch norm updating running
    statistics, a dropout that drops (``F.dropout``'s ``training`` defaults to True,
    aten's ``train`` is given), or a torch BatchNorm or Dropout module in training
    mode. A batch norm without running statistics (``track_running_stats=False``)
    uses batch statistics in eval mode too: it counts when its weight or bias
    requires grad and no batch norm with running statistics says eval mode.
    False when one says eval mode (a batch norm using its running statistics, a
    dropout whose flag is literally False); None when nothing tells (an MLP
    ``torch.export`` captured, whose module is always in training mode)."""
    statless_trained = eval_seen = False
    for op, target, nodes in nodes_by_target(gm.graph):
        if op == "call_module":
            for node in nodes:
                module = _module(node, gm)
                if module is not None and any(_trains(m) for m in module.modules()):
                    return True
                eval_seen = eval_seen or (module is not None and any(_evaluates(m) for m in module.modules()))
            continue
        if op != "call_function":
            continue
        name = op_name(target) if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) \
            else getattr(target, "__name__", "")
        if "batch_norm" in name and "no_training" in name:
            eval_seen = True
        elif "batch_norm" in name:
            flagged = flagged_writes(target)
            if flagged is None:
                continue
            position, keyword = flagged[0][0]  # the running mean
            for n in nodes:
                stats = call_argument(n, position, keyword, None) is not None
                if flag_on(n, flagged):
                    if stats:  # batch statistics with running ones to update
                        return True
                    statless_trained = statless_trained or _reads_trainable_state(n, gm)
                elif stats:
                    eval_seen = True
        elif name in _DROPOUTS:
            position, keyword, default = _DROPOUTS[name]
            if name == "dropout" and not isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
                position, keyword, default = 2, "training", True  # F.dropout
            flags = [call_argument(n, position, keyword, default) for n in nodes]
            if any(flag not in (False, None) for flag in flags):
                return True
            eval_seen = eval_seen or any(flag is False for flag in flags)
    if statless_trained and not eval_seen:
        return True
    return False if eval_seen else None


def _reads_trainable_state(node: fx.Node, gm: Any) -> bool:
    """``node`` reads a module tensor that requires grad (a batch norm's weight)."""
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            value = _attr(gm, arg.target)
            if isinstance(value, torch.Tensor) and value.requires_grad:
                return True
    return False


def _evaluates(module: Any) -> bool:
    """A torch dropout or batch norm (with running statistics) in eval mode."""
    if module.training:
        return False
    if isinstance(module, torch.nn.modules.dropout._DropoutNd):
        return True
    return isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.track_running_stats


def _trains(module: Any) -> bool:
    """A torch module (or one inside a torch leaf module: a transformer layer's)
    that behaves as in training: a dropout that drops, a batch norm updating
    running statistics, attention with dropout."""
    if not module.training:
        return False
    if isinstance(module, torch.nn.modules.dropout._DropoutNd):
        return True
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
        return module.track_running_stats
    return isinstance(module, torch.nn.MultiheadAttention) and module.dropout > 0


def writes_state_when_training(module: Any) -> bool:
    """Whether a call of ``module`` writes its buffers in training mode only: a torch
    batch norm or instance norm that tracks running statistics. Its ``training``
    flag is the module's own, which a caller may flip after any analysis."""
    return isinstance(module, torch.nn.modules.batchnorm._NormBase) and bool(module.track_running_stats)


def held_norms(module: Any) -> list:
    """The batch and instance norms tracking running statistics among the modules
    ``module`` holds (itself excluded): a torch module that runs them writes their
    statistics in training mode."""
    if not module._modules:
        return []
    return [m for m in module.modules() if m is not module and writes_state_when_training(m)]


def module_written_state(module: Any) -> list:
    """The tensors of a module that writes its own state (``module_writes_own_state``)
    it may write: a hook-free torch BatchNorm or InstanceNorm its buffers (running
    statistics, the batch counter), not its weight and bias, which stay the caller's
    (gradients of the result reach them); so for the library's own modules that say
    so (``WRITES_BUFFERS_ONLY``: the QAT layers and fake quantizers); every other
    module all of them."""
    known = _known_buffer_writes(module)
    return known if known is not None else [*module.parameters(), *module.buffers()]


def writes_known_buffers(module: Any) -> bool:
    """Whether a call of ``module`` runs code known to write only its buffers (or
    its norms'), never its weights, nor return them: torch's norms, torch's weight
    reparametrizations, the library's own modules that say so."""
    return _known_buffer_writes(module) is not None


def _known_buffer_writes(module: Any) -> "list | None":
    if isinstance(module, torch.nn.modules.batchnorm._NormBase) and code_class(type(module)).__module__.startswith(
            _TORCH_MODULES) and not (module._forward_hooks or module._forward_pre_hooks or _global_hooks()) \
            and _runs_torch_code_only(module):
        return list(module.buffers())
    if _reparametrized_by_torch(module):
        return list(module.buffers())
    if _writes_buffers_only(module):
        return list(module.buffers())  # the library's own (a QAT layer): statistics and ranges, not its weights
    kind = _module_kind(type(module))
    if kind.plain_leaf and not kind.norm and not (module._forward_hooks or module._forward_pre_hooks
                                                  or _global_hooks()) and _runs_torch_code_only(module) \
            and _module_setting(module, "max_norm", None) is None:
        # torch's code writes only the statistics of the norms it holds: not the weights
        return [t for m in held_norms(module) for t in m.buffers()]
    return None


def _writes_buffers_only(module: Any) -> bool:
    """A module of the library's own that declares its calls write its buffers only
    (``WRITES_BUFFERS_ONLY``: the QAT layers and fake quantizers), without hooks."""
    return bool(getattr(type(module), "WRITES_BUFFERS_ONLY", False)) \
        and type(module).__module__.startswith("rewrite.") \
        and not (module._forward_hooks or module._forward_pre_hooks or _global_hooks())


#: torch's weight reparametrizations, by hook (the deprecated ``nn.utils.weight_norm``
#: and ``spectral_norm``) or by ``nn.utils.parametrize``: they compute the weight from
#: parameters they only read, and update buffers (spectral norm's power iteration)
_REPARAMETRIZING = ("torch.nn.utils.weight_norm", "torch.nn.utils.spectral_norm", "torch.nn.utils.parametrize",
                    "torch.nn.utils.parametrizations", "torch.nn.modules.container")


def _reparametrized_by_torch(module: Any) -> bool:
    """A torch module whose weight torch's own weight or spectral norm computes, and
    nothing else runs around it: its forward writes buffers only."""
    from torch.nn.utils import parametrize

    kind = type(module)
    if parametrize.is_parametrized(module):
        if not all(type(m).__module__ in _REPARAMETRIZING for m in module.parametrizations.modules()):
            return False
        kind = kind.__bases__[0]
    elif not module._forward_pre_hooks:
        return False
    if module._forward_hooks or _global_hooks() or not kind.__module__.startswith(_TORCH_MODULES):
        return False
    return all(type(hook).__module__ in _REPARAMETRIZING for hook in module._forward_pre_hooks.values())


# Hooks torch.export puts on ``ep.module()``: input checks, no writes.
_HARMLESS_HOOK_MODULES = frozenset({"torch.export._unlift"})


def _global_hooks() -> bool:
    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


def _call_writes_all(node: fx.Node) -> bool:
    """Calls that may write their arguments without a schema saying so: batch and
    instance norm updating running statistics (``training`` / ``use_input_stats``
    not literally False), ``F.embedding`` renormalizing rows (``max_norm``), an
    ``out=``, higher-order ops (``cond``, ``while_loop``: their subgraphs), and
    Python functions from outside torch."""
    target = node.target
    if node.op != "call_function":
        return False
    if "out" not in node.kwargs and flagged_writes(target) is not None:
        return False  # ``written_args`` names what it writes: a train-mode batch norm its statistics
    if isinstance(target, torch._ops.OpOverload):  # the common case first, cheaply
        name = target._name  # "aten::batch_norm"
        if "out" in node.kwargs:
            return True
    elif getattr(operator, getattr(target, "__name__", ""), None) is target:
        return False
    elif "out" in node.kwargs or isinstance(target, torch._ops.HigherOrderOperator):
        return True  # a higher-order op runs subgraphs, which may write anything they get
    elif isinstance(target, torch._ops.OpOverloadPacket):
        name = target._qualified_op_name
    else:
        name = getattr(target, "__name__", "")
        if not _from_torch(target):
            return True
        if "embedding" in name:
            return call_argument(node, 3, "max_norm", None) is not None
    if "no_training" in name:
        return False
    if "batch_norm" in name:
        return call_argument(node, 5, "training", False) is not False
    if "instance_norm" in name:
        return call_argument(node, 5, "use_input_stats", True) is not False
    return False


def call_argument(node: fx.Node, position: int, keyword: str, default: Any) -> Any:
    """A call node's argument, given by position or keyword, or its default."""
    if position < len(node.args):
        return node.args[position]
    return node.kwargs.get(keyword, default)


def _inplace_flag(node: fx.Node) -> bool:
    """``F.relu(x, True)``: a Python function's ``inplace`` parameter given a value
    that is not literally False (aten overloads and operators have none)."""
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return False
    position = _inplace_position(target)
    if position is None:
        return False
    value = node.kwargs.get("inplace", node.args[position] if position < len(node.args) else False)
    return value is not False


@functools.lru_cache(maxsize=None)
def _inplace_position(target: Any) -> "int | None":
    """The position of a function's ``inplace`` parameter, or None."""
    import inspect

    try:
        params = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return None
    return params.index("inplace") if "inplace" in params else None


def state_writes(gm: Any) -> "frozenset[int] | None":
    """The ids of the parameters and buffers running ``gm`` may write in place, or
    None when that is unknown (a call whose effects no schema or name list tells).
    (``state_writes_and_guesses``: which of them only a guess says it writes.)"""
    return state_writes_and_guesses(gm)[0]


def state_writes_and_guesses(gm: Any) -> "tuple[frozenset[int] | None, frozenset[int]]":
    """``state_writes``, and the ids among its answer that only code nothing here
    reads may write (a user's leaf module, a hook, a ``torch.fx.wrap``'d function, a
    call given a module, a higher-order op): the others a graph op, a schema or
    torch's own module code surely may write (``w.add_(1)``, an ``Embedding`` with
    ``max_norm``, a training batch norm).

    A value may alias the state tensors its get_attr reads and, through ops that may
    return (a view of) an argument, the state its arguments alias; a node that writes
    an argument may write every state tensor that argument aliases; a module that
    writes its own state (``module_writes_own_state``) may write all of it and
    everything its arguments alias. About 4 us per node that reads state."""
    if not isinstance(gm, fx.GraphModule) or _global_hooks() or _hooks_of(gm, recurse=False):
        return None, frozenset()  # something besides the graph runs: it may write anything
    if _only_quiet_calls(gm.graph):
        return frozenset(), frozenset()
    hooks = HookReach()
    aliases: dict = {}
    written: set = set()
    sure: set = set()  # what a graph op or torch's own code writes
    code_writes = hooks.code_state_written(gm)  # a wrapped helper may write what it reaches
    if code_writes is None:
        return None, frozenset()
    written |= code_writes
    modules: set = set()  # get_attr nodes that read a module
    overloads: dict = {}  # id(aten overload) -> (overload, result may alias an argument, never writes)

    def of(value: Any) -> set:
        found: set = set()
        fx.node.map_arg(value, lambda n: found.update(aliases.get(n, ())))
        return found

    for node in gm.graph.nodes:
        op = node.op
        if op == "get_attr":
            obj = _attr(gm, node.target)
            if isinstance(obj, torch.Tensor):
                aliases[node] = {id(obj)}
            elif isinstance(obj, torch.nn.Module):
                aliases[node] = {id(t) for t in [*obj.parameters(), *obj.buffers()]}
                modules.add(node)
            elif obj is not None:  # a list or dict of tensors (parameters among them)
                aliases[node] = {id(t) for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)}
            continue
        if op not in ("call_function", "call_method", "call_module"):
            continue
        args: set = set()
        given_module = False
        for used in node._input_nodes:
            found = aliases.get(used)
            if found:
                args |= found
            given_module = given_module or used in modules
        if not args and op != "call_module":
            continue  # nothing it reads aliases state: it cannot write any
        if given_module:  # a call given a module may run it (functional_call, x.forward())
            written |= args
        if op == "call_module":
            module = _module(node, gm)
            if module is None:
                return None, frozenset()
            hooked_writes = hooks.state_written(module, gm)
            if hooked_writes is None:
                return None, frozenset()  # a hook holds more than can be told: it may write anything
            written |= hooked_writes
            writes_own_state, writes_arguments, aliasing = module_effects(module)
            known = _code_known(module)  # else what it writes is a guess
            if writes_own_state and _writes_buffers_only(module):
                # the library's own (a QAT layer, a fake quantizer): its buffers, never its
                # arguments or weights; it may return its input, never its weights
                sure |= {id(t) for t in module_written_state(module)}
                aliases[node] = args
                continue
            if writes_own_state and writes_known_buffers(module):
                # torch's own code (a training batch norm, a spectral-norm conv): its
                # buffers; its result is new memory (or, as for any torch module, what
                # ``aliasing`` says of its input), never its weights
                sure |= {id(t) for t in module_written_state(module)}
                if writes_arguments:
                    (sure if known else written).update(args)
                if aliasing:
                    aliases[node] = args
                continue
            if writes_own_state:
                own = {id(t) for t in [*module.parameters(), *module.buffers()]}
                (sure if known else written).update({id(t) for t in module_written_state(module)} | args)
                aliases[node] = own | args
                continue
            # what ``written_args`` and ``may_alias`` answer for a module, read once
            if writes_arguments:
                (sure if known else written).update(args)
            elif _module_setting(module, "inplace", False):
                for key in _first_argument(node):
                    sure |= of(node.args[key] if isinstance(key, int) else node.kwargs[key])
            if aliasing:
                aliases[node] = args
            continue
        target = node.target
        if isinstance(target, torch._ops.OpOverload):  # its schema answers for every node
            known = overloads.get(id(target))
            if known is None:  # (may alias, writes nothing whatever its arguments)
                known = overloads[id(target)] = (target, may_alias(node, gm), call_writes(target) == "never")
            aliasing = known[1]
            if known[2]:
                if aliasing:
                    aliases[node] = args
                continue
        else:
            aliasing = None
        into = written if node.op == "call_function" and (
            isinstance(target, torch._ops.HigherOrderOperator) or _opaque_function(target)) else sure
        if op != "call_module" and (_call_writes_all(node) or (op == "call_function" and _inplace_flag(node))):
            into |= args
        for position in written_args(node, gm):
            arg = node.args[position] if isinstance(position, int) else node.kwargs[position]
            into |= of(arg)
        if aliasing is None:
            aliasing = may_alias(node, gm)
        if aliasing:
            aliases[node] = args
    return frozenset(written | sure), frozenset(written - sure)


def _code_known(module: Any) -> bool:
    """Whether what a call of ``module`` writes is known from torch's (or the
    library's) own code: a torch leaf module running only torch's code, no hook."""
    kind = _module_kind(type(module))
    return kind.plain_leaf and _runs_torch_code_only(module) and not (
        module._forward_hooks or module._forward_pre_hooks or _global_hooks())


def _hooks_of(module: Any, recurse: bool = True) -> list:
    """(module, hook) for the caller's hooks calling ``module`` runs (forward,
    pre-forward and backward, on it or, with ``recurse``, on a module it holds);
    torch.export's own input-unlifting hook is not one."""
    found: list = []
    stack, seen = [module], set()
    while stack:  # (``modules()`` costs a generator per module: state_writes asks every call_module)
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if m._forward_pre_hooks or m._forward_hooks or m._backward_hooks or m._backward_pre_hooks:
            found += [(m, hook) for table in (m._forward_pre_hooks, m._forward_hooks, m._backward_hooks,
                                              m._backward_pre_hooks)
                      for hook in table.values() if getattr(hook, "__module__", None) not in _HARMLESS_HOOK_MODULES]
        if recurse and m._modules:
            stack += [child for child in m._modules.values() if child is not None]
    return found


class HookReach:
    """What the caller's hooks can reach (``rewrite.ops.reach``): what they close
    over, the globals their code names, and what the module they are given holds (a
    plain list of trackers, a reference to the parent model). A hook may write any
    of it: a counter on the root, another layer's weight, a tensor outside the model.
    One walk over all the hooks asked about: an object is gone through once (one
    monitor's bound method hooked on every layer reaches the whole model: walked once,
    not once per layer), and what is answered is the union, which is what the callers
    want (the state a graph may write, the tensors a check must put back)."""

    def __init__(self) -> None:
        self._seen: set = set()  # ids of objects walked through (the objects are alive: hooks hold them)
        self._found: list | None = []
        self._state_storages: dict | None = None

    def tensors(self, module: Any) -> "list | None":
        """Every tensor the hooks of ``module`` and the modules it holds, and those
        asked about before, can reach; None when that is unbounded."""
        for owner, hook in _hooks_of(module):
            if self._found is None:
                break
            if _from_torch_itself(hook):
                continue  # torch's weight and spectral norms: what they write, module_written_state tells
            reached = reachable_tensors((hook, owner), self._seen)
            self._found = None if reached is None else self._found + reached
        return self._found

    def code_tensors(self, gm: Any) -> "list | None":
        """Every tensor the code ``gm``'s graph calls that the library cannot read
        (``opaque_code``: a ``torch.fx.wrap``'d helper, a user's leaf module) can
        reach, with those asked about before; None when that is unbounded."""
        for fn in opaque_code(gm):
            if self._found is None:
                break
            reached = reachable_tensors(fn, self._seen)
            self._found = None if reached is None else self._found + reached
        return self._found

    def state_written(self, module: Any, gm: Any) -> "set | None":
        """The ids of the tensors (``gm``'s state among them, matched by memory) the
        hooks reach (those of ``module`` and of the modules asked about before), or
        None when unbounded."""
        return self._ids(self.tensors(module), gm)

    def code_state_written(self, gm: Any) -> "set | None":
        """``state_written`` for the code of ``gm`` the library cannot read (``code_tensors``),
        and what its user leaf modules hold where that can be told (``holder_tensors``)."""
        found = self._ids(self.code_tensors(gm), gm)
        held = self.holder_tensors(gm)
        return found if found is None or not held else found | self._ids(held, gm)

    def holder_tensors(self, gm: Any) -> list:
        """The tensors ``opaque_holders`` reach, new to this walk; none when that walk
        cannot be bounded (best-effort: see ``opaque_holders``)."""
        holders = opaque_holders(gm)
        if not holders:
            return []
        seen = set(self._seen)
        reached = reachable_tensors(holders, seen)
        if reached is None:
            return []
        self._seen |= seen
        if self._found is not None:
            self._found = self._found + reached
        return reached

    def _ids(self, reached: "list | None", gm: Any) -> "set | None":
        if not reached:
            return None if reached is None else set()
        if self._state_storages is None:
            self._state_storages = {}
            for table in _state_tables(gm):
                for t in table.values():
                    if isinstance(t, torch.Tensor):
                        self._state_storages.setdefault(storage_key(t), []).append(id(t))
            self._state_storages.pop(None, None)
        found = {id(t) for t in reached}
        for t in reached:
            found.update(self._state_storages.get(storage_key(t), ()))
        return found


def _from_torch_itself(hook: Any) -> bool:
    """A hook torch defines (a function, a bound method or a callable object of
    torch's: ``WeightNorm``, a quantization observer's hook)."""
    fn = getattr(hook, "__func__", hook)
    where = getattr(fn, "__module__", None) if isinstance(fn, types.FunctionType) else type(fn).__module__
    return (where or "").startswith("torch.")


def hooked_containers(module: Any) -> "list | None":
    """The lists, dicts, sets and deques the caller's hooks on ``module`` and the
    modules it holds, and the code its graph calls that the library cannot read
    (``opaque_code``), can reach (``reachable_containers``: a feature list a hook
    appends to); None when that is unbounded."""
    found: list = []
    seen: set = set()
    code = [hook for _, hook in _hooks_of(module) if not _from_torch_itself(hook)]
    for fn in code + (opaque_code(module) if isinstance(module, fx.GraphModule) else []):
        reached = reachable_containers(fn, seen)
        if reached is None:
            return None
        found += reached
    for held in opaque_holders(module) if isinstance(module, fx.GraphModule) else ():
        reached = reachable_containers(held, set(seen))  # best-effort (see ``opaque_holders``)
        found += reached or []
    return found


def hooked_generators(module: Any) -> list:
    """The random generator objects (``reachable_generators``) the caller's hooks on
    ``module`` and the modules it holds, the code its graph calls that the library
    cannot read (``opaque_code``) and what its user leaf modules hold can reach: a
    run may draw from them (a wrapped helper adding noise from a module-level
    ``numpy.random.default_rng()``). Best-effort, each object once."""
    roots = [hook for _, hook in _hooks_of(module) if not _from_torch_itself(hook)]
    if isinstance(module, fx.GraphModule):
        roots += opaque_code(module) + opaque_holders(module)
    if not roots:
        return []
    found = reachable_generators(roots)
    return list({id(g): g for g in found}.values())


def hooked_tensors(module: Any) -> "list | None":
    """Every tensor the caller's hooks on ``module`` and the modules it holds, and
    the code its graph calls that the library cannot read (``opaque_code``), can
    reach (``HookReach``); None when that is unbounded."""
    reach = HookReach()
    found = reach.tensors(module)
    if found is None or not isinstance(module, fx.GraphModule):
        return found
    found = reach.code_tensors(module)
    return found if found is None else found + reach.holder_tensors(module)


def opaque_code(gm: Any) -> list:
    """The Python code a run of ``gm``'s graph calls that the library cannot read,
    hooks aside: a function from outside torch (``torch.fx.wrap``'d) and the forward
    of a user's leaf module. It may write whatever it reaches besides its arguments
    (a model's buffer through a registry, a module-level counter): what the check
    and a recording run save and put back."""
    functions = [target for op, target, _ in nodes_by_target(gm.graph)
                 if op == "call_function" and _opaque_function(target)]
    return functions + [type(module).forward for module in _users_leaf_modules(gm)]


def opaque_holders(gm: Any) -> list:
    """What a user's leaf module of ``gm`` holds besides its parameters and buffers:
    the module and its public attributes (a plain tensor, a dict of them, a helper
    object with a list), which its forward may write. Walked best-effort (a module
    holding a large object graph is not walked at all): its own parameters and buffers
    count as written anyway (``module_effects``)."""
    return [(module, *(v for k, v in vars(module).items() if not k.startswith("_")))
            for module in _users_leaf_modules(gm)]


def in_place_writers(gm: Any) -> list:
    """The user's leaf modules of ``gm`` whose own code may write a tensor in place
    (``_writes_in_place``). The weights of the others are only read by their code."""
    return [m for m in _users_leaf_modules(gm) if _writes_in_place(m)]


def _writes_in_place(module: Any) -> bool:
    """Whether code a call of ``module`` may run writes a tensor in place, by what
    the code says. Read: for it and every module it holds (a child layer it calls),
    every method, property, static or class method of their classes (before torch's
    in the MRO; a decorated one read through ``__wrapped__``; ``__init__`` for the
    closures and lambdas it defines only, not its own body, which runs at
    construction: ``nn.ReLU(inplace=True)`` or ``nn.init`` there write no weight at a
    call), the functions their instances hold, the hooks they registered on
    themselves, and the methods of the helper objects they hold (in a list or dict
    too) that the code read names or that Python calls implicitly (``__call__``,
    ``__getitem__``, ``__enter__``...); then, a few calls deep, the Python functions
    from outside torch and the standard library that code names as globals: a
    function, an attribute of a module or class (``utils.halve(w)``,
    ``Ops.halve(w)``). A write is an in-place name (``add_``, ``copy_``, also as a
    string: ``getattr(w, "mul_")``; ``__imul__``, ``operator.imul``), ``.data``,
    ``torch.nn.init``, an augmented assignment (``w += 1``: in place on a tensor), an
    item assignment (``w[0] = 0``) or an ``out=`` or ``inplace=`` keyword. Erring
    towards a write: ``out += residual`` on a local tensor counts too."""
    codes: list = []  # (code, globals) to read
    helpers: list = []  # helper objects held
    for held in module.modules():
        for name, value in _user_class_attributes(code_class(type(held))):
            for function in _functions_of(value):
                if name == "__init__" and function.__code__.co_name == "__init__":
                    codes += [(c, function.__globals__) for c in _nested_code(function.__code__)]
                else:
                    codes.append((function.__code__, function.__globals__))
        hooks = [h for table in (held._forward_pre_hooks, held._forward_hooks, held._backward_hooks,
                                 held._backward_pre_hooks) for h in table.values()]
        for value in [*vars(held).values(), *hooks]:
            for item in (value if isinstance(value, (list, tuple)) else
                         value.values() if isinstance(value, dict) else (value,)):
                if isinstance(item, (torch.Tensor, torch.nn.Module, type, str, bytes, int, float, bool,
                                     types.ModuleType)) or item is None:
                    continue
                functions = _functions_of(item)
                codes += [(f.__code__, f.__globals__) for f in functions]
                if not functions and not isinstance(item, (list, tuple, dict, set)):
                    helpers.append(item)
    return _codes_write_in_place(codes, helpers)


def _codes_write_in_place(codes: list, helpers: list) -> bool:
    """``_writes_in_place`` over ``codes`` (with their globals) and what they reach:
    the helper objects' methods they name or Python calls implicitly, global helpers."""
    by_name: dict = {}  # a helper object's method name -> its values
    for helper in helpers:
        for name, value in _user_class_attributes(type(helper)):
            by_name.setdefault(name, []).append(value)
    stack = [(code, found, 0) for code, found in codes]
    stack += [(f.__code__, f.__globals__, 0) for name in _IMPLICIT_CALLS for value in by_name.get(name, ())
              for f in _functions_of(value)]
    named: set = set(_IMPLICIT_CALLS)
    seen: set = set()
    while stack:
        code, found, depth = stack.pop()
        if code in seen or _library_code(code.co_filename):
            continue
        seen.add(code)
        if _code_writes_in_place(code):
            return True
        for name in _attribute_names(code):
            if name not in named and name in by_name:
                named.add(name)
                stack += [(f.__code__, f.__globals__, depth) for value in by_name[name] for f in _functions_of(value)]
        if depth < _HELPER_DEPTH:
            stack += [(f.__code__, f.__globals__, depth + 1) for helper in _named_helpers(found, code)
                      for f in _functions_of(helper)]
    return False


#: what Python calls on a helper object without naming it: ``h(w)``, ``h[0]``, ``with h:``, ``for x in h``
_IMPLICIT_CALLS = frozenset({"__call__", "__getitem__", "__setitem__", "__delitem__", "__enter__", "__exit__",
                             "__iter__", "__next__", "__contains__", "__len__", "__bool__", "__get__"})


def _nested_code(code: types.CodeType) -> list:
    """The code objects defined inside ``code`` (closures, lambdas, comprehensions), nested ones too."""
    found = []
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found += [const, *_nested_code(const)]
    return found


def _user_class_attributes(kind: type) -> list:
    """``(name, value)`` of the attributes of a class's MRO before torch's, the
    library's, the standard library's or ``object``."""
    found: list = []
    for base in kind.__mro__:
        module = base.__module__ or ""
        if module.startswith(("torch", "rewrite.")) or module.partition(".")[0] in _STDLIB or base is object:
            break
        found.extend(vars(base).items())
    return found


@functools.lru_cache(maxsize=4096)
def _attribute_names(code: types.CodeType) -> frozenset:
    """The names ``code`` and the code nested in it use (attributes, globals)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _attribute_names(const)
    return frozenset(names)


def _library_code(filename: str) -> bool:
    """Code of torch's or of the standard library (not a site-packages module)."""
    return filename.startswith(_TORCH_DIR) or (filename.startswith(_STDLIB_DIR) and "-packages" not in filename)


def _named_helpers(found: dict, code: types.CodeType) -> list:
    """The Python functions (and classes' attributes) ``code`` may call through the
    globals it names: a function, or an attribute it names of a module or class
    (``utils.halve``, ``Helper.halve``); not torch's."""
    helpers: list = []
    for name in _global_loads(code):
        value = found.get(name)
        if isinstance(value, (types.FunctionType, functools.partial)):
            helpers.append(value)
        elif isinstance(value, (types.ModuleType, type)) \
                and not (getattr(value, "__name__", "") if isinstance(value, types.ModuleType)
                         else value.__module__ or "").startswith(("torch", "builtins")):
            table = vars(value)
            helpers.extend(table[n] for n in code.co_names if n in table)
    return helpers


_TORCH_DIR = torch.__file__.rpartition("/")[0] + "/"
_STDLIB_DIR = os.path.dirname(os.__file__) + "/"
_STDLIB = frozenset(sys.stdlib_module_names) | {"builtins"}
_HELPER_DEPTH = 4  # calls into helper functions followed from a module's own code


def _functions_of(value: Any) -> list:
    """The Python functions a class attribute or held value runs: itself, a
    property's accessors, a static or class method's function, a partial's
    function, and what a decorator wrapped (``__wrapped__``, as ``functools.wraps``
    and ``torch.no_grad()`` leave it)."""
    found, stack, seen = [], [value], set()
    while stack:
        v = stack.pop()
        if v is None or id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, property):
            stack += [v.fget, v.fset, v.fdel]
        elif isinstance(v, (staticmethod, classmethod, types.MethodType)):
            stack.append(v.__func__)
        elif isinstance(v, functools.partial):
            stack.append(v.func)
        elif isinstance(v, types.FunctionType):
            found.append(v)
            stack.append(v.__dict__.get("__wrapped__"))
    return found


@functools.lru_cache(maxsize=4096)
def _code_writes_in_place(code: types.CodeType) -> bool:
    """``_writes_in_place`` for one code object and the code nested in it."""
    names = code.co_names
    if any(_in_place_name(n) or n in _IN_PLACE_NAMES for n in names) or "data" in names or "init" in names:
        return True
    for const in code.co_consts:
        if (isinstance(const, str) and (_in_place_name(const) or const in _IN_PLACE_NAMES)) \
                or (isinstance(const, tuple) and ("out" in const or "inplace" in const)):
            return True  # getattr(w, "add_"); a call's keyword names (out=..., inplace=...)
        if isinstance(const, types.CodeType) and _code_writes_in_place(const):
            return True
    return any(i.opname in ("STORE_SUBSCR", "DELETE_SUBSCR") or i.opname.startswith("INPLACE_")
               or (i.opname == "BINARY_OP" and i.argrepr.endswith("=")) for i in dis.get_instructions(code))


#: names of in-place operations that do not end in a single underscore
_IN_PLACE_NAMES = frozenset(
    {f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "lshift", "rshift", "and",
                            "xor", "or", "matmul")}
    | {f"i{op}" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "lshift", "rshift", "and",
                          "xor", "or", "matmul", "concat")}
    | {"__setitem__", "__delitem__", "setitem", "delitem", "__set__", "setattr"})


def _in_place_name(name: str) -> bool:
    return name.endswith("_") and not name.endswith("__") and name.isidentifier() and name != "_"


@functools.lru_cache(maxsize=4096)
def _global_loads(code: types.CodeType) -> tuple:
    """The global names ``code`` and the code nested in it load."""
    found = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found.update(_global_loads(const))
    return tuple(found)


def _users_leaf_modules(gm: Any) -> Iterator:
    """The modules ``gm``'s call_module nodes call whose code is the user's: not
    torch's, not the library's own (a QAT layer, a fake quantizer: ``module_effects``
    knows what they write), not a GraphModule (its graph is read); and torch's that
    run the user's code they hold (``TransformerEncoderLayer(activation=obj)``, a
    torch container of a user's layer: ``_runs_torch_code_only``)."""
    for op, _, nodes in nodes_by_target(gm.graph):
        if op != "call_module":
            continue
        for node in nodes:
            module = _module(node, gm)
            if module is None or isinstance(module, fx.GraphModule):
                continue
            where = code_class(type(module)).__module__
            if not where.startswith(("torch.", "rewrite.")) or (
                    where.startswith("torch.") and not _runs_torch_code_only(module)):
                yield module


def lasting_write(node: fx.Node, gm: Any) -> bool:
    """Whether what ``node`` does to the memory it writes may outlast the call: code
    nothing describes (a ``torch.fx.wrap``'d helper, a user's leaf module, a
    higher-order op: it may keep a reference and write later, through a path the
    graph does not show) or an op that makes memory shared (``z.set_(h)``: a later
    write into z is one into h)."""
    if node.op == "call_module":
        module = _module(node, gm)
        return module is None or not type(module).__module__.startswith("torch.")
    if node.op not in ("call_function", "call_method"):
        return False
    target = node.target
    if op_name(target) in _WRITES_EVERY_ARGUMENT or isinstance(target, torch._ops.HigherOrderOperator):
        return True
    return node.op == "call_function" and _opaque_function(target)


def _opaque_function(target: Any) -> bool:
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
        return False
    if _from_torch(target) or getattr(builtins, getattr(target, "__name__", ""), None) is target:
        return False
    return callable(target)


def _state_tables(gm: Any) -> Iterator:
    for m in gm.modules():
        yield m._parameters
        yield m._buffers
        yield {k: v for k, v in vars(m).items() if isinstance(v, torch.Tensor)}


def _only_quiet_calls(graph: fx.Graph) -> bool:
    """Every call of the graph is a getitem or an aten overload that writes nothing with the
    arguments it is given (no ``Tensor(a!)``, no ``out=``, a flagged write's flag
    off: eval-mode ``batch_norm``): then nothing is written, whatever aliases what.
    Read by target from the graph's index (export graphs: a few dozen targets for
    10k nodes), so ``state_writes`` need not walk the graph."""
    for op, target, nodes in nodes_by_target(graph):
        if op == "call_module" and graph.owning_module is not None and all(
                not n.users and _quiet_guard(graph.owning_module, n.target) for n in nodes):
            continue  # torch.export's input guard: it checks shapes, computes and writes nothing
        if op != "call_function":
            return False
        if target is operator.getitem:
            continue  # an element of a multi-output op's result: reading writes nothing
        if not isinstance(target, torch._ops.OpOverload):
            return False  # aten ops take no module to run: other targets may be given one
        how = call_writes(target)  # an overload's out= is in its schema: "node"
        if how == "node" or (how == "flag" and any(flag_on(n, flagged_writes(target)) for n in nodes)):
            return False
    return True


def _quiet_guard(gm: Any, target: str) -> bool:
    """A ``torch.export`` input guard without hooks (no global ones: ``state_writes``)."""
    module = _attr(gm, target)
    return is_export_guard(gm, target) and not (module._forward_hooks or module._forward_pre_hooks)


def _attr(gm: Any, target: str) -> Any:
    try:
        return attribute(gm, target)
    except AttributeError:
        return None
