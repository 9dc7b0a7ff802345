"""Compile checked rules into matcher programs.

The checker (``rewrite.language.check``) has already guaranteed that every name
resolves; this stage turns each ``ast.Rule`` into a ``CompiledRule``:

* the pattern becomes a tree of ``P*`` records whose calls carry the resolved
  ``OpDef`` alternatives and the arguments keyed by canonical parameter name
  (omitted parameters must equal their defaults unless the call ends with ``...``);
* the replacement becomes a tree of ``R*`` records (op emission, rewrite-time
  constant, inserted module, variable, literal);
* the rule is indexed by its root: canonical op names for vocabulary ops, node keys
  (``("call_function", target)``) for qualified spellings, so a node only meets the
  rules that could match it.

Arguments of a call are ordered cheap-first (literals, then nested calls, then
variables) so most failing candidates are rejected before any recursion.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator

import attrs

from rewrite.engine.dtypes import DTYPES
from rewrite.engine.outputs import results_opdef
from rewrite.engine.where import compile_where
from rewrite.functions.registry import FunctionSpec, lookup_function
from rewrite.language import ast
from rewrite.ops import OpDef, lookup_op
from rewrite.ops.base import REQUIRED
from rewrite.ops.forms import literal_expansion, strictest_expansion

__all__ = [
    "PCall", "PVar", "PWild", "PLit", "PDefault", "PSeq", "PResults", "ROp", "RVar", "RLit", "RSeq",
    "RConst", "RModule", "RResults", "CompiledRule", "compile_rule", "CompileError", "DTYPES",
    "pattern_arguments", "variable_expansions",
]


class CompileError(Exception):
    """A rule that passed the checker but cannot be compiled (a bug or an unsupported
    construct); carries the rule's source position."""


# ---------------------------------------------------------------- pattern records


@attrs.frozen
class PWild:
    pass


_SPAN = dict(default=None, eq=False, repr=False)


@attrs.frozen
class PVar:
    name: str
    span: Any = attrs.field(**_SPAN)


@attrs.frozen
class PLit:
    value: Any
    span: Any = attrs.field(**_SPAN)
    #: how an int compares with a list at the argument it is (``same_arg``): set
    #: per op and parameter (``literal_expansion``); an item of a list: never
    expand: str = attrs.field(default="none", eq=False)
    #: "list" or "tuple" for a sequence literal as written (a getitem index tells them apart)
    sequence: str = attrs.field(default="", eq=False)


@attrs.frozen
class PDefault:
    """An omitted argument: must equal the parameter's default."""

    value: Any
    param: str = ""
    span: Any = attrs.field(**_SPAN)  # the call that omitted it
    expand: str = attrs.field(default="none", eq=False)  # as PLit's


@attrs.frozen
class PSeq:
    items: tuple
    span: Any = attrs.field(**_SPAN)
    written: str = attrs.field(default="", eq=False)  # "list" or "tuple", as written
    #: only a sequence of the kind written matches (a getitem index: ``x[(0, 1)]`` is one
    #: element, ``x[[0, 1]]`` two rows); elsewhere a tuple also matches a list
    strict: bool = attrs.field(default=False, eq=False)


@attrs.frozen
class PAlt:
    """One op alternative of a call: the OpDef and its arguments, cheap-first."""

    opdef: OpDef
    canonical: bool  # the vocabulary's own OpDef (bind via the shared node index)
    args: tuple  # of (param name, pattern)
    # The same arguments split for the matcher's straight-line path: literal
    # checks, plain variables, and the rest.
    literals: tuple = ()  # (param, value)
    variables: tuple = ()  # (param, variable name)
    nested: tuple = ()  # (param, pattern): calls and sequences
    # the arguments with a commutative op's two operands swapped: the other order
    # the matcher and its prefilter try; None when the op does not commute or the
    # two are one variable or both wildcards (``mul(x, x)``: the same match again)
    swapped: tuple | None = None
    flipped: "PAlt | None" = None  # the alternative with its arguments ``swapped``, split alike

    @classmethod
    def of(cls, opdef: OpDef, canonical: bool, args: tuple) -> "PAlt":
        swapped = opdef.commuted(args)
        if swapped is not None:
            operands = [p for (n, p), (m, _) in zip(args, swapped) if n != m]
            if len(operands) == 2 and _same_operand_pattern(*operands):
                swapped = None
        flipped = None if swapped is None else cls(opdef, canonical, swapped, *_split(swapped))
        return cls(opdef, canonical, args, *_split(args), swapped, flipped)


def _split(args: tuple) -> tuple:
    """``(literals, variables, nested)`` of an alternative's arguments."""
    return (tuple((n, p.value, p.expand) for n, p in args if isinstance(p, (PLit, PDefault))),
            tuple((n, p.name) for n, p in args if isinstance(p, PVar)),
            tuple((n, p) for n, p in args if isinstance(p, (PCall, PSeq, PResults))))


def pattern_arguments(pattern: Any) -> Iterator[tuple]:
    """``(op, param, pattern)`` of every argument written in ``pattern``: each call
    alternative's, nested calls' and results' too; an item of a sequence has op and
    param None (an int is no list of itself there)."""
    stack = [(None, None, pattern)]
    while stack:
        op, param, p = stack.pop()
        if p is not pattern:
            yield op, param, p
        if isinstance(p, PCall):
            stack.extend((alt.opdef.name, name, arg) for alt in p.alts for name, arg in alt.args)
        elif isinstance(p, PSeq):
            stack.extend((None, None, item) for item in p.items)
        elif isinstance(p, PResults):
            stack.append((None, None, p.call))


def variable_expansions(pattern: Any) -> dict:
    """Variable name -> how an int equals a list at the arguments it is bound at
    (``same_arg``'s ``expand``, ``literal_expansion``): the strictest where a
    variable is bound at more than one; an item of a sequence, never."""
    out: dict = {}
    for op, param, p in pattern_arguments(pattern):
        if isinstance(p, PVar):
            expand = literal_expansion(op, param) if op is not None else "none"
            out[p.name] = strictest_expansion(out.get(p.name, expand), expand)
    return out


def _same_operand_pattern(a: Any, b: Any) -> bool:
    """Two operand patterns that match exactly the same operands, written alike."""
    return (isinstance(a, PWild) and isinstance(b, PWild)) or (
        isinstance(a, PVar) and isinstance(b, PVar) and a.name == b.name)


@attrs.frozen
class PCall:
    alts: tuple  # of PAlt
    name: str | None  # the `as` name, if any
    span: Any = attrs.field(default=None, eq=False)
    # `as (a, _, c)`: names of the op's results ("_": ignored); None for one value
    results: tuple | None = None


@attrs.frozen
class PResults:
    """``op(...) as (a, b)`` as an argument: matches the list of all the op's
    results, in order (``[getitem(n, 0), getitem(n, 1)]``); ``call.results`` names them."""

    call: PCall
    span: Any = attrs.field(**_SPAN)


# ---------------------------------------------------------------- replacement records


@attrs.frozen
class RVar:
    name: str


@attrs.frozen
class RLit:
    value: Any


@attrs.frozen
class RSeq:
    items: tuple
    kind: type


@attrs.frozen
class ROp:
    opdef: OpDef
    args: dict  # canonical param -> R*


@attrs.frozen
class RResults:
    """A tuple replacing the results of a multi-output root, one item per result
    (None: ``_``, a result the replacement does not provide)."""

    items: tuple


@attrs.frozen
class RConst:
    spec: FunctionSpec
    args: tuple
    kwargs: dict


@attrs.frozen
class RModule:
    spec: FunctionSpec
    inputs: tuple  # R* graph values the module is called on
    config: dict  # literal keyword config for the factory


# ---------------------------------------------------------------- compiled rule


@attrs.frozen(eq=False)
class CompiledRule:
    """A rule ready to match: pattern tree, where clause (AST, and the closure it
    compiles to: ``where_fn(env, facts)``), replacement tree, and the root index keys."""

    name: str
    rule: ast.Rule
    pattern: PCall
    where: Any
    replacement: Any
    priority: int
    order: int  # position in the program, for deterministic ties
    shared: bool
    root_ops: frozenset  # canonical op names
    root_keys: frozenset  # node keys, for qualified (non-canonical) roots
    replacement_vars: frozenset  # variables the replacement uses (kept nodes)

    @functools.cached_property
    def where_fn(self) -> Any:
        """The where clause compiled to a closure ``f(env, facts)`` (None: no clause);
        ``compile_rule`` builds it, so matching never walks the AST."""
        return None if self.where is None else compile_where(self.where, self.expansions)

    @functools.cached_property
    def expansions(self) -> dict:
        """How each pattern variable compares with an int in the where clause, as
        a literal at the argument it was bound at would (``literal_expansion``):
        ``s == 1`` holds for a stride ``[1, 1]``, not for a size ``[1, 1]``."""
        return variable_expansions(self.pattern)

    @functools.cached_property
    def flat(self) -> bool:
        """The pattern is one call whose arguments are variables, literals and
        wildcards (``permute(x, p)``, ``add(x, 0)``): the matcher binds it without
        recursion (``Matcher.match``), a commutative op in both orders."""
        p = self.pattern
        return p.results is None and all(not alt.nested for alt in p.alts)

    @property
    def location(self) -> str:
        return str(self.rule.span) if self.rule.span else "<rule>"


def _resolve_ops(names: tuple, families: dict, results: bool = False) -> list:
    out: list = []
    for name in names:
        for member in families.get(name, (name,)):
            opdef = lookup_op(member)
            if opdef is None:
                raise CompileError(f"unknown op {member!r}")
            if results:
                opdef = results_opdef(member, opdef)
            if opdef not in out:
                out.append(opdef)
    return out


def _cost(p: Any) -> int:
    if isinstance(p, (PLit, PDefault)):
        return 0
    if isinstance(p, PSeq):
        return 1
    if isinstance(p, (PCall, PResults)):
        return 2
    return 3


class _PatternBuilder:
    def __init__(self, families: dict) -> None:
        self.families = families

    def build(self, e: Any) -> Any:
        if isinstance(e, ast.As):
            inner = self.build(e.expr)
            if not isinstance(inner, PCall):
                raise CompileError("'as' names an op call; use a plain variable instead")
            return attrs.evolve(inner, name=e.name)
        if isinstance(e, ast.AsTuple):
            return PResults(self.results(e), e.span)
        if isinstance(e, ast.Call):
            return self.call(e)
        if isinstance(e, ast.Var):
            return PVar(e.name, e.span)
        if isinstance(e, ast.Wildcard):
            return PWild()
        if isinstance(e, ast.Literal):
            return PLit(e.value, e.span)
        if isinstance(e, ast.DTypeLit):
            return PLit(DTYPES[e.name], e.span)
        if isinstance(e, (ast.TupleLit, ast.ListLit)):
            items = tuple(self.build(i) for i in e.items)
            sequence = "list" if isinstance(e, ast.ListLit) else "tuple"
            if items and all(type(i) is PLit for i in items):
                # a literal list is one literal: ``mean(x, [0])`` matches ``x.mean(0)`` as
                # ``mean(x, 0)`` matches export's ``[0]`` (``same_arg``)
                return PLit(tuple(i.value for i in items), e.span, sequence=sequence)
            return PSeq(items, e.span, written=sequence)
        raise CompileError(f"{type(e).__name__} cannot appear in a pattern")

    def results(self, e: ast.AsTuple) -> PCall:
        if not isinstance(e.expr, ast.Call):
            raise CompileError("'as (...)' binds the results of an op call")
        return attrs.evolve(self.call(e.expr, results=True), results=tuple(e.names))

    def call(self, e: ast.Call, results: bool = False) -> PCall:
        alts = []
        # the arguments once for every alternative op (built per alternative, nested
        # families cost their product: act(act(...)) over 4 ops, 4^depth)
        positional = tuple(self.build(a) for a in e.args)
        keywords = tuple((kw.name, self.build(kw.value)) for kw in e.kwargs)
        for opdef in _resolve_ops(e.op.names, self.families, results):
            given = dict(zip(opdef.param_names, positional))
            given.update(keywords)
            args = []
            for param in opdef.params:
                expand = literal_expansion(opdef.name, param.name)
                if param.name in given:
                    given_pattern = given[param.name]
                    indexing = (opdef.name, param.name) == ("getitem", "index")
                    if isinstance(given_pattern, PLit):
                        given_pattern = attrs.evolve(given_pattern, expand=(
                            given_pattern.sequence if indexing and given_pattern.sequence else expand))
                    elif isinstance(given_pattern, PSeq) and indexing:
                        given_pattern = attrs.evolve(given_pattern, strict=True)
                    args.append((param.name, given_pattern))
                elif not e.rest:
                    if param.default is REQUIRED:
                        raise CompileError(f"{opdef.name}: missing argument {param.name!r}")
                    args.append((param.name, PDefault(param.default, param.name, e.span, expand)))
            args.sort(key=lambda item: _cost(item[1]))
            alts.append(PAlt.of(opdef, not opdef.qualified, tuple(args)))
        return PCall(tuple(alts), None, e.span)


class _ReplacementBuilder:
    def __init__(self, families: dict) -> None:
        self.families = families
        self.vars: set = set()

    def build(self, e: Any) -> Any:
        if isinstance(e, ast.Var):
            self.vars.add(e.name)
            return RVar(e.name)
        if isinstance(e, ast.Literal):
            return RLit(e.value)
        if isinstance(e, ast.DTypeLit):
            return RLit(DTYPES[e.name])
        if isinstance(e, ast.TupleLit):
            return RSeq(tuple(self.build(i) for i in e.items), tuple)
        if isinstance(e, ast.ListLit):
            return RSeq(tuple(self.build(i) for i in e.items), list)
        if isinstance(e, ast.Call):
            return self.call(e)
        raise CompileError(f"{type(e).__name__} cannot appear in a replacement")

    def call(self, e: ast.Call) -> Any:
        if len(e.op.names) != 1:
            raise CompileError("a replacement must name one op, not alternatives")
        name = e.op.names[0]
        spec = lookup_function(name)
        if spec is not None and spec.kind in ("constant", "module"):
            args = tuple(self.build(a) for a in e.args)
            kwargs = {kw.name: self.build(kw.value) for kw in e.kwargs}
            if spec.kind == "constant":
                return RConst(spec, args, kwargs)
            bound = dict(zip(spec.params, args))
            bound.update(kwargs)
            inputs = tuple(bound.pop(n) for n in spec.inputs if n in bound)
            return RModule(spec, inputs, bound)
        opdefs = _resolve_ops((name,), self.families)
        if len(opdefs) != 1:
            raise CompileError(f"{name!r} names a family; a replacement must name one op")
        opdef = opdefs[0]
        given = dict(zip(opdef.param_names, (self.build(a) for a in e.args)))
        for kw in e.kwargs:
            given[kw.name] = self.build(kw.value)
        args = {}
        for param in opdef.params:
            if param.name in given:
                args[param.name] = given[param.name]
            elif param.default is REQUIRED:
                raise CompileError(f"{opdef.name}: missing argument {param.name!r}")
            else:
                args[param.name] = RLit(param.default)
        return ROp(opdef, args)


def compile_rule(rule: ast.Rule, order: int, families: dict) -> CompiledRule:
    """Compile one checked rule. Raises CompileError with the rule's position."""
    try:
        pb = _PatternBuilder(families)
        multi = isinstance(rule.pattern, ast.AsTuple)
        pattern = pb.results(rule.pattern) if multi else pb.build(rule.pattern)
        if not isinstance(pattern, PCall):
            raise CompileError("a pattern must be an op call at its root")
        rb = _ReplacementBuilder(families)
        if multi and isinstance(rule.replacement, ast.TupleLit):
            replacement = RResults(tuple(None if isinstance(i, ast.Wildcard) else rb.build(i)
                                         for i in rule.replacement.items))
            if len(replacement.items) != len(pattern.results):
                raise CompileError("the replacement gives another number of values than the pattern binds")
        else:
            replacement = rb.build(rule.replacement)
        if isinstance(replacement, (RLit, RSeq)):
            raise CompileError("a replacement must produce a graph value (an op, a variable, a module or a constant)")
    except CompileError as err:
        raise CompileError(f"{rule.span}: error: rule {rule.name!r}: {err}") from None
    root_ops, root_keys = set(), set()
    for alt in pattern.alts:
        if alt.canonical:
            root_ops.add(alt.opdef.name)
        else:
            root_keys.update(form.key for form in alt.opdef.forms)
    compiled = CompiledRule(
        name=rule.name,
        rule=rule,
        pattern=pattern,
        where=rule.where,
        replacement=replacement,
        priority=int(rule.option("priority", 0) or 0),
        order=order,
        shared=bool(rule.option("shared", False)),
        root_ops=frozenset(root_ops),
        root_keys=frozenset(root_keys),
        replacement_vars=frozenset(rb.vars),
    )
    compiled.where_fn  # noqa: B018 - compiled now, not on the first match
    return compiled
