"""Rule sets: the public object users load, compose and apply.

Example::

    import rewrite
    rules = rewrite.load("rules/fusion.rw")
    result = rules.apply(graph_module, example_inputs=(x,))
    result.graph_module      # the rewritten torch.fx.GraphModule (a new object)
    result.counts            # {"conv_bn": 53, ...}
    rules.apply(graph_module, example_inputs=(x,), inplace=True)  # rewrites graph_module itself

Rule sets are values: ``rewrite.load("rules/fusion.rw") + rewrite.load("rules/cleanup.rw")``
runs one after the other; ``rules["fusion"]`` selects a ``ruleset`` declared in the file.
"""

from __future__ import annotations

import difflib
import inspect
import math
import os
import random
import time
import warnings
from pathlib import Path
from typing import Any, Iterable

import attrs
import torch
import torch.fx as fx

from rewrite.capture import as_input_tuple, hooked, symbolic_trace
from rewrite.engine.compile import compile_rule
from rewrite.engine.driver import Driver, Schedule
from rewrite.engine.facts import INFERENCE_KEY, TrainingModeWarning, forget_recorded_facts
from rewrite.engine.layout import output_values, restore_output_layouts
from rewrite.engine.workspace import (HOOK_TABLES, Journal, check_touched, gc_paused, own_module_path,
                                       own_state_training_writes, own_written_state, shared_copy)
from rewrite.language import Program, ast, load_program, load_program_text
from rewrite.module_state import AttributeSnapshot
from rewrite.trust.modes import autocast_off, cpu_default_device, fake_mode_off, one_thread_at_a_time
from rewrite.trust.rng import generators_kept, model_generators
from rewrite.trust.sizes import DECLARED_RANGES
from rewrite.ops import detect_dialect

__all__ = ["RuleSet", "RewriteResult", "Rejection", "EquivalenceError", "CaptureError", "load", "parse", "rules_dir"]


class EquivalenceError(AssertionError):
    """The rewritten graph does not compute what the original computes. The
    rewrite is not returned; ``report`` says which output diverged, ``counts``
    which rules fired."""

    def __init__(self, report: Any, counts: dict, culprit: Any = None, tolerance: str = "exact",
                 rolled_back: tuple = ()) -> None:
        fired = ", ".join(f"{name} x{n}" for name, n in sorted(counts.items())) or "none"
        mm = getattr(report, "first_mismatch", None)
        what = "outputs"
        if mm is not None and (mm.path.startswith("gradient") or mm.message.startswith("gradients")):
            what = "gradients"
        message = f"rewrite changed the model's {what}: {report}; rules that fired: {fired}"
        if rolled_back:
            rules = ", ".join(f"{r!r}" for r in dict.fromkeys(r.rule for r in rolled_back))
            message += (f"; on_mismatch=\"skip-rule\" rolled back {len(rolled_back)} applications (rules {rules}), "
                        f"its limit, and the rewrite still differs")
        if culprit is not None:
            message += f"; the first application that {'still ' if rolled_back else ''}broke it: {culprit}"
        if tolerance == "approx" and mm is not None and 0 < mm.max_rel_error < 0.1:
            message += (
                f". Approximate rules fired: the outputs differ by {mm.max_rel_error:.2g} of their scale, "
                "the size of error an approximate rule set (a lower precision, a fold) can accumulate over "
                "a deep model, so no single rule need be wrong. If that is acceptable, pass looser "
                "tolerances (apply(..., rtol=..., atol=...): atol is then absolute); otherwise find the "
                "rule with rules.verify() and on_mismatch=\"skip-rule\"")
        super().__init__(message)
        self.tolerance = tolerance
        self.report = report
        self.counts = counts
        self.culprit = culprit
        self.rolled_back = rolled_back  # skip-rule's rollbacks before it gave up (Rejection records)


class CaptureError(EquivalenceError):
    """``torch.fx.symbolic_trace``'s graph of an ``nn.Module`` given to ``apply``
    does not compute what the module does on the example inputs: fx records one
    path through the forward's Python (``if mask is not None`` on an argument left
    at its default) and drops grad-mode switches, so no rule is to blame."""

    def __init__(self, report: Any) -> None:
        AssertionError.__init__(
            self, f"torch.fx.symbolic_trace's graph of this model does not compute what the model does on "
                  f"example_inputs ({report}): fx records one path through the forward's Python and drops "
                  "what it does besides computing values (a branch such as `if mask is not None` on an "
                  "argument left at its default, a branch on a value, a grad-mode switch such as "
                  "`with torch.no_grad()`). No rule was applied. Capture the model with "
                  "torch.export.export(model, example_inputs).module() and pass that")
        self.tolerance = "exact"
        self.report = report
        self.counts: dict = {}
        self.culprit = None


def confirm_capture(model: Any, traced: fx.GraphModule, example_inputs: tuple) -> None:
    """Raise ``CaptureError`` when a symbolic_trace of ``model`` (``apply``'s own, the
    quantization flows') differs from it on the example inputs as given (one run of
    each)."""
    from rewrite.trust.check import check_equivalence

    report = check_equivalence(model, traced, example_inputs, trials=1, tolerance="exact")
    if not report.ok:
        raise CaptureError(report)


@attrs.frozen
class RewriteResult:
    """What ``RuleSet.apply`` returns.

    Attributes:
        graph_module: the rewritten GraphModule: with ``inplace=True`` the input
            itself; otherwise a new one (the input is never modified) that shares
            the input's unchanged parameters and buffers, and is a
            ``torch.fx._lazy_graph_module._LazyGraphModule``: its Python code is
            generated once, on the first call, ``.code``, ``print`` or ``torch.save``
            (``rewrite.engine.workspace.compile_now`` forces it; ``torch.jit.script`` needs
            ``fx.GraphModule(gm, gm.graph)`` first, as for any lazy graph module).
        counts: rule name -> number of times it was applied.
        stats: rule name -> ``RuleStats`` (tries, prefiltered, applied, failed, seconds).
        equivalence: the randomized equivalence report, or None if not checked.
        seconds: wall time of the rewrite itself: matching, replacing, removing
            what became unused, checking the created nodes (``Graph.lint`` for
            them); not the copy, not code generation, not the check.
        rejected: applications rolled back because they broke equivalence
            (``on_mismatch="skip-rule"``), as ``Rejection`` records.
        copy_seconds: wall time of copying the input's graph (0 with ``inplace=True``).
        changes: names of the rules that fired and are declared intentional
            changes (``change=True``): the check compared the rewrite with the
            model after those rules alone.
    """

    graph_module: fx.GraphModule
    counts: dict
    stats: dict
    equivalence: Any
    seconds: float
    rejected: tuple = ()
    copy_seconds: float = 0.0
    changes: tuple = ()
    original: Any = attrs.field(default=None, repr=False, eq=False)  # the input graph, for report()
    example_inputs: Any = attrs.field(default=None, repr=False, eq=False)

    @property
    def changed(self) -> bool:
        return bool(self.counts)

    def report(self, example_inputs: tuple | None = None) -> Any:
        """Original vs rewritten: nodes, FLOPs, elementwise ops, bytes, parameters,
        peak activation memory, casts and int8 ops (``rewrite.analysis.compare``).

        Both graphs are run once on ``example_inputs`` (default: those given to
        ``apply``, else made from placeholder metadata). ``print(result.report())``
        shows the table; ``.to_dict()`` gives plain data.
        """
        from rewrite.analysis import analyze, compare

        if self.original is None or self.original is self.graph_module:
            raise ValueError("report() needs the original graph, which apply(..., inplace=True) rewrote: "
                             "analyze a copy before rewriting (rewrite.analysis.analyze)")
        inputs = example_inputs if example_inputs is not None else self.example_inputs
        return compare(analyze(self.original, inputs), analyze(self.graph_module, inputs), self.counts)

    def summary(self) -> str:
        """A table of per-rule counts and the equivalence verdict."""
        lines = [f"{'rule':<32} {'applied':>8} {'tries':>8} {'failed':>8}"]
        for name in sorted(self.stats):
            s = self.stats[name]
            lines.append(f"{name:<32} {s.applied:>8} {s.tries:>8} {s.failed:>8}")
        for name in sorted(self.stats):
            if self.stats[name].failed:
                lines.append(f"failed: {self.stats[name].first_error}")
            elif self.stats[name].first_error:  # a registered predicate raised
                lines.append(f"error in {name}: {self.stats[name].first_error}")
        lines.append(
            f"rewrites: {sum(self.counts.values())} in {self.seconds * 1e3:.1f} ms "
            f"(+ {self.copy_seconds * 1e3:.1f} ms to copy the input)"
        )
        for name in self.changes:
            lines.append(f"intentional change (not checked): {name} x{self.counts.get(name, 0)}")
        if self.equivalence is not None:
            lines.append(f"equivalence: {self.equivalence}")
        for r in self.rejected:
            lines.append(f"rolled back: {r}")
        return "\n".join(lines)


def _schedule_of(s: Any) -> Any:
    """A parsed schedule as the driver's ``Schedule`` record (references stay names)."""
    if isinstance(s, ast.ScheduleRef):
        return s.name
    return Schedule(s.kind, tuple(_schedule_of(i) for i in s.items))


def _runs(sets: dict, schedule: Any, name: str) -> list:
    """For each place ``schedule`` runs rule ``name``, whether that run is one sweep:
    the rule sits directly in a ``once(...)`` with no ``fixpoint(...)`` around it (a
    bare rule in ``seq(...)`` runs to a fixpoint). Empty when it never runs it."""
    found: list = []
    walked: set = set()  # (set name, container, repeated): each context walked once

    def walk(node: Any, container: str, repeated: bool, seen: frozenset) -> None:
        if isinstance(node, str):
            if node == name:
                found.append(container == "once" and not repeated)
            elif node in sets and node not in seen and (node, container, repeated) not in walked:
                walked.add((node, container, repeated))
                walk(sets[node], container, repeated, seen | {node})
            return
        for child in node.items:
            walk(child, node.kind, repeated or node.kind == "fixpoint", seen)

    walk(schedule, "fixpoint", False, frozenset())
    return found


def _runs_in_sets(sets: dict, name: str) -> list:
    """``_runs`` over every rule set declared."""
    return [once for schedule in sets.values() for once in _runs(sets, schedule, name)]


def _clashing(sets: dict, rule_names: set, beside: dict, taken: set, tag: str) -> dict:
    """New names for the rule sets of ``sets`` that would mean something else beside
    the rules ``rule_names`` (a rule's name resolves first) and the rule sets
    ``beside``: named like such a rule, declared in ``beside`` with another schedule,
    or naming a set renamed so (their text alike, their meaning not). New names
    (``cleanup+fusion``, ``cleanup+fusion+2``) are added to ``taken``."""
    renamed: set = {n for n in sets if n in rule_names or (n in beside and beside[n] != sets[n])}
    grew = True
    while grew:  # a set naming a renamed set means something else too
        more = {n for n, sched in sets.items() if n not in renamed and n in beside and _names(sched) & renamed}
        renamed |= more
        grew = bool(more)
    names: dict = {}
    for n in sorted(renamed):
        new, k = f"{n}+{tag}", 2
        while new in taken:
            new, k = f"{n}+{tag}+{k}", k + 1
        taken.add(new)
        names[n] = new
    return names


def _names(schedule: Any) -> set:
    """The rule and rule-set names ``schedule`` refers to."""
    return {schedule} if isinstance(schedule, str) else set().union(*(_names(i) for i in schedule.items))


def _renamed(schedule: Any, names: dict) -> Any:
    """``schedule`` with the rule sets it names renamed by ``names``."""
    if not names:
        return schedule
    if isinstance(schedule, str):
        return names.get(schedule, schedule)
    return Schedule(schedule.kind, tuple(_renamed(item, names) for item in schedule.items))


def _default_schedule(rules: dict, unsettled: frozenset) -> Any:
    """A file's schedule when it declares no ``main``: every rule to a fixpoint, but a
    rule that rewrites its own output forever (E409, let through because one of the
    file's rule sets runs it in ``once(...)``) runs once, after the rest."""
    once = tuple(n for n in rules if n in unsettled)
    rest = tuple(n for n in rules if n not in unsettled)
    if not once:
        return Schedule("fixpoint", rest)
    return Schedule("seq", (Schedule("fixpoint", rest), Schedule("once", once))) if rest else Schedule("once", once)


class RuleSet:
    """Compiled rules plus a schedule. Build with ``rewrite.load`` / ``rewrite.parse``."""

    def __init__(self, rules: dict, sets: dict, schedule: Any, name: str = "") -> None:
        self.rules = rules  # name -> CompiledRule
        self.sets = sets  # ruleset name -> Schedule
        self.schedule = schedule
        self.name = name

    @classmethod
    def from_program(cls, program: Program, name: str = "") -> "RuleSet":
        families = dict(program.families)
        rules = {r.name: compile_rule(r, i, families) for i, r in enumerate(program.rules)}
        sets = {n: _schedule_of(s) for n, s in program.rulesets.items()}
        return cls(rules, sets, sets["main"] if "main" in sets else _default_schedule(rules, program.unsettled), name)

    def __repr__(self) -> str:
        return f"RuleSet({self.name or 'rules'}: {len(self.rules)} rules, schedule={self.schedule!r})"

    def __len__(self) -> int:
        return len(self.rules)

    def __iter__(self):
        return iter(self.rules.values())

    def __getitem__(self, name: str) -> "RuleSet":
        """The rule set (or single rule) declared under ``name``."""
        if name in self.sets:
            return RuleSet(self.rules, self.sets, self.sets[name], name)
        if name in self.rules:
            return self.only(name)
        raise KeyError(f"no rule or ruleset named {name!r}; have {sorted(self.sets) + sorted(self.rules)}")

    def only(self, rule: Any) -> "RuleSet":
        """A rule set that runs one rule as this set's schedule runs it: to a
        fixpoint, or in one sweep when the schedule runs it only in ``once(...)`` (a
        rule that matches its own replacement; verified so). A rule the schedule never
        runs runs as the file's rule sets run it. ``rule``: a name of this set, or a
        ``CompiledRule`` (a variant of one, e.g. without its where clause, which
        replaces the rule of that name)."""
        if isinstance(rule, str):
            if rule not in self.rules:
                raise KeyError(f"no rule named {rule!r}; have {sorted(self.rules)}")
            name = rule
        elif isinstance(getattr(rule, "name", None), str) and hasattr(rule, "rule"):
            name = rule.name
        else:
            raise TypeError(f"only takes a rule's name or a compiled rule, not {type(rule).__name__}")
        runs = _runs(self.sets, self.schedule, name) or _runs_in_sets(self.sets, name)
        kind = "once" if runs and all(runs) else "fixpoint"
        rules = self.rules if isinstance(rule, str) else {**self.rules, name: rule}
        return RuleSet(rules, self.sets, Schedule(kind, (name,)), name)

    def __add__(self, other: "RuleSet") -> "RuleSet":
        """Run ``self`` then ``other``."""
        if not isinstance(other, RuleSet):
            return NotImplemented
        rules = dict(self.rules)
        for name, rule in other.rules.items():
            if name in rules and rules[name].rule != rule.rule:
                raise ValueError(f"both rule sets define a different rule named {name!r}")
            rules[name] = rule
        # each side's schedules keep their meaning: a rule set named like a rule of
        # the other side, or declared by both with another meaning (each file's
        # ``main``, a ``cleanup`` of each, or one naming such a set), gets a name of
        # its own, which no file can write
        taken = set(rules) | set(self.sets) | set(other.sets)
        mine = _clashing(self.sets, set(other.rules) - set(self.rules), {}, taken, self.name or "1")
        mine_sets = {mine.get(n, n): _renamed(sched, mine) for n, sched in self.sets.items()}
        theirs = _clashing(other.sets, set(self.rules) - set(other.rules), mine_sets, taken, other.name or "2")
        their_sets = {theirs.get(n, n): _renamed(sched, theirs) for n, sched in other.sets.items()}
        first = _renamed(self.schedule, mine)
        items = first.items if not isinstance(first, str) and first.kind == "seq" else (first,)  # a + b + c: one seq
        schedule = Schedule("seq", items + (_renamed(other.schedule, theirs),))
        return RuleSet(rules, {**mine_sets, **their_sets}, schedule, f"{self.name}+{other.name}")

    def _resolve(self, name: str) -> Any:
        if name in self.rules:
            return self.rules[name]
        return self.sets[name]

    @one_thread_at_a_time()
    def apply(
        self,
        model: Any,
        example_inputs: tuple | None = None,
        *,
        check: bool = True,
        trials: int = 3,
        rtol: float | None = None,
        atol: float | None = None,
        max_rewrites: int | None = None,
        on_mismatch: str = "raise",
        shuffle_seed: int | None = None,
        inplace: bool = False,
        input_ranges: dict | None = None,
        fixed_inputs: tuple = (),
        training: bool | None = None,
    ) -> RewriteResult:
        """Apply the rule set to a copy of ``model`` (or to ``model`` itself).

        Args:
            model: a ``torch.fx.GraphModule`` (from symbolic_trace, torch.export's
                ``.module()``, or a dynamo backend), a ``torch.export.ExportedProgram``
                (rewritten as its ``.module()``: the result is a GraphModule, which
                ``torch.export.export`` can capture again), or an ``nn.Module``, which
                is captured with ``torch.fx.symbolic_trace``.
            example_inputs: inputs to the model; used for shape facts (when the
                graph has no ``meta['val']``) and for the equivalence check.
            check: compare original and rewritten outputs on random inputs shaped
                like ``example_inputs`` (trial 0 uses them as given). The original
                runs once per trial; bisection and re-runs reuse its outputs. With
                nothing to run it on (no ``example_inputs``, no input shapes recorded
                in the graph) a rewrite raises ``ValueError``: never returned unchecked.
            trials, rtol, atol: passed to the check (tolerances default by dtype).
            max_rewrites: bound on rewrites before ``NonTerminationError``.
            on_mismatch: when the check fails, the first rewrite that broke it is
                found by bisection over the applications. ``"raise"`` (default)
                raises ``EquivalenceError`` naming it; ``"skip-rule"`` rolls that
                application back, keeps the good ones, and reports it in
                ``result.rejected``.
            shuffle_seed: visit the worklist in a random order (seeded), to find
                rule sets whose result depends on the order.
            inplace: rewrite ``model`` itself (a ``GraphModule``) and return it as
                ``result.graph_module``. Every change is journaled: a failed check,
                a ``skip-rule`` rollback, a bisection step or an exception puts the
                module back exactly as it was (graph, node metadata, parameters,
                buffers, submodules) before the error propagates. The default
                (False) never modifies ``model``: the result is a copy of its graph
                that shares its parameters and buffers (no rule writes a tensor:
                a rule that changes a constant makes a new one), except those its
                forward writes in place, which it owns copies of.
            input_ranges: for the check's random trials, inputs drawn uniformly in a
                range: ``{index or pytree path: (low, high)}`` (``{1: (0, 5)}``,
                ``{"[0]['lengths']": (1, 8)}``), for models whose inputs must be
                valid in a way random normals are not.
            fixed_inputs: inputs (by flat index or pytree path) every trial passes as
                the example gives them (a symmetric positive definite matrix, sorted
                lengths): the trials vary the others.
            training: whether the graph is trained (its parameters get gradients an
                optimizer reads). None (default) reads it from the graph: its batch
                norms and dropouts, a ``symbolic_trace`` graph's modules' flags, or a
                mark a capture of an eval-mode model (``rewrite.capture``) or an
                earlier apply left (``INFERENCE_KEY``). A graph none of them tells of
                (a ``torch.export`` of an MLP: its module is always in training mode)
                may train: its parameters that require grad are not folded, and apply
                warns (``TrainingModeWarning``). True: no rule folds a parameter that
                requires grad into a constant (AMP then casts the weights at run time,
                so gradients reach them); False: an inference graph, folds everywhere.

        Returns:
            RewriteResult with ``graph_module`` and ``counts``.

        Raises:
            EquivalenceError: the rewritten graph diverged; nothing is returned.
            NonTerminationError: the rules never settled.

        Example::

            result = rewrite.load("rules/fusion.rw").apply(gm, example_inputs=(x,))
            result.counts          # {'conv_bn': 53}
        """
        validate_apply_options(check=check, trials=trials, rtol=rtol, atol=atol, max_rewrites=max_rewrites,
                               on_mismatch=on_mismatch, inplace=inplace, input_ranges=input_ranges,
                               fixed_inputs=fixed_inputs, training=training, shuffle_seed=shuffle_seed)
        if not isinstance(model, (torch.nn.Module, torch.export.ExportedProgram)):
            raise TypeError(f"apply needs a torch.fx.GraphModule, a torch.export.ExportedProgram or an "
                            f"nn.Module, not {type(model).__name__}")
        if isinstance(model, torch.jit.ScriptModule):
            raise TypeError("apply cannot rewrite a TorchScript module: pass the nn.Module itself, or its "
                            "torch.export.export(model, args).module()")
        if isinstance(model, torch.export.ExportedProgram):
            if inplace:
                raise ValueError("inplace=True needs a GraphModule, not an ExportedProgram: pass ep.module()")
            declared = dict(model.range_constraints)
            model = model.module()  # the module it runs as; the result is a GraphModule too
            model.meta[DECLARED_RANGES] = declared  # the smallest sizes the check tries (trust/sizes.py)
        if inplace and not isinstance(model, fx.GraphModule):
            raise ValueError(f"inplace=True needs a torch.fx.GraphModule, not {type(model).__name__}")
        if check and isinstance(example_inputs, dict):
            raise TypeError("example_inputs is a tuple of positional inputs, not a dict")
        keywords = _keyword_only_inputs(model) if check else ()
        if keywords:
            raise ValueError(
                f"the check calls the model with example_inputs as positional arguments, and this model "
                f"takes {', '.join(map(repr, keywords))} by keyword only: pass check=False (and compare the "
                "result yourself), or wrap the model in a module whose forward takes them positionally")
        try:
            _refuse_uninitialized(model)
        except RecursionError:
            raise ValueError(f"{type(model).__name__} holds one of its own ancestors as a submodule (a cycle in the "
                             "module tree, e.g. `child.owner = model` on an nn.Module): torch's module walks "
                             "(named_modules, state_dict, .to) never end on it. Keep the reference out of the "
                             "module tree (a weakref, or object.__setattr__ outside _modules)") from None
        _refuse_fake_inputs(example_inputs)
        _refuse_fake_model(model)
        if check:
            _refuse_meta(model, example_inputs)
        original = model if isinstance(model, fx.GraphModule) else _symbolic_trace(model)
        if not any(n.op == "output" for n in reversed(original.graph.nodes)):
            raise ValueError("the graph has no output node: a GraphModule's graph ends in graph.output(...)")
        self._warn_hidden(original)
        example_inputs = as_input_tuple(example_inputs) if example_inputs is not None else None
        if example_inputs is not None and (input_ranges or fixed_inputs):
            from rewrite.trust.check import validate_input_keys

            validate_input_keys(example_inputs, input_ranges, fixed_inputs)  # before any work
        # one pause of the cyclic collector for the whole call: paused separately, the
        # copy's young objects were collected once between copying and rewriting.
        # Outside inference mode: a constant a rule computes (a folded weight) is then
        # a plain tensor, which the result can use anywhere, autograd included.
        # a traced model's own modules run where facts are recorded from the example
        # inputs: what a hook of theirs writes into them (a feature list) is put back
        caller = AttributeSnapshot(list(model.modules())) if model is not original else None
        with gc_paused(), torch.inference_mode(False), autocast_off(), cpu_default_device(), fake_mode_off(), \
                generators_kept(model_generators(original)):
            try:
                txn = _Transaction(self, original, example_inputs, max_rewrites, shuffle_seed, inplace,
                                   checked=check, training=training)
            except Exception as err:
                _refuse_malformed(original, err)
                raise
            try:
                return self._apply(txn, model, original, example_inputs, check, trials, rtol, atol, on_mismatch,
                                   {"input_ranges": input_ranges, "fixed_inputs": tuple(fixed_inputs)})
            except BaseException as err:
                txn.rollback()  # in place: the module as it was; a copy: nothing to do
                if isinstance(err, Exception):
                    _refuse_malformed(original, err)
                raise
            finally:
                if caller is not None:
                    caller.restore()

    def _apply(self, txn: "_Transaction", model: Any, original: fx.GraphModule, example_inputs: tuple | None,
               check: bool, trials: int, rtol: float | None, atol: float | None,
               on_mismatch: str, drawn: dict) -> RewriteResult:
        gm, driver = txn.run()
        seconds, copy_seconds = txn.seconds, txn.copy_seconds
        report, rejected = None, []
        traced = model is not original and example_inputs is not None  # apply captured the module itself
        if check and traced and not set(driver.counts) - self._changes():
            confirm_capture(model, original, example_inputs)  # nothing else checks the capture
        if check and set(driver.counts) - self._changes() and not _can_check(original, example_inputs):
            # checked by default: a rewrite the check cannot run on is not returned
            raise ValueError(
                f"apply: the equivalence check needs inputs, and the graph records no input shapes (a "
                f"symbolic_trace graph); the rules fired {dict(driver.counts)}, nothing was returned. Pass "
                "example_inputs=(...) (the model's example inputs: the check draws random ones like them), or "
                "check=False to take the rewrite unchecked")
        if check and set(driver.counts) - self._changes():
            from rewrite.trust.check import (Reference, check_equivalence, half_node_counts, more_half_nodes,
                                             named_half_precisions, new_half_precisions, static_float_dtypes)

            kind = self._tolerance_of(driver.counts)
            # Intentional changes (``change=True``) are not checked: the rewrite is
            # compared with the model after those rules alone.
            changes = set(driver.counts) & self._changes()
            # a rule that names a stop-gradient, a rounding or a quantizer may keep
            # every value and change the gradients: compare a backward pass too
            # (later replays only skip applications: never a rule this run did not fire)
            gradients = self._touches_gradients(set(driver.counts) - changes)
            if txn.inplace:
                # the model is the rewrite now: back to the original to run it once
                # per trial (and under autocast to the half precisions the rewrite
                # newly computes in: the check may measure against it), then the
                # (deterministic) rewrite again
                rewritten_dtypes, rewritten_half = static_float_dtypes(gm), half_node_counts(gm)
                # metadata that does not tell: every half precision the rewrite names
                named = named_half_precisions(gm) if rewritten_dtypes is None or rewritten_half is None else ()
                txn.restore()
                base = original if not changes else self._changed(original, changes, driver.counts, example_inputs,
                                                                  (trials, rtol, atol, drawn, on_mismatch))
                lower = tuple(sorted(set(new_half_precisions(static_float_dtypes(original), rewritten_dtypes))
                                     | set(more_half_nodes(half_node_counts(original), rewritten_half))
                                     | set(named), key=str))
                reference = Reference(base, example_inputs, graph=original, **drawn)
                reference.prepare(trials, kind, gradients, lower)
                gm, driver = txn.run()
            else:
                base = model if not changes else self._changed(original, changes, driver.counts, example_inputs,
                                                               (trials, rtol, atol, drawn, on_mismatch))
                reference = Reference(base, example_inputs, graph=original, **drawn)

            def verdict(candidate: fx.GraphModule) -> Any:
                return check_equivalence(reference, candidate, example_inputs, trials=trials, rtol=rtol,
                                         atol=atol, tolerance=kind, gradients=gradients)

            report = verdict(gm)
            while not report.ok:
                relayout = report.first_mismatch.relayout if report.first_mismatch is not None else None
                if relayout is not None and relayout[0] not in txn.relayouts:
                    # only an output's layout changed, where the graph's recorded layouts
                    # misled the restore (a fake kernel's batch norm of a strided input):
                    # copied into the original's format at the output, checked again
                    txn.relayouts[relayout[0]] = relayout[1]
                    gm, driver = txn.run()
                    report = verdict(gm)
                    continue
                if traced:  # the capture itself, not a rule, may be what differs
                    confirm_capture(model, original, example_inputs)
                    traced = False
                culprit = txn.bisect(verdict, len(driver.history))
                if on_mismatch == "raise" or culprit is None:
                    raise EquivalenceError(report, dict(driver.counts), culprit, kind)
                if len(rejected) >= _MAX_REJECTIONS:
                    raise EquivalenceError(report, dict(driver.counts), culprit, kind, rolled_back=tuple(rejected))
                if sum(r.rule == culprit.rule for r in rejected) + 1 >= _ROLLBACKS_PER_RULE:
                    # a rule wrong at this many places is likely wrong at more: skipped
                    # everywhere, rather than one bisection per place
                    culprit = attrs.evolve(culprit, everywhere=True)
                    txn.skip.add((culprit.rule, None))
                else:
                    txn.skip.add((culprit.rule, culprit.node))
                rejected.append(culprit)
                warnings.warn(f"rewrite: rolled back {culprit}", stacklevel=3)
                gm, driver = txn.run()
                report = verdict(gm) if driver.counts else None
                if report is None:
                    break
        # before the commit: a warning the caller's filter turns into an error
        # (pytest -W error) must still find the in-place module to roll back
        _warn_unknown_training(driver.facts.unknown_training)
        txn.commit()
        if driver.facts.training is not None:  # the caller's word, kept for a later apply
            gm.meta[INFERENCE_KEY] = not driver.facts.training
        elif driver.facts.inference:  # a later apply knows it too (a fold may remove what told)
            gm.meta[INFERENCE_KEY] = True
        changes = tuple(sorted(set(driver.counts) & self._changes()))
        return RewriteResult(gm, dict(driver.counts), dict(driver.stats), report, seconds, tuple(rejected),
                             copy_seconds, changes, original=original, example_inputs=example_inputs)

    def scheduled_rules(self) -> tuple:
        """The names of the rules this set's schedule runs, in first-seen order."""
        names: dict = {}
        walked: set = set()  # named sets walked once (s1 = fixpoint(s0, s0), s2 = ...: 2^n paths)

        def walk(item: Any) -> None:
            if isinstance(item, str):
                if item in self.rules:
                    names[item] = None
                elif item in self.sets and item not in walked:
                    walked.add(item)
                    walk(self.sets[item])
            else:
                for child in item.items:
                    walk(child)

        walk(self.schedule)
        return tuple(names)

    def _warn_hidden(self, gm: fx.GraphModule) -> None:
        """Warn (``LeafModuleWarning``) when leaf modules hide ops the rules rewrite."""
        from rewrite.engine.leaves import LeafModuleWarning, leaf_warning

        roots = set().union(*(self.rules[n].root_ops for n in self.scheduled_rules()))
        message = leaf_warning(gm, roots) if roots else None
        if message:
            warnings.warn(message, LeafModuleWarning, stacklevel=3)

    def _changes(self) -> set:
        """Names of the rules declared as intentional changes (``change=True``)."""
        return {name for name, rule in self.rules.items() if rule.rule.option("change", False)}

    def _changed(self, original: fx.GraphModule, fired: set, counts: Any = None, example_inputs: Any = None,
                 checking: tuple = (3, None, None, {}, "raise")) -> fx.GraphModule:
        """The model with only the intentional changes this run made (``fired``: not
        every ``change`` rule of the file, which this rule set may not schedule)
        applied: what the whole rewrite must stay equivalent to. When the changes
        alone do not fire as often as in the run (``counts``: a change rule matches
        what another rule made, or another rule took a site first), they are applied
        after the other rules, which are checked on their own first (``checking``:
        trials, rtol, atol, the drawn inputs' options and ``on_mismatch`` of the run)."""
        # under the rule set's own schedule (a change rule that matches its own
        # replacement runs in once(...)): its other rules left out
        schedule = self._only(self.schedule, fired) or Schedule("fixpoint", tuple(sorted(fired)))
        only = RuleSet(self.rules, {}, schedule, f"{self.name}:changes")
        alone = only.apply(original, example_inputs, check=False)
        if counts is None or all(alone.counts.get(name, 0) == counts.get(name, 0) for name in fired):
            return alone.graph_module
        others = self._only(self.schedule, set(self.scheduled_rules()) - self._changes())
        if others is None:
            return alone.graph_module
        trials, rtol, atol, drawn, on_mismatch = checking
        exact = RuleSet(self.rules, {}, others, f"{self.name}:without changes").apply(
            original, example_inputs, check=True, trials=trials, rtol=rtol, atol=atol, on_mismatch=on_mismatch,
            **drawn)
        return only.apply(exact.graph_module, example_inputs, check=False).graph_module

    def _only(self, item: Any, rules: set) -> Any:
        """``item`` of a schedule with every rule not in ``rules`` left out (rule-set
        names resolved into their schedules); None when nothing is left."""
        if isinstance(item, str):
            if item in self.rules:
                return item if item in rules else None
            return self._only(self.sets[item], rules) if item in self.sets else None
        kept = tuple(k for k in (self._only(i, rules) for i in item.items) if k is not None)
        return Schedule(item.kind, kept) if kept else None

    def _touches_gradients(self, fired: set) -> bool:
        """Whether a rule that fired may change gradients without changing a value
        (``rewrite.trust.gradients.touches_gradients``)."""
        from rewrite.trust.gradients import touches_gradients

        return any(touches_gradients(self.rules[name]) for name in fired if name in self.rules)

    def _tolerance_of(self, counts: dict) -> str:
        """``"exact"`` when every rule that fired is exact (only rounding may differ),
        else ``"approx"`` (see ``rewrite.trust.verify.rule_tolerance``)."""
        from rewrite.trust.instances import rule_tolerance

        fired = (self.rules[name] for name in counts if name in self.rules)
        return "approx" if any(rule_tolerance(rule) == "approx" for rule in fired) else "exact"

    @one_thread_at_a_time()
    @fake_mode_off()
    def verify(self, *, max_examples: int = 100, seed: int = 0, names: Any = None) -> Any:
        """Check every rule on random instances of its pattern before trusting it.

        Each rule's pattern is built as a small graph on random shapes, dtypes,
        attributes and values that satisfy its constraints (hypothesis); the rule is
        applied and the outputs compared, exactly for exact rules, with dtype-aware
        tolerances (and again in float64) for approximate ones.

        Returns:
            ``rewrite.trust.verify.VerificationReport``: ``.ok``, ``.table()``, and for
            each failing rule a shrunk counterexample with its source position.
        """
        from rewrite.trust.verify import verify_rules

        return verify_rules(self, max_examples=max_examples, seed=seed, names=names)

    def explain(self, model: Any, rule: str | None = None, node: str | None = None,
                example_inputs: tuple | None = None, limit: int = 10, training: bool | None = None) -> list:
        """Why rules fire or not, in the rule file's terms.

        Args:
            model: the GraphModule (or nn.Module, symbolic_traced) to look at.
            rule: one rule's name, or None for every rule.
            node: one node's name, or None for the near misses across the graph
                (nodes where the rule's root op matched but something else failed,
                deepest partial match first, at most ``limit`` per rule).
            example_inputs: for shape facts on graphs that carry none.
            training: as ``apply`` takes it (False: an inference graph, whose
                parameters are constants).

        Returns:
            A list of ``rewrite.trust.explain.Explanation`` (printable). A match of
            a rule this set's schedule never runs says so.
        """
        from rewrite.trust.explain import explain

        if isinstance(model, torch.export.ExportedProgram):
            model = model.module()  # as apply takes it
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"explain needs a torch.fx.GraphModule, a torch.export.ExportedProgram or an "
                            f"nn.Module, not {type(model).__name__}")
        for name, given in (("rule", rule), ("node", node)):
            if given is not None and not isinstance(given, str):
                hint = " (example inputs go by keyword: explain(model, example_inputs=(x,)))" \
                    if isinstance(given, (tuple, list, torch.Tensor)) and any(
                        isinstance(v, torch.Tensor) for v in torch.utils._pytree.tree_leaves(given)) else ""
                raise TypeError(f"explain: {name} is one {name}'s name, a str, not {type(given).__name__}{hint}")
        if rule is not None and rule not in self.rules:
            raise KeyError(f"no rule named {rule!r}; have {sorted(self.rules)}")
        gm = model if isinstance(model, fx.GraphModule) else _symbolic_trace(model)
        return explain(self, gm, rule, node, example_inputs, limit, training)



#: ``on_mismatch="skip-rule"``: bisections (one per rolled-back application) before
#: the check's failure is raised after all
_MAX_REJECTIONS = 16
#: the rolled-back applications of one rule after which it is skipped at every node
_ROLLBACKS_PER_RULE = 3


def _refuse_malformed(gm: fx.GraphModule, err: Exception) -> None:
    """``ValueError`` naming what makes ``gm`` no program, for an apply that failed
    with torch's own error from deep inside (a ``KeyError`` for a node used before it
    is defined); our own errors and a sound graph: nothing."""
    from rewrite.trust.check import ModelRunError

    if isinstance(err, (ValueError, TypeError, AssertionError)) and not isinstance(err, ModelRunError):
        return
    problem = graph_problem(gm)
    if problem is not None:
        raise ValueError(f"the graph is malformed: {problem}") from err


def graph_problem(gm: fx.GraphModule) -> str | None:
    """What makes ``gm`` no program fx can run (``Graph.lint``'s complaint: a node
    used before it is defined or from another graph, a missing submodule; a
    ``get_attr`` of nothing), or None. Asked only once a rewrite failed: linting
    every graph would cost every apply a walk."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gm.graph.lint()
    except Exception as err:  # noqa: BLE001 - lint's own complaint is the answer
        return str(err).splitlines()[0] if str(err) else type(err).__name__
    for node in gm.graph.find_nodes(op="get_attr"):
        owner: Any = gm
        for atom in str(node.target).split("."):
            if not hasattr(owner, atom):
                return f"get_attr node {node.name!r} reads {node.target!r}, which the module does not have"
            owner = getattr(owner, atom)
    return None


def _refuse_uninitialized(model: torch.nn.Module) -> None:
    """A lazy module (``LazyLinear``) whose parameters have no shape yet cannot be
    rewritten: no fact about them is known until a forward pass materializes them."""
    from torch.nn.parameter import UninitializedTensorMixin

    # the modules' own tables, read directly: named_parameters' bookkeeping was ~1 ms
    # per 5000 tensors, on every apply
    for owner, module in model.named_modules(remove_duplicate=False):
        for name, t in [*module._parameters.items(), *module._buffers.items()]:
            if not isinstance(t, UninitializedTensorMixin):
                continue
            kind = type(module).__name__
            raise TypeError(
                f"{type(model).__name__} holds a lazy module not initialized yet ({kind} "
                f"{owner or '(the model)'!r}, {name!r} has no shape): run the model once on example inputs "
                "to materialize it, then rewrite it")


#: ``RuleSet.apply``'s keyword options and their defaults, read once (a caller may wrap apply)
_APPLY_OPTIONS = {name: p.default for name, p in inspect.signature(RuleSet.apply).parameters.items()
                  if p.kind is p.KEYWORD_ONLY}


def validate_apply_options(**options: Any) -> None:
    """``TypeError``/``ValueError`` for an option ``RuleSet.apply`` does not take (a
    misspelt name, with the closest one) or a value it refuses; what is left out takes
    its default. ``rewrite.backend`` asks when it is made, not at the first compile."""
    known = _APPLY_OPTIONS
    unknown = sorted(set(options) - set(known))
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(known), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(f"unknown apply option {unknown[0]!r}{hint}; apply takes {', '.join(sorted(known))}")
    given = {**known, **options}
    check, trials, rtol, atol = given["check"], given["trials"], given["rtol"], given["atol"]
    max_rewrites, on_mismatch, inplace = given["max_rewrites"], given["on_mismatch"], given["inplace"]
    input_ranges, fixed_inputs, training = given["input_ranges"], given["fixed_inputs"], given["training"]
    seed = given["shuffle_seed"]
    if on_mismatch not in ("raise", "skip-rule"):
        raise ValueError(f"on_mismatch must be 'raise' or 'skip-rule', not {on_mismatch!r}")
    for flag, given in (("check", check), ("inplace", inplace), ("training", training)):
        if not isinstance(given, bool) and not (flag == "training" and given is None):
            # inplace="no" is truthy: the caller's model would be rewritten
            raise TypeError(f"{flag} must be True or False, not {given!r}")
    if max_rewrites is not None and (not isinstance(max_rewrites, int) or isinstance(max_rewrites, bool)
                                     or max_rewrites < 1):
        raise ValueError(f"max_rewrites must be a positive int (or None: 20 per node, plus 1000), "
                         f"not {max_rewrites!r}")
    if check and (not isinstance(trials, int) or isinstance(trials, bool) or trials < 1):
        raise ValueError(f"trials must be a positive int when check=True, not {trials!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise ValueError(f"shuffle_seed must be a non-negative int (or None: graph order), not {seed!r}")
    for name, tol in (("rtol", rtol), ("atol", atol)):
        if tol is not None and not (isinstance(tol, (int, float)) and not isinstance(tol, bool)
                                    and 0 <= tol < math.inf):
            why = " (an infinite tolerance passes any rewrite that keeps shapes and dtypes: check=False says " \
                "so)" if tol == math.inf else ""
            raise ValueError(f"{name} must be a finite non-negative number, not {tol!r}{why}")
    if input_ranges is not None and not (isinstance(input_ranges, dict) and all(
            isinstance(v, (tuple, list)) and len(v) == 2 for v in input_ranges.values())):
        raise ValueError(f"input_ranges maps an input (index or pytree path) to (low, high), not {input_ranges!r}")
    if isinstance(fixed_inputs, (str, int)) or not all(isinstance(k, (str, int)) for k in fixed_inputs):
        raise ValueError(f"fixed_inputs is a list of input indices or pytree paths, not {fixed_inputs!r}")


def _refuse_meta(model: torch.nn.Module, example_inputs: Any) -> None:
    """The check runs the model and compares values: a model or inputs on the meta
    device (``device="meta"``, an empty-weights loader) have none. Said before any
    work, not as torch's error from deep inside the comparison."""
    inputs = torch.utils._pytree.tree_leaves(example_inputs) if example_inputs is not None else []
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    for module in model.modules():
        tensors.extend(t for t in [*module._parameters.values(), *module._buffers.values()] if t is not None)
    if any(t.is_meta for t in tensors):
        raise ValueError("the equivalence check runs the model on real values, and this model or its example "
                         "inputs are on the meta device: load the weights first (to_empty() and a state dict), "
                         "or pass check=False")


def _refuse_fake_inputs(example_inputs: Any) -> None:
    """Facts are recorded, and the check runs, by calling the model on the example
    inputs: FakeTensors carry shapes but no values, and the model's real weights
    cannot meet them (torch asserts, or no fact is recorded and no rule fires). A
    graph that already carries FakeTensor metadata (torch.export, dynamo) needs no
    example inputs for its facts."""
    from torch._subclasses.fake_tensor import FakeTensor

    from rewrite.trust.held import input_leaves

    inputs = input_leaves(example_inputs) if example_inputs is not None else []
    if any(isinstance(t, FakeTensor) for t in inputs):
        raise ValueError("example_inputs holds FakeTensors: apply records facts and checks the rewrite by running "
                         "the model on real values. Pass real tensors of the same shapes (torch.randn(...)), or "
                         "no example_inputs for a graph whose nodes already carry FakeTensor metadata "
                         "(torch.export, dynamo)")


def _refuse_fake_model(model: torch.nn.Module) -> None:
    """A model whose weights are FakeTensors (built under a ``FakeTensorMode``) has no
    values to fold, record facts from or check: said before any work."""
    from torch._subclasses.fake_tensor import FakeTensor

    for module in model.modules():
        if any(isinstance(t, FakeTensor) for t in [*module._parameters.values(), *module._buffers.values()]):
            raise ValueError("the model's parameters or buffers are FakeTensors (built under a FakeTensorMode): "
                             "apply folds constants, records facts and checks the rewrite on real values. Build "
                             "the model outside the mode (or load real weights into it) first")


def _warn_unknown_training(names: set) -> None:
    """Say that parameters were kept out of folds only for want of ``training=``."""
    if names:
        shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
        warnings.warn(f"rewrite: {len(names)} parameter(s) that require grad ({shown}) were not folded into "
                      "constants: nothing in this graph tells whether it trains (a torch.export graph keeps no "
                      "trace of model.eval() without a batch norm or dropout in it). Pass apply(..., "
                      "training=False) for an inference graph (weights folded, e.g. cast once by AMP), or "
                      "training=True to keep them trainable and silence this", TrainingModeWarning, stacklevel=4)


def _symbolic_trace(model: torch.nn.Module) -> fx.GraphModule:
    """``torch.fx.symbolic_trace(model)``, its failures told in the user's terms. A
    hook registered on the model itself is refused: the traced graph runs without it
    (a hooked submodule stays one call, which runs its hooks:
    ``rewrite.capture.symbolic_trace``), so the result would compute something else,
    or (a state_dict hook: a checkpoint format's version, renamed keys) save and load
    other checkpoints than the model."""
    hooks = [kind for kind in HOOK_TABLES if getattr(model, kind, None) and not kind.endswith(("_kwargs", "_called"))]
    if hooks:
        raise TypeError(
            f"{type(model).__name__} has hooks registered on itself ({', '.join(h.strip('_') for h in hooks)}), "
            "which torch.fx.symbolic_trace does not capture: the rewritten model would run (or save and load its "
            "state) without them. Remove them (or register them on a submodule), or pass a GraphModule you "
            "captured")
    try:
        return symbolic_trace(model)
    except Exception as err:  # noqa: BLE001 - any tracing failure: say what to do instead
        hooked_modules = [name for name, m in model.named_modules() if name and hooked(m)]
        why = (f"; the submodules with hooks ({', '.join(hooked_modules[:3])}) stay calls, so that their "
               "hooks keep running, and their outputs are then opaque to the trace: remove the hooks "
               "while rewriting") if hooked_modules else ""
        raise TypeError(
            f"could not capture {type(model).__name__} with torch.fx.symbolic_trace "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}){why}; capture it "
            "yourself, e.g. torch.export.export(model, example_inputs, strict=False).module(), and pass that"
        ) from err


@attrs.frozen
class Rejection:
    """A rule application that broke equivalence: the rule, the root node it
    rewrote, where the rule was written, where the node came from in the model."""

    rule: str
    node: str
    rule_location: str
    source: str
    report: Any
    #: the rule was rolled back at every node (its ``_ROLLBACKS_PER_RULE``-th
    #: application that broke equivalence is ``node``)
    everywhere: bool = False

    def __str__(self) -> str:
        where = f"at node {self.node!r}{' from ' + self.source if self.source else ''}"
        if self.everywhere:
            where = (f"at every node, after {_ROLLBACKS_PER_RULE} of its applications broke equivalence (the "
                     f"last {where})")
        return f"rule {self.rule!r} ({self.rule_location}) {where}: {self.report}"


class _Transaction:
    """The rewrite of one module, replayable: in full, stopped after k applications,
    or with some applications skipped. Every replay starts from the module as given,
    put back by the undo journal (``rewrite.engine.workspace.Journal``); the driver
    is deterministic, so the first k applications of a replay are those of the full
    run. The module is the caller's own (``inplace``) or a copy sharing its tensors
    (``rewrite.engine.workspace.shared_copy``)."""

    def __init__(self, ruleset: "RuleSet", original: fx.GraphModule, example_inputs: Any,
                 max_rewrites: int | None, shuffle_seed: int | None, inplace: bool = False,
                 checked: bool = True, training: bool | None = None) -> None:
        self.ruleset = ruleset
        self.training = training
        self.original = original
        self.example_inputs = example_inputs
        self.max_rewrites = max_rewrites
        self.shuffle_seed = shuffle_seed
        self.inplace = inplace
        self.skip: set = set()
        # checked: replays may follow (bisection, skip-rule); unchecked, a copy is
        # never replayed, so it needs no journal
        self.checked = checked
        self.seconds = 0.0
        with gc_paused():
            start = time.perf_counter()
            self.gm = original if inplace else shared_copy(original)
            if not inplace:  # running the result must not write the caller's tensors
                own_written_state(self.gm, self.training)
            self.copy_seconds = time.perf_counter() - start
        self._journal: Journal | None = None
        self._stale = False  # the graph changed since its code was last generated
        self._done = False
        self._recorded = False  # a run recorded facts from the example inputs: forgotten at commit
        # output leaf -> memory format the original's run gave it, where the check found
        # the layouts the graph records wrong (``restore_output_layouts``)
        self.relayouts: dict = {}

    def run(self, limit: int | None = None, sync: bool = True) -> tuple:
        """One replay from the module as given; the nodes the rewrites created are
        linted (``check_touched``). ``sync``: make
        the module's code follow the graph (lazily for copies)."""
        gm = self.gm
        with gc_paused():
            start = time.perf_counter()
            # an unchecked copy is never replayed nor rolled back (a failure drops it):
            # no journal, no hook on every node the rewrite creates or erases
            journal = None
            if self.inplace or self.checked:
                if self._journal is None:
                    self._journal = Journal(gm)
                else:
                    self._undo(keep_meta=True)
                journal = self._journal.open()
            try:
                driver = Driver(gm, detect_dialect(gm), self.max_rewrites, self.example_inputs, limit=limit,
                                skip=self.skip, on_meta=journal.note_meta if journal is not None else None,
                                shuffle=random.Random(self.shuffle_seed) if self.shuffle_seed is not None else None,
                                training=self.training)
                outputs = output_values(gm)
                with torch.no_grad():
                    driver.run(self.ruleset.schedule, self.ruleset._resolve)
                if driver.counts:
                    _remove_unused(gm, driver.replacer.released_nodes, driver.replacer.released_targets)
                    driver.created.extend(restore_output_layouts(gm, driver.facts, outputs, detect_dialect(gm),
                                                                 driver.created, driver.replacer.replaced,
                                                                 self.relayouts))
                    driver.facts.settle(driver.created)
                    # the untouched rest of the graph was valid and still is; the
                    # check's runs then exercise every node anyway
                    check_touched(gm.graph, driver.created)
            finally:
                if journal is not None:
                    journal.close()
            self._recorded |= driver.facts.recorded
            # unjournaled, the graph changed exactly when a rule fired (the cleanups
            # and layout restores run only then; recorded facts are not code)
            self._stale |= journal.changed if journal is not None else bool(driver.counts)
            if sync:
                self.sync()
            self.seconds = time.perf_counter() - start
        return gm, driver

    def sync(self) -> None:
        """Regenerate the module's code if its graph changed (lazily: a copy's code
        is generated on first use; an eager GraphModule given in place now)."""
        if self._stale:
            self.gm.recompile()
            self._stale = False

    def _undo(self, keep_meta: bool) -> None:
        if self._journal is not None:
            self._stale |= self._journal.changed
            self._journal.undo(keep_meta=keep_meta)

    def restore(self) -> None:
        """Back to the module as given (facts recorded on its nodes kept: a replay
        reuses them), its code following its graph."""
        self._undo(keep_meta=True)
        self.sync()

    def rollback(self) -> None:
        """After a failure: an in-place module goes back exactly as it was given."""
        if self.inplace and not self._done:
            self._undo(keep_meta=False)
            if self._journal is not None:  # the graph is the one given: so is its code
                self._journal.restore_code()
                self._stale = False
            self.sync()
            self._done = True

    def commit(self) -> None:
        if self._recorded:
            forget_recorded_facts(self.gm)
        if not self.inplace:  # nor after the caller puts the result in training mode
            own_state_training_writes(self.gm)
        self.sync()
        self._done = True

    def bisect(self, verdict: Any, n: int) -> Rejection | None:
        """The first application after which the check fails (None if even the
        full replay passes, i.e. the failure is not reproducible)."""
        lo, hi, failing = 1, n, None
        while lo <= hi:
            mid = (lo + hi) // 2
            gm, driver = self.run(limit=mid)
            report = verdict(gm)
            if report.ok:
                lo = mid + 1
            else:
                failing, hi = (mid, report, driver), mid - 1
        if failing is None:
            return None
        k, report, driver = failing
        rule_name, node_name = driver.history[k - 1]
        before, _ = self.run(limit=k - 1, sync=False)
        node = next((n for n in before.graph.nodes if n.name == node_name), None)
        return Rejection(rule_name, node_name, self.ruleset.rules[rule_name].location, _source_of(node), report)


def _source_of(node: fx.Node | None) -> str:
    """The model source line a node came from (its stack trace's last frame outside
    torch: fx's tracer records its own frames after the model's), or the module path
    it was called in (a trace of torch's frames only, as export records for a model
    defined in ``exec``'d source, names torch's ``linear.py``: the path says more)."""
    if node is None:
        return ""
    trace = node.meta.get("stack_trace")
    if trace:
        # (dynamo's traces mark the expression under the line: ^^^^ or ~~~^^^)
        lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip().strip("^~")]
        frames = [(i, ln) for i, ln in enumerate(lines) if ln.startswith("File ")]
        own = [(i, ln) for i, ln in frames if _TORCH_DIR not in ln]
        if not own and not node.meta.get("nn_module_stack"):
            own = frames  # torch's frames only: better than nothing
        if own:
            i, frame = own[-1]
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            return frame + (f": {code}" if code else "")
    stack = node.meta.get("nn_module_stack")
    if stack:
        path, _ = list(stack.values())[-1]
        return f"module {path}"
    return f"{node.op} {getattr(node.target, '__name__', node.target)}"


#: where torch's own frames come from, left out of a node's source line
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _keyword_only_inputs(model: Any) -> tuple:
    """Inputs ``model`` takes by keyword only: a forward's required keyword-only
    parameters, or a ``torch.export`` module's keyword inputs (its pytree input spec)."""
    if isinstance(model, fx.GraphModule):
        info = getattr(model.graph._codegen, "pytree_info", None)
        spec = getattr(info, "in_spec", None)
        try:  # (args, kwargs): the keys of the kwargs dict
            if spec is None or spec.num_children != 2:
                return ()
            kwargs = spec.child(1) if hasattr(spec, "child") else spec.children_specs[1]
            return tuple(kwargs.context)
        except (AttributeError, IndexError, TypeError):
            return ()
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty)


def _can_check(gm: fx.GraphModule, example_inputs: tuple | None) -> bool:
    """Inputs for the check can be made: given, or described by placeholder metadata."""
    if example_inputs is not None:
        return True
    keys = ("val", "tensor_meta", "example_value")
    return all(any(k in n.meta for k in keys) for n in gm.graph.nodes if n.op == "placeholder")


def _referenced_attrs(gm: fx.GraphModule) -> set:
    graph = gm.graph
    return {n.target for op in ("get_attr", "call_module") for n in graph.find_nodes(op=op, sort=False)}


def _remove_unused(gm: fx.GraphModule, released_nodes: list, released_targets: set) -> None:
    """Erase the get_attr nodes the rewrite left without readers, then delete the
    parameters, buffers and submodules it left unreferenced (only ones whose last
    reference it erased: the cost follows the rewrite, not the graph). A submodule
    something is deleted from is first replaced in ``gm`` by a copy
    (``own_module_path``): in place, ``gm``'s submodules may be the eager model's own
    objects (``symbolic_trace`` shares them); in a copy, one module may stand at two
    paths (``gm.b = gm.a``), and the other path, still called, keeps what it holds."""
    targets = set(released_targets)
    for node in released_nodes:
        if not node._erased and not node.users:
            targets.add(node.target)
            gm.graph.erase_node(node)
    if not targets:
        return
    # what the input fetched and never read, of a module the rewrite released from
    # (export fetches a batch norm's num_batches_tracked): it goes with the module
    owners = {str(t).rpartition(".")[0] for t in targets}
    for node in gm.graph.find_nodes(op="get_attr", sort=False):
        if not node.users and str(node.target).rpartition(".")[0] in owners and "." in str(node.target):
            targets.add(node.target)
            gm.graph.erase_node(node)
    now = _referenced_attrs(gm)
    if not targets - now:
        return
    # a name still in use, one under it (``a`` of ``a.b``) or one over it (``a.b`` of
    # ``a``) stays: by dotted prefix, not by comparing every pair (amp releases
    # thousands of weights while thousands stay referenced)
    owned: set = set()  # copies own_module_path made
    used_or_under = set(now)
    for r in now:
        parts = r.split(".")
        used_or_under.update(".".join(parts[:i]) for i in range(1, len(parts)))
    for name in sorted(targets - now, key=len, reverse=True):
        parts = name.split(".")
        if name in used_or_under or any(".".join(parts[:i]) in now for i in range(1, len(parts))):
            continue
        owner_name, _, attr = name.rpartition(".")
        try:
            owner = gm.get_submodule(owner_name) if owner_name else gm
        except AttributeError:
            continue
        if attr in owner._parameters or attr in owner._buffers or attr in owner._modules:
            if owner_name:
                owner = own_module_path(gm, owner_name, owned)
                if owner is None:
                    continue  # inside a subgraph module: left as it is
            delattr(owner, attr)
            _delete_emptied_owners(gm, owner_name, used_or_under)


def _delete_emptied_owners(gm: fx.GraphModule, name: str, used_or_under: set) -> None:
    """Delete the module ``name`` and then its owners, up to the first one that is
    referenced, holds something still or is ``gm``: containers the rewrite emptied
    (export's ``layer1.0`` of folded weights). ``name`` itself, which the rewrite
    just deleted a tensor from, goes while it holds only tensors nothing reads: a
    conv whose call an earlier rewrite replaced, its bias folded now, would stay
    with its weight and without the bias its ``repr`` reads. A submodule the graph
    never called (a head the caller attached) stays."""
    first = True
    while name and name not in used_or_under:
        owner_name, _, attr = name.rpartition(".")
        try:
            module = gm.get_submodule(name)
            owner = gm.get_submodule(owner_name) if owner_name else gm
        except AttributeError:
            return
        tables = (module._modules,) if first else (module._parameters, module._buffers, module._modules)
        if any(v is not None for table in tables for v in table.values()):
            return
        delattr(owner, attr)
        name, first = owner_name, False


def rules_dir() -> Path:
    """The shipped rule libraries (``fusion.rw``, ``cleanup.rw``, ...)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_rules", here.parent / "rules"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError("the shipped rules directory is missing")


def _resolve_path(p: Any) -> str:
    """A rule file path; a relative one that does not exist here may name a shipped
    file: ``fusion.rw``, ``rules/fusion.rw``, ``quant/observe.rw``, ``rules/quant/observe.rw``."""
    path = Path(p)
    try:
        here = path.exists()
    except (ValueError, OSError, UnicodeError):  # NUL bytes, lone surrogates: load says so (E402)
        return str(path)
    if not here and not path.is_absolute():
        parts = path.parts[1:] if path.parts[:1] == ("rules",) else path.parts
        shipped = rules_dir().joinpath(*parts) if parts and ".." not in parts else None
        if shipped is not None and shipped.is_file():
            return str(shipped)
    return str(path)


def load(*paths: Any) -> RuleSet:
    """Load and compile rule files.

    Args:
        paths: one or more ``.rw`` files (or one iterable of them). A name such as
            ``"rules/fusion.rw"``, ``"fusion.rw"`` or ``"quant/observe.rw"`` that does
            not exist relative to the working directory is looked up among the
            shipped rule libraries.

    Returns:
        A RuleSet running every rule of the files to a fixpoint (or the file's
        ``ruleset main`` if it declares one).

    Raises:
        rewrite.RuleError: with ``file:line:col`` diagnostics for any error.
    """
    if len(paths) == 1 and not isinstance(paths[0], (str, bytes, Path)) and isinstance(paths[0], Iterable):
        paths = tuple(paths[0])
    if not paths:
        raise TypeError("rewrite.load needs at least one rule file path")
    for p in paths:
        if not isinstance(p, (str, os.PathLike)):
            raise TypeError(f"rewrite.load takes rule file paths (str or os.PathLike), not {type(p).__name__}")
    resolved = [_resolve_path(p) for p in paths]
    program = load_program(resolved)
    return RuleSet.from_program(program, name="+".join(Path(p).stem for p in resolved))


def parse(text: str, path: str = "<string>") -> RuleSet:
    """Compile rules given as text (same language as rule files)."""
    if not isinstance(text, str):
        raise TypeError(f"rewrite.parse takes the rules as str, not {type(text).__name__}"
                        + (" (decode the bytes first)" if isinstance(text, bytes) else ""))
    if not isinstance(path, str) or any(c in path for c in "\n\r"):
        raise TypeError(f"rewrite.parse's path names the text in diagnostics: a one-line str, not {path!r}")
    # a byte-order mark, as a file read without "utf-8-sig" keeps it (``load`` drops it too)
    return RuleSet.from_program(load_program_text(text.removeprefix("\ufeff"), path), name=Path(path).stem)
