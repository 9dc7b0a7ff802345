"""Match compiled patterns against fx nodes.

Matching is pattern-directed and backtracking: ``_match`` yields every environment
(variable -> operand) under which a pattern fits an operand, so alternatives,
commutative swaps and repeated variables compose without special cases. The first
environment that also satisfies the ``where`` clause and the interior-use check wins.

Operands are what ``rewrite.ops`` binds: ``fx.Node`` graph values, ``ConstRef``s to
module tensors (symbolic_trace's ``call_module``), and literals.
"""

from __future__ import annotations

import itertools
import operator
import os
from typing import Any, Iterator

import torch.fx as fx

from rewrite.engine.compile import CompiledRule, PCall, PDefault, PLit, PResults, PSeq, PVar, PWild, RResults
from rewrite.engine.facts import GraphFacts, is_metadata_check
from rewrite.engine.outputs import getitem_users, result_count
from rewrite.engine.symbolic import SymbolicUnknown, deciding
from rewrite.engine.where import UNKNOWN, PredicateError, where_function
from rewrite.language import ast
from rewrite.engine.aliasing import alias_class, caller_owned, storage_base
from rewrite.ops import bind_node, forms_for_key, forms_for_node, node_key
from rewrite.ops.effects import written_nodes
from rewrite.ops.forms import same_arg
from rewrite.ops.base import ConstRef

__all__ = ["Match", "Matcher", "Refusal", "match_bindings", "match_nodes", "COMPILED", "UNKNOWN"]

#: Use the straight-line matching path; ``REWRITE_INTERPRET=1`` turns it off so
#: every pattern element goes through the reference interpreter.
COMPILED = os.environ.get("REWRITE_INTERPRET", "") in ("", "0")

_NODES = "\0nodes"  # environment key holding the call nodes a match covers, root first


class Match:
    """A successful match: the rule, the root node, bindings, and covered nodes."""

    __slots__ = ("rule", "root", "env", "nodes")

    def __init__(self, rule: CompiledRule, root: fx.Node, env: dict) -> None:
        self.rule = rule
        self.root = root
        self.nodes: tuple = env.pop(_NODES, ())
        self.env = env

    def __repr__(self) -> str:
        return f"Match({self.rule.name} at {self.root.name})"


def match_nodes(env: dict) -> tuple:
    """The call nodes a (partial) match environment covers, root first."""
    return env.get(_NODES, ())


def match_bindings(env: dict) -> dict:
    """A match environment's variables (pattern name -> operand)."""
    return {k: v for k, v in env.items() if k != _NODES}


class Refusal:
    """Why a structural match was not taken: ``kind`` is ``"where"`` (``detail``:
    the first conjunct that does not hold) or ``"interior"`` (``detail``: the
    ``(interior node, outside user)`` pair)."""

    __slots__ = ("kind", "detail")

    def __init__(self, kind: str, detail: Any) -> None:
        self.kind, self.detail = kind, detail


def _same_operand(a: Any, b: Any) -> bool:
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        if a is b:
            return True
        qa = a.target if isinstance(a, fx.Node) and a.op == "get_attr" else getattr(a, "qualname", None)
        qb = b.target if isinstance(b, fx.Node) and b.op == "get_attr" else getattr(b, "qualname", None)
        return qa is not None and qa == qb
    if isinstance(a, ConstRef) or isinstance(b, ConstRef):
        return a == b
    return same_arg(a, b)


def _fits_straight(alt: Any, args: dict, env: dict) -> bool:
    """An alternative's literal checks and plain variables against bound ``args``:
    the variables are bound into ``env`` (a variable bound before must be the same
    operand). False when one does not fit (``env`` is then partly written)."""
    for name, value, expand in alt.literals:
        if not same_arg(value, args[name], expand):
            return False
    for name, var in alt.variables:
        operand = args[name]
        if var in env:
            if not _same_operand(env[var], operand):
                return False
        else:
            env[var] = operand
    return True


_RECENT = 32  # bindings kept: more than any pattern binds at one root


#: Calls a match may try to bind at one root before it gives up there (the rule does
#: not fire at that node; the driver reports it): a pattern of nested commutative
#: ops with a repeated variable can have exponentially many ways to bind.
MATCH_BUDGET = 100_000


class _OverBudget(Exception):
    """A match tried more than ``MATCH_BUDGET`` bindings."""


class Matcher:
    """Matches rules at nodes of one GraphModule. The bindings of the last few
    nodes bound are kept until the graph changes (the rules rooted at one op try
    it in turn, a nested commutative pattern binds its operands once per order); a
    cache of every node's was hit for under 2% of look-ups on 10k-node graphs and
    held a binding per visited node (a fifth of the rewrite's memory on a GPT-2
    graph)."""

    def __init__(self, gm: fx.GraphModule, facts: GraphFacts, compiled: bool | None = None,
                 on_failure: Any = None) -> None:
        """``on_failure(pattern, operand, env)``, when given, is called for every
        pattern element that matched nothing (``rewrite.trust.explain`` records the
        deepest); it runs every element through the interpreter. Without it the
        matching loop has no reporting cost."""
        self.gm = gm
        self.compiled = (COMPILED if compiled is None else compiled) and on_failure is None
        self.facts = facts
        self._recent: dict = {}  # node -> its bindings, _RECENT at most, emptied when the graph changes
        self.where_error: str | None = None  # the first PredicateError since the driver last looked
        self._steps = 0  # calls bound at the match being tried (MATCH_BUDGET)
        self.over_budget: str | None = None  # the first match given up since the driver last looked
        self._inplace_ok: dict = {}
        self._module_keys: dict = {}
        self._names_by_key: dict = {}
        self._names_by_function: dict = {}
        if on_failure is not None:
            self._on_failure = on_failure
            self._match = self._match_reporting  # recursion goes through it too

    # -- per-node facts

    def bindings(self, node: fx.Node) -> tuple:
        b = self._recent.get(node)
        if b is None:
            b = bind_node(node, self.gm) if node.op in ("call_function", "call_method", "call_module") else ()
            if len(self._recent) >= _RECENT:
                self._recent.clear()
            self._recent[node] = b
        return b

    def forget(self, node: fx.Node) -> None:
        """Drop what is known of a node whose arguments changed (and every kept
        binding: a rewrite changed the graph)."""
        self._recent.clear()
        self._inplace_ok.pop(node, None)

    def rewritable(self, node: fx.Node) -> bool:
        """An in-place op binds like its functional twin, but may only be rewritten
        when nothing else reads the tensor it writes into."""
        ok = self._inplace_ok.get(node)
        if ok is None:
            ok = all(self._privately_written(node, written) for written in written_nodes(node, self.gm))
            self._inplace_ok[node] = ok
        return ok

    def _privately_written(self, node: fx.Node, written: fx.Node) -> bool:
        """The tensor ``node`` writes (``written``) is the graph's own (not an input,
        a constant or a view of anything), and nothing else reads it: replacing the
        write by a functional op then changes nothing anyone can observe."""
        base = storage_base(written, self.gm)
        if caller_owned(base):
            return False
        after = alias_class(node, self.gm)  # the written value's readers from here on
        before = alias_class(base, self.gm, exclude=frozenset(after))
        return all(user in before or user is node for n in before for user in n.users)

    def _op_names(self, node: fx.Node) -> frozenset:
        """Names of the ops some form of the node's target may bind as."""
        if node.op == "call_function":  # by the target's identity (an OpOverload hashes in Python)
            hit = self._names_by_function.get(id(node.target))
            if hit is None or hit[0] is not node.target:
                names = frozenset(opdef.name for opdef, _ in forms_for_node(node, self.gm))
                hit = self._names_by_function[id(node.target)] = (node.target, names)
            return hit[1]
        key = self.key(node)
        try:
            names = self._names_by_key.get(key)
        except TypeError:  # an unhashable target binds to nothing
            return frozenset()
        if names is None:
            names = self._names_by_key[key] = frozenset(opdef.name for opdef, _ in forms_for_key(key))
        return names

    def key(self, node: fx.Node) -> Any:
        if node.op == "call_module":
            key = self._module_keys.get(node.target)
            if key is None:
                key = self._module_keys[node.target] = node_key(node, self.gm)
            return key
        return (node.op, node.target)

    # -- matching

    def match(self, rule: CompiledRule, node: fx.Node) -> Match | None:
        if self.compiled and rule.flat:
            return self._match_flat(rule, node)
        self._steps = 0
        try:
            for env in self._match_root(rule, node):
                if rule.where_fn is not None and not self._holds(rule.where_fn, env):
                    continue
                if not rule.shared and self.interior_escape(rule, env) is not None:
                    continue
                return Match(rule, node, env)
        except _OverBudget:
            if self.over_budget is None:
                self.over_budget = (f"matching at node {node.name!r} tried over {MATCH_BUDGET} ways to bind the "
                                    "pattern (nested commutative ops, repeated variables): not matched there")
        return None

    def _match_flat(self, rule: CompiledRule, node: fx.Node) -> Match | None:
        """``match`` for a flat rule (``CompiledRule.flat``): what ``_match_call``
        and ``_match_straight`` do for it, as one loop (most of the rules that
        meet every view or permute of a transformer are flat)."""
        if node.op not in ("call_function", "call_method", "call_module"):
            return None
        p = rule.pattern
        where_fn = rule.where_fn
        for alt in p.alts:
            for bound in self._alt_bindings(alt, node):
                orders = (alt,) if alt.flipped is None or not same_arg(bound.args.get("alpha", 1), 1) \
                    else (alt, alt.flipped)  # x + 2*y does not commute
                for order in orders:
                    env = {_NODES: (node,) + bound.interior}
                    if p.name is not None:
                        env[p.name] = node
                    if not _fits_straight(order, bound.args, env):
                        continue
                    if not self.rewritable(node):
                        return None
                    if where_fn is not None and not self._holds(where_fn, env):
                        continue
                    if not rule.shared and bound.interior and self.interior_escape(rule, env) is not None:
                        continue
                    return Match(rule, node, env)
        return None

    def attempts(self, rule: CompiledRule, node: fx.Node) -> Iterator[tuple]:
        """``(env, refusal)`` for each structural match of ``rule`` at ``node`` in the
        order ``match`` tries them, up to the one it takes (refusal None): what
        ``match`` decides, with the reason for each refusal (a ``Refusal``)."""
        self._steps = 0
        try:
            yield from self._attempts(rule, node)
        except _OverBudget:
            return

    def _attempts(self, rule: CompiledRule, node: fx.Node) -> Iterator[tuple]:
        for env in self._match_root(rule, node):
            if rule.where_fn is not None and not self._holds(rule.where_fn, env):
                yield env, Refusal("where", self.failed_conjunct(rule.where, env, rule.expansions))
                continue
            escape = None if rule.shared else self.interior_escape(rule, env)
            if escape is not None:
                yield env, Refusal("interior", escape)
                continue
            yield env, None
            return

    def _match_root(self, rule: CompiledRule, node: fx.Node) -> Iterator[dict]:
        p = rule.pattern
        for env in self._match(p, node, {_NODES: ()}):
            if p.results is not None:
                env = self._root_results(rule, node, env)
                if env is None:
                    return  # the results are the node's, whatever the arguments bound
            yield env

    def _root_results(self, rule: CompiledRule, node: fx.Node, env: dict) -> dict | None:
        """A multi-output root ``op(...) as (a, b)``: the node has as many results
        (when known; else no getitem reads one beyond them), every result the
        replacement does not provide is unused, and the value is read whole only
        when the replacement is one multi-output call (then its count must be
        known). The names bind the getitem nodes."""
        return self._bound_results(rule, node, env)[0]

    def root_results_problem(self, rule: CompiledRule, node: fx.Node) -> str | None:
        """Why the results of a multi-output root that matched its structure cannot
        be taken as the rule names them (``rewrite.trust.explain``), or None."""
        if rule.pattern.results is None:
            return None
        problem = None
        for env in self._match(rule.pattern, node, {_NODES: ()}):
            env, problem = self._bound_results(rule, node, env)
            if env is not None:
                return None
        return problem

    def _bound_results(self, rule: CompiledRule, node: fx.Node, env: dict) -> tuple:
        """(``_root_results``'s env or None, why not)."""
        names = rule.pattern.results
        n = len(names)
        count = result_count(node, self.facts)
        if count is not None and count != n:
            return None, f"{node.name} has {count} results, the pattern names {n}"
        users = getitem_users(node)
        if users is None:  # returned or passed on whole
            if isinstance(rule.replacement, RResults) or count != n:
                return None, f"{node.name}'s results are read whole (returned or passed on), not one by one"
            users = {}
            for user in node.users:
                if user.target is operator.getitem and len(user.args) == 2 and isinstance(user.args[1], int):
                    users.setdefault(user.args[1], []).append(user)
        beyond = next((i for i in users if i >= n), None)
        if beyond is not None:
            return None, f"result {beyond} of {node.name} is read, beyond the {n} the pattern names"
        if isinstance(rule.replacement, RResults):
            for i, getitems in users.items():
                if rule.replacement.items[i] is None and any(g.users for g in getitems):
                    return None, (f"result {i} of {node.name} is read ({getitems[0].name}), and the replacement "
                                  "does not provide it (_)")
        env = dict(env)
        for i, name in enumerate(names):
            if name != "_" and i in users:
                if name in env and env[name] is not users[i][0]:
                    return None, f"{name} is bound to another value than result {i} of {node.name}"
                env[name] = users[i][0]
        return env, None

    def _match_reporting(self, p: Any, operand: Any, env: dict) -> Iterator[dict]:
        produced = False
        for result in Matcher._match(self, p, operand, env):
            produced = True
            yield result
        if not produced:
            self._on_failure(p, operand, env)

    def _match(self, p: Any, operand: Any, env: dict) -> Iterator[dict]:
        if isinstance(p, PCall):
            yield from self._match_call(p, operand, env)
        elif isinstance(p, PVar):
            if p.name in env:
                if _same_operand(env[p.name], operand):
                    yield env
            else:
                env = dict(env)
                env[p.name] = operand
                yield env
        elif isinstance(p, PWild):
            yield env
        elif isinstance(p, (PLit, PDefault)):
            if same_arg(p.value, operand, p.expand):
                yield env
        elif isinstance(p, PSeq):
            if p.strict and isinstance(operand, list) != (p.written == "list"):
                return  # a getitem index: x[(i, j)] is not x[[i, j]]
            if isinstance(operand, (list, tuple)) and len(operand) == len(p.items):
                yield from self._match_args(tuple(zip(p.items, operand)), env)
        elif isinstance(p, PResults):
            yield from self._match_results(p, operand, env)
        else:  # pragma: no cover - compile produces only the kinds above
            raise TypeError(f"unknown pattern {p!r}")

    def _match_call(self, p: PCall, node: Any, env: dict) -> Iterator[dict]:
        if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method", "call_module"):
            return
        if node in env[_NODES]:
            return
        self._steps += 1
        if self._steps > MATCH_BUDGET:
            raise _OverBudget
        for alt in p.alts:
            for bound in self._alt_bindings(alt, node):
                nodes = env[_NODES] + (node,) + bound.interior
                env2 = dict(env)
                env2[_NODES] = nodes
                if p.name is not None:
                    if p.name in env2 and env2[p.name] is not node:
                        continue
                    env2[p.name] = node
                if self.compiled:
                    matches = self._match_straight(alt, bound.args, env2)
                    if alt.flipped is not None and same_arg(bound.args.get("alpha", 1), 1):
                        # the other order gets its own env: the first one writes env2
                        matches = itertools.chain(matches, self._match_straight(alt.flipped, bound.args, dict(env2)))
                else:
                    matches = (env3 for order in self._arg_orders(alt, bound)
                               for env3 in self._match_args(tuple((pat, bound.args[name]) for name, pat in order), env2))
                for env3 in matches:
                    # asked only once the structure fits: the alias analysis behind
                    # it costs more than most failed matches
                    if not self.rewritable(node):
                        return
                    yield env3

    def _match_results(self, p: PResults, operand: Any, env: dict) -> Iterator[dict]:
        """``op(...) as (a, b)`` as an argument: ``operand`` is the list
        ``[getitem(n, 0), getitem(n, 1)]`` of all the results of one node ``n``
        (its result count known and equal), and ``n`` matches the call."""
        names = p.call.results
        if not isinstance(operand, (list, tuple)) or len(operand) != len(names):
            return
        producer = None
        for i, item in enumerate(operand):
            if not (isinstance(item, fx.Node) and item.op == "call_function" and item.target is operator.getitem
                    and len(item.args) == 2 and not item.kwargs and type(item.args[1]) is int
                    and item.args[1] == i and (producer is None or item.args[0] is producer)):
                return
            producer = item.args[0]
        if not isinstance(producer, fx.Node) or result_count(producer, self.facts) != len(names):
            return
        if any(item in env[_NODES] for item in operand):
            return
        env = dict(env)
        env[_NODES] = env[_NODES] + tuple(operand)
        for name, item in zip(names, operand):
            if name == "_":
                continue
            if name in env:
                if not _same_operand(env[name], item):
                    return
            else:
                env[name] = item
        yield from self._match(p.call, producer, env)  # explain hears of a call that does not match

    def _match_straight(self, alt: Any, args: dict, env: dict) -> Iterator[dict]:
        """The compiled path: literal checks and variable bindings in a plain loop,
        recursion only for nested calls and sequences. Same results as the
        interpreter (``compiled=False``), which tests compare."""
        if not _fits_straight(alt, args, env):
            return
        if alt.nested:
            yield from self._match_args(tuple((pat, args[name]) for name, pat in alt.nested), env)
        else:
            yield env

    def _alt_bindings(self, alt: Any, node: fx.Node) -> Iterator:
        if alt.canonical:
            if alt.opdef.name not in self._op_names(node):
                return  # no form of the node's target binds as this op: skip binding it
            for bound in self.bindings(node):
                if bound.op == alt.opdef.name:
                    yield bound
            return
        key = self.key(node)
        for form in alt.opdef.forms:
            if form.key == key:
                bound = form.bind(node, self.gm, alt.opdef)
                if bound is not None:
                    yield bound

    @staticmethod
    def _arg_orders(alt: Any, bound: Any) -> Iterator[tuple]:
        yield alt.args
        swapped = alt.swapped
        if swapped is not None and same_arg(bound.args.get("alpha", 1), 1):  # x + 2*y does not commute
            yield swapped

    def _match_args(self, pairs: tuple, env: dict) -> Iterator[dict]:
        if not pairs:
            yield env
            return
        pat, operand = pairs[0]
        rest = pairs[1:]
        for env2 in self._match(pat, operand, env):
            yield from self._match_args(rest, env2)

    # -- checks after the structure fits

    def interior_escape(self, rule: CompiledRule, env: dict) -> tuple | None:
        """Interior nodes the rewrite will delete must have no users outside the
        match (nodes the replacement keeps are exempt): the first
        ``(interior node, outside user)``, or None when there is none."""
        nodes = env[_NODES]
        covered = set(nodes)
        kept = {env[v] for v in rule.replacement_vars if isinstance(env.get(v), fx.Node)}
        for n in nodes[1:]:
            if n in kept:
                continue
            for user in n.users:
                if user in covered:
                    continue
                if user.target is operator.getitem and not user.users:
                    continue  # an unused output of a multi-output op
                if is_metadata_check(user):
                    continue  # goes with the node (export's check after a .to())
                return n, user
        return None

    def failed_conjunct(self, where: Any, env: dict, expansions: dict | None = None) -> Any:
        """The first conjunct of ``where`` that does not hold (``where`` itself when
        it is not a conjunction); ``expansions``: the rule's (``CompiledRule.expansions``)."""
        items = where.items if isinstance(where, ast.BoolOp) and where.op == "and" else (where,)
        for item in items:
            if not self.where_holds(item, env, expansions):
                return item
        return where

    def where_holds(self, expr: Any, env: dict, expansions: dict | None = None) -> bool:
        """The where clause (or a part of it) holds: True, not False and not unknown.
        ``expr`` runs as the closure it compiles to (``rewrite.engine.where``)."""
        return self._holds(where_function(expr, expansions), env)

    def where_value(self, expr: Any, env: dict, expansions: dict | None = None) -> Any:
        """What a where clause (or a part of it) answers: True, False, or None when
        it is unknown (a fact the graph does not record, a size that decides it
        for some sizes only); a failing user function raises ``PredicateError``."""
        shape_env = self.facts.shape_env
        function = where_function(expr, expansions)
        try:
            if shape_env is None:
                value = function(env, self.facts)
            else:
                with deciding(shape_env):
                    value = function(env, self.facts)
        except SymbolicUnknown:
            return None
        return None if value is UNKNOWN or value is None else value

    def _holds(self, where_fn: Any, env: dict) -> bool:
        shape_env = self.facts.shape_env
        try:
            if shape_env is None:
                return where_fn(env, self.facts) is True
            with deciding(shape_env):  # symbolic sizes: only what holds for every size
                return where_fn(env, self.facts) is True
        except SymbolicUnknown:
            return False
        except PredicateError as err:  # a user's function failed: kept for the rule's stats
            if self.where_error is None:
                self.where_error = str(err)
            return False
        except Exception:  # noqa: BLE001 - an undecidable constraint does not hold
            return False
