"""Rule sets: the public object users load, compose and apply.

Example::

    import rewrite
    rules = rewrite.load("rules/fusion.rw")
    result = rules.apply(graph_module, example_inputs=(x,))
    result.graph_module      # the rewritten torch.fx.GraphModule (a new object)
    result.counts            # {"conv_bn": 53, ...}

Rule sets are values: ``rewrite.load("rules/fusion.rw") + rewrite.load("rules/cleanup.rw")``
runs one after the other; ``rules["fusion"]`` selects a ``ruleset`` declared in the file.
"""

from __future__ import annotations

import copy
import time
import warnings
from pathlib import Path
from typing import Any, Iterable

import attrs
import torch
import torch.fx as fx

from rewrite.compile import compile_rule
from rewrite.driver import Driver
from rewrite.language import Program, ast, load_program, load_program_text
from rewrite.ops import detect_dialect

__all__ = ["RuleSet", "RewriteResult", "EquivalenceError", "load", "parse", "rules_dir"]


class EquivalenceError(AssertionError):
    """The rewritten graph does not compute what the original computes. The
    rewrite is not returned; ``report`` says which output diverged, ``counts``
    which rules fired."""

    def __init__(self, report: Any, counts: dict) -> None:
        fired = ", ".join(f"{name} x{n}" for name, n in sorted(counts.items())) or "none"
        super().__init__(f"rewrite changed the model's outputs: {report}; rules that fired: {fired}")
        self.report = report
        self.counts = counts


@attrs.frozen
class RewriteResult:
    """What ``RuleSet.apply`` returns.

    Attributes:
        graph_module: the rewritten GraphModule (the input is never modified).
        counts: rule name -> number of times it was applied.
        stats: rule name -> ``RuleStats`` (tries, applied, failed, seconds).
        equivalence: the randomized equivalence report, or None if not checked.
        seconds: wall time of the rewrite itself (without the check).
    """

    graph_module: fx.GraphModule
    counts: dict
    stats: dict
    equivalence: Any
    seconds: float

    @property
    def changed(self) -> bool:
        return bool(self.counts)

    def summary(self) -> str:
        """A table of per-rule counts and the equivalence verdict."""
        lines = [f"{'rule':<32} {'applied':>8} {'tries':>8}"]
        for name in sorted(self.stats):
            s = self.stats[name]
            lines.append(f"{name:<32} {s.applied:>8} {s.tries:>8}")
        lines.append(f"rewrites: {sum(self.counts.values())} in {self.seconds * 1e3:.1f} ms")
        if self.equivalence is not None:
            lines.append(f"equivalence: {self.equivalence}")
        return "\n".join(lines)


def _schedule_tuple(s: Any) -> Any:
    if isinstance(s, ast.ScheduleRef):
        return s.name
    return (s.kind, tuple(_schedule_tuple(i) for i in s.items))


class RuleSet:
    """Compiled rules plus a schedule. Build with ``rewrite.load`` / ``rewrite.parse``."""

    def __init__(self, rules: dict, sets: dict, schedule: Any, name: str = "") -> None:
        self.rules = rules  # name -> CompiledRule
        self.sets = sets  # ruleset name -> schedule tuple
        self.schedule = schedule
        self.name = name

    @classmethod
    def from_program(cls, program: Program, name: str = "") -> "RuleSet":
        families = dict(program.families)
        rules = {r.name: compile_rule(r, i, families) for i, r in enumerate(program.rules)}
        sets = {n: _schedule_tuple(s) for n, s in program.rulesets.items()}
        schedule = sets["main"] if "main" in sets else ("fixpoint", tuple(rules))
        return cls(rules, sets, schedule, name)

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
            return RuleSet(self.rules, self.sets, ("fixpoint", (name,)), name)
        raise KeyError(f"no rule or ruleset named {name!r}; have {sorted(self.sets) + sorted(self.rules)}")

    def __add__(self, other: "RuleSet") -> "RuleSet":
        """Run ``self`` then ``other``."""
        rules = dict(self.rules)
        for name, rule in other.rules.items():
            if name in rules and rules[name].rule != rule.rule:
                raise ValueError(f"both rule sets define a different rule named {name!r}")
            rules[name] = rule
        sets = {**self.sets, **other.sets}
        return RuleSet(rules, sets, ("seq", (self.schedule, other.schedule)), f"{self.name}+{other.name}")

    def _resolve(self, name: str) -> Any:
        if name in self.rules:
            return self.rules[name]
        return self.sets[name]

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
    ) -> RewriteResult:
        """Apply the rule set to a copy of ``model``.

        Args:
            model: a ``torch.fx.GraphModule`` (from symbolic_trace, torch.export's
                ``.module()``, or a dynamo backend), or an ``nn.Module``, which is
                captured with ``torch.fx.symbolic_trace``.
            example_inputs: inputs to the model; used for shape facts (when the
                graph has no ``meta['val']``) and for the equivalence check.
            check: compare original and rewritten outputs on random inputs shaped
                like ``example_inputs`` (trial 0 uses them as given).
            trials, rtol, atol: passed to the check (tolerances default by dtype).
            max_rewrites: bound on rewrites before ``NonTerminationError``.

        Returns:
            RewriteResult with ``graph_module`` and ``counts``.

        Raises:
            EquivalenceError: the rewritten graph diverged; nothing is returned.
            NonTerminationError: the rules never settled.
        """
        original = model if isinstance(model, fx.GraphModule) else fx.symbolic_trace(model)
        gm = copy.deepcopy(original)
        example_inputs = tuple(example_inputs) if example_inputs is not None else None
        referenced = _referenced_attrs(gm)
        start = time.perf_counter()
        driver = Driver(gm, detect_dialect(gm), max_rewrites, example_inputs)
        with torch.no_grad():
            driver.run(self.schedule, self._resolve)
        if driver.counts:
            _remove_unused(gm, referenced)
            gm.graph.lint()
            gm.recompile()
        seconds = time.perf_counter() - start
        report = None
        if check and driver.counts and not _can_check(original, example_inputs):
            warnings.warn(
                "rewrite: the equivalence check was skipped: pass example_inputs "
                "(the graph records no input shapes)",
                stacklevel=2,
            )
        elif check and driver.counts:
            from rewrite.check import check_equivalence

            report = check_equivalence(model, gm, example_inputs, trials=trials, rtol=rtol, atol=atol)
            if not report.ok:
                raise EquivalenceError(report, dict(driver.counts))
        return RewriteResult(gm, dict(driver.counts), dict(driver.stats), report, seconds)


def _can_check(gm: fx.GraphModule, example_inputs: tuple | None) -> bool:
    """Inputs for the check can be made: given, or described by placeholder metadata."""
    if example_inputs is not None:
        return True
    keys = ("val", "tensor_meta", "example_value")
    return all(any(k in n.meta for k in keys) for n in gm.graph.nodes if n.op == "placeholder")


def _referenced_attrs(gm: fx.GraphModule) -> set:
    return {n.target for n in gm.graph.nodes if n.op in ("get_attr", "call_module")}


def _remove_unused(gm: fx.GraphModule, referenced_before: set) -> None:
    """Erase unused get_attr nodes, then delete parameters, buffers and submodules the
    rewrite left unreferenced (only ones the graph referenced before)."""
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users and node.target in referenced_before:
            gm.graph.erase_node(node)
    now = _referenced_attrs(gm)
    for name in sorted(referenced_before - now, key=len, reverse=True):
        if any(r == name or r.startswith(name + ".") or name.startswith(r + ".") for r in now):
            continue
        owner_name, _, attr = name.rpartition(".")
        try:
            owner = gm.get_submodule(owner_name) if owner_name else gm
        except AttributeError:
            continue
        if attr in owner._parameters or attr in owner._buffers or attr in owner._modules:
            delattr(owner, attr)
    gm.delete_all_unused_submodules()


def rules_dir() -> Path:
    """The shipped rule libraries (``fusion.rw``, ``cleanup.rw``, ...)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_rules", here.parent / "rules"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError("the shipped rules directory is missing")


def _resolve_path(p: Any) -> str:
    path = Path(p)
    if not path.exists() and not path.is_absolute():
        shipped = rules_dir() / path.name if path.parent in (Path("."), Path("rules")) else None
        if shipped is not None and shipped.exists():
            return str(shipped)
    return str(path)


def load(*paths: Any) -> RuleSet:
    """Load and compile rule files.

    Args:
        paths: one or more ``.rw`` files (or one iterable of them). A name such as
            ``"rules/fusion.rw"`` or ``"fusion.rw"`` that does not exist relative to
            the working directory is looked up among the shipped rule libraries.

    Returns:
        A RuleSet running every rule of the files to a fixpoint (or the file's
        ``ruleset main`` if it declares one).

    Raises:
        rewrite.RuleError: with ``file:line:col`` diagnostics for any error.
    """
    if len(paths) == 1 and not isinstance(paths[0], (str, Path)) and isinstance(paths[0], Iterable):
        paths = tuple(paths[0])
    resolved = [_resolve_path(p) for p in paths]
    program = load_program(resolved)
    return RuleSet.from_program(program, name="+".join(Path(p).stem for p in resolved))


def parse(text: str, path: str = "<string>") -> RuleSet:
    """Compile rules given as text (same language as rule files)."""
    return RuleSet.from_program(load_program_text(text, path), name=Path(path).stem)
