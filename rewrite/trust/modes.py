"""Higher-order ops met by the check's dispatch modes.

The check watches a run through ``TorchDispatchMode``s (the dtypes ops compute in,
where a non-finite value is born, a run widened to float64). torch hands a mode a
higher-order op (``torch.cond``, ``while_loop``, ``wrap_with_set_grad_enabled``) only
when the mode says it takes them, and otherwise raises ``NotImplementedError`` for
the whole run: a model holding a ``cond`` could not be checked once an approximate
rule fired. Every mode here takes them and calls ``run_higher_order``.

``autocast_off``: ``apply`` and the check run without the caller's ``torch.autocast``
(``ambient_autocast``: with it, for a dynamo graph traced under it).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["ambient_autocast", "autocast_off", "cpu_default_device", "fake_mode_off", "inside_torch_compile",
           "is_higher_order", "one_thread_at_a_time", "run_higher_order"]

_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps")


_AMBIENT = contextvars.ContextVar("rewrite_ambient_autocast", default=False)


@contextlib.contextmanager
def ambient_autocast() -> Iterator[None]:
    """Inside the block ``autocast_off`` leaves the caller's autocast as it is: a
    dynamo graph runs under the autocast state it was traced in (dynamo guards on
    it), so ``rewrite.backend`` rewrites and checks it in that state."""
    token = _AMBIENT.set(True)
    try:
        yield
    finally:
        _AMBIENT.reset(token)


@contextlib.contextmanager
def autocast_off() -> Iterator[None]:
    """No ``torch.autocast`` inside the block, for whichever devices the caller turned
    it on: facts recorded from an example run under it (a linear's output is
    bfloat16) would describe the model as autocast runs it, and a rewrite relying on
    them (a ``.to(torch.bfloat16)`` removed as a no-op) changes the model as it runs
    without. The rewrite is of the model itself; the check's own autocast runs (the
    precision noise of a rewrite in half precision) enter it again inside."""
    if _AMBIENT.get():
        yield
        return
    with contextlib.ExitStack() as stack:
        for device in _AUTOCAST_DEVICES:
            try:
                on = torch.is_autocast_enabled(device)
            except (RuntimeError, ValueError, TypeError):
                continue
            if on:
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


@contextlib.contextmanager
def cpu_default_device() -> Iterator[None]:
    """Factory calls inside the block make CPU tensors, as by default, whatever the
    caller set (``torch.set_default_device("meta")``, ``with torch.device(...)``):
    the inputs the check draws, the constants a rule folds and the facts recorded
    are made where the library's own code expects them, then moved to the model's
    device as they always are."""
    if torch.get_default_device().type == "cpu":
        yield
        return
    with torch.device("cpu"):
        yield


_ENTRY_LOCK = threading.RLock()
_COMPILING = contextvars.ContextVar("rewrite_inside_torch_compile", default=False)


@contextlib.contextmanager
def one_thread_at_a_time() -> Iterator[None]:
    """The library's entry points (``apply``, the check, ``verify``, capture, the
    quantization flows) run one thread at a time: each saves, seeds and puts back
    process-wide state (torch's, Python's and numpy's global random generators, the
    collector) and torch.fx's tracer keeps a process-wide flag while it traces, so
    two threads at once would each put back what the other had changed, and leave it
    changed. A thread calling in while another runs waits; the same thread may call
    in again (a model's forward that applies rules).

    Not inside torch.compile (``inside_torch_compile``: ``rewrite.backend``, the
    Inductor pass): torch holds its compile lock there (compiles are one at a time
    already), and waiting here while a thread holding this lock compiles (a model
    that runs a compiled function, ``capture(..., "dynamo")``) would deadlock."""
    if _COMPILING.get():
        yield
        return
    with _ENTRY_LOCK:
        yield


@contextlib.contextmanager
def inside_torch_compile() -> Iterator[None]:
    """Mark the block as running inside torch.compile (see ``one_thread_at_a_time``)."""
    token = _COMPILING.set(True)
    try:
        yield
    finally:
        _COMPILING.reset(token)


@contextlib.contextmanager
def fake_mode_off() -> Iterator[None]:
    """No caller's ``FakeTensorMode`` inside the block: with one active, every op on the
    model's real weights and inputs fails (torch asserts every tensor is fake), so
    the facts recorded and the check's runs would fail or, worse, record nothing and
    let no rule fire. ``apply`` works on real values, as outside the mode; the
    library's own fake runs (new nodes' metadata) enter their graph's mode inside.
    Inductor's post-grad passes run with the mode set aside already (``V.fake_mode``
    is not entered), so the Inductor pass is unaffected."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        yield


def is_higher_order(func: Any) -> bool:
    return isinstance(func, torch._ops.HigherOrderOperator)


def run_higher_order(mode: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """``torch.cond`` runs the branch its predicate takes under ``mode`` (the mode
    sees its ops, as it sees the rest of the graph's); other higher-order ops run as
    they are, unseen by it (a mode then knows less inside them: the dtypes recorder
    records fewer precisions, so the check is stricter there, never looser)."""
    if func is torch.ops.higher_order.cond:
        pred, true_fn, false_fn, operands = args
        with mode:
            return (true_fn if bool(pred) else false_fn)(*operands)
    return func(*args, **(kwargs or {}))
