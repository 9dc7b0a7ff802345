"""Rule verification: check each rule on random instances of its pattern before trusting it.

``apply`` checks a rewrite on the graph it rewrote; that says nothing about graphs the
rule has not met yet. Verification asks the rule itself: for many random instances
of its pattern (shapes, dtypes, attribute values, constants drawn by hypothesis), is
the rewritten instance equivalent to the original? A rule that is wrong anywhere in
its domain is rejected with the smallest instance hypothesis can shrink to, printed
Alive-style: the rule and its source position, the bindings, the original and the
rewritten graph with every node's value, expected vs got, the first diverging node.

Instances come from ``rewrite.trust.instances``: the pattern emitted with the vocabulary's
own emitters into a fresh graph (torch or aten spelling), shapes, attributes and
values drawn by per-op generators, ``const(...)`` variables as module constants, in
every dtype the ops accept (float32, float64, float16, bfloat16, int64, int32, int8,
uint8, bool; an op that rejects the dtype discards the instance), quantized tensors
made with torch's observers and rewritten under a drawn quantized engine. The first
instances are drawn one per dtype the rule admits (its where clause's favoured ones,
else every one), then one with an empty dim, a 0-d one, a non-contiguous one and a
large one (rank 5, a dim past 4), whatever hypothesis' adaptive state; then
hypothesis searches over every dtype for the rest of the budget, a tenth of the
shapes 0-d, a tenth empty where the ops take them and a tenth large (``rewrite.trust.instances``). Each
instance is rewritten by the rule alone (``ruleset[rule.name].apply(...,
check=False)``) and both graphs are run on the same inputs. ``max_examples`` counts
instances checked, the leading ones included (hypothesis' search checks at least two
more): discarded ones (not a program, or the where clause does not hold) are drawn
again, up to hypothesis' limit (three tries for a leading instance).

Verdicts, per rule:

* ``ok``: every instance on which the rule fired gave the same outputs, in the
  instance's dtype and, for approximate rules, again in float64;
* ``counterexample``: outputs differed, or the engine raised, or the rule did not
  terminate, or (on an instance with a non-contiguous input) a flattening ``view``
  of the rewritten result raised where the original's worked: the rule changes its
  result's layout, which a stride-dependent reader inside a graph sees (unless the
  rule's own file lowers such a view: ``_Checker._check_viewable``). Whatever the tolerance: shapes and dtypes must be equal (an integer
  output that became float is a mismatch), integer and bool outputs equal, and a
  value finite in the original must be finite in the rewritten graph (a rewrite that
  overflows to inf or makes a NaN is wrong however close the rest is). ``exact``
  rules: floats equal too, NaN = NaN and -0.0 = 0.0 (so ``x + 0 => x`` is exact),
  quantized outputs with the same parameters and integer values. ``approx`` rules:
  ``rewrite.trust.check.TOLERANCES`` at the lowest precision either graph computes in; a
  rewrite computing in a narrower float than its inputs (a cast to float16) is also
  compared with the original run on inputs and constants rounded to that float, so it
  may lose what that float cannot hold, never overflow; on instances of large
  magnitude (float32/64) and about a large offset (``OFFSET_DRAWS``), within that
  tolerance of the original or of the exact answer (the original in float64), or at
  most twice as far from it as the original is; a graph that rounds through
  int8 values is held to one quantization step (quantized outputs at most one step
  apart, float outputs within one scale);
* ``did not fire``: the rule did not fire on an instance even with its where
  clause removed: its pattern does not match a graph built from its own ops (or
  its replacement could not be built, on any quantized engine);
* ``intentional``: the rule is declared an intentional change (``change=True``): it
  changes what the model computes on purpose, so there is no equivalence to verify;
* ``skipped``: no generator for an op of the pattern, or no instance satisfied the
  where clause (instances violating it are discarded, not failures), or on every
  instance it matched its replacement was the very call it matched (no rewrite: an
  instance that exercises nothing is discarded too). A skipped rule
  is an unverified rule: ``VerificationReport.ok`` is False, and ``rewrite check
  --verify`` fails unless ``--allow-skipped``.

Tolerance: the rule's ``tolerance`` option; unset, a rule whose replacement computes
rewrite-time constants (folds) is ``approx``, every other rule ``exact``.

Example::

    report = rewrite.trust.verify.verify_rules(rewrite.load("rules/cleanup.rw"))
    print(report.table())
    assert report.ok, report

Needs ``hypothesis`` (a test extra), imported on first use.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import tempfile
import warnings
from typing import Any

import attrs
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from rewrite.engine.compile import CompiledRule
from rewrite.engine.replace import UNLIKE_ROOT
from rewrite.trust.instances import (Instance, Plan, draw_instance, hypothesis_api, instances,
                                     plan_for, quantized_engines, rule_tolerance, strategies, trapping_division)
from rewrite.trust.check import check_equivalence
from rewrite.trust.nonfinite import NonFiniteCounter
from rewrite.trust.gradients import gradient_reach, moved, redrawn, touches_gradients
from rewrite.trust.rng import seeded
from rewrite.trust.tolerance import Tolerance, compare_tensors, loosest, newly_nonfinite

__all__ = [
    "RuleVerdict", "Counterexample", "VerificationReport", "Instance",
    "verify_rules", "verify_rule", "instances", "rule_tolerance", "WIDE_DRAWS", "EXACT_WIDE_DRAWS",
]


# ================================================================ results


@attrs.frozen
class Counterexample:
    """Why a rule was rejected, on the smallest instance found.

    Attributes:
        kind: ``"mismatch"``, ``"did not fire"``, ``"error"`` or ``"non-termination"``.
        message: one line saying what went wrong.
        bindings: ``(variable, value as text)`` pairs of the pattern.
        source, target: the instance graph and the rewritten graph, one node per
            line with its value.
        expected, got: the original and the rewritten output (text).
        diverging: the first diverging node, original vs rewritten.
    """

    rule: str
    location: str
    kind: str
    message: str
    dtype: str = ""
    dialect: str = ""
    bindings: tuple = ()
    source: str = ""
    target: str = ""
    expected: str = ""
    got: str = ""
    diverging: str = ""

    def __str__(self) -> str:
        lines = [f"{self.location}: rule {self.rule}: {self.kind}: {self.message}"]
        if self.dtype:
            lines.append(f"  instance ({self.dtype}, {self.dialect} graph):")
            lines += [f"    {name} = {value}" for name, value in self.bindings]
        if self.source:
            lines.append("  original:")
            lines += ["    " + line for line in self.source.splitlines()]
        if self.target:
            lines.append("  rewritten:")
            lines += ["    " + line for line in self.target.splitlines()]
        if self.diverging:
            lines.append(f"  first diverging node: {self.diverging}")
        if self.expected or self.got:
            lines.append(f"  expected: {self.expected}")
            lines.append(f"  got:      {self.got}")
        return "\n".join(lines)


@attrs.frozen
class RuleVerdict:
    """The verdict on one rule.

    Attributes:
        status: ``"ok"``, ``"counterexample"``, ``"did not fire"``, ``"skipped"``, or
            ``"intentional"`` (a rule declared ``change=True``: not verified, by design).
        tolerance: ``"exact"`` or ``"approx"``.
        checked: instances on which the rule fired and outputs were compared.
        generated: instances generated (including discarded ones).
        reason: why it was skipped (or a short summary); on ``ok``, what was not
            checked (an approximate rule's float64 recheck that could not run).
        counterexample: for the failing statuses.
    """

    rule: str
    location: str
    status: str
    tolerance: str = "exact"
    checked: int = 0
    generated: int = 0
    reason: str = ""
    counterexample: Counterexample | None = None

    @property
    def failed(self) -> bool:
        return self.status in ("counterexample", "did not fire")

    def __str__(self) -> str:
        if self.counterexample is not None:
            return str(self.counterexample)
        extra = f": {self.reason}" if self.reason else ""
        return f"{self.location}: rule {self.rule}: {self.status}{extra}"


@attrs.frozen
class VerificationReport:
    """One ``RuleVerdict`` per rule, in rule-set order."""

    verdicts: tuple

    @property
    def ok(self) -> bool:
        """Every rule verified: none has a counterexample or failed to fire, and none
        was skipped (a skipped rule is an unverified rule). ``ok_or_skipped`` accepts
        skipped ones."""
        return not self.failures and not self.skipped

    @property
    def ok_or_skipped(self) -> bool:
        """No rule has a counterexample or failed to fire (skipped ones may remain)."""
        return not self.failures

    @property
    def failures(self) -> tuple:
        """Verdicts that reject a rule: counterexample, did not fire."""
        return tuple(v for v in self.verdicts if v.failed)

    @property
    def skipped(self) -> tuple:
        """Rules no instance was checked for: no generator for an op, no valid instance,
        or no instance on which the where clause held."""
        return tuple(v for v in self.verdicts if v.status == "skipped")

    def __getitem__(self, name: str) -> RuleVerdict:
        for v in self.verdicts:
            if v.rule == name:
                return v
        raise KeyError(name)

    def table(self) -> str:
        """A fixed-width table: rule, verdict, tolerance, instances checked/generated, where."""
        width = max([len("rule")] + [len(v.rule) for v in self.verdicts])
        lines = [f"{'rule':<{width}}  {'verdict':<14}  {'tolerance':<9}  {'checked':>11}  where"]
        for v in self.verdicts:
            counts = f"{v.checked}/{v.generated}"
            lines.append(f"{v.rule:<{width}}  {v.status:<14}  {v.tolerance:<9}  {counts:>11}  {v.location}"
                         + (f"  ({v.reason})" if v.reason and v.status in ("skipped", "ok") else ""))
        n = collections.Counter(v.status for v in self.verdicts)
        lines.append(", ".join(f"{n[s]} {s}" for s in ("ok", "counterexample", "did not fire", "skipped", "intentional")
                               if n[s]))
        return "\n".join(lines)

    def __str__(self) -> str:
        parts = [self.table()] + [str(v) for v in self.failures]
        return "\n\n".join(parts)


# ================================================================ checking one instance


class _Failure(Exception):
    def __init__(self, counterexample: Counterexample) -> None:
        super().__init__(counterexample.message)
        self.counterexample = counterexample


class _Seen(dict):
    """Every node's value, and where the random generator ended (``rng_after``)."""

    rng_after: Any = None


class _Recorder(fx.Interpreter):
    """Runs a graph and keeps every node's value (for the counterexample)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.seen = _Seen()

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        self.seen[n] = out
        return out

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        trapping_division(args, kwargs)  # a trap would kill the process: an error instead
        return super().call_function(target, args, kwargs)

    def call_method(self, target: Any, args: tuple, kwargs: dict) -> Any:
        trapping_division(args, kwargs)
        return super().call_method(target, args, kwargs)


class _Widening(_Recorder):
    """Runs a graph in float64 throughout: every float dtype an op is given
    (``to(x, torch.bfloat16)``) is float64, ``x.half()`` keeps x, and every float
    value made is widened to float64; no cast rounds."""

    def run_node(self, n: fx.Node) -> Any:
        out = pytree.tree_map(_to_float64, fx.Interpreter.run_node(self, n))
        self.seen[n] = out
        return out

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        args, kwargs = pytree.tree_map(_float64_dtype, (args, kwargs))
        return super().call_function(target, args, kwargs)

    def call_method(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if target in ("half", "bfloat16", "float", "double") and not kwargs and len(args) == 1:
            return args[0]
        args, kwargs = pytree.tree_map(_float64_dtype, (args, kwargs))
        return super().call_method(target, args, kwargs)


def _to_float64(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.dtype.is_floating_point and v.dtype != torch.float64:
        return v.to(torch.float64)
    return v


def _lowest_cast(gm: fx.GraphModule) -> torch.dtype | None:
    """The least precise float a graph casts to or holds a constant in (None: float64)."""
    found = [v for n in gm.graph.nodes for v in pytree.tree_leaves((n.args, n.kwargs))
             if isinstance(v, torch.dtype) and v.is_floating_point]
    found += [{"half": torch.float16, "bfloat16": torch.bfloat16}[n.target] for n in gm.graph.nodes
              if n.op == "call_method" and n.target in ("half", "bfloat16")]
    found += [t.dtype for t in [*gm.parameters(), *gm.buffers()] if t.dtype.is_floating_point and not t.is_quantized]
    low = max(found, key=lambda d: torch.finfo(d).eps, default=None)
    return None if low in (None, torch.float64) else low


def _float64_dtype(v: Any) -> Any:
    return torch.float64 if isinstance(v, torch.dtype) and v.is_floating_point else v


def _run(gm: fx.GraphModule, inputs: tuple, widen: bool = False) -> tuple:
    rec = (_Widening if widen else _Recorder)(gm)
    with torch.no_grad(), seeded(0):
        out = rec.run(*[t.clone() if isinstance(t, torch.Tensor) else t for t in inputs])
        rec.seen.rng_after = torch.default_generator.get_state()
    return out, rec.seen


def _counted_run(gm: fx.GraphModule, inputs: tuple) -> tuple:
    """``_run``, and how many of its op calls turn finite values into inf or NaN."""
    counter = NonFiniteCounter()
    with counter:
        out, seen = _run(gm, inputs)
    return out, seen, sum(counter.births.values())


def _strided_input(inst: Instance) -> bool:
    """Some input tensor of the instance is laid out otherwise than contiguously."""
    return any(isinstance(t, torch.Tensor) and not t.is_quantized and t.numel() > 1 and not t.is_contiguous()
               for t in inst.example_inputs)


_CLONES = (torch.clone, torch.ops.aten.clone.default)
#: instances per rule whose gradient paths are compared (``_Checker._compare_gradient_paths``)
_PATH_INSTANCES = 2


def _viewed(inst: Instance) -> Instance | None:
    """The instance with each contiguous tensor output of two or more elements read
    by a flattening ``view`` (as a reader inside a bigger graph would); None when
    there is none. The view reads the rule's result itself, not the ``clone`` the
    instance returns (a copy keeps the layout, and the clone is a reader the engine
    looks through: ``layout_change_seen``)."""
    try:
        outputs, _ = _run(inst.graph_module, inst.example_inputs)
    except Exception:  # noqa: BLE001
        return None
    gm = copy.deepcopy(inst.graph_module)
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    leaves, spec = pytree.tree_flatten(out_node.args[0])
    values = pytree.tree_leaves(outputs)
    if len(values) != len(leaves):
        return None
    viewed = False
    with gm.graph.inserting_before(out_node):
        for i, (leaf, value) in enumerate(zip(leaves, values)):
            if (isinstance(leaf, fx.Node) and isinstance(value, torch.Tensor) and not value.is_quantized
                    and value.layout == torch.strided and value.numel() > 1 and value.dim() > 1
                    and value.is_contiguous()):
                read = leaf.args[0] if leaf.target in _CLONES and isinstance(leaf.args[0], fx.Node) else leaf
                leaves[i] = (gm.graph.call_function(torch.ops.aten.view.default, (read, [-1]))
                             if inst.dialect == "aten" else gm.graph.call_method("view", (read, -1)))
                viewed = True
    if not viewed:
        return None
    out_node.args = (pytree.tree_unflatten(leaves, spec),)
    for node in list(gm.graph.nodes):
        if node.target in _CLONES and not node.users:
            gm.graph.erase_node(node)  # the copy the view now bypasses: no second reader of the result
    gm.recompile()
    return attrs.evolve(inst, graph_module=gm)


def _one_rule(ruleset: Any, rule: CompiledRule, without_where: bool = False) -> Any:
    return ruleset.only(attrs.evolve(rule, where=None) if without_where else rule.name)


def _fires(ruleset: Any, gm: fx.GraphModule, inputs: tuple, max_rewrites: int | None = None) -> Any:
    return ruleset.apply(gm, inputs, check=False, max_rewrites=max_rewrites)


def _output_moves(gm: fx.GraphModule, inputs: tuple, position: int, path: str) -> bool:
    """Whether the floating output at ``path`` of ``gm`` changes when input
    ``position`` is drawn again (its value depends on it); True when it cannot tell."""
    other = redrawn(inputs[position], 0)
    if other is None:
        return True
    shifted = (*inputs[:position], other, *inputs[position + 1:])
    try:
        before, after = _run(gm, tuple(inputs))[0], _run(gm, shifted)[0]
    except Exception:  # noqa: BLE001 - cannot tell
        return True

    def leaf(out: Any) -> Any:
        return {pytree.keystr(kp): v for kp, v in pytree.tree_flatten_with_path(out)[0]}.get(path)

    return moved(leaf(before), leaf(after))


class _Checker:
    """Checks instances of one rule; counts what happened."""

    def __init__(self, ruleset: Any, plan: Plan) -> None:
        self.plan, self.rule = plan, plan.rule
        self.whole = ruleset
        self.one = _one_rule(ruleset, plan.rule)
        self.probe = _one_rule(ruleset, plan.rule, without_where=True)
        self.counts: collections.Counter = collections.Counter()
        self.last_discard = ""
        self.where_error = ""  # the first error a where clause's function raised (a user's predicate)

    def check(self, inst: Instance | str) -> None:
        self.counts["generated"] += 1
        if isinstance(inst, str):
            self.counts["invalid"] += 1
            self.last_discard = inst
            return
        with warnings.catch_warnings(), _engine(inst.engine):
            warnings.simplefilter("ignore")  # torch's observers and kernels warn on every call
            self._check(inst)

    def _check(self, inst: Instance) -> None:
        result = self._apply(self.one, inst)
        if not result.counts:
            stats = result.stats.get(self.rule.name)
            if stats is not None and stats.unchanged and not stats.failed:
                # its replacement is the call it matched: the graph as it was, which
                # exercises nothing (a rule changing a layer norm's eps meets only the
                # eps it writes): not an instance; none at all is a skipped rule
                self.counts["unchanged"] += 1
                return
            if stats is not None and stats.failed and inst.wide:
                # declining large values (a constant float16 cannot hold) is sound
                self.counts["invalid"] += 1
                self.last_discard = "its replacement declined the large values drawn"
                return
            if stats is not None and stats.failed and self._other_engine(inst):
                return
            if stats is not None and stats.failed and UNLIKE_ROOT in stats.first_error:
                raise _Failure(self._cex(inst, "mismatch", stats.first_error.split(UNLIKE_ROOT, 1)[1].join(
                    ("its replacement is not the matched value: ", ""))))
            if stats is not None and stats.failed:
                why = stats.first_error.split(": ", 1)[-1] if stats.first_error else ""
                raise _Failure(self._cex(inst, "did not fire", f"its replacement failed to build "
                                                              f"({stats.failed}x) where the rule matched"
                                                              + (f": {why}" if why else "")))
            if stats is not None and stats.first_error.startswith("where clause: ") and not self.where_error:
                self.where_error = stats.first_error
            if self._matches(self.probe, inst):
                self.counts["filtered"] += 1  # the where clause does not hold here
                return
            raise _Failure(self._cex(inst, "did not fire", "its pattern does not match an instance built "
                                                           "from its own ops, even without the where clause"))
        if inst.wide:
            if self._no_new_nonfinite(inst, result.graph_module):
                self.counts["checked"] += 1
            return
        if inst.offset:
            if self._compare_offset(inst, result.graph_module):
                self.counts["checked"] += 1
            return
        if not self._compare(inst, result.graph_module, inst.example_inputs, self.plan.tolerance):
            return
        if touches_gradients(self.rule):
            self._compare_gradients(inst, result.graph_module)
        elif self.counts["paths"] < _PATH_INSTANCES:
            self._compare_gradient_paths(inst, result.graph_module)
        if _strided_input(inst):
            self._check_viewable(inst)
        if self.plan.tolerance == "approx" and inst.dtype != torch.float64:
            self._check_float64(inst, result.graph_module)
        self.counts["checked"] += 1

    def _check_viewable(self, inst: Instance) -> None:
        """Inside a graph, the rule's result is read by ops that depend on its strides,
        which the layout restore of outputs does not reach: where the original's
        result can be ``view``-ed flat, the rewritten one must be too
        (``contiguous(x) => clone(x)`` keeps a transposed ``x`` transposed, and a
        ``.view(-1)`` after it raises). Unless the rule's own file makes it so: the
        AMP files lower such a view to a ``reshape``."""
        probe = _viewed(inst)
        if probe is None:
            return
        try:
            _run(probe.graph_module, probe.example_inputs)
        except Exception:  # noqa: BLE001 - the original cannot be viewed either
            return
        problem = None
        for ruleset in (self.one, self.whole):
            result = self._apply(ruleset, probe, quiet=True)
            if result is None or self.rule.name not in result.counts:
                return  # it does not fire before a view: nothing to tell
            try:
                _run(result.graph_module, probe.example_inputs)
                return
            except Exception as err:  # noqa: BLE001
                strides = ", ".join(f"{t.stride()}" for t in probe.example_inputs
                                    if isinstance(t, torch.Tensor) and not t.is_contiguous())
                problem = (f"a view of its result raised {type(err).__name__}: {str(err).splitlines()[0]} "
                           f"(on inputs of strides {strides}, the replacement lays its result out "
                           f"otherwise than the original: a reader inside a graph that depends on "
                           f"strides, such as view, fails where it worked)")
                rewritten = result.graph_module
        raise _Failure(self._cex(probe, "error", problem, rewritten))

    def _compare_gradients(self, inst: Instance, rewritten: fx.GraphModule) -> None:
        """A rule naming an op whose gradient its forward values do not tell
        (``GRADIENT_OPS``: a stop-gradient, a rounding, an embedding's
        ``padding_idx``) is compared on one backward pass too, as ``apply`` does."""
        report = check_equivalence(inst.graph_module, rewritten, inst.example_inputs, trials=1,
                                   tolerance=self.plan.tolerance, gradients=True)
        # gradients that differ where both reach (a quantizer's rewrite may leave an
        # output no gradient at all: what inference-only rules such as convert.rw's do)
        mismatch = report.first_mismatch if not report.ok else None
        if mismatch is not None and mismatch.path.startswith("gradient"):
            raise _Failure(self._cex(inst, "mismatch", f"{mismatch.path}: {mismatch.message}", rewritten))

    def _compare_gradient_paths(self, inst: Instance, rewritten: fx.GraphModule) -> None:
        """Which outputs a gradient reaches from which inputs (``gradient_reach``), on
        the first instances with a floating input: a rule that keeps every value and
        cuts the path (``x.view(torch.int32).view(torch.float32)``) leaves a model being
        trained through it without gradients. Only where gradients flow, never their
        values (a rewrite's gradient may differ where the op is not differentiable)."""
        if not any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in inst.example_inputs):
            return
        ref = gradient_reach(inst.graph_module, inst.example_inputs)
        got = gradient_reach(rewritten, inst.example_inputs)
        if ref is None or got is None or len(ref) != len(got):
            return
        self.counts["paths"] += 1
        for leaf, ((path, needs, reached), (_, got_needs, got_reached)) in enumerate(zip(ref, got)):
            lost, gained = reached - got_reached, got_reached - reached
            if needs and got_needs:  # a lost path that carried zeros (the unused half of a stack) is no loss
                lost = {k for k in lost if _output_moves(rewritten, inst.example_inputs, k, path)}
            if needs == got_needs and not lost and not gained:
                continue
            where = f"output{path}"
            if needs != got_needs:
                problem = f"{where} requires grad in the {'original' if needs else 'rewrite'} only"
            else:
                which = sorted(lost or gained)[0]
                problem = (f"a gradient from {where} reaches input {which} in the "
                           f"{'original' if lost else 'rewrite'} only")
            raise _Failure(self._cex(inst, "mismatch", problem + " (floating inputs requiring grad, as a "
                                     "trained model's activations do; every value is the same)", rewritten))

    def _other_engine(self, inst: Instance) -> bool:
        """The replacement failed to build on the instance's quantized engine but
        builds on another (onednn's fused conv + add): not an instance for this one."""
        if inst.engine is None:
            return False
        for other in quantized_engines():
            if other != inst.engine:
                with _engine(other):
                    if self._apply(self.one, inst, quiet=True) is not None:
                        self.counts["invalid"] += 1
                        self.last_discard = f"its replacement builds on the {other} engine only"
                        return True
        return False

    def _matches(self, ruleset: Any, inst: Instance) -> bool:
        """Whether the (where-less) rule matched: it fired, its replacement failed, or
        its replacement was the call it matched (``softmax(x, d) => softmax(x, -1)``
        where d is -1). One rewrite tells: without its where clause a rule may never settle."""
        try:
            result = _fires(ruleset, inst.graph_module, inst.example_inputs, max_rewrites=1)
        except Exception:  # noqa: BLE001 - the probe only classifies
            return True
        stats = result.stats.get(self.rule.name)
        return bool(result.counts) or bool(stats is not None and (stats.failed or stats.unchanged))

    def _apply(self, ruleset: Any, inst: Instance, quiet: bool = False) -> Any:
        from rewrite.engine.driver import NonTerminationError

        try:
            result = _fires(ruleset, inst.graph_module, inst.example_inputs)
        except NonTerminationError as err:
            if quiet:
                return None
            raise _Failure(self._cex(inst, "non-termination", str(err))) from None
        except Exception as err:  # noqa: BLE001 - an engine error on a valid instance is a finding
            if quiet:
                return None
            raise _Failure(self._cex(inst, "error", f"{type(err).__name__}: {err}")) from None
        if quiet:
            return result if result.counts else None
        return result

    def _check_float64(self, inst: Instance, rewritten: fx.GraphModule) -> None:
        """Approximate rules again in float64, where rounding cannot hide a wrong
        formula. A rule that does not fire there (a where clause pins the dtype:
        ``dtype(x) == torch.float32``) has what it rewrote to, ``rewritten``, run in
        float64 instead, with every float value widened to float64 as it is made,
        the original's too (``_compare_widened``)."""
        if not all(not isinstance(t, torch.Tensor) or t.dtype.is_floating_point for t in inst.example_inputs):
            return
        gm = copy.deepcopy(inst.graph_module).to(torch.float64)
        inputs = tuple(t.to(torch.float64) if isinstance(t, torch.Tensor) else t for t in inst.example_inputs)
        inst64 = attrs.evolve(inst, graph_module=gm, example_inputs=inputs, dtype=torch.float64,
                              bindings={k: v.to(torch.float64) if isinstance(v, torch.Tensor)
                                        and v.dtype.is_floating_point else v for k, v in inst.bindings.items()})
        result = self._apply(self.one, inst64, quiet=True)
        if result is not None:
            self._compare(inst64, result.graph_module, inputs, "approx")
            return
        widened = copy.deepcopy(rewritten).to(torch.float64)
        try:
            got, _ = _run(widened, inputs)
            wanted, _ = _run(gm, inputs)
            dtypes = [getattr(t, "dtype", None) for t in pytree.tree_leaves(got)]
            same = dtypes == [getattr(t, "dtype", None) for t in pytree.tree_leaves(wanted)]
        except Exception:  # noqa: BLE001 - its replacement computes in a dtype of its own
            same = False
        # both run with every float widened to float64 as it is made: the original's
        # own casts (``to(y, torch.float32)`` in ``rms_norm(to(y, float32))``) widened
        # too, or an op whose default depends on its dtype (rms_norm's eps=None is
        # float32's epsilon there, float64's in the replacement) differs by design
        self._compare_widened(inst64, widened, inputs, None if same else _lowest_cast(rewritten))

    def _compare_widened(self, inst: Instance, rewritten: fx.GraphModule, inputs: tuple,
                         narrow: torch.dtype | None) -> None:
        """Both graphs in float64 with every float value widened to float64 as it is
        made, so the replacement's own casts (``to(x, torch.bfloat16)``) round nothing
        and cannot hide a wrong formula behind their rounding error. Inputs and the
        original's constants are rounded to ``narrow`` first, as the replacement's
        folded constants (``w_cast``) already are."""
        original = inst.graph_module
        if narrow is not None:
            inputs = tuple(_round_to(t, narrow) for t in inputs)
            original = _rounded_copy(original, narrow)
        try:
            ref, ref_seen = _run(original, inputs, widen=True)
            got, got_seen = _run(rewritten, inputs, widen=True)
        except Exception:  # noqa: BLE001 - ops that take no float64 (quantized kernels)
            self.counts["float64 unchecked"] += 1
            return
        seen = [*ref_seen.values(), *got_seen.values()]
        problem = _overflow(ref, got) or _differ(ref, got, "approx", torch.float64, _quantum(seen))
        if problem is not None:
            problem += " (in float64, the replacement's own casts widened to float64)"
            cex = self._cex(inst, "mismatch", problem, rewritten, ref_seen, got_seen)
            raise _Failure(attrs.evolve(cex, expected=_show(ref, full=True), got=_show(got, full=True)))

    def _both_runs(self, inst: Instance, rewritten: fx.GraphModule, inputs: tuple, run: Any) -> tuple | None:
        """``(run(original), run(rewritten))`` on ``inputs``; None (counted as not an
        instance) when the original raises, ``_Failure`` when only the rewrite does."""
        try:
            ref = run(inst.graph_module, inputs)
        except Exception:  # noqa: BLE001 - values outside the ops' domain: not an instance
            self.counts["invalid"] += 1
            self.last_discard = "the original graph raised on its inputs"
            return None
        try:
            return ref, run(rewritten, inputs)
        except Exception as err:  # noqa: BLE001
            raise _Failure(self._cex(inst, "error", f"the rewritten graph raised {type(err).__name__}: {err}",
                                     rewritten)) from None

    def _no_new_nonfinite(self, inst: Instance, rewritten: fx.GraphModule) -> bool:
        """A wide instance (large magnitudes): raise ``_Failure`` when the rewrite
        makes inf or NaN where the original's output is finite; False when the
        original cannot run on it. Values are not compared: large operands amplify
        a legitimate rounding difference past any tolerance."""
        runs = self._both_runs(inst, rewritten, inst.example_inputs, _counted_run)
        if runs is None:
            return False
        (ref, ref_seen, ref_births), (got, got_seen, got_births) = runs
        problem = _overflow(ref, got)
        seen = [*ref_seen.values(), *got_seen.values()]
        if problem is None and got_births > ref_births:
            # an inf the rewrite made inside (x * x in float16) and absorbed after
            # (rsqrt(inf) = 0) shows as a wrong value: judged by the tolerance then
            # (where nothing overflowed, large operands only amplify rounding)
            problem = _differ(ref, got, "approx", _lowest_precision(seen), _quantum(seen))
            if problem is not None:
                problem += "; an intermediate value overflowed"
        elif problem is None and _lowest_precision(seen) in _WIDE_COMPARED and _all_finite(ref):
            # in single and double precision, values too: a rule wrong past 4 only
            # (``relu(x) => hardtanh(x, 0, 6)``) is wrong at 32; large operands may
            # amplify rounding, so the rewrite is held to the exact answer as well
            problem = self._less_accurate(inst, ref, got, seen)
            if problem is not None:
                cex = self._cex(inst, "mismatch", problem + " (operands of large magnitude, where the rewrite "
                                "computes another value)", rewritten, ref_seen, got_seen)
                raise _Failure(attrs.evolve(cex, expected=_show(ref, full=True), got=_show(got, full=True)))
        if problem is not None:
            cex = self._cex(inst, "mismatch", problem + " (operands of large magnitude: the rewrite overflows "
                            "where the original does not)", rewritten, ref_seen, got_seen)
            raise _Failure(attrs.evolve(cex, expected=_show(ref, full=True), got=_show(got, full=True)))
        return True

    def _compare_offset(self, inst: Instance, rewritten: fx.GraphModule) -> bool:
        """An offset instance (floats drawn about a large value): the rewrite must
        agree with the original within the tolerance, or be at most twice as far
        from the exact answer (the original run in float64) as the original is. A
        formula that cancels there (a variance as ``E[x^2] - E[x]^2``) fails, one
        more accurate than the original (a written-out variance made a kernel)
        passes. False (not an instance) where the original's own output is not
        finite: the values left its domain."""
        runs = self._both_runs(inst, rewritten, inst.example_inputs, _run)
        if runs is None:
            return False
        (ref, ref_seen), (got, got_seen) = runs
        problem = _overflow(ref, got)
        if problem is not None and self.plan.rule.rule.option("assumes_range", False):
            # the values a rule declared ``assumes_range=True`` casts must fit (autocast's
            # contract): an offset past its narrow float is not an instance of it
            self.counts["invalid"] += 1
            self.last_discard = "the values drawn about a large offset do not fit the range the rule assumes"
            return False
        if problem is None and not _all_finite(ref):
            self.counts["invalid"] += 1
            self.last_discard = "the original's output is not finite on values drawn about a large offset"
            return False
        seen = [*ref_seen.values(), *got_seen.values()]
        if problem is None:
            problem = self._less_accurate(inst, ref, got, seen)
        if problem is not None:
            problem += " (inputs drawn about a large value, not about zero: the rewrite loses accuracy there)"
            cex = self._cex(inst, "mismatch", problem, rewritten, ref_seen, got_seen)
            raise _Failure(attrs.evolve(cex, expected=_show(ref, full=True), got=_show(got, full=True)))
        return True

    def _less_accurate(self, inst: Instance, ref: Any, got: Any, seen: list) -> str | None:
        """Why ``got`` (the rewrite's outputs) is wrong where ``ref`` (the original's)
        is not within the rule's tolerance of it, or None: it is within tolerance of the exact
        answer (the original run in float64), or at most twice as far from it as the
        original is (``_no_less_accurate``). For values drawn far from zero, where
        either may lose digits the other keeps."""
        low = _lowest_precision(seen)
        problem = _differ(ref, got, self.plan.tolerance, low, _quantum(seen))
        if problem is None or problem.startswith("output structure"):
            return problem
        try:
            exact = _run(inst.graph_module, inst.example_inputs, widen=True)[0]
        except Exception:  # noqa: BLE001 - no float64 reference: the comparison stands
            return problem
        return None if _no_less_accurate(ref, got, exact, low) else problem

    def _compare(self, inst: Instance, rewritten: fx.GraphModule, inputs: tuple, tolerance: str) -> bool:
        """Raise ``_Failure`` when the outputs differ; False when the original itself
        cannot run on the inputs (not an instance after all)."""
        runs = self._both_runs(inst, rewritten, inputs, _run)
        if runs is None:
            return False
        (ref, ref_seen), (got, got_seen) = runs
        if not torch.equal(ref_seen.rng_after, got_seen.rng_after):  # as apply's check: the caller's next draw
            raise _Failure(self._cex(inst, "mismatch", "random stream: the rewrite draws other random numbers than "
                                     "the original (from the same seed, the generator ends elsewhere: the "
                                     "caller's next torch.rand would differ)", rewritten, ref_seen, got_seen))
        seen = [*ref_seen.values(), *got_seen.values()]
        problem = _overflow(ref, got) or _differ(ref, got, tolerance, _lowest_precision(seen), _quantum(seen))
        if problem is not None and tolerance == "approx" and not problem.startswith("output structure"):
            # a rewrite that computes in a narrower float (a cast to float16) may lose
            # what that float cannot hold of its inputs: compare it with the original
            # run on inputs and constants rounded to it as well (never an overflow:
            # that was decided against the original above)
            narrow = _narrowest(seen)
            rounded = _run_rounded(inst.graph_module, inputs, narrow) if narrow is not None else None
            if (rounded is not None and not _overflow(ref, got)
                    and _differ(rounded, got, tolerance, _lowest_precision(seen), _quantum(seen)) is None):
                problem = None
        if problem is not None:
            cex = self._cex(inst, "mismatch", problem, rewritten, ref_seen, got_seen)
            raise _Failure(attrs.evolve(cex, expected=_show(ref, full=True), got=_show(got, full=True)))
        return True

    def _cex(self, inst: Instance, kind: str, message: str, rewritten: fx.GraphModule | None = None,
             ref_seen: dict | None = None, got_seen: dict | None = None) -> Counterexample:
        if ref_seen is None:
            try:
                ref_seen = _run(inst.graph_module, inst.example_inputs)[1]
            except Exception:  # noqa: BLE001
                ref_seen = {}
        return Counterexample(
            rule=self.rule.name, location=self.rule.location, kind=kind, message=message,
            dtype=str(inst.dtype).replace("torch.", ""), dialect=inst.dialect,
            bindings=tuple((k, _show(v)) for k, v in inst.bindings.items()),
            source=_listing(inst.graph_module, ref_seen),
            target=_listing(rewritten, got_seen or {}) if rewritten is not None else "",
            diverging=_diverging(inst.graph_module, rewritten) if rewritten is not None and got_seen else "",
        )


@contextlib.contextmanager
def _engine(name: str | None) -> Any:
    """Rewrite and run with this quantized engine (prepacked weights are engine's own)."""
    if name is None or name == torch.backends.quantized.engine:
        yield
        return
    old = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = old


def _lowest_precision(values: list) -> torch.dtype:
    """The floating dtype with the loosest tolerance among the values computed."""
    dtypes = {t.dtype for v in values for t in pytree.tree_leaves(v)
              if isinstance(t, torch.Tensor) and t.dtype.is_floating_point}
    return loosest(dtypes) or torch.float64


def _narrowest(values: list) -> torch.dtype | None:
    """The floating dtype of least precision among the values computed, when some
    other value computed has more (else None: nothing was rounded to it)."""
    dtypes = {t.dtype for v in values for t in pytree.tree_leaves(v)
              if isinstance(t, torch.Tensor) and not t.is_quantized and t.dtype.is_floating_point}
    if len(dtypes) < 2:
        return None
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def _round_to(t: Any, dtype: torch.dtype) -> Any:
    if (isinstance(t, torch.Tensor) and not t.is_quantized and t.dtype.is_floating_point
            and torch.finfo(t.dtype).eps < torch.finfo(dtype).eps):
        return t.detach().to(dtype).to(t.dtype)
    return t


def _rounded_copy(gm: fx.GraphModule, dtype: torch.dtype) -> fx.GraphModule:
    """A copy of ``gm`` whose float constants are rounded to ``dtype`` (and back)."""
    rounded = copy.deepcopy(gm)
    with torch.no_grad():
        for t in [*rounded.parameters(), *rounded.buffers()]:
            if t.dtype.is_floating_point and not t.is_quantized:
                t.copy_(_round_to(t, dtype))
    return rounded


def _run_rounded(gm: fx.GraphModule, inputs: tuple, dtype: torch.dtype) -> Any:
    """The graph's outputs on inputs and constants rounded to ``dtype`` (and back)."""
    try:
        return _run(_rounded_copy(gm, dtype), tuple(_round_to(t, dtype) for t in inputs))[0]
    except Exception:  # noqa: BLE001 - no rounded reference: the comparison stands
        return None


def _overflow(ref: Any, got: Any) -> str | None:
    """A value finite in ``ref`` and inf or NaN in ``got``: wrong whatever the tolerance."""
    for i, (r, g) in enumerate(zip(pytree.tree_leaves(ref), pytree.tree_leaves(got))):
        if isinstance(r, torch.Tensor) and isinstance(g, torch.Tensor) and g.is_floating_point():
            problem = newly_nonfinite(r, g)
            if problem is not None:
                return f"output {i}: {problem.message}"
    return None


def _all_finite(out: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in pytree.tree_leaves(out)
               if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and not t.is_quantized)


def _no_less_accurate(ref: Any, got: Any, exact: Any, low: torch.dtype) -> bool:
    """Whether ``got`` is, output by output, within tolerance of ``exact`` (the
    original run in float64) or at most twice as far from it as ``ref`` (the
    original in its own precision) is: a rewrite may be as inexact as the original,
    not more."""
    for r, g, e in zip(pytree.tree_leaves(ref), pytree.tree_leaves(got), pytree.tree_leaves(exact)):
        if not isinstance(g, torch.Tensor) or not g.is_floating_point() or g.is_quantized:
            continue
        if not isinstance(e, torch.Tensor) or e.shape != g.shape:
            return False
        if _differ(e.to(g.dtype), g, "approx", low) is None:
            continue
        exact64 = e.to(torch.float64)
        if float((g.to(torch.float64) - exact64).abs().max()) > 2 * float((r.to(torch.float64) - exact64).abs().max()):
            return False
    return True


def _quantum(values: list) -> float:
    """The largest step (scale) of a per-tensor quantized value computed: the
    precision of a graph that rounds through int8 (0.0 when none does)."""
    scales = [t.q_scale() for v in values for t in pytree.tree_leaves(v)
              if isinstance(t, torch.Tensor) and t.is_quantized
              and t.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric)]
    return max(scales, default=0.0)


def _differ(ref: Any, got: Any, tolerance: str, low: torch.dtype, quantum: float = 0.0) -> str | None:
    """None when ``got`` equals ``ref`` (exact) or is within tolerance (approx), by
    ``rewrite.trust.tolerance``: exact rules bit for bit (NaN = NaN, -0.0 = 0.0),
    approximate ones within ``TOLERANCES`` at dtype ``low`` scaled by each output's
    largest value, or within one ``quantum`` when a graph rounds through int8 values
    of that step (a float op moved onto int8 values rounds its result to their grid).
    Structure, shapes and dtypes must match; integers are compared exactly."""
    ref_leaves, ref_spec = pytree.tree_flatten(ref)
    got_leaves, got_spec = pytree.tree_flatten(got)
    if ref_spec != got_spec:
        return f"output structure differs: {ref_spec} vs {got_spec}"
    tol = Tolerance.bitwise() if tolerance == "exact" else Tolerance.of(low, "approx", floor=1.0, quantum=quantum)
    for i, (r, g) in enumerate(zip(ref_leaves, got_leaves)):
        if not isinstance(r, torch.Tensor):
            if r != g:
                return f"output {i}: expected {r!r}, got {g!r}"
            continue
        if not isinstance(g, torch.Tensor) or g.shape != r.shape or g.dtype != r.dtype:
            return f"output {i}: expected {_meta(r)}, got {_meta(g)}"
        _, _, problem = compare_tensors(r, g, tol)
        if problem is not None:
            return f"output {i}: {problem.message}"
    return None


# ---------------------------------------------------------------- printing


def _dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def _meta(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
    return type(v).__name__


def _show(v: Any, full: bool = False) -> str:
    """A value as text: small tensors in full, larger ones summarized."""
    if isinstance(v, torch.Tensor) and v.is_quantized:
        if v.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            params = f"scale {v.q_scale():.6g}, zero point {v.q_zero_point()}"
        else:
            params = f"per channel on dim {v.q_per_channel_axis()}"
        return f"{_show(v.int_repr(), full)} ({params})".replace(
            _dtype_name(v.int_repr().dtype), _dtype_name(v.dtype), 1)
    if isinstance(v, torch.Tensor):
        limit = 64 if full else 16
        if v.numel() <= limit:
            data = v.detach().to(torch.float64 if v.dtype.is_floating_point else torch.int64).tolist()
            return f"{_meta(v)} {_round(data)}"
        f = v.detach().to(torch.float64)
        return f"{_meta(v)} (min {float(f.min()):.4g}, max {float(f.max()):.4g}, mean {float(f.mean()):.4g})"
    if isinstance(v, fx.Node):
        return f"%{v.name}"
    if isinstance(v, (list, tuple)) and any(isinstance(i, (torch.Tensor, fx.Node)) for i in v):
        return "[" + ", ".join(_show(i) for i in v) + "]"
    return repr(v)


def _round(data: Any) -> Any:
    if isinstance(data, list):
        return "[" + ", ".join(str(_round(d)) for d in data) + "]"
    if isinstance(data, float):
        return f"{data:.6g}"
    return data


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):  # by its namespace: aten's, a library's (mylib.twice)
        namespace, _, name = target._schema.name.rpartition("::")
        return f"{namespace or 'aten'}.{name}.{target._overloadname}"
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target))
    if module.startswith("torch.nn.functional"):
        return f"F.{name}"
    if name.startswith("_VariableFunctionsClass."):
        return f"torch.{name.split('.')[-1]}"
    if "TensorBase." in name:
        return f"Tensor.{name.split('.')[-1]}"
    if module in ("_operator", "operator"):
        return f"operator.{name}"
    return f"{module}.{name}" if module and module not in ("torch", "torch._C") else f"torch.{name}"


def _format_node(n: fx.Node) -> str:
    args = [_show(a) for a in n.args] + [f"{k}={_show(v)}" for k, v in n.kwargs.items()]
    if n.op == "placeholder":
        return f"%{n.name} = input"
    if n.op == "get_attr":
        return f"%{n.name} = constant {n.target}"
    if n.op == "output":
        return f"return {', '.join(args)}"
    return f"%{n.name} = {_target_name(n.target)}({', '.join(args)})"


def _listing(gm: fx.GraphModule, seen: dict) -> str:
    """The graph, one node per line, with each computed value."""
    lines = []
    for n in gm.graph.nodes:
        text = _format_node(n)
        if n.op != "output" and n in seen:
            text = f"{text:<48}  # {_show(seen[n])}"
        lines.append(text)
    return "\n".join(lines)


def _diverging(original: fx.GraphModule, rewritten: fx.GraphModule) -> str:
    """The node that computes the diverging output in each graph."""
    def producer(gm: fx.GraphModule) -> Any:
        out = next(n for n in gm.graph.nodes if n.op == "output")
        first = pytree.tree_leaves(out.args[0])
        return first[0] if first else None

    a, b = producer(original), producer(rewritten)
    if not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
        return ""
    return f"rewritten {_format_node(b)}  vs  original {_format_node(a)}"


# ================================================================ entry points


def _settings(max_examples: int) -> Any:
    hyp = hypothesis_api()
    return hyp.settings(max_examples=max_examples, deadline=None, database=None,
                        suppress_health_check=list(hyp.HealthCheck), verbosity=hyp.Verbosity.quiet,
                        report_multiple_bugs=False)


def verify_rule(ruleset: Any, rule: CompiledRule | str, *, max_examples: int = 100, seed: int = 0) -> RuleVerdict:
    """Verify one rule of ``ruleset`` on random instances of its pattern.

    Args:
        ruleset: the ``RuleSet`` the rule belongs to.
        rule: the compiled rule or its name.
        max_examples: instances checked (discarded ones are drawn again, up to
            hypothesis' limit on rejected examples).
        seed: for reproducible runs.

    Returns:
        A ``RuleVerdict`` (``ok``, ``counterexample``, ``did not fire``, ``skipped``).
    """
    with _private_hypothesis_home():
        return _verify_rule(ruleset, rule, max_examples, seed)


@contextlib.contextmanager
def _private_hypothesis_home() -> Any:
    """Hypothesis's storage (its cache of the constants in the code it runs, kept
    even with ``database=None``) in a temporary folder while the block runs: verify
    writes nothing into the caller's working directory."""
    hypothesis_api()
    import hypothesis.configuration as configuration

    before = getattr(configuration, "__hypothesis_home_directory", None)
    with tempfile.TemporaryDirectory(prefix="rewrite-verify-") as home:
        configuration.set_hypothesis_home_dir(home)
        try:
            yield
        finally:
            configuration.set_hypothesis_home_dir(before)


def _verify_rule(ruleset: Any, rule: CompiledRule | str, max_examples: int, seed: int) -> RuleVerdict:
    hyp, st = hypothesis_api(), strategies()
    if isinstance(rule, str):
        rule = ruleset.rules[rule]
    plan = plan_for(rule)
    verdict = {"rule": rule.name, "location": rule.location, "tolerance": plan.tolerance}
    if rule.rule.option("change", False):
        return RuleVerdict(status="intentional", reason="declared an intentional change (change=True): "
                                                        "not an equivalence to verify", **verdict)
    if plan.unsupported:
        return RuleVerdict(status="skipped", reason=plan.unsupported, **verdict)
    checker = _Checker(ruleset, plan)
    failures: list = []

    def search(p: Plan, n: int, shapes: str | None = None, leading: bool = False, salt: Any = None,
               wide: float = 0.0, offset: float = 0.0) -> None:
        """Check ``n`` instances of plan ``p`` (hypothesis draws and shrinks them).
        A leading search wants one random instance (not hypothesis' all-simplest
        first one) and gives up after a few discarded draws; ``salt`` varies its
        seed (each dtype gets other shapes and values); ``wide``: instances of
        that magnitude (``Instance.wide``); ``offset``: instances drawn about that
        value (``Instance.offset``)."""
        tries = [0]

        @_settings(n)
        @hyp.seed(seed if salt is None else f"{seed}/{salt}")
        @hyp.given(st.data())
        def run(data: Any) -> None:
            if leading:
                hyp.assume(data.draw(st.booleans()))  # False: the all-simplest draw
            inst = data.draw(st.composite(lambda draw: draw_instance(draw, p, shapes=shapes, wide=wide,
                                                                            offset=offset))())
            if leading:  # (after drawing as every call does: hypothesis checks that)
                if tries[0] >= (_WIDE_TRIES if wide or offset else _LEADING_TRIES) and not failures:
                    raise _GiveUp()
                tries[0] += 1
            checked = checker.counts["checked"]
            try:
                checker.check(inst)
            except _Failure as f:
                failures.append(f.counterexample)
                raise
            # a discarded instance (not a program, or the where clause does not hold)
            # does not count: hypothesis draws another, up to its limit on rejections
            hyp.assume(checker.counts["checked"] > checked)

        try:
            run()
        except _GiveUp:
            pass
        except hyp.errors.Unsatisfiable:  # all discarded: skipped below, unless another search checks one
            pass

    try:
        # Leading instances, one per dtype the rule admits, then one with an empty
        # dim, a 0-d one, a non-contiguous one, a large one and a long one, in the dtypes that made an
        # instance: whatever hypothesis' adaptive state (which depends on what ran
        # before in the process), every dtype and these shapes are met.
        valid = []
        for dtype in plan.favoured or plan.dtypes:
            before = checker.counts["checked"]
            search(attrs.evolve(plan, dtypes=(dtype,), favoured=()), 1, shapes="mixed", leading=True,
                   salt=str(dtype))
            if checker.counts["checked"] > before:
                valid.append(dtype)
        shaped = ([(m, valid[i % len(valid)]) for i, m in enumerate(("empty", "scalar", "strided", "large", "long"))]
                  if valid else [])
        for shapes, dtype in shaped:
            search(attrs.evolve(plan, dtypes=(dtype,), favoured=()), 1, shapes=shapes, leading=True, salt=shapes)
        # then hypothesis' own search over every dtype, for the rest of the budget
        search(plan, max(max_examples - checker.counts["checked"], min(max_examples, 2)), shapes="mixed")
        # large magnitudes too, one instance each (an approximate rule in half
        # precision as well; an exact one also meets infinities and the largest values)
        # (an exact rule's in long shapes: many values, so that a window it is wrong
        # in, past 4 and short of where it is right again, is met)
        for scale, dtype in _wide_draws(plan):
            search(attrs.evolve(plan, dtypes=(dtype,), favoured=()), 1, leading=True,
                   salt=f"wide {scale:g} {dtype}", wide=scale, shapes="long" if plan.tolerance == "exact" else None)
        # and values about a large offset, where a formula that cancels loses its digits
        for offset, dtype in _offset_draws(plan):
            search(attrs.evolve(plan, dtypes=(dtype,), favoured=()), 1, leading=True,
                   salt=f"offset {offset:g} {dtype}", offset=offset)
    except _Failure as f:
        return _failed(verdict, checker, f.counterexample)
    except Exception as err:  # noqa: BLE001 - flaky replays and the like: report the last failure
        if failures:
            return _failed(verdict, checker, failures[-1])
        cex = Counterexample(rule.name, rule.location, "error", f"{type(err).__name__}: {err}")
        return _failed(verdict, checker, cex)
    counts = checker.counts
    if counts["checked"] == 0 and counts["unchanged"]:
        why = (f"its replacement rebuilt the call it matched on every instance it fired on ({counts['unchanged']}): "
               "no instance exercised the rewrite")
        return RuleVerdict(status="skipped", reason=why, generated=counts["generated"], **verdict)
    if counts["checked"] == 0:
        why = (f"no valid instance in {counts['generated']}: {checker.last_discard}" if not counts["filtered"]
               else f"the where clause held on none of {counts['filtered']} instances"
               + (f" ({counts['invalid']} more were no valid instance: {checker.last_discard})"
                  if counts["invalid"] else "")
               + (f"; its {checker.where_error}" if checker.where_error else ""))
        return RuleVerdict(status="skipped", reason=why, generated=counts["generated"], **verdict)
    # an approximate rule whose float64 recheck could not run (quantized kernels take no
    # float64) was checked at its own precision only: the verdict says so
    note = (f"float64 recheck not run on {counts['float64 unchecked']} of {counts['checked']} instances"
            if counts["float64 unchecked"] else "")
    return RuleVerdict(status="ok", checked=counts["checked"], generated=counts["generated"], reason=note,
                       **verdict)


def _wide_draws(plan: Plan) -> tuple:
    """(magnitude, dtype) of a rule's wide instances: for an approximate rule
    ``WIDE_DRAWS``, in float16 and bfloat16 too, which an approximate rule's
    ordinary instances do not draw (``plan_for``): a rewrite that squares a float16
    value overflows past 256 where the original's kernel computes in float32; for
    an exact rule ``EXACT_WIDE_DRAWS`` (its ordinary instances stay within [-4, 4]
    but for infinities and the largest values: ``where(x > 4, x, silu(x))`` for
    ``silu(x)`` is wrong from 4 to about 20 and right at both). A where clause
    that pins dtypes (``dtype(x) == torch.float32``) gets those instead. None for a
    quantized rule (quantized kernels clamp to their grid), nor for one declared
    ``assumes_range=True`` (a lowering to float16 that relies on autocast's
    contract: the values it casts fit)."""
    if plan.quantized or plan.rule.rule.option("assumes_range", False):
        return ()
    draws = list(WIDE_DRAWS if plan.tolerance == "approx" else EXACT_WIDE_DRAWS)
    pinned = [d for d in plan.favoured if d.is_floating_point]
    if plan.favoured:
        draws = [(scale, pinned[i % len(pinned)]) for i, (scale, _) in enumerate(draws)] if pinned else []
    return tuple(dict.fromkeys(draws))


def _offset_draws(plan: Plan) -> tuple:
    """(offset, dtype) of an approximate rule's offset instances (``OFFSET_DRAWS``),
    in the float dtypes a where clause pins, else in float32. None for an exact
    rule (bit for bit wherever it is drawn) or a quantized one (its kernels clamp
    to their grid). A rule declared ``assumes_range=True`` is drawn too: only
    instances whose values fit its narrow float count."""
    if plan.tolerance != "approx" or plan.quantized:
        return ()
    pinned = [d for d in plan.favoured if d.is_floating_point]
    if plan.favoured and not pinned:
        return ()
    return tuple((OFFSET_DRAWS[d], d) for d in dict.fromkeys(pinned or [torch.float32]) if d in OFFSET_DRAWS)


class _GiveUp(BaseException):
    """A leading search found no instance in its few tries (the dtype does not fit
    the ops, or the where clause). A BaseException: hypothesis lets it through."""


#: (magnitude, dtype) of an approximate rule's wide instances, whose float tensors'
#: ranges ([-4, 4] for most ops) are scaled by the magnitude (at most to a quarter of
#: the dtype's largest value): float32's exp overflows past 88 ([-128, 128] at 32), a
#: float16 round trip past 65504 (1e5), float16's exp past 11 (4), its x * x past 256
WIDE_DRAWS = ((32.0, torch.float32), (1e3, torch.float32), (1e5, torch.float32), (4.0, torch.float16),
               (1e3, torch.float16), (3e4, torch.bfloat16))

#: (magnitude, dtype) of an exact rule's wide instances: past the [-4, 4] its
#: ordinary instances draw, short of the largest values they meet as specials; in
#: float32, where values are compared too (``_WIDE_COMPARED``)
EXACT_WIDE_DRAWS = ((4.0, torch.float32), (32.0, torch.float32), (1e3, torch.float32))

#: dtype -> the value an approximate rule's offset instance draws its floats about:
#: their spread ([-4, 4]) is then a few ten-thousandths of their magnitude in float32
#: (a few ten-millionths in float64), where ``E[x^2] - E[x]^2`` keeps no correct digit
OFFSET_DRAWS = {torch.float32: 1e4, torch.float64: 1e8, torch.float16: 1e2, torch.bfloat16: 1e2}

#: the precisions whose wide instances have their values compared too (not only
#: new inf and NaN): in half precision, rounding at large magnitudes is the
#: tolerance's size
_WIDE_COMPARED = (torch.float32, torch.float64)

#: draws a leading search (one per dtype, then the shaped ones) makes before it gives up
_LEADING_TRIES = 3
#: and a wide one: its dtype is one the rule was not tried in yet, its where clause
#: may hold rarely (``is_number(e) and last_dim(x, s)``), and it is the only look at
#: large magnitudes
_WIDE_TRIES = 12


def _failed(verdict: dict, checker: _Checker, cex: Counterexample) -> RuleVerdict:
    status = "did not fire" if cex.kind == "did not fire" else "counterexample"
    return RuleVerdict(status=status, checked=checker.counts["checked"], generated=checker.counts["generated"],
                       reason=cex.message, counterexample=cex, **verdict)


def verify_rules(ruleset: Any, *, max_examples: int = 100, seed: int = 0,
                 names: Any = None) -> VerificationReport:
    """Verify every rule of ``ruleset`` (or those in ``names``) before trusting it.

    Args:
        ruleset: a ``RuleSet`` (``rewrite.load(...)``).
        max_examples: instances checked per rule.
        seed: for reproducible runs.
        names: optional rule names to verify.

    Returns:
        A ``VerificationReport``: ``report.ok``, ``report.table()``, ``report.failures``.

    Example::

        report = verify_rules(rewrite.load("rules/fusion.rw"), max_examples=50)
        print(report)
    """
    if isinstance(max_examples, bool) or not isinstance(max_examples, int) or max_examples < 1:
        raise ValueError(f"max_examples must be a positive int, not {max_examples!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, not {seed!r}")
    if names is not None:
        names = [names] if isinstance(names, str) else list(names)
        unknown = [n for n in names if n not in {r.name for r in ruleset}]
        if unknown:
            raise ValueError(f"no rule named {', '.join(map(repr, unknown))} in this rule set; it has "
                             f"{', '.join(r.name for r in ruleset)}")
    verdicts = [verify_rule(ruleset, r, max_examples=max_examples, seed=seed)
                for r in ruleset if names is None or r.name in names]
    return VerificationReport(tuple(verdicts))
