"""The rule language's abstract syntax: frozen records with source spans.

The parser (``rewrite.language.parser``) builds these from a rule file; the checker
(``rewrite.language.check``) resolves names against the op vocabulary and the
function registry; the compiler (``rewrite.engine.compile``) turns resolved rules into
matchers. Spans are excluded from equality so ``parse(format(ast)) == ast``.

A rule file, printed back::

    import "cleanup.rw"
    family act = relu | gelu | silu
    # x * 1 -> x
    rule mul_one: mul(x, 1) => x
    rule conv_bn(priority=10):
        batch_norm(conv(x, w, b, stride, padding, dilation, groups) as c,
                   mean, var, gamma, beta, training=False, eps=eps, ...)
        where const(w, b, mean, var, gamma, beta) and single_use(c)
        => conv(x, bn_fold_weight(w, var, gamma, eps), bn_fold_bias(b, mean, var, gamma, beta, eps),
                stride, padding, dilation, groups)
    ruleset fusion = fixpoint(conv_bn, mul_one)
"""

from __future__ import annotations

from typing import Any, Iterator, Union

import attrs

__all__ = [
    "walk",
    "Span", "Var", "Wildcard", "Literal", "DTypeLit", "TupleLit", "ListLit", "OpRef",
    "Call", "Keyword", "As", "AsTuple", "Compare", "BoolOp", "Not", "Index", "Expr",
    "RuleOption", "Rule", "Family", "Binding", "Import", "Param", "ScheduleRef", "Schedule", "RuleSetDecl",
    "Module",
]


@attrs.frozen
class Span:
    """Where a construct was written: 1-based line and column, end exclusive."""

    path: str
    line: int
    col: int
    end_line: int
    end_col: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.col}"


def _span() -> Any:
    return attrs.field(default=None, eq=False, repr=False)


# ---------------------------------------------------------------- expressions


@attrs.frozen
class Var:
    """A variable: binds a node or a literal in a pattern; refers to it elsewhere."""

    name: str
    span: Span | None = _span()


@attrs.frozen
class Wildcard:
    """``_``: matches anything, binds nothing."""

    span: Span | None = _span()


@attrs.frozen
class Literal:
    """An int, float, bool, None or string literal."""

    value: Any
    span: Span | None = _span()


@attrs.frozen
class DTypeLit:
    """A dtype literal such as ``torch.float32`` (stored by its name, ``float32``)."""

    name: str
    span: Span | None = _span()


@attrs.frozen
class TupleLit:
    """``(a, b)``: a tuple of expressions (patterns match tuples and lists alike)."""

    items: tuple
    span: Span | None = _span()


@attrs.frozen
class ListLit:
    """``[a, b]``: a list of expressions."""

    items: tuple
    span: Span | None = _span()


@attrs.frozen
class OpRef:
    """The callee of a call: one name or alternatives ``(relu | gelu)``.

    Names are as written: canonical op names (``conv``), qualified names
    (``aten.conv2d``, ``F.relu``, ``nn.Conv2d``, ``Tensor.clamp``), family names, or
    registered function/predicate names. The checker decides which.
    """

    names: tuple
    span: Span | None = _span()
    name_spans: tuple = attrs.field(default=(), eq=False, repr=False)  # one Span per name


@attrs.frozen
class Keyword:
    """``name=value`` inside a call."""

    name: str
    value: "Expr"
    span: Span | None = _span()


@attrs.frozen
class Call:
    """``op(args, kw=value, ...)``; ``rest`` is True when the call ends with ``...``
    (in a pattern: the arguments not written may be anything)."""

    op: OpRef
    args: tuple
    kwargs: tuple  # of Keyword
    rest: bool = False
    span: Span | None = _span()


@attrs.frozen
class As:
    """``pattern as name``: names an interior node of a pattern."""

    expr: "Expr"
    name: str
    span: Span | None = _span()


@attrs.frozen
class AsTuple:
    """``pattern as (a, b, _)``: binds the results of a multi-output op (what the
    graph reads through ``getitem(node, i)``) to names, ``_`` for a result the rule
    ignores. As a pattern's root it names the results the replacement replaces; as
    an argument it matches the list of all of them (``cat(split(x, s, d) as (a, b), d)``)."""

    expr: "Expr"
    names: tuple  # of str; "_" for an ignored result
    span: Span | None = _span()
    name_spans: tuple = attrs.field(default=(), eq=False, repr=False)  # one Span per name


@attrs.frozen
class Compare:
    """``left OP right`` with OP in ``== != < <= > >= in``."""

    op: str
    left: "Expr"
    right: "Expr"
    span: Span | None = _span()


@attrs.frozen
class BoolOp:
    """``a and b and c`` / ``a or b``."""

    op: str  # "and" | "or"
    items: tuple
    span: Span | None = _span()


@attrs.frozen
class Not:
    expr: "Expr"
    span: Span | None = _span()


@attrs.frozen
class Index:
    """``expr[i]``, e.g. ``shape(x)[1]``."""

    expr: "Expr"
    index: "Expr"
    span: Span | None = _span()


Expr = Union[Var, Wildcard, Literal, DTypeLit, TupleLit, ListLit, Call, As, AsTuple, Compare, BoolOp, Not, Index]


# ---------------------------------------------------------------- declarations


@attrs.frozen
class RuleOption:
    """``name=value`` in a rule header, e.g. ``priority=10`` or ``shared=true``."""

    name: str
    value: Any
    span: Span | None = _span()


@attrs.frozen
class Rule:
    """``rule NAME(options): pattern [where condition] => replacement``."""

    name: str
    pattern: Expr
    where: Expr | None
    replacement: Expr
    options: tuple = ()  # of RuleOption
    doc: str = attrs.field(default="", eq=False)  # the comment lines just above the rule
    span: Span | None = _span()
    name_span: Span | None = _span()  # the rule's name in its header

    def option(self, name: str, default: Any = None) -> Any:
        for opt in self.options:
            if opt.name == name:
                return opt.value
        return default


@attrs.frozen
class Family:
    """``family NAME = op | op | ...``: a named set of ops usable as a callee."""

    name: str
    ops: tuple  # of str
    span: Span | None = _span()
    name_span: Span | None = _span()
    op_spans: tuple = attrs.field(default=(), eq=False, repr=False)  # one Span per op


@attrs.frozen
class Binding:
    """``name = value [as tag]`` in an import: binds the imported file's ``param name``
    to a literal ``value``; ``tag`` replaces the word ``name`` in its declarations' names."""

    name: str
    value: "Expr"
    tag: str | None = None
    span: Span | None = _span()


@attrs.frozen
class Import:
    """``import "path.rw" [with bindings]``: path relative to the importing file."""

    path: str
    span: Span | None = _span()
    bindings: tuple = ()  # of Binding


@attrs.frozen
class Param:
    """``param name``: a value the importing file binds (``import ... with name = v``)."""

    name: str
    span: Span | None = _span()


@attrs.frozen
class ScheduleRef:
    """A rule or rule-set name inside a schedule."""

    name: str
    span: Span | None = _span()


@attrs.frozen
class Schedule:
    """``fixpoint(a, b)``, ``once(a, b)`` or ``seq(s1, s2)``; items are ScheduleRef or Schedule."""

    kind: str  # "fixpoint" | "once" | "seq"
    items: tuple
    span: Span | None = _span()


@attrs.frozen
class RuleSetDecl:
    """``ruleset NAME = schedule``."""

    name: str
    schedule: Schedule
    span: Span | None = _span()
    name_span: Span | None = _span()


@attrs.frozen
class Module:
    """One parsed rule file: its declarations in source order."""

    path: str
    items: tuple  # of Import | Param | Family | Rule | RuleSetDecl
    source: str = attrs.field(default="", eq=False, repr=False)


def walk(e: object) -> Iterator:
    """Every expression node under ``e`` (inclusive), parents first."""
    yield e
    if isinstance(e, Call):
        for a in e.args:
            yield from walk(a)
        for k in e.kwargs:
            yield from walk(k.value)
    elif isinstance(e, (TupleLit, ListLit, BoolOp)):
        for i in e.items:
            yield from walk(i)
    elif isinstance(e, (As, AsTuple, Not)):
        yield from walk(e.expr)
    elif isinstance(e, Compare):
        yield from walk(e.left)
        yield from walk(e.right)
    elif isinstance(e, Index):
        yield from walk(e.expr)
        yield from walk(e.index)
