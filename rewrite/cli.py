"""The ``rewrite`` command line: thin over the Python API.

    rewrite check rules/*.rw                      # exit 1 on any error, file:line:col
    rewrite apply rules/fusion.rw --model rewrite.examples.cnn:demo_cnn_with_inputs
    rewrite explain rules/fusion.rw [--model M --capture export]

Exit codes: 0 clean, 1 findings (rule errors, a failed equivalence check), 2 bad
usage or an internal error.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import sys
from typing import Any, Sequence

__all__ = ["main"]


def _load(paths: Sequence[str]) -> Any:
    import rewrite

    return rewrite.load(*paths)


def _cmd_check(args: argparse.Namespace) -> int:
    from rewrite.language import RuleError

    failed = 0
    for path in args.files:
        try:
            rules = _load([path])
        except RuleError as err:
            print(str(err), file=sys.stderr)
            failed += 1
            continue
        except FileNotFoundError as err:
            print(f"{path}: error: {err}", file=sys.stderr)
            failed += 1
            continue
        if not args.quiet:
            print(f"{path}: ok ({len(rules)} rules)")
    return 1 if failed else 0


def _load_model(spec: str) -> tuple:
    """``package.module:callable`` -> (model, example_inputs)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not attr:
        raise SystemExit(f"rewrite: error: --model wants 'module:callable', got {spec!r}")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise SystemExit(f"rewrite: error: cannot load {spec!r}: {err}") from None
    built = factory()
    if not (isinstance(built, tuple) and len(built) == 2):
        raise SystemExit(f"rewrite: error: {spec} must return (model, example_inputs)")
    model, inputs = built
    return model.eval(), tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _capture(model: Any, inputs: tuple, level: str) -> Any:
    import torch

    if level == "fx":
        return torch.fx.symbolic_trace(model)
    return torch.export.export(model, inputs, strict=False).module()


def _op_histogram(gm: Any) -> collections.Counter:
    from rewrite.ops import bind_node

    hist: collections.Counter = collections.Counter()
    for node in gm.graph.nodes:
        if node.op.startswith("call_"):
            ops = {b.op for b in bind_node(node, gm)} or {str(getattr(node.target, "__name__", node.target))}
            hist[sorted(ops)[0]] += 1
    return hist


def _print_changes(before: Any, after: Any) -> None:
    hb, ha = _op_histogram(before), _op_histogram(after)
    rows = [(op, hb[op], ha[op]) for op in sorted(set(hb) | set(ha)) if hb[op] != ha[op]]
    if not rows:
        print("graph unchanged")
        return
    print(f"{'op':<28} {'before':>7} {'after':>7}")
    for op, b, a in rows:
        print(f"{op:<28} {b:>7} {a:>7}")
    print(f"{'ops in total':<28} {sum(hb.values()):>7} {sum(ha.values()):>7}")


def _save(gm: Any, path: str) -> None:
    """torch.save a GraphModule. fx cannot pickle string type annotations on
    placeholders (``x: "torch.Tensor"`` under postponed annotations): drop them."""
    import torch

    for node in gm.graph.nodes:
        if isinstance(node.type, str):
            node.type = None
    gm.recompile()
    torch.save(gm, path)


def _cmd_apply(args: argparse.Namespace) -> int:
    import torch

    import rewrite

    rules = _load(args.rules)
    if args.ruleset:
        rules = rules[args.ruleset]
    model, inputs = _load_model(args.model)
    if args.capture == "dynamo":
        results = []
        compiled = torch.compile(model, backend=rewrite.backend(rules, check=not args.no_check, on_result=results.append))
        with torch.no_grad():
            compiled(*inputs)
        for i, result in enumerate(results):
            print(f"-- dynamo graph {i}")
            print(result.summary())
        return 0
    gm = _capture(model, inputs, args.capture)
    try:
        result = rules.apply(gm, example_inputs=inputs, check=not args.no_check, trials=args.trials)
    except rewrite.EquivalenceError as err:
        print(f"rewrite: error: {err}", file=sys.stderr)
        return 1
    print(result.summary())
    print()
    _print_changes(gm, result.graph_module)
    if args.save:
        _save(result.graph_module, args.save)
        print(f"saved the rewritten GraphModule to {args.save}")
    if args.print_code:
        print(result.graph_module.code)
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    rules = _load(args.rules)
    if (args.rule or args.node) and args.model:
        model, inputs = _load_model(args.model)
        gm = _capture(model, inputs, args.capture)
        explanations = rules.explain(gm, rule=args.rule, node=args.node, example_inputs=inputs)
        for e in explanations:
            print(e)
        if not explanations:
            print("no near misses: the rule's root op occurs nowhere in the graph")
        return 0
    stats = {}
    if args.model:
        model, inputs = _load_model(args.model)
        gm = _capture(model, inputs, args.capture)
        stats = rules.apply(gm, example_inputs=inputs, check=False).stats
    for rule in rules:
        if args.rule and rule.name != args.rule:
            continue
        roots = ", ".join(sorted(rule.root_ops) or [str(k[1]) for k in rule.root_keys])
        print(f"{rule.location}: rule {rule.name} (priority {rule.priority}; root: {roots})")
        if rule.rule.doc:
            for line in rule.rule.doc.splitlines():
                print(f"    # {line}")
        if rule.name in stats:
            s = stats[rule.name]
            print(f"    tried at {s.tries} nodes, applied {s.applied}, failed {s.failed}, {s.seconds * 1e3:.2f} ms")
        elif args.model:
            print("    never tried: no node has its root op")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rewrite", description="Declarative rewrite rules for PyTorch graphs.")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("check", help="parse and check rule files; exit 1 on any error")
    c.add_argument("files", nargs="+")
    c.add_argument("-q", "--quiet", action="store_true")
    c.set_defaults(fn=_cmd_check)

    a = sub.add_parser("apply", help="apply rule files to a model and report what changed")
    a.add_argument("rules", nargs="+", help="rule files (.rw)")
    a.add_argument("--model", required=True, help="module:callable returning (model, example_inputs)")
    a.add_argument("--capture", choices=("fx", "export", "dynamo"), default="fx")
    a.add_argument("--ruleset", help="apply only this ruleset of the files")
    a.add_argument("--no-check", action="store_true", help="skip the equivalence check")
    a.add_argument("--trials", type=int, default=3)
    a.add_argument("--save", help="torch.save the rewritten GraphModule here")
    a.add_argument("--print-code", action="store_true", help="print the rewritten graph's code")
    a.set_defaults(fn=_cmd_apply)

    e = sub.add_parser(
        "explain",
        help="list rules with per-rule statistics on a model; with --rule/--node, say why a rule "
        "does not fire (the deepest partial match, or the near misses across the graph)",
    )
    e.add_argument("rules", nargs="+")
    e.add_argument("--rule", help="only this rule")
    e.add_argument("--node", help="explain at this node (by name) of the captured graph")
    e.add_argument("--model", help="module:callable returning (model, example_inputs)")
    e.add_argument("--capture", choices=("fx", "export"), default="fx")
    e.set_defaults(fn=_cmd_explain)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rewrite`` console script and ``python -m rewrite``."""
    args = _parser().parse_args(argv)
    from rewrite.language import RuleError

    try:
        return args.fn(args)
    except RuleError as err:
        print(str(err), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 2
    except SystemExit:
        raise
    except Exception as err:  # noqa: BLE001 - report, do not dump a traceback on users
        print(f"rewrite: internal error: {type(err).__name__}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
