"""Rule sets before Inductor: ``rewrite.backend(rules, compiler="inductor")`` against
``torch.compile`` with Inductor alone.

Two models, inference (``torch.no_grad``), Inductor's freezing on for every variant
(``torch._inductor.config.freezing = True``), the same thread count for all:

* ResNet-50 (torchvision layout from ``rewrite.examples.cnn``, random BN statistics),
  batch 1, 3x224x224;
* BERT-base (``transformers`` ``BertModel`` from its default config, random weights),
  batch 1, 128 tokens.

Variants, each compiled once, then timed round-robin (one call of each in turn,
``--runs`` rounds, median); ``eager`` and ``eager autocast`` (the model itself, in
float32 / under autocast) are there for context:

* ``inductor``: ``torch.compile(model)`` (Inductor alone);
* ``rules+inductor``: ``torch.compile(model, backend=rewrite.backend(fusion+cleanup,
  compiler="inductor"))``: rules/fusion.rw then rules/cleanup.rw on each dynamo
  graph (equivalence-checked), then Inductor;
* ``inductor autocast``: ``torch.compile(model)`` compiled and called under
  ``torch.autocast("cpu", torch.bfloat16)``;
* ``amp rules+inductor``: ``rewrite.backend(amp_bf16, compiler="inductor")``
  (rules/amp_bf16.rw; the error columns stand in for the check).

Errors are against the eager fp32 model on the benchmark input (first output):
max absolute error and SQNR in dB. "rewrites" sums ``RewriteResult.counts`` over
the dynamo graphs (from ``on_result``); "compile s" is the first call.

Run: ``flock /tmp/bench.lock python benchmarks/inductor.py --runs 10``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time
from typing import Any, Callable

import torch
import torch._dynamo
import torch._inductor.config as inductor_config

import rewrite
from rewrite.examples.cnn import resnet50_with_inputs
from rewrite.examples.hf import bert_base


def _first(out: Any) -> torch.Tensor:
    while not isinstance(out, torch.Tensor):
        out = out[0] if isinstance(out, (tuple, list)) else next(iter(out.values()))
    return out


def _errors(out: Any, ref: torch.Tensor) -> tuple:
    out = _first(out).float()
    noise = (out - ref).pow(2).mean()
    sqnr = float("inf") if noise == 0 else float(10 * torch.log10(ref.pow(2).mean() / noise))
    return float((out - ref).abs().max()), sqnr


def _compiled(model: torch.nn.Module, backend: Any, autocast: bool) -> Callable:
    # no torch._dynamo.reset() between variants: dynamo keeps one cache entry per
    # backend (guarded on it) and on the autocast state, so all variants stay compiled
    fn = torch.compile(model, backend=backend)
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    return lambda *args: _run(fn, ctx, args)


def _run(fn: Callable, ctx: Callable, args: tuple) -> Any:
    with ctx():
        return fn(*args)


def variants(model: torch.nn.Module, args: tuple, fusion_cleanup: Any, amp: Any) -> list:
    """(name, compiled callable, compile seconds, rewrites, error tuple) per variant."""
    with torch.no_grad():
        ref = _first(model(*args)).float()
    out = []
    specs = [
        ("inductor", lambda: "inductor", False, "inductor"),
        ("rules+inductor", lambda rec: rewrite.backend(fusion_cleanup, compiler="inductor", on_result=rec),
         False, "inductor"),
        ("inductor autocast", lambda: "inductor", True, "inductor autocast"),
        ("amp rules+inductor", lambda rec: rewrite.backend(amp, compiler="inductor", check=False, on_result=rec),
         False, "inductor autocast"),
    ]
    for name, autocast in (("eager", False), ("eager autocast", True)):  # context: no compile
        ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
        fn = functools.partial(_run, model, ctx)
        with torch.no_grad():
            result = fn(args)
        out.append((name, lambda *a, fn=fn: fn(a), 0.0, None, _errors(result, ref),
                    "inductor autocast" if autocast else "inductor"))
    for name, make, autocast, peer in specs:
        results: list = []
        backend = make(results.append) if make.__code__.co_argcount else make()
        fn = _compiled(model, backend, autocast)
        start = time.perf_counter()
        with torch.no_grad():
            result = fn(*args)
        seconds = time.perf_counter() - start
        rewrites = sum(sum(r.counts.values()) for r in results) if results else None
        out.append((name, fn, seconds, rewrites, _errors(result, ref), peer))
    return out


def time_round_robin(fns: dict, args: tuple, runs: int, warmup: int = 2) -> dict:
    times: dict = {k: [] for k in fns}
    with torch.no_grad():
        for _ in range(warmup):
            for fn in fns.values():
                fn(*args)
        for _ in range(runs):
            for k, fn in fns.items():
                start = time.perf_counter()
                fn(*args)
                times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default="resnet50,bert", help="comma-separated: resnet50, bert")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    inductor_config.freezing = True
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
    fusion_cleanup = rewrite.load("rules/fusion.rw") + rewrite.load("rules/cleanup.rw")
    amp = rewrite.load("rules/amp_bf16.rw")
    models = {"resnet50": ("ResNet-50", resnet50_with_inputs), "bert": ("BERT-base", bert_base)}
    print(f"torch {torch.__version__}, {opts.threads} threads, freezing on, median of {opts.runs} runs")
    print("| model | variant | median ms | vs peer | peer | compile s | rewrites | max abs err | SQNR dB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key in opts.models.split(","):
        label, factory = models[key]
        model, args = factory()
        model = model.eval()
        torch._dynamo.reset()
        built = variants(model, args, fusion_cleanup, amp)
        medians = time_round_robin({b[0]: b[1] for b in built}, args, opts.runs)
        for name, _, seconds, rewrites, (abs_err, sqnr), peer in built:
            ratio = medians[name] / medians[peer]
            print(f"| {label} | {name} | {medians[name] * 1e3:.1f} | {ratio:.3f} | {peer} | {seconds:.1f} | "
                  f"{'-' if rewrites is None else rewrites} | {abs_err:.3g} | {sqnr:.1f} |", flush=True)


if __name__ == "__main__":
    main()
