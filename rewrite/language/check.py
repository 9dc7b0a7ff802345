"""Name resolution and checking of parsed rule files (codes E1xx-E4xx; E306 in ``where_kinds``).

The parser only knows the shape of the text. This module knows what the names
mean: which callees are ops of the vocabulary (``rewrite.ops``), families, or
registered functions (``rewrite.functions.registry``) of the right kind for where
they are used; whether arguments fit the op's signature; whether every variable is
bound by the pattern and every pattern variable is used. Every problem is
collected, so one run of ``rewrite check`` shows them all.

Each rule is checked in three places with different rules of use:

* pattern: calls of ops and families (alternatives allowed), variables, ``_``,
  literals, ``as``, ``...``;
* where: calls of predicates and queries, comparisons, ``and``/``or``/``not``,
  indexing, bound variables and literals;
* replacement: calls of ops and of ``constant``/``module`` functions, bound
  variables and literals.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, Iterable, Iterator, Optional

import attrs

from rewrite.language import ast
from rewrite.language.diagnostics import Diagnostic, did_you_mean
from rewrite.language.limits import MAX_NESTING, NESTING_CODE
from rewrite.language.literals import describe, param_types, refusal
from rewrite.language.parser import DTYPES
from rewrite.language.printer import format_expr
from rewrite.language.syntax import NOT_LITERALS
from rewrite.language.where_kinds import ANY, BOOL, returned_kind, where_problems

__all__ = ["Scope", "check_module", "check_declarations", "expand_families", "run_only_once",
           "SCHEDULE_KINDS", "OPTIONS"]

SCHEDULE_KINDS = ("fixpoint", "once", "seq")

# Rule options: name -> (check, what the value must be).
OPTIONS = {
    "priority": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "shared": (lambda v: isinstance(v, bool), "True or False"),
    "tolerance": (lambda v: v in ("exact", "approx"), "\"exact\" or \"approx\""),
    "change": (lambda v: isinstance(v, bool), "True or False"),
    "assumes_range": (lambda v: isinstance(v, bool), "True or False"),
}

_PATTERN, _WHERE, _REPLACEMENT = "pattern", "where clause", "replacement"
_HINTS = 20  # did-you-mean hints per file


def _vocabulary() -> Any:
    # Imported late: the vocabulary imports torch, and the parser should not need it.
    import rewrite.ops

    return rewrite.ops


def _registry() -> Any:
    from rewrite.functions import registry

    return registry


@attrs.frozen
class Scope:
    """The names one file can see: its own declarations and its imports'.

    ``complete`` is False when an import could not be read or parsed; names that
    might have come from it are then not reported as unknown. ``uses``, for an
    instance of a parametrized file, maps the span of each use of a parameter to
    its ``ast.Binding``: a literal the checker refuses there is the binding's fault.
    """

    families: dict = attrs.field(factory=dict)  # name -> ast.Family
    schedulables: dict = attrs.field(factory=dict)  # name -> ast.Rule | ast.RuleSetDecl
    complete: bool = True
    uses: dict = attrs.field(factory=dict)  # Span -> ast.Binding


def check_module(module: ast.Module, scope: Scope, endless: list | None = None) -> list:
    """Every diagnostic for the declarations of one parsed file. ``endless`` gets
    ``(rule name, E409 diagnostic)`` for each rule that never settles by itself:
    whether it is an error depends on how the whole program runs it
    (``run_only_once``), which one file does not know."""
    checker = _Checker(scope)
    checker.endless = endless if endless is not None else []
    for item in module.items:
        if isinstance(item, ast.Rule):
            checker.rule(item)
        elif isinstance(item, ast.Family):
            checker.family(item)
        elif isinstance(item, ast.RuleSetDecl):
            checker.ruleset(item)
    misused = set(checker.misused)
    where = [d for d, bindings in checker.where_diags if not bindings & misused]
    return checker.diags + where + checker.binding_misuses()


def run_only_once(modules: Iterable) -> tuple:
    """``(once, repeated)``: the rules the rule sets of ``modules`` (a whole program:
    every file loaded together, importers included) run only in one sweep, listed
    directly inside ``once(...)`` with no ``fixpoint(...)`` around it and nowhere
    else (a bare rule in ``seq(...)`` runs to a fixpoint), through the rule sets
    they name; and for the other rules they name, the span of a schedule that
    repeats one (the ``fixpoint(...)`` around it, or the bare item itself). A rule
    in ``once`` may rewrite its own output (E409's exemption). Linear in the program."""
    decls = {i.name: i.schedule for m in modules for i in m.items if isinstance(i, ast.RuleSetDecl)}
    once, repeated, walked = set(), {}, set()
    # (schedule item, the kind of schedule holding it, the fixpoint around it or None)
    pending = [(s, "fixpoint", None) for s in decls.values()]
    while pending:  # (an explicit stack: rule sets may chain a hundred deep)
        node, container, again = pending.pop()
        if isinstance(node, ast.ScheduleRef):
            if node.name in decls:
                if (node.name, container, again is not None) not in walked:
                    walked.add((node.name, container, again is not None))
                    pending.append((decls[node.name], container, again))
            elif container == "once" and again is None:
                once.add(node.name)
            else:
                repeated.setdefault(node.name, again or node.span)
            continue
        around = again if again is not None or node.kind != "fixpoint" else node.span
        pending.extend((item, node.kind, around) for item in node.items)
    return frozenset(once - set(repeated)), repeated


# ---------------------------------------------------------------- declarations


def check_declarations(modules: list, origins: list | None = None) -> list:
    """Program-wide checks: duplicate names (one namespace for rules, families and
    rulesets across all files), families named like ops, recursive families and
    rulesets.

    ``origins``, parallel to ``modules``, gives for an instance of a parametrized
    file the ``(span, text)`` note naming the import that made it (None for a plain
    file): two instances of one template declare a name at the same line, and the
    notes tell them apart."""
    diags: list = []
    first: dict = {}
    families: dict = {}
    rulesets: dict = {}
    for module, origin in zip(modules, origins or [None] * len(modules)):
        for item in module.items:
            if isinstance(item, (ast.Import, ast.Param)):
                continue
            where = item.name_span or item.span
            if item.name in first:
                kind, prev, prev_origin = first[item.name]
                related = ((prev, f"'{item.name}' first defined here"),)
                help = "rules, families and rulesets share one namespace; rename one of them"
                if prev_origin is not None or origin is not None:
                    # both in one instance: its note once
                    related += tuple(dict.fromkeys(o for o in (prev_origin, origin) if o is not None))
                if kind == "ruleset" and isinstance(item, ast.RuleSetDecl) and prev is not None \
                        and where is not None and prev.path != where.path:
                    help += ("; to run two files' rule sets one after the other, load the files apart and "
                             "add them: rewrite.load(a) + rewrite.load(b)")
                if prev_origin is not None and origin is not None and prev == where:
                    help = ("two instances of one parametrized file declare it: give each import "
                            "its own tag (import \"...\" with NAME = value as TAG)")
                diags.append(Diagnostic(
                    where, f"duplicate name '{item.name}': already defined as a {kind}", "E401",
                    help=help, related=related))
                continue
            first[item.name] = (_kind(item), where, origin)
            if isinstance(item, ast.Family):
                families[item.name] = item
                if _vocabulary().lookup_op(item.name) is not None:
                    diags.append(Diagnostic(where, f"family '{item.name}' has the name of an op", "E401",
                                            help="choose a name that is not an op"))
            elif isinstance(item, ast.RuleSetDecl):
                rulesets[item.name] = item
    diags += _cycles({n: [(m, s) for m, s in zip(f.ops, _op_spans(f)) if m in families]
                      for n, f in families.items()}, "family")
    cycles = _cycles({n: [(r.name, r.span) for r in _refs(d.schedule) if r.name in rulesets]
                      for n, d in rulesets.items()}, "ruleset")
    diags += cycles or _nested_too_deeply(rulesets)  # (a cycle is as deep as it is long: its E404 says it)
    return diags


def _nested_too_deeply(rulesets: dict) -> list:
    """One E001 for each rule set that is the first on its chain to nest schedules
    deeper than ``MAX_NESTING``, counting the rule sets it names: the driver runs a
    schedule recursively, and a chain of rule sets each naming the one before
    (declared in any order) would otherwise exhaust Python's recursion limit when
    applied, not when loaded."""
    depth: dict = {}
    for name in _members_first(lambda n: [r.name for r in _refs(rulesets[n].schedule) if r.name in rulesets],
                               rulesets):
        depth[name] = _schedule_depth(rulesets[name].schedule, depth)
    diags = []
    for name, d in rulesets.items():
        named = [depth.get(r.name, 0) for r in _refs(d.schedule) if r.name in rulesets]
        if depth[name] > MAX_NESTING and all(n <= MAX_NESTING for n in named):
            diags.append(Diagnostic(
                d.name_span or d.span, f"rule set '{name}' nests schedules too deeply (more than {MAX_NESTING} "
                "levels, counting the rule sets it names)", NESTING_CODE,
                help="name the rules of the innermost rule sets directly, with fewer rule sets in between"))
    return diags


def _schedule_depth(s: ast.Schedule, depth: dict) -> int:
    """Levels of ``s``, a named rule set counting its own (``depth``); a name not in
    ``depth`` (a rule, or a rule set on a cycle) counts none."""
    return 1 + max((depth.get(i.name, 0) if isinstance(i, ast.ScheduleRef) else _schedule_depth(i, depth)
                    for i in s.items), default=0)


def _kind(item: object) -> str:
    return {ast.Rule: "rule", ast.Family: "family", ast.RuleSetDecl: "ruleset"}[type(item)]


def _op_spans(f: ast.Family) -> tuple:
    return f.op_spans if len(f.op_spans) == len(f.ops) else (f.span,) * len(f.ops)


def _refs(s: ast.Schedule) -> Iterator:
    for item in s.items:
        if isinstance(item, ast.ScheduleRef):
            yield item
        else:
            yield from _refs(item)


def _cycles(graph: dict, kind: str) -> list:
    """One E404 per back edge of a depth-first walk of ``graph``
    (name -> [(child name, span of the reference)]). Walked with an explicit stack:
    a chain of declarations is as deep as its file is long, and whether it loads
    must not depend on the recursion limit of the process loading it."""
    diags, state, path = [], {}, []
    for root in graph:
        if root in state:
            continue
        state[root] = "open"
        path.append(root)
        pending = [iter(graph.get(root, ()))]
        while pending:
            step = next(pending[-1], None)
            if step is None:
                pending.pop()
                state[path.pop()] = "done"
                continue
            child, span = step
            if state.get(child) == "open":
                cycle = " -> ".join(path[path.index(child):] + [child])
                diags.append(Diagnostic(span, f"{kind} '{child}' contains itself: {cycle}", "E404",
                                        help=f"a {kind} cannot include itself, directly or through another"))
            elif child not in state:
                state[child] = "open"
                path.append(child)
                pending.append(iter(graph.get(child, ())))
    return diags


def expand_families(families: dict) -> dict:
    """name -> the op names of a family, nested families flattened, first-seen order
    (``family a = relu | b`` with ``family b = gelu`` -> ``a: (relu, gelu)``)."""

    # each family expanded once (``f1 = f0 | f0``, ``f2 = f1 | f1``... would otherwise
    # take a path per way down: 2^n), members first; a family met again on its own
    # path is a cycle, reported as E404, and skipped here
    done: dict = {}
    for name in _members_first(lambda n: [m for m in families[n].ops if m in families], families):
        out: list = []
        for member in families[name].ops:
            if member not in families:
                out.append(member)
            elif member in done:  # (not done: a member on a cycle)
                out += done[member]
        done[name] = tuple(dict.fromkeys(out))
    return {name: done[name] for name in families}


def _members_first(members: Callable[[str], Iterable[str]], names: Iterable[str]) -> list:
    """``names`` and the declarations they name (``members``), each after the ones it
    names, walked with an explicit stack (a chain declared from the top down is as
    deep as its file); a name met again on its own path (a cycle, E404) is not
    waited for."""
    order: list = []
    done: set = set()
    for root in names:
        if root in done:
            continue
        path, on_path = [root], {root}
        while path:
            name = path[-1]
            waiting = next((m for m in members(name) if m not in done and m not in on_path), None)
            if waiting is not None:
                path.append(waiting)
                on_path.add(waiting)
                continue
            done.add(name)
            order.append(name)
            on_path.discard(path.pop())
    return order


# ---------------------------------------------------------------- per rule


def _certainly_matches(pattern: object, term: object, env: dict, canonical: Any) -> bool:
    """Does ``pattern`` match every graph that replacement ``term`` builds?
    ``term``'s variables stand for unknown values, so a sub-pattern that needs
    more than a variable (an op, a literal) does not match one: False means
    "not certainly", never "certainly not"."""
    if isinstance(pattern, ast.Wildcard):
        return True
    if isinstance(pattern, ast.AsTuple):
        return False  # matches results through getitem: never a term's own shape
    if isinstance(pattern, ast.Var):
        if pattern.name in env:
            return env[pattern.name] == term
        env[pattern.name] = term
        return True
    if isinstance(pattern, ast.As):
        return _certainly_matches(pattern.expr, term, env, canonical) and \
            _certainly_matches(ast.Var(pattern.name), term, env, canonical)
    if isinstance(pattern, (ast.Literal, ast.DTypeLit)):
        return type(term) is type(pattern) and term == pattern and (
            not isinstance(pattern, ast.Literal) or type(term.value) is type(pattern.value))
    if isinstance(pattern, (ast.TupleLit, ast.ListLit)):
        return type(term) is type(pattern) and len(term.items) == len(pattern.items) and all(
            _certainly_matches(p, t, env, canonical) for p, t in zip(pattern.items, term.items))
    if not (isinstance(pattern, ast.Call) and isinstance(term, ast.Call)) or len(term.op.names) != 1:
        return False
    ops = frozenset().union(*(canonical(n) for n in pattern.op.names))
    made = canonical(term.op.names[0])
    if len(made) != 1 or not made <= ops:
        return False
    if len(term.args) < len(pattern.args) or (len(term.args) > len(pattern.args) and not pattern.rest):
        return False
    given = {k.name: k.value for k in term.kwargs}
    if {k.name for k in pattern.kwargs} != set(given):
        return False
    return all(_certainly_matches(p, t, env, canonical) for p, t in zip(pattern.args, term.args)) and all(
        _certainly_matches(k.value, given[k.name], env, canonical) for k in pattern.kwargs)


def _as_name_span(e: ast.As) -> ast.Span | None:
    """The span of the name after ``as`` (the last token of the As node)."""
    s = e.span
    if s is None:
        return None
    return ast.Span(s.path, s.end_line, max(s.end_col - len(e.name), 1), s.end_line, s.end_col)


def _result_spans(e: ast.AsTuple) -> tuple:
    """One span per name of ``op(...) as (a, b)`` (the whole binding when unknown)."""
    return e.name_spans if len(e.name_spans) == len(e.names) else (e.span,) * len(e.names)


_WHAT = {ast.Compare: "a comparison", ast.BoolOp: "'{op}'", ast.Not: "'not'", ast.Index: "indexing",
         ast.As: "'as'", ast.AsTuple: "'as (...)'", ast.Wildcard: "'_'"}


def _what(e: object) -> str:
    text = _WHAT[type(e)]
    return text.format(op=e.op) if isinstance(e, ast.BoolOp) else text


def _signature(opdef: Any) -> str:
    required = _vocabulary().REQUIRED
    parts = [p.name if p.default is required else f"{p.name}={p.default!r}" for p in opdef.params]
    return f"{opdef.name}({', '.join(parts)})"


def _other_overloads_hint(c: ast.Call, opdef: Any, sig: str) -> str:
    """``sig``, and where the call's arguments fit another aten overload of a torch
    function than the one its name binds (``torch.var(x, dim=-1)``: ``var.dim``),
    that overload and how a rule names it."""
    from rewrite.ops.generic import generic_opdef, other_overloads

    keywords = {k.name for k in c.kwargs}
    fits = []
    for qualname, other in other_overloads(opdef.name):
        params = [n for n in other.names if n not in ("inplace",)]
        positional = [n for n in params if n not in other.kwonly]
        if len(c.args) > len(positional) or not keywords <= set(params) | {"input"}:
            continue
        given = set(positional[: len(c.args)]) | {"self" if k == "input" else k for k in keywords}
        if not c.rest and any(n not in other.defaults and n not in given for n in params):
            continue
        overload = generic_opdef(qualname)  # its literals' types: repeat_interleave(x, 2) is self_int's
        if overload is not None and _refuses_literals(c, overload):
            continue
        text = f"{qualname}({', '.join(params)})"
        if text not in fits:
            fits.append(text)
    if not fits:
        return sig
    return (f"{sig} (the overload this name binds); the call fits {' and '.join(fits[:2])}: a rule names "
            "it so, at the ATen level (torch.export graphs)")


def _repetitions(e: Any) -> float | None:
    """How many times ``e`` repeats a literal sequence (a string or a list: 1 for the
    literal itself, the product of the counts through nested ``operator.mul(...,
    n)``, infinite for a count that is no int literal), or None when ``e`` is no
    repeated literal sequence (a product of numbers)."""
    from rewrite.ops.resolve import normalize_qualname

    if isinstance(e, (ast.ListLit, ast.TupleLit)):  # [[1] * 4096]: as many as its repeated items together
        inner = [_repetitions(item) for item in e.items]
        return 1 if all(r is None for r in inner) else sum(1 if r is None else r for r in inner)
    if isinstance(e, ast.Literal) and isinstance(e.value, str):
        return 1
    op = normalize_qualname(e.op.names[0]) if isinstance(e, ast.Call) else None
    if op not in _REPEATING and op not in _JOINING:
        return None
    args = list(e.args) + [k.value for k in e.kwargs]
    if len(args) != 2:
        return None
    if op in _JOINING:  # "b" + "a" * n: as long as its parts together
        parts = [_repetitions(a) for a in args]
        return None if all(p is None for p in parts) else sum(1 if p is None else p for p in parts)
    for sequence, count in (args, args[::-1]):
        inner = _repetitions(sequence)
        if inner is not None:
            if isinstance(count, ast.Literal) and isinstance(count.value, int) and not isinstance(count.value, bool):
                return inner * max(count.value, 0)
            return math.inf
    return None


def _refuses_literals(c: ast.Call, opdef: Any) -> bool:
    """Whether a literal argument of ``c`` is no value ``opdef`` takes there (E206's
    test, for the overloads an E201/E202 hint could name)."""
    types = param_types(opdef)
    named = dict(zip(opdef.param_names, c.args))
    named.update({"input" if k.name == "self" else k.name: k.value for k in c.kwargs})
    for name, value in named.items():
        param = opdef.param(name)
        if param is not None and refusal(types.get(name), value, optional=param.default is None) is not None:
            return True
    return False


class _Checker:
    """Collects diagnostics for one file's declarations."""

    def __init__(self, scope: Scope):
        self.scope = scope
        self.diags: list = []
        self.bound: dict = {}  # name -> span, for the rule being checked
        self.used: set = set()
        self.misused: dict = {}  # id(ast.Binding) -> (binding, [(use span, argument, who, expected, help)])
        # where-clause problems (E306) with the ids of the bindings whose values they
        # hold: dropped when such a binding is misused (its E206 says it already)
        self.where_diags: list = []

    def _suggest(self, name: str, candidates: Any, valid: Any = None) -> str | None:
        """``did_you_mean``, for the first ``_HINTS`` unknown names of a file: each
        search is linear in the names in scope, so a file of thousands of errors
        would take quadratic time for hints nobody reads."""
        self._hints = getattr(self, "_hints", 0) + 1
        return did_you_mean(name, candidates, valid) if self._hints <= _HINTS else None

    def _query_kind(self, name: str) -> str:
        """The kind of value a where-clause call returns (``where_kinds``)."""
        kind, found = self.resolve(name)
        if kind != "function":
            return ANY
        return BOOL if found.kind == "predicate" else returned_kind(found.fn)

    def error(self, span: ast.Span | None, message: str, code: str, help: str | None = None) -> None:
        self.diags.append(Diagnostic(span, message, code, help))

    # ------------------------------------------------------ names

    def resolve(self, name: str) -> tuple:
        """``("family", ast.Family)``, ``("op", OpDef)``, ``("function", FunctionSpec)``
        or ``(None, None)``."""
        if name in self.scope.families:
            return "family", self.scope.families[name]
        opdef = _vocabulary().lookup_op(name)
        if opdef is not None:
            return "op", opdef
        spec = _registry().lookup_function(name)
        if spec is not None:
            return "function", spec
        return None, None

    def family_ops(self, family: ast.Family) -> list:
        """(member name, OpDef) of a family, nested families expanded; unknown
        members are skipped (reported on the family itself)."""
        lookup = _vocabulary().lookup_op
        out = []
        for member in expand_families(self.scope.families).get(family.name, ()):
            opdef = lookup(member)
            if opdef is not None:
                out.append((member, opdef))
        return out

    def _ops_and_families(self) -> list:
        return list(_vocabulary().op_names()) + list(self.scope.families)

    # ------------------------------------------------------ declarations

    def family(self, f: ast.Family) -> None:
        for member, span in zip(f.ops, _op_spans(f)):
            kind, found = self.resolve(member)
            if kind == "function":
                self.error(span, f"'{member}' is a {found.kind}, not an op; a family lists ops", "E104")
            elif kind is None and self.scope.complete:
                refused = _vocabulary().op_refusal(member)
                self.error(span, f"{refused.message} (in family '{f.name}')" if refused else
                           f"unknown op '{member}' in family '{f.name}'", "E101",
                           help=refused.help if refused else
                           self._suggest(member, self._ops_and_families(), _vocabulary().lookup_op))

    def ruleset(self, d: ast.RuleSetDecl) -> None:
        self._schedule(d.schedule)

    def _schedule(self, s: ast.Schedule) -> None:
        if s.kind not in SCHEDULE_KINDS:
            span = s.span and ast.Span(s.span.path, s.span.line, s.span.col, s.span.line, s.span.col + len(s.kind))
            self.error(span, f"unknown schedule '{s.kind}'", "E408",
                       help=self._suggest(s.kind, SCHEDULE_KINDS) or "schedules are fixpoint(...), once(...), seq(...)")
        if not s.items:
            self.error(s.span, f"empty schedule '{s.kind}()'", "E408", help="list rules or rulesets inside it")
        for item in s.items:
            if isinstance(item, ast.Schedule):
                self._schedule(item)
            elif item.name in self.scope.families:
                self.error(item.span, f"'{item.name}' is a family, not a rule or ruleset", "E407",
                           help="a schedule lists rules and rulesets")
            elif item.name not in self.scope.schedulables and self.scope.complete:
                self.error(item.span, f"unknown rule or ruleset '{item.name}'", "E407",
                           help=self._suggest(item.name, self.scope.schedulables))

    def rule(self, r: ast.Rule) -> None:
        errors_before = len(self.diags)
        self._options(r)
        self.bound, self.used = {}, set()
        self._bind(r.pattern)
        root = r.pattern.expr if isinstance(r.pattern, (ast.As, ast.AsTuple)) else r.pattern
        if not isinstance(root, ast.Call):
            self.error(_span_of(root), f"a pattern must be an op call, found {_describe(root)}", "E304",
                       help="write the op whose output the rule rewrites, e.g. relu(x)")
        self.check(r.pattern, _PATTERN)
        if r.where is not None:
            self.check(r.where, _WHERE)
            # kinds of values only in a clause whose names resolve; a parameter's
            # value too, as bound (``dtype(y) == lowp`` bound to a string never holds)
            if len(self.diags) == errors_before:
                bindings = _bindings_in(r.where, self.scope.uses)
                for problem in where_problems(r.where, self._query_kind):
                    self.where_diags.append((Diagnostic(problem.span, problem.message, "E306", problem.help),
                                             bindings))
        if isinstance(r.pattern, ast.AsTuple) and isinstance(r.replacement, ast.TupleLit):
            for item in r.replacement.items:  # `_`: a result the replacement does not provide
                if not isinstance(item, ast.Wildcard):
                    self.check(item, _REPLACEMENT)
                    self._replacement_root(item)
        else:
            self.check(r.replacement, _REPLACEMENT)
            self._replacement_root(r.replacement, r.pattern)
        self._results(r)
        self._unused(r)
        if len(self.diags) == errors_before:
            self._endless(r)

    def _endless(self, r: ast.Rule) -> None:
        """E409: a rule whose replacement builds a term its own pattern certainly
        matches (no where clause to stop it) rewrites its own output forever,
        ``add(x, y) => add(y, x)`` or ``relu(x) as r => neg(relu(r))``. Only a
        certain match is reported, and not for a rule the program runs only in
        ``once(...)``: the error is kept in ``endless`` until that is known."""
        if r.where is not None:
            return
        pattern = r.pattern
        if isinstance(pattern, ast.AsTuple) and all(n == "_" for n in pattern.names):
            pattern = pattern.expr  # a multi-output root whose results nothing names: the call's match
        for term in ast.walk(r.replacement):
            if isinstance(term, ast.Call) and _certainly_matches(pattern, term, {}, self._canonical):
                self.endless.append((r.name, Diagnostic(
                    term.span, f"rule '{r.name}' never settles: its pattern matches the "
                               f"{format_expr(term)} it builds, so it rewrites its own output forever", "E409",
                    help="add a where clause the new term fails, or run the rule only "
                         f"in once(...): ruleset {r.name}_once = once({r.name})")))
                return

    def _canonical(self, name: str) -> frozenset:
        """The ops a callee may stand for: canonical names (a family's members), or
        the qualified name itself for an op restricted to one spelling."""
        kind, found = self.resolve(name)
        if kind == "family":
            return frozenset(op.name for _, op in self.family_ops(found))
        if kind == "op":  # a qualified name (nn.ReLU, aten.add.Tensor) is its one spelling
            return frozenset((f"={name}",) if found.qualified else (found.name,))
        return frozenset()

    def _replacement_root(self, e: object, pattern: object = None) -> None:
        """The replacement stands for the matched node, so it must be a graph value:
        a variable, an op call, a module function, or a rewrite-time constant whose
        tensor becomes a new constant of the module (not a literal)."""
        if isinstance(e, ast.TupleLit) and pattern is not None:
            self.error(e.span, "a tuple replacement needs a pattern whose root binds the results of a "
                               "multi-output op", "E305",
                       help="bind the root op's results in the pattern, e.g. split(x, 2, 0) as (a, b) "
                            "=> (e1, e2)")
        elif isinstance(e, (ast.Literal, ast.DTypeLit, ast.TupleLit, ast.ListLit)):
            self.error(e.span, f"a replacement must produce a graph value, found {_describe(e)}", "E304",
                       help="build the value with an op, return a variable bound by the pattern, "
                            "or compute a constant tensor with a constant function")

    # ------------------------------------------------------ multi-output roots

    def _results(self, r: ast.Rule) -> None:
        """A pattern root ``op(...) as (a, b)`` is replaced result by result: the
        replacement is a tuple of as many values (``_`` for one it does not
        provide) or one call of a multi-output op; it cannot read the results it
        replaces (``a``, ``b``: they go away). A root that returns several values
        without ``as (...)`` (``split(x, 2, 0)``) is replaced by one call of an op
        that returns several too, never by one tensor (its readers' ``getitem``
        would index that tensor)."""
        if not isinstance(r.pattern, ast.AsTuple):
            self._several_replaced_by_one(r)
            return
        names, rep = r.pattern.names, r.replacement
        if isinstance(rep, ast.TupleLit):
            if len(rep.items) != len(names):
                self.error(rep.span, f"the pattern binds {len(names)} results but the replacement gives "
                                     f"{len(rep.items)} values", "E305",
                           help="give one value per result, in order; write _ for a result the "
                                "replacement does not provide (it must then be unused)")
        elif isinstance(rep, ast.Call) and len(rep.op.names) == 1:
            kind, found = self.resolve(rep.op.names[0])
            if kind == "op":
                from rewrite.engine.outputs import fixed_count, single_output

                count = fixed_count(found)
                if single_output(found):
                    self.error(rep.span, f"'{rep.op.names[0]}' returns one value; the pattern binds "
                                         f"{len(names)} results", "E305",
                               help="write a tuple of values, one per result: "
                                    f"({', '.join(['...'] * len(names))})")
                elif count is not None and count != len(names):
                    self.error(rep.span, f"'{rep.op.names[0]}' returns {count} values; the pattern binds "
                                         f"{len(names)} results", "E305",
                               help="bind as many results as the replacement returns")
            elif kind == "function":
                self.error(rep.span, f"'{rep.op.names[0]}' makes one value; the pattern binds "
                                     f"{len(names)} results", "E305",
                           help="write a tuple of values, one per result")
        elif isinstance(rep, ast.Var):
            self.error(_span_of(rep), f"the pattern binds {len(names)} results; a replacement for them is a "
                                      f"tuple of values or a call of a multi-output op, not {_describe(rep)}",
                       "E305", help=f"write ({', '.join(['...'] * len(names))})")
        replaced = set(names) - {"_"}
        for e in ast.walk(rep):
            if isinstance(e, ast.Var) and e.name in replaced:
                self.error(e.span, f"'{e.name}' is a result of the matched op, which the replacement "
                                   "replaces", "E305",
                           help="build the values from the op's inputs; its results can be tested in "
                                "the where clause")

    def _several_replaced_by_one(self, r: ast.Rule) -> None:
        from rewrite.engine.outputs import LIST, ONE, output_kind

        pattern, rep = r.pattern, r.replacement
        if not isinstance(pattern, ast.Call) or len(pattern.op.names) != 1:
            return
        kind, found = self.resolve(pattern.op.names[0])
        several = output_kind(found) if kind == "op" else None
        if several != LIST and not (isinstance(several, int) and several > 1):
            return
        if isinstance(rep, ast.Call) and len(rep.op.names) == 1:
            rep_kind, rep_found = self.resolve(rep.op.names[0])
            if rep_kind != "op" or output_kind(rep_found) != ONE:
                return  # several (or unknown): the count is compared at run time
        elif not isinstance(rep, ast.Var):
            return
        what = f"'{rep.op.names[0]}', which returns one" if isinstance(rep, ast.Call) else _describe(rep)
        self.error(_span_of(rep) or rep.span, f"'{pattern.op.names[0]}' returns several values; a replacement "
                                              f"for it is one call of an op that returns as many, not {what}",
                   "E305",
                   help=f"bind its results in the pattern ({pattern.op.names[0]}(...) as (a, b)) and "
                        "replace them by a tuple of values")

    def _tuple_binding(self, e: ast.AsTuple) -> None:
        """``op(...) as (a, b)``: the op returns several values, as many as named
        when its schema fixes the number."""
        if not isinstance(e.expr, ast.Call):
            self.error(e.span, f"'as (...)' binds the results of an op call, not {_describe(e.expr)}", "E304",
                       help="write op(...) as (a, b)")
            return
        from rewrite.engine.outputs import fixed_count, results_opdef, single_output

        for name in e.expr.op.names:
            kind, found = self.resolve(name)
            if kind != "op":
                continue
            found = results_opdef(name, found)
            count = fixed_count(found)
            if single_output(found):
                self.error(e.span, f"'{name}' returns one value; 'as (...)' binds the results of an op that "
                                   "returns several", "E305", help="name its value with 'as name'")
            elif count is not None and count != len(e.names):
                self.error(e.span, f"'{name}' returns {count} values; the pattern binds {len(e.names)}", "E305",
                           help=f"bind all {count}, writing _ for those the rule ignores")

    def _options(self, r: ast.Rule) -> None:
        seen = set()
        for opt in r.options:
            if opt.name in seen:
                self.error(opt.span, f"option '{opt.name}' given twice", "E406")
                continue
            seen.add(opt.name)
            if opt.name not in OPTIONS:
                self.error(opt.span, f"unknown rule option '{opt.name}'", "E405",
                           help=self._suggest(opt.name, OPTIONS) or f"known options: {', '.join(OPTIONS)}")
                continue
            ok, wanted = OPTIONS[opt.name]
            value = opt.value
            if isinstance(value, (ast.Var, ast.Call, ast.TupleLit, ast.ListLit, ast.DTypeLit, ast.Wildcard,
                                  ast.As, ast.Compare, ast.BoolOp, ast.Not, ast.Index)) or not ok(value):
                shown = format_expr(value if hasattr(value, "span") else ast.Literal(value))
                self.error(opt.span, f"option '{opt.name}' must be {wanted}, got {shown}", "E406")

    # ------------------------------------------------------ variables

    def _bind(self, pattern: object) -> None:
        """Record the pattern's variables; report names bound twice by ``as``."""
        var_spans: dict = {}
        for e in ast.walk(pattern):
            if isinstance(e, ast.Var):
                var_spans.setdefault(e.name, e.span)
                self.bound.setdefault(e.name, e.span)
        as_spans: dict = {}
        for e in ast.walk(pattern):
            if isinstance(e, ast.AsTuple):
                for name, span in zip(e.names, _result_spans(e)):
                    if name == "_":
                        continue
                    # a result named again in the pattern is the same value (an argument's
                    # results only: a root's are read outside the match)
                    if name in as_spans or (name in var_spans and e is pattern):
                        self.error(span, f"'{name}' is bound twice; each result needs a new name", "E303",
                                   help="give each result its own name, or _ to ignore it")
                    as_spans.setdefault(name, span)
                    self.bound.setdefault(name, span)
                continue
            if not isinstance(e, ast.As):
                continue
            span = _as_name_span(e)
            if e.name in as_spans:
                self.error(span, f"'{e.name}' names two nodes with 'as'", "E303",
                           help="give each named node its own name")
            elif any(isinstance(v, ast.Var) and v.name == e.name for v in ast.walk(e.expr)):
                self.error(span, f"'{e.name}' names a node that would read itself", "E303",
                           help="a name bound by 'as' may be written again elsewhere in the pattern "
                                "(the same node), not inside what it names")
            # (a variable of the same name elsewhere in the pattern is that same node: a
            # value the pattern reads twice, as a written-out layer norm reads x - mean)
            as_spans.setdefault(e.name, span)
            self.bound.setdefault(e.name, span)

    def _unused(self, r: ast.Rule) -> None:
        counts: dict = {}
        spans: dict = {}
        for e in ast.walk(r.pattern):
            if isinstance(e, ast.AsTuple):
                for name, span in zip(e.names, _result_spans(e)):
                    if name != "_":
                        counts[name] = counts.get(name, 0) + 1
                        spans.setdefault(name, span)
                continue
            name = e.name if isinstance(e, (ast.Var, ast.As)) else None
            if name is not None:
                counts[name] = counts.get(name, 0) + 1
                spans.setdefault(name, e.span if isinstance(e, ast.Var) else _as_name_span(e))
        for name, count in counts.items():
            if count == 1 and name not in self.used and not name.startswith("_"):
                self.error(spans[name], f"unused pattern variable '{name}'", "E302",
                           help="write _ to match anything, or use the variable in the where clause or replacement")

    def _use(self, v: ast.Var) -> None:
        self.used.add(v.name)
        if v.name in self.bound:
            return
        hint = self._suggest(v.name, self.bound)
        if v.name in DTYPES:
            hint = f"did you mean 'torch.{v.name}'?"
        elif v.name in ("inf", "nan"):
            hint = NOT_LITERALS
        self.error(v.span, f"unbound variable '{v.name}'", "E301",
                   help=hint or "every variable of the where clause and replacement must appear in the pattern")

    # ------------------------------------------------------ expressions

    def check(self, e: object, place: str) -> None:
        """Check ``e`` as used in ``place`` (pattern, where clause, replacement)."""
        if isinstance(e, ast.Var):
            if place != _PATTERN:
                self._use(e)
        elif isinstance(e, ast.Wildcard):
            if place != _PATTERN:
                self.error(e.span, "'_' can only be used in a pattern", "E304",
                           help="use a variable bound by the pattern")
        elif isinstance(e, (ast.TupleLit, ast.ListLit)):
            for item in e.items:
                self.check(item, place)
        elif isinstance(e, ast.As):
            if place != _PATTERN:
                self.error(_as_name_span(e), "'as' can only be used in a pattern", "E304",
                           help="name the node in the pattern and use the name here")
            elif not isinstance(e.expr, ast.Call):
                self.error(_as_name_span(e), f"'as' can only name a call, not {_describe(e.expr)}", "E304",
                           help="a variable already names what it matches")
            self.check(e.expr, place)
        elif isinstance(e, ast.AsTuple):
            if place != _PATTERN:
                self.error(e.span, "'as (...)' can only be used in a pattern", "E304",
                           help="bind the results in the pattern and use the names here")
            else:
                self._tuple_binding(e)
            if isinstance(e.expr, ast.Call):
                self.call(e.expr, place, results=True)
            else:
                self.check(e.expr, place)
        elif isinstance(e, ast.Call):
            self.call(e, place)
        elif isinstance(e, ast.DTypeLit):
            import torch

            if not isinstance(getattr(torch, e.name, None), torch.dtype):
                self.error(e.span, f"this torch build has no dtype 'torch.{e.name}'", "E010",
                           help=f"torch {torch.__version__} lacks it; use another dtype")
        elif isinstance(e, (ast.Compare, ast.BoolOp, ast.Not, ast.Index)):
            if place != _WHERE:
                self.error(e.span, f"{_what(e)} can only be used in a where clause", "E304",
                           help="conditions go after 'where', between the pattern and '=>'")
            for child in _children(e):
                self.check(child, place)

    def call(self, c: ast.Call, place: str, results: bool = False) -> None:
        self._duplicate_keywords(c)
        if len(c.op.names) > 1 and place != _PATTERN:
            self.error(c.op.span, "alternatives can only be used in a pattern", "E304",
                       help="call one op or function here")
        if c.rest and place != _PATTERN:
            self.error(c.span, "'...' can only be used in a pattern", "E304",
                       help="write every argument the call needs")
        spans = c.op.name_spans if len(c.op.name_spans) == len(c.op.names) else (c.op.span,) * len(c.op.names)
        for name, span in zip(c.op.names, spans):
            kind, found = self.resolve(name)
            if results and kind == "op":
                from rewrite.engine.outputs import results_opdef

                found = results_opdef(name, found)
            getattr(self, "_call_in_" + place.split()[0])(c, name, span, kind, found)
        for a in c.args:
            self.check(a, place)
        for k in c.kwargs:
            self.check(k.value, place)

    def _call_in_pattern(self, c: ast.Call, name: str, span: Any, kind: str | None, found: Any) -> None:
        if kind == "family":
            members = self.family_ops(found)
            for member, opdef in members:
                # a literal only some members take matches those (mul | matmul: f(x, 2) is a mul)
                self._op_args(c, opdef, f"'{member}' (in family '{name}')", span,
                              siblings=[other for _, other in members if other is not opdef])
        elif kind == "op":
            self._op_args(c, found, f"'{name}'", span)
        elif kind == "function":
            where = "where clause" if found.kind in ("predicate", "query") else "replacement"
            self.error(span, f"'{name}' is a {found.kind}, not an op; a pattern can only call ops and families",
                       "E104", help=f"use it in the {where}")
        elif self.scope.complete:
            refused = _vocabulary().op_refusal(name)  # a torch.library op: say why it is not one
            self.error(span, refused.message if refused else f"unknown op '{name}'", "E102",
                       help=refused.help if refused else
                       self._suggest(name, self._ops_and_families(), _vocabulary().lookup_op))

    def _call_in_where(self, c: ast.Call, name: str, span: Any, kind: str | None, found: Any) -> None:
        if kind == "function" and found.kind in ("predicate", "query"):
            self._function_args(c, found, span)
        elif kind is not None:
            what = {"op": "an op", "family": "a family"}.get(kind) or f"a {found.kind} function"
            self.error(span, f"'{name}' is {what}; a where clause can only call predicates and queries", "E104",
                       help="match ops in the pattern and test them here through their variables")
        else:
            names = _registry().function_names("predicate") + _registry().function_names("query")
            self.error(span, f"unknown predicate or query '{name}'", "E103", help=self._suggest(name, names))

    def _call_in_replacement(self, c: ast.Call, name: str, span: Any, kind: str | None, found: Any) -> None:
        if kind == "op":
            self._op_args(c, found, f"'{name}'", span)
            self._writes(c, found, name, span)
            self._unsafe_emission(name, span)
            self._unbounded_arithmetic(c, name, span)
            self._failing_arithmetic(c, name, span)
            self._literal_sizes(c, found, name, span)
        elif kind == "function" and found.kind in ("constant", "module"):
            self._function_args(c, found, span)
        elif kind == "function":
            self.error(span, f"'{name}' is a {found.kind}; a replacement can only call ops and constant or "
                             "module functions", "E104", help="use it in the where clause")
        elif kind == "family":
            self.error(span, f"'{name}' is a family; a replacement must call one op", "E104",
                       help="name the op to build")
        else:
            reg = _registry()
            names = list(_vocabulary().op_names()) + reg.function_names("constant") + reg.function_names("module")
            refused = _vocabulary().op_refusal(name)  # a torch.library op: say why it is not one
            self.error(span, refused.message if refused else f"unknown op or function '{name}'", "E102",
                       help=refused.help if refused else self._suggest(name, names, _vocabulary().lookup_op))

    # ------------------------------------------------------ effects

    def _writes(self, c: ast.Call, opdef: Any, name: str, span: Any) -> None:
        """A replacement may write in place only into a value it creates itself (an
        op call whose result shares no memory with its arguments): anything else is
        the caller's input, a module constant or a value other nodes read, and the
        rewritten model would change it."""
        from rewrite.ops.effects import opdef_writes

        given = self._arguments(c, opdef)
        for param, flag in opdef_writes(opdef):
            if flag is not None and not _may_be_true(given.get(flag, _default_of(opdef, flag))):
                continue
            written = given.get(param, _default_of(opdef, param))
            if written is None or (isinstance(written, ast.Literal) and written.value is None):
                continue
            if self._fresh(written):
                continue
            when = f" (when {flag} is true)" if flag is not None else ""
            self.error(_span_of(written) or span,
                       f"'{name}' writes its argument '{param}' in place{when}; a replacement may only write "
                       f"a value it creates", "E105",
                       help="emit the functional op (e.g. 'mul' rather than 'aten.mul_'), or write into a "
                            "fresh copy: aten.mul_(clone(x), -1.0)")

    def _unsafe_emission(self, name: str, span: Any) -> None:
        """A replacement builds ops outside the vocabulary only where they are safe
        (``rewrite.ops.generic.emission_refusal``)."""
        from rewrite.ops.generic import emission_refusal
        from rewrite.ops.resolve import normalize_qualname

        qualname = normalize_qualname(name)
        if qualname is None or "." not in qualname or _vocabulary().in_vocabulary(name):
            return
        why = emission_refusal(qualname)
        if why is not None:
            self.error(span, f"'{name}' cannot be built by a replacement: {why}", "E106",
                       help="build the public op the vocabulary names (rewrite.reference lists them); "
                            "a pattern may still match this one")

    def _unbounded_arithmetic(self, c: ast.Call, name: str, span: Any) -> None:
        """E207: Python arithmetic whose result may be unboundedly large, which
        inferring the replacement's facts (and every call of the rewritten model)
        would compute: ``operator.pow(10, 100000000000)``, a shift that far, a power
        of a power, a string or list repeated that many times."""
        from rewrite.ops.resolve import normalize_qualname

        op = normalize_qualname(name)
        args = list(c.args) + [k.value for k in c.kwargs]
        if op in _GROWING and len(args) == 2:
            base, exponent = args
            small = isinstance(exponent, ast.Var) or (
                isinstance(exponent, ast.Literal) and isinstance(exponent.value, (int, float))
                and abs(exponent.value) <= _MAX_EXPONENT)
            if not small or isinstance(base, ast.Call):
                self.error(span, f"'{name}' may compute a number without bound here: its exponent or shift must be "
                                 f"a pattern variable or a number literal of at most {_MAX_EXPONENT}, and its base "
                                 "a variable or a literal", "E207",
                           help="compute the constant in a registered constant function, or write the number")
        elif op in _FORMATTING and args and isinstance(_literal_value(args[0]), str) and "%" in _literal_value(args[0]):
            self.error(span, f"'{name}' formats a string ('%' with a width or precision may make it as long as "
                             "it says, at load and in every call of the rewritten model)", "E207",
                       help="write the string out")
        elif op in _REPEATING and len(args) == 2:
            times = _repetitions(c)
            if times is not None and times > _MAX_REPEAT:
                self.error(span, f"'{name}' repeats a literal sequence a number of times that may have no bound: "
                                 "the count (nested repeats multiply theirs) must be an int literal of at most "
                                 f"{_MAX_REPEAT}", "E207",
                           help="write the sequence out")

    def _failing_arithmetic(self, c: ast.Call, name: str, span: Any) -> None:
        """E210: Python arithmetic on literals alone that raises
        (``operator.truediv(1, 0)``, ``operator.getitem([1, 2], 5)``): every call of the
        rewritten model would raise. Reported where the failing call is, not again at
        the calls around it."""
        value = _literal_value(c)
        if isinstance(value, _FailedArithmetic) and all(
                not isinstance(_literal_value(a), _FailedArithmetic) for a in (*c.args, *(k.value for k in c.kwargs))):
            self.error(span, f"'{name}' of these literals raises {type(value.error).__name__}: {value.error}", "E210",
                       help="write the value it should have, or take the operands from matched values")

    def _literal_sizes(self, c: ast.Call, opdef: Any, name: str, span: Any) -> None:
        """E207: a size, count or number of steps written as a literal that large
        (``torch.linspace(0, 1, 10 ** 18)``, ``new_zeros(x, [2 ** 62])``,
        ``repeat(x, [10 ** 6, 10 ** 6])``): inferring the replacement's facts costs
        nothing, but the check, verification and every call of the rewritten model
        would allocate it."""
        for param, arg in self._arguments(c, opdef).items():
            bound = _GROWTH_PARAMS.get(param)
            if bound is not None:
                largest = max(map(abs, _literal_numbers(arg)), default=None)
                if largest is not None and largest > bound:
                    self.error(_span_of(arg) or span,
                               f"argument '{param}' of '{name}' is given {largest}: written as a literal, it is at "
                               f"most {bound} (the op's result grows with it)", "E207",
                               help="take it from a matched value, or compute the constant in a registered "
                                    "constant function")
                continue
            if param not in _SIZE_PARAMS:
                continue
            lowest = min((v for v in _literal_numbers(arg) if isinstance(v, int)), default=None)
            if lowest is not None and param != "end" and lowest < (-1 if param in _MAY_INFER else 0):
                self.error(_span_of(arg) or span,
                           f"argument '{param}' of '{name}' is given the size {lowest}: no size is negative"
                           + (" (-1 asks for the one inferred from the others)" if param in _MAY_INFER else ""),
                           "E207", help="take the size from a matched value (shape(x)), or write it as a "
                                        "non-negative literal")
                continue
            count = _literal_count(arg)
            if count is not None and count > _MAX_LITERAL_ELEMENTS:
                self.error(_span_of(arg) or span,
                           f"argument '{param}' of '{name}' asks for {count} elements: a size written as a literal "
                           f"is at most {_MAX_LITERAL_ELEMENTS}", "E207",
                           help="take the size from a matched value (shape(x)), or compute the constant in a "
                                "registered constant function")

    @staticmethod
    def _arguments(c: ast.Call, opdef: Any) -> dict:
        given = dict(zip(opdef.param_names, c.args))
        given.update({k.name: k.value for k in c.kwargs})
        return given

    def _fresh(self, e: object) -> bool:
        """``e`` is a value the replacement creates: an op call whose result shares
        no memory with its arguments (a copy, an arithmetic op), not a variable, a
        constant (a module attribute, kept across calls) or a view."""
        from rewrite.ops.effects import opdef_may_alias

        if not isinstance(e, ast.Call) or len(e.op.names) != 1:
            return False
        kind, found = self.resolve(e.op.names[0])
        return kind == "op" and not opdef_may_alias(found)

    # ------------------------------------------------------ arguments

    def _duplicate_keywords(self, c: ast.Call) -> None:
        seen = set()
        for k in c.kwargs:
            if k.name in seen:
                self.error(k.span, f"keyword argument '{k.name}' given twice", "E203")
            seen.add(k.name)

    def _op_args(self, c: ast.Call, opdef: Any, who: str, span: Any, siblings: list = ()) -> None:
        """Check a call's arguments against an op's signature (``siblings``: the other
        members of the family a pattern calls)."""
        names = [p.name for p in opdef.params]
        sig = f"signature: {_signature(opdef)}"
        if opdef.qualified:
            sig = _other_overloads_hint(c, opdef, sig)
        errors_before = len(self.diags)
        if len(c.args) > len(names):
            extra = c.args[len(names)]
            spread = next(((f.rename or {}).get(f.varargs, f.varargs) for f in opdef.forms
                           if getattr(f, "varargs", None)), None)
            hint = f"; a rule writes '{spread}' as one list, as in [2, 3]" if spread else ""
            self.error(_span_of(extra), f"too many arguments for {who}: it takes {len(names)}, got {len(c.args)}",
                       "E201", help=sig + hint)
        given = set(names[: len(c.args)])
        for k in c.kwargs:
            if k.name == "out" and "out" not in names:  # torch takes it: say why a rule may not
                self.error(k.span, f"'out=' makes {who} write its result into a given tensor, in place; rules "
                                   "name the functional op", "E105", help="use the op's result instead of out=")
            elif k.name not in names:
                hint = self._suggest(k.name, names)
                self.error(k.span, f"{who} has no parameter '{k.name}'", "E202",
                           help=f"{hint} ({sig})" if hint else sig)
            elif k.name in given and names.index(k.name) < len(c.args):
                self.error(k.span, f"argument '{k.name}' of {who} given both by position and by keyword",
                           "E203", help=sig)
            given.add(k.name)
        if len(self.diags) == errors_before:  # arguments that miss the signature have no types to check
            self._literal_args(c, opdef, who, sig, siblings)
        if c.rest:
            return
        required = _vocabulary().REQUIRED
        missing = [p.name for p in opdef.params if p.default is required and p.name not in given]
        if missing:
            listed = ", ".join(f"'{m}'" for m in missing)
            self.error(span, f"missing argument{'s' * (len(missing) > 1)} {listed} for {who}", "E204",
                       help=f"{sig}; in a pattern, end the call with '...' to match the rest")

    def _literal_args(self, c: ast.Call, opdef: Any, who: str, sig: str, siblings: list = ()) -> None:
        """E206: a literal argument no form of the op can take (a string for
        ``softmax``'s int ``dim``, an int for ``to``'s dtype). Types come from the aten
        schemas of the op's forms (``rewrite.language.literals``); a parameter of
        unknown type takes anything. In a family's call, a literal another member
        takes is no error."""
        types = param_types(opdef)
        keyed = [(k.name, k.name, k.value) for k in c.kwargs]
        for where, name, value in [*((i, n, v) for i, (n, v) in enumerate(zip(opdef.param_names, c.args))), *keyed]:
            param = opdef.param(name)
            if param is None:
                continue
            if name == "dim" and "correction" in opdef.param_names and isinstance(value, ast.Literal) \
                    and isinstance(value.value, bool):
                # torch.var(x, False) is another overload's unbiased, which this dim is not
                self.error(_span_of(value) or c.span, f"argument 'dim' of {who} takes a dim (an int or a list of "
                           f"them), not a bool", "E206",
                           help="unbiased=False is correction=0, over every dim when dim is left out; " + sig)
                continue
            found = refusal(types.get(name), value, optional=param.default is None)
            if found is None or any(_takes(other, where, value) for other in siblings):
                continue
            bad, expected = found
            what = describe(bad) if bad is value else f"{describe(value)} holding {describe(bad)}"
            hint = "a dtype is written torch.float32, torch.bfloat16, ...; " if "dtype" in expected else ""
            binding = self.scope.uses.get(value.span) if bad is value and value.span is not None else None
            if binding is not None:  # a parameter's value: reported once, at the import that binds it
                entry = self.misused.setdefault(id(binding), (binding, []))
                entry[1].append((value.span, name, who, expected, hint + sig))
                continue
            self.error(_span_of(bad) or _span_of(value) or c.span,
                       f"argument '{name}' of {who} takes {expected}, not {what}", "E206", help=hint + sig)

    def binding_misuses(self) -> list:
        """One E206 per parameter binding whose literal some use of the parameter
        cannot take, at the binding, with a note at the first such use."""
        out = []
        for binding, misuses in self.misused.values():
            span, name, who, expected, help = misuses[0]
            more = ""
            if len(misuses) > 1:
                more = f" (and in {len(misuses) - 1} more place{'s' * (len(misuses) > 2)} like it)"
            out.append(Diagnostic(
                binding.value.span or binding.span,
                f"parameter '{binding.name}' is bound to {describe(binding.value)}, but it is passed as "
                f"argument '{name}' of {who}, which takes {expected}", "E206", help=help,
                related=((span, f"'{binding.name}' is used here{more}"),)))
        return out

    def _function_args(self, c: ast.Call, spec: Any, span: Any) -> None:
        problem = spec.accepts(len(c.args), tuple(k.name for k in c.kwargs))
        if problem:
            params = ", ".join(spec.params) + (", ..." if spec.variadic else "")
            self.error(span, problem, "E205", help=f"signature: {spec.name}({params})")
        if spec.choices and not problem:
            self._chosen_args(c, spec)
        if spec.op_names_from is not None:
            if not problem and len(c.args) <= spec.op_names_from:
                self.error(span, f"{spec.name}() names no op: it would never match", "E208",
                           help=f"name the ops after its first argument: {spec.name}(x, \"relu\")")
            for arg in c.args[spec.op_names_from:]:
                self._op_name_arg(arg, spec, span)

    def _chosen_args(self, c: ast.Call, spec: Any) -> None:
        """E209: a literal argument a registered function does not take (``kind="minmx"``
        for an observer): it would raise at rewrite time, and the rule not fire."""
        given = [*zip(spec.params, c.args), *((k.name, k.value) for k in c.kwargs)]
        for name, arg in given:
            allowed = spec.choices.get(name)
            if allowed is None or not isinstance(arg, ast.Literal) or arg.value in allowed \
                    and type(arg.value) is type(allowed[list(allowed).index(arg.value)]):
                continue
            shown = ", ".join(map(repr, allowed))
            close = did_you_mean(str(arg.value), [str(a) for a in allowed]) if isinstance(arg.value, str) else None
            self.error(getattr(arg, "span", None) or c.span,
                       f"argument '{name}' of {spec.name}() is {arg.value!r}, not one of {shown}", "E209",
                       help=close or f"{spec.name}() takes {name} = one of {shown}")

    def _op_name_arg(self, arg: Any, spec: Any, span: Any) -> None:
        """E208: an argument of ``feeds``/``produced_by`` that names no op by the
        name the engine gives it (``"relu"``, ``"conv"``): it would never match, and
        under ``not`` the clause would always hold."""
        at = getattr(arg, "span", None) or span
        if not (isinstance(arg, ast.Literal) and isinstance(arg.value, str)):
            self.error(at, f"{spec.name}() takes op names as string literals (\"relu\", \"conv\") after its first "
                           "argument", "E208", help="write the op's name in quotes")
            return
        found = _vocabulary().lookup_op(arg.value)
        if found is not None and found.name == arg.value:
            return
        hint = f"the op is called {found.name!r} here" if found is not None else \
            self._suggest(arg.value, list(_vocabulary().op_names()), _vocabulary().lookup_op)
        self.error(at, f"{spec.name}() names no op {arg.value!r}: it would never match", "E208", help=hint)


def _takes(opdef: Any, where: int | str, value: Any) -> bool:
    """Whether ``opdef`` takes literal ``value`` as its argument at ``where`` (a
    position or a keyword)."""
    name = (opdef.param_names[where] if where < len(opdef.param_names) else None) if isinstance(where, int) else where
    param = opdef.param(name) if name is not None else None
    return param is not None and refusal(param_types(opdef).get(name), value, optional=param.default is None) is None


def _default_of(opdef: Any, param: str) -> Any:
    """An omitted argument as a literal: the parameter's default (None when required)."""
    p = opdef.param(param)
    if p is None or p.default is _vocabulary().REQUIRED:
        return None
    return ast.Literal(p.default)


#: parameters that give how many elements an op makes (E207 bounds literal ones)
_SIZE_PARAMS = frozenset({"size", "sizes", "shape", "steps", "repeats", "n", "m", "end", "output_size", "length",
                          "dims", "num_classes", "bins", "minlength", "N"})
_MAX_LITERAL_ELEMENTS = 1 << 26
#: parameters an op's result grows with otherwise (by adding to a size, multiplying
#: each, or choosing among elements): each literal value they hold is at most this
_GROWTH_PARAMS = {"pad": 1 << 13, "diagonal": 1 << 13, "offset": 1 << 13, "scale_factor": 64, "r": 4}


def _literal_numbers(arg: Any) -> list:
    """The numbers a literal (a number, or a list or tuple of them, nested, or Python
    arithmetic on literals: ``operator.mul([100000], 2)``) holds."""
    if isinstance(arg, ast.Literal) and isinstance(arg.value, (int, float)) and not isinstance(arg.value, bool):
        return [arg.value]
    if isinstance(arg, (ast.ListLit, ast.TupleLit)):
        return [v for item in arg.items for v in _literal_numbers(item)]
    if isinstance(arg, ast.Call):
        return _numbers_in(_literal_value(arg))
    return []


def _numbers_in(value: Any) -> list:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in _numbers_in(item)]
    return []


class _FailedArithmetic:
    """What ``_literal_value`` answers for arithmetic on literals that raises."""

    def __init__(self, error: Exception) -> None:
        self.error = error


_NOT_LITERAL = object()

#: the ``operator`` functions ``_literal_value`` computes, on literals alone
_LITERAL_ARITHMETIC = frozenset({"add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs",
                                 "lshift", "rshift", "and_", "or_", "xor", "invert", "getitem", "not_", "eq", "ne",
                                 "lt", "le", "gt", "ge"})


def _literal_value(e: Any) -> Any:
    """The value of ``e`` where it is made of literals alone, Python arithmetic on
    them included (``operator.mul(8193, 8193)``, as the rewritten model would
    compute it); a ``_FailedArithmetic`` where that arithmetic raises; ``_NOT_LITERAL``
    otherwise, or where E207 leaves its size unbounded (it is not computed then)."""
    from rewrite.ops.resolve import normalize_qualname

    if isinstance(e, ast.Literal):
        return e.value
    if isinstance(e, (ast.ListLit, ast.TupleLit)):
        items = [_literal_value(item) for item in e.items]
        if any(item is _NOT_LITERAL or isinstance(item, _FailedArithmetic) for item in items):
            return next((i for i in items if isinstance(i, _FailedArithmetic)), _NOT_LITERAL)
        return items if isinstance(e, ast.ListLit) else tuple(items)
    if not isinstance(e, ast.Call) or e.kwargs or len(e.op.names) != 1:
        return _NOT_LITERAL
    op = normalize_qualname(e.op.names[0]) or ""
    module, _, fn = op.rpartition(".")
    if module != "operator" or fn not in _LITERAL_ARITHMETIC:
        return _NOT_LITERAL
    args = [_literal_value(a) for a in e.args]
    failed = next((a for a in args if isinstance(a, _FailedArithmetic)), None)
    if failed is not None or any(a is _NOT_LITERAL for a in args):
        return failed or _NOT_LITERAL
    if not _bounded(fn, args):
        return _NOT_LITERAL
    try:
        return getattr(operator, fn)(*args)
    except Exception as error:  # noqa: BLE001 - what the rewritten model's every call would raise
        return _FailedArithmetic(error)


def _bounded(fn: str, args: list) -> bool:
    """Whether computing ``fn`` on ``args`` is cheap: E207's bounds (an exponent or
    shift of at most 64 on a number, a sequence made at most 4096 long), judged
    before anything is computed (``[0] * 4096 * 4096`` is never built)."""
    if fn in ("pow", "lshift") and len(args) == 2:  # (2 ** 64) ** 64 at most: 4096 bits
        return isinstance(args[1], (int, float)) and abs(args[1]) <= _MAX_EXPONENT \
            and isinstance(args[0], (int, float)) and abs(args[0]) <= 2 ** 64
    if fn == "mul" and len(args) == 2:
        for sequence, count in (args, args[::-1]):
            if isinstance(sequence, (str, list, tuple)):
                return isinstance(count, int) and _literal_size(sequence) * max(count, 0) <= _MAX_REPEAT
    if fn == "mod" and args and isinstance(args[0], str):  # "%0300000000d" % 1: formatting, never computed
        return False
    if fn == "add" and len(args) == 2 and all(isinstance(a, (str, list, tuple)) for a in args):
        return _literal_size(args[0]) + _literal_size(args[1]) <= _MAX_REPEAT
    return all(not isinstance(a, (int, float)) or abs(a) <= 2 ** 4096 for a in args)


def _literal_size(value: Any) -> int:
    """How many items a literal holds, nested sequences' items counted (a list of a
    repeated list is as large as all its copies), or more than ``_MAX_REPEAT``: the
    count stops there."""
    if isinstance(value, str):
        return len(value)
    if not isinstance(value, (list, tuple)):
        return 1
    total = 0
    for item in value:
        total += _literal_size(item) if isinstance(item, (list, tuple)) else 1
        if total > _MAX_REPEAT:
            break
    return total


#: size parameters where -1 stands for a size inferred from the others (view, reshape, expand)
_MAY_INFER = frozenset({"size", "sizes", "shape"})


def _literal_count(arg: Any) -> Optional[int]:
    """The elements a literal size asks for: an int, or the product of a list or
    tuple of ints (``-1`` as one), arithmetic on literals computed; None when it is
    not a literal."""
    if isinstance(arg, ast.Literal) and isinstance(arg.value, int) and not isinstance(arg.value, bool):
        return abs(arg.value)
    if isinstance(arg, (ast.ListLit, ast.TupleLit)):
        count = 1
        for item in arg.items:
            n = _literal_count(item)
            if n is None:
                return None
            count *= max(n, 1)
        return count
    if isinstance(arg, ast.Call):
        return _count_of(_literal_value(arg))
    return None


def _count_of(value: Any) -> Optional[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value)
    if isinstance(value, (list, tuple)):
        counts = [_count_of(item) for item in value]
        return None if None in counts else math.prod(max(n, 1) for n in counts)
    return None


_GROWING = frozenset({"operator.pow", "operator.ipow", "operator.lshift", "operator.ilshift"})
_REPEATING = frozenset({"operator.mul", "operator.imul"})
_FORMATTING = frozenset({"operator.mod", "operator.imod"})
_JOINING = frozenset({"operator.add", "operator.iadd", "operator.concat", "operator.iconcat"})
_MAX_EXPONENT = 64
_MAX_REPEAT = 4096


def _may_be_true(e: object) -> bool:
    """Whether an argument can be true when the rule fires: anything but a falsy literal."""
    return not (isinstance(e, ast.Literal) and not e.value) and e is not None


def _bindings_in(e: object, uses: dict) -> set:
    """Ids of the import bindings whose values ``e`` holds (``Scope.uses``: the span
    of each use of a parameter, which the value substituted there carries)."""
    found: set = set()
    if not uses:
        return found
    stack = [e]
    while stack:
        node = stack.pop()
        span = getattr(node, "span", None)
        if isinstance(node, (ast.Literal, ast.DTypeLit, ast.TupleLit, ast.ListLit)) and span in uses:
            found.add(id(uses[span]))
        if isinstance(node, (ast.Compare, ast.BoolOp, ast.Not, ast.Index)):
            stack.extend(_children(node))
        elif isinstance(node, (ast.TupleLit, ast.ListLit)):
            stack.extend(node.items)
        elif isinstance(node, ast.Call):
            stack.extend((*node.args, *(k.value for k in node.kwargs)))
    return found


def _children(e: object) -> tuple:
    if isinstance(e, ast.Compare):
        return (e.left, e.right)
    if isinstance(e, ast.BoolOp):
        return e.items
    if isinstance(e, ast.Not):
        return (e.expr,)
    return (e.expr, e.index)


def _span_of(e: object) -> ast.Span | None:
    return getattr(e, "span", None)


def _describe(e: object) -> str:
    if isinstance(e, ast.Var):
        return f"variable '{e.name}'"
    if isinstance(e, ast.Wildcard):
        return "'_'"
    if isinstance(e, (ast.Literal, ast.DTypeLit)):
        return f"literal {format_expr(e)}"
    if isinstance(e, ast.TupleLit):
        return "a tuple"
    if isinstance(e, ast.ListLit):
        return "a list"
    if isinstance(e, ast.As):
        return "'as'"
    return _what(e) if type(e) in _WHAT else type(e).__name__
