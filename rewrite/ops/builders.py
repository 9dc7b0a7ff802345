"""The little language the vocabulary table is written in.

A table entry reads like the op's documentation::

    op("relu", "input: T",
       fn("torch.relu", "torch.relu_", "F.relu", "aten.relu.default", "aten.relu_.default"),
       method("relu", "relu_"),
       module("nn.ReLU", extract=modules.unary),
       torch="torch.relu", aten="aten.relu.default", elementwise=True)

Surfaces are named by the qualified name a rule author writes, and resolved here
into ``rewrite.ops.forms`` objects: signatures come from the aten schema or
``inspect`` unless written out (``sig="self, *size"``); ``self`` is renamed to
``input`` and ``inplace`` dropped everywhere. Every ``Tensor`` method also gets a
``call_function`` twin on ``torch.Tensor.<m>``, which is how emission spells methods.

``op`` checks the entry when the table is imported: every parameter of every target
must land on a canonical parameter, a guard or an ignored name, and the emitters
must name one of the op's own forms, so whatever the vocabulary emits it can bind
again.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs

from rewrite.ops.base import REQUIRED, Emitter, Instances, ModuleForm, OpDef, Param
from rewrite.ops.forms import EmitError, Fn, Item, Method, call_for
from rewrite.ops.resolve import Sig, parse_sig, resolve, signature_of

__all__ = ["Spec", "Module", "fn", "method", "module", "item", "op", "make_op", "emittable", "sig_params"]


@attrs.frozen
class Spec:
    """An unresolved surface: kind (fn, method, module, item), name, options."""

    kind: str
    name: str
    opts: dict


@attrs.frozen
class Module(ModuleForm):
    """``ModuleForm`` that remembers the qualified name it was written as."""

    qualname: str = ""
    aliases: tuple = ()
    named: bool = True


def fn(*names: str, **opts: Any) -> list:
    """``call_function`` surfaces, one per qualified name, sharing ``opts``."""
    return [Spec("fn", n, opts) for n in names]


def method(*names: str, **opts: Any) -> list:
    """``call_method`` surfaces (``"view"`` means ``x.view(...)``)."""
    return [Spec("method", n, opts) for n in names]


def module(*names: str, extract: Callable, named: bool = True) -> list:
    """``call_module`` surfaces; ``extract(module, node, qualname) -> args | None``."""
    return [Spec("module", n, {"extract": extract, "named": named}) for n in names]


def item(inner: str, index: int = 0, **opts: Any) -> list:
    """``getitem(inner(...), index)``: output ``index`` of a multi-output aten op."""
    return [Spec("item", inner, {**opts, "index": index})]


_FORM_OPTS = ("rename", "fixed", "guards", "ignore", "check", "convert", "fill", "named")


def _signature(spec: Spec, target: Any, qualname: str) -> Sig:
    text = spec.opts.get("sig")
    if text is not None:
        return parse_sig(text)
    sig = signature_of(qualname, target, spec.opts.get("overload"))
    if sig is None:
        raise TypeError(f"vocabulary: cannot read the signature of {qualname}; write sig=")
    return sig


def _common(spec: Spec, sig: Sig, params: dict, opname: str, qualname: str) -> dict:
    rename = dict(spec.opts.get("rename", {}))
    if "self" in sig.names and "self" not in params:
        rename.setdefault("self", "input")
    ignore = frozenset(spec.opts.get("ignore", ())) | ({"inplace"} & set(sig.names))
    guards = dict(spec.opts.get("guards", {}))
    for name in sig.names:  # a table bug must fail at import, not as a silent non-match
        if name not in guards and name not in ignore and rename.get(name, name) not in params:
            raise TypeError(f"vocabulary: {qualname} parameter {name!r} has no place in {opname}")
    defaults = {**sig.defaults, **spec.opts.get("defaults", {})}
    return dict(
        op=opname, signature=sig.names, rename=rename, fixed=dict(spec.opts.get("fixed", {})),
        guards=guards, defaults=defaults, ignore=ignore, qualname=qualname,
        varargs=sig.varargs, check=spec.opts.get("check"), convert=dict(spec.opts.get("convert", {})),
        kwonly=sig.kwonly, int_lists=sig.int_lists, fill=dict(spec.opts.get("fill", {})),
        named=spec.opts.get("named", True),
    )


def _build(spec: Spec, opname: str, params: dict) -> list:
    unknown = set(spec.opts) - set(_FORM_OPTS) - {"sig", "overload", "defaults", "index", "extract"}
    if unknown:
        raise TypeError(f"vocabulary: unknown options {sorted(unknown)} for {spec.name}")
    if spec.kind == "module":
        return [Module(opname, resolve(spec.name), spec.opts["extract"], qualname=spec.name,
                       named=spec.opts["named"])]
    if spec.kind == "item":
        inner = resolve(spec.name)
        common = _common(spec, _signature(spec, inner, spec.name), params, opname, spec.name)
        return [Item(inner_target=inner, index=spec.opts["index"], **common)]
    if spec.kind == "fn":
        target = resolve(spec.name)
        return [Fn(target=target, **_common(spec, _signature(spec, target, spec.name), params, opname, spec.name))]
    qualname = f"Tensor.{spec.name}"
    target = resolve(qualname)
    common = _common(spec, _signature(spec, target, qualname), params, opname, qualname)
    return [Method(method=spec.name, **common), Fn(target=target, **common)]


def _params(signature: str) -> tuple:
    sig = parse_sig(signature)
    return tuple(Param(n, sig.defaults.get(n, REQUIRED), n in sig.tensors) for n in sig.names)


def sig_params(sig: Sig, dropped: tuple = ()) -> tuple:
    """A target's signature as canonical ``Param``s: ``self`` is ``input`` (the forms
    rename it so), ``dropped`` names left out. How ops built from a schema get theirs."""
    return tuple(
        Param("input" if n == "self" else n, sig.defaults.get(n, REQUIRED), n in sig.tensors)
        for n in sig.names if n not in dropped
    )


def emittable(forms: tuple) -> dict:
    """qualified name -> the ``call_function`` form emission uses for it."""
    out = {}
    for form in forms:
        if isinstance(form, Fn):
            for qualname in (form.qualname, *form.aliases):
                out.setdefault(qualname, form)
    return out


def _no_facts(value: Any) -> None:
    return None


def _emitter(opdef_ref: list, spec: Any, dialect: str) -> Emitter:
    def choose(args: dict, facts: Callable | None = None) -> tuple:
        opdef = opdef_ref[0]
        full = opdef.normalize_call((), dict(args))
        if full is None:
            raise EmitError(f"{opdef.name}: arguments {sorted(args)} do not fit {opdef.param_names}")
        picked = spec(full, facts or _no_facts) if callable(spec) else spec
        if isinstance(picked, tuple):
            picked, full = picked
        return call_for(emittable(opdef.forms)[picked], full, opdef)

    choose.__qualname__ = f"emit_{dialect}"
    return Emitter(choose)


def op(name: str, signature: str, *specs: Any, torch: Any, aten: Any, commutative: bool = False,
       elementwise: bool = False, doc: str = "", writes: tuple = (), instances: Any = None) -> OpDef:
    """One canonical op: its signature (``"input: T, other: T, alpha=1"``), its
    surfaces, and how to emit it in each dialect (a qualified name of one of its
    ``fn``/``method`` surfaces, or ``f(args, facts) -> name`` or ``(name, args)``),
    and how verification builds calls of it (``instances``: an ``Instances``, or a
    family name)."""
    if isinstance(instances, str):
        instances = Instances(instances)
    return make_op(name, _params(signature), specs, torch=torch, aten=aten,
                   commutative=commutative, elementwise=elementwise, doc=doc, writes=writes,
                   instances=instances)


def make_op(name: str, params: tuple, specs: Any, *, torch: Any, aten: Any, commutative: bool = False,
            elementwise: bool = False, doc: str = "", writes: tuple = (), qualified: bool = False,
            instances: Any = None) -> OpDef:
    """``op`` with the signature given as ``Param``s and ``specs`` as a list of spec lists."""
    by_name = {p.name: p for p in params}
    forms, seen = [], {}
    for group in specs:
        for spec in group:
            for form in _build(spec, name, by_name):
                # one target called with several argument lists (torch.var(x, dim, unbiased) and
                # torch.var(x, dim, correction=c)) keeps a form per list
                key = (form.key, getattr(form, "index", None), getattr(form, "inner_target", None),
                       getattr(form, "signature", None))
                if key in seen:  # F.conv2d is torch.conv2d: one form, found by either name
                    at = seen[key]
                    forms[at] = attrs.evolve(forms[at], aliases=forms[at].aliases + (form.qualname,))
                    continue
                seen[key] = len(forms)
                forms.append(form)
    ref: list = []
    opdef = OpDef(name, params, commutative, elementwise, tuple(forms),
                  {"torch": _emitter(ref, torch, "torch"), "aten": _emitter(ref, aten, "aten")}, doc,
                  tuple(writes), qualified, instances)
    ref.append(opdef)
    targets = emittable(opdef.forms)
    for spec in (torch, aten):
        if isinstance(spec, str) and spec not in targets:
            raise TypeError(f"vocabulary: {name} emits {spec}, which is not one of its fn/method surfaces")
    return opdef
