"""Benchmark: this project's QDQ export in onnxruntime, against onnxruntime's own quantizer.

The deployment path of issue 14: quantize with ``rewrite.quant`` in the QDQ form
(``convert(..., form="qdq")``), export to ONNX (``rewrite.quant.export_onnx``:
QuantizeLinear / DequantizeLinear pairs) and run it with onnxruntime's CPU execution
provider, which fuses the pairs into int8 kernels. The peer a deploying user would
pick is onnxruntime's static quantizer (``onnxruntime.quantization.quantize_static``,
QDQ format, per-channel int8 weights, uint8 activations, MinMax calibration) on the
fp32 ONNX export of the same model, calibrated on the same batches.

In one process, for each model and thread count (``--threads``, default 1 and 2):

* ``ort fp32``: the fp32 model exported with ``torch.onnx.export(..., dynamo=True)``;
* ``ort int8 (ORT quantizer)``: that model through ``quantize_static``;
* ``ort int8 (ours)``: our QDQ form exported to ONNX;
* ``torch int8 (ours)``: our int8-kernel form (``torch.ops.quantized``) in eager.

Latency is the median of ``--runs`` round-robin calls. Printed: ms, speed-up over
ORT fp32, ratio to the ORT quantizer's model (below 1: ours is faster), output SQNR
against the fp32 torch model on held-out batches, and the kernels onnxruntime ran
after its graph optimizations (QLinearConv, QLinearMatMul, float Conv/MatMul...):
where the ORT quantizer wins, the op counts say which nodes it quantized or fused
that ours did not. Models: ResNet-50 (``rewrite.examples.cnn``, batch 1, 224x224)
and BERT-base (transformers from its config, random weights, 128 tokens).
Inputs are random (random weights). Never run as a test.

    python benchmarks/deploy.py --runs 10
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
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
from rewrite.examples.cnn import resnet50_with_inputs
from rewrite.trust.check import generate_inputs
from timing import round_robin_ms


def _first(out: Any) -> torch.Tensor:
    """The first output (BERT: ``last_hidden_state``)."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "last_hidden_state"):
        return out.last_hidden_state
    return _first(out[0])


def _session(path: Path, threads: int, optimized: Path | None = None) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if optimized is not None:
        opts.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _kernels(optimized: Path) -> collections.Counter:
    """The op types onnxruntime runs after its graph optimizations (QDQ fused into
    QLinear* kernels; what stays float shows as Conv, MatMul, Gemm...)."""
    import onnx

    return collections.Counter(n.op_type for n in onnx.load(str(optimized)).graph.node)


def _ort_fn(sess: Any) -> Callable:
    names = [i.name for i in sess.get_inputs()]

    def run(*args: torch.Tensor) -> torch.Tensor:
        feed = {n: a.numpy() for n, a in zip(names, args)}
        return torch.from_numpy(sess.run(None, feed)[0])

    return run


def _sqnr(reference: Callable, fn: Callable, batches: list) -> float:
    sig = noise = 0.0
    with torch.inference_mode():
        for b in batches:
            r, o = _first(reference(*b)).double(), _first(fn(*b)).double()
            sig += float((r * r).sum())
            noise += float(((r - o) ** 2).sum())
    return float("inf") if noise == 0 else 10 * torch.log10(torch.tensor(sig / noise)).item()


def _ort_quantize(fp32: Path, out: Path, input_names: List[str], calib: list, pre: Path) -> None:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.feeds = iter([{n: a.numpy() for n, a in zip(input_names, b)} for b in calib])

        def get_next(self) -> Any:
            return next(self.feeds, None)

    quant_pre_process(str(fp32), str(pre), skip_symbolic_shape=True)
    quantize_static(str(pre), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)


def bench(name: str, model: torch.nn.Module, inputs: tuple, capture: str, ruleset: str | None,
          args: argparse.Namespace, tmp: Path) -> None:
    calib = [inputs] + [generate_inputs(inputs, seed=100 + i) for i in range(args.calibration - 1)]
    held = [generate_inputs(inputs, seed=200 + i) for i in range(args.held_out)]
    torch.set_num_threads(max(args.threads))
    t0 = time.perf_counter()
    # ours: one calibration, two forms
    observed = rq.prepare(model, inputs, capture=capture, ruleset=ruleset, check=False)
    rq.calibrate(observed, calib)
    int8 = rq.convert(observed, check=False)
    qdq = rq.convert(observed, form="qdq", check=False)
    ours = rq.export_onnx(qdq, inputs, tmp / f"{name}_ours.onnx")
    t_ours = time.perf_counter() - t0
    # the peer: fp32 ONNX through onnxruntime's quantizer, same calibration batches
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp32 = tmp / f"{name}_fp32.onnx"
        torch.onnx.export(model, inputs, dynamo=True, verbose=False).save(str(fp32))
    input_names = [i.name for i in _session(fp32, 1).get_inputs()]
    peer = tmp / f"{name}_ort_int8.onnx"
    _ort_quantize(fp32, peer, input_names, calib, tmp / f"{name}_pre.onnx")
    t_peer = time.perf_counter() - t0
    print(f"\n## {name}: ours (prepare, calibrate, both forms, ONNX export) {t_ours:.0f} s; "
          f"fp32 ONNX export + ORT quantize_static {t_peer:.0f} s")
    print(f"SQNR vs fp32 in torch eager: QDQ form {_sqnr(model, qdq, held):.2f} dB, int8-kernel form "
          f"{_sqnr(model, int8, held):.2f} dB; QDQ vs int8-kernel form {_sqnr(int8, qdq, held):.1f} dB; "
          f"{qdq.meta['rewrite.quant']['coverage'].summary}")

    kernels: Dict[str, collections.Counter] = {}
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        sessions = {}
        for label, path in (("ort fp32", fp32), ("ort int8 (ORT quantizer)", peer), ("ort int8 (ours)", ours)):
            opt = tmp / f"{name}_{label.split()[-1].strip('()')}_{threads}_opt.onnx"
            sessions[label] = _ort_fn(_session(path, threads, opt))
            kernels[label] = _kernels(opt)
        fns = dict(sessions)
        fns["torch int8 (ours)"] = int8
        ms = round_robin_ms(fns, inputs, args.runs, args.warmup)
        for label in fns:
            rows.append((threads, label, ms[label], ms["ort fp32"] / ms[label],
                         ms[label] / ms["ort int8 (ORT quantizer)"], _sqnr(model, fns[label], held)))
    print(f"{'threads':>7}  {'variant':<26} {'ms':>8} {'vs ORT fp32':>12} {'vs ORT quantizer':>17} {'SQNR dB':>8}")
    for threads, label, ms_, speed, ratio, db in rows:
        print(f"{threads:>7}  {label:<26} {ms_:>8.2f} {speed:>11.2f}x {ratio:>16.2f}x {db:>8.1f}")
    interesting = ("QLinearConv", "QLinearMatMul", "MatMulInteger", "QGemm", "QLinearAdd", "QuantizeLinear",
                   "DequantizeLinear", "Conv", "FusedConv", "MatMul", "FusedMatMul", "Gemm", "Add", "QAttention")
    print("kernels onnxruntime runs (after its graph optimizations):")
    for label, counts in kernels.items():
        shown = ", ".join(f"{op} {counts[op]}" for op in interesting if counts[op])
        if args.all_kernels:
            shown = ", ".join(f"{op} {n}" for op, n in sorted(counts.items()))
        print(f"  {label:<26} {shown}")


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--calibration", type=int, default=4, help="calibration batches (the example one included)")
    p.add_argument("--held-out", type=int, default=2)
    p.add_argument("--all-kernels", action="store_true", help="list every op type onnxruntime runs")
    p.add_argument("--models", nargs="+", default=["resnet50", "bert_base"], choices=["resnet50", "bert_base", "hf_bert"])
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    import logging

    logging.getLogger().setLevel(logging.ERROR)  # ORT quantizer's per-tensor notes
    import onnxruntime as ort

    ort.set_default_logger_severity(3)  # the warning on saving optimized models
    print(f"torch {torch.__version__}, quantized engine x86; threads {args.threads}; "
          f"median of {args.runs} runs")
    with tempfile.TemporaryDirectory() as d:
        for name in args.models:
            if name == "resnet50":
                model, inputs = resnet50_with_inputs()
                bench(name, model.eval(), inputs, "fx", None, args, Path(d))
            else:
                from rewrite.examples import hf

                model, inputs = getattr(hf, name)()
                bench(name, model.eval(), inputs, "export", "linear", args, Path(d))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
