"""Why did a rule not fire? The deepest partial match, in the rule file's terms.

``explain`` runs the same matcher as ``apply``, instrumented: every pattern element
that fails to match records what it expected, what the graph had, where the element
was written, and the bindings so far. The failure reached with the most bindings
(the deepest partial match) is the explanation; a rule that matched its structure
but failed its ``where`` clause names the conjunct that was false.

Example::

    for miss in rules.explain(gm, rule="conv_bn"):
        print(miss)
    # rules/fusion.rw:16:5: conv_bn at node 'batch_norm_3': where clause failed:
    #   single_use(c) is false (c = conv2d_3, 2 users) ...
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.fx as fx

from rewrite.engine.compile import CompiledRule, PCall, PDefault, PLit, PResults, PSeq, PVar, pattern_arguments
from rewrite.engine.facts import GraphFacts
from rewrite.language import ast
from rewrite.language.printer import format_expr
from rewrite.engine.match import Matcher, match_bindings, match_nodes
from rewrite.engine.replace import Replacer, ReplacementError
from rewrite.engine.workspace import Journal, own_written_state, shared_copy
from rewrite.ops import detect_dialect
from rewrite.ops import ConstRef
from rewrite.trust.rng import generators_kept, model_generators

__all__ = ["Explanation", "Explanations", "explain"]


@attrs.frozen
class Explanation:
    """The outcome of one rule at one node.

    Attributes:
        rule, node: the rule name and the node (by name) it was tried at.
        matched: True when the rule would fire there.
        depth: how far the match got (bindings + covered nodes); near misses are
            ranked by it.
        location: rule-file position of the element that failed (``file:line:col``).
        element: that element, as written.
        expected, actual: what it wanted, what the graph had.
        bindings: variable -> value, as far as the match got.
    """

    rule: str
    node: str
    matched: bool
    depth: int = 0
    location: str = ""
    element: str = ""
    expected: str = ""
    actual: str = ""
    bindings: dict = attrs.field(factory=dict)
    #: what else to know (a match of a rule the rule set's schedule never runs)
    note: str = ""

    def __str__(self) -> str:
        if self.matched:
            return f"{self.rule} matches at node {self.node!r}" + (f" ({self.note})" if self.note else "")
        lines = [f"{self.location}: {self.rule} at node {self.node!r}: {self.element} failed"]
        lines.append(f"    expected: {self.expected}")
        lines.append(f"    actual:   {self.actual}")
        if self.bindings:
            lines.append("    bindings: " + ", ".join(f"{k} = {v}" for k, v in self.bindings.items()))
        return "\n".join(lines)


def _describe(operand: Any, gm: fx.GraphModule) -> str:
    if isinstance(operand, fx.Node):
        if operand.op == "call_module":
            return f"{operand.name} (call_module {type(gm.get_submodule(operand.target)).__name__})"
        target = getattr(operand.target, "__name__", operand.target)
        return f"{operand.name} ({operand.op} {target})"
    if isinstance(operand, ConstRef):
        return f"constant {operand.qualname}"
    return repr(operand)


def _param_of(pattern: Any, literal: Any) -> str | None:
    """The parameter a pattern's literal is written for (``training`` of
    ``batch_norm(..., training=False)``), or None (an item of a list)."""
    return next((param for _, param, p in pattern_arguments(pattern) if p is literal), None)


def _pattern_text(p: Any) -> str:
    if isinstance(p, PCall):
        names = " | ".join(dict.fromkeys(a.opdef.name for a in p.alts))
        return f"{names}(...)" + (f" as {p.name}" if p.name else "")
    if isinstance(p, PVar):
        return p.name
    if isinstance(p, PLit):
        return repr(p.value)
    if isinstance(p, PDefault):
        return f"omitted argument {p.param!r}"
    if isinstance(p, PSeq):
        return "(" + ", ".join(_pattern_text(i) for i in p.items) + ")"
    if isinstance(p, PResults):
        return f"{_pattern_text(p.call)} as ({', '.join(p.call.results)})"
    return "_"


class _Explainer:
    """Explains one rule at nodes: a ``Matcher`` whose failure hook keeps the
    deepest failure, and ``Matcher.attempts`` for what happens after the pattern
    fits (where clause, interior uses), so both decide exactly as ``apply`` does."""

    def __init__(self, gm: fx.GraphModule, facts: GraphFacts, rule: CompiledRule) -> None:
        self.gm, self.facts, self.rule = gm, facts, rule
        self.matcher = Matcher(gm, facts, on_failure=self._explain_failure)
        self.best: tuple | None = None  # (depth, location, element, expected, actual, env)

    def _note(self, depth: int, span: Any, element: str, expected: str, actual: str, env: dict) -> None:
        if self.best is None or depth > self.best[0]:
            location = str(span) if span is not None else self.rule.location
            self.best = (depth, location, element, expected, actual, env)

    @staticmethod
    def _depth(env: dict) -> int:
        return len(match_bindings(env)) + 1 + len(match_nodes(env))

    def _explain_failure(self, p: Any, operand: Any, env: dict) -> None:
        # past the root (its op matched) even with nothing bound yet: a near miss
        # (``cat(split(...) as (_, _), d)`` at a cat whose list is one node)
        depth, text = self._depth(env) + (p is not self.rule.pattern), _pattern_text(p)
        if isinstance(p, PCall):
            wanted = " | ".join(dict.fromkeys(a.opdef.name for a in p.alts))
            if not isinstance(operand, fx.Node) or not operand.op.startswith("call_"):
                self._note(depth, p.span, text, f"a call of {wanted}", _describe(operand, self.gm), env)
            elif not self.matcher.rewritable(operand):
                self._note(depth, p.span, text, "an op that may be rewritten",
                           f"{_describe(operand, self.gm)} writes in place into a tensor that is read elsewhere, "
                           "an input, a constant or a view", env)
            else:
                ops = sorted({b.op for b in self.matcher.bindings(operand)}) or ["(not in the op vocabulary)"]
                spelled = [form.qualname for a in p.alts if a.opdef.qualified for form in a.opdef.forms
                           if getattr(form, "qualname", None)]
                if spelled and set(ops) <= {a.opdef.name for a in p.alts}:  # the op, in another spelling
                    wanted = f"{' | '.join(spelled)} exactly (a qualified name matches that target only)"
                self._note(depth, p.span, text, wanted, f"{' | '.join(ops)}: {_describe(operand, self.gm)}", env)
        elif isinstance(p, PVar):
            self._note(depth, p.span, text, f"the value bound to {p.name}: {_describe(env.get(p.name), self.gm)}",
                       _describe(operand, self.gm), env)
        elif isinstance(p, PDefault):
            self._note(depth, p.span, text, f"the default {p.value!r}", _describe(operand, self.gm), env)
        elif isinstance(p, PLit):
            param = _param_of(self.rule.pattern, p)
            actual = _describe(operand, self.gm)
            if param == "training" and p.value is False and operand is True:
                actual += " (the op runs in training mode, on its batch's statistics: call model.eval() before " \
                          "capturing)"
            self._note(depth, p.span, f"{param}={text}" if param else text, repr(p.value), actual, env)
        elif isinstance(p, PSeq):
            self._note(depth, p.span, text, f"a sequence of {len(p.items)} items", _describe(operand, self.gm), env)
        elif isinstance(p, PResults):
            wanted = " | ".join(dict.fromkeys(a.opdef.name for a in p.call.alts))
            whole = isinstance(operand, fx.Node) and operand.op.startswith("call_")
            self._note(depth, p.span, f"{wanted}(...) as ({', '.join(p.call.results)})",
                       f"the list of the {len(p.call.results)} results of a call of {wanted}, read one by one "
                       "(getitem nodes)", _describe(operand, self.gm) + (
                           ": its value handed on whole, not read through getitem nodes (as symbolic_trace "
                           "records cat(x.split(...)); torch.export and dynamo unpack it)" if whole else ""), env)

    def explain_at(self, node: fx.Node) -> Explanation:
        rule = self.rule
        self.matcher.where_error = None
        for env, refusal in self.matcher.attempts(rule, node):
            depth = 1000 + self._depth(env)  # past the whole structure
            if refusal is None:
                return Explanation(rule.name, node.name, True, depth, bindings=self._bindings_text(env))
            if refusal.kind == "where":
                failed = refusal.detail
                # a registered function that raised: its error, not "false"
                error, self.matcher.where_error = self.matcher.where_error, None
                verdict = f"an error ({error})" if error else "false"
                if not error and self._asks_training(failed, env):
                    # a parameter of a graph that may train is no constant (apply warns)
                    verdict += (" (the graph may be trained, so its parameters are no constants: pass "
                                "training=False to apply and explain if it is an inference graph)")
                if not error and self._unknown(failed, env):
                    # unknown and false is false: a false conjunct is what example inputs cannot cure
                    false = self._false_conjunct(rule.where, env)
                    if false is not None:
                        failed = false
                    else:
                        verdict = ("unknown (the graph records no such fact: pass example_inputs, or capture "
                                   "with torch.export)")
                self._note(depth, failed.span, "where clause", f"{format_expr(failed)} to hold",
                           f"{verdict}, with " + self._facts_text(failed, env), env)
            else:
                interior, user = refusal.detail
                self._note(depth, rule.pattern.span, "interior-use check",
                           "interior nodes used only inside the match",
                           f"{interior.name} is also used by {user.name}", env)
        if self.best is None:
            problem = self.matcher.root_results_problem(rule, node)
            if problem is not None:
                return Explanation(rule.name, node.name, False, 1000, rule.location, "results",
                                   f"the results as ({', '.join(rule.pattern.results)}) name them", problem)
            return Explanation(rule.name, node.name, False, 0, rule.location, "pattern", "a match", "none")
        depth, location, element, expected, actual, env = self.best
        return Explanation(rule.name, node.name, False, depth, location, element, expected, actual,
                           self._bindings_text(env))

    def _asks_training(self, expr: Any, env: dict) -> bool:
        """Whether ``expr`` read a parameter of a graph that may train (which is
        then no constant): the facts note such parameters as they answer."""
        before = set(self.facts.unknown_training)
        self.facts.unknown_training.clear()
        try:
            self.matcher.where_value(expr, env, self.rule.expansions)
        except Exception:  # noqa: BLE001 - a failing function is reported as such
            pass
        asked = bool(self.facts.unknown_training)
        self.facts.unknown_training |= before
        return asked

    def _false_conjunct(self, where: Any, env: dict) -> Any:
        items = where.items if isinstance(where, ast.BoolOp) and where.op == "and" else (where,)
        for item in items:
            try:
                if self.matcher.where_value(item, env, self.rule.expansions) is False:
                    return item
            except Exception:  # noqa: BLE001 - a failing function is reported as such
                continue
        return None

    def _unknown(self, expr: Any, env: dict) -> bool:
        try:
            return self.matcher.where_value(expr, env, self.rule.expansions) is None
        except Exception:  # noqa: BLE001 - a failing function is reported as such
            return False

    def _facts_text(self, expr: Any, env: dict) -> str:
        """The variables of a failed condition, with what the graph says about them."""
        names: list = []

        def walk(e: Any) -> None:
            if isinstance(e, ast.Var) and e.name not in names:
                names.append(e.name)
            elif attrs.has(type(e)):
                for f in attrs.fields(type(e)):
                    v = getattr(e, f.name)
                    for item in v if isinstance(v, tuple) else (v,):
                        walk(item)

        walk(expr)
        parts = []
        for name in names:
            value = env.get(name)
            text = f"{name} = {_describe(value, self.gm)}"
            if isinstance(value, fx.Node):
                meta = self.facts.meta(value)
                shape = f", shape {tuple(meta.shape)}, {meta.dtype}" if meta is not None else ", shape unknown"
                text += f" ({len(value.users)} user{'s' if len(value.users) != 1 else ''}{shape})"
            parts.append(text)
        return "; ".join(parts) or "no variables"

    def _bindings_text(self, env: dict) -> dict:
        return {k: _describe(v, self.gm) for k, v in match_bindings(env).items()}


class Explanations(list):
    """A list of ``Explanation``s that prints as the text ``rewrite explain`` shows."""

    def __str__(self) -> str:
        return "\n\n".join(str(e) for e in self) if self else "no rule was tried at any node"

    __repr__ = __str__


def explain(ruleset: Any, model: fx.GraphModule, rule: str | None = None, node: str | None = None,
            example_inputs: tuple | None = None, limit: int = 10, training: bool | None = None) -> list:
    """Explain rules at nodes (see ``RuleSet.explain``); works on a copy of ``model``
    that shares its tensors, as ``apply``'s does (running it writes none of the
    caller's), and leaves every random generator as it was.
    Returns ``Explanations``: a list that prints as text."""
    if rule is not None and rule not in ruleset.rules:
        raise KeyError(f"no rule named {rule!r}; have {sorted(ruleset.rules)}")
    with generators_kept(model_generators(model)):
        trials = _Trials(model, example_inputs, training)
        scheduled = ruleset.scheduled_rules()
        gm = trials.gm
        rules = [ruleset.rules[rule]] if rule is not None else list(ruleset.rules.values())
        if node is not None:
            nodes = [n for n in gm.graph.nodes if n.name == node]
            if not nodes:
                raise KeyError(f"no node named {node!r} in the graph")
        else:
            nodes = [n for n in gm.graph.nodes if n.op.startswith("call_")]
        out = []
        for r in rules:
            found = []
            for n in nodes:
                found.append(_Explainer(gm, trials.facts, r).explain_at(n))
            if node is None:  # near misses: the root op matched, the rest did not
                found = [e for e in found if e.matched or e.depth > 1]
                found.sort(key=lambda e: (not e.matched, -e.depth))
                found = found[:limit]
            found = [trials.refused(r, e) if e.matched else e for e in found]
            if r.name not in scheduled:
                found = [attrs.evolve(e, note=f"but this rule set's schedule never runs rule {r.name!r}: apply "
                                            f"does not fire it; rules[{r.name!r}] runs it") if e.matched else e
                         for e in found]
            out.extend(found)
    return Explanations(out)


class _Trials:
    """The working copy explain reads, and the replacements of its matches tried on
    it through the guards ``apply`` runs then (a write between the match's nodes,
    sharing the caller would gain or lose, a result unlike the root's shape, dtype
    or device, a grad-mode or autocast switch). A replacement made is undone by the
    copy's journal, as ``apply`` undoes an in-place rewrite."""

    def __init__(self, model: fx.GraphModule, example_inputs: tuple | None, training: bool | None = None) -> None:
        self.gm = shared_copy(model)
        own_written_state(self.gm)  # recording facts runs the copy
        self.example_inputs, self.training = example_inputs, training
        self.journal = Journal(self.gm).open()
        self.facts = GraphFacts(self.gm, example_inputs, on_meta=self.journal.note_meta, training=training)

    def refused(self, rule: CompiledRule, matched: Explanation) -> Explanation:
        """The match as it was, or why its replacement is refused."""
        matcher = Matcher(self.gm, self.facts)
        root = next(n for n in self.gm.graph.nodes if n.name == matched.node)
        match = matcher.match(rule, root)
        if match is None:
            return matched
        try:
            with torch.no_grad():
                Replacer(self.gm, self.facts, detect_dialect(self.gm), matcher.bindings).apply(match)
        except ReplacementError as err:
            reason = str(err).split(": ", 1)[-1]
            return Explanation(rule.name, matched.node, False, matched.depth + 1, rule.location, "replacement",
                               "a replacement apply may make", reason, matched.bindings)
        # made: back to the graph as it was (facts recorded on it kept), with facts
        # that know nothing of the replacement
        self.journal.undo(keep_meta=True)
        self.facts = GraphFacts(self.gm, self.example_inputs, on_meta=self.journal.note_meta, training=self.training)
        return matched
