"""The ``rewrite`` command line: thin over the Python API.

    rewrite check rules/*.rw                      # exit 1 on any error, file:line:col
    rewrite check --verify rules/*.rw             # and verify every rule on random instances
                                                  # (exit 1 on a counterexample or a skipped rule)
    rewrite fmt [--check | --write] rules/*.rw    # print, check or rewrite in canonical form
    rewrite apply rules/fusion.rw --model rewrite.examples.cnn:demo_cnn_with_inputs
    rewrite explain rules/fusion.rw [--model M --capture export]
    rewrite stats --model M [--capture export] [--by module|op] [--json]
    rewrite show --model M [--rules rules/fusion.rw] -o graph.svg|graph.html

Exit codes: 0 clean, 1 findings (rule errors, a failed equivalence check), 2 bad
usage or an internal error.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import math
import sys
from typing import Any, Sequence

from rewrite.arguments import non_negative_int, positive_int
from rewrite.language.diagnostics import printable

__all__ = ["main"]


def _load(paths: Sequence[str]) -> Any:
    import rewrite

    return rewrite.load(*paths)


def _cmd_check(args: argparse.Namespace) -> int:
    from rewrite.language import RuleError

    failed, loaded = 0, []
    for path in args.files:
        try:
            rules = _load([path])
        except RuleError as err:
            print(str(err), file=sys.stderr)
            failed += 1
            continue
        except FileNotFoundError as err:
            print(printable(f"{path}: error: {err}"), file=sys.stderr)
            failed += 1
            continue
        if not args.quiet:
            print(printable(f"{path}: ok ({len(rules)} rules)"))
        loaded.append(rules)
    if args.verify and loaded:
        try:
            failed += _verify(loaded, args.max_examples, args.seed, args.allow_skipped)
        except ImportError as err:  # hypothesis is a test extra
            print(f"rewrite: error: --verify: {err}", file=sys.stderr)
            return 2
    return 1 if failed else 0


def _verify(rulesets: list, max_examples: int, seed: int, allow_skipped: bool = False) -> int:
    """Verify every rule once (a rule imported by two files is verified once; a
    parametrized file's rules once per instantiation: ``amp/policy.rw`` with
    ``lowp = torch.bfloat16`` and with ``torch.float16`` are two rules); print
    the verdict table and each counterexample. Returns the number of failed rules:
    skipped ones too (an unverified rule), unless ``allow_skipped``. Intentional
    changes (``change=True``) are listed, not verified."""
    from rewrite.trust.verify import VerificationReport, verify_rule

    from rewrite.analysis.progress import progress

    verdicts, seen = [], set()
    bar = progress(sum(len(r) for r in rulesets), "verify", unit="rule")  # on a terminal only
    for rules in rulesets:
        for rule in rules:
            bar.update(1)
            key = (rule.location, rule.rule)  # the rule as written, parameters substituted
            if key not in seen:
                seen.add(key)
                verdicts.append(verify_rule(rules, rule, max_examples=max_examples, seed=seed))
    bar.close()
    report = VerificationReport(tuple(verdicts))
    print()
    print(report.table())
    failed = 0
    for verdict in report.failures:
        print()
        print(verdict)
        failed += 1
    if allow_skipped:
        return failed
    for verdict in report.skipped:
        print()
        print(f"{verdict} (unverified: fails the check; --allow-skipped accepts it)")
    return failed + len(report.skipped)


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


def _cmd_apply(args: argparse.Namespace) -> int:
    import torch

    import rewrite
    from rewrite.capture import save, save_path_problem
    from rewrite.trust.runnable import load_runnable_model

    rules = _load(args.rules)
    if args.ruleset:
        rules = _pick(rules, args.ruleset)
    problem = args.save and save_path_problem(args.save, args.capture)
    if problem:  # refused before any work, as a usage error
        print(f"rewrite: error: --save {args.save}: {problem}", file=sys.stderr)
        return 2
    if args.report and args.capture == "dynamo":
        print("rewrite: error: --report needs --capture fx or export (dynamo rewrites its graphs inside "
              "torch.compile): use rewrite stats --capture dynamo for the figures", file=sys.stderr)
        return 2
    model, inputs = load_runnable_model(args.model)
    if args.capture == "dynamo":
        results = []
        compiled = torch.compile(model, backend=rewrite.backend(
            rules, check=not args.no_check, on_result=results.append, trials=args.trials, rtol=args.rtol,
            atol=args.atol))
        try:
            with torch.no_grad():
                compiled(*inputs)
        except Exception as err:  # noqa: BLE001 - dynamo wraps what the backend raised
            inner = _raised_by_backend(err)
            if not isinstance(inner, rewrite.EquivalenceError):
                raise inner from None
            print(f"rewrite: error: {inner}", file=sys.stderr)
            return 1
        for i, result in enumerate(results):
            print(f"-- dynamo graph {i}")
            print(result.summary())
            if args.print_code:
                print(result.graph_module.code)
        return 0
    gm = _captured_model(model, inputs, args.capture, args.model, _APPLY_CAPTURES)
    try:
        result = rules.apply(gm, example_inputs=inputs, check=not args.no_check, trials=args.trials,
                             rtol=args.rtol, atol=args.atol)
    except rewrite.EquivalenceError as err:
        print(f"rewrite: error: {err}", file=sys.stderr)
        return 1
    print(result.summary())
    print()
    if args.report:
        print(result.report().table())
    else:
        _print_changes(gm, result.graph_module)
    if args.save:
        saved = save(result.graph_module, args.save, args.capture, inputs)
        kind = "ExportedProgram (torch.export.load reads it)" if saved.suffix == ".pt2" else "GraphModule"
        print(f"saved the rewritten {kind} to {saved}")
    if args.print_code:
        print(result.graph_module.code)
    return 0


def _raised_by_backend(err: BaseException) -> BaseException:
    """What ``rewrite.backend`` raised inside ``torch.compile``, which dynamo hands
    on wrapped (``BackendCompilerFailed``, with advice to report a bug to PyTorch):
    a failed check is the user's finding, as under the other captures."""
    from torch._dynamo.exc import BackendCompilerFailed

    while isinstance(err, BackendCompilerFailed) and isinstance(err.inner_exception, BaseException):
        err = err.inner_exception
    return err


def _cmd_explain(args: argparse.Namespace) -> int:
    rules = _load(args.rules)
    if (args.rule or args.node) and args.model:
        gm, inputs = _captured(args.model, args.capture, levels=_EXPLAIN_CAPTURES)
        try:
            explanations = rules.explain(gm, rule=args.rule, node=args.node, example_inputs=inputs)
        except KeyError as err:  # --rule or --node names nothing: the user's input, not a bug
            print(f"rewrite: error: {err.args[0] if err.args else err}", file=sys.stderr)
            return 2
        for e in explanations:
            print(e)
        if not explanations:
            print("no near misses: the rule's root op occurs nowhere in the graph")
        return 0
    if args.rule and args.rule not in {rule.name for rule in rules}:
        print(f"rewrite: error: no rule named {args.rule!r}", file=sys.stderr)
        return 2
    stats = {}
    if args.model:
        gm, inputs = _captured(args.model, args.capture, levels=_EXPLAIN_CAPTURES)
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


# ---------------------------------------------------------------- fmt


def _cmd_fmt(args: argparse.Namespace) -> int:
    from rewrite.language import RuleError, format_source
    from rewrite.language.program import read_rule_file

    status = 0
    for path in args.files:
        try:
            text = read_rule_file(path)  # unreadable: E402, as check says it
            formatted = format_source(text, path)
        except RuleError as err:
            print(str(err), file=sys.stderr)
            status = 1
            continue
        if args.check:
            if formatted != text:
                print(printable(f"{path}: not formatted (run 'rewrite fmt --write {path}')"), file=sys.stderr)
                status = 1
        elif args.write:
            if formatted != text:
                with open(path, "w", encoding="utf-8") as fh:
                    fh.write(formatted)
                print(printable(f"{path}: formatted"))
        else:
            _write_text(formatted)
    return status


def _write_text(text: str) -> None:
    """``text`` on stdout; characters its encoding cannot hold (a legacy console's)
    escaped, not an internal error."""
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    try:
        text.encode(encoding)
    except (UnicodeEncodeError, LookupError):
        text = text.encode(encoding, errors="backslashreplace").decode(encoding)
    sys.stdout.write(text)


#: the capture levels each command takes (``--capture``)
_APPLY_CAPTURES = ("fx", "export", "dynamo")
_EXPLAIN_CAPTURES = ("fx", "export")
_ANALYSIS_CAPTURES = ("fx", "export", "export_core", "dynamo")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rewrite", description="Declarative rewrite rules for PyTorch graphs.")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import this Python module first (before the command; repeatable): it registers the "
                        "torch.library custom ops or rewrite functions the rule files name")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("check", help="parse and check rule files; exit 1 on any error")
    c.add_argument("files", nargs="+")
    c.add_argument("-q", "--quiet", action="store_true")
    c.add_argument("--verify", action="store_true",
                   help="also verify every rule on random instances of its pattern (needs hypothesis); "
                        "exit 1 on any counterexample, rule that did not fire, or skipped (unverified) rule")
    c.add_argument("--allow-skipped", action="store_true",
                   help="with --verify: a rule no instance could be built for is reported, not failed")
    c.add_argument("--max-examples", type=positive_int, default=100,
                   help="instances checked per rule for --verify (discarded ones are drawn again)")
    c.add_argument("--seed", type=int, default=0, help="seed for --verify (the same seed, the same instances)")
    c.set_defaults(fn=_cmd_check)

    f = sub.add_parser("fmt", help="print rule files in canonical form (comments kept)")
    f.add_argument("files", nargs="+")
    mode = f.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if a file is not formatted (naming it); change nothing")
    mode.add_argument("--write", action="store_true", help="rewrite the files in place")
    f.set_defaults(fn=_cmd_fmt)

    a = sub.add_parser("apply", help="apply rule files to a model and report what changed")
    a.add_argument("rules", nargs="+", help="rule files (.rw)")
    a.add_argument("--model", required=True, help="module:callable returning (model, example_inputs)")
    a.add_argument("--capture", choices=_APPLY_CAPTURES, default="fx")
    a.add_argument("--ruleset", help="apply only this ruleset of the files")
    a.add_argument("--no-check", action="store_true", help="skip the equivalence check")
    a.add_argument("--trials", type=positive_int, default=3)
    a.add_argument("--rtol", type=_tolerance, help="relative tolerance of the check (default: by dtype)")
    a.add_argument("--atol", type=_tolerance, help="absolute tolerance of the check (default: by dtype)")
    a.add_argument("--save", metavar="PATH", help="save the result: *.pt (torch.save of the GraphModule) for "
                   "--capture fx, *.pt2 (torch.export.save) for --capture export; never a partial file")
    a.add_argument("--print-code", action="store_true", help="print the rewritten graph's code")
    a.add_argument("--report", action="store_true",
                   help="compare original and rewritten: nodes, FLOPs, bytes, parameters, peak memory, casts, "
                        "int8 ops (rewrite.analysis)")
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
    e.add_argument("--capture", choices=_EXPLAIN_CAPTURES, default="fx")
    e.set_defaults(fn=_cmd_explain)

    s = sub.add_parser("stats", help="per-node FLOPs, bytes, shapes and peak activation memory of a model's "
                       "graph, with totals (rewrite.analysis)")
    s.add_argument("--model", required=True, help="module:callable returning (model, example_inputs)")
    s.add_argument("--capture", choices=_ANALYSIS_CAPTURES, default="fx")
    s.add_argument("--by", choices=("module", "op"), help="roll the table up by module path or by op")
    s.add_argument("--depth", type=non_negative_int, default=2,
                   help="with --by module: module path components kept (0: the whole path)")
    s.add_argument("--limit", type=non_negative_int, help="print at most this many rows")
    out = s.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print plain data: nodes, totals, groups (--by, default op)")
    out.add_argument("--csv", action="store_true", help="print one CSV row per node")
    s.set_defaults(fn=_cmd_stats)

    w = sub.add_parser("show", help="draw the graph as a DAG (SVG or a self-contained HTML viewer); with "
                       "--rules, the before/after diff with rewritten regions labelled by rule")
    w.add_argument("--model", required=True, help="module:callable returning (model, example_inputs)")
    w.add_argument("--capture", choices=_ANALYSIS_CAPTURES, default="fx")
    w.add_argument("--rules", nargs="+", metavar="FILE", help="rule files to apply; draw before and after")
    w.add_argument("--ruleset", help="with --rules: apply only this ruleset of the files")
    w.add_argument("-o", "--output", required=True, help="out.svg or out.html")
    w.set_defaults(fn=_cmd_show)

    # Its options live in rewrite.quant, which imports torch: parsed there, so that
    # the other commands start without torch.
    q = sub.add_parser(
        "quantize", add_help=False,
        help="int8 post-training quantization: fuse, observe, calibrate on random inputs shaped like "
        "the example, convert, lower to torch.ops.quantized; print counts and the accuracy report "
        "(rewrite quantize --help for its options)",
    )
    q.set_defaults(fn=_cmd_quantize)  # main() hands it the raw arguments
    return p


def _captured(spec: str, level: str, levels: tuple, for_rules: bool = False) -> tuple:
    """(graph module, the inputs to run it with) for a ``--model`` spec. ``for_rules``:
    the graph rules will read; a dynamo graph takes the model's parameters as inputs,
    so they are frozen into constants first, as ``rewrite.backend`` does (no folding
    rule would fire otherwise, and ``show --rules`` would draw no rewrite)."""
    import copy

    import torch.fx as fx

    from rewrite.flows.dynamo import freeze_parameters
    from rewrite.trust.runnable import load_runnable_model

    model, inputs = load_runnable_model(spec)
    gm, inputs = _captured_model(model, inputs, level, spec, levels, with_inputs=True)
    if for_rules and level == "dynamo":
        gm = fx.GraphModule(gm, copy.deepcopy(gm.graph))
        _, kept = freeze_parameters(gm, list(inputs))
        inputs = tuple(kept)
    return gm, inputs


def _captured_model(model: Any, inputs: tuple, level: str, spec: str, levels: tuple,
                    with_inputs: bool = False) -> Any:
    """``capture(_with_inputs)`` of a loaded model; a model torch cannot capture at
    ``level`` (transformers' code under symbolic_trace) is the user's error, said so,
    with the other ``levels`` the command takes."""
    import torch

    from rewrite.capture import ModelSpecError, capture_with_inputs

    if isinstance(model, torch.jit.ScriptModule):
        raise ModelSpecError(f"{spec}: a TorchScript module cannot be captured or rewritten: return the "
                             "nn.Module itself")
    try:
        captured = capture_with_inputs(model, inputs, level)
    except Exception as err:  # noqa: BLE001 - the model's own code (or torch) cannot be captured so: say so
        others = ", ".join(other for other in levels if other != level)
        first = str(err).splitlines()[0] if str(err) else ""
        raise ModelSpecError(f"{spec}: the model cannot be captured at --capture {level} "
                             f"({type(err).__name__}: {first}); try --capture {others}") from err
    return captured if with_inputs else captured[0]


def _cmd_stats(args: argparse.Namespace) -> int:
    import json

    from rewrite.analysis import analyze

    gm, inputs = _captured(args.model, args.capture, levels=_ANALYSIS_CAPTURES)
    analysis = analyze(gm, inputs, show_progress=True)
    if args.json:
        groups = analysis.by_op() if args.by != "module" else analysis.by_module(args.depth)
        data = {**analysis.to_dict(), "groups": [g.to_dict() for g in groups]}
        print(json.dumps(data, indent=1))
    elif args.csv:
        sys.stdout.write(analysis.to_csv())
    else:
        print(analysis.table(by=args.by, depth=args.depth, limit=args.limit))
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from rewrite.analysis.show import ShowError, layout_program, output_problem, render

    try:
        problem = output_problem(args.output) or (layout_program() and None)
    except (ShowError, ImportError) as err:
        problem = str(err)
    if problem:  # refused before any work
        print(f"rewrite: error: show -o {args.output}: {problem}", file=sys.stderr)
        return 2
    gm, inputs = _captured(args.model, args.capture, levels=_ANALYSIS_CAPTURES, for_rules=bool(args.rules))
    before = None
    if args.rules:
        import rewrite

        rules = _load(args.rules)
        if args.ruleset:
            rules = _pick(rules, args.ruleset)
        try:
            result = rules.apply(gm, example_inputs=inputs)
        except rewrite.EquivalenceError as err:
            print(f"rewrite: error: {err}", file=sys.stderr)
            return 1
        before, gm = gm, result.graph_module
        print(result.summary())
    path = render(gm, args.output, inputs, before=before, show_progress=True)
    print(f"wrote {path}")
    return 0


def _cmd_quantize(options: list) -> int:
    from rewrite.flows.quant import add_quantize_arguments, quantize_command

    parser = add_quantize_arguments(argparse.ArgumentParser(prog="rewrite quantize"))
    return quantize_command(parser.parse_args(options))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rewrite`` console script and ``python -m rewrite``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    imports = []
    while argv[:1] == ["--import"] and len(argv) >= 2 or argv[:1] and argv[0].startswith("--import="):
        imports.append(argv[1] if argv[0] == "--import" else argv[0].split("=", 1)[1])
        argv = argv[2:] if argv[0] == "--import" else argv[1:]
    if argv[:1] == ["quantize"]:
        run = functools.partial(_cmd_quantize, argv[1:])
    else:
        args = _parser().parse_args(argv)
        run = functools.partial(args.fn, args)
    from rewrite.capture import ExportError, ModelSpecError, SaveError
    from rewrite.language import RuleError

    for module in imports:  # the user's own code, named on the command line (never by a rule file)
        try:
            importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - the user's module failed: say so, no traceback
            print(f"rewrite: error: --import {module}: {type(err).__name__}: {err}", file=sys.stderr)
            return 2
    try:
        return run()
    except RuleError as err:
        print(str(err), file=sys.stderr)
        return 1
    except (ModelSpecError, ExportError, SaveError, _NoSuchRuleset) as err:  # the user's model, rules or result
        print(f"rewrite: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 2
    except SystemExit:
        raise
    except Exception as err:  # noqa: BLE001 - report, do not dump a traceback on users
        print(f"rewrite: internal error: {type(err).__name__}: {err}", file=sys.stderr)
        return 2


def _tolerance(text: str) -> float:
    """argparse type: a finite, non-negative float."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a finite, non-negative number")
    return value


class _NoSuchRuleset(Exception):
    """--ruleset names nothing the rule files declare."""


def _pick(rules: Any, name: str) -> Any:
    try:
        return rules[name]
    except KeyError as err:
        raise _NoSuchRuleset(f"--ruleset: {err.args[0]}") from None


if __name__ == "__main__":
    sys.exit(main())
