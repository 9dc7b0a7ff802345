"""The original's own rounding error, for models that compute in half precision.

A model that computes in bfloat16 or float16 is itself far from the exact function
it spells: through the 28 conv + batch-norm pairs of a ResNet with sharp statistics, its
bfloat16 outputs are a few percent off what the same graph computes in float32. A
rewrite in the same precision (a batch norm folded into the conv's weights) rounds
elsewhere and lands as far off in another direction, so comparing it with the
original under bfloat16's tolerance fails although it is no worse than the original.

So when a comparison fails and the original computes in half precision, the check
runs the original once more with every half-precision tensor and dtype widened to
float32 (``widened_run``: torch function and dispatch modes, so the graph and its
parameters are as they are), measures how far the original's outputs are from that
run, and compares the rewrite with that run, ``NOISE_MULTIPLIER`` times the
original's error around each element (``rounding_noise``) allowed on top of the
tolerance. This is the rule torch's own accuracy checker applies to compiled models
against a float64 run (``torch._dynamo.utils.same``: the compiled error within a
multiple of the eager error); here element by element, with the tolerance's window.

The other way round, a rewrite that newly computes a float32 model in bfloat16 (the
AMP rule sets) is held to bfloat16's tolerance, which one linear layer early in a
deep net can exceed by itself. When such a comparison fails, the original runs
once more under ``torch.autocast`` to that dtype (``narrowed_run``): torch's own
mixed precision is the measure of what computing the model in it costs, and the
rewrite may be ``NOISE_MULTIPLIER`` times as far from the original as autocast's run
is around each element (``rounding_noise`` with the roles swapped: the original is
the truth, autocast's run the rounded one).

Nothing is relaxed when the widened run is not the same computation: an op that
writes a half-precision tensor it did not create (the widened copy would take the
write), a run that raises, or outputs of another structure or shape. Nor when the
original's error is not rounding: outputs off by more than half their scale, whose
rewrite no comparison could judge.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Tuple

import torch
from torch.utils import _pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from rewrite.trust.modes import is_higher_order, run_higher_order
from rewrite.trust.rng import model_generators, seeded
from rewrite.trust.runner import call_with
from rewrite.trust.tolerance import SCALE_RADIUS, window_max

__all__ = ["HALF", "WIDE", "NOISE_MULTIPLIER", "NOISE_FLOOR", "computes_in_half", "widened_run",
           "narrowed_run", "rounding_noise"]

#: the precisions whose own rounding the check measures
HALF = (torch.bfloat16, torch.float16)
#: what they are widened to: float32's rounding is 2**-16 of bfloat16's
WIDE = torch.float32
#: a rewrite may differ from the original by this many times the original's own
#: error (the error of the rewrite and the original's, each about as large, and a margin)
NOISE_MULTIPLIER = 3.0
#: an element's error is at least this fraction of the tensor's largest (rounding
#: through a deep net does not stay where it started): 0.1 failed a legitimate fold
#: of a bfloat16 ResNet, 0.5 let a 5% error of a float32 model's gelus pass, of the
#: cases tried (see the closing note of the session that chose it)
NOISE_FLOOR = 0.25
#: an original farther than this share of its scale from its widened run is not
#: rounded, it is something else: no relaxation
NOISE_LIMIT = 0.5


class _NotTheSame(Exception):
    """The widened run would not compute what the original does."""


class _Widening:
    """The float32 copies a widened run made of half-precision tensors it was given
    (parameters, buffers, inputs, constants): a write into one would be lost to the
    original tensor, which later reads would still see."""

    def __init__(self, narrow: tuple = HALF, wide: torch.dtype = WIDE) -> None:
        self.copies: dict = {}  # storage address -> the copy (kept alive for the run)
        self.narrow, self.wide = narrow, wide

    def widen(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dtype in self.narrow and not x.is_quantized:
            wide = x.to(self.wide)
            self.copies[wide.untyped_storage()._cdata] = wide
            return wide
        if isinstance(x, torch.dtype) and x in self.narrow:
            return self.wide
        return x

    def refuse_writes(self, func: Any, args: tuple, kwargs: dict) -> None:
        """``_NotTheSame`` when ``func`` writes a half-precision tensor or a copy of one."""
        schema = getattr(func, "_schema", None)
        if schema is None or not schema.is_mutable:
            return
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                for t in pytree.tree_leaves(value):
                    if isinstance(t, torch.Tensor) and (t.dtype in self.narrow or _storage(t) in self.copies):
                        raise _NotTheSame(f"{func} writes a half-precision tensor")


def _storage(t: torch.Tensor) -> Any:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None


class _WidenedCalls(TorchFunctionMode):
    """Widens the arguments of every torch call (composite ops such as ``conv2d``
    check their arguments' dtypes before they reach the dispatcher)."""

    def __init__(self, widening: _Widening) -> None:
        super().__init__()
        self.widening = widening

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        args, kwargs = pytree.tree_map(self.widening.widen, (args, kwargs or {}))
        return func(*args, **kwargs)


#: export's dtype checks (``rewrite.engine.facts.METADATA_CHECKS``, which imports the
#: check: not imported from there)
_METADATA_CHECKS = frozenset({torch.ops.aten._assert_tensor_metadata.default})


class _UncheckedMetadata(TorchDispatchMode):
    """Export's dtype checks pass: autocast computes in another dtype on purpose.
    And the core ATen ops CPU autocast has no rule for, though it narrows their
    non-core spellings (``aten.convolution``, every conv of an ``export_core`` graph,
    where autocast narrows ``conv2d``), compute in ``dtype`` as those would: without
    it the estimate of a narrowing's noise on a core ATen graph was none at all."""

    supports_higher_order_operators = True  # rewrite.trust.modes

    def __init__(self, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if is_higher_order(func):
            return run_higher_order(self, func, args, kwargs)
        if func in _METADATA_CHECKS:
            return None
        if self.dtype is not None and func in _AUTOCAST_MISSED:
            args, kwargs = pytree.tree_map_only(
                torch.Tensor, lambda t: t.to(self.dtype) if t.dtype == torch.float32 else t, (args, kwargs or {}))
        return func(*args, **(kwargs or {}))


#: core ATen ops autocast lets through at float32 while it narrows what they come
#: from (``conv1d``/``conv2d``/``conv_transpose2d``/... all decompose to this one)
_AUTOCAST_MISSED = frozenset({torch.ops.aten.convolution.default})


class _WidenedOps(TorchDispatchMode):
    """Every op computes on float32 copies of its half-precision arguments and makes
    float32 where it was asked for a half precision (``_to_copy``, factories); an op
    that writes a half-precision tensor, or the copy of one, ends the run."""

    supports_higher_order_operators = True  # rewrite.trust.modes

    def __init__(self, widening: _Widening) -> None:
        super().__init__()
        self.widening = widening

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if is_higher_order(func):
            return run_higher_order(self, func, args, kwargs)
        if func in _METADATA_CHECKS:  # export's dtype checks: another precision is the point here
            return None
        kwargs = kwargs or {}
        self.widening.refuse_writes(func, args, kwargs)
        args, kwargs = pytree.tree_map(self.widening.widen, (args, kwargs))
        return func(*args, **kwargs)


def computes_in_half(outputs: Any, dtypes: Any = ()) -> bool:
    """Whether a run with these outputs, whose ops computed in ``dtypes`` (what the
    check recorded, when it did), is in half precision anywhere."""
    return any(d in HALF for d in dtypes) or any(
        isinstance(t, torch.Tensor) and t.dtype in HALF for t in pytree.tree_leaves(outputs))


def widened_run(fn: Any, args: Any, rng_seed: int, to_float64: bool = False) -> Any:
    """``fn(*args)`` with half precision widened to float32 (``to_float64``: half
    precision and float32 widened to float64), under ``no_grad``, the RNG seeded as
    the check's runs are; None when that is not the same computation. ``args`` must
    be private: the run may write the widened ones."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(seeded(rng_seed, model_generators(fn)))
        widening = _Widening(HALF + (torch.float32,), torch.float64) if to_float64 else _Widening()
        stack.enter_context(_WidenedCalls(widening))
        stack.enter_context(_WidenedOps(widening))
        try:
            return call_with(fn, args)
        except Exception:  # noqa: BLE001 - _NotTheSame, or an op float32 does not take: no estimate
            return None


def narrowed_run(fn: Any, args: Any, rng_seed: int, dtype: torch.dtype) -> Any:
    """``fn(*args)`` under ``torch.autocast("cpu", dtype)`` (under ``no_grad``, the RNG
    seeded as the check's runs are), or None when it raises or ``dtype`` is not a half
    precision. A call autocast cannot run in ``dtype`` (oneDNN's float16 LSTM on
    CPU) runs in float32 instead (``_Float32WhereAutocastRefuses``), as the AMP
    rules leave such an op: the run is mixed precision where torch's can be.
    ``args`` must be private."""
    if dtype not in HALF:
        return None
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(seeded(rng_seed, model_generators(fn)))
        try:
            stack.enter_context(torch.autocast("cpu", dtype=dtype))
            stack.enter_context(_UncheckedMetadata(dtype))
            stack.enter_context(_Float32WhereAutocastRefuses())
            return call_with(fn, args)
        except Exception:  # noqa: BLE001 - an op that runs in neither: no estimate
            return None


class _Float32WhereAutocastRefuses(TorchFunctionMode):
    """A torch call that raises under autocast runs again without it, its half
    precision tensor arguments widened to float32 (what autocast made of their
    producers). Tried first as it is: an op autocast runs stays as torch runs it. A
    call that writes one of the widened copies raises (no estimate): its write
    would not reach the tensor later calls read."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except Exception:  # noqa: BLE001 - retried in float32; raises again if that fails too
            if not torch.is_autocast_enabled("cpu"):
                raise
        copies: list = []
        widened = pytree.tree_map_only(torch.Tensor, lambda t: _float32_if_half(t, copies), (args, kwargs))
        versions = [t._version for t in copies]
        with torch.autocast("cpu", enabled=False):
            out = func(*widened[0], **widened[1])
        if any(t._version != v for t, v in zip(copies, versions)):
            # an in-place call (``h[:, i] = v`` into the float16 h autocast made) wrote
            # the float32 copy: what reads h later would not see it, another computation
            raise RuntimeError("an in-place call autocast refuses wrote a widened copy")
        return out


def _float32_if_half(t: torch.Tensor, copies: list) -> torch.Tensor:
    if t.dtype not in HALF:
        return t
    copy = t.float()
    copies.append(copy)
    return copy


def rounding_noise(outputs: Any, truth: Any) -> Optional[Tuple[Optional[Tuple[torch.Tensor, torch.Tensor]], ...]]:
    """Per leaf of ``outputs`` (pytree order), ``(truth, error)``: the value of the
    more precise run, and how far each element of the less precise one may be from
    it by rounding: the largest ``|outputs - truth|`` within the tolerance's window
    around it (along any dim), at least ``NOISE_FLOOR`` of the tensor's largest
    (rounding through a deep net does not stay where it started). Both float64;
    None for a leaf that is not a floating tensor, or whose truth is not finite
    where the output is. None for all: the runs are not the same computation
    (another structure, shape, or an error past ``NOISE_LIMIT`` of the scale)."""
    if truth is None or outputs is None:
        return None
    ours, spec = pytree.tree_flatten(outputs)
    theirs, their_spec = pytree.tree_flatten(truth)
    if spec != their_spec:
        return None
    noise: list = []
    for r, w in zip(ours, theirs):
        if not (isinstance(r, torch.Tensor) and r.is_floating_point() and not r.is_quantized):
            noise.append(None)
            continue
        if not isinstance(w, torch.Tensor) or w.shape != r.shape or not w.is_floating_point():
            return None
        r64, w64 = r.detach().to(torch.float64), w.detach().to(torch.float64)
        finite = torch.isfinite(r64)
        if r64.numel() == 0 or not bool((torch.isfinite(w64) | ~finite).all()):
            noise.append(None)
            continue
        error = torch.where(finite, (r64 - w64).abs(), torch.zeros((), dtype=torch.float64))
        if not bool(error.any()):
            noise.append(None)
            continue
        scale = float(w64[finite].abs().max()) if bool(finite.any()) else 0.0
        if float(error.max()) > NOISE_LIMIT * scale:
            return None
        noise.append((w64, _neighbourhood_max(error)))
    return tuple(noise)


def _neighbourhood_max(error: torch.Tensor) -> torch.Tensor:
    """The largest error within ``SCALE_RADIUS`` elements along any dim of each
    element, at least ``NOISE_FLOOR`` of the largest."""
    if error.dim() == 0:
        return error
    most = None
    for dim in range(error.dim()):
        along = window_max(error, dim, SCALE_RADIUS)
        most = along if most is None else torch.maximum(most, along)
    return torch.maximum(most, error.max() * NOISE_FLOOR)
