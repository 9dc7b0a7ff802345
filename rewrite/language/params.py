"""Parametrized rule files: ``param`` declarations bound by ``import ... with``.

One policy, several instances: ``rules/amp/policy.rw`` declares ``param lowp`` and
writes its rules with ``lowp`` where the low-precision dtype goes; ``amp_bf16.rw``
imports it ``with lowp = torch.bfloat16 as bf16`` and ``amp_fp16.rw`` ``with lowp =
torch.float16 as fp16``. A fix to a shared rule lands once.

Instantiating is substitution on the parsed file, before it is checked:

* every variable named like a parameter becomes the bound value (a literal: number,
  string, bool, None, dtype, or a tuple/list of them), so ``to(x, lowp)`` reads
  ``to(x, torch.bfloat16)``;
* with ``as tag``, the word ``lowp`` in the names the file declares (rules, rulesets,
  families, split at ``_``) becomes ``tag``: ``conv_lowp_nobias`` is
  ``conv_bf16_nobias``, so two instances can live in one program and keep the rule
  names users already know. A declaration that depends on ``lowp`` (uses it, or
  names a declaration that does or that is renamed) without the word in its name
  gets ``_tag`` appended (``scale_cast`` -> ``scale_cast_bf16``): its instances
  differ, so they need different names;
* a declaration that does not depend on any parameter is the same in every
  instance (``fold_cast``): ``instantiate`` reports it as shared, and the loader
  keeps one copy, as it does for a file imported twice.

A parametrized file is only usable through an import that binds every parameter;
checking it then reports errors at the policy file's own lines.
"""

from __future__ import annotations

from typing import Any

import attrs

from rewrite.language import ast
from rewrite.language.diagnostics import Diagnostic, did_you_mean

__all__ = ["declared_params", "binding_key", "instantiate", "unbound_diagnostics", "Instance"]

_LITERALS = (ast.Literal, ast.DTypeLit)


@attrs.frozen
class Instance:
    """What ``instantiate`` makes of a parametrized file for one import.

    Attributes:
        module: the file with the bindings substituted and its names renamed (the
            file as parsed when there are diagnostics).
        diagnostics: problems of the bindings (E410, E411, E412) and of the
            declarations (E413).
        shared: names (after renaming) of the declarations that depend on no
            parameter: the same declaration in every instance of the file.
        uses: span of each use of a parameter -> its ``ast.Binding``: the value
            substituted there carries that span, so a check of the value can name
            the binding.
    """

    module: ast.Module
    diagnostics: list
    shared: frozenset = frozenset()
    uses: dict = attrs.field(factory=dict)


def declared_params(module: ast.Module) -> list:
    """The ``param`` declarations of a parsed file."""
    return [item for item in module.items if isinstance(item, ast.Param)]


def binding_key(bindings: tuple) -> str:
    """A stable text for a set of bindings: one loaded instance per distinct key."""
    from rewrite.language.printer import format_expr
    return ",".join(f"{b.name}={format_expr(b.value)} as {b.tag}" for b in sorted(bindings, key=lambda b: b.name))


def _is_literal(value: Any) -> bool:
    if isinstance(value, _LITERALS):
        return True
    return isinstance(value, (ast.TupleLit, ast.ListLit)) and all(_is_literal(i) for i in value.items)


def declaration_diagnostics(module: ast.Module) -> list:
    """E413 for a parameter declared twice, or named ``_`` (the wildcard: a binding
    of it would change nothing, and ``mul(x, _)`` would still match anything)."""
    diags, seen = [], set()
    for p in declared_params(module):
        if p.name == "_":
            diags.append(Diagnostic(p.span, "a parameter cannot be named '_', the wildcard", "E413",
                                    help="name it: param scale"))
        elif p.name in seen:
            diags.append(Diagnostic(p.span, f"parameter '{p.name}' declared twice", "E413",
                                    help="declare each parameter once"))
        seen.add(p.name)
    return diags


def unbound_diagnostics(module: ast.Module, display: str) -> list:
    """E411 for each parameter of a file loaded without an import that binds it."""
    return declaration_diagnostics(module) + [Diagnostic(p.span, f"'{display}' takes parameter '{p.name}', which nothing binds", "E411",
                       help=f'load it through an import that binds it: import "{display}" with {p.name} = ...')
            for p in declared_params(module)]


def instantiate(module: ast.Module, bindings: tuple, display: str, import_span: Any) -> Instance:
    """The instance of ``module`` that an import with ``bindings`` makes."""
    params = {p.name for p in declared_params(module)}
    diags: list = declaration_diagnostics(module)
    bound: dict = {}
    for b in bindings:
        if b.name not in params:
            hint = did_you_mean(b.name, params) or (
                f"'{display}' declares {', '.join(sorted(params))}" if params else f"'{display}' declares no param")
            diags.append(Diagnostic(b.span, f"'{display}' has no parameter '{b.name}'", "E410", help=hint))
        elif b.name in bound:
            diags.append(Diagnostic(b.span, f"parameter '{b.name}' bound twice", "E410",
                                    help="bind each parameter once"))
        elif not _is_literal(b.value):
            diags.append(Diagnostic(b.value.span or b.span, f"parameter '{b.name}' must be bound to a literal",
                                    "E412", help="a number, string, True/False/None, a dtype such as "
                                                 "torch.bfloat16, or a tuple or list of them"))
        else:
            bound[b.name] = b
    for name in sorted(params - {b.name for b in bindings}):
        diags.append(Diagnostic(import_span, f"'{display}' takes parameter '{name}'; this import does not bind it",
                                "E411", help=f'import "{display}" with {name} = ...'))
    if diags:
        return Instance(module, diags)
    values = {name: b.value for name, b in bound.items()}
    words = {name: b.tag for name, b in bound.items() if b.tag}
    order = [p.name for p in declared_params(module)]
    depends = _dependencies(module, set(values), words)
    renames = {}
    for n, params in depends.items():
        renamed = _rename(n, words)
        suffix = [words[p] for p in order if p in params and p in words and p not in n.split("_")]
        renames[n] = "_".join([renamed, *suffix])
    uses: dict = {}
    items = tuple(_substitute(item, values, renames, uses) for item in module.items if not isinstance(item, ast.Param))
    shared = frozenset(renames[n] for n, params in depends.items() if not params)
    return Instance(attrs.evolve(module, items=items), [], shared,
                    {span: bound[name] for span, name in uses.items()})


def _rename(name: str, words: dict) -> str:
    return "_".join(words.get(part, part) for part in name.split("_"))


def _dependencies(module: ast.Module, params: set, words: dict) -> dict:
    """name -> the parameters each declaration of ``module`` depends on: those it
    uses as variables, and through the declarations it names (a ruleset's rules, a
    rule's or family's families), theirs and the words that rename them."""
    declared = {item.name: item for item in module.items if isinstance(item, (ast.Rule, ast.RuleSetDecl, ast.Family))}
    direct: dict = {}
    refs: dict = {}
    for name, item in declared.items():
        used: set = set()
        named: set = set()
        _scan(item, params, used, named)
        direct[name] = used
        refs[name] = named & set(declared)
    out = {name: set(direct[name]) for name in declared}
    changed = True
    while changed:  # to a fixpoint: a ruleset of a ruleset of a dependent rule depends too
        changed = False
        for name in declared:
            for ref in refs[name]:
                more = out[ref] | {p for p in words if p in ref.split("_")}
                if not more <= out[name]:
                    out[name] |= more
                    changed = True
    return {name: frozenset(v) for name, v in out.items()}


def _scan(node: Any, params: set, used: set, named: set) -> None:
    """Collect the parameter variables under ``node`` and the names it refers to."""
    if isinstance(node, tuple):
        for n in node:
            _scan(n, params, used, named)
        return
    if isinstance(node, ast.Var) and node.name in params:
        used.add(node.name)
    elif isinstance(node, ast.ScheduleRef):
        named.add(node.name)
    elif isinstance(node, ast.OpRef):
        named.update(node.names)
    elif isinstance(node, ast.Family):
        named.update(node.ops)
    if not attrs.has(type(node)):
        return
    for field in attrs.fields(type(node)):
        if field.name in ("span", "name_span", "name_spans", "op_spans", "name", "names", "ops"):
            continue
        value = getattr(node, field.name)
        if isinstance(value, tuple) or attrs.has(type(value)):
            _scan(value, params, used, named)


def _substitute(node: Any, values: dict, renames: dict, uses: dict) -> Any:
    """``node`` with parameter variables replaced by their values and the file's own
    declarations (and references to them) renamed."""
    if isinstance(node, tuple):
        return tuple(_substitute(n, values, renames, uses) for n in node)
    if isinstance(node, ast.Var) and node.name in values:
        if node.span is not None:
            uses[node.span] = node.name
        return attrs.evolve(values[node.name], span=node.span)  # errors point at the use
    if isinstance(node, (ast.Rule, ast.RuleSetDecl, ast.Family, ast.ScheduleRef)):
        node = attrs.evolve(node, name=renames.get(node.name, node.name))
    elif isinstance(node, ast.OpRef):
        node = attrs.evolve(node, names=tuple(renames.get(n, n) for n in node.names))
    if not attrs.has(type(node)):
        return node
    changes = {}
    for field in attrs.fields(type(node)):
        if field.name in ("span", "name_span", "name_spans", "op_spans", "name", "names"):
            continue
        value = getattr(node, field.name)
        if isinstance(value, tuple) or attrs.has(type(value)):
            new = _substitute(value, values, renames, uses)
            if new is not value:
                changes[field.name] = new
    if isinstance(node, ast.Family):
        changes["ops"] = tuple(renames.get(n, n) for n in node.ops)
    if isinstance(node, ast.RuleOption) and isinstance(changes.get("value"), ast.Literal):
        changes["value"] = changes["value"].value  # an option holds the bare value, as parsed
    return attrs.evolve(node, **changes) if changes else node
