"""Mixed precision on CPU: rules/amp_bf16.rw against torch.autocast, fp32 and a
wholesale bfloat16 model.

Three models, each captured with ``torch.export`` and rewritten once by
``rules/amp_bf16.rw`` (the equivalence check is replaced by the error columns):

* ResNet-50 (torchvision layout, random BN statistics), batch 1, 3x224x224;
* a BERT-base encoder from ``transformers`` (12 layers, hidden 768, random
  weights), batch 1, 128 tokens, captured with ``torch.export(strict=False)``;
* an MLP of 8 ``Linear(1024, 1024)`` + ReLU layers, batch 128.

Variants, timed round-robin (one call of each in turn, ``--runs`` rounds, median):

* ``fp32``: the eager model;
* ``fp32 graph``: the captured graph, not rewritten (capture alone is not the win);
* ``autocast``: the eager model under ``torch.autocast("cpu", torch.bfloat16)``;
* ``bf16 model``: ``model.to(torch.bfloat16)`` called on bfloat16 inputs;
* ``amp rules``: the captured graph rewritten by ``rules/amp_bf16.rw``;
* ``fusion+amp`` (ResNet-50 only): ``rules/fusion.rw`` (BN folding) first.

Errors are against the fp32 model on the benchmark input: max absolute error and
max relative error (max abs error / max |fp32 output|) of the first output.

Run: ``flock /tmp/bench.lock python benchmarks/amp.py --runs 20``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch
from torch import nn

import rewrite
from rewrite.ops import bind_node


class MLP(nn.Module):
    """``depth`` x (Linear(width, width) + ReLU)."""

    def __init__(self, width: int = 1024, depth: int = 8) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def mlp_with_inputs(batch: int = 128, width: int = 1024, depth: int = 8, seed: int = 0) -> tuple:
    torch.manual_seed(seed)
    return MLP(width, depth).eval(), (torch.randn(batch, width),)


def _first(out: Any) -> torch.Tensor:
    while not isinstance(out, torch.Tensor):
        out = out[0] if isinstance(out, (tuple, list)) else next(iter(out.values()))
    return out


def _casts(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if any(b.op == "to" for b in bind_node(n, gm)))


def _errors(out: Any, ref: torch.Tensor) -> tuple:
    diff = (_first(out).float() - ref).abs().max().item()
    return diff, diff / ref.abs().max().item()


def _to_bf16(args: tuple) -> tuple:
    return tuple(a.to(torch.bfloat16) if a.is_floating_point() else a for a in args)


def variants(name: str, model: nn.Module, args: tuple, rules: Any, fusion: Any) -> tuple:
    """{variant: callable}, the rewritten graph's cast count and rewrite seconds."""
    gm = torch.export.export(model, args, strict=False).module()
    start = time.perf_counter()
    amp = rules.apply(gm, args, check=False, training=False).graph_module  # inference: weights cast once
    seconds = time.perf_counter() - start
    bf16_model = copy.deepcopy(model).to(torch.bfloat16)
    bf16_args = _to_bf16(args)

    def autocast() -> Any:
        with torch.autocast("cpu", torch.bfloat16):
            return model(*args)

    out: dict = {
        "fp32": lambda: model(*args),
        "fp32 graph": lambda: gm(*args),
        "autocast": autocast,
        "bf16 model": lambda: bf16_model(*bf16_args),
        "amp rules": lambda: amp(*args),
    }
    if name == "ResNet-50":
        folded = fusion.apply(gm, args, check=False, training=False).graph_module
        fused_amp = rules.apply(folded, args, check=False, training=False).graph_module
        out["fusion+amp"] = lambda: fused_amp(*args)
    return out, _casts(amp), seconds


def time_round_robin(fns: dict, runs: int, warmup: int = 3) -> dict:
    """Median seconds per variant; variants alternate so load changes hit all alike."""
    times: dict = {k: [] for k in fns}
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    for _ in range(runs):
        for k, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--models", default="resnet50,bert,mlp")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)

    from rewrite.examples.cnn import resnet50_with_inputs
    from rewrite.examples.hf import bert_base

    builders: dict = {"resnet50": ("ResNet-50", resnet50_with_inputs), "bert": ("BERT-base", bert_base),
                      "mlp": ("MLP 8x1024", mlp_with_inputs)}
    rules = rewrite.load("rules/amp_bf16.rw")
    fusion = rewrite.load("rules/fusion.rw")
    print(f"torch {torch.__version__}, {opts.threads} threads, median of {opts.runs} runs, round-robin\n")
    print("| model | variant | median ms | vs autocast | speed-up vs fp32 | max abs err | max rel err |")
    print("|---|---|---|---|---|---|---|")
    for key in opts.models.split(","):
        name, build = builders[key]
        model, args = build()
        with torch.no_grad():
            fns, casts, seconds = variants(name, model, args, rules, fusion)
            ref = _first(model(*args)).float()
            errors: dict = {k: _errors(fns[k](), ref) for k in fns}
            medians = time_round_robin(fns, opts.runs)
        for k, t in medians.items():
            abs_err, rel_err = errors[k]
            print(f"| {name} | {k} | {t * 1e3:.1f} | {t / medians['autocast']:.2f} | "
                  f"{medians['fp32'] / t:.2f} | {abs_err:.2g} | {rel_err:.2g} |")
        agree = _errors(fns["amp rules"](), _first(fns["autocast"]()).float())
        print(f"| {name} | amp rules vs autocast: max abs diff {agree[0]:.2g}; "
              f"{casts} casts in the graph; rewrite {seconds:.1f} s | | | | | |")


if __name__ == "__main__":
    main()
