"""Benchmark: int8 post-training quantization from rule files, against torch.ao.

In one process and one run, with the same calibration and held-out data for every
quantizer:

* **ResNet-50** (``rewrite.examples.cnn``, symbolic_trace, batch 1, 3x224x224):
  fp32 eager; ``torch.ao.quantization.quantize_fx.prepare_fx/convert_fx`` with
  ``get_default_qconfig_mapping(backend)``; ``rewrite.quant`` (``prepare``,
  ``calibrate``, ``convert``), for the x86 and onednn backends. Latency (median of
  ``--runs`` round-robin calls per thread count), speed-up over fp32, ratio to
  torch.ao on the same backend (below 1: faster than torch.ao), and output SQNR
  against fp32 on held-out inputs.
* **BERT** from transformers (``hf_bert`` small config at seq 64, ``bert_base`` at seq 128),
  captured with ``torch.export.export(model, args, strict=False).module()``, int8
  linear layers (``ruleset="linear"``): speed-up and SQNR of both outputs.
* **A CNN from transformers** (``ResNetModel`` with ResNetConfig's defaults, i.e.
  the ResNet-50 layout, 224x224; and the small ``hf_mobilenet_v2``), captured with
  ``torch.export``, quantized end to end: speed-up and SQNR.

Inputs are random (the models have random weights): calibration on
``--calibration`` normal batches, SQNR on ``--held-out`` other batches. Never run
as a test.

    python benchmarks/quant.py --runs 20
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch

try:
    import rewrite  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rewrite.quant as rq
from rewrite.trust.check import generate_inputs
from rewrite.examples.cnn import randomize_batchnorm, resnet50_with_inputs
from timing import round_robin_ms


class Variant:
    """A callable timed under its own quantized engine (onednn's fused conv+add
    needs ``torch.backends.quantized.engine == "onednn"`` when it runs)."""

    def __init__(self, fn: Callable, engine: str | None = None) -> None:
        self.fn, self.engine = fn, engine

    def __call__(self, *args: Any) -> Any:
        if self.engine is not None:
            torch.backends.quantized.engine = self.engine
        return self.fn(*args)


def _sqnr(reference: Callable, candidate: Variant, batches: list) -> List[float]:
    """SQNR per float output, pooled over the held-out batches."""
    sig: List[float] = []
    noise: List[float] = []
    with torch.inference_mode():
        for batch in batches:
            for i, (r, c) in enumerate(rq._float_pairs(reference(*batch), candidate(*batch))):
                r, c = r.double(), c.double()
                if i >= len(sig):
                    sig.append(0.0)
                    noise.append(0.0)
                sig[i] += float((r * r).sum())
                noise[i] += float(((r - c) ** 2).sum())
    return [float("inf") if n == 0 else 10 * torch.log10(torch.tensor(s / n)).item() for s, n in zip(sig, noise)]


def _batches(inputs: tuple, n: int, seed: int) -> list:
    return [generate_inputs(inputs, seed=seed + i) for i in range(n)]


def _ours(model: Any, inputs: tuple, calib: list, backend: str, **options: Any) -> tuple:
    start = time.perf_counter()
    observed = rq.prepare(model, inputs, backend=backend, check=False, **options)
    prep = time.perf_counter() - start
    rq.calibrate(observed, calib)
    start = time.perf_counter()
    int8 = rq.convert(observed, check=False)
    return observed, int8, prep + time.perf_counter() - start


def _torch_ao(model: Any, inputs: tuple, calib: list, backend: str) -> tuple:
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    torch.backends.quantized.engine = backend
    start = time.perf_counter()
    prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping(backend), inputs)
    prep = time.perf_counter() - start
    with torch.no_grad():
        for batch in calib:
            prepared(*batch)
    start = time.perf_counter()
    converted = convert_fx(prepared)
    return converted, prep + time.perf_counter() - start


def _fmt(db: List[float]) -> str:
    return " / ".join(f"{d:.1f}" for d in db)


def bench_resnet50(args: argparse.Namespace, threads: List[int]) -> None:
    model, (x,) = resnet50_with_inputs(batch=1, size=224)
    inputs = (x,)
    calib = _batches(inputs, args.calibration, 1000)
    held = _batches(inputs, args.held_out, 2000)
    variants: Dict[str, Variant] = {"fp32 eager": Variant(model)}
    transform: Dict[str, float] = {}
    counts: Dict[str, Any] = {}
    for backend in args.backends:
        if backend not in torch.backends.quantized.supported_engines:
            continue
        ao, seconds = _torch_ao(model, inputs, calib, backend)
        variants[f"torch.ao {backend}"] = Variant(ao, backend)
        transform[f"torch.ao {backend}"] = seconds
        _, int8, seconds = _ours(model, inputs, calib, backend)
        variants[f"rewrite {backend}"] = Variant(int8, backend)
        transform[f"rewrite {backend}"] = seconds
        counts[backend] = int8.meta["rewrite.quant"]["lower_counts"]
    sqnr = {name: _sqnr(model, v, held) for name, v in variants.items() if name != "fp32 eager"}

    print("## ResNet-50 (symbolic_trace), batch 1, 3x224x224")
    for backend, c in counts.items():
        print(f"rewrite {backend} lowering: " + ", ".join(f"{k} x{v}" for k, v in sorted(c.items())))
    print()
    print("| threads | variant | median ms | speed-up vs fp32 | vs torch.ao (same backend) | output SQNR dB |")
    print("|---|---|---|---|---|---|")
    for n in threads:
        torch.set_num_threads(n)
        med = round_robin_ms(variants, inputs, args.runs, args.warmup)
        for name, ms in med.items():
            backend = name.split()[-1]
            peer = med.get(f"torch.ao {backend}")
            vs_ao = f"{ms / peer:.3f}" if peer and name.startswith("rewrite") else ("1.000" if name.startswith("torch.ao") else "")
            db = _fmt(sqnr[name]) if name in sqnr else ""
            print(f"| {n} | {name} | {ms:.1f} | {med['fp32 eager'] / ms:.2f}x | {vs_ao} | {db} |")
    print()
    print("transformation seconds (prepare + convert, calibration excluded): "
          + ", ".join(f"{k} {v:.1f}" for k, v in transform.items()))
    print()


def _export_table(title: str, model: Any, inputs: tuple, threads: List[int], args: argparse.Namespace,
                  **options: Any) -> None:
    calib = [inputs] + _batches(inputs, args.calibration - 1, 1000)
    held = _batches(inputs, args.held_out, 2000)
    start = time.perf_counter()
    gm = torch.export.export(model, inputs, strict=False).module()
    capture = time.perf_counter() - start
    _, int8, seconds = _ours(gm, inputs, calib, "x86", **options)
    counts = int8.meta["rewrite.quant"]["lower_counts"]
    variants = {"fp32 eager": Variant(model), "rewrite x86 int8": Variant(int8, "x86")}
    db = _sqnr(model, variants["rewrite x86 int8"], held)
    print(f"## {title}")
    print("lowering: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))
    print(f"export {capture:.1f} s, prepare + convert {seconds:.1f} s; output SQNR dB (each output): {_fmt(db)}")
    print()
    print("| threads | fp32 eager ms | int8 ms | speed-up |")
    print("|---|---|---|---|")
    for n in threads:
        torch.set_num_threads(n)
        med = round_robin_ms(variants, inputs, args.runs, args.warmup)
        print(f"| {n} | {med['fp32 eager']:.1f} | {med['rewrite x86 int8']:.1f} | "
              f"{med['fp32 eager'] / med['rewrite x86 int8']:.2f}x |")
    print()


def bench_transformers(args: argparse.Namespace, threads: List[int]) -> None:
    from transformers import ResNetConfig, ResNetModel

    from rewrite.examples.hf import bert_base, hf_bert, hf_mobilenet_v2

    model, inputs = hf_bert(batch=1, seq=64)
    _export_table("BERT, transformers BertModel small config (2 layers, hidden 32), seq 64, int8 linear",
                  model, inputs, threads, args, ruleset="linear")
    if not args.skip_bert_base:
        model, inputs = bert_base(batch=1, seq=128)
        _export_table("BERT-base (12 layers, hidden 768), seq 128, int8 linear", model, inputs, threads, args,
                      ruleset="linear")
    torch.manual_seed(0)
    model = randomize_batchnorm(ResNetModel(ResNetConfig())).eval()
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    _export_table("transformers ResNetModel (ResNetConfig defaults: ResNet-50 layout), 3x224x224",
                  model, (x,), threads, args)
    model, inputs = hf_mobilenet_v2(size=224)
    _export_table("transformers MobileNetV2Model (depth multiplier 0.35), 3x224x224", model, inputs, threads, args)


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="timed calls per variant (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per variant first")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--calibration", type=int, default=8, help="calibration batches")
    parser.add_argument("--held-out", type=int, default=4, help="held-out batches for SQNR")
    parser.add_argument("--backends", default="x86,onednn", help="quantized engines to compare")
    parser.add_argument("--only", choices=("resnet50", "transformers"), help="run one part")
    parser.add_argument("--skip-bert-base", action="store_true", help="skip BERT-base (the slowest part)")
    args = parser.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    warnings.filterwarnings("ignore")
    threads = [int(t) for t in args.threads.split(",")]
    print(f"torch {torch.__version__}, engines {torch.backends.quantized.supported_engines}, "
          f"cpu {torch.backends.cpu.get_cpu_capability()}, runs {args.runs}, "
          f"calibration {args.calibration}, held-out {args.held_out}")
    print()
    if args.only in (None, "resnet50"):
        bench_resnet50(args, threads)
    if args.only in (None, "transformers"):
        bench_transformers(args, threads)


if __name__ == "__main__":
    main()
