"""AST -> rule text: the inverse of the parser, so ``parse_text(format_module(m)) == m``.

Used for messages that quote an expression (``option 'priority' must be an integer,
got 'x + 1'``), for ``rewrite explain``, and by the round-trip tests. Output is one
line per declaration; parentheses are added only where precedence needs them.

The printer recurses, about two frames a level: safe on every parsed program, whose
nesting the front end bounds (``rewrite.language.limits.MAX_NESTING``; the tools at
that limit are tested in ``tests/test_deep_nesting.py``).
"""

from __future__ import annotations

import math

from rewrite.language import ast

__all__ = ["format_expr", "format_rule", "format_schedule", "format_item", "format_module"]

# Binding strength, loosest first, matching the grammar's precedence ladder.
_OR, _AND, _NOT, _CMP, _AS, _POSTFIX = range(6)


def _level(e: object) -> int:
    if isinstance(e, ast.BoolOp):
        return _OR if e.op == "or" else _AND
    if isinstance(e, ast.Not):
        return _NOT
    if isinstance(e, ast.Compare):
        return _CMP
    if isinstance(e, (ast.As, ast.AsTuple)):
        return _AS
    return _POSTFIX


def _wrap(e: object, at_least: int) -> str:
    text = format_expr(e)
    return f"({text})" if _level(e) < at_least else text


def format_expr(e: object) -> str:
    """One expression as rule text."""
    if isinstance(e, ast.Var):
        return e.name
    if isinstance(e, ast.Wildcard):
        return "_"
    if isinstance(e, ast.Literal):
        return _literal(e.value)
    if isinstance(e, ast.DTypeLit):
        return f"torch.{e.name}"
    if isinstance(e, ast.TupleLit):
        items = [format_expr(i) for i in e.items]
        return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
    if isinstance(e, ast.ListLit):
        return f"[{', '.join(format_expr(i) for i in e.items)}]"
    if isinstance(e, ast.Call):
        parts = [format_expr(a) for a in e.args]
        parts += [f"{k.name}={format_expr(k.value)}" for k in e.kwargs]
        if e.rest:
            parts.append("...")
        return f"{_callee(e.op)}({', '.join(parts)})"
    if isinstance(e, ast.As):
        return f"{_wrap(e.expr, _POSTFIX)} as {e.name}"
    if isinstance(e, ast.AsTuple):
        return f"{_wrap(e.expr, _POSTFIX)} as ({', '.join(e.names)})"
    if isinstance(e, ast.Compare):
        return f"{_wrap(e.left, _AS)} {e.op} {_wrap(e.right, _AS)}"
    if isinstance(e, ast.BoolOp):
        # Same-op nesting is kept explicit so the tree shape round-trips.
        level = _OR if e.op == "or" else _AND
        return f" {e.op} ".join(_wrap(i, level + 1) for i in e.items)
    if isinstance(e, ast.Not):
        return f"not {_wrap(e.expr, _NOT)}"
    if isinstance(e, ast.Index):
        return f"{_wrap(e.expr, _POSTFIX)}[{format_expr(e.index)}]"
    return repr(e)


def _callee(op: ast.OpRef) -> str:
    if len(op.names) == 1:
        return op.names[0]
    return "(" + " | ".join(op.names) + ")"


def _literal(value: object) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        # No rule text means inf or nan (the parser refuses 1e400): printing `inf` would
        # read back as a pattern variable and silently change what the rule matches.
        raise ValueError(f"the float {value!r} cannot be written in the rule language")
    if isinstance(value, str):
        text = repr(value)  # Python escapes; the parser reads them back with literal_eval
        return text if text[0] == '"' else '"' + text[1:-1].replace('"', '\\"') + '"'
    return repr(value)


def format_schedule(s: ast.Schedule) -> str:
    items = [i.name if isinstance(i, ast.ScheduleRef) else format_schedule(i) for i in s.items]
    return f"{s.kind}({', '.join(items)})"


def format_rule(r: ast.Rule, doc: bool = True) -> str:
    """``rule name(options): pattern [where cond] => replacement`` on one line,
    preceded by its doc comment lines when ``doc``."""
    head = f"rule {r.name}"
    if r.options:
        opts = ", ".join(f"{o.name}={_option_value(o.value)}" for o in r.options)
        head += f"({opts})"
    text = f"{head}: {format_expr(r.pattern)}"
    if r.where is not None:
        text += f" where {format_expr(r.where)}"
    text += f" => {format_expr(r.replacement)}"
    if doc and r.doc:
        text = "\n".join(f"# {line}".rstrip() for line in r.doc.split("\n")) + "\n" + text
    return text


def _option_value(value: object) -> str:
    if isinstance(value, (ast.Var, ast.Wildcard, ast.Literal, ast.DTypeLit, ast.TupleLit, ast.ListLit,
                          ast.Call, ast.As, ast.AsTuple, ast.Compare, ast.BoolOp, ast.Not, ast.Index)):
        return format_expr(value)
    return _literal(value)


def format_item(item: object) -> str:
    """One declaration as rule text."""
    if isinstance(item, ast.Import):
        bindings = ", ".join(f"{b.name} = {format_expr(b.value)}" + (f" as {b.tag}" if b.tag else "")
                             for b in item.bindings)
        return f"import {_literal(item.path)}" + (f" with {bindings}" if bindings else "")
    if isinstance(item, ast.Param):
        return f"param {item.name}"
    if isinstance(item, ast.Family):
        return f"family {item.name} = {' | '.join(item.ops)}"
    if isinstance(item, ast.Rule):
        return format_rule(item)
    if isinstance(item, ast.RuleSetDecl):
        return f"ruleset {item.name} = {format_schedule(item.schedule)}"
    return repr(item)


def format_module(m: ast.Module) -> str:
    """A whole module, one declaration per line."""
    return "".join(format_item(i) + "\n" for i in m.items)
