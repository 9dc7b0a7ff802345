"""Quantization-aware training vs post-training quantization on real data.

    python benchmarks/qat.py [--epochs 30] [--qat-epochs 6] [--qat-lr 1e-4] [--seed 0]

scikit-learn's ``load_digits`` (1797 8x8 handwritten digits, shipped with the package:
no download), split 80/20 (stratified, fixed seed). A small CNN (three conv + batch
norm + relu, max pool, two linears) trains in float; then, on the same weights:

* PTQ int8: ``rewrite.quant.prepare`` / ``calibrate`` (on training batches) / ``convert``;
* QAT int8: ``rewrite.qat.prepare_qat`` (``rules/quant/qat.rw``, ruleset ``main``), a few
  epochs of fine-tuning, ``rewrite.qat.convert``;
* PTQ and QAT with 4-bit weights / 8-bit activations (ruleset ``w4``; "PTQ" is the
  prepared model converted right after calibration, without training), and the same
  with 2-bit weights (a copy of the w4 rules with another literal: a rule-file policy).

Every accuracy is the converted int8 model's (``torch.ops.quantized`` kernels) on the
test split; the float model's is measured in the same run. Last, the converted QAT
and PTQ int8 models are timed on the test split, interleaved, and their ratio printed
(the same kernels: it should be 1).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rewrite  # noqa: E402
import rewrite.qat as rqat  # noqa: E402
import rewrite.quant as rq  # noqa: E402


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.conv3, self.bn3 = nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = F.relu(self.bn3(self.conv3(x)))
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


def load_digits_split(seed: int) -> tuple:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    idx_train, idx_test = train_test_split(range(len(y)), test_size=0.2, random_state=seed, stratify=data.target)
    return x[idx_train], y[idx_train], x[idx_test], y[idx_test]


def batches(x: torch.Tensor, y: torch.Tensor, size: int, gen: torch.Generator) -> list:
    order = torch.randperm(len(y), generator=gen)
    return [(x[order[i:i + size]], y[order[i:i + size]]) for i in range(0, len(y), size)]


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, lr: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, epochs * ((len(y) + 63) // 64)))
    model.train()
    for _ in range(epochs):
        for xb, yb in batches(x, y, 64, gen):
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    model.eval()


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        out = model(x)
    out = out[0] if isinstance(out, tuple) else out
    return 100.0 * float((out.argmax(1) == y).float().mean())


def rules_with_weight_bits(bits: int):
    """The shipped qat.rw with ruleset w4's weight rules at another bit width: the
    policy is a literal in the rule file."""
    text = (rewrite.rules_dir() / "quant" / "qat.rw").read_text()
    old = '4, "per_channel_symmetric")'
    if text.count(old) != 3:
        raise SystemExit(f"expected the 3 weight rules of ruleset w4 in qat.rw, found {text.count(old)}")
    text = text.replace(old, f'{bits}, "per_channel_symmetric")')
    return rewrite.parse(text, f"qat_w{bits}.rw")


def qat_pair(model, example, calib, xtr, ytr, xte, yte, *, ruleset="main", rules=None, epochs=6, lr=1e-4,
             seed=0) -> tuple:
    """(PTQ accuracy, QAT accuracy, QAT fake-quant accuracy, int8 QAT model) through the QAT
    flow: converted right after calibration, then after fine-tuning."""
    prepared = rqat.prepare_qat(model, example, ruleset=ruleset, rules=rules, calibration=calib)
    ptq = rqat.convert(prepared)
    ptq_acc = accuracy(ptq, xte, yte)
    train(prepared, xtr, ytr, epochs, lr, seed)
    fake = accuracy(prepared.eval(), xte, yte)
    int8 = rqat.convert(prepared)
    return ptq_acc, accuracy(int8, xte, yte), fake, int8


def timing(models: dict, x: torch.Tensor, repeats: int) -> tuple:
    """Median time of each model, the median of the per-round time ratios of the
    second to the first (rounds alternate which runs first: paired, so load on the
    machine that shifts both cancels), and the ratio of their best times."""
    times: dict = {k: [] for k in models}
    ratios = []
    names = list(models)
    with torch.no_grad():
        for m in models.values():
            m(x)
        for i in range(repeats):
            for k in (names if i % 2 == 0 else names[::-1]):
                t0 = time.perf_counter()
                models[k](x)
                times[k].append(time.perf_counter() - t0)
            ratios.append(times[names[1]][-1] / times[names[0]][-1])
    best = {k: min(v) for k, v in times.items()}
    return ({k: statistics.median(v) for k, v in times.items()}, statistics.median(ratios),
            best[names[1]] / best[names[0]])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=30, help="float training epochs")
    p.add_argument("--qat-epochs", type=int, default=6, help="QAT fine-tuning epochs (int8, 4-bit weights)")
    p.add_argument("--qat-lr", type=float, default=1e-4, help="QAT learning rate (int8, 4-bit weights)")
    p.add_argument("--low-bit-epochs", type=int, default=10, help="QAT fine-tuning epochs, 2-bit weights")
    p.add_argument("--low-bit-lr", type=float, default=5e-4, help="QAT learning rate, 2-bit weights")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=100, help="timing repeats (interleaved)")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore", UserWarning)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    start = time.perf_counter()

    xtr, ytr, xte, yte = load_digits_split(args.seed)
    model = DigitsCNN()
    train(model, xtr, ytr, args.epochs, 3e-3, args.seed)
    float_acc = accuracy(model, xte, yte)
    example = (xtr[:64],)
    calib = [(xb,) for xb, _ in batches(xtr, ytr, 64, torch.Generator().manual_seed(1))[:8]]

    observed = rq.prepare(model, example)
    rq.calibrate(observed, calib)
    ptq8 = rq.convert(observed)
    ptq8_acc = accuracy(ptq8, xte, yte)
    common = dict(epochs=args.qat_epochs, lr=args.qat_lr, seed=args.seed)
    ptq8_flow, qat8_acc, qat8_fake, qat8 = qat_pair(model, example, calib, xtr, ytr, xte, yte, ruleset="main",
                                                   **common)
    ptq4_acc, qat4_acc, qat4_fake, _ = qat_pair(model, example, calib, xtr, ytr, xte, yte, ruleset="w4", **common)
    ptq2_acc, qat2_acc, qat2_fake, _ = qat_pair(model, example, calib, xtr, ytr, xte, yte, ruleset="w4",
                                               rules=rules_with_weight_bits(2), epochs=args.low_bit_epochs,
                                               lr=args.low_bit_lr, seed=args.seed)

    print(f"load_digits: {len(ytr)} train / {len(yte)} test images (1 image = {100 / len(yte):.2f} points); "
          f"float CNN {args.epochs} epochs; QAT {args.qat_epochs} epochs at lr {args.qat_lr:g} (2-bit: "
          f"{args.low_bit_epochs} at {args.low_bit_lr:g}); test accuracy (%) of the converted int8 models")
    print(f"{'weights / activations':<24}{'float':>8}{'PTQ':>8}{'QAT':>8}{'PTQ loss':>10}{'QAT loss':>10}"
          f"{'recovered':>11}")
    for name, ptq_acc, qat_acc in (("int8 / int8", ptq8_acc, qat8_acc), ("4-bit / int8", ptq4_acc, qat4_acc),
                                   ("2-bit / int8", ptq2_acc, qat2_acc)):
        lost, qlost = float_acc - ptq_acc, float_acc - qat_acc
        rec = f"{100 * (lost - qlost) / lost:.0f}%" if lost > 0 else "PTQ lost 0"
        print(f"{name:<24}{float_acc:>8.2f}{ptq_acc:>8.2f}{qat_acc:>8.2f}{lost:>10.2f}{qlost:>10.2f}{rec:>11}")
    print(f"PTQ int8 is rewrite.quant (histogram observers); the 4- and 2-bit PTQ figures are the QAT flow "
          f"converted before training (moving-average min/max), int8 that way: {ptq8_flow:.2f}")
    print(f"QAT fake-quant model (before convert): int8 {qat8_fake:.2f}, 4-bit {qat4_fake:.2f}, "
          f"2-bit {qat2_fake:.2f}")
    cov = qat8.meta["rewrite.quant"]["coverage"]
    print(f"QAT int8 model: {cov.summary}; PTQ int8 model: {ptq8.meta['rewrite.quant']['coverage'].summary}")
    kernels = lambda gm: sorted(type(m).__name__ + ":" + getattr(m, "op_name", "")  # noqa: E731
                                for m in gm.modules() if hasattr(m, "op_name"))
    print(f"same int8 kernels as PTQ: {kernels(qat8) == kernels(ptq8)} ({', '.join(kernels(qat8))})")
    t, ratio, best = timing({"ptq": ptq8, "qat": qat8}, xte, args.repeats)
    print(f"speed on the test split ({args.repeats} interleaved rounds, 1 thread): median PTQ int8 "
          f"{t['ptq'] * 1e3:.2f} ms, QAT int8 {t['qat'] * 1e3:.2f} ms; QAT/PTQ time ratio {ratio:.3f} "
          f"(median of paired rounds), {best:.3f} (best of each)")
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
