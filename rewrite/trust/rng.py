"""The random number generators a checked run draws from, seeded for the run and
put back after it.

The reference and the candidate draw the same numbers (dropout in training mode)
because each run starts from the same seed; the caller's generators are left as
they were. ``torch.manual_seed`` would also queue a seed for every accelerator not
initialized yet, formatting a stack trace each time (~0.2 ms a call, several per
check), and leave the accelerators' generators changed: only the CPU's is seeded,
and CUDA's when the process uses CUDA (forked, so put back too). Python's ``random``
and numpy's global generator (a wrapped helper drawing from them: LayerDrop, an
augmentation) are seeded and put back the same way. Generator objects the model's
code holds (a module-level ``numpy.random.default_rng()``, a ``random.Random`` or
``torch.Generator`` a helper draws from: ``rewrite.ops.effects.hooked_generators``)
cannot be seeded without changing what the model computes: each run starts from
their state as the caller left it (``generator_states`` / ``put_back_states``), so
the reference and the candidate draw the same numbers and the caller's are not moved.
"""

from __future__ import annotations

import contextlib
import random
import sys
from typing import Iterator

import torch

from rewrite.ops.effects import hooked_generators

__all__ = ["generator_states", "generators_kept", "host_generator_states", "host_generators_kept", "model_generators",
           "put_back_states", "seeded"]


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
def generators_kept(held: "list | tuple" = ()) -> Iterator[None]:
    """torch's CPU generator (and every CUDA device's, once CUDA is initialized),
    Python's and numpy's, and the generator objects ``held`` are after the block as
    they were before it: a user's function a rule runs (a module factory
    initializing its weights) or a run of the model moves none of the caller's."""
    with torch.random.fork_rng(devices=_cuda_devices()), host_generators_kept(), _states_kept(held):
        yield


@contextlib.contextmanager
def seeded(seed: int, held: "list | tuple" = ()) -> Iterator[None]:
    """Within the block the CPU generator (and every CUDA device's, once CUDA is
    initialized), Python's and numpy's start from ``seed``; after it, they are as
    they were, and so are the generator objects ``held`` (``model_generators``):
    every run starts from their state as the caller left it."""
    devices = _cuda_devices()
    cuda = bool(devices)
    with torch.random.fork_rng(devices=devices), host_generators_kept(), _states_kept(held):
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.manual_seed_all(seed)
        random.seed(seed)
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed(seed % 2 ** 32)
        yield


def model_generators(fn: object) -> list:
    """The generator objects a run of ``fn`` may draw from besides the global ones
    (``rewrite.ops.effects.hooked_generators``: what its hooks and the code its graph
    calls that the library cannot read reach); none for a plain callable."""
    return hooked_generators(fn) if isinstance(fn, torch.nn.Module) else []


@contextlib.contextmanager
def _states_kept(held: "list | tuple") -> Iterator[None]:
    saved = generator_states(held)
    try:
        yield
    finally:
        put_back_states(saved)


def generator_states(generators: "list | tuple") -> list:
    """(generator, its state) for each of ``generators`` (``reach.generator_types``)."""
    return [(g, _state_of(g)) for g in generators]


def put_back_states(saved: list) -> None:
    """Each generator of ``generator_states``' answer back in the state it had."""
    for g, state in saved:
        if isinstance(g, torch.Generator):
            g.set_state(state)
        elif isinstance(g, random.Random):
            g.setstate(state)
        elif hasattr(g, "bit_generator"):  # numpy.random.Generator
            g.bit_generator.state = state
        else:  # numpy.random.RandomState
            g.set_state(state)


def _state_of(g: object) -> object:
    if isinstance(g, torch.Generator):
        return g.get_state()
    if isinstance(g, random.Random):
        return g.getstate()
    if hasattr(g, "bit_generator"):
        return g.bit_generator.state
    return g.get_state()
