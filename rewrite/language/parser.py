"""Rule text -> AST: the Lark parser and the one Transformer that builds ``ast`` records.

The grammar lives in ``grammar/rules.lark`` (shipped inside the wheel as
``rewrite/_grammar/rules.lark``). It is LALR(1) with a basic lexer, built once and
cached. Lark's exceptions never leave this module: a parse error becomes a
``Diagnostic`` (``rewrite.language.syntax`` turns typical mistakes into friendly
messages) and ``parse_text`` raises ``RuleError``.

Example::

    >>> m = parse_text("rule mul_one: mul(x, 1) => x")
    >>> m.items[0].pattern
    Call(op=OpRef(names=('mul',)), args=(Var(name='x'), Literal(value=1)), kwargs=(), rest=False)
"""

from __future__ import annotations

import ast as _pyast
import functools
import math
import warnings
from importlib import resources
from pathlib import Path

import lark
from lark import Token, Transformer, v_args

from rewrite.language import ast
from rewrite.language.diagnostics import Diagnostic, RuleError, did_you_mean, source_lines
from rewrite.language.limits import nesting_diagnostic
from rewrite.language.syntax import syntax_diagnostic

__all__ = ["parse_text", "parse_module", "grammar_path", "DTYPES"]

# torch dtype attribute names a rule may write as ``torch.NAME``.
DTYPES = frozenset({
    "float32", "float", "float64", "double", "float16", "half", "bfloat16",
    "int8", "uint8", "int16", "short", "int32", "int", "int64", "long", "bool",
    "uint16", "uint32", "uint64", "complex32", "chalf", "complex64", "cfloat",
    "complex128", "cdouble", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
    "float8_e5m2fnuz", "qint8", "quint8", "qint32", "quint4x2",
})

# Lowercase spellings of the Python literals: a likely slip, never a variable name.
_LOWER_LITERALS = {"true": "True", "false": "False", "none": "None", "null": "None"}

#: torch's constants that are not dtypes, which the language has no literal for
_TORCH_CONSTANTS = {
    **dict.fromkeys(("contiguous_format", "channels_last", "channels_last_3d", "preserve_format",
                     "legacy_contiguous_format"), "memory format"),
    **dict.fromkeys(("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "jagged",
                     "_mkldnn"), "layout"),
    # torch's dtypes of sub-byte or packed bits, which no op of the vocabulary computes in
    **dict.fromkeys(("bit", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2", "float4_e2m1fn_x2", "float8_e8m0fnu",
                     "quint2x4", *(f"int{i}" for i in range(1, 8)), *(f"uint{i}" for i in range(1, 8))),
                    "dtype of packed bits"),
    **dict.fromkeys(("per_tensor_affine", "per_channel_affine", "per_tensor_symmetric", "per_channel_symmetric",
                     "per_channel_affine_float_qparams"), "quantization scheme"),
}


def grammar_path() -> Path:
    """Where ``rules.lark`` is: inside the installed package (``rewrite/_grammar``)
    when packaged, else the repository's top-level ``grammar/`` directory."""
    try:
        packaged = resources.files("rewrite._grammar") / "rules.lark"
        if packaged.is_file():
            return Path(str(packaged))
    except (ImportError, TypeError):
        pass  # running from a source checkout: no rewrite._grammar package
    return Path(__file__).resolve().parents[2] / "grammar" / "rules.lark"


@functools.lru_cache(maxsize=1)
def _parser() -> lark.Lark:
    return lark.Lark(
        grammar_path().read_text(encoding="utf-8"),
        parser="lalr",
        lexer="basic",
        propagate_positions=True,
        maybe_placeholders=True,
    )


def parse_text(text: str, path: str = "<string>") -> ast.Module:
    """Parse one rule file's text into an ``ast.Module`` (no name checking).

    Args:
        text: the rule file's contents.
        path: the name used in spans and diagnostics.

    Returns:
        The module's declarations in source order.

    Raises:
        RuleError: on syntax errors, with every diagnostic found.
    """
    module, diags = parse_module(text, path)
    if diags:
        raise RuleError(diags, {path: text})
    return module


def parse_module(text: str, path: str) -> tuple:
    """``(module or None, diagnostics)``: the non-raising form used by the loader."""
    parser = _parser()
    try:
        tree = parser.parse(text)
    except lark.exceptions.LarkError as exc:
        return None, [syntax_diagnostic(exc, text, path, parser)]
    except RecursionError:
        return None, [_too_deep(path)]
    too_deep = nesting_diagnostic(tree, path)
    if too_deep is not None:
        return None, [too_deep]
    builder = _Builder(path, text)
    try:
        items = builder.transform(tree)
    except lark.exceptions.VisitError as exc:
        if isinstance(exc.orig_exc, RecursionError):
            return None, [_too_deep(path)]
        raise exc.orig_exc from None  # a bug in _Builder: show it, not Lark's wrapper
    except RecursionError:
        return None, [_too_deep(path)]
    if builder.errors:
        return None, builder.errors
    return ast.Module(path, tuple(items), source=text), []


def _too_deep(path: str) -> Diagnostic:
    return Diagnostic(ast.Span(path, 1, 1, 1, 1), "expression nested too deeply", "E001",
                      help="split the rule into smaller rules")


def _span(path: str, meta: object) -> ast.Span:
    return ast.Span(path, meta.line, meta.column, meta.end_line, meta.end_column)


class _Dotted:
    """A dotted name and its span, between the ``dotted`` rule and its consumer."""

    __slots__ = ("text", "span")

    def __init__(self, text: str, span: ast.Span):
        self.text, self.span = text, span


@v_args(meta=True)
class _Builder(Transformer):
    """Parse tree -> AST. Errors the grammar cannot express (argument order, bad
    value names) are collected in ``errors`` rather than raised."""

    def __init__(self, path: str, text: str):
        super().__init__()
        self.path = path
        self.lines = list(source_lines(text))
        self.errors: list = []

    def _s(self, meta: object) -> ast.Span:
        return _span(self.path, meta)

    def _tok(self, tok: Token) -> ast.Span:
        return ast.Span(self.path, tok.line, tok.column, tok.end_line, tok.end_column)

    def _error(self, span: ast.Span, message: str, code: str, help: str | None = None) -> None:
        self.errors.append(Diagnostic(span, message, code, help))

    # ---------------------------------------------------------- declarations

    def start(self, meta, items):
        return items

    def import_decl(self, meta, children):
        tok, *bindings = children
        return ast.Import(self._string(tok), span=self._s(meta),
                          bindings=tuple(b for b in bindings if b is not None))

    def binding(self, meta, children):
        name, value = children
        tag = None
        if isinstance(value, ast.As):  # `lowp = torch.bfloat16 as bf16`
            value, tag = value.expr, value.name
        return ast.Binding(str(name), value, tag, span=self._s(meta))

    def param_decl(self, meta, children):
        (name,) = children
        return ast.Param(str(name), span=self._s(meta))

    def family_decl(self, meta, children):
        name, *members = children
        return ast.Family(str(name), tuple(m.text for m in members), span=self._s(meta),
                          name_span=self._tok(name), op_spans=tuple(m.span for m in members))

    def rule_decl(self, meta, children):
        name, options, pattern, where, replacement = children
        return ast.Rule(str(name), pattern, where, replacement, tuple(options or ()),
                        doc=self._doc_above(meta.line, meta.column), span=self._s(meta), name_span=self._tok(name))

    def rule_options(self, meta, children):
        return tuple(c for c in children if c is not None)

    def option(self, meta, children):
        name, value = children
        if isinstance(value, ast.Literal):
            value = value.value
        return ast.RuleOption(str(name), value, span=self._s(meta))

    def where_clause(self, meta, children):
        return children[0]

    def ruleset_decl(self, meta, children):
        name, schedule = children
        return ast.RuleSetDecl(str(name), schedule, span=self._s(meta), name_span=self._tok(name))

    def schedule(self, meta, children):
        kind, *items = children
        return ast.Schedule(str(kind), tuple(i for i in items if i is not None), span=self._s(meta))

    def sched_ref(self, meta, children):
        return ast.ScheduleRef(str(children[0]), span=self._s(meta))

    def _doc_above(self, line: int, column: int) -> str:
        """The comment lines directly above line ``line`` (1-based), ``#`` stripped; none
        for a declaration that does not start its line (the comment is the first one's)."""
        if self.lines[line - 1][: column - 1].strip():
            return ""
        doc = []
        i = line - 2
        while i >= 0 and self.lines[i].lstrip().startswith("#"):
            text = self.lines[i].strip()[1:]  # trailing blanks are no part of it (``fmt`` drops them)
            doc.append(text[1:] if text.startswith(" ") else text)
            i -= 1
        return "\n".join(reversed(doc))

    # ---------------------------------------------------------- expressions

    def or_test(self, meta, children):
        return ast.BoolOp("or", tuple(children), span=self._s(meta))

    def and_test(self, meta, children):
        return ast.BoolOp("and", tuple(children), span=self._s(meta))

    def not_op(self, meta, children):
        return ast.Not(children[0], span=self._s(meta))

    def compare(self, meta, children):
        left, op, right = children
        return ast.Compare(op, left, right, span=self._s(meta))

    def comp_op(self, meta, children):
        return " ".join(str(t) for t in children)

    def as_name(self, meta, children):
        expr, name = children
        return ast.As(expr, str(name), span=self._s(meta))

    def as_tuple(self, meta, children):
        expr, *names = (c for c in children if c is not None)
        return ast.AsTuple(expr, tuple(str(n) for n in names), span=self._s(meta),
                           name_spans=tuple(self._tok(n) for n in names))

    def index(self, meta, children):
        expr, idx = children
        return ast.Index(expr, idx, span=self._s(meta))

    def callee(self, meta, children):
        return ast.OpRef(tuple(c.text for c in children), span=self._s(meta),
                         name_spans=tuple(c.span for c in children))

    def member(self, meta, children):
        return str(children[0])

    def dotted(self, meta, children):
        return _Dotted(".".join(str(c) for c in children), self._s(meta))

    def call(self, meta, children):
        op, arguments = children
        args, kwargs, rest, misplaced = [], [], None, False
        for item in arguments or ():
            if item is None:
                continue
            if misplaced:
                continue  # one report per call is enough
            if rest is not None:
                self._error(rest, "'...' must be the last argument of a call", "E009",
                            help="move '...' to the end: it stands for the arguments not written")
                misplaced = True
            elif isinstance(item, Token):  # ELLIPSIS
                rest = self._tok(item)
            elif isinstance(item, ast.Keyword):
                kwargs.append(item)
            elif kwargs:
                self._error(item.span, "positional argument after a keyword argument", "E009",
                            help="write positional arguments first, then name=value arguments")
                misplaced = True
            else:
                args.append(item)
        return ast.Call(op, tuple(args), tuple(kwargs), rest is not None, span=self._s(meta))

    def arguments(self, meta, children):
        return children

    def keyword(self, meta, children):
        name, value = children
        return ast.Keyword(str(name), value, span=self._s(meta))

    def name(self, meta, children):
        (dotted,) = children
        text, span = dotted.text, dotted.span
        if text == "_":
            return ast.Wildcard(span=span)
        if "." not in text:
            if text in _LOWER_LITERALS:
                fix = _LOWER_LITERALS[text]
                self._error(span, f"'{text}' is not a literal; write '{fix}'", "E010",
                            help="literals use Python spelling: True, False, None")
            return ast.Var(text, span=span)
        head, _, attr = text.partition(".")
        if head == "torch" and attr in DTYPES:
            return ast.DTypeLit(attr, span=span)
        kind = _TORCH_CONSTANTS.get(attr) if head == "torch" else None
        if kind is not None:
            self._error(span, f"'{text}' is a {kind}, which rules cannot write; the dtypes of docs/language.md "
                              "are the literals of torch (torch.float32, ...)", "E010",
                        help="in a pattern, bind the argument to a variable or '_' (or leave it out, for its "
                             "default)")
        elif head == "torch" and "." not in attr:
            hint = did_you_mean(attr, DTYPES)
            self._error(span, f"unknown dtype '{text}'", "E010",
                        help=hint.replace("'", "'torch.", 1) if hint else "dtypes are written torch.float32, torch.int64, ...")
        else:
            self._error(span, f"'{text}' is not a value; a qualified name can only be called", "E010",
                        help=f"call it, '{text}(...)', or bind a variable in the pattern")
        return ast.Var(text, span=span)

    def int_lit(self, meta, children):
        span = self._s(meta)
        try:
            value = int(children[0])
        except ValueError:  # longer than Python's int-string conversion limit
            self._error(span, "integer literal is too long", "E010", help="write a shorter number")
            return ast.Literal(0, span=span)
        if not -2 ** 63 <= value < 2 ** 63:  # the sign is part of the literal
            self._error(span, f"integer literal {children[0]} is out of range (graphs hold 64-bit integers)",
                        "E010", help="write a number from -9223372036854775808 to 9223372036854775807")
            return ast.Literal(0, span=span)
        return ast.Literal(value, span=span)

    def float_lit(self, meta, children):
        span = self._s(meta)
        value = float(children[0])
        if not math.isfinite(value):  # 1e400 overflows: `fmt` could only print it as inf
            self._error(span, f"float literal {children[0]} is out of range (it overflows to infinity)", "E010",
                        help="write a finite number; the largest float is about 1.8e308")
            return ast.Literal(0.0, span=span)
        if value == 0.0 and any(c in "123456789" for c in children[0].lower().split("e")[0]):
            # 1e-400 underflows to 0.0: a pattern's mul(x, 1e-400) would match mul(x, 0.0)
            self._error(span, f"float literal {children[0]} is out of range (it underflows to zero)", "E010",
                        help="write 0.0 for zero; the smallest float is about 4.9e-324")
            return ast.Literal(0.0, span=span)
        return ast.Literal(value, span=span)

    def str_lit(self, meta, children):
        return ast.Literal(self._string(children[0]), span=self._s(meta))

    def true_lit(self, meta, children):
        return ast.Literal(True, span=self._s(meta))

    def false_lit(self, meta, children):
        return ast.Literal(False, span=self._s(meta))

    def none_lit(self, meta, children):
        return ast.Literal(None, span=self._s(meta))

    def tuple_lit(self, meta, children):
        return ast.TupleLit(tuple(c for c in children if c is not None), span=self._s(meta))

    def list_lit(self, meta, children):
        return ast.ListLit(tuple(c for c in children if c is not None), span=self._s(meta))

    def _string(self, tok: Token) -> str:
        # literal_eval only evaluates literals: safe on untrusted text.
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # invalid escapes ("\q") are kept as written
                value = _pyast.literal_eval(str(tok))
        except (ValueError, SyntaxError):
            value = None
        if not isinstance(value, str):
            self._error(self._tok(tok), f"invalid string literal {tok}", "E003",
                        help="use Python string escapes such as \\n, \\\\ and \\\"")
            return ""
        return value
