"""Round-robin timing shared by the benchmarks.

Each round calls every variant once, starting from a different one each round, so
slow drift of a noisy host (frequency, other load) hits all variants alike; the
median over rounds is reported. Run under ``torch.inference_mode()``, as deployed.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict

import torch

__all__ = ["round_robin_ms"]


def round_robin_ms(fns: Dict[str, Callable], args: tuple, runs: int, warmup: int) -> Dict[str, float]:
    """name -> median milliseconds of ``fns[name](*args)`` over ``runs`` rounds."""
    samples: Dict[str, list] = {name: [] for name in fns}
    names = list(fns)
    with torch.inference_mode():
        for _ in range(warmup):
            for name in names:
                fns[name](*args)
        for i in range(runs):
            for name in names[i % len(names):] + names[: i % len(names)]:
                start = time.perf_counter()
                fns[name](*args)
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) * 1e3 for name, s in samples.items()}
