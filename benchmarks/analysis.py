"""rewrite.analysis against its peers, measured in the same run.

    python benchmarks/analysis.py [--quick]

1. FLOPs: ``analyze(...).totals.flops`` vs ``torch.utils.flop_counter.FlopCounterMode``
   on the eager model: ResNet-50 (symbolic_trace and export), BERT-base and ViT-base
   (transformers, built from their configs with random weights, captured with
   torch.export); BERT also at the core-ATen level, where attention is decomposed.
2. ``rewrite stats`` on BERT-base (export): capture + analyze vs one eager forward +
   the same capture.
3. ``rewrite show`` of ResNet-50: SVG and HTML render times, one graph and the
   before/after diff of rules/fusion.rw.
4. Peak activation memory of ResNet-50 at batch 1: the liveness estimate vs torch's
   profiler (``profile_memory=True``): its raw peak, which includes the scratch
   buffers an op allocates and frees inside itself (mkldnn's reorders), and the peak
   between ops (the tensors that exist when an op returns: the activations).

``--quick`` uses small configs (for a smoke run); the README figures come from the full run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.fx as fx
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

import rewrite
from rewrite.analysis import analyze
from rewrite.analysis.show import render
from rewrite.capture import capture_with_inputs


def eager_flops(model, inputs) -> int:
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(*inputs)
    return counter.get_total_flops()


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def models(quick: bool):
    from rewrite.examples.cnn import resnet50_with_inputs, resnet_tiny_with_inputs
    from rewrite.examples.hf import bert_base, hf_bert, hf_vit

    def vit_base():
        from transformers import ViTConfig, ViTModel
        torch.manual_seed(0)
        return ViTModel(ViTConfig()).eval(), (torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0)),)

    if quick:
        return {"resnet": resnet_tiny_with_inputs, "bert": hf_bert, "vit": hf_vit}
    return {"resnet": resnet50_with_inputs, "bert": bert_base, "vit": vit_base}


def flops_section(builders) -> None:
    print("== 1. FLOPs: rewrite.analysis vs FlopCounterMode on the eager model")
    print(f"{'model':<10} {'capture':<12} {'FlopCounterMode':>16} {'analysis':>16} {'ratio':>8}")
    for name, levels in (("resnet", ("fx", "export")), ("bert", ("export", "export_core")), ("vit", ("export",))):
        model, inputs = builders[name]()
        ref = eager_flops(model, inputs)
        for level in levels:
            gm, args = capture_with_inputs(model, inputs, level)
            a = analyze(gm, args)
            print(f"{name:<10} {level:<12} {ref:>16,} {a.totals.flops:>16,} {a.totals.flops / ref:>8.4f}")
            if name != "resnet" and level == "export":
                sdpa = [n for n in a.nodes if n.op == "scaled_dot_product_attention"]
                if sdpa:
                    print(f"{'':<10} {'':<12} attention nodes: {len(sdpa)}, FLOPs counted there: "
                          f"{sum(n.flops for n in sdpa)} (CPU's _scaled_dot_product_flash_attention_for_cpu is not "
                          "in flop_registry)")


def stats_section(builders) -> None:
    print("\n== 2. rewrite stats on BERT-base (export): capture + analyze vs one eager forward + capture")
    model, inputs = builders["bert"]()
    with torch.no_grad():
        model(*inputs)  # warm up
        _, forward = timed(model, *inputs)
    (gm, args), capture = timed(capture_with_inputs, model, inputs, "export")
    a, analysis = timed(analyze, gm, args)
    _, table = timed(a.table, by="module")
    stats = capture + analysis + table
    print(f"eager forward {forward:.2f} s, capture {capture:.2f} s, analyze {analysis:.2f} s "
          f"({len(gm.graph.nodes)} nodes), table {table:.3f} s")
    print(f"rewrite stats / (forward + capture) = {stats:.2f} / {forward + capture:.2f} = "
          f"{stats / (forward + capture):.2f}x (target < 3x); analyze alone = {analysis / forward:.2f} eager forwards")


def show_section(builders) -> None:
    print("\n== 3. rewrite show: ResNet-50 render times")
    model, inputs = builders["resnet"]()
    out = Path(tempfile.mkdtemp(prefix="bench_show_"))
    for level in ("fx", "export"):
        gm, args = capture_with_inputs(model, inputs, level)
        result = rewrite.load("rules/fusion.rw").apply(gm, example_inputs=args, check=False)
        (_, a_s) = timed(analyze, gm, args)
        for suffix in (".svg", ".html"):
            _, one = timed(render, gm, out / f"{level}{suffix}", args)
            _, diff = timed(render, result.graph_module, out / f"{level}_diff{suffix}", args, before=gm)
            size = (out / f"{level}_diff{suffix}").stat().st_size / 2**20
            print(f"{level:<7} {suffix:<6} {len(gm.graph.nodes):>4} nodes: {one:.2f} s; before/after diff "
                  f"{diff:.2f} s ({size:.1f} MiB); of which analyze {a_s:.2f} s per graph")


def measured_peaks(model, inputs) -> tuple:
    """(raw peak, peak between ops) of the memory torch's profiler records in one forward."""
    with torch.no_grad():
        model(*inputs)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model(*inputs)
    events = list(prof.profiler.kineto_results.events())
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    ops = sorted((e.start_ns(), e.end_ns()) for e in events if e.name().startswith("aten::"))
    ends, last = [], -1
    for start, end in ops:  # top-level ops only
        if start >= last:
            ends.append(end)
            last = end
    live = peak = between = 0
    j = 0
    for t, n in memory:
        while j < len(ends) and ends[j] < t:
            between = max(between, live)
            j += 1
        live += n
        peak = max(peak, live)
    return peak, max(between, live)


def memory_section(builders) -> None:
    print("\n== 4. Peak activation memory, ResNet-50 batch 1: liveness estimate vs torch's profiler")
    model, inputs = builders["resnet"]()
    raw, between = measured_peaks(model, inputs)
    for level in ("fx", "export"):
        gm, args = capture_with_inputs(model, inputs, level)
        a = analyze(gm, args)
        print(f"{level:<7} estimate {a.peak_bytes / 2**20:.2f} MiB (at {a.peak_node}); measured between ops "
              f"{between / 2**20:.2f} MiB -> {a.peak_bytes / between:.3f}; raw peak incl. op scratch "
              f"{raw / 2**20:.2f} MiB -> {a.peak_bytes / raw:.3f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small models (a smoke run)")
    p.add_argument("--only", choices=("flops", "stats", "show", "memory"))
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    builders = models(args.quick)
    sections = {"flops": flops_section, "stats": stats_section, "show": show_section, "memory": memory_section}
    for name, fn in sections.items():
        if args.only in (None, name):
            fn(builders)
    return 0


if __name__ == "__main__":
    sys.exit(main())
