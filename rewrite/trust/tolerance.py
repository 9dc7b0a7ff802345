"""One tolerance comparator for ``apply``'s check and for rule verification.

Both ask the same question of a reference tensor and a candidate: are they the same
value, up to what a rewrite of this kind may change? The answer's rules live here
once; ``rewrite.trust.check`` and ``rewrite.trust.verify`` only choose a
``Tolerance`` and phrase the path of the output.

Whatever the tolerance: shapes and dtypes must be the same; integer and bool values
equal (or, under a lower precision, at least an agreement share of them); quantized
values must keep their quantization parameters and integer values (``quant_steps``
apart at most); NaN equals NaN and an infinity itself; and a value finite in the
reference must not be inf or NaN in the candidate. Floating values pass when, element
by element, ``|cand - ref| <= rtol * |ref| + allowed``, where ``allowed`` is ``atol``
itself (``floor`` None) or ``atol * max(unit, local scale)`` (``local_scale`` with that
floor: a floor of 1 is the tensor's largest value; ``unit`` 1, or 0 for the check's
second look at outputs below 1: ``rewrite.trust.check``), and never less than
``quantum`` (one int8 step of a graph that rounds through int8 values).
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import attrs
import torch

__all__ = [
    "TOLERANCES", "EXACT_TOLERANCES", "DEFAULT_TOLERANCE", "SCALE_FLOOR", "EXACT_SCALE_FLOOR",
    "Tolerance", "Difference", "local_scale", "window_max", "loosest", "compare_tensors", "newly_nonfinite",
]

#: dtype -> (rtol, atol_base) for approximate rewrites (folds, casts to lower
#: precision); atol = atol_base * max(1, local scale of the reference).
TOLERANCES: Dict[torch.dtype, Tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.complex128: (1e-7, 1e-7),
    torch.float32: (1e-3, 1e-3),
    torch.complex64: (1e-3, 1e-3),
    # half precision: about two units in the last place at 1.0, as for exact rewrites
    # (a rewrite to float16 is never held tighter than float16's own rounding)
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
#: dtype -> (rtol, atol_base) for exact rewrites: only rounding may differ.
EXACT_TOLERANCES: Dict[torch.dtype, Tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.complex128: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.complex64: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
DEFAULT_TOLERANCE = (1e-3, 1e-3)
_TABLES = {"approx": TOLERANCES, "exact": EXACT_TOLERANCES}

#: A tolerance allows at least this many of its dtype's smallest subnormals: a
#: subnormal result (4e-45 in float32) holds a digit or two, a scale-relative bound
#: would fall below one step of it
_SUBNORMAL_STEPS = 2
#: Neighbours on each side along a dim that make up an element's surroundings.
SCALE_RADIUS = 2
#: Exact rewrites: the local scale is at least this fraction of the tensor's largest value.
EXACT_SCALE_FLOOR = 0.1
#: Approximate rewrites: the local scale of an element is at least this fraction of
#: the tensor's largest value. Where a dtype's rounding is close to its tolerance
#: (half precision), rounding of large inputs can dominate a small element, and only
#: the tensor's scale is safe (1.0, the default).
SCALE_FLOOR: Dict[torch.dtype, float] = {
    torch.float64: 1e-2,
    torch.complex128: 1e-2,
    torch.float32: 1e-2,
    torch.complex64: 1e-2,
}


def loosest(dtypes, kind: str = "approx") -> Optional[torch.dtype]:
    """The dtype with the loosest tolerance of ``kind`` among ``dtypes`` (None if empty);
    of two with the same entry (float16 and float32 for approximate rewrites), the
    lower precision, whose scale floor is the looser (``SCALE_FLOOR``)."""
    table = _TABLES[kind]

    def key(d: torch.dtype) -> tuple:
        eps = torch.finfo(d).eps if d.is_floating_point or d.is_complex else 0.0
        return table.get(d, DEFAULT_TOLERANCE), eps

    return max(dtypes, key=key, default=None)


@attrs.frozen
class Tolerance:
    """What a comparison allows (see the module docstring)."""

    rtol: float
    atol: float
    floor: Optional[float] = None  # None: atol is absolute; else atol * max(1, local scale)
    quantum: float = 0.0
    quant_steps: int = 0
    label: str = "exact"
    #: the local scale counts as at least this (1: ``atol`` is absolute below 1,
    #: the rounding of intermediate values about 1 that cancel; 0: a tensor whose
    #: values are all below 1 is held to its own scale, any other as with 1)
    unit: float = 1.0

    @classmethod
    def bitwise(cls) -> "Tolerance":
        """Bit for bit (NaN = NaN, -0.0 = 0.0): a rule declared exact, verified."""
        return cls(0.0, 0.0, None, label="exact rule")

    @classmethod
    def of(cls, dtype: torch.dtype, kind: str, rtol: Optional[float] = None, atol: Optional[float] = None,
           floor: Optional[float] = None, quantum: float = 0.0) -> "Tolerance":
        """``kind``'s table entry for ``dtype`` (``"exact"``: rounding only; ``"approx"``);
        an explicit ``rtol`` or ``atol`` overrides it (``atol`` is then absolute). The
        floor defaults to ``EXACT_SCALE_FLOOR`` / ``SCALE_FLOOR`` of the dtype."""
        base_rtol, base_atol = _TABLES[kind].get(dtype, DEFAULT_TOLERANCE)
        if floor is None:
            floor = EXACT_SCALE_FLOOR if kind == "exact" else SCALE_FLOOR.get(dtype, 1.0)
        return cls(base_rtol if rtol is None else rtol, base_atol if atol is None else atol,
                   None if atol is not None else floor, quantum, 0 if kind == "exact" else 1,
                   f"{kind} tolerance for {str(dtype).replace('torch.', '')}")


@attrs.frozen
class Difference:
    """Why a candidate is not the reference: a sentence and the errors measured."""

    message: str
    abs_error: float = math.inf
    rel_error: float = math.inf


def window_max(mag: torch.Tensor, dim: int, radius: int) -> torch.Tensor:
    """The largest value within ``radius`` elements along ``dim`` of each element."""
    moved = mag.movedim(dim, -1)
    n = moved.shape[-1]
    flat = moved.reshape(-1, 1, n)
    pooled = torch.nn.functional.max_pool1d(flat, 2 * radius + 1, stride=1, padding=radius)
    return pooled.reshape(moved.shape).movedim(-1, dim)


def local_scale(ref: torch.Tensor, floor: float = 1e-2, radius: int = SCALE_RADIUS) -> torch.Tensor:
    """Per element, the magnitude of the reference around it: over the tensor's
    dims, the smallest of the largest ``|ref|`` within ``radius`` elements along
    that dim, and at least ``floor`` times the largest ``|ref|`` of the tensor
    (``floor >= 1``: the tensor's largest value everywhere). Non-finite values do
    not count. A column of scores next to a column of box coordinates, or a run of
    scores concatenated before the boxes, keeps the scores' scale."""
    mag = ref.abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).to(torch.float64)
    if mag.dim() == 0 or mag.numel() == 0:
        return mag
    if floor >= 1.0:
        return mag.max().expand_as(mag)
    scale = None
    for dim in range(mag.dim()):
        along = window_max(mag, dim, radius)
        scale = along if scale is None else torch.minimum(scale, along)
    return torch.maximum(scale, mag.max() * floor)


def _value(t: torch.Tensor, i: int) -> str:
    v = t.flatten()[i]
    return f"{float(v.real) if v.is_complex() else float(v):.6g}" if v.is_floating_point() or v.is_complex() \
        else str(int(v))


def _at(mask: torch.Tensor, ref: torch.Tensor, got: torch.Tensor, score: Optional[torch.Tensor] = None) -> str:
    """Where the (worst, by ``score``) flagged element is, with both values."""
    flat = mask.flatten()
    i = int(torch.argmax(torch.where(flat, score.flatten(), torch.full_like(score.flatten(), -math.inf)))) \
        if score is not None else int(flat.nonzero()[0])
    index = [int(k) for k in torch.unravel_index(torch.tensor(i), ref.shape)] if ref.dim() else []
    return f"at {index}: expected {_value(ref, i)}, got {_value(got, i)}"


def newly_nonfinite(ref: torch.Tensor, got: torch.Tensor) -> Optional[Difference]:
    """A value finite in ``ref`` and inf or NaN in ``got``: wrong whatever the tolerance."""
    if ref.is_quantized or got.is_quantized or not (ref.is_floating_point() or ref.is_complex()) \
            or ref.shape != got.shape:
        return None
    bad = torch.isfinite(ref) & ~torch.isfinite(got.to(ref.dtype) if got.dtype != ref.dtype else got)
    if not bool(bad.any()):
        return None
    return Difference(f"{int(bad.sum())} of {ref.numel()} elements finite in the original are inf or nan "
                      f"in the rewritten graph (wrong whatever the tolerance); {_at(bad, ref, got)}")


def _dtype(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def _quantized(ref: torch.Tensor, got: torch.Tensor, steps_allowed: int) -> Optional[Difference]:
    if ref.qscheme() != got.qscheme():
        return Difference(f"quantization scheme {ref.qscheme()} became {got.qscheme()}")
    if ref.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        if ref.q_scale() != got.q_scale() or ref.q_zero_point() != got.q_zero_point():
            return Difference(f"quantization parameters (scale {ref.q_scale():.6g}, zero point "
                              f"{ref.q_zero_point()}) became (scale {got.q_scale():.6g}, zero point "
                              f"{got.q_zero_point()})")
    elif not (torch.equal(ref.q_per_channel_scales(), got.q_per_channel_scales())
              and torch.equal(ref.q_per_channel_zero_points(), got.q_per_channel_zero_points())
              and ref.q_per_channel_axis() == got.q_per_channel_axis()):
        return Difference("per-channel quantization parameters differ")
    ri, gi = ref.int_repr().to(torch.int64), got.int_repr().to(torch.int64)
    steps = (ri - gi).abs()
    bad = steps > steps_allowed
    if not bool(bad.any()):
        return None
    what = "differ (exact rule)" if steps_allowed == 0 else "more than one quantization step apart"
    return Difference(f"{int(bad.sum())} of {ref.numel()} quantized elements {what} (max {int(steps.max())} "
                      f"steps); {_at(bad, ri, gi)}", float(steps.max()), float(steps.max()))


def _integers(ref: torch.Tensor, got: torch.Tensor, agreement: Optional[float]) -> Optional[Difference]:
    diff = (ref.long() - got.long()).abs() if ref.dtype != torch.bool else (ref != got).long()
    if not bool(diff.any()):
        return None
    n = int((diff != 0).sum())
    if agreement is not None and 1 - n / ref.numel() >= agreement:
        return None  # within the agreement rate a lower precision allows
    max_abs = float(diff.max())
    scale = max(1.0, float(ref.long().abs().max())) if ref.dtype != torch.bool else 1.0
    required = f"agreement >= {agreement:.0%} required" if agreement is not None else "compared exactly"
    return Difference(f"{n} of {ref.numel()} elements differ ({_dtype(ref.dtype)} output: {required}); "
                      f"{_at(diff != 0, ref, got)}", max_abs, max_abs / scale)


#: A value equal in both runs and this many times the median magnitude of the values
#: that differ is a
#: fill (a mask's ``finfo.min``, ``-1e9``, ``-1e4``), not a magnitude anything was
#: computed from: it does not widen its neighbours' tolerance.
FILL_RATIO = 1e4


def _without_fills(r: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``r`` with its fill values (``FILL_RATIO``) zeroed, for the local scale: a wrong
    score next to a masked ``finfo.min`` keeps its own scale."""
    mag, same = r.abs(), r == g
    differing = mag[~same & torch.isfinite(mag) & (mag > 0)]  # what the rewrite computes otherwise
    if differing.numel() == 0:
        return r
    fills = same & (mag > FILL_RATIO * float(differing.median()))
    return torch.where(fills, torch.zeros((), dtype=r.dtype), r) if bool(fills.any()) else r


def _kind_change(ref: torch.Tensor, got: torch.Tensor) -> Optional[str]:
    """What the caller sees of a tensor besides its shape, dtype and values, when it
    changed: its layout (an mkldnn or sparse tensor takes other ops), its device, and
    the lazy conjugate and negative bits (``view_as_real`` and ``numpy()`` refuse a
    tensor with the conjugate bit set)."""
    if got.layout != ref.layout:
        return f"layout {got.layout} != expected {ref.layout}"
    if got.device != ref.device:
        return f"device {got.device} != expected {ref.device}"
    for bit, what in (("is_conj", "conjugate"), ("is_neg", "negative")):
        if getattr(got, bit)() and not getattr(ref, bit)():  # one cleared serves every use the set one did
            return f"the lazy {what} bit is set in the rewrite's output, not in the original's ({bit}() tells)"
    return None


def compare_tensors(ref: torch.Tensor, got, tol: Tolerance, agreement: Optional[float] = None,
                    noise: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                    noise_multiplier: float = 0.0) -> Tuple[float, float, Optional[Difference]]:
    """``(max abs error, max rel error, the first difference or None)`` of ``got``
    against ``ref`` under ``tol``; ``agreement`` lets that share of integer
    elements suffice (a lower precision may flip an argmax). ``noise``
    (``rewrite.trust.precision.rounding_noise``): a more precise run of the
    reference and, per element, the error of the less precise one (float64); ``got``
    is then compared with the more precise run, ``noise_multiplier`` times that error
    allowed on top of the tolerance (inf and NaN still compare with the reference)."""
    if not isinstance(got, torch.Tensor):
        return math.inf, math.inf, Difference(f"expected a tensor, got {type(got).__name__}")
    if tuple(got.shape) != tuple(ref.shape):
        return math.inf, math.inf, Difference(f"shape {tuple(got.shape)} != expected {tuple(ref.shape)}")
    if got.dtype != ref.dtype:
        return math.inf, math.inf, Difference(f"dtype {_dtype(got.dtype)} != expected {_dtype(ref.dtype)}")
    kind = _kind_change(ref, got)
    if kind is not None:
        return math.inf, math.inf, Difference(kind)
    r, g = ref.detach().cpu(), got.detach().cpu()
    if r.numel() == 0:
        return 0.0, 0.0, None
    if r.is_quantized:
        problem = _quantized(r, g, tol.quant_steps)
        return (0.0, 0.0, None) if problem is None else (problem.abs_error, problem.rel_error, problem)
    if not (r.is_floating_point() or r.is_complex()):
        problem = _integers(r, g, agreement)
        return (0.0, 0.0, None) if problem is None else (problem.abs_error, problem.rel_error, problem)
    r64 = r.to(torch.complex128 if r.is_complex() else torch.float64)
    g64 = g.to(r64.dtype)
    overflow = newly_nonfinite(r64, g64)
    if overflow is not None:
        return math.inf, math.inf, overflow
    special = (torch.isnan(r64) & torch.isnan(g64)) | (torch.isinf(r64) & (r64 == g64))
    diff = torch.where(special | (r64 == g64), torch.zeros(r64.shape, dtype=torch.float64), (r64 - g64).abs())
    diff = diff.nan_to_num(nan=math.inf)
    finite = r64[torch.isfinite(r64)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    max_abs = float(diff.max())
    max_rel = max_abs / scale if scale > 0 else max_abs
    if tol.floor is None:
        allowed = torch.full(r64.shape, tol.atol, dtype=torch.float64)
    else:
        # ``unit`` below 1 holds a tensor whose values are all below 1 to its own scale
        unit = tol.unit if scale < 1.0 else max(tol.unit, 1.0)
        allowed = tol.atol * local_scale(_without_fills(r64, g64), tol.floor).clamp(min=unit)
    if tol.quantum:
        allowed = allowed.clamp(min=tol.quantum)
    if tol.atol > 0:  # never below two steps of the dtype's subnormals: all rounding there
        info = torch.finfo(r.dtype)
        allowed = allowed.clamp(min=_SUBNORMAL_STEPS * info.tiny * info.eps)
    noisy = noise is not None and noise_multiplier > 0 and tuple(noise[0].shape) == tuple(r64.shape)
    if noisy:
        wide, error = noise
        # where the reference is inf or NaN, the candidate still compares with it: a
        # more precise run that is finite there does not make a finite value right
        against = torch.where(torch.isfinite(r64), wide.to(r64.dtype), r64)
        diff = torch.where(special | (r64 == g64), torch.zeros(r64.shape, dtype=torch.float64),
                           (against - g64).abs()).nan_to_num(nan=math.inf)
        allowed = allowed + noise_multiplier * error
    violating = diff > allowed + tol.rtol * r64.abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    if not bool(violating.any()):
        return max_abs, max_rel, None
    n = int(violating.sum())
    if tol.rtol == 0 and tol.atol == 0 and not tol.quantum:
        return max_abs, max_rel, Difference(
            f"{n} of {r.numel()} elements differ ({tol.label}); {_at(violating, r64, g64, diff)}", max_abs, max_rel)
    how = "absolute" if tol.floor is None else "x local scale"
    extra = f", at least one int8 step {tol.quantum:.3g}" if tol.quantum else ""
    if noisy:
        extra += f"; against the more precise run, + {noise_multiplier:g}x the less precise one's error"
    worst = int(torch.argmax(torch.where(violating, diff - allowed, torch.full_like(diff, -math.inf))))
    return max_abs, max_rel, Difference(
        f"{n} of {r.numel()} elements outside tolerance ({tol.label}: rtol={tol.rtol:.3g}, atol={tol.atol:.3g} "
        f"{how}{extra}); {_at(violating, r64, g64, diff - allowed)} (allowed abs diff "
        f"{float(allowed.flatten()[worst]):.3g}); max abs diff {max_abs:.3g}, max rel diff {max_rel:.3g}",
        max_abs, max_rel)
