"""Benchmark: batch norms the plain conv -> BN fold misses, on transformers models.

For LeViT (linear -> flatten -> BatchNorm1d -> reshape_as), TextNet (RepVGG layers:
parallel conv + BN branches and a BN identity branch) and SwiftFormer (BN before 1x1
convs), built from their default configs (or ``--small`` ones) with random weights
and random BN statistics, captured with ``torch.export``: prints the BNs in the
graph before and after ``rules/fusion.rw``, the convs, which rules fired, and the
latency of the fused graph against the captured one (median of ``--runs`` calls,
round-robin, 1 thread by default). Ratios below 1 mean the fused graph is faster.
Never run as a test.

    python benchmarks/fusion_views.py --runs 20
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch

try:
    import rewrite
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import rewrite
from rewrite.capture import capture
from rewrite.examples.cnn import randomize_batchnorm
from rewrite.ops import bind_node
from timing import round_robin_ms


def _levit(small: bool) -> Any:
    from transformers import LevitConfig, LevitForImageClassification

    if small:
        return LevitForImageClassification(LevitConfig(
            image_size=64, hidden_sizes=[16, 24, 32], num_attention_heads=[1, 2, 2], depths=[1, 1, 1],
            key_dim=[8, 8, 8], patch_size=16))
    return LevitForImageClassification(LevitConfig())  # levit-128S


def _textnet(small: bool) -> Any:
    from transformers import TextNetConfig, TextNetModel

    if small:
        return TextNetModel(TextNetConfig(
            stem_out_channels=8, hidden_sizes=[8, 8, 16, 16, 32],
            conv_layer_kernel_sizes=[[[3, 3], [3, 3]], [[3, 3], [1, 3]], [[3, 3], [3, 1]], [[3, 3], [3, 3]]],
            conv_layer_strides=[[1, 2], [2, 1], [2, 1], [2, 1]]))
    return TextNetModel(TextNetConfig())


def _swiftformer(small: bool) -> Any:
    from transformers import SwiftFormerConfig, SwiftFormerForImageClassification

    if small:
        return SwiftFormerForImageClassification(SwiftFormerConfig(
            depths=[1, 1, 1, 1], embed_dims=[8, 16, 24, 32], num_labels=10))
    return SwiftFormerForImageClassification(SwiftFormerConfig())  # swiftformer-xs


MODELS: Dict[str, Callable[[bool], Any]] = {"LeViT": _levit, "TextNet": _textnet, "SwiftFormer": _swiftformer}


def _ops(gm: torch.fx.GraphModule) -> collections.Counter:
    return collections.Counter(b[0].op for n in gm.graph.nodes for b in [bind_node(n, gm)] if b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--small", action="store_true", help="tiny configs at 64x64 (seconds)")
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    warnings.filterwarnings("ignore")
    size = 64 if opts.small else opts.size
    rules = rewrite.load(str(Path(__file__).resolve().parents[1] / "rules" / "fusion.rw"))

    print(f"rules/fusion.rw on transformers models, export capture, 1x3x{size}x{size}, "
          f"{opts.threads} thread(s), median of {opts.runs}")
    print(f"{'model':<12} {'BN modules':>10} {'BN before':>9} {'BN after':>8} {'convs':>9} "
          f"{'captured ms':>11} {'fused ms':>9} {'ratio':>6}  rules")
    for name in opts.models:
        torch.manual_seed(0)
        model = randomize_batchnorm(MODELS[name](opts.small)).eval()
        args = (torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(0)),)
        gm = capture(model, args, "export")
        result = rules.apply(gm, example_inputs=args)  # checked: raises if the outputs differ
        before, after = _ops(gm), _ops(result.graph_module)
        modules = sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
        times = round_robin_ms({"captured": gm, "fused": result.graph_module}, args, opts.runs, opts.warmup)
        fired = ", ".join(f"{k} {v}" for k, v in sorted(result.counts.items()))
        print(f"{name:<12} {modules:>10} {before['batch_norm']:>9} {after['batch_norm']:>8} "
              f"{before['conv']:>4}->{after['conv']:<4} {times['captured']:>11.2f} "
              f"{times['fused']:>9.2f} {times['fused'] / times['captured']:>6.2f}  {fired}")


if __name__ == "__main__":
    main()
