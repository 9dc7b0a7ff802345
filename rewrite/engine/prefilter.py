"""Operand prefilters: reject a rule at a node from its raw arguments, before binding.

A rule's root op may occur thousands of times (every ``add``, every ``relu``) while
the pattern asks for a particular producer in one argument (``relu(relu(_))``,
``add(x, neg(y))``) or a literal (``add(x, 0)``). Binding a node normalizes all of
its arguments; the prefilter looks only at those the pattern constrains, read
straight from ``node.args``/``node.kwargs`` at positions computed once per (rule,
root node key): the operand's node key must be one the nested call can bind, the
literal must be equal.

Where-clause conjuncts over the root's own arguments (``permute(x, p) where
is_identity_perm(p)``, ``reshape_like(x, s) where reshape_is_noop(x, s)``) are
evaluated the same way, on the arguments as the node holds them, when binding would
hand the matcher exactly those values (a form bound through its plain plan, no
keywords): on a transformer most views and permutes fail such a clause, and
rejecting them here skips binding the node at all. A conjunct that raises lets the
node through, so the matcher records the error as before. Only conjuncts calling the
library's own functions are evaluated here: a function the user registered sees
matches only.

It is only ever a necessary condition. Whenever a position cannot be known from
the form alone (varargs, value conversions, ``getitem``, a module's settings; a
module call's forward input is known: every extractor of ``ops/modules.py`` reads
it from the same place) the filter lets the node through and the matcher decides,
so results never change; ``tests/test_differential.py`` compares against the interpreter, which runs
without prefilters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
from torch import fx

from rewrite.engine.compile import CompiledRule, PAlt, PCall, PDefault, PLit, PResults, PSeq, PVar
from rewrite.engine.symbolic import deciding
from rewrite.engine.where import where_function
from rewrite.functions.registry import is_builtin, lookup_function
from rewrite.language import ast
from rewrite.ops import forms_for_key
from rewrite.ops.base import FunctionForm, MethodForm, ModuleForm
from rewrite.ops.forms import Fn, Method, binding_plan, same_arg
from rewrite.ops.modules import reads_forward_input

__all__ = ["build_prefilter"]

_NODE = fx.Node
_ABSENT = object()
_SAME = object()  # a need's literal: the argument is the same node as another one

#: ``check(matcher, node) -> bool``: False only if the rule cannot match at node.
Prefilter = Callable[[Any, fx.Node], bool]


@attrs.frozen
class _Need:
    """The argument at ``index`` (or keyword ``kwarg``) must be a node with a key in
    ``keys``, or (``keys`` None) equal ``literal`` when it is given."""

    index: int
    kwarg: str
    keys: frozenset | None
    literal: Any = None
    nested: Prefilter | None = None  # what the producer must hold beyond its key
    other: tuple | None = None  # literal _SAME: (index, kwarg) of the argument it must be the same node as


def build_prefilter(rule: CompiledRule, key: Any) -> Prefilter | None:
    """A prefilter for ``rule`` at nodes with node key ``key``, or None when nothing
    can be checked cheaply (every node then goes to the matcher)."""
    root = rule.pattern
    if not isinstance(root, PCall):
        return None
    options = _options(root, key, _root_conjuncts(rule))
    return None if options is None else _checker(options)


def _options(call: PCall, key: Any, conjuncts: tuple) -> tuple | None:
    """``(needs, where-needs)`` per reading of a node with key ``key`` as ``call``
    (form, argument order): any option's needs all holding lets the node through.
    None when some reading constrains nothing (or none exists)."""
    options: list = []
    for alt in call.alts:
        for form in _forms_at(alt, key):
            if not isinstance(form, (FunctionForm, MethodForm, ModuleForm)):
                return None
            for order in _orders(alt):
                needs = _needs(form, order) + _same_needs(form, alt, order)
                clauses = _where_needs(form, alt, order, call.name, conjuncts)
                if not needs and not clauses:
                    return None  # this reading of the node constrains nothing
                options.append((needs, clauses))
    return tuple(options) if options else None


#: id(nested call pattern) -> (the pattern, its operand filter): built once per
#: pattern, not once per reading of each enclosing node (a 5-deep attention pattern
#: of ops with many spellings would multiply those readings level by level)
_OPERAND_FILTERS: dict = {}


def _operand_filter(call: PCall) -> Prefilter | None:
    """What a nested call asks of the node in its place beyond its key (its own
    literals and producers, ``add(x, mul(y, 2.0))``), per node key: a rule set of
    many rules that differ one level down then fails at the root's arguments
    instead of binding the node in full for each rule. None when no key of the
    nested call constrains anything."""
    known = _OPERAND_FILTERS.get(id(call))
    if known is not None and known[0] is call:
        return known[1]
    made = _build_operand_filter(call)
    if len(_OPERAND_FILTERS) > 4096:  # rule files loaded again and again: keep it bounded
        _OPERAND_FILTERS.clear()
    _OPERAND_FILTERS[id(call)] = (call, made)
    return made


def _build_operand_filter(call: PCall) -> Prefilter | None:
    by_function: dict = {}
    by_key: dict = {}
    for key in _keys_of(call):
        options = _options(call, key, ())
        if options is None:
            continue
        if key[0] == "call_function":
            by_function[id(key[1])] = _checker(options)
        else:
            by_key[key] = _checker(options)
    if not by_function and not by_key:
        return None

    def nested(matcher: Any, node: fx.Node) -> bool:
        check = by_function.get(id(node.target)) if node.op == "call_function" else by_key.get(matcher.key(node))
        return check is None or check(matcher, node)

    return nested


_ROOT = -1  # a where-need's place for the root node itself (``relu(_) as r``)


def _root_conjuncts(rule: CompiledRule) -> tuple:
    """``(closure, variable names)`` of each conjunct of the rule's where clause
    whose variables are all bound once, directly at the root (as an argument or
    as the root's ``as`` name): those the prefilter can evaluate before binding."""
    if rule.where is None or rule.pattern.results is not None:
        return ()
    counts: dict = {}
    _count_names(rule.pattern, counts)
    direct = {pat.name for alt in rule.pattern.alts for _, pat in alt.args if isinstance(pat, PVar)}
    if rule.pattern.name is not None:
        direct.add(rule.pattern.name)
    where = rule.where
    items = where.items if isinstance(where, ast.BoolOp) and where.op == "and" else (where,)
    out = []
    for item in items:
        names = frozenset(e.name for e in ast.walk(item) if isinstance(e, ast.Var))
        if names and all(counts.get(n) == 1 and n in direct for n in names) and _calls_only_builtins(item):
            out.append((where_function(item, rule.expansions), names))
    return tuple(out)


def _calls_only_builtins(item: Any) -> bool:
    """Whether a conjunct calls only the library's own functions: a function the
    user registered is called on matches only (it may log, count or assume the
    pattern's literals), never on a node the prefilter has not ruled out yet (one
    whose omitted argument the matcher still compares with the pattern's)."""
    for e in ast.walk(item):
        if isinstance(e, ast.Call):
            spec = lookup_function(e.op.names[0])
            if spec is None or not is_builtin(spec.fn):
                return False
    return True


def _count_names(p: Any, counts: dict) -> None:
    """How often each variable (and ``as`` name) is bound in one match of pattern
    ``p``: a call's alternatives are read one at a time (the most any binds)."""
    if isinstance(p, PVar):
        counts[p.name] = counts.get(p.name, 0) + 1
    elif isinstance(p, PCall):
        for name in ((p.name,) if p.name is not None else ()) + tuple(p.results or ()):
            counts[name] = counts.get(name, 0) + 1
        most: dict = {}
        for alt in p.alts:
            inner: dict = {}
            for _, a in alt.args:
                _count_names(a, inner)
            for name, n in inner.items():
                most[name] = max(most.get(name, 0), n)
        for name, n in most.items():
            counts[name] = counts.get(name, 0) + n
    elif isinstance(p, PSeq):
        for item in p.items:
            _count_names(item, counts)
    elif isinstance(p, PResults):
        _count_names(p.call, counts)


def _where_needs(form: Any, alt: PAlt, order: tuple, root_name: str | None, conjuncts: tuple) -> tuple:
    """``(closure, ((variable, index), ...))`` for each root conjunct this reading
    of the node can evaluate: the form binds through its plain plan (the bound
    value of a parameter is the node's argument at its position, unconverted) and
    every variable of the conjunct has a position in it (or is the root)."""
    if not conjuncts or not isinstance(form, (Fn, Method)) or binding_plan(form, alt.opdef) is None:
        return ()  # a module, or a form whose binding may convert its arguments
    places: dict = {} if root_name is None else {root_name: _ROOT}
    for param, pat in order:
        if isinstance(pat, PVar):
            place = _position(form, param)
            if place is not None:
                places[pat.name] = place[0]
    return tuple((fn, tuple((n, places[n]) for n in sorted(names)))
                 for fn, names in conjuncts if all(n in places for n in names))


def _forms_at(alt: PAlt, key: Any) -> list:
    if alt.canonical:
        return [form for _, form in forms_for_key(key) if form.op == alt.opdef.name]
    return [form for form in alt.opdef.forms if form.key == key]


def _orders(alt: PAlt) -> list:
    """The argument orders the matcher tries: as written, and for commutative ops
    the first two tensor parameters swapped."""
    return [alt.args] if alt.swapped is None else [alt.args, alt.swapped]


def _needs(form: Any, order: tuple) -> tuple:
    needs = []
    for param, pat in order:
        nested = None
        if isinstance(pat, PCall):
            keys, literal, nested = _keys_of(pat), None, _operand_filter(pat)
        elif isinstance(pat, (PLit, PDefault)) and param not in getattr(form, "convert", {}) \
                and not (isinstance(pat, PLit) and isinstance(pat.value, tuple)):
            # (a sequence literal, ``reshape(x, (4, 8))``, is left to the matcher: a
            # node may spell it spread out, ``x.reshape(4, 8)``)
            keys, literal = None, pat.value
        else:
            continue
        place = _position(form, param)
        if place is not None:
            needs.append(_Need(place[0], place[1], keys, literal, nested))
    return tuple(needs)


def _same_needs(form: Any, alt: PAlt, order: tuple) -> tuple:
    """``mul(x, x)``: a variable written twice among the root's own arguments needs
    the same operand at both places. Only for forms that bind through their plain
    plan (the bound operand is the node's argument at its position)."""
    if not isinstance(form, (Fn, Method)) or binding_plan(form, alt.opdef) is None:
        return ()
    places: dict = {}
    for param, pat in order:
        if isinstance(pat, PVar):
            place = _position(form, param)
            if place is not None:
                places.setdefault(pat.name, []).append(place)
    return tuple(_Need(first[0], first[1], None, _SAME, None, other)
                 for spots in places.values() if len(spots) > 1 for first, other in zip(spots, spots[1:]))


def _position(form: Any, param: str) -> tuple | None:
    """(index in node.args, keyword name) of canonical ``param`` in ``form``'s
    target signature; None when the node spells it in a way only binding knows.
    A module call's only known position is its forward input (what the module's
    own extractor reads as ``input``: ``nn.ReLU()(x)``)."""
    if isinstance(form, ModuleForm):
        return (0, "input") if param == "input" and reads_forward_input(form.extract) else None
    if param in form.fixed:
        return None
    names = [t for t in form.signature if form.rename.get(t, t) == param
             and t not in form.guards and t not in form.ignore]
    if len(names) != 1:
        return None
    index = form.signature.index(names[0])
    varargs = getattr(form, "varargs", None)
    if varargs is not None and index >= form.signature.index(varargs):
        return None
    return index, names[0]


def _keys_of(pat: PCall) -> frozenset:
    keys: set = set()
    for alt in pat.alts:
        keys.update(form.key for form in alt.opdef.forms)
    return frozenset(keys)


def _producer_keys(keys: frozenset) -> tuple:
    """``(function targets by id, other node keys)`` of ``keys``. Function targets
    are compared by identity (what an OpOverload's equality is; hashing one runs
    Python code), other keys through the matcher's node key."""
    functions = frozenset(id(t) for op, t in keys if op == "call_function")
    others = frozenset(k for k in keys if k[0] != "call_function")
    return functions, others


def _checker(options: tuple) -> Prefilter:
    # per option: (index, keyword, producer keys or None, literal) per need, and
    # the where-needs; the producer test is inlined (a call per need was a tenth
    # of the visit loop on a 10k-node graph)
    compiled = tuple((tuple((need.index, need.kwarg, None if need.keys is None else _producer_keys(need.keys),
                             need.literal, need.nested or need.other) for need in needs), clauses)
                     for needs, clauses in options)

    def check(matcher: Any, node: fx.Node) -> bool:
        args = node.args
        n = len(args)
        try:
            for needs, clauses in compiled:
                for index, kwarg, producer, literal, more in needs:  # more: nested filter or other place
                    value = args[index] if index < n else node.kwargs.get(kwarg, _ABSENT)
                    if producer is not None:  # a node one of the nested call's keys
                        if not isinstance(value, _NODE):
                            break
                        if value.op == "call_function":
                            if id(value.target) not in producer[0]:
                                break
                        elif not producer[1] or matcher.key(value) not in producer[1]:
                            break
                        if more is not None and not more(matcher, value):
                            break
                    elif literal is _SAME:
                        other = args[more[0]] if more[0] < n else node.kwargs.get(more[1], _ABSENT)
                        if value is other or value is _ABSENT or other is _ABSENT:
                            continue
                        nodes = (value.__class__ is _NODE) + (other.__class__ is _NODE)
                        if nodes == 1 or (nodes == 2 and value.op != "get_attr" and other.op != "get_attr"):
                            break  # a node and a literal, or two computed values (constants compare by name)
                    elif value is not _ABSENT and (value.__class__ is _NODE or not same_arg(literal, value)):
                        break  # a literal is never a node
                else:
                    if not clauses or node.kwargs or _clauses_hold(clauses, matcher, node, args, n):
                        return True
        except TypeError:  # an unhashable target: let the matcher decide
            return True
        return False

    return check


def _clauses_hold(clauses: tuple, matcher: Any, node: fx.Node, args: tuple, n: int) -> bool:
    """Every root conjunct is True on the node's own arguments; a conjunct that
    reads an argument the node omits (a default), or raises, does not decide."""
    for fn, places in clauses:
        env = {}
        for name, index in places:
            if index == _ROOT:
                env[name] = node
            elif index < n:
                env[name] = args[index]
            else:
                break
        else:
            try:
                if matcher.facts.shape_env is not None:
                    with deciding(matcher.facts.shape_env):
                        holds = fn(env, matcher.facts)
                else:
                    holds = fn(env, matcher.facts)
                if holds is not True:
                    return False
            except Exception:  # noqa: BLE001 - the matcher evaluates it again and reports it (SymbolicUnknown too)
                return True
    return True
