"""Diagnostics: what the front end reports about a rule file, and how it prints.

Every problem the parser or the checker finds becomes a ``Diagnostic`` with a span,
a message, a stable code (documented in ``docs/language.md``) and an optional
``help`` line. They are collected, not raised one by one, so a user sees every
problem of a file at once; ``RuleError`` carries them all out of the loader.

The printed form follows ruff and mypy::

    rules/bad.rw:3:9: error: unknown op 'rleu' [E102]
        rule r: rleu(x) => x
                ^^^^
      help: did you mean 'relu'?
"""

from __future__ import annotations

import difflib
import functools
import re
from typing import Callable, Iterable

import attrs

from rewrite.language.ast import Span

__all__ = ["Diagnostic", "RuleError", "format_diagnostic", "did_you_mean", "printable", "sort_diagnostics"]


#: a quoted name longer than this is cut in a message (the source line is cut too)
_LONGEST_QUOTED = 200
_QUOTED = re.compile(r"'([^'\n]{%d,})'" % (_LONGEST_QUOTED + 1))


def _bounded(text: str) -> str:
    """``text`` with every quoted name over ``_LONGEST_QUOTED`` characters cut: a rule
    file's 200,000-character name must not make a 200,000-character message."""
    return _QUOTED.sub(lambda m: f"'{_middle_cut(m.group(1))}' ({len(m.group(1))} characters)", text)


def _middle_cut(name: str) -> str:
    """``name`` cut to ``_LONGEST_QUOTED`` characters in the middle: a path keeps its
    file name, and the cut name is short enough not to be cut again."""
    head = (_LONGEST_QUOTED - 3) // 2
    return f"{name[:head]}...{name[len(name) - (_LONGEST_QUOTED - 3 - head):]}"


@attrs.frozen
class Diagnostic:
    """One problem in a rule file.

    Attributes:
        span: where it is (1-based line and column; the caret underlines the span).
        message: one sentence naming the objects involved.
        code: a stable code such as ``E102`` (see ``docs/language.md``).
        help: a hint on how to fix it, printed as ``help: ...``.
        severity: ``"error"`` or ``"warning"``.
        related: ``(span, message)`` pairs printed as ``note:`` lines, e.g. where a
            duplicate name was first defined.
    """

    span: Span | None
    message: str = attrs.field(converter=_bounded)
    code: str
    help: str | None = attrs.field(default=None, converter=attrs.converters.optional(_bounded))
    severity: str = "error"
    related: tuple = ()

    def __str__(self) -> str:
        """The one-line form: ``path:line:col: error: message [code]``, with any
        character a terminal would act on escaped (a path or a name from a rule file
        may hold newlines and escape sequences: a forged line, a cleared screen)."""
        where = f"{self.span}: " if self.span is not None else ""
        return printable(f"{where}{self.severity}: {self.message} [{self.code}]")


def printable(text: str) -> str:
    """``text`` with every character that is not printable (control characters,
    newlines, escapes) written as its Python escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def format_diagnostic(d: Diagnostic, source: str | None = None) -> str:
    """The full form of a diagnostic: the one-line header, the source line with a
    caret underline (when ``source``, the text of ``d.span.path``, is given), the
    ``help:`` line and any ``note:`` lines."""
    lines = [str(d)]
    if d.span is not None and source is not None:
        lines.extend(_excerpt(d.span, source))
    if d.help:
        lines.append(printable(f"  help: {d.help}"))
    for span, note in d.related:
        lines.append(printable(f"  note: {span}: {note}"))
    return "\n".join(lines)


@functools.lru_cache(maxsize=8)
def source_lines(source: str) -> tuple:
    """The lines of a rule file as the grammar counts them: split at ``\n`` only
    (``str.splitlines`` also splits at form feeds, ``\x1c``, U+2028..., which the
    grammar treats as ordinary characters). Cached: a file with thousands of
    diagnostics is split once, not once per diagnostic."""
    return tuple(line[:-1] if line.endswith("\r") else line for line in source.split("\n"))


def _excerpt(span: Span, source: str) -> list:
    """The span's first source line, indented, with carets under the span."""
    text_lines = source_lines(source)
    if not 1 <= span.line <= len(text_lines):
        return []
    raw = text_lines[span.line - 1]
    col, end_col = span.col, span.end_col
    cut_before = cut_after = False
    if len(raw) > 4 * _EXCERPT_WIDTH:
        # a long line (a generated file, thousands of errors on one line): only the
        # part about the span is looked at, so each excerpt costs the same
        first = max(0, col - 1 - _EXCERPT_WIDTH)
        last = min(len(raw), first + 4 * _EXCERPT_WIDTH)
        cut_before, cut_after = first > 0, last < len(raw)
        raw, col, end_col = raw[first:last], col - first, end_col - first
    line = raw.expandtabs(4)
    start = len(raw[: max(col - 1, 0)].expandtabs(4))
    if span.end_line == span.line and end_col > col:
        end = len(raw[: end_col - 1].expandtabs(4))
    else:
        end = len(line.rstrip())
    width = max(end - start, 1)
    # Non-printable characters would garble the excerpt; show them as '?'.
    shown = "".join(c if c.isprintable() else "?" for c in line).rstrip()
    if len(shown) > _EXCERPT_WIDTH or cut_before or cut_after:  # the part around the span, marked as cut
        first = max(0, min(start - _EXCERPT_WIDTH // 3, len(shown) - _EXCERPT_WIDTH))
        last = first + _EXCERPT_WIDTH
        before = "..." if first or cut_before else ""
        after = "..." if last < len(shown) or cut_after else ""
        shown = before + shown[first:last] + after
        start = start - first + len(before)
        width = max(1, min(width, len(shown) - len(after) - start))
    return ["    " + shown, "    " + " " * start + "^" * width]


#: characters of a source line shown under a diagnostic (a generated line may be huge)
_EXCERPT_WIDTH = 120


def did_you_mean(name: str, candidates: Iterable[str], valid: Callable | None = None) -> str | None:
    """``"did you mean 'x'?"`` for the closest candidate to ``name``, or None.

    For a qualified name (``F.rleu``), when ``valid`` is given, the last part is
    matched against the candidates' last parts and the user's prefix is kept if
    ``valid(prefix.match)`` holds (``F.relu``), so the hint reads as they wrote it.
    """
    pool = sorted(set(candidates))
    if "." in name and valid is not None:
        prefix, _, last = name.rpartition(".")
        tails = sorted({c.rpartition(".")[2] for c in pool})
        for tail in difflib.get_close_matches(last, tails, n=3, cutoff=0.6):
            if valid(f"{prefix}.{tail}"):
                return f"did you mean '{prefix}.{tail}'?"
    close = difflib.get_close_matches(name, pool, n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else None


def sort_diagnostics(diags: Iterable[Diagnostic], file_order: Iterable[str] = ()) -> list:
    """Diagnostics in file order (as given), then by line and column."""
    order = {path: i for i, path in enumerate(file_order)}

    def key(d: Diagnostic) -> tuple:
        if d.span is None:
            return (-1, 0, 0)
        return (order.get(d.span.path, len(order)), d.span.line, d.span.col)

    return sorted(diags, key=key)


class RuleError(Exception):
    """Raised by the loader when a rule program has errors; holds all of them.

    Attributes:
        diagnostics: every problem found, in file and source order.
        sources: path -> text of every file read, to print source excerpts.

    ``str(err)`` is every diagnostic in full form followed by a summary line such as
    ``2 errors``.
    """

    def __init__(self, diagnostics: Iterable[Diagnostic], sources: dict | None = None):
        self.diagnostics = list(diagnostics)
        self.sources = dict(sources or {})
        self._text: str | None = None  # rendered on the first str(): thousands of excerpts cost
        super().__init__(self.summary())

    def _render(self) -> str:
        parts = [format_diagnostic(d, self.sources.get(d.span.path) if d.span else None)
                 for d in self.diagnostics]
        parts.append(self.summary())
        return "\n".join(parts)

    def summary(self) -> str:
        """``"2 errors"``, ``"1 error, 1 warning"``."""
        errors = sum(d.severity == "error" for d in self.diagnostics)
        warnings = len(self.diagnostics) - errors
        out = f"{errors} error{'s' * (errors != 1)}"
        if warnings:
            out += f", {warnings} warning{'s' * (warnings != 1)}"
        return out

    def __str__(self) -> str:
        if self._text is None:
            self._text = self._render()
        return self._text

    def __reduce__(self) -> tuple:
        # Exceptions pickle through their args; ours are the rendered text.
        return (RuleError, (self.diagnostics, self.sources))
