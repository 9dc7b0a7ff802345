"""The random number generators a checked run draws from, seeded for the run and
put back after it.

The reference and the candidate draw the same numbers (dropout in training mode)
because each run starts from the same seed; the caller's generators are left as
they were. ``torch.manual_seed`` would also queue a seed for every accelerator not
initialized yet, formatting a stack trace each time (~0.2 ms a call, several per
check), and leave the accelerators' generators changed: only the CPU's is seeded,
and CUDA's when the process uses CUDA (forked, so put back too). Python's ``random``
and numpy's global generator (a wrapped helper drawing from them: LayerDrop, an
augmentation) are seeded and put back the same way.
"""

from __future__ import annotations

import contextlib
import random
import sys
from typing import Iterator

import torch

__all__ = ["generators_kept", "host_generator_states", "host_generators_kept", "seeded"]


@contextlib.contextmanager
def host_generators_kept() -> Iterator[None]:
    """Python's ``random`` and numpy's global generator (when numpy is imported) are
    after the block as they were before it."""
    numpy = sys.modules.get("numpy")
    state = random.getstate()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        random.setstate(state)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)


def host_generator_states() -> tuple:
    """Python's and numpy's global generator states, comparable with ``==``: a call
    between two readings that differ drew from one of them."""
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return (random.getstate(),)
    name, keys, position, has_gauss, gauss = numpy.random.get_state()
    return random.getstate(), (name, keys.tobytes(), position, has_gauss, gauss)


def _cuda_devices() -> list:
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return list(range(torch.cuda.device_count())) if cuda else []


@contextlib.contextmanager
def generators_kept() -> Iterator[None]:
    """torch's CPU generator (and every CUDA device's, once CUDA is initialized),
    Python's and numpy's are after the block as they were before it: a user's
    function a rule runs (a module factory initializing its weights) moves none of
    the caller's."""
    with torch.random.fork_rng(devices=_cuda_devices()), host_generators_kept():
        yield


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Within the block the CPU generator (and every CUDA device's, once CUDA is
    initialized), Python's and numpy's start from ``seed``; after it, they are as
    they were."""
    devices = _cuda_devices()
    cuda = bool(devices)
    with torch.random.fork_rng(devices=devices), host_generators_kept():
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.manual_seed_all(seed)
        random.seed(seed)
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed(seed % 2 ** 32)
        yield
