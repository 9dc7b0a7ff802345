"""Custom ops: operators a library registered with ``torch.library``, named in a rule.

A rule may name an operator registered with ``torch.library.custom_op``,
``torch.library.Library("mylib", "DEF")`` or a C++ ``TORCH_LIBRARY``, written
``mylib.myrelu``, ``mylib.myrelu.default`` or ``torch.ops.mylib.myrelu[.overload]``.
Its schema is its signature (argument names, defaults, which are tensors); it
matches every capture level: ``torch.ops.mylib.myrelu(x)`` in a symbolic_trace or
dynamo graph (the packet; bound only when the op has a single overload, so the
schema is known), ``torch.ops.mylib.myrelu.default(x)`` or the ``custom_op``
function there and in torch.export graphs (the overload). It emits the overload in
both dialects. Verification draws its tensor arguments as float tensors of one
shared shape (``rewrite.trust.instances``), so the op needs a kernel for the CPU
(and a fake kernel for torch.export, which the library provides anyway).

Allowed and refused (``refusal`` says why, and ``rewrite check`` prints it):

* the library must be registered, i.e. the module that defines the op imported,
  before the rule file is loaded: resolution only looks names up in the
  dispatcher's registry, it never imports or runs anything the rule file names;
* namespaces torch registers for itself (``aten``, which has its own path, and
  ``prims``, ``quantized``, ``c10d``, ``profiler``, ``debugprims``, ...) and names
  with a leading underscore are not custom ops;
* an op whose schema writes an argument (``mutates_args``, ``Tensor(a!)``), has
  ``out=`` arguments, returns nothing, takes a TorchBind object, is in
  ``torch.fx``'s side-effectful set or has a registered effect, or draws random
  numbers (tag ``nondeterministic_seeded``: replacing or removing it would change
  the random stream the caller sees) is refused.
"""

from __future__ import annotations

import attrs
import torch

from rewrite.ops.base import OpDef
from rewrite.ops.builders import fn, make_op, sig_params
from rewrite.ops.resolve import ROOTS, schema_sig

__all__ = ["Refusal", "INTERNAL_NAMESPACES", "library_name", "custom_opdef", "refusal"]

#: namespaces torch registers for its own kernels, collectives, profiling and I/O
INTERNAL_NAMESPACES = frozenset({
    "aten", "prim", "prims", "quantized", "_quantized", "quantized_decomposed", "quantization",
    "mkldnn", "mkldnn_prepacked", "mkl", "onednn", "sparse", "c10d", "_c10d_functional",
    "_c10d_functional_autograd", "symm_mem", "static_runtime", "profiler", "debugprims", "rngprims",
    "inductor", "inductor_prims", "higher_order", "debug_mode_ops", "export", "_dtensor", "_test",
    "_native", "fbgemm", "cuda", "xpu", "mps", "streams",
    # registered once torch._dynamo, torch.distributed or torch.onnx is imported: legacy
    # collectives (all_reduce, isend: a rule must never emit them), FSDP's, flex
    # attention's, ONNX export's and Inductor's test ops
    "c10d_functional", "fsdp", "flex_lib", "onnx", "onnx_symbolic", "_inductor_test",
    # context parallelism's all-gather (torch.distributed.tensor.experimental)
    "cplib",
})


def _defined_by_torch(namespace: str) -> bool:
    """Whether an op of ``namespace`` was defined by torch's own Python code with
    ``torch.library.custom_op`` (a namespace torch adds after this list was written:
    ``cplib``'s collective was missing from it), read from torch's registry of such
    ops: nothing is imported or run."""
    from torch._library import custom_ops

    prefix = namespace + "::"
    modules = [getattr(getattr(opdef, "_init_fn", None), "__module__", "") or ""
               for qualname, opdef in list(getattr(custom_ops, "OPDEFS", {}).items()) if qualname.startswith(prefix)]
    # every op of it (a user's library registering a torch function as one of its ops stays the user's)
    return bool(modules) and all(m == "torch" or m.startswith("torch.") for m in modules)


@attrs.frozen
class Refusal:
    """Why a library op name does not resolve: the diagnostic's message and hint."""

    message: str
    help: str


def library_name(qualname: str) -> tuple | None:
    """``(namespace, op, overload or None)`` when a normalized qualified name has the
    shape of a ``torch.library`` op (a root the vocabulary does not know), else None."""
    parts = qualname.split(".")
    if len(parts) not in (2, 3) or parts[0] in ROOTS or any(not p.isidentifier() for p in parts):
        return None
    return parts[0], parts[1], parts[2] if len(parts) == 3 else None


def _registered(namespace: str) -> dict:
    """op name -> overload names registered in ``namespace`` (the dispatcher's
    registry: nothing is imported or run)."""
    out: dict = {}
    for full in torch._C._dispatch_get_all_op_names():
        ns, _, rest = full.partition("::")
        if ns == namespace:
            name, _, overload = rest.partition(".")
            out.setdefault(name, []).append(overload or "default")
    return out


def _problem(overload: torch._ops.OpOverload) -> str | None:
    """What makes an overload unsafe to match or emit, or None."""
    schema = overload._schema
    for a in schema.arguments:
        if a.is_out:
            return f"it has an out= argument '{a.name}'"
        if a.alias_info is not None and a.alias_info.is_write:
            return f"its schema writes its argument '{a.name}' in place ({schema})"
        if "__torch__" in str(a.type):
            return f"its argument '{a.name}' is a TorchBind object ({a.type})"
    if not schema.returns:
        return "it returns nothing: it is called for its effects"
    side_effectful = torch.fx.node._side_effectful_functions
    if overload in side_effectful or overload.overloadpacket in side_effectful:
        return "torch.fx marks it side-effectful"
    from torch._higher_order_ops import effects

    if effects.has_effects(overload):
        return "it has a registered effect (torch.library._register_effectful_op)"
    if torch.Tag.nondeterministic_seeded in overload.tags:
        return "it draws random numbers (nondeterministic_seeded): rewriting it changes the random stream"
    return None


def _lookup(qualname: str) -> tuple:
    """``(OpDef, None)`` for a usable library op, ``(None, Refusal)`` for a refused or
    unknown one, ``(None, None)`` when ``qualname`` is not a library op name."""
    parsed = library_name(qualname)
    if parsed is None:
        return None, None
    ns, name, overload = parsed
    written = qualname
    hint = "name a vocabulary op, an aten op (aten.<op>) or an op of your own library"
    if ns in INTERNAL_NAMESPACES or _defined_by_torch(ns):
        return None, Refusal(f"op '{written}' is refused: '{ns}' is torch's own namespace, not a custom op "
                             "library", hint)
    if ns.startswith("_") or name.startswith("_"):
        return None, Refusal(f"op '{written}' is refused: private names (a leading underscore) are not part of "
                             "the rule language", hint)
    ops = _registered(ns)
    if not ops:
        return None, Refusal(f"unknown op '{written}'",
                             f"no operator library '{ns}' is registered: import the module that defines it "
                             "(torch.library.custom_op / Library) before loading the rule file; on the command line: "
                             "rewrite --import MODULE ...")
    if name not in ops or (overload is not None and overload not in ops[name]):
        known = sorted(f"{ns}.{n}" for n in ops)
        return None, Refusal(f"unknown op '{written}'", f"library '{ns}' registers {', '.join(known[:8])}"
                             + (", ..." if len(known) > 8 else ""))
    packet = getattr(getattr(torch.ops, ns), name)
    overloads = packet.overloads()
    chosen = overload or ("default" if "default" in overloads else overloads[0])
    target = getattr(packet, chosen)
    problem = _problem(target)
    if problem is not None:
        return None, Refusal(f"op '{written}' is refused: {problem}",
                             "a rule may only name custom ops that compute a fresh result from their arguments")
    sig = schema_sig(target)
    specs = fn(f"{ns}.{name}.{chosen}")
    if len(overloads) == 1:  # the packet's call resolves to this overload: bind it too
        specs += fn(f"{ns}.{name}", overload=chosen)
    emit = f"{ns}.{name}.{chosen}"
    opdef = make_op(written, sig_params(sig), [specs], torch=emit, aten=emit, qualified=True,
                    doc=f"{ns}::{name}.{chosen} (a custom op: from its schema)")
    return opdef, None


def custom_opdef(qualname: str) -> OpDef | None:
    """The ``OpDef`` of a usable ``torch.library`` op named ``qualname`` (normalized:
    ``mylib.f`` or ``mylib.f.overload``), or None."""
    try:
        return _lookup(qualname)[0]
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


def refusal(qualname: str) -> Refusal | None:
    """Why the library op name ``qualname`` does not resolve (refused, unknown
    library, unknown op), or None when it resolves or is not a library op name."""
    try:
        return _lookup(qualname)[1]
    except (AttributeError, RuntimeError, TypeError, ValueError) as err:
        return Refusal(f"op '{qualname}' cannot be read from the registry: {err}", "check the op's schema")
