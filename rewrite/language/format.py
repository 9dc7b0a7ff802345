"""``rewrite fmt``: a rule file in canonical form, comments kept.

``format_source(text)`` parses the text, prints each declaration with
``rewrite.language.printer`` and lays long ones out over lines at ``WIDTH``
columns; comments, blank-line grouping and declarations with comments inside them
are kept as written. It never changes the parsed program (see ``format_source``).

Example::

    >>> print(format_source("# x * 1 -> x\nrule   mul_one :mul(x,1)=>x\n"), end="")
    # x * 1 -> x
    rule mul_one: mul(x, 1) => x
"""

from __future__ import annotations

from typing import Any

import attrs

from rewrite.language import ast
from rewrite.language.diagnostics import source_lines
from rewrite.language.parser import parse_text
from rewrite.language.printer import format_expr, format_item, format_rule, format_schedule
from rewrite.language.program import one_line_end

__all__ = ["format_source", "WIDTH"]

#: Lines are wrapped at this many columns (a longer line is one that cannot break).
WIDTH = 100


def format_source(text: str, path: str = "<string>") -> str:
    """A rule file's text in canonical form; ``rewrite fmt`` prints or writes it.

    Each declaration is printed by ``rewrite.language.printer`` (long rules laid out
    over lines, calls wrapped at ``WIDTH`` columns with arguments aligned after the
    bracket); comments and blank-line grouping are kept. A declaration with a
    comment inside it is kept as written, so no comment is ever lost.

    The guarantee: ``parse_text(format_source(t)) == parse_text(t)`` for every text
    the parser accepts (same declarations, same order; only spans differ), and
    ``format_source`` is idempotent. fmt never changes the parsed program, so it is
    safe to run on any rule file at any time, and a formatting-only diff never needs
    review for meaning.

    Args:
        text: the rule file's contents.
        path: the name used in diagnostics.

    Raises:
        RuleError: when the parser rejects the text (the same positioned
            diagnostics ``rewrite check`` prints).
    """
    text = one_line_end(text)  # line breaks as a load reads them (U+2028 ends a line there too)
    module = parse_text(text, path)
    # lines as the grammar counts them (``\n`` only): ``str.splitlines`` also splits at
    # form feeds, ``\x1c``, U+2028..., which would end a comment early and make what
    # follows it in the same grammar line live code
    lines = list(source_lines(text))
    if lines and lines[-1] == "" and text.endswith("\n"):
        lines.pop()
    out: list = []
    done = 0  # source lines consumed
    items = module.items
    for i, item in enumerate(items):
        span = item.span
        out += _gap(lines[done:span.line - 1], bool(out))
        inner, trailing = _comments_in(lines, span)
        if i + 1 < len(items) and items[i + 1].span.line == span.end_line:
            trailing = ""  # the comment ends the line after the next declaration: it is that one's
        if inner:
            out += _as_written(lines, span)
        else:
            out += _layout_item(item, lines).split("\n")
        if trailing:
            out[-1] = f"{out[-1]}  {trailing}"
        done = span.end_line
    out += _gap(lines[done:], bool(out))
    while out and not out[-1]:
        out.pop()
    return "\n".join(out) + "\n" if out else ""


def _gap(lines: list, after: bool) -> list:
    """Comment and blank lines between declarations: comments stripped of
    surrounding space, runs of blank lines collapsed to one (none at the top)."""
    out: list = []
    blank = False
    for line in lines:
        line = line.strip()
        if not line:
            blank = True
            continue
        if blank and (out or after):
            out.append("")
        out.append(line)
        blank = False
    if blank and (out or after):
        out.append("")
    return out


def _comment_col(line: str) -> int | None:
    """Index of the ``#`` that starts a comment on ``line`` (not one inside a string)."""
    quote, escaped = None, False
    for i, ch in enumerate(line):
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return i
    return None


def _comments_in(lines: list, span: Any) -> tuple:
    """(whether a comment lies inside the span, the comment trailing its last line)."""
    inner, trailing = False, ""
    for n in range(span.line, span.end_line + 1):
        col = _comment_col(lines[n - 1])
        if col is None:
            continue
        after_start = n > span.line or col >= span.col - 1
        if n == span.end_line and col >= span.end_col - 1:
            trailing = lines[n - 1][col:].strip()
        elif after_start:
            inner = True
    return inner, trailing


def _layout_item(item: Any, lines: list) -> str:
    """One line when it fits; else the rule's body on one line under its header;
    else pattern, ``where`` and ``=>`` on lines of their own, wrapped. A declaration
    nested too deeply to print within Python's recursion limit (possible only for
    trees deeper than ``limits.MAX_NESTING``, which the parser should reject) is
    kept as written (``lines``: the file's lines): fmt never fails on a file the
    parser accepted, and never changes what it means."""
    try:
        return _layout_decl(item)
    except RecursionError:
        return "\n".join(_as_written(lines, item.span))


def _as_written(lines: list, span: Any) -> list:
    """The source lines of ``span``, cut at its first and last column."""
    body = [lines[span.line - 1][span.col - 1:]] + lines[span.line:span.end_line]
    body[-1] = body[-1][: len(body[-1]) - (len(lines[span.end_line - 1]) - span.end_col + 1)]
    return [line.rstrip() for line in body]


def _layout_decl(item: Any) -> str:
    if isinstance(item, ast.RuleSetDecl):
        return "\n".join(_layout_schedule(item.schedule, f"ruleset {item.name} = "))
    if not isinstance(item, ast.Rule):
        return format_item(item)
    one = format_rule(item, doc=False)
    if len(one) <= WIDTH:
        return one
    blank = ast.Var("_")
    head = format_rule(attrs.evolve(item, pattern=blank, where=None, replacement=blank), doc=False)
    head = head[: -len(" _ => _")]
    body = one[len(head) + 1:]
    if 4 + len(body) <= WIDTH:
        return f"{head}\n    {body}"
    lines = [head]
    first = item.where is not None and f"    {format_expr(item.pattern)} where {format_expr(item.where)}"
    if first and len(first) <= WIDTH:
        lines.append(first)
    else:
        lines += _layout(item.pattern, 4, "")
        if item.where is not None:
            lines += _layout(item.where, 4, "where ")
    lines += _layout(item.replacement, 4, "=> ")
    return "\n".join(lines)


def _layout_schedule(s: Any, prefix: str, col: int = 0, suffix: str = "") -> list:
    """A schedule's items packed greedily, continuation lines aligned after ``(``;
    nested schedules that do not fit wrap the same way."""
    text = " " * col + prefix + format_schedule(s) + suffix
    if len(text) <= WIDTH or not s.items:
        return [text]
    head = " " * col + prefix + s.kind + "("
    inner = len(head)
    lines, cur, fresh = [], head, True
    for n, item in enumerate(s.items):
        end = ")" + suffix if n == len(s.items) - 1 else ","
        piece = (item.name if isinstance(item, ast.ScheduleRef) else format_schedule(item)) + end
        if len(cur) + (0 if fresh else 1) + len(piece) <= WIDTH:
            cur, fresh = cur + ("" if fresh else " ") + piece, False
            continue
        if not fresh:
            lines.append(cur)
            cur, fresh = " " * inner, True
        if len(cur) + len(piece) <= WIDTH or isinstance(item, ast.ScheduleRef):
            cur, fresh = cur + piece, False
            continue
        sub = _layout_schedule(item, "", inner, end)
        sub[0] = cur + sub[0][inner:]
        lines += sub[:-1]
        cur, fresh = sub[-1], False
    return lines + [cur]


def _layout(e: Any, col: int, prefix: str, suffix: str = "") -> list:
    """``e`` as lines starting at column ``col`` (first line after ``prefix``), ending
    with ``suffix``; calls wrap their arguments, a long ``and``/``or`` its operands."""
    text = " " * col + prefix + format_expr(e) + suffix
    if len(text) <= WIDTH:
        return [text]
    name_suffix = ""
    if isinstance(e, ast.As) and isinstance(e.expr, ast.Call):
        e, name_suffix = e.expr, f" as {e.name}"
    elif isinstance(e, ast.AsTuple) and isinstance(e.expr, ast.Call):
        e, name_suffix = e.expr, f" as ({', '.join(e.names)})"
    if isinstance(e, ast.Call):
        return _layout_call(e, col, prefix, name_suffix + suffix)
    if isinstance(e, ast.ListLit) and e.items:  # a list of calls (cat's operands): wrapped as arguments
        head = " " * col + prefix + "["
        return _pack_args([("", i) for i in e.items], head, len(head), suffix, fresh=True, closer="]")
    if isinstance(e, ast.BoolOp):
        items = [f"({format_expr(i)})" if isinstance(i, ast.BoolOp) and (e.op == "and" or i.op == "or")
                 else format_expr(i) for i in e.items]
        lines, cur = _operand(e.items[0], items[0], col, prefix)
        for expr, item in zip(e.items[1:], items[1:]):
            piece = f" {e.op} {item}"
            if len(cur) + len(piece) > WIDTH:
                lines.append(cur)
                more, cur = _operand(expr, item, col + len(prefix), f"{e.op} ")
                lines += more
            else:
                cur += piece
        return lines + [cur + suffix]
    return [text]


def _operand(expr: Any, text: str, col: int, prefix: str) -> tuple:
    """An ``and``/``or`` operand starting a line at ``col`` after ``prefix``: (the
    lines it fills, the line it ends on). A call too long for the line wraps its
    arguments; anything else stays whole."""
    if col + len(prefix) + len(text) <= WIDTH or not isinstance(expr, ast.Call):
        return [], " " * col + prefix + text
    sub = _layout(expr, col, prefix)
    return sub[:-1], sub[-1]


_MIN_ROOM = 40  # columns after a call's ( below which its arguments hang
_MIN_GAIN = 8  # columns hanging must gain for a first argument that does not fit after the (


def _layout_call(e: Any, col: int, prefix: str, suffix: str) -> list:
    """Arguments packed greedily, continuation lines aligned after the ``(``; when
    the ``(`` leaves less than ``_MIN_ROOM`` columns (a long qualified callee, deep
    nesting), the arguments hang on the next lines, indented four from the call's
    column; they hang too when the first argument does not fit after the ``(``
    and hanging moves it left by more than ``_MIN_GAIN`` (a call nested in a call would
    start far right). One layout per call, chosen
    before laying out the arguments: trying both
    would double the work at every level of nesting."""
    callee = e.op.names[0] if len(e.op.names) == 1 else "(" + " | ".join(e.op.names) + ")"
    head = " " * col + prefix + callee + "("
    args = [("", a) for a in e.args] + [(f"{k.name}=", k.value) for k in e.kwargs]
    if e.rest:
        args.append(("", None))
    if not args:
        return [head + ")" + suffix]
    hang = col + 4
    kw, first = args[0]
    first_fits = len(head) + len(kw) + len("..." if first is None else format_expr(first)) + 1 <= WIDTH
    if (WIDTH - len(head) < _MIN_ROOM or not first_fits and len(head) > hang + _MIN_GAIN) \
            and len(head) > hang:  # decided up front
        return [head] + _pack_args(args, " " * hang, hang, suffix, fresh=True)
    return _pack_args(args, head, len(head), suffix, fresh=True)


def _pack_args(args: list, cur: str, inner: int, suffix: str, fresh: bool, closer: str = ")") -> list:
    """``args`` after ``cur`` (the head or an indent), continuation lines at ``inner``."""
    lines = []
    for i, (kw, value) in enumerate(args):
        end = closer + suffix if i == len(args) - 1 else ","
        piece = kw + ("..." if value is None else format_expr(value)) + end
        sep = "" if fresh else " "
        if len(cur) + len(sep) + len(piece) <= WIDTH:
            cur, fresh = cur + sep + piece, False
            continue
        if not fresh:
            lines.append(cur)
            cur, fresh = " " * inner, True
        if len(cur) + len(piece) <= WIDTH or value is None:
            cur, fresh = cur + piece, False
            continue
        sub = _layout(value, inner, kw, end)
        sub[0] = cur + sub[0][inner:]  # cur is the head or the continuation indent
        lines += sub[:-1]
        cur, fresh = sub[-1], False
    return lines + [cur]
