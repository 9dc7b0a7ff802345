"""Benchmark: ResNet-50 inference latency after BN folding, against torch's own fuser.

Compares, in the same process and the same run:

* ``eager``      the unfused eval-mode model,
* ``rewrite``    ``rewrite.load("rules/fusion.rw").apply(symbolic_trace(model))``,
* ``torch fuse`` ``torch.fx.experimental.optimization.fuse(model)``,

at batch 1, 3x224x224, for each thread count, as the median of ``--runs`` timed
calls after ``--warmup`` calls. Variants are timed round-robin so that drift in
machine load hits them equally. Also reports how long each transformation
takes (ours with and without the equivalence check). Ratios below 1 mean
faster than the reference column. Never run as a test.

    python benchmarks/fusion.py --runs 30
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, List

import torch
from torch import fx
from torch.fx.experimental.optimization import fuse as torch_fuse

try:
    import rewrite
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import rewrite
from rewrite.examples.cnn import resnet50_with_inputs
from rewrite.examples.graph_stats import count_batch_norms
from rewrite.engine.workspace import compile_now


def _time_transform(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _latency(variants: Dict[str, Callable], x: torch.Tensor, runs: int, warmup: int) -> Dict[str, float]:
    samples: Dict[str, List[float]] = {name: [] for name in variants}
    names = list(variants)
    with torch.inference_mode():
        for _ in range(warmup):
            for name in names:
                variants[name](x)
        for i in range(runs):
            order = names[i % len(names):] + names[: i % len(names)]
            for name in order:
                start = time.perf_counter()
                variants[name](x)
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="timed calls per variant (median reported)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per variant first")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--size", type=int, default=224, help="input height and width")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--transform-repeats", type=int, default=3,
                        help="times each transformation is timed (median reported)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")

    model, (x,) = resnet50_with_inputs(batch=args.batch, size=args.size)
    rules = rewrite.load("rules/fusion.rw")
    traced = fx.symbolic_trace(model)

    result = rules.apply(traced, example_inputs=(x,), check=False)
    ours = result.graph_module
    theirs = torch_fuse(model)  # returns a fused copy; model is untouched

    t_apply = _time_transform(lambda: rules.apply(traced, example_inputs=(x,), check=False),
                              args.transform_repeats)
    t_apply_codegen = _time_transform(
        lambda: compile_now(rules.apply(traced, example_inputs=(x,), check=False).graph_module),
        args.transform_repeats)
    t_apply_checked = _time_transform(lambda: rules.apply(traced, example_inputs=(x,)),
                                      args.transform_repeats)
    t_trace = _time_transform(lambda: fx.symbolic_trace(model), args.transform_repeats)
    t_fuse = _time_transform(lambda: torch_fuse(model), args.transform_repeats)

    with torch.no_grad():
        ref = model(x)
        err_ours = (ours(x) - ref).abs().max().item()
        err_theirs = (theirs(x) - ref).abs().max().item()

    print(f"ResNet-50, batch {args.batch}, 3x{args.size}x{args.size}, torch {torch.__version__}, "
          f"median of {args.runs} runs after {args.warmup} warmup")
    print(f"batch norms: eager {count_batch_norms(traced)}, rewrite {count_batch_norms(ours)}, "
          f"torch fuse {count_batch_norms(fx.symbolic_trace(theirs))}; "
          f"rewrite counts {dict(sorted(result.counts.items()))}")
    print(f"max |output - eager|: rewrite {err_ours:.2e}, torch fuse {err_theirs:.2e}")
    print()
    print(f"{'threads':>7}  {'variant':<11} {'median ms':>10} {'vs eager':>9} {'vs torch fuse':>14}")
    original_threads = torch.get_num_threads()
    try:
        for threads in [int(t) for t in args.threads.split(",") if t]:
            torch.set_num_threads(threads)
            lat = _latency({"eager": model, "rewrite": ours, "torch fuse": theirs}, x,
                           args.runs, args.warmup)
            for name, sec in lat.items():
                print(f"{threads:>7}  {name:<11} {sec * 1e3:>10.2f} {sec / lat['eager']:>9.3f} "
                      f"{sec / lat['torch fuse']:>14.3f}")
    finally:
        torch.set_num_threads(original_threads)
    print()
    print("transformation time (median of %d):" % args.transform_repeats)
    print(f"  rewrite apply, no check     {t_apply * 1e3:>9.1f} ms  ({t_apply / t_fuse:.2f}x torch fuse)")
    print(f"  ... then generate its code  {t_apply_codegen * 1e3:>9.1f} ms  ({t_apply_codegen / t_fuse:.2f}x torch fuse;"
          " apply's result compiles lazily, on first call)")
    print(f"  rewrite apply, with check   {t_apply_checked * 1e3:>9.1f} ms  ({t_apply_checked / t_fuse:.2f}x torch fuse)")
    print(f"  symbolic_trace (both need)  {t_trace * 1e3:>9.1f} ms")
    print(f"  torch fuse (traces itself)  {t_fuse * 1e3:>9.1f} ms")


if __name__ == "__main__":
    main()
