"""Ops outside the vocabulary, named by a qualified name in a rule file.

A rule may use any torch op the vocabulary lacks (``aten.hardsigmoid``,
``Tensor.clamp_min``, ``F.elu``). Its signature comes from the op's aten schema (or,
for a Python function in ``torch.nn.functional``, from ``inspect``), and it binds and
emits exactly the named target.

Loading a rule file must never run arbitrary code, so a name is resolved only if it
is, after ``rewrite.ops.resolve.normalize_qualname`` rejects dunders:

* ``aten.<op>[.<overload>]``: an ``OpOverloadPacket`` of ``torch.ops.aten``;
* ``torch.<f>``: a C-bound function of ``torch`` with an aten op of the same name
  (so ``torch.load`` and ``torch.save``, Python functions, are refused);
* ``F.<f>``: a public function defined in ``torch.nn.functional``, or a C-bound one
  with an aten op of the same name;
* ``Tensor.<m>``: a public method of ``torch.Tensor`` with an aten op of the same name;
* ``operator.<f>``: arithmetic, comparison and ``getitem`` only;
* ``quantized_decomposed.<op>``: the PT2E quantize/dequantize ops (per tensor and
  per channel, default overload), what ``torch.export`` and ONNX export read;
* ``<namespace>.<op>[.<overload>]`` (also ``torch.ops.<namespace>...``): an op a
  library registered with ``torch.library``, looked up in the dispatcher's registry
  only; ops that write an argument, have ``out=`` arguments, side effects or draw
  random numbers are refused, as are torch's own namespaces. See
  ``rewrite.ops.custom`` for the full allow/deny rules.

A replacement may not build every op it may name: ``emission_refusal`` says which
(private aten ops, ops that make uninitialized or unchecked memory, autograd effects;
E106). A pattern may match any of them.

A name without an overload takes the signature of the default overload (or the
first that takes a tensor first); ``aten.sum.dim_IntList`` names another. An aten
packet name also matches its other overloads that take the same arguments.

``nn.<Module>`` classes are not resolved here: only the vocabulary's modules bind
(a module's forward can do anything; the vocabulary says what each one computes).
"""

from __future__ import annotations

import inspect
import types

import torch
import torch.nn.functional as F

from rewrite.ops.base import OpDef
from rewrite.ops.builders import fn, make_op, method, sig_params
from rewrite.ops.custom import custom_opdef, library_name
from rewrite.ops.resolve import Sig, aten_overload, resolve, schema_sig, signature_of

__all__ = ["generic_opdef", "emission_refusal", "other_overloads", "OPERATOR_ALLOWED", "DECOMPOSED_ALLOWED"]

_UNARY = ("neg", "pos", "abs", "invert", "not_")
_BINARY = (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and_", "or_", "xor",
    "lshift", "rshift", "lt", "le", "gt", "ge", "eq", "ne",
    "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul", "iand", "ior", "ixor",
)
OPERATOR_ALLOWED = frozenset(_UNARY + _BINARY + ("getitem",))
_DROPPED = ("inplace", "_stacklevel")


def _build(name: str, sig: Sig, specs: list, emit: str) -> OpDef:
    return make_op(name, sig_params(sig, _DROPPED), [specs], torch=emit, aten=emit,
                   doc=f"{name} (from its schema; not in the vocabulary)", qualified=True)


def _aten(parts: list) -> OpDef | None:
    if len(parts) not in (1, 2):
        return None
    chosen = aten_overload(parts[0], parts[1] if len(parts) == 2 else None)
    if chosen is None:
        return None
    sig = schema_sig(chosen)
    names = [f"aten.{parts[0]}.{chosen._overloadname}"]
    if len(parts) == 1:  # the packet: every overload called the same way
        packet = getattr(torch.ops.aten, parts[0])
        for ov in packet.overloads():
            q, overload = f"aten.{parts[0]}.{ov}", getattr(packet, ov)
            writes_out = any(a.is_out for a in overload._schema.arguments)
            if q not in names and not writes_out and schema_sig(overload).names == sig.names:
                names.append(q)
    return _build(".".join(["aten", *parts]), sig, fn(*names, ignore=_DROPPED), names[0])


def _torch(name: str) -> OpDef | None:
    target = getattr(torch, name, None)
    if not isinstance(target, types.BuiltinFunctionType) or aten_overload(name) is None:
        return None
    sig = signature_of(f"torch.{name}", target)
    return None if sig is None else _build(f"torch.{name}", sig, fn(f"torch.{name}"), f"torch.{name}")


def _functional(name: str) -> OpDef | None:
    target = getattr(F, name, None)
    python = inspect.isfunction(target) and target.__module__ == "torch.nn.functional"
    builtin = isinstance(target, types.BuiltinFunctionType) and aten_overload(name) is not None
    if not (python or builtin):
        return None
    sig = signature_of(f"F.{name}", target)
    return None if sig is None else _build(f"F.{name}", sig, fn(f"F.{name}", ignore=_DROPPED), f"F.{name}")


def _tensor(name: str) -> OpDef | None:
    if not callable(getattr(torch.Tensor, name, None)) or aten_overload(name) is None:
        return None
    sig = signature_of(f"Tensor.{name}", getattr(torch.Tensor, name))
    return None if sig is None else _build(f"Tensor.{name}", sig, method(name), f"Tensor.{name}")


def other_overloads(qualname: str) -> list:
    """``(aten qualified name, Sig)`` of the aten overloads of a ``torch.<f>``,
    ``F.<f>`` or ``Tensor.<m>`` name other than the one its ``generic_opdef`` takes
    (``torch.prod`` takes ``prod(input, dtype)``; torch also takes ``prod.dim_int``):
    a rule names those only at the ATen level, and an error about the arguments
    should say so."""
    root, _, name = qualname.partition(".")
    if root not in ("torch", "F", "Tensor") or "." in name:
        return []
    chosen = aten_overload(name)
    if chosen is None:
        return []
    out = []
    packet = getattr(torch.ops.aten, name)
    for ov in packet.overloads():
        overload = getattr(packet, ov)
        args = overload._schema.arguments
        if overload is chosen or not args or "Tensor" not in str(args[0].type) or any(a.is_out for a in args) \
                or any("Dimname" in str(a.type) for a in args):
            continue
        out.append((f"aten.{name}.{ov}", schema_sig(overload)))
    return out


def _operator(name: str) -> OpDef | None:
    if name not in OPERATOR_ALLOWED:
        return None
    sig = Sig(("input",) if name in _UNARY else ("input", "other"), tensors=frozenset({"input"}))
    if name == "getitem":
        sig = Sig(("input", "index"), tensors=frozenset({"input"}))
    text = ", ".join(sig.names)
    return _build(f"operator.{name}", sig, fn(f"operator.{name}", sig=text), f"operator.{name}")


#: the ``torch.ops.quantized_decomposed`` ops a rule may name
DECOMPOSED_ALLOWED = frozenset({"quantize_per_tensor", "dequantize_per_tensor", "quantize_per_channel",
                                "dequantize_per_channel"})


def _decomposed(name: str) -> OpDef | None:
    if name not in DECOMPOSED_ALLOWED:
        return None
    q = f"quantized_decomposed.{name}"
    return _build(q, schema_sig(resolve(q).default, "input"), fn(f"{q}.default"), f"{q}.default")


#: words in an op's name that mark memory a rule must not make: uninitialized memory
#: (``empty_like``, ``new_empty``), tensors whose invariants are not checked
#: (``_sparse_coo_tensor_unsafe``: its ``to_dense`` writes out of bounds), nested
#: and sparse constructors
_UNSAFE_WORDS = ("empty", "unsafe", "sparse", "nested", "resize", "to_mkldnn", "mkldnn_reorder")
#: autograd effects no schema annotates: they reach the caller's leaves
_AUTOGRAD = frozenset({"backward", "retain_grad", "requires_grad_", "register_hook"})


def emission_refusal(qualname: str) -> str | None:
    """Why a replacement may not build the op a qualified name outside the
    vocabulary names (None: it may). A pattern may match any of them; only building
    one is refused: a private aten op (``aten._reshape_alias`` reads past its
    storage; torch's private ops check nothing for their callers), an op that makes
    uninitialized or unchecked memory, or one with autograd effects."""
    root, _, op = qualname.partition(".")
    op = op.split(".")[0]
    if root == "aten" and op.startswith("_"):
        return "a private aten op, which checks nothing for its callers (it may read or write past its storage)"
    if any(word in op for word in _UNSAFE_WORDS):
        return "it makes uninitialized memory or a tensor whose invariants nothing checks"
    if op in _AUTOGRAD:
        return "it has autograd effects, which reach the caller's tensors"
    return None


def generic_opdef(qualname: str) -> OpDef | None:
    """An ``OpDef`` for a normalized qualified name outside the vocabulary, or None
    when the name is not on the allowlist or names nothing."""
    root, *parts = qualname.split(".")
    if any("__" in p for p in parts):
        return None
    if library_name(qualname) is not None:
        return custom_opdef(qualname)
    try:
        if root == "aten":
            return _aten(parts)
        if len(parts) != 1 or parts[0].startswith("_"):
            return None  # private torch API is not part of the rule language
        builder = {"torch": _torch, "F": _functional, "Tensor": _tensor, "operator": _operator,
                   "quantized_decomposed": _decomposed}.get(root)
        return None if builder is None else builder(parts[0])
    except (TypeError, ValueError, AttributeError, RuntimeError):
        return None
