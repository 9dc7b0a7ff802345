"""Apply compiled rules to a graph: schedules, a worklist fixpoint, termination.

``fixpoint`` runs a worklist seeded with every call node in graph order. A rewrite
pushes only what it touched: the nodes it created, the users of the new value, and
the producers of the nodes it erased (their use counts changed, so a ``single_use``
constraint may now hold). A node meets only the rules indexed under its canonical ops
or its node key, highest priority first, then file order, so the result is
deterministic.

Termination: the number of rewrites is bounded (by default 20 per node plus 1000);
when the bound is hit, the rules that kept firing in the last stretch are named, with
the node where they did, instead of a bare iteration limit.
"""

from __future__ import annotations

import collections
import functools
import itertools
import operator
import random
import time
from typing import Any, Iterable

import attrs
import torch.fx as fx
from torch._ops import OpOverload

from rewrite.engine.compile import CompiledRule, PCall, PResults, PSeq
from rewrite.engine.facts import GraphFacts, is_metadata_check
from rewrite.engine.match import Matcher
from rewrite.ops import lookup_op
from rewrite.ops.vocabulary import CALL_OPS, nodes_by_target
from rewrite.engine.prefilter import build_prefilter
from rewrite.functions.registry import lookup_function
from rewrite.language import ast
from rewrite.engine.replace import Replacer, ReplacementError, Unchanged, uses_root

__all__ = ["Driver", "NonTerminationError", "RuleIndex", "RuleStats", "Schedule"]


@attrs.frozen
class Schedule:
    """How a rule set runs: ``kind`` is ``"fixpoint"`` (repeat until nothing
    applies), ``"once"`` (one sweep) or ``"seq"`` (each item in turn); ``items`` are
    rule names, rule-set names or nested ``Schedule``s."""

    kind: str = attrs.field(validator=attrs.validators.in_(("fixpoint", "once", "seq")))
    items: tuple = attrs.field(converter=tuple)

    def __repr__(self) -> str:
        return f"{self.kind}({', '.join(i if isinstance(i, str) else repr(i) for i in self.items)})"


class NonTerminationError(RuntimeError):
    """A rule set kept rewriting past its bound: rules that undo each other, or a
    rule that grows the graph without end."""

    def __init__(self, message: str, rules: tuple, node: str) -> None:
        super().__init__(message)
        self.rules = rules
        self.node = node


@attrs.define
class RuleStats:
    """Per-rule counters: tries (nodes whose op the rule's root has), of which
    ``prefiltered`` its prefilter turned away before matching, matches applied,
    failures while building a replacement (and the first one's reason), and seconds
    spent matching."""

    tries: int = 0
    applied: int = 0
    failed: int = 0
    seconds: float = 0.0
    prefiltered: int = 0
    first_error: str = ""  # why the first failed replacement failed, or a user's predicate raised
    unchanged: int = 0  # matches whose replacement is the call they matched (``Unchanged``)


def _depth(p: Any) -> int:
    """Call depth of a pattern (relu(neg(x)) -> 2)."""
    if isinstance(p, PCall):
        return 1 + max((_depth(a) for alt in p.alts for _, a in alt.args), default=0)
    if isinstance(p, PSeq):
        return max((_depth(i) for i in p.items), default=0)
    if isinstance(p, PResults):  # the list, its getitems, the op
        return 1 + _depth(p.call)
    return 0


def _cover(p: Any) -> int:
    """At least the number of nodes a match of pattern ``p`` covers: each call and
    the getitem a multi-output form reads it through, and the results it names."""
    if isinstance(p, PCall):
        args = max((sum(_cover(a) for _, a in alt.args) for alt in p.alts), default=0)
        return 2 + args + len(getattr(p, "results", None) or ())
    if isinstance(p, PSeq):
        return sum(_cover(i) for i in p.items)
    if isinstance(p, PResults):
        return 1 + _cover(p.call)
    return 0


def _reads_users(rule: CompiledRule) -> bool:
    """Whether the rule's where clause may depend on how many nodes read a value
    (``single_use``, ``users``, a function not registered ``local=True``)."""
    found = [name for e in ast.walk(rule.where) if isinstance(e, ast.Call) for name in e.op.names]
    specs = (lookup_function(name) for name in found)
    return any(spec is None or not spec.local for spec in specs)


def _may_be_interior(node: fx.Node, most: int) -> bool:
    """Whether ``node`` can be an interior node of a match covering at most ``most``
    nodes: every user that would keep it alive (not an unused getitem, not a
    metadata check) must be in the match. Stops counting past ``most``, so a value
    read by thousands of nodes costs ``most`` steps, not thousands."""
    if len(node.users) <= most:
        return True
    count = 0
    for user in node.users:
        if user.target is operator.getitem and not user.users:
            continue
        if is_metadata_check(user):
            continue
        count += 1
        if count > most:
            return False
    return True


def _signature(node: fx.Node) -> tuple:
    """What a node computes, locally: its op, target and inputs (by name)."""
    target = getattr(node.target, "__name__", None) or str(node.target)
    kwargs = node.kwargs
    return (node.op, target, _arg_signature(node.args),
            tuple(sorted((k, _arg_signature(v)) for k, v in kwargs.items())) if kwargs else ())


#: how many levels of rule-made inputs ``Driver._computes`` spells out
_STRUCTURE_DEPTH = 3


def _readers(node: fx.Node) -> dict:
    """Where ``node`` is read: each reader with the positions of ``node`` among its
    inputs (the graph's output reads many values, each at its own place)."""
    found = {}
    for user in node.users:
        args = user.args
        if not user.kwargs and not any(a.__class__ in (list, tuple, dict) for a in args):
            places = tuple(i for i, a in enumerate(args) if a is node)  # the usual flat call
        else:
            seen: list = []
            count = itertools.count()
            fx.node.map_arg((args, user.kwargs), lambda n, seen=seen, count=count:
                            seen.append(next(count)) if n is node else next(count))
            places = tuple(seen)
        found[user] = places
    return found


def _has_twin(node: fx.Node, signature: tuple) -> bool:
    """Whether another node computes what ``node`` does (same op and inputs: a conv
    applied twice to one input). Rewriting twins recreates the signature of the
    first one replaced without any rule undoing another."""
    inputs = node.all_input_nodes
    if not inputs:
        return False
    return any(u is not node and u.target == node.target and u.op == node.op and not u._erased
               and _signature(u) == signature for u in inputs[0].users)


def _arg_signature(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        return tuple(_arg_signature(x) for x in a)
    return repr(a)


def _users_within(nodes: tuple, depth: int) -> tuple:
    """Users of ``nodes``, their users, ... ``depth - 1`` levels down."""
    out: list = []
    frontier = list(nodes)
    for _ in range(depth - 1):
        frontier = [u for n in frontier for u in n.users]
        out.extend(frontier)
    return tuple(out)


class RuleIndex:
    """Rules by the node keys their root can bind: ``("call_function", torch.relu)``,
    ``("call_method", "relu")``, ``("call_module", nn.ReLU)``... A node whose key
    no rule's root can have costs one dictionary look-up. Each (rule, key) carries
    its operand prefilter (``rewrite.engine.prefilter``; None in interpreter mode)."""

    def __init__(self, rules: Iterable[CompiledRule], prefilters: bool = True) -> None:
        by_key: dict = collections.defaultdict(list)
        for rule in rules:
            keys = set(rule.root_keys)
            for op in rule.root_ops:
                keys.update(form.key for form in lookup_op(op).forms)
            for key in keys:
                by_key[key].append(rule)
        self.by_key = {
            k: tuple((r, build_prefilter(r, k) if prefilters else None)
                     for r in sorted(v, key=lambda r: (-r.priority, r.order)))
            for k, v in by_key.items()
        }
        self.depth = max((_depth(r.pattern) for r in rules), default=1)
        # a producer read by more nodes than any match covers cannot become an
        # interior node when it loses a reader, unless a where clause counts readers
        self.cover = None if any(_reads_users(r) for r in rules) else max(
            (_cover(r.pattern) for r in rules), default=1)
        # call_function targets by identity: an OpOverload hashes in Python (slow),
        # and compares by identity anyway
        self._by_function = {id(target): entry for (op, target), entry in self.by_key.items()
                             if op == "call_function"}

    def candidates(self, matcher: Matcher, node: fx.Node) -> tuple:
        """(rule, prefilter) pairs for ``node``, in priority then file order."""
        if node.op == "call_function":
            found = self._by_function.get(id(node.target))
            if found is not None or isinstance(node.target, OpOverload):
                return found or ()
        try:
            return self.by_key.get(matcher.key(node), ())
        except TypeError:  # an unhashable call target: no rule can name it
            return ()


@functools.lru_cache(maxsize=64)
def _index_of(rules: tuple, prefilters: bool) -> RuleIndex:
    """The index of a rule list, built once per rule set (rules hash by identity)."""
    return RuleIndex(rules, prefilters)


class Driver:
    """Runs rule schedules over one GraphModule (which it mutates: callers pass a copy)."""

    def __init__(
        self,
        gm: fx.GraphModule,
        dialect: str,
        max_rewrites: int | None = None,
        example_inputs: tuple | None = None,
        *,
        limit: int | None = None,
        skip: Iterable = (),
        shuffle: random.Random | None = None,
        on_meta: Any = None,
        training: bool | None = None,
    ) -> None:
        """Args:
            gm: the module to rewrite, in place.
            dialect: how new nodes are spelled (``rewrite.ops.detect_dialect``).
            max_rewrites: bound on rewrites before ``NonTerminationError``.
            example_inputs: for shape facts on graphs that carry none.
            limit: stop after this many rewrites (bisection replays).
            skip: (rule name, root node name) pairs never applied (rolled back);
                (rule name, None): that rule nowhere.
            shuffle: visit the worklist in this random order (confluence tests).
            on_meta: called as ``on_meta(node, key)`` before facts are recorded on
                a node of the input graph (``rewrite.engine.workspace.Journal``).
            training: whether the graph is trained (``GraphFacts.training``).
        """
        self.gm = gm
        self.facts = GraphFacts(gm, example_inputs, on_meta=on_meta, training=training)
        self.matcher = Matcher(gm, self.facts)
        self.replacer = Replacer(gm, self.facts, dialect, self.matcher.bindings)
        self.facts.before_run = self.replacer.flush  # recording facts runs the graph
        self.counts: collections.Counter = collections.Counter()
        self.stats: dict = collections.defaultdict(RuleStats)
        self.history: list = []  # (rule name, root node name) per applied rewrite
        self.created: list = []  # every node a rewrite created (some erased later)
        self._created_at: list = []  # per rewrite in history: where its nodes start in created
        self._made: set = set()  # the same, for membership (``_computes``)
        n = len(gm.graph.nodes)
        self.max_rewrites = max_rewrites if max_rewrites is not None else 20 * n + 1000
        self._bound_given = max_rewrites is not None
        self.max_nodes = 10 * n + 1000  # growth without end stops here
        self.limit = limit
        self.skip = frozenset(skip)
        self.shuffle = shuffle
        # what a replaced node computed (``_computes``) -> [[history index, times recreated, its readers,
        # len(created)], ...]
        self._removed: dict = {}
        self._repeating = 0  # enclosing schedules that repeat (fixpoints): where a cycle can loop
        self._step_start = 0  # rewrites made before the outermost step running now (the default bound's count)
        self._inserted: set = set()  # (rule name, root) of insertions: the root stays, never again

    # -- schedules

    def fixpoint(self, rules: list) -> bool:
        """Rewrite until no rule applies anywhere. Returns whether anything changed."""
        index = _index_of(tuple(rules), self.matcher.compiled)
        matcher = self.matcher
        nodes = self._seeds(index)
        if self.shuffle is not None:
            self.shuffle.shuffle(nodes)
        queue = collections.deque(nodes)
        queued = set(queue)
        changed = False
        self._start_repeating()
        try:
            while queue:
                node = queue.popleft()
                queued.discard(node)
                if node._erased:
                    continue  # erased meanwhile
                result = self._rewrite_at(index, node)
                if result is None:
                    continue
                changed = True
                fresh = [n for n in dict.fromkeys(result) if n not in queued and not n._erased
                         and n.op in CALL_OPS and index.candidates(matcher, n)]
                if self.shuffle is not None:
                    self.shuffle.shuffle(fresh)
                queue.extend(fresh)
                queued.update(fresh)
        finally:
            self._repeating -= 1
            self.replacer.flush()
        return changed

    def _start_repeating(self) -> None:
        """Enter a schedule that repeats until nothing changes, where rules that
        undo each other loop. The outermost one starts its own record of replaced
        nodes: steps run one after the other (``seq``, ``once``) cannot loop, and
        what one of them recreates from an earlier one is no cycle."""
        if not self._repeating:
            self._removed = {}
            self._step_start = len(self.history)
        self._repeating += 1

    def _seeds(self, index: RuleIndex) -> list:
        """The nodes some rule's root can bind, in graph order: a node without
        candidates would cost a visit and decide nothing. Read by target from the
        graph's own index: the candidates of a call_function depend on its target
        only, so a 10k-node graph costs one look-up per distinct target."""
        found: list = []
        for op, _, nodes in nodes_by_target(self.gm.graph):
            if op == "call_function":
                if index.candidates(self.matcher, next(iter(nodes))):
                    found.extend(nodes)
            else:
                found.extend(n for n in nodes if index.candidates(self.matcher, n))
        found.sort()  # graph order: nodes compare by position
        return found

    def once(self, rules: list) -> bool:
        """One sweep in graph order; nodes created by the sweep are not revisited.
        Outside a fixpoint it cannot loop: what it recreates is not a cycle
        (``seq(once(grow), once(grow))`` is two finite sweeps)."""
        index = _index_of(tuple(rules), self.matcher.compiled)
        changed = False
        if not self._repeating:
            self._step_start = len(self.history)
        try:
            for node in list(self.gm.graph.nodes):
                if not node._erased and node.op in CALL_OPS:
                    changed |= self._rewrite_at(index, node) is not None
        finally:
            self.replacer.flush()
        return changed

    # -- one node

    def _rewrite_at(self, index: RuleIndex, node: fx.Node) -> tuple | None:
        if self.limit is not None and len(self.history) >= self.limit:
            return None
        for rule, prefilter in index.candidates(self.matcher, node):
            if self.skip and ((rule.name, node.name) in self.skip or (rule.name, None) in self.skip):
                continue
            if self._inserted and (rule.name, node) in self._inserted:
                continue
            stats = self.stats[rule.name]
            stats.tries += 1
            if prefilter is not None and not prefilter(self.matcher, node):
                stats.prefiltered += 1
                continue
            start = time.perf_counter()
            match = self.matcher.match(rule, node)
            stats.seconds += time.perf_counter() - start
            if match is None:
                if self.matcher.where_error is not None:  # a user's predicate raised
                    if not stats.first_error:
                        stats.first_error = f"where clause: {self.matcher.where_error}"
                    self.matcher.where_error = None
                if self.matcher.over_budget is not None:  # gave up binding the pattern there
                    if not stats.first_error:
                        stats.first_error = self.matcher.over_budget
                    self.matcher.over_budget = None
                continue
            # a multi-output root's results are read through getitems: their
            # readers are the ones that get new inputs
            users_before = list(node.users) + [u for g in node.users if g.target is operator.getitem
                                               for u in g.users]
            signature = _signature(node)
            insertion = uses_root(match)
            twin = not insertion and _has_twin(node, signature)
            removed = (self._computes(node), tuple(_readers(node).items())) \
                if self._repeating and not (insertion or twin) else None
            try:
                created, producers = self.replacer.apply(match)
            except Unchanged:
                stats.unchanged += 1  # the graph already says it so: no rewrite
                continue
            except ReplacementError as err:
                stats.failed += 1
                if not stats.first_error:
                    cause = err.__cause__
                    stats.first_error = str(err) + (f" ({type(cause).__name__})" if cause is not None else "")
                continue
            stats.applied += 1
            if insertion:  # the root stays: never insert at it again
                self._inserted.add((rule.name, node))
            self.counts[rule.name] += 1
            self.history.append((rule.name, node.name))
            self._created_at.append(len(self.created))
            self.created.extend(created)
            self._made.update(created)
            if self._repeating:
                self._check_cycle(removed, created, node.name)
            self._check_bound(node)
            for user in users_before:
                self.matcher.forget(user)
            for p in producers:
                self.matcher.forget(p)
            # Producers lost users, so matches that were blocked by the interior-use
            # check may now hold: revisit their users down to the deepest pattern
            # (those of a producer still read by more nodes than a match covers
            # stay blocked).
            unblocked = _users_within(producers if index.cover is None else tuple(
                p for p in producers if _may_be_interior(p, index.cover)), index.depth)
            # an insertion keeps its root: the other rules get their turn at it
            again = (node,) if insertion else ()
            return tuple(created) + tuple(users_before) + tuple(producers) + unblocked + again
        return None

    def _check_cycle(self, removed: tuple | None, created: tuple, where: str) -> None:
        """Rules that undo each other recreate a node they replaced before, with the
        same op and inputs, read where it was read (``removed``: the replaced node's
        signature and ``_readers``). The second time that happens is a cycle: stop
        and name the rules that fired since the node first went away. Rules that
        each rewrite another place into the same term (``mul(x, 2)`` from ``x * 2``
        and from ``(x + x) * 1``) give it other readers: no cycle. A reader erased
        since (a rule rebuilt it) may be stood in for by a node made since, of its op
        (``exp(mul(x, 2)) => exp(add(x, x))`` with ``add(x, x) => mul(x, 2)`` rebuilds
        the ``exp`` each turn)."""
        if removed is not None:  # an insertion removes nothing; a node with a twin is not unique
            signature, readers = removed
            entries = self._removed.setdefault(signature, [])
            if not any(e[2] == readers for e in entries):
                entries.append([len(self.history) - 1, 0, readers, len(self.created)])
        for node in created:
            entries = self._removed.get(self._computes(node))
            if not entries:
                continue
            sig = _signature(node)
            now = _readers(node)
            for entry in entries:
                if not self._read_as_before(entry, now):
                    continue
                entry[1] += 1
                since, seen = entry[0], entry[1]
                if seen >= 2:
                    rules = self._cycle_rules(since, entry[2])
                    who = f"rule {rules[0]!r} undoes itself" if len(rules) == 1 else \
                        f"rules {', '.join(repr(r) for r in rules)} undo each other"
                    raise NonTerminationError(
                        f"{who}: near node {where!r} "
                        f"{'it keeps' if len(rules) == 1 else 'they keep'} recreating "
                        f"{sig[1]}({', '.join(map(str, sig[2]))}) after replacing it",
                        rules,
                        where,
                    )
                break

    def _cycle_rules(self, since: int, readers: tuple) -> tuple:
        """The rules of a cycle that began at rewrite ``since``: that rewrite, the last
        one, and those between that rewrote a node the cycle made or a reader of the
        replaced node (``readers``), not rules that fired elsewhere meanwhile."""
        involved = {user.name for user, _ in readers}
        rules = set()
        last = len(self.history) - 1
        for i in range(since, last + 1):
            name, root = self.history[i]
            if i in (since, last) or root in involved:
                rules.add(name)
                end = self._created_at[i + 1] if i < last else len(self.created)
                involved.update(n.name for n in self.created[self._created_at[i]:end])
        return tuple(sorted(rules))

    def _computes(self, node: fx.Node, depth: int = _STRUCTURE_DEPTH) -> tuple:
        """``_signature``, with each input a rule made spelled by what it computes
        (a few levels down) rather than by its name: a cycle that rebuilds the
        root's input each turn (``sigmoid(neg(x)) => sigmoid(mul(x, -1))`` and back)
        recreates the same computation under new names."""
        def spelled(a: Any) -> Any:
            if isinstance(a, fx.Node):
                return self._computes(a, depth - 1) if depth > 0 and a in self._made else a.name
            if isinstance(a, (list, tuple)):
                return tuple(spelled(x) for x in a)
            return repr(a)

        target = getattr(node.target, "__name__", None) or str(node.target)
        kwargs = node.kwargs
        return (node.op, target, tuple(spelled(a) for a in node.args),
                tuple(sorted((k, spelled(v)) for k, v in kwargs.items())) if kwargs else ())

    def _read_as_before(self, entry: list, now: dict) -> bool:
        """Whether a recreated node is read as the replaced one was (``entry``): by
        each of its readers still in the graph, at the same places, and otherwise
        only by nodes made since it was replaced that rebuild an erased reader (the
        same op, reading it at the same places)."""
        before, born = entry[2], entry[3]
        alive = {user: places for user, places in before if not user._erased}
        if any(now.get(user) != places for user, places in alive.items()):
            return False
        others = [user for user in now if user not in alive]
        if not others:
            return True
        # a reader rebuilt since: a node made since, of the erased reader's op, reading it there
        rebuilt = {(user.op, user.target, places) for user, places in before if user._erased}
        fresh = set(self.created[born:])
        return all(user in fresh and (user.op, user.target, now[user]) in rebuilt for user in others)

    def _check_bound(self, node: fx.Node) -> None:
        """Stop a run that does not settle: more rewrites than ``max_rewrites`` (the
        default bound counts them per step of a ``seq``, as cycles are: steps run
        one after the other are finite; the caller's counts the whole run), or a
        graph grown ten times over."""
        grown = len(self.gm.graph.nodes) > self.max_nodes
        done = len(self.history) - (0 if self._bound_given else self._step_start)
        if done <= self.max_rewrites and not grown:
            return
        recent = self.history[-200:]
        rules = tuple(sorted({name for name, _ in recent}))
        where = recent[-1][1]
        if self._bound_given and not grown:  # the caller's own bound: no loop to diagnose
            raise NonTerminationError(
                f"stopped at max_rewrites={self.max_rewrites}: rules {', '.join(repr(r) for r in rules)} were "
                f"still firing (last at node {where!r}); nothing was applied. Pass a larger max_rewrites (or "
                "None, the default bound) if the rules settle",
                rules,
                where,
            )
        if grown and not self._repeating:  # one sweep is finite: it grew the graph past the bound
            raise NonTerminationError(
                f"stopped: the graph grew to {len(self.gm.graph.nodes)} nodes, past the bound of "
                f"{self.max_nodes} (ten times the input's and 1000), after {len(self.history)} rewrites; "
                f"rules {', '.join(repr(r) for r in rules)} were growing it (last at node {where!r})",
                rules,
                where,
            )
        raise NonTerminationError(
            f"rewriting did not settle after {len(self.history)} rewrites "
            f"({len(self.gm.graph.nodes)} nodes); "
            f"rules {', '.join(repr(r) for r in rules)} keep firing (last at node {where!r}): "
            "they undo each other or grow the graph without end",
            rules,
            where,
        )

    def run(self, schedule: Schedule, resolve: Any) -> bool:
        """Run a ``Schedule``: its items are rule names, rule-set names or nested
        schedules; ``resolve(name)`` gives a CompiledRule or a nested Schedule."""
        kind, items = schedule.kind, schedule.items
        if kind == "seq":
            changed = False
            for item in items:
                changed |= self.run(self._as_schedule(item, resolve), resolve)
            return changed
        rules, nested = self._split(items, resolve, join=kind == "fixpoint")
        if not nested:
            return self.fixpoint(rules) if kind == "fixpoint" else self.once(rules)
        # Mixed rules and nested schedules: run them in order, repeated for fixpoint.
        steps = ([Schedule("fixpoint" if kind == "fixpoint" else "once", tuple(r.name for r in rules))]
                 if rules else []) + nested
        changed_any = False
        repeats = kind == "fixpoint"
        if repeats:
            self._start_repeating()
        try:
            for _ in range(self.max_rewrites):
                changed = False
                for step in steps:
                    changed |= self.run(step, resolve)
                changed_any |= changed
                if not changed or not repeats:
                    break
        finally:
            self._repeating -= repeats
        return changed_any

    @staticmethod
    def _as_schedule(item: Any, resolve: Any) -> Schedule:
        target = resolve(item) if isinstance(item, str) else item
        if isinstance(target, CompiledRule):
            return Schedule("fixpoint", (item,))
        return target

    @classmethod
    def _split(cls, items: tuple, resolve: Any, join: bool = False, joined: set | None = None) -> tuple:
        """``(rules, nested schedules)`` of ``items``. With ``join`` (a fixpoint), a
        nested fixpoint's items join this one: ``fixpoint(a, s)`` with ``s =
        fixpoint(b, c)`` is one fixpoint over a, b and c, so a rule set can be built
        from shared parts (amp_bf16.rw's policy) and still run as one. A named
        fixpoint joins once (``s1 = fixpoint(s0, s0)``, ``s2 = fixpoint(s1, s1)``...
        would otherwise be split 2^n times)."""
        rules, nested = [], []
        joined = set() if joined is None else joined
        for item in items:
            target = resolve(item) if isinstance(item, str) else item
            if isinstance(target, CompiledRule):
                rules.append(target)
            elif join and target.kind == "fixpoint":
                if isinstance(item, str):
                    if item in joined:
                        continue  # joined already: the same rules and nested schedules
                    joined.add(item)
                inner_rules, inner_nested = cls._split(target.items, resolve, join=True, joined=joined)
                rules += [r for r in inner_rules if r not in rules]
                nested += inner_nested
            else:
                nested.append(target)
        return rules, nested
