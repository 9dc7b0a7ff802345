"""Equivalence by randomized execution.

A rewrite is only trusted if the rewritten graph computes the same function as
the original, so every ``apply`` runs both on the user's example inputs and on
fresh random inputs shaped like them, and compares the outputs with
tolerances that depend on the output dtype.

Input generation keeps values in ranges that make sense for the model:
floating tensors are drawn from a normal with the example's mean and standard
deviation (and stay non-negative when the example is, e.g. a variance);
integer tensors stay within the example's ``[min, max]`` so token ids and
indices remain valid; bools are random. When there are no example inputs the
shapes come from a GraphModule's placeholder metadata instead.

Tolerances: floating outputs pass when, element by element,
``|cand - ref| <= rtol * |ref| + atol_base * max(1, scale)``, where ``scale`` is the
*local* magnitude of the reference around that element: over the tensor's dims,
the smallest of the largest ``|ref|`` within two elements along that dim (a column
of scores next to a column of box coordinates, or a run of scores concatenated
before the boxes, keeps the scores' scale), and at least a floor fraction of the
tensor's largest value. Rounding grows with the magnitude of the values an element
is computed from, not with that of unrelated values in the same output, so a wrong
rule cannot hide behind large neighbours. ``(rtol, atol_base)`` and the floor come
from the kind of rewrite and a dtype: ``"exact"`` (``EXACT_TOLERANCES``, floor
``EXACT_SCALE_FLOOR``: rounding only) unless an approximate rule fired
(``TOLERANCES``, floor ``SCALE_FLOOR``); the dtype is the output's, or the lowest
precision the rewritten model computes that output from and the original did not
(per output, through the values it depends on: ``_static_lineage`` from node
metadata, else ``_DtypeRecorder`` while it runs; a bfloat16 rewrite of a float32
model is held to bfloat16's tolerance on the outputs bfloat16 reaches, whose
rounding leaves no room for a local scale: floor 1, the tensor's largest value).
Integer and bool outputs must be equal (at least ``INT_AGREEMENT`` of them where a
lower precision newly reaches them); structure, shapes and dtypes must match
exactly; NaNs match NaNs; a finite value that becomes inf or NaN never passes.
An original in half precision is itself off by its own rounding: a comparison that
fails is made again against its run widened to float32, allowing a multiple of
that error (``rewrite.trust.precision``, ``Reference.noise``).

Besides the outputs, the check compares what else the caller can observe: the
inputs after the call (a model that writes its input must write the same values;
one that did not must not start to), the module state the call writes (BatchNorm
statistics in training mode), memory sharing: an output of the candidate may not
share memory with an input, a module constant or another output where the
reference's did not, nor stop sharing it where the reference's did (an output that
is an input itself compares by value), and, on the first trial, run with gradients
enabled, an output that requires grad in the reference must in the candidate.
Both models are run on private copies of the inputs, and
their parameters and buffers are restored after the check: checking has no side
effects on either.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import warnings
import functools
import inspect
import math
import numbers
import operator
from typing import Any, Callable, Dict, Iterable, Iterator, Mapping, Optional, Sequence, Tuple, Union

import attrs
import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from rewrite.capture import is_export_guard, lifted_state_positions
from rewrite.engine.shapes import addressing, layout_of
from rewrite.engine.symbolic import size_hint
from rewrite.engine.workspace import CODE_ATTRIBUTES, gc_paused
from rewrite.module_state import AttributeSnapshot, version_of
from rewrite.ops.base import ConstRef, attribute, nodes_by_target
from rewrite.ops.effects import call_writes, hooked_containers, hooked_tensors, state_writes, written_args
from rewrite.ops.reach import storage_key, view_over
from rewrite.ops.vocabulary import CALL_OPS, OPS, bind_node
from rewrite.trust.gradients import GradientRun, grad_leaves, gradient_run, moved, redrawn
from rewrite.trust.sizes import smallest_sizes
from rewrite.trust.held import generator_copy, input_leaves, laid_out_copy, map_held
from rewrite.trust.modes import (autocast_off, cpu_default_device, fake_mode_off, is_higher_order,
                                 one_thread_at_a_time, run_higher_order)
from rewrite.trust.nonfinite import non_finite_births
from rewrite.trust.precision import HALF, NOISE_MULTIPLIER, computes_in_half, narrowed_run, rounding_noise, widened_run
from rewrite.trust.rng import host_generator_states, model_generators, seeded
from rewrite.trust.reuse import Recording, ReusePlan, record_plan, recordable
from rewrite.trust.runner import GraphRunner, active_runner, call_with, running_as_graph, runs_generated_code
from rewrite.trust.tolerance import (
    EXACT_TOLERANCES,
    TOLERANCES,
    Tolerance,
    compare_tensors,
    local_scale,
    loosest,
)

__all__ = [
    "Reference",
    "ModelRunError",
    "TOLERANCES",
    "EXACT_TOLERANCES",
    "INT_AGREEMENT",
    "local_scale",
    "Mismatch",
    "EquivalenceReport",
    "check_equivalence",
    "assert_equivalent",
    "preserved_state",
    "random_like",
    "generate_inputs",
    "validate_input_keys",
    "inputs_from_graph",
    "inputs_copy",
    "laid_out_copy",
    "new_half_precisions", "half_node_counts", "half_nodes_per_output", "more_half_nodes",
    "named_half_precisions",
    "static_float_dtypes",
    "uninitialized_filled",
]

#: A rewrite that newly computes in lower precision (bfloat16 for a float32 model) may
#: flip an integer output computed from floats (argmax, codebook indices) where two
#: candidates are within rounding: such integer outputs (those the lower precision
#: reaches) pass when at least this share of their elements is equal. Other integer
#: outputs, exact runs, and approximate ones in the model's own precision compare
#: integers exactly.
INT_AGREEMENT = 0.95

#: Range for integer placeholders when neither an example nor the graph bounds them.
DEFAULT_INT_RANGE = (0, 3)

Range = Tuple[float, float]
InputKey = Union[int, str]


class ModelRunError(RuntimeError, ValueError):
    """The original model itself fails on the inputs the check runs it on (its own
    example inputs on trial 0: too many or too few, of the wrong kind): the caller's
    input, so a ``ValueError`` too (a ``RuntimeError`` as it always was)."""


@attrs.frozen
class Mismatch:
    """The first output that differed: where, in which trial, and by how much."""

    path: str
    trial: int
    shape: Optional[Tuple[int, ...]]
    dtype: Optional[str]
    max_abs_error: float
    max_rel_error: float
    message: str
    #: (output leaf index, memory format it has in the original: "contiguous",
    #: "channels_last", "channels_last_3d") when only its layout changed, which a
    #: copy into that format at the output mends (``RuleSet.apply`` does)
    relayout: Optional[Tuple[int, str]] = None

    def __str__(self) -> str:
        where = f"{self.path} (trial {self.trial}"
        if self.shape is not None:
            where += f", shape {tuple(self.shape)}, {self.dtype}"
        return f"{where}): {self.message}"


@attrs.frozen
class EquivalenceReport:
    """Outcome of ``check_equivalence``.

    ``max_rel_error`` is the largest absolute difference divided by the
    reference output's largest magnitude (an elementwise ratio explodes near
    zero and says little).
    """

    ok: bool
    trials: int
    max_abs_error: float
    max_rel_error: float
    first_mismatch: Optional[Mismatch] = None
    int_agreement: Optional[float] = None  # see INT_AGREEMENT; None: integers compared exactly
    #: trials not run because they could not tell anything a run trial did not:
    #: their inputs equal an earlier trial's (no input the check can vary)
    skipped: int = 0
    #: every output of every trial run held no element (a batch of 0): the check
    #: compared nothing, and a wrong rewrite would pass it as well (ints and 0-d
    #: tensors beside empty tensors do not count: ``x.shape[0]``, ``x.sum()``)
    empty: bool = False

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        errs = f"max abs error {self.max_abs_error:.3g}, max rel error {self.max_rel_error:.3g}"
        if self.int_agreement is not None:
            errs += f", integer outputs agree on {self.int_agreement:.1%}"
        if self.skipped:
            errs += (f"; {self.skipped} trial(s) skipped: their inputs would equal an earlier trial's "
                     "(nothing the check can vary)")
        if self.empty:
            errs += "; every output was empty (a batch of 0?): nothing was compared"
        if self.ok:
            return f"equivalent over {self.trials} trial(s) ({errs})"
        return f"NOT equivalent: {self.first_mismatch} [{errs} over {self.trials} trial(s)]"


# --------------------------------------------------------------------------- inputs


def _is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def random_like(example: torch.Tensor, generator: torch.Generator,
                value_range: Optional[Range] = None, widen_constants: bool = False) -> torch.Tensor:
    """A random tensor with ``example``'s shape, dtype and device.

    Floats: normal with the example's mean/std (std 1 when it is 0 or
    undefined), folded to non-negative when the example has no negative
    entries and some positive one (an image in [0, 1]; all zeros say nothing).
    Integers: uniform in the example's ``[min, max]`` (``[0, 1]`` for an
    all-ones example: a mask without padding hides what a mask changes). Bools: fair
    coin. ``value_range`` overrides both with a uniform ``[low, high]``.
    ``widen_constants``: an integer example holding one value ``v`` draws
    ``[v - 1, v + 1]`` within its dtype, ``[0, 1]`` for zeros (``token_type_ids`` of
    one segment: zeros alone hide what the ids select; a scale ``torch.tensor(2)``
    kept at 2 hides a rewrite that holds for 2 only).
    """
    shape, dtype = tuple(example.shape), example.dtype
    ex = example.detach().to("cpu")
    if dtype == torch.bool:
        out = torch.randint(0, 2, shape, generator=generator).bool()
    elif _is_float(dtype):
        real = torch.float64
        if value_range is not None:
            lo, hi = value_range
            out = torch.rand(shape, generator=generator, dtype=real) * (hi - lo) + lo
        else:
            vals = ex.to(torch.complex128 if dtype.is_complex else real)
            finite = vals[torch.isfinite(vals)] if vals.numel() else vals
            mean = finite.mean() if finite.numel() else torch.zeros((), dtype=vals.dtype)
            std = finite.std().real.item() if finite.numel() > 1 else 0.0
            if not math.isfinite(std) or std == 0.0:
                std = 1.0
            if dtype.is_complex:
                noise = torch.complex(torch.randn(shape, generator=generator, dtype=real),
                                      torch.randn(shape, generator=generator, dtype=real))
            else:
                noise = torch.randn(shape, generator=generator, dtype=real)
            out = noise * std + mean
            if not dtype.is_complex and finite.numel() and bool((finite >= 0).all()) and bool(finite.any()):
                out = out.abs()  # an all-zero example (an RNN's h0) tells no sign: both signs
        out = out.to(dtype)
    else:
        if value_range is not None:
            lo, hi = int(value_range[0]), int(value_range[1])
        elif ex.numel():
            lo, hi = int(ex.min()), int(ex.max())
            if lo == hi == 1:
                lo = 0  # an all-ones mask (attention_mask without padding): draw zeros too
            elif lo == hi and widen_constants:
                info = torch.iinfo(dtype)
                lo, hi = max(lo - 1, 0 if lo == 0 else info.min), min(hi + 1, info.max)
        else:
            lo, hi = DEFAULT_INT_RANGE
        out = torch.randint(lo, hi + 1, shape, generator=generator, dtype=torch.int64).to(dtype)
    return out.to(example.device)


def _one_valued_int(leaf: Any) -> bool:
    """An integer tensor example holding one value throughout (not ones alone: an
    all-ones mask is always widened), which ``widen_constants`` widens."""
    if not isinstance(leaf, torch.Tensor) or leaf.dtype.is_floating_point or leaf.dtype.is_complex \
            or leaf.dtype == torch.bool or not leaf.numel():
        return False
    lo, hi = leaf.min(), leaf.max()
    return bool(lo == hi) and int(lo) != 1


def _each_element_once(size: Any, stride: Any) -> bool:
    """Strides that address no element twice: taken from the smallest, each is at
    least the span of the dimensions before it."""
    span = 0
    for n, step in sorted(((n, st) for n, st in zip(size, stride) if n > 1), key=lambda d: d[1]):
        if step <= span:
            return False
        span += (n - 1) * step
    return True


def _lookup_range(ranges: Optional[Mapping[InputKey, Range]], index: int, path: str) -> Optional[Range]:
    if not ranges:
        return None
    if index in ranges:
        return ranges[index]
    return ranges.get(path)


def _addresses(example_inputs: Any) -> Callable[[Any], bool]:
    """Whether a key (flat index or ``pytree.keystr`` path) addresses a leaf of
    ``example_inputs``."""
    leaves = pytree.tree_flatten_with_path(example_inputs)[0]
    paths = {pytree.keystr(kp) for kp, _ in leaves}
    return lambda k: ((isinstance(k, int) and not isinstance(k, bool) and 0 <= k < len(leaves))
                      or (isinstance(k, str) and k in paths))


def validate_input_keys(example_inputs: Any, input_ranges: Optional[Mapping[InputKey, Range]],
                        fixed_inputs: Iterable[InputKey]) -> None:
    """ValueError for an ``input_ranges`` or ``fixed_inputs`` key that addresses no
    leaf of ``example_inputs`` (a flat index out of range, a path with a typo: the
    check would draw that input at random all the same) and for a range that is not
    two real numbers ``low <= high`` (numpy's scalars are numbers too)."""
    fits = _addresses(example_inputs)
    leaves = pytree.tree_flatten_with_path(example_inputs)[0]
    paths = sorted(pytree.keystr(kp) for kp, _ in leaves)
    shown = ", ".join(paths[:8]) + (", ..." if len(paths) > 8 else "")
    for option, keys in (("fixed_inputs", list(fixed_inputs)), ("input_ranges", list(input_ranges or {}))):
        bad = [k for k in keys if not fits(k)]
        if bad:
            raise ValueError(
                f"{option}: {', '.join(map(repr, bad))} addresses no input: the example inputs have "
                f"{len(leaves)} leaves, by flat index 0..{len(leaves) - 1} or by path ({shown})")
    by_key = {**{i: leaf for i, (_, leaf) in enumerate(leaves)}, **{pytree.keystr(kp): leaf for kp, leaf in leaves}}
    for key, value in (input_ranges or {}).items():
        numbers_ = isinstance(value, (tuple, list)) and len(value) == 2 and all(
            isinstance(v, numbers.Real) and not isinstance(v, bool) for v in value)
        if not numbers_ or not value[0] <= value[1]:
            raise ValueError(f"input_ranges[{key!r}] = {value!r}: a range is two numbers (low, high), low <= high")
        problem = _range_problem(value, by_key.get(key))
        if problem:
            raise ValueError(f"input_ranges[{key!r}] = {value!r}: {problem}")


def _range_problem(value: Any, leaf: Any) -> Optional[str]:
    """Why values drawn from ``value`` cannot be the input ``leaf`` holds: not finite
    (every trial would be NaN, and any rule pass), or beyond its dtype (an int8 input
    drawn up to 1000 wraps, a float16 one up to 1e6 overflows to inf)."""
    low, high = (float(v) for v in value)
    if not (math.isfinite(low) and math.isfinite(high)):
        return "a range is finite (draws from an infinite one are NaN, on which any rewrite passes)"
    if not isinstance(leaf, torch.Tensor) or leaf.dtype == torch.bool or leaf.is_complex():
        return None
    info = torch.finfo(leaf.dtype) if leaf.is_floating_point() else torch.iinfo(leaf.dtype)
    if low < info.min or high > info.max:
        return f"the input is {leaf.dtype}, whose values lie within [{info.min:g}, {info.max:g}]"
    return None


def generate_inputs(example_inputs: Any, seed: int = 0, *,
                    input_ranges: Optional[Mapping[InputKey, Range]] = None,
                    fixed_inputs: Iterable[InputKey] = (), widen_constants: bool = False) -> Any:
    """Random inputs with the same pytree structure as ``example_inputs``.

    Leaves are addressed by flat index or by ``pytree.keystr`` path (``"[0]"``,
    ``"[1]['mask']"``). ``input_ranges`` maps leaves to a uniform range;
    ``fixed_inputs`` lists leaves passed through unchanged. Non-tensors are passed
    through, but for the tensors an object holds (a dataclass, a ``UserDict``:
    ``rewrite.trust.held``), which are drawn too; an ``nn.Parameter`` is drawn as a
    parameter requiring grad as the example does. ``widen_constants``: see
    ``random_like``.
    """
    generator = torch.Generator().manual_seed(seed)
    fixed = set(fixed_inputs)
    leaves, spec = pytree.tree_flatten_with_path(example_inputs)
    out = []
    made: Dict[int, torch.Tensor] = {}  # the same tensor given twice is one random tensor

    def drawn(leaf: torch.Tensor, value_range: Optional[Range]) -> torch.Tensor:
        value = made.get(id(leaf))
        if value is None:
            value = _laid_out_like(leaf, random_like(leaf, generator, value_range, widen_constants))
            if isinstance(leaf, torch.nn.Parameter):
                value = torch.nn.Parameter(value, requires_grad=leaf.requires_grad)
            made[id(leaf)] = value
        return value

    for i, (kp, leaf) in enumerate(leaves):
        path = pytree.keystr(kp)
        if i in fixed or path in fixed:
            out.append(leaf)
        elif not isinstance(leaf, torch.Tensor):
            out.append(map_held(leaf, lambda t: drawn(t, None)))
        else:
            out.append(drawn(leaf, _lookup_range(input_ranges, i, path)))
    return pytree.tree_unflatten(out, spec)


def _laid_out_like(example: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (contiguous) with ``example``'s strides, when those address each
    element once (a slice, a transpose, channels_last; not an ``expand``)."""
    if example.layout != torch.strided or value.stride() == example.stride() or example.is_contiguous():
        return value
    if not _each_element_once(example.size(), example.stride()):
        return value
    try:
        laid = torch.empty_strided(example.size(), example.stride(), dtype=value.dtype, device=value.device)
        laid.copy_(value)
        return laid
    except (RuntimeError, NotImplementedError, AttributeError):
        return value


def _concrete(n: Any) -> int:
    return size_hint(n)


def _node_shape(node: Any, gm: fx.GraphModule) -> Optional[Tuple[int, ...]]:
    """Shape of an argument node (placeholder, get_attr or op) if known."""
    if isinstance(node, fx.Node):
        for key in ("val", "example_value"):
            val = node.meta.get(key)
            if isinstance(val, torch.Tensor):
                return tuple(_concrete(s) for s in val.shape)
        tm = node.meta.get("tensor_meta")
        if tm is not None and hasattr(tm, "shape"):
            return tuple(_concrete(s) for s in tm.shape)
        if node.op == "get_attr":
            try:
                obj = attribute(gm, node.target)
                if isinstance(obj, torch.Tensor):
                    return tuple(obj.shape)
            except AttributeError:
                return None
    return None


def _operand_shape(value: Any, gm: fx.GraphModule) -> Optional[tuple]:
    if isinstance(value, ConstRef):
        try:
            return tuple(attribute(gm, value.qualname).shape)
        except AttributeError:
            return None
    return _node_shape(value, gm) if isinstance(value, fx.Node) else None


def _bindings_reading(node: fx.Node, gm: fx.GraphModule) -> list:
    """How each user of ``node`` binds to the vocabulary (through the ``getitem``
    that a multi-output op like core ATen's batch norm is read by)."""
    out = []
    for user in node.users:
        for candidate in (user, *(u for u in user.users if u.target is operator.getitem)):
            out += bind_node(candidate, gm)
    return out


def _infer_range(node: fx.Node, gm: fx.GraphModule) -> Optional[Range]:
    """Guess a valid value range from how the placeholder is used: the operand
    ranges its users' vocabulary entries declare (``Instances.operand_ranges``).

    Indices into an embedding stay below its number of rows; running variances stay
    positive. Anything else: no constraint.
    """
    for bound in _bindings_reading(node, gm):
        spec = OPS[bound.op].instances if bound.op in OPS else None
        for param, kind in (spec.operand_ranges if spec is not None else ()):
            if bound.args.get(param) is not node:
                continue
            if kind == "positive":
                return (0.5, 1.5)
            if kind.startswith("index:"):
                shape = _operand_shape(bound.args.get(kind.split(":", 1)[1]), gm)
                if shape:
                    return (0, shape[0] - 1)
    if node.name.endswith("running_var") or node.name.endswith("running_var_"):
        return (0.5, 1.5)
    return None


def inputs_from_graph(gm: fx.GraphModule, seed: int = 0, *,
                      input_ranges: Optional[Mapping[InputKey, Range]] = None) -> Tuple[Any, ...]:
    """Random positional inputs for ``gm`` built from its placeholders' metadata.

    Uses ``meta['val']`` / ``meta['example_value']`` (FakeTensor or int) or
    ``meta['tensor_meta']``; symbolic sizes take their hint. Floats are
    standard normal, integers fall in a range inferred from their users
    (embedding size) or ``DEFAULT_INT_RANGE``. Placeholders without metadata
    are an error: there is nothing to build them from.
    """
    generator = torch.Generator().manual_seed(seed)
    args = []
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        val = node.meta.get("val", node.meta.get("example_value"))
        rng = _lookup_range(input_ranges, i, node.name) or _infer_range(node, gm)
        if isinstance(val, torch.Tensor):
            shape, dtype, device = val.shape, val.dtype, val.device
        elif node.meta.get("tensor_meta") is not None:
            tm = node.meta["tensor_meta"]
            shape, dtype, device = tm.shape, tm.dtype, torch.device("cpu")
        elif val is not None and not isinstance(val, torch.Tensor):
            args.append(_concrete(val) if isinstance(val, torch.SymInt) else val)
            continue
        else:
            raise ValueError(f"placeholder {node.name!r} has no 'val' or 'tensor_meta' metadata; "
                             "pass example_inputs")
        shape = tuple(_concrete(s) for s in shape)
        if rng is None and _is_float(dtype):
            value = torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
        else:
            if rng is None and dtype != torch.bool:
                rng = DEFAULT_INT_RANGE
            value = random_like(torch.zeros(shape, dtype=dtype), generator, rng)
        args.append(value.to(device))
    return tuple(args)


# --------------------------------------------------------------------------- running


def inputs_copy(tree: Any) -> Any:
    """A private copy of the inputs as the caller gave them: each tensor with its
    own strides and storage offset (a ``reshape => view`` rule fails on a sliced
    input as it would for the caller), and tensors sharing memory (the same tensor
    passed twice, views of one base) sharing one copy of it. Tensors whose memory
    cannot be copied as such (requiring grad, conjugated, quantized, sparse,
    subclasses) are cloned one by one."""
    copies: Dict[int, Any] = {}

    def one(t: Any) -> Any:
        if isinstance(t, torch.Generator):  # the run draws from its own: the caller's stays where it was
            return generator_copy(t)
        if not isinstance(t, torch.Tensor):
            return map_held(t, one)  # an object holding tensors: a copy holding copies
        if t.requires_grad or type(t) not in (torch.Tensor, torch.nn.Parameter) or t.is_conj() or t.is_neg() \
                or t.layout != torch.strided or t.is_quantized:
            return t.clone()
        try:
            storage = t.untyped_storage()
            key = storage._cdata
            copy = copies.get(key)
            if copy is None:
                copy = copies[key] = storage.clone()
            with torch.no_grad():
                return torch.empty(0, dtype=t.dtype, device=t.device).set_(copy, t.storage_offset(), t.size(),
                                                                          t.stride())
        except (RuntimeError, NotImplementedError, TypeError):
            return t.clone()

    return pytree.tree_map(one, tree)



def _state(fn: Any) -> Dict[str, torch.Tensor]:
    """Parameters, buffers and plain tensor attributes (``torch.export``'s lifted
    constants, fx's ``_tensor_constant``s, a counter a forward writes) of a module
    by qualified name (empty for plain callables)."""
    if not isinstance(fn, torch.nn.Module):
        return {}
    out = dict(fn.named_parameters(remove_duplicate=False))
    out.update(fn.named_buffers(remove_duplicate=False))
    for prefix, module in fn.named_modules(remove_duplicate=False):
        for name, value in module.__dict__.items():
            # an inference tensor (a cache filled under inference_mode) keeps no version
            # counter: nothing can write it outside inference mode, nothing to watch
            if isinstance(value, torch.Tensor) and not value.is_inference():
                out[f"{prefix}.{name}" if prefix else name] = value
    return out


@attrs.frozen
class _Run:
    """One call: its outputs, its private inputs as they are after the call, which
    of them it wrote, which module state it wrote, the module's state and the
    storages it holds, and the floating dtypes its ops computed in."""

    outputs: Any
    inputs: Any
    inputs_written: frozenset
    state_written: Dict[str, torch.Tensor]
    state: Dict[str, torch.Tensor]
    dtypes: frozenset = frozenset()
    storages: frozenset = frozenset()
    #: per leaf of ``outputs`` (pytree order), the floating dtypes of the values it
    #: was computed from (``_static_lineage``, ``_DtypeRecorder``); None: not known
    lineage: Optional[Tuple[frozenset, ...]] = None
    #: per leaf of ``outputs``, whether it requires grad when called with gradients
    #: enabled (trial 0 only; None: not run so, or it raised so)
    requires_grad: Optional[Tuple[bool, ...]] = None
    #: per leaf of ``outputs`` that requires grad, where its gradient starts (its
    #: ``grad_fn``, or the tensor itself when it is a leaf): what it requires grad through
    grad_roots: Optional[Tuple[Any, ...]] = None
    #: what the call raised with gradients enabled (it then ran under ``no_grad``)
    grad_error: Optional[str] = None
    #: what the call raised with its floating inputs requiring grad (``_as_activations``;
    #: it then ran on the inputs as given)
    activation_error: Optional[str] = None
    #: the CPU generator's state after the call (it started from the trial's seed):
    #: what the caller's next ``torch.rand`` would draw from
    rng_after: Optional[torch.Tensor] = None
    #: every value of the run, by node (``rewrite.trust.reuse.Recording``), or None
    recorded: Any = None
    #: ``_sharing`` of the outputs as returned, where ``outputs`` holds copies of
    #: those in memory the run did not make (``_memory_copied``); None: not taken apart
    sharing: Optional[Tuple[set, Dict[str, tuple]]] = None
    #: the call drew from Python's or numpy's generator (``seeded`` seeds them too)
    host_drew: bool = False


@attrs.frozen
class _Watch:
    """What the check needs to know of one callable before running it, worked out
    once per check rather than per run (on a 10k-node graph with 5k parameters each
    piece costs several milliseconds): its parameters and buffers by name and the
    storages they hold, the names a run may write (all of them unless the graph
    tells otherwise: ``rewrite.ops.effects.state_writes``) and which of those are
    compared by value (``by_value``), and the floating dtypes its nodes' metadata
    records (None: unknown)."""

    state: Dict[str, torch.Tensor]
    storages: frozenset
    writable: Optional[frozenset]
    watched: Tuple[str, ...]
    by_value: frozenset
    static: Optional[frozenset]
    lineage: Optional[Tuple[frozenset, ...]] = None  # _static_lineage

    #: the lineage is not needed (``of``'s ``compared_with``): no run records it
    lineage_unneeded: bool = False
    #: False: ``lineage`` was not worked out (``of``'s ``lineage=False``)
    lineage_read: bool = True
    #: random generator objects its code draws from (``hooked_generators``): every run
    #: starts from their state as the caller left it
    generators: tuple = ()

    @classmethod
    def of(cls, fn: Any, dtypes: bool = True, compared_with: Optional[frozenset] = None,
           lineage: bool = True) -> "_Watch":
        """``dtypes``: read the static dtypes (approximate checks need them).
        ``compared_with``: the static dtypes of the reference ``fn`` is checked
        against; when ``fn``'s own are among them, no output can be computed from a
        precision new to it (``_new_precision`` is None), so the per-output lineage
        is neither worked out nor recorded. ``lineage=False``: not yet (a check
        without dtypes never reads it; ``with_lineage`` works it out later)."""
        state = _state(fn)
        writable = state_writes(fn)
        watched = tuple(name for name, t in state.items() if writable is None or id(t) in writable)
        # Kernels update some buffers without bumping their version (batch norm's
        # running statistics), and a write through a view that shares memory but not
        # the version counter (unsafe_chunk, _unsafe_view) bumps none: buffers, and
        # every tensor the graph is known to may write (few), are compared by value;
        # with nothing known, the other parameters by version counter.
        buffer_ids = {id(t) for t in fn.buffers()} if isinstance(fn, torch.nn.Module) else set()
        by_value = frozenset(name for name in watched if writable is not None or id(state[name]) in buffer_ids)
        static = static_float_dtypes(fn) if dtypes else None
        # with one floating dtype in the reference and none other here, no output is
        # computed from a precision new to it; with several (a float16 branch of a
        # float32 model), one output may be, though the whole run computes no new one
        unneeded = static is not None and compared_with is not None and static <= compared_with \
            and sum(d.is_floating_point for d in compared_with) <= 1
        lineage = lineage and dtypes and not unneeded
        generators = tuple(model_generators(fn))
        return cls(state, frozenset(_storage(t) for t in state.values()) - {None}, writable, watched, by_value,
                   static, _static_lineage(fn) if lineage else None, unneeded, lineage or not dtypes or unneeded,
                   generators)

    def drawing_from(self, generators: Any) -> "_Watch":
        """This watch, its runs also starting ``generators`` from where they stand."""
        known = {id(g) for g in self.generators}
        more = tuple(g for g in generators if id(g) not in known)
        return attrs.evolve(self, generators=self.generators + more) if more else self

    def with_lineage(self, fn: Any) -> "_Watch":
        """This watch with ``fn``'s lineage worked out, if it was not."""
        return self if self.lineage_read else attrs.evolve(self, lineage=_static_lineage(fn), lineage_read=True)

    def dispatches(self, dtypes: bool) -> bool:
        """Whether a run records the dtypes its ops compute in as it goes (every op
        dispatched through ``_DtypeRecorder``): they are needed (``dtypes``) and the
        graph's metadata does not tell them."""
        return dtypes and (self.static is None or (self.lineage is None and not self.lineage_unneeded))


class _DtypeRecorder(TorchDispatchMode):
    """Records the floating dtypes of every tensor an op produces and, with
    ``lineage``, per storage the floating dtypes of the values written into it,
    transitively: an op's results (and the arguments it writes) get the dtypes of
    its floating results and everything its tensor arguments were computed from.
    Keyed by storage, so a view, and a write through a view, share their base's; a
    result in fresh memory starts anew. Tensors no op produced (inputs, constants)
    count none: what a lower precision changes is what ops compute."""

    supports_higher_order_operators = True  # rewrite.trust.modes

    def __init__(self, lineage: bool = False) -> None:
        super().__init__()
        self.dtypes: set = set()
        # storage address -> (a weak reference that keeps the address from being reused
        # while the recorder lives, the dtypes)
        self.lineage: Optional[Dict[int, Tuple[Any, frozenset]]] = {} if lineage else None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if is_higher_order(func):
            return run_higher_order(self, func, args, kwargs)
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        results = pytree.tree_leaves(out)
        own = set()
        for t in results:
            if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
                own.add(t.dtype)
        self.dtypes |= own
        if self.lineage is not None:
            self._track(func, args, kwargs, results, own)
        return out

    def _track(self, func: Any, args: Any, kwargs: Any, results: list, own: set) -> None:
        lineage = self.lineage
        read: Dict[int, torch.Tensor] = {}
        acc = set(own)
        for t in pytree.tree_leaves((args, kwargs)):
            key = _storage_key(t)
            if key is not None:
                read[key] = t
                entry = lineage.get(key)
                if entry is not None:
                    acc |= entry[1]
        dtypes = frozenset(acc)
        written = set()
        schema = getattr(func, "_schema", None)
        if schema is not None:  # arguments the op writes in place (add_, copy_, out=)
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    value = args[i] if i < len(args) else kwargs.get(arg.name)
                    written.update(k for k in map(_storage_key, pytree.tree_leaves(value)) if k is not None)
        for t in results:
            key = _storage_key(t)
            if key is None:
                continue
            if key in read:  # a view of an argument, or the argument itself: shares its storage
                written.add(key)
            else:
                lineage[key] = (_weak_storage(t), dtypes)
        for key in written:
            entry = lineage.get(key)
            if entry is None:
                tensor = read.get(key)
                if tensor is None:
                    continue
                lineage[key] = (_weak_storage(tensor), dtypes)
            else:
                lineage[key] = (entry[0], entry[1] | dtypes)

    def lineage_of(self, t: Any) -> frozenset:
        """The floating dtypes ``t``'s storage was computed from (none for a tensor no
        op wrote: an input, a constant)."""
        key = _storage_key(t)
        entry = None if key is None or self.lineage is None else self.lineage.get(key)
        return frozenset() if entry is None else entry[1]


def _storage_key(t: Any) -> Optional[int]:
    """The address of ``t``'s storage (views share it), or None (not a tensor, or no
    storage: sparse, subclasses)."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None


def _weak_storage(t: torch.Tensor) -> Any:
    try:
        return StorageWeakRef(t.untyped_storage())
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None


def _new_precision(ref: _Run, cand: _Run, given: frozenset = frozenset()) -> Optional[torch.dtype]:
    """The lowest floating precision the candidate computes in that the reference
    does not (bfloat16 for a mixed-precision rewrite of a float32 model), or None.
    ``given``: the floating dtypes of the inputs, the precision of a reference that
    computes no float itself (``gt(x, 0)``)."""
    return loosest(_less_precise(cand.dtypes - ref.dtypes, ref.dtypes | given))


def _new_precisions(ref: _Run, cand: _Run, given: frozenset = frozenset()) -> Tuple[Optional[torch.dtype], ...]:
    """Per output leaf, the lowest floating precision the candidate computes it from
    that the reference does not compute the same output from, or None: a bfloat16
    rewrite of one branch loosens the tolerance of the outputs that branch reaches,
    not of the others. When either run's lineage is not known (an output structure
    the graph does not tell), every output gets ``_new_precision``, the whole run's."""
    n = len(pytree.tree_leaves(cand.outputs))
    if ref.lineage is None or cand.lineage is None or len(ref.lineage) != len(cand.lineage) \
            or len(cand.lineage) != n:
        return (_new_precision(ref, cand, given),) * n
    return tuple(loosest(_less_precise(c - r, r, ref.dtypes | given)) for r, c in zip(ref.lineage, cand.lineage))


def _less_precise(new: frozenset, before: frozenset, run: frozenset = frozenset()) -> frozenset:
    """The floating dtypes of ``new`` less precise than the most precise of
    ``before`` (else of ``run``, the dtypes of the original's whole run: a bool
    output's lineage holds none; all of them when neither holds one): a rewrite that
    computes in float64 where the original computed in float32 rounds less, and
    earns no tolerance."""
    floats = [d for d in before if d.is_floating_point] or [d for d in run if d.is_floating_point]
    if not floats:
        return frozenset(new)
    finest = min(torch.finfo(d).eps for d in floats)
    return frozenset(d for d in new if not d.is_floating_point or torch.finfo(d).eps > finest)


_META_KEYS = ("val", "example_value", "rewrite_facts", "tensor_meta")


def static_float_dtypes(fn: Any) -> Optional[frozenset]:
    """The floating dtypes a GraphModule's ops compute in, read from the metadata
    its nodes carry (export and dynamo graphs, rewritten ones included), or None
    when a call node carries none (then the ops are watched as they run)."""
    if not isinstance(fn, fx.GraphModule):
        return None
    out = set()
    for node in fn.graph.nodes:
        if node.op not in CALL_OPS or _computes_nothing(node, fn):
            continue
        meta = node.meta
        val = meta.get("val")
        if val is None:
            val = next((meta[k] for k in _META_KEYS if meta.get(k) is not None), None)
            if val is None and node.target is operator.setitem:
                # dynamo records no value for ``t[i] = v``: it computes in t's and v's dtypes
                val = [_meta_val(a) for a in node.args if isinstance(a, fx.Node)]
                if any(v is None for v in val):
                    return None
            if val is None:
                return None
        if isinstance(val, torch.Tensor):  # most nodes: one tensor
            out.add(val.dtype)
            continue
        for leaf in pytree.tree_leaves(val):
            dtype = getattr(leaf, "dtype", None)
            if isinstance(dtype, torch.dtype):
                out.add(dtype)
    return frozenset(d for d in out if d.is_floating_point)


def half_node_counts(fn: Any) -> Optional[collections.Counter]:
    """How many call nodes of a GraphModule compute a value in each half precision,
    read from its nodes' metadata; None when a call node carries none."""
    if not isinstance(fn, fx.GraphModule):
        return None
    counts: collections.Counter = collections.Counter()
    for node in fn.graph.nodes:
        halves = _half_dtypes(node, fn)
        if halves is None:
            return None
        counts.update(halves)
    return counts


def _half_dtypes(node: fx.Node, gm: fx.GraphModule) -> Optional[set]:
    """The half precisions a call node computes values in (none for other nodes), read
    from its metadata; None when it carries none."""
    if node.op not in CALL_OPS or _computes_nothing(node, gm):
        return set()
    val = _meta_val(node)
    if val is None:
        return None
    values = (val,) if isinstance(val, torch.Tensor) else pytree.tree_leaves(val)
    return {getattr(v, "dtype", None) for v in values} & set(HALF)


def named_half_precisions(fn: Any) -> frozenset:
    """The half precisions a GraphModule names: a dtype argument of a call (a cast
    ``to(x, torch.bfloat16)``) or a constant it reads. Where its nodes' metadata do
    not tell what they compute in (``static_float_dtypes`` is None: new nodes of a
    dynamo graph of static sizes), what a rewrite newly computes in is among them."""
    if not isinstance(fn, fx.GraphModule):
        return frozenset()
    found: set = set()
    for node in fn.graph.nodes:
        if node.op == "get_attr":
            found.add(getattr(attribute(fn, node.target), "dtype", None))
        elif node.op in CALL_OPS:
            found.update(a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, torch.dtype))
    return frozenset(found & set(HALF))


def more_half_nodes(before: Optional[collections.Counter], after: Optional[collections.Counter]
                    ) -> Tuple[torch.dtype, ...]:
    """The half precisions more of the rewritten graph's nodes compute in than the
    original's did (``half_node_counts``): a mixed-precision rewrite of a model that
    already computes something in bfloat16 (Falcon's ALiBi slopes) computes in no
    dtype new to it, but newly computes most of its work in it. None when unknown."""
    if before is None or after is None:
        return ()
    return tuple(sorted((d for d in after if after[d] > before.get(d, 0)), key=str))


def half_nodes_per_output(fn: Any) -> Optional[Tuple[collections.Counter, ...]]:
    """Per output leaf of a GraphModule (pytree order), how many of the call nodes it
    is computed from compute in each half precision (``half_node_counts``, output by
    output); None when a node's metadata does not tell."""
    if not isinstance(fn, fx.GraphModule):
        return None
    output = next((n for n in reversed(fn.graph.nodes) if n.op == "output"), None)
    if output is None:
        return None
    leaves = pytree.tree_leaves(output.args[0] if output.args else None)
    reach: Dict[fx.Node, int] = {}  # node -> bit mask of the output leaves computed from it
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, fx.Node):
            reach[leaf] = reach.get(leaf, 0) | (1 << i)
    counts = tuple(collections.Counter() for _ in leaves)
    for node in reversed(fn.graph.nodes):
        mask = reach.get(node, 0)
        for user in node.users:
            mask |= reach.get(user, 0)
        if not mask:
            continue
        reach[node] = mask
        halves = _half_dtypes(node, fn)
        if halves is None:
            return None
        for dtype in halves:
            i = 0
            while mask >> i:
                if mask >> i & 1:
                    counts[i][dtype] += 1
                i += 1
    return counts


def _more_half_per_output(before: Optional[tuple], after: Optional[tuple]) -> Optional[Tuple[Any, ...]]:
    """Per output leaf, the loosest half precision more of the rewrite's nodes it is
    computed from compute in than the original's (``half_nodes_per_output``), else
    None; None for all when unknown or when no output has more."""
    if before is None or after is None or len(before) != len(after):
        return None
    more = tuple(loosest({d for d in a if a[d] > b.get(d, 0)}) for b, a in zip(before, after))
    return more if any(d is not None for d in more) else None


_UNREAD = object()  # a lazily read attribute not read yet


def _computes_nothing(node: fx.Node, gm: fx.GraphModule) -> bool:
    """A node that returns nothing and computes no value: a metadata check (its
    recorded value is None), ``torch.export``'s input guard."""
    if "val" in node.meta and node.meta["val"] is None and not node.users:
        return True
    if node.op == "call_function" and not node.users and node.target in _LOGGING_CALLS:
        return True  # dynamo records torch's usage logging with no value at all
    return node.op == "call_module" and not node.users and is_export_guard(gm, node.target)


#: calls that only log (dynamo keeps ``torch._C._log_api_usage_once("python.nn_module")``
#: from a module built inside the traced code, with no recorded value)
_LOGGING_CALLS = frozenset({torch._C._log_api_usage_once})


def _meta_val(node: fx.Node) -> Any:
    val = node.meta.get("val")
    if val is None:
        val = next((node.meta[k] for k in _META_KEYS if node.meta.get(k) is not None), None)
    return val


def _known_effects(node: fx.Node, gm: fx.GraphModule) -> bool:
    """The node writes none of its arguments, as far as the graph tells: no schema or
    name says so, and it is no call whose effects nothing tells (a module or a Python
    function from outside torch, a higher-order op, an ``out=``)."""
    target = node.target
    if node.op == "call_function" and type(target) is torch._ops.OpOverload and call_writes(target) == "never":
        return True  # most nodes of an ATen graph: known by target (an overload's out= is in its schema)
    if written_args(node, gm) or "out" in node.kwargs:
        return False
    if node.op == "call_module":
        try:
            module = gm.get_submodule(target)
        except AttributeError:
            return False
        return type(module).__module__.startswith("torch.")
    if node.op == "call_function":
        if isinstance(target, torch._ops.HigherOrderOperator):
            return False
        if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return True
        where = getattr(target, "__module__", None) or ""
        if where.split(".")[0] not in ("torch", "operator", "_operator", "builtins", "math"):
            return False
        position = _inplace_parameter(target)  # F.relu(x, True)
        if position is not None:
            given = node.kwargs.get("inplace", node.args[position] if position < len(node.args) else False)
            return given is False
    return True  # call_method: written_args reads in-place methods by name


@functools.lru_cache(maxsize=None)
def _inplace_parameter(target: Any) -> Optional[int]:
    """The position of a function's ``inplace`` parameter, or None."""
    try:
        params = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return None
    return params.index("inplace") if "inplace" in params else None


def _static_lineage(fn: Any) -> Optional[Tuple[frozenset, ...]]:
    """Per leaf of a GraphModule's output (pytree order), the floating dtypes of the
    values it is computed from: its node's and, transitively, its arguments' (from
    node metadata, as ``static_float_dtypes``; placeholders and constants count none, as
    in ``_DtypeRecorder``). None when the graph cannot tell: a call node without
    metadata, a node that may write an argument in place (a later reader of the
    argument depends on the write, which no edge shows), an output leaf whose value
    is not a single tensor or scalar. The check then records it as it runs."""
    if not isinstance(fn, fx.GraphModule):
        return None
    lineage: Dict[fx.Node, frozenset] = {}
    interned: Dict[frozenset, frozenset] = {}
    empty = frozenset()
    output = None
    for node in fn.graph.nodes:
        if node.op == "output":
            output = node
            continue
        if node.op not in CALL_OPS or _computes_nothing(node, fn):
            lineage[node] = empty
            continue
        val = _meta_val(node)
        if (val is None and "val" not in node.meta) or not _known_effects(node, fn):
            return None  # no metadata (a recorded None: an op that returns nothing, a check)
        own = {val.dtype} if isinstance(val, torch.Tensor) else {
            d for d in (getattr(leaf, "dtype", None) for leaf in pytree.tree_leaves(val))
            if isinstance(d, torch.dtype)}
        acc = {d for d in own if d.is_floating_point}
        for used in node.all_input_nodes:
            acc |= lineage.get(used, empty)
        key = frozenset(acc)
        lineage[node] = interned.setdefault(key, key)
    if output is None or not output.args:
        return None
    out = []
    for leaf in pytree.tree_leaves(output.args[0]):
        if isinstance(leaf, fx.Node):
            val = _meta_val(leaf)
            if val is not None and not isinstance(val, (torch.Tensor, int, float, bool, torch.SymInt,
                                                        torch.SymFloat, torch.SymBool)) \
                    and not isinstance(getattr(val, "dtype", None), torch.dtype):
                return None  # a tuple or an object: more leaves at run time than here
            out.append(lineage.get(leaf, empty))
        else:
            out.append(empty)
    return tuple(out)


def _discard(t: torch.Tensor) -> None:
    return None


def _call(fn: Callable, inputs: Any, rng_seed: int, dtypes: bool = True, watch: Optional[_Watch] = None,
          grad: bool = False, restore: Optional[Callable[[], None]] = None,
          held: frozenset = frozenset()) -> _Run:
    """Run ``fn`` on a private copy of ``inputs`` with a fixed RNG state.

    The fixed seed makes stochastic ops (dropout in training mode) draw the
    same numbers in the reference and the candidate; ``seeded`` leaves the
    caller's RNG untouched. Version counters tell which inputs and which
    parameters/buffers the call wrote in place. ``watch``: ``_Watch.of(fn, dtypes)``
    when the caller has it.

    ``grad``: run with gradients enabled, as a caller outside ``no_grad`` would (the
    autograd graph keeps no tensor for a backward that never comes), and record which
    outputs require grad; should that raise (an in-place write to a parameter), put
    the module state back with ``restore`` and run under ``no_grad`` as usual. The
    floating inputs then require grad, as activations inside a trained model do,
    but those at the flat positions in ``held`` (module state a dynamo graph takes as
    inputs, fixed inputs); should that raise, the inputs as given.
    """
    if grad:
        try:
            return _call_once(fn, inputs, rng_seed, dtypes, watch, True, held)
        except Exception as err:  # noqa: BLE001 - an op that takes no input requiring grad
            activation_error = _first_line(err)
            if restore is not None:
                restore()
        try:
            run = _call_once(fn, inputs, rng_seed, dtypes, watch, True)
            return attrs.evolve(run, activation_error=activation_error)
        except Exception as err:  # noqa: BLE001 - if the original raises so too, the caller could not run it so
            if restore is not None:
                restore()
            run = _call_once(fn, inputs, rng_seed, dtypes, watch, False)
            return attrs.evolve(run, grad_error=_first_line(err), activation_error=activation_error)
    return _call_once(fn, inputs, rng_seed, dtypes, watch, False)


def _holds_elements(outputs: Any) -> bool:
    """Whether comparing ``outputs`` compares something: some tensor of at least one
    dim holds an element. Beside an empty batch, an int (``x.shape[0] + 1``) or a
    0-d tensor (``x.sum()``) is no comparison of what the batch computes; outputs
    with no tensor of a dim count when they hold anything at all."""
    leaves = pytree.tree_leaves(outputs)
    batches = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim()]
    if batches:
        return any(leaf.numel() for leaf in batches)
    return any(not isinstance(leaf, torch.Tensor) or leaf.numel() for leaf in leaves)


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


class _Activation(torch.autograd.Function):
    """Declares a tensor written in place (``mark_dirty``), which gives it autograd
    history without copying it: it then requires grad as an activation inside a
    trained model does, keeping its storage, strides and identity, and can still be
    written in place (a leaf that requires grad could not)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        ctx.mark_dirty(t)
        return t

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[None, None]:
        return None, None  # never run: the gradient trial keeps no graph for a backward


def _as_activations(leaves: Sequence[Any], held: frozenset) -> None:
    """The floating input copies of the gradient trial made to require grad, as the
    same block's inputs do inside a model being trained: a rewrite that keeps every
    value and cuts the gradient path from an input (``x.view(torch.int32)
    .view(torch.float32)``) shows in which outputs require grad, and through what."""
    with torch.enable_grad():
        for i, t in enumerate(leaves):
            if i not in held and type(t) is torch.Tensor and t.is_floating_point() and not t.requires_grad \
                    and t.layout == torch.strided and not t.is_inference():
                _Activation.apply(t, torch.zeros((), requires_grad=True))


def _call_once(fn: Callable, inputs: Any, rng_seed: int, dtypes: bool, watch: Optional[_Watch],
               grad: bool, held: Optional[frozenset] = None) -> _Run:
    watch = watch if watch is not None else _Watch.of(fn, dtypes)
    args = inputs_copy(inputs)
    leaves = input_leaves(args)
    if grad and held is not None:
        _as_activations(leaves, held)
    before = [t._version if isinstance(t, torch.Tensor) else None for t in leaves]
    state = watch.state
    versions = {name: version_of(state[name]) for name in watch.watched}  # (an inference tensor: None)
    values_before = {name: state[name].detach().clone() for name in watch.by_value}  # _Watch.of says why
    # The floating dtypes ops compute in matter only to approximate checks (a
    # lower precision loosens the tolerance); recording them dispatches every op
    # through Python, which costs more than the op on small tensors: on request only.
    static = watch.static if dtypes else None
    static_lineage = watch.lineage if dtypes else None
    record_lineage = static_lineage is None and not watch.lineage_unneeded
    recording = watch.dispatches(dtypes)
    recorder = _DtypeRecorder(lineage=record_lineage) if recording else contextlib.nullcontext()
    grad_mode = contextlib.ExitStack()
    if grad:
        grad_mode.enter_context(torch.enable_grad())
        grad_mode.enter_context(torch.autograd.graph.saved_tensors_hooks(_discard, _discard))
    else:
        grad_mode.enter_context(torch.no_grad())
    with grad_mode, seeded(rng_seed, watch.generators), recorder, uninitialized_filled():
        host_before = host_generator_states()
        out = _fields_as_dicts(call_with(fn, args))
        rng_after = torch.get_rng_state()
        host_drew = host_generator_states() != host_before
    requires_grad = roots = None
    if grad:
        flat, spec = pytree.tree_flatten(out)
        requires_grad = tuple(isinstance(t, torch.Tensor) and t.requires_grad for t in flat)
        if any(requires_grad):  # keep where gradients start (no saved tensor), not the outputs' graph
            roots = tuple((t.grad_fn if t.grad_fn is not None else t) if needs else None
                          for t, needs in zip(flat, requires_grad))
            given = {id(t) for t in leaves}  # an output that is an input stays that input (_returned_inputs)
            out = pytree.tree_unflatten([t.detach() if isinstance(t, torch.Tensor) and t.grad_fn is not None
                                         and id(t) not in given else t for t in flat], spec)
    lineage = None
    if dtypes:
        results = pytree.tree_leaves(out)
        if record_lineage:
            lineage = tuple(recorder.lineage_of(t) for t in results)
        elif static_lineage is not None and len(static_lineage) == len(results):
            lineage = static_lineage
    # an input written through a view that does not share its version counter
    # (unsafe_chunk) bumps none: inputs are compared by value too (the trial's own
    # inputs were never passed to the model)
    written = frozenset(i for i, (t, v, given) in enumerate(zip(leaves, before, input_leaves(inputs)))
                        if isinstance(t, torch.Tensor) and (t._version != v or (
                            isinstance(given, torch.Tensor) and not _same_values(t, given))))
    state_written = {name: state[name].detach().clone() for name in watch.watched
                     if version_of(state[name]) != versions[name]
                     or (name in values_before and not _same_values(state[name], values_before[name]))}
    seen = static if static is not None else (frozenset(recorder.dtypes) if dtypes else frozenset())
    run = _Run(out, args, written, state_written, state, seen, watch.storages, lineage, requires_grad, roots,
               rng_after=rng_after, host_drew=host_drew)
    own = {_storage(t) for t in leaves}
    if any(_storage(t) not in own for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)):
        # an output in memory the call did not make (``buf[0]`` of a buffer it wrote, a
        # tensor a leaf module or a global keeps) would show that memory as the state is
        # put back for the next run, or as the other model's run writes it
        run = attrs.evolve(run, outputs=_memory_copied(out, own), sharing=_sharing(run))
    return run


def _memory_copied(outputs: Any, own: set) -> Any:
    """``outputs`` with each tensor outside the memory ``own`` (the run's private
    inputs) as a tensor over a copy of its memory, one copy per memory (the thousand
    rows of an ``unbind`` share one): the values the call returned, with the same
    strides, offset and storage size (what ``_layout_change`` and ``_retained_memory``
    read); ``_Run.sharing`` keeps which memory they shared. A conjugate or negative
    view is the same view of the copy (its bit is what the caller sees); a quantized
    tensor or a subclass is cloned."""
    copies: Dict[int, Any] = {}

    def copied(t: Any) -> Any:
        key = _storage(t)
        if key is None or key in own:
            return t
        with torch.no_grad():
            if t.layout != torch.strided or type(t) not in (torch.Tensor, torch.nn.Parameter) or t.is_quantized:
                try:
                    return t.clone()
                except (RuntimeError, NotImplementedError, TypeError):
                    return t
            memory = copies.get(key)
            if memory is None:
                memory = copies[key] = t.untyped_storage().clone()
            return view_over(memory, t)

    return pytree.tree_map(copied, outputs)


@contextlib.contextmanager
def uninitialized_filled() -> Iterator[None]:
    """Memory ``empty``-like ops return is filled (NaN for floats, the largest value
    for integers: ``torch.utils.deterministic.fill_uninitialized_memory``, which
    takes effect in torch's deterministic mode) while the block runs: a rewrite that
    reads memory nobody wrote (``zeros_like(x) => empty_like(x)``) cannot pass
    because the allocator happened to hand back zeroed pages. Deterministic mode is
    process-wide: it is entered warn-only (an op without a deterministic kernel still
    runs, its warning not shown) when the first of overlapping blocks (threads) starts
    and left as it was when the last one ends; other threads see it meanwhile."""
    global _FILLING, _FILL_RESTORE
    with _FILL_LOCK:
        if _FILLING == 0:
            import torch.utils.deterministic as deterministic

            enabled = torch.are_deterministic_algorithms_enabled()
            warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
            fill = deterministic.fill_uninitialized_memory
            _FILL_RESTORE = (enabled, warn_only, fill)
            if not (enabled and fill):
                torch.use_deterministic_algorithms(True, warn_only=not enabled or warn_only)
                deterministic.fill_uninitialized_memory = True
        _FILLING += 1
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*does not have a deterministic implementation.*")
            yield
    finally:
        with _FILL_LOCK:
            _FILLING -= 1
            if _FILLING == 0 and _FILL_RESTORE is not None:
                import torch.utils.deterministic as deterministic

                enabled, warn_only, fill = _FILL_RESTORE
                deterministic.fill_uninitialized_memory = fill
                torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
                _FILL_RESTORE = None


_FILL_LOCK = threading.Lock()
_FILLING = 0  # blocks of uninitialized_filled running (over all threads)
_FILL_RESTORE: Any = None  # the deterministic settings to put back when the last ends


def _fields_as_dicts(tree: Any) -> Any:
    """``tree`` with each dataclass instance (an output pytree does not flatten:
    ``==`` on one compares its tensors and raises) replaced by a dict of its fields,
    in the same way: its tensors compare, share memory and keep their layout as
    every output leaf does."""
    def plain(leaf: Any) -> Any:
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            return {"<" + type(leaf).__qualname__ + ">": True,
                    **{f.name: _fields_as_dicts(getattr(leaf, f.name)) for f in dataclasses.fields(leaf)}}
        return leaf
    return pytree.tree_map(plain, tree)


class _SavedState:
    """Parameters and buffers of some modules as they were, their modes and which
    parameters require grad: ``restore`` puts back what changed, told by version
    counter and by value (kernels update some buffers without bumping their version;
    a hook's ``w.data.clamp_()`` writes through ``.data``, which has a counter of its
    own), as often as needed.
    ``runs_only``: the block does nothing but call the modules, so a GraphModule's
    state its graph cannot write is not saved (cloning ResNet-50's 25M parameters
    costs more than the rest of the check's bookkeeping), and what it may write is
    compared by value (a write through ``unsafe_chunk`` bumps no version)."""

    def __init__(self, fns: Any, runs_only: bool = False, watches: Iterable[Optional[_Watch]] = ()) -> None:
        self.saved, self.modes, seen = [], [], set()
        self.attributes: list = []  # an AttributeSnapshot per module given
        # parameters and whether each requires grad (a forward may call w.requires_grad_(False)),
        # apart: restore reads the flags at C speed
        self._params: list = []
        self._flag_values: list = []
        watches = list(watches)
        for i, fn in enumerate(fns):
            if not isinstance(fn, torch.nn.Module):
                continue
            modules = list(fn.modules())
            self.modes += [(m, m.training) for m in modules]
            # what a run leaves in a module's attributes (a hook caching features, a
            # leaf module counting its calls with ``self.step = self.step + 1``, which
            # replaces the entry of its ``_buffers`` table, a list it appends to); a
            # GraphModule's code is its graph's, not state
            self.attributes.append(AttributeSnapshot(modules, hooked_containers(fn) or ()))
            # A block that only runs graphs can write only what their nodes may
            # write (rewrite.ops.effects.state_writes): ResNet-50 in eval mode, nothing,
            # not even a parameter's requires_grad (``w.requires_grad_(False)`` writes w).
            watch = watches[i] if i < len(watches) else None
            writable = None if not runs_only else watch.writable if watch is not None else state_writes(fn)
            if writable is not None and not writable:
                continue
            params = list(fn.parameters())
            self._params += params
            self._flag_values += list(map(_REQUIRES_GRAD, params))
            # and what the caller's hooks can reach outside the model: a hook on a copy of a
            # module (the check's reference) still writes the tensor it closes over
            reached = [t for t in (hooked_tensors(fn) or []) if _saveable(t)] if writable is None or writable else []
            named = (watch.state if watch is not None else _state(fn)).items()
            for name, t in [*((f"the model's {n!r}", t) for n, t in named),
                            *(("a tensor a hook reaches", t) for t in reached)]:
                if id(t) not in seen and (writable is None or id(t) in writable):
                    seen.add(id(t))
                    if t.is_inference():
                        if writable is None:
                            # torch refuses any write into it outside inference mode, loudly:
                            # nothing to save (a model that writes it fails its run)
                            continue
                        raise ValueError(
                            f"{name} is an inference tensor (made under torch.inference_mode()) and the model's "
                            "forward writes it in place: the check runs the model outside inference mode, "
                            "where torch refuses such a write. Build the model outside inference_mode, or pass "
                            "check=False")
                    self.saved.append([t, t._version, t.detach().clone(), t.grad_fn])

    def restore(self) -> None:
        with torch.no_grad():
            for entry in self.saved:
                t, version, copy, grad_fn = entry
                if t._version != version or not _same_values(t, copy):
                    t.copy_(copy)
                    if t.grad_fn is not grad_fn and grad_fn is None and not t._is_view():
                        # a write with gradients enabled (the first trial) left it autograd
                        # history: the caller's buffer would require grad, and deepcopy fail
                        t.detach_()
                    # the values are the saved ones bit for bit: so is the version, or an
                    # autograd graph the caller holds on the tensor would call it stale
                    _SET_VERSIONS((t,), (version,))
        for m, training in self.modes:
            m.training = training
        for snapshot in self.attributes:
            snapshot.restore(code=_CODE_KEYS)
        if list(map(_REQUIRES_GRAD, self._params)) != self._flag_values:  # thousands of parameters: one look
            for p, requires_grad in zip(self._params, self._flag_values):
                if p.requires_grad is not requires_grad:
                    p.requires_grad_(requires_grad)


#: a GraphModule's attributes that are its generated code (``recompile`` sets them:
#: they follow its graph, a run of a lazily compiled module may set them) or how the
#: check runs it (``running_as_graph`` installs a ``forward`` while a block runs)
_CODE_KEYS = frozenset(CODE_ATTRIBUTES) | {"forward"}


@contextlib.contextmanager
def preserved_state(*fns: Any, runs_only: bool = False, watches: Iterable[Any] = ()) -> Iterator[_SavedState]:
    """Run a block and put every parameter and buffer of the given modules back as
    it was (values written in place, e.g. BatchNorm statistics in training mode,
    are restored), and every submodule in the mode it was in. The block gets the
    saved state: ``state.restore()`` puts it back midway too; threads take turns
    through blocks that may write state. ``runs_only=True``:
    the block only calls the modules, so what their graphs cannot write is not
    saved (see ``_SavedState``); ``watches``: their ``_Watch``es, when known."""
    _STATE_LOCK.acquire()  # the snapshot, the run and the restore, as one step
    try:
        state = _SavedState(fns, runs_only, watches)
    except BaseException:
        _STATE_LOCK.release()
        raise
    held = bool(state.saved)
    if not held:  # nothing the block can write: other threads need not wait
        _STATE_LOCK.release()
    try:
        yield state
    finally:
        try:
            state.restore()
        finally:
            if held:
                _STATE_LOCK.release()


_SET_VERSIONS = torch._C._autograd._unsafe_set_version_counter
_REQUIRES_GRAD = operator.attrgetter("requires_grad")

#: Held while a block that may write module state runs: two threads checking the same
#: train-mode model would otherwise each snapshot the other's half-done update and
#: restore it last (the caller's BatchNorm statistics left changed).
_STATE_LOCK = threading.RLock()


def _saveable(t: torch.Tensor) -> bool:
    """A tensor outside the model a hook can reach that a run may write and restore
    can put back: not an inference tensor (nothing outside inference mode writes
    one, and it has no version counter), not empty, sparse or a subclass."""
    return not t.is_inference() and storage_key(t) is not None


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit the same values (NaN equals NaN)."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b) or (
        a.is_floating_point() and ((a == b) | (torch.isnan(a) & torch.isnan(b))).all()))


def _compare_tensor(path: str, trial: int, ref: torch.Tensor, cand: Any, kind: str,
                    rtol: Optional[float], atol: Optional[float],
                    compute_dtype: Optional[torch.dtype] = None,
                    agreement: Optional[float] = None,
                    noise: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                    quantum: float = 0.0, unit: float = 1.0) -> Tuple[float, float, Optional[Mismatch]]:
    """Compare one tensor (``rewrite.trust.tolerance``); ``compute_dtype``, the lowest
    precision the candidate computed in (a rewrite to bfloat16 casts back to float32
    at the end), loosens the tolerance to that dtype's when it is looser than the
    output's; ``noise``, the reference's widened run and own half-precision
    rounding error (``rewrite.trust.precision``): the candidate is compared with the
    widened run, ``NOISE_MULTIPLIER`` times that error allowed on top; ``quantum``:
    one int8 step of a graph that rounds through int8 values (``graph_quantum``),
    allowed whatever the dtype's tolerance."""
    tol_dtype = ref.dtype
    if compute_dtype is not None and compute_dtype.is_floating_point and ref.is_floating_point():
        tol_dtype = loosest((ref.dtype, compute_dtype), kind)
    tol = Tolerance.of(tol_dtype, kind, rtol, atol, quantum=quantum if kind == "approx" else 0.0)
    if unit != tol.unit:
        tol = attrs.evolve(tol, unit=unit)
    max_abs, max_rel, problem = compare_tensors(ref, cand, tol, agreement, noise, NOISE_MULTIPLIER)
    if problem is None:
        return max_abs, max_rel, None
    shape, dtype = tuple(ref.shape), str(ref.dtype).replace("torch.", "")
    return problem.abs_error, problem.rel_error, Mismatch(path, trial, shape, dtype, problem.abs_error,
                                                          problem.rel_error, problem.message)


def _compare(trial: int, ref_out: Any, cand_out: Any, kind: str, rtol: Optional[float],
             atol: Optional[float], compute_dtype: Optional[torch.dtype] = None,
             prefix: str = "output", agreement: Optional[float] = None,
             compute_dtypes: Optional[Tuple[Optional[torch.dtype], ...]] = None,
             noises: Optional[Tuple[Any, ...]] = None, quantum: Union[float, Tuple[float, ...]] = 0.0,
             unit: float = 1.0) -> Tuple[float, float, Optional[Mismatch]]:
    """Compare two outputs leaf by leaf (``quantum``: ``_compare_tensor``'s, per leaf
    when a tuple, ``graph_quantum``).
    ``compute_dtypes``: per leaf, the lower
    precision the candidate newly computes it from (``_new_precisions``; else
    ``compute_dtype`` for every leaf): it loosens that leaf's tolerance, and only a
    leaf with one gets the integer ``agreement``. ``noises``: per leaf, the
    reference's own rounding error (``Reference.noise``)."""
    ref_leaves, ref_spec = pytree.tree_flatten_with_path(ref_out)
    cand_leaves, cand_spec = pytree.tree_flatten_with_path(cand_out)
    if ref_spec != cand_spec:
        return math.inf, math.inf, Mismatch(
            prefix, trial, None, None, math.inf, math.inf,
            f"{prefix} structure differs: expected {len(ref_leaves)} leaves {ref_spec}, "
            f"got {len(cand_leaves)} {cand_spec}")
    worst_abs = worst_rel = 0.0
    first: Optional[Mismatch] = None
    if isinstance(quantum, tuple) and len(quantum) != len(ref_leaves):
        quantum = max(quantum, default=0.0)  # the graph's outputs are not these leaves: its largest step
    for i, ((kp, r), (_, c)) in enumerate(zip(ref_leaves, cand_leaves)):
        path = prefix + pytree.keystr(kp)
        if type(r) is float and type(c) is float:  # ``loss.item()``: rounds as the tensor it was read from
            r, c = _as_tensors(r, c)
        if isinstance(r, torch.Tensor):
            low = compute_dtypes[i] if compute_dtypes is not None else compute_dtype
            a, rel, mm = _compare_tensor(path, trial, r, c, kind, rtol, atol, low,
                                         agreement if low is not None else None,
                                         noises[i] if noises is not None and i < len(noises) else None,
                                         quantum[i] if isinstance(quantum, tuple) else quantum, unit)
        else:
            equal = _same_leaf(r, c)
            a, rel = (0.0, 0.0) if equal else (math.inf, math.inf)
            mm = None if equal else Mismatch(path, trial, None, None, a, rel,
                                             f"expected {r!r}, got {c!r}")
        worst_abs, worst_rel = max(worst_abs, a), max(worst_rel, rel)
        if mm is not None and first is None:
            first = mm
    return worst_abs, worst_rel, first


def _as_tensors(r: float, c: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Two Python float outputs as 0-dim tensors of the precision they were computed
    in, so they compare with its tolerance (``==`` would fail any rewrite that rounds
    differently): float32 when both are float32 values (``.item()`` of a float32 or
    half-precision tensor; a float64 result almost never is one), else float64."""
    narrow = torch.tensor([r, c], dtype=torch.float32).tolist()
    fits = all(math.isnan(v) or v == n for v, n in zip((r, c), narrow))
    dtype = torch.float32 if fits else torch.float64
    return torch.tensor(r, dtype=dtype), torch.tensor(c, dtype=dtype)


def _same_leaf(r: Any, c: Any) -> bool:
    """Two output leaves that are not tensors (ints, floats, strings, objects) are
    the same: of one type and equal (NaN equals NaN); an ``==`` that raises or does
    not give a truth value (an object holding tensors) holds only for the same object."""
    if type(r) is not type(c):
        return False
    if isinstance(r, float) and math.isnan(r) and math.isnan(c):
        return True
    try:
        same = r == c
        if isinstance(same, bool) or type(same).__name__ in ("bool", "bool_"):  # numpy's scalars: numpy's bool
            return bool(same)
        return r is c
    except Exception:  # noqa: BLE001 - an object that cannot tell
        return r is c


def _flips_from_non_finite(trial: int, reference: "Reference", candidate: Callable, state: Any) -> Optional[Mismatch]:
    """Integer outputs that differ (within ``INT_AGREEMENT``) where the candidate
    makes inf or NaN from finite values more often than the original: no rounding
    flip but a new inf (``rewrite.trust.nonfinite``). Both run again, only then (the
    original's count of an in-place rewrite was taken before the model changed)."""
    inputs, rng_seed = reference.inputs(trial), reference.seed + trial
    births = [reference.non_finite_births(trial, state)]
    births.append(non_finite_births(lambda: _call(candidate, inputs, rng_seed, dtypes=False)))
    state.restore()
    if births[0] is None:  # not counted before an in-place rewrite: as if the original made none
        births[0] = 0
    if births[1] <= births[0]:
        return None
    return Mismatch("output", trial, None, None, math.inf, math.inf,
                    f"integer outputs differ where the rewrite newly makes inf/NaN ({births[1]} op calls turn "
                    f"finite values into one, the original's {births[0]}): the integer agreement allows "
                    "rounding flips, not these")


def _int_agreement(ref_out: Any, cand_out: Any,
                   compute_dtypes: Optional[Tuple[Optional[torch.dtype], ...]] = None) -> Optional[float]:
    """The smallest share of equal elements over integer/bool outputs (those with a
    lower compute dtype, when ``compute_dtypes`` says per leaf), or None."""
    leaves = list(zip(pytree.tree_leaves(ref_out), pytree.tree_leaves(cand_out)))
    shares = [float((r == c).float().mean()) for i, (r, c) in enumerate(leaves)
              if (compute_dtypes is None or (i < len(compute_dtypes) and compute_dtypes[i] is not None))
              and isinstance(r, torch.Tensor) and isinstance(c, torch.Tensor) and not _is_float(r.dtype)
              and r.shape == c.shape and r.numel()]
    return min(shares) if shares else None


def _storage(t: Any) -> Optional[int]:
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return None
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, subclasses)
        return None
    return ptr or None


def _sharing(run: _Run) -> Tuple[set, Dict[str, tuple]]:
    """Which outputs share memory with an input or a module constant (``(output path,
    what it shares with)``), and where each output lies (output path -> its storage
    and the bytes of it that it spans, ``_span``: two outputs share memory when they
    overlap there, not merely when they are two slices of one storage)."""
    inputs = {}
    for i, t in enumerate(input_leaves(run.inputs)):
        ptr = _storage(t)
        if ptr is not None:
            inputs.setdefault(ptr, i)
    state = run.storages
    out, groups = set(), {}
    for kp, t in pytree.tree_flatten_with_path(run.outputs)[0]:
        ptr, path = _storage(t), "output" + pytree.keystr(kp)
        if ptr is None:
            continue
        if ptr in inputs:
            out.add((path, f"input {inputs[ptr]}"))
        if ptr in state:
            out.add((path, "a module constant"))
        groups[path] = (ptr, *_span(t))
    return out, groups


def _span(t: torch.Tensor) -> Tuple[int, int]:
    """The bytes of its storage ``t`` can address, ``[start, end)`` (empty for no
    elements): two tensors whose spans in one storage do not meet share nothing."""
    if t.numel() == 0:
        return 0, 0
    size = t.element_size()
    start = t.storage_offset() * size
    last = sum((int(n) - 1) * abs(int(st)) for n, st in zip(t.shape, t.stride()))
    return start, start + (last + 1) * size


def _overlap(a: Optional[tuple], b: Optional[tuple]) -> bool:
    return a is not None and b is not None and a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def _shared_only_in(mine: Dict[str, tuple], theirs: Dict[str, tuple]) -> Optional[Tuple[str, str]]:
    """Two outputs whose memory overlaps in ``mine`` and not in ``theirs``: ``(the
    later path, the earlier one)``, or None."""
    by_storage: Dict[int, list] = {}
    for path, where in mine.items():
        by_storage.setdefault(where[0], []).append(path)
    for paths in by_storage.values():
        # swept by start: each span meets only the earlier ones still open (disjoint
        # slices, ``x.unbind(0)`` into thousands of outputs, stay linear)
        paths.sort(key=lambda p: mine[p][1])
        open_: list = []
        for path in paths:
            start = mine[path][1]
            open_ = [other for other in open_ if mine[other][2] > start]
            for other in open_:
                if _overlap(mine[path], mine[other]) and not _overlap(theirs.get(path), theirs.get(other)):
                    return path, other
            open_.append(path)
    return None


def _output_reads(candidate: Any, index: int, leaves: int) -> Optional[set]:
    """The ids of the tensors (parameters, buffers, constants) a GraphModule's output
    leaf ``index`` (pytree order, of ``leaves``) is computed from, through its graph;
    None when the graph cannot tell."""
    if not isinstance(candidate, fx.GraphModule):
        return None
    output = next((n for n in reversed(candidate.graph.nodes) if n.op == "output"), None)
    if output is None or not output.args:
        return None
    flat = pytree.tree_leaves(output.args[0])
    if len(flat) != leaves:
        return None
    reads: set = set()
    stack = [flat[index]] if isinstance(flat[index], fx.Node) else []
    seen: set = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "get_attr":
            try:
                value = attribute(candidate, node.target)
            except AttributeError:
                return None
            reads.update(id(t) for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))
            if isinstance(value, torch.nn.Module):
                reads.update(id(t) for t in [*value.parameters(), *value.buffers()])
        elif node.op == "call_module":
            try:
                module = attribute(candidate, node.target)
            except AttributeError:
                return None
            reads.update(id(t) for t in [*module.parameters(), *module.buffers()])
        stack.extend(node.all_input_nodes)
    return reads


def _requires_grad_change(trial: int, ref: _Run, cand: _Run, candidate: Any = None,
                          reaches_input: Optional[Callable[[int, int], bool]] = None) -> Optional[Mismatch]:
    """An output that requires grad in the original and not in the rewrite, both
    called with gradients enabled on the same inputs: a caller training through it
    sees it (its ``backward`` fails, or no gradient reaches the parameters). Unless
    every parameter it required grad through is one the rewrite no longer trains (a
    fold made it a rewrite-time constant, and the rewrite holds a constant the original
    did not: the shipped folds are for inference); an
    input, or a tensor outside the module, always counts. One that newly requires
    grad fails too: the caller sees it (``out.numpy()`` raises, the autograd graph
    is kept). Not compared when either could not run so."""
    if ref.requires_grad is None or cand.requires_grad is None or len(ref.requires_grad) != len(cand.requires_grad) \
            or (ref.activation_error is None) != (cand.activation_error is None):
        return None
    paths = [pytree.keystr(kp) for kp, _ in pytree.tree_flatten_with_path(ref.outputs)[0]]
    names = {id(t): name for name, t in ref.state.items()}
    trained = {id(t) for t in cand.state.values() if t.requires_grad}
    # a fold leaves a constant it computed, under a name of its own, in place of what
    # it folded; a rewrite that only drops a parameter (``w * 0 => zeros``) leaves
    # none, and the rewrite's own copy of a buffer its forward writes keeps the
    # buffer's name; per output when the graph tells (a fold elsewhere must not
    # excuse an output that lost its gradient)
    new_constants = {id(t) for name, t in cand.state.items() if name not in ref.state}
    folded = bool(new_constants)
    positions = None  # _input_positions, when first needed
    walked: Dict[int, list] = {}  # each root's walk, once (both directions walk both runs' roots)

    def leaves(root: Any) -> list:
        if id(root) not in walked:
            walked[id(root)] = grad_leaves(root)
        return walked[id(root)]
    for i, (path, mine, theirs) in enumerate(zip(paths, ref.requires_grad, cand.requires_grad)):
        if not mine and theirs:
            return Mismatch("output" + path, trial, None, None, math.inf, math.inf,
                            "requires grad in the rewrite only (the caller's out.numpy() fails, and a backward "
                            "through it reaches tensors the original's did not); both called with gradients "
                            "enabled, floating inputs requiring grad as a trained model's activations do")
        if not mine:
            continue
        if theirs:
            # a parameter a fold made a constant is not lost: this output is no longer
            # computed from it in the rewrite's graph
            reads = _output_reads(candidate, i, len(paths)) if folded else None
            if positions is None:  # once per call, only when some output requires grad in both
                positions = _input_positions(ref, cand)
            fresh = folded if reads is None else any(r in new_constants for r in reads)
            lost = _lost_gradient(ref, cand, i, positions, names, trained, reads, fresh, reaches_input, leaves)
            if lost is not None:
                return Mismatch("output" + path, trial, None, None, math.inf, math.inf,
                                f"gradients reach {lost} through this output in the original, not in the rewrite "
                                "(it still requires grad, through other tensors); both called with gradients "
                                "enabled, floating inputs requiring grad as a trained model's activations do")
            gained = _gained_gradient(ref, cand, i, positions, names, leaves)
            if gained is not None:
                return Mismatch("output" + path, trial, None, None, math.inf, math.inf,
                                f"gradients reach {gained} through this output in the rewrite, not in the original "
                                "(a backward gives it a gradient, even a zero one, where the original gave none: "
                                "an optimizer's weight decay then moves it); both called with gradients enabled, "
                                "floating inputs requiring grad as a trained model's activations do")
            continue
        root = ref.grad_roots[i] if ref.grad_roots is not None else None
        reads = _output_reads(candidate, i, len(paths)) if folded else None
        if reads is None:  # what the rewrite still holds stands for what it reads
            kept = [t for t in leaves(root) if id(t) not in names or id(t) in trained]
            fresh = folded
        else:  # what this output is computed from, in the rewrite's graph
            kept = [t for t in leaves(root) if id(t) not in names or id(t) in reads]
            fresh = any(r in new_constants for r in reads)
        if root is not None and not kept and fresh:
            continue  # only through parameters the rewrite folded away, into constants it reads
        if positions is None:
            positions = _input_positions(ref, cand)
        through = "" if not kept else (
            f" (through parameter {names[id(kept[0])]}, which the rewrite still has)" if id(kept[0]) in names
            else f" (through input {positions[id(kept[0])]})" if id(kept[0]) in positions
            else " (through a tensor outside the module)")
        return Mismatch("output" + path, trial, None, None, math.inf, math.inf,
                        "gradients reach this output in the original, not in the rewrite: it requires grad "
                        f"in the original only{through}; both called with gradients enabled, floating inputs requiring "
                        "grad as a trained model's activations do")
    return None


def _input_positions(ref: _Run, cand: _Run) -> dict:
    """id -> position of each input: each run's copy of it, and what that copy was
    cloned from (a clone of an input that requires grad passes its gradient on: to
    the tensor given, a dynamo graph's lifted parameter); a rewrite's run may reuse
    the original's values (rewrite.trust.reuse), whose gradients reach the original's."""
    positions: dict = {}
    for run in (ref, cand):
        for k, t in enumerate(input_leaves(run.inputs)):
            if isinstance(t, torch.Tensor):
                positions[id(t)] = k
                for source in grad_leaves(t.grad_fn) if t.grad_fn is not None else ():
                    positions.setdefault(id(source), k)
    return positions


def _lost_gradient(ref: _Run, cand: _Run, index: int, positions: dict, names: dict, trained: set,
                   reads: Optional[set] = None, fresh: bool = False,
                   reaches_input: Optional[Callable[[int, int], bool]] = None,
                   leaves: Callable[[Any], list] = grad_leaves) -> Optional[str]:
    """What a gradient from output ``index`` reaches in the original and not in the
    rewrite: an input (by position: each run has its own copies), a tensor outside
    the module (``x.view(torch.int32).view(torch.float32)`` keeps every value and cuts
    the path), a parameter the rewrite still trains, or one it dropped when no fold
    explains it. A parameter a fold made a constant is not lost (``fresh``: the rewrite
    holds constants the original did not, which this output reads when ``reads``, the
    tensors the rewrite's graph computes it from, is known). An input counts only where
    the output's value moves with it (``reaches_input(input, output)``: dropping the
    unused half of ``select(stack([a, b]), 0)`` loses a path that carried zeros; a cut
    through ``view(torch.int32)`` keeps the value's dependence and loses its gradient).
    None when nothing is. ``leaves``: ``grad_leaves``, or a memo of it."""
    if ref.grad_roots is None or cand.grad_roots is None or len(cand.grad_roots) <= index:
        return None
    reached = {("input", positions[id(t)]) if id(t) in positions else id(t)
               for t in leaves(cand.grad_roots[index])}
    # the rewrite's own copy of a module (one with hooks) holds its parameters under their names
    reached_names = {name for name, t in cand.state.items() if id(t) in reached}
    for t in leaves(ref.grad_roots[index]):
        if id(t) in positions:
            k = positions[id(t)]
            if ("input", k) not in reached and (reaches_input is None or reaches_input(k, index)):
                return f"input {k}"
        elif id(t) in reached or names.get(id(t)) in reached_names:
            continue
        elif id(t) not in names:
            return "a tensor outside the module"
        elif id(t) in trained:
            if reads is None or id(t) in reads:
                return f"parameter {names[id(t)]}"
        elif not fresh:  # dropped, and no constant of the rewrite stands for it
            return f"parameter {names[id(t)]}"
    return None


def _output_moves(fn: Callable, inputs: Any, rng_seed: int, watch: _Watch, state: Any, outputs: Any,
                  position: int, index: int) -> bool:
    """Whether output leaf ``index`` of ``fn`` (the rewrite; ``outputs``: its run on
    ``inputs``) changes when the input at flat ``position`` is drawn again: whether
    its value depends on that input, so that a gradient path the rewrite lost from it
    carried something. True when it cannot tell (conservative)."""
    args = inputs_copy(inputs)
    leaves = input_leaves(args)
    t = leaves[position] if position < len(leaves) else None
    other = redrawn(t, rng_seed)
    if other is None:
        return True
    with torch.no_grad():
        t.copy_(other)
    try:
        after = pytree.tree_leaves(_call(fn, args, rng_seed, False, watch).outputs)
    except Exception:  # noqa: BLE001 - cannot tell
        return True
    finally:
        state.restore()
    before = pytree.tree_leaves(outputs)
    return index >= len(after) or index >= len(before) or moved(before[index], after[index])


def _gained_gradient(ref: _Run, cand: _Run, index: int, positions: dict, names: dict,
                     leaves: Callable[[Any], list] = grad_leaves) -> Optional[str]:
    """What a gradient from output ``index`` reaches in the rewrite and not in the
    original, of what both have: an input (by position), a parameter of the original
    (``zeros_like(w) => mul(w, 0.0)``), a tensor outside the module. A constant the
    rewrite made (a fold's, which requires grad as its source did) is not the
    original's. None when nothing is."""
    if ref.grad_roots is None or cand.grad_roots is None or len(cand.grad_roots) <= index:
        return None
    reached = {("input", positions[id(t)]) if id(t) in positions else id(t)
               for t in leaves(ref.grad_roots[index])}
    own = {id(t): name for name, t in cand.state.items()}
    reached_names = {name for name, t in ref.state.items() if id(t) in reached}
    for t in leaves(cand.grad_roots[index]):
        name = names.get(id(t), own.get(id(t)))
        if id(t) in positions:
            if ("input", positions[id(t)]) not in reached:
                return f"input {positions[id(t)]}"
        elif id(t) in reached or name in reached_names:
            continue
        elif name in ref.state:  # the original's parameter (or the rewrite's copy of it, by name)
            return f"parameter {name}"
        elif id(t) not in own:
            return "a tensor outside the module"
    return None


def _returned_inputs(run: _Run) -> set:
    """``(output path, "input i")`` for each output that is input ``i`` itself."""
    inputs = {id(t): i for i, t in enumerate(input_leaves(run.inputs)) if isinstance(t, torch.Tensor)}
    return {("output" + pytree.keystr(kp), f"input {inputs[id(t)]}")
            for kp, t in pytree.tree_flatten_with_path(run.outputs)[0]
            if isinstance(t, torch.Tensor) and id(t) in inputs}


def _side_effects(trial: int, ref: _Run, cand: _Run, kind: str, rtol: Optional[float],
                  atol: Optional[float], low: Optional[torch.dtype] = None) -> Optional[Mismatch]:
    """What the caller observes besides the outputs: memory sharing gained or lost,
    inputs written, module state written. ``low``: the lower precision the rewrite
    newly computes in (``_new_precision``): what it writes (a train-mode batch
    norm's running statistics after a bfloat16 conv) is held to that precision's
    tolerance, as its outputs are."""
    ref_sharing, ref_groups = ref.sharing or _sharing(ref)
    cand_sharing, cand_groups = cand.sharing or _sharing(cand)
    gained = sorted(cand_sharing - ref_sharing)
    pair = gained[0] if gained else _shared_only_in(cand_groups, ref_groups)
    if pair is not None:
        return Mismatch(pair[0], trial, None, None, math.inf, math.inf,
                        f"shares memory with {pair[1]} in the rewrite, not in the original "
                        "(writing into one would change the other)")
    # An output that is an input itself (``return x``; a graph's placeholder, which no
    # rewrite replaces) is not held to it: a reimplementation ``x + 0.0`` of the
    # identity compares by value. An output that is a view of an input is.
    lost = sorted(ref_sharing - cand_sharing - _returned_inputs(ref))
    pair = lost[0] if lost else _shared_only_in(ref_groups, cand_groups)
    if pair is not None:
        return Mismatch(pair[0], trial, None, None, math.inf, math.inf,
                        f"shares memory with {pair[1]} in the original, not in the rewrite "
                        "(writing into one changes the other in the original only)")
    layout = _layout_change(ref.outputs, cand.outputs, trial)
    if layout is not None:
        return layout
    retained = _retained_memory(ref.outputs, cand.outputs, trial, {path for path, _ in cand_sharing})
    if retained is not None:
        return retained
    ref_inputs, cand_inputs = input_leaves(ref.inputs), input_leaves(cand.inputs)
    for i in sorted(ref.inputs_written | cand.inputs_written):
        if i not in ref.inputs_written:
            return Mismatch(f"input {i}", trial, None, None, math.inf, math.inf,
                            "the rewrite writes into this input in place; the original does not")
        if i not in cand.inputs_written:
            return Mismatch(f"input {i}", trial, None, None, math.inf, math.inf,
                            "the original writes into this input in place; the rewrite does not")
        _, _, mm = _compare_tensor(f"input {i} (as written)", trial, ref_inputs[i], cand_inputs[i], kind, rtol,
                                   atol, low)
        if mm is not None:
            return mm
    if ref.rng_after is not None and cand.rng_after is not None and not torch.equal(ref.rng_after, cand.rng_after):
        return Mismatch("random stream", trial, None, None, math.inf, math.inf,
                        "the rewrite draws other random numbers than the original (from the same seed, the "
                        "generator ends elsewhere: the caller's next torch.rand would differ)")
    for name in sorted(set(ref.state_written) | set(cand.state_written)):
        if name not in cand.state_written and name not in cand.state:
            continue  # the rewrite folded it away; outputs tell whether that was right
        if name not in ref.state and "." in name:
            continue  # state of a module the rewrite inserted (an observer records what it sees)
        if name not in ref.state_written or name not in cand.state_written:
            who = "the rewrite" if name in cand.state_written else "the original"
            return Mismatch(f"module state {name}", trial, None, None, math.inf, math.inf,
                            f"only {who} writes it in place")
        _, _, mm = _compare_tensor(f"module state {name}", trial, ref.state_written[name],
                                   cand.state_written[name], kind, rtol, atol, low)
        if mm is not None:
            return mm
    return None


def _layout_change(ref_out: Any, cand_out: Any, trial: int) -> Optional[Mismatch]:
    """An output laid out contiguously (or channels_last) in the original and not so
    in the rewrite, or one with other strides (a transposed view) whose strides
    changed: the caller sees it (``out.view(-1)`` or ``out.t().view(-1)`` fails in one
    only, ``is_contiguous()`` changes). Strides of dimensions of size 1 address
    nothing and are not compared."""
    ref_leaves = pytree.tree_flatten_with_path(ref_out)[0]
    cand_leaves = pytree.tree_leaves(cand_out)
    for index, ((kp, r), c) in enumerate(zip(ref_leaves, cand_leaves)):
        if not (isinstance(r, torch.Tensor) and isinstance(c, torch.Tensor)) or r.shape != c.shape \
                or r.numel() < 2 or r.layout != torch.strided or c.layout != torch.strided:
            continue
        mine, theirs = layout_of(r), layout_of(c)
        order = _gapped_order(r) if mine == "strided" else None
        compacted = order is not None and theirs == order
        if mine == "strided" and addressing(r) != addressing(c) and not compacted:
            # a gapped original in a dense format's order (a channel slice of a channels_last
            # conv output): a compact copy in that format serves it, which apply can make
            return Mismatch("output" + pytree.keystr(kp), trial, tuple(r.shape), str(r.dtype).replace("torch.", ""),
                            0.0, 0.0, f"strides changed: {tuple(r.stride())} in the original, {tuple(c.stride())} "
                                      "in the rewrite (out.t().view(-1) or is_contiguous() would tell)",
                            relayout=None if order is None else (index, order))
        if mine not in (None, "strided") and mine != theirs:
            return Mismatch("output" + pytree.keystr(kp), trial, tuple(r.shape), str(r.dtype).replace("torch.", ""),
                            0.0, 0.0, f"memory layout changed: {mine} (strides {tuple(r.stride())}) in the original, "
                                      f"{theirs} (strides {tuple(c.stride())}) in the rewrite (out.view() or "
                                      "is_contiguous() would tell)", relayout=(index, mine))
    return None


def _storage_bytes(t: Any) -> Optional[int]:
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.numel() == 0:
        return None
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # no storage (a subclass, quantized)
        return None


def _retained_memory(ref_out: Any, cand_out: Any, trial: int, caller_memory: set) -> Optional[Mismatch]:
    """An output whose memory is larger in the rewrite than in the original: a view
    of a larger intermediate (``cat([h[-1]])`` returned as ``h[-1]``) keeps all of it
    alive as long as the caller keeps the output, and ``torch.save`` writes all of it.
    Memory the output's own elements fill is never too much. Outputs sharing the
    caller's memory (``caller_memory``: their paths) are compared as sharing instead."""
    ref_leaves = pytree.tree_flatten_with_path(ref_out)[0]
    cand_leaves = pytree.tree_leaves(cand_out)
    for (kp, r), c in zip(ref_leaves, cand_leaves):
        path = "output" + pytree.keystr(kp)
        if path in caller_memory:
            continue
        had, kept = _storage_bytes(r), _storage_bytes(c)
        # a compact copy of an expanded output (the AMP files' cast back) holds only itself
        if had is not None and kept is not None and kept > max(had, c.numel() * c.element_size()):
            return Mismatch(path, trial, tuple(r.shape), str(r.dtype).replace("torch.", ""), 0.0, 0.0,
                            f"keeps {kept} bytes of memory alive in the rewrite, {had} in the original "
                            "(a view of a larger value: torch.save(out) writes all of it)")
    return None


_FORMAT_ORDERS = {"contiguous": None, "channels_last": (0, 2, 3, 1), "channels_last_3d": (0, 2, 3, 4, 1)}


def _gapped_order(t: torch.Tensor) -> Optional[str]:
    """The dense format (``"contiguous"``, ``"channels_last"``...) whose dimension
    order ``t`` keeps with gaps or overlaps (a slice ``logits[:, -1]``, an ``expand``,
    the channel slice of a channels_last conv output): a compact copy of it in that
    format serves every view and write ``t`` serves (only ``stride()`` tells them
    apart), so a rewrite may return one (the AMP files' cast back to float32 after
    such a view). None: a dense tensor, or another order (a transposed slice)."""
    for name, order in _FORMAT_ORDERS.items():
        if order is not None and len(order) != t.dim():
            continue
        perm = order or tuple(range(t.dim()))
        dims = [(int(t.stride()[d]), int(t.shape[d])) for d in perm if int(t.shape[d]) > 1]
        moving = [st for st, _ in dims if st != 0]
        if any(a < b for a, b in zip(moving, moving[1:])):
            continue  # not this order
        expected = 1
        for st, n in reversed(dims):
            if st != expected:
                return name
            expected *= n
        return None  # dense in this order: its layout is compared as such
    return None


def _same_inputs(a: Any, b: Any) -> bool:
    la, lb = input_leaves(a), input_leaves(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x is not y and (x.shape != y.shape or x.dtype != y.dtype or not _same_values(x, y)):
                return False
        elif x is not y and x != y:
            return False
    return True


class Reference:
    """The reference side of ``check_equivalence``, run once per trial and kept.

    A rewrite checked several times against the same model (bisection replays,
    ``on_mismatch="skip-rule"`` re-runs) compares each candidate with the outputs
    the reference produced the first time, instead of running it again; an in-place
    rewrite computes them before the model changes. Trials whose inputs equal an
    earlier trial's (no input the check can vary: none, or only integers fixed by
    their range) cannot tell anything new and are skipped (``report.skipped``).

    Args: as ``check_equivalence``'s. ``graph``: the GraphModule whose placeholder
    metadata describes the inputs when ``example_inputs`` is None (default: ``fn``).
    """

    def __init__(self, fn: Callable, example_inputs: Any = None, *, seed: int = 0,
                 input_ranges: Optional[Mapping[InputKey, Range]] = None,
                 fixed_inputs: Iterable[InputKey] = (), graph: Any = None) -> None:
        self.fn = fn
        # a dynamic dynamo graph's example inputs hold its sizes as SymInts (``s0``):
        # the runs take the sizes they stand for
        self.example_inputs = torch.utils._pytree.tree_map_only(torch.SymInt, _concrete, example_inputs)
        self.seed = seed
        self.input_ranges = input_ranges
        self.fixed_inputs = tuple(fixed_inputs)
        if example_inputs is not None and (input_ranges or self.fixed_inputs):
            validate_input_keys(self.example_inputs, input_ranges, self.fixed_inputs)  # check_equivalence's
        self.graph = graph if graph is not None else fn
        self._half_nodes: Any = _UNREAD
        self._inputs: Dict[int, Any] = {}
        self._narrowed: set = set()  # trials whose one-valued integer inputs keep their value (_narrow)
        self._runs: Dict[int, _Run] = {}
        self._with_dtypes: Dict[int, bool] = {}
        self._repeats: Dict[int, bool] = {}
        self._watch: Optional[_Watch] = None
        self._gradients: Optional[Tuple[Optional[GradientRun], Optional[str]]] = None
        self._second: Dict[Tuple[int, bool], Optional[_Run]] = {}  # second_call's runs
        self._held: Optional[frozenset] = None  # held_positions
        self._noise: Dict[Any, Optional[tuple]] = {}
        self._prepared = False  # in place: the module is the candidate after prepare()
        self._recordable: Optional[bool] = None
        self._plan: Optional[dict] = None  # rewrite.trust.reuse.record_plan of the graph the runs record
        self._runner: Optional[GraphRunner] = None
        self._recording = True
        self._small: Optional[int] = None  # the trial at the smallest sizes (trial_indices), or -1: none
        self._refused: set = set()  # trials whose inputs the original refuses (the smallest sizes)

    def trial_indices(self, trials: int) -> list:
        """The trials the check runs: ``range(trials)``, and one more (numbered
        ``trials``) at the smallest sizes when the graph's inputs have symbolic ones
        (``rewrite.trust.sizes``): the example's sizes decide layouts and
        copy-or-view choices that others do not."""
        if self._small is None:
            self._small = -1
            if self.example_inputs is not None:
                small = smallest_sizes(self.graph, self.inputs(1 if trials > 1 else 0))
                if small is not None:
                    self._inputs[trials] = small
                    self._small = trials
        return [*range(trials), *([self._small] if self._small == trials else [])]

    def is_small(self, trial: int) -> bool:
        """Whether ``trial`` is the one at the smallest sizes (``trial_indices``):
        the program may refuse them, and the trial is then skipped."""
        return trial == self._small and trial >= 0

    def inputs(self, trial: int) -> Any:
        if trial not in self._inputs:
            if self.example_inputs is None:
                if not isinstance(self.graph, fx.GraphModule):
                    raise ValueError("example_inputs is None and neither callable is a GraphModule")
                made = inputs_from_graph(self.graph, self.seed + trial, input_ranges=self.input_ranges)
            elif trial == 0:
                made = self.example_inputs
            else:
                made = generate_inputs(self.example_inputs, self.seed + trial, input_ranges=self.input_ranges,
                                       fixed_inputs=self.fixed_inputs,
                                       widen_constants=trial not in self._narrowed)
            self._inputs[trial] = made
        return self._inputs[trial]

    def _narrow(self, trial: int) -> bool:
        """After the original failed on a random trial whose one-valued integer inputs
        drew their neighbours too (a one-segment model's ``token_type_ids``, an index
        into a table of one row, the last position): the trial's inputs drawn again
        with those inputs as the example has them. False when there is nothing to
        take back."""
        if trial == 0 or trial in self._narrowed or self.example_inputs is None or not any(
                _one_valued_int(leaf) for leaf in input_leaves(self.example_inputs)):
            return False
        self._narrowed.add(trial)
        self._inputs.pop(trial, None)
        self._repeats.pop(trial, None)
        return True

    def repeats(self, trial: int) -> bool:
        """Whether this trial's inputs equal an earlier trial's."""
        if trial not in self._repeats:
            mine = self.inputs(trial)
            self._repeats[trial] = any(_same_inputs(mine, self.inputs(t)) for t in range(trial))
        return self._repeats[trial]

    def run(self, trial: int, dtypes: bool = True, state: Optional[_SavedState] = None) -> _Run:
        """The reference's run on this trial's inputs (computed once; its module
        state is put back afterwards: by ``state.restore()`` when given, a saved
        state covering the reference). ``dtypes``: record the floating dtypes its
        ops compute in (approximate checks need them). A random trial the original
        fails on is drawn again once with all-zero integer inputs kept zero."""
        if trial in self._refused:
            raise RuntimeError(f"the original refuses trial {trial}'s inputs")
        try:
            return self._run_once(trial, dtypes, state)
        except RuntimeError:
            if self.is_small(trial):
                self._refused.add(trial)  # asked again after an in-place rewrite, the module is the candidate
                raise
            if not self._narrow(trial):
                raise
        return self._run_once(trial, dtypes, state)

    def _run_once(self, trial: int, dtypes: bool, state: Optional[_SavedState]) -> _Run:
        if trial not in self._runs or (dtypes and not self._with_dtypes[trial]):
            records = self._records()
            with (preserved_state(self.fn, runs_only=True, watches=(self.watch(dtypes),)) if state is None
                  else contextlib.nullcontext(state)) as saved, \
                    running_as_graph(self.fn, force=records, runner=self._recorder() if records else None) as fn:
                runner = active_runner(fn) if records else None
                recording = Recording(self._plan) if runner is not None and runner.recording is None else None
                if recording is not None:  # the values, for a rewrite's run to reuse
                    runner.recording = recording
                try:
                    # trial 0 with gradients enabled: which outputs require grad
                    self._runs[trial] = _call(fn, self.inputs(trial), self.seed + trial, dtypes, self.watch(dtypes),
                                              trial == 0, saved.restore,
                                              self.held_positions() if trial == 0 else frozenset())
                except Exception as e:
                    if "inference tensor outside InferenceMode" in str(e):
                        raise ValueError(
                            "the model writes an inference tensor of its own in place (its state was made under "
                            "torch.inference_mode()): the check runs the model outside inference mode, where "
                            "torch refuses such a write. Build the model outside inference_mode, or pass "
                            f"check=False ({type(e).__name__}: {str(e).splitlines()[0]})") from e
                    hint = "" if trial == 0 else (
                        " (the original itself fails on these random inputs: if it needs inputs random ones are "
                        "not, such as sorted lengths or a positive definite matrix, pass fixed_inputs=[index] or "
                        "input_ranges={index: (low, high)} to apply, or trials=1)")
                    raise ModelRunError(
                        f"reference failed on trial {trial} inputs: {type(e).__name__}: {e}{hint}") from e
                finally:
                    if recording is not None:
                        runner.recording = None
                    if state is not None:
                        state.restore()
                if recording is not None and recording.complete:
                    self._runs[trial] = attrs.evolve(self._runs[trial], recorded=recording)
            self._with_dtypes[trial] = dtypes
        return self._runs[trial]

    def gradients(self, state: Optional[_SavedState] = None) -> Tuple[Optional[GradientRun], Optional[str]]:
        """The reference's backward pass on trial 0's inputs (``rewrite.trust.gradients``),
        computed once: ``(run, None)``, or ``(None, why)`` when there is nothing to
        compare (no gradient reaches an output, or its backward fails)."""
        if self._gradients is None and self._prepared:
            return None, "not computed before the rewrite changed the model"
        if self._gradients is None:
            with self._running(state) as fn:
                try:
                    run = gradient_run(fn, self.inputs(0), self.seed)
                    self._gradients = (run, None if run is not None else "no gradient reaches an output")
                except Exception as e:  # noqa: BLE001 - no gradient to preserve
                    self._gradients = (None, f"the original's backward failed: {type(e).__name__}: {e}")
        return self._gradients

    def held_positions(self) -> frozenset:
        """Flat input positions the gradient trial passes as given rather than as
        activations requiring grad: fixed inputs, and the parameters and buffers a
        dynamo graph takes as inputs (``lifted_state_positions``; worked out once)."""
        if self._held is None:
            held = {k for k in self.fixed_inputs if isinstance(k, int)}
            if isinstance(self.graph, fx.GraphModule):
                held.update(lifted_state_positions(self.graph))
            self._held = frozenset(held)
        return self._held

    def second_call(self, trial: int, dtypes: bool, state: Optional[_SavedState] = None) -> Optional[_Run]:
        """The reference's second call in a row, on ``trial``'s inputs, from the
        module state its call on trial 0's inputs left (computed once); None when that
        call writes no module state (or before trial 0 ran): the second call would
        start from the state the first did (``_second_call_mismatch``)."""
        first = self._runs.get(0)
        if first is None or not first.state_written:
            return None
        key = (trial, dtypes)
        if key not in self._second and not self._prepared:
            with self._running(state) as fn:
                watch = self.watch(dtypes)
                try:
                    _call(fn, self.inputs(0), self.seed, False, watch)
                    self._second[key] = _call(fn, self.inputs(trial), self.seed + trial, dtypes, watch)
                except Exception:  # noqa: BLE001 - the original cannot be called twice so: nothing to compare
                    self._second[key] = None
        return self._second.get(key)

    @contextlib.contextmanager
    def _running(self, state: Optional[_SavedState]) -> Iterator[Any]:
        """The reference callable (its graph run node by node when its code waits),
        its module state put back afterwards: by ``state.restore()`` when given, else
        by a saved state of its own."""
        with (preserved_state(self.fn, runs_only=True, watches=(self.watch(),)) if state is None
              else contextlib.nullcontext()), running_as_graph(self.fn) as fn:
            try:
                yield fn
            finally:
                if state is not None:
                    state.restore()

    def noise(self, trial: int, state: Optional[_SavedState] = None) -> Optional[tuple]:
        """Per output leaf, the reference's own rounding error on this trial's inputs
        when it computes in half precision (``rewrite.trust.precision``: one more run
        with half precision widened to float32), else None."""
        def estimate(ref: _Run, fn: Any, inputs: Any, seed: int) -> Optional[tuple]:
            if not computes_in_half(ref.outputs, ref.dtypes | (self.watch().static or frozenset())):
                return None
            return rounding_noise(ref.outputs, widened_run(fn, inputs, seed))

        return self._estimated(trial, None, state, estimate)

    def precise(self, trial: int, state: Optional[_SavedState] = None) -> Optional[tuple]:
        """Per output leaf, a float64 run of the reference on this trial's inputs and
        the reference's own rounding error around each element (``rounding_noise``),
        else None (no float64 run: an op without float64 kernels)."""
        def estimate(ref: _Run, fn: Any, inputs: Any, seed: int) -> Optional[tuple]:
            return rounding_noise(ref.outputs, widened_run(fn, inputs, seed, to_float64=True))

        return self._estimated(trial, "float64", state, estimate)

    def narrowing_noise(self, trial: int, dtype: torch.dtype, state: Optional[_SavedState] = None) -> Optional[tuple]:
        """Per output leaf, how far the reference is, on this trial's inputs, from its
        own run under ``torch.autocast`` to ``dtype`` (``rewrite.trust.precision``:
        what computing it in that precision costs), else None."""
        def estimate(ref: _Run, fn: Any, inputs: Any, seed: int) -> Optional[tuple]:
            return rounding_noise(narrowed_run(fn, inputs, seed, dtype), ref.outputs)

        return self._estimated(trial, dtype, state, estimate)

    def non_finite_births(self, trial: int, state: Optional[_SavedState] = None) -> Optional[int]:
        """How many op calls of the reference make inf or NaN from finite values on this
        trial's inputs (``rewrite.trust.nonfinite``), counted once (None before the
        trial's run, or when ``prepare`` did not count it)."""
        def estimate(ref: _Run, fn: Any, inputs: Any, seed: int) -> int:
            return non_finite_births(lambda: _call(fn, inputs, seed, dtypes=False))

        return self._estimated(trial, "births", state, estimate)

    def _estimated(self, trial: int, dtype: Any, state: Optional[_SavedState],
                   estimate: Callable[[_Run, Any, Any, int], Optional[tuple]]) -> Optional[tuple]:
        """``estimate(run, fn, private inputs, seed)`` for this trial, computed once
        (None before the trial's run). After ``prepare`` only what it computed: the
        module may be the candidate by then."""
        key = (trial, dtype)
        if key not in self._noise and not self._prepared:
            ref = self._runs.get(trial)
            if ref is None:
                return None
            with self._running(state) as fn:
                self._noise[key] = estimate(ref, fn, inputs_copy(self.inputs(trial)), self.seed + trial)
        return self._noise.get(key)

    def _records(self) -> bool:
        """Whether runs keep every value for a rewrite's runs to reuse
        (``rewrite.trust.reuse``): whether the graph allows it is decided once,
        before an in-place rewrite changes it; ``stop_recording`` ends it."""
        if self._recordable is None:
            self._recordable = recordable(self.fn) and runs_generated_code(self.fn)
            self._plan = record_plan(self.fn) if self._recordable else None
        return self._recording and self._recordable

    def _recorder(self) -> Optional[GraphRunner]:
        """The runner recording runs go through (built once; None if they cannot)."""
        if self._runner is None and self._records():
            try:
                self._runner = GraphRunner(self.fn)
            except NotImplementedError:
                self._recordable = False
        return self._runner

    def stop_recording(self) -> None:
        """Later runs keep no values: a rewrite's run took too few of them to pay
        for keeping them (and for running node by node rather than the code)."""
        self._recording = False

    def watch(self, dtypes: bool = False) -> _Watch:
        """What the check watches of the reference (worked out on its first run: an
        in-place rewrite changes the module's graph afterwards). The per-output
        lineage of dtypes only when ``dtypes`` asks for it (a bit-exact check never
        does: ``prepare`` runs every trial with the tolerance it will be checked at)."""
        if self._watch is None:
            self._watch = _Watch.of(self.fn, lineage=dtypes)
            if isinstance(self.graph, fx.GraphModule) and self.graph is not self.fn:
                # a module's trace tells what its code draws from (a wrapped helper's
                # numpy generator), which the module itself does not show
                self._watch = self._watch.drawing_from(model_generators(self.graph))
        elif dtypes:
            self._watch = self._watch.with_lineage(self.fn)
        return self._watch

    @property
    def half_nodes(self) -> Optional[Tuple[collections.Counter, ...]]:
        """The original graph's nodes per half precision, per output
        (``half_nodes_per_output``): read once, by ``prepare`` before an in-place
        rewrite changes the graph, else when an approximate check first asks."""
        if self._half_nodes is _UNREAD:
            self._half_nodes = half_nodes_per_output(self.graph)
        return self._half_nodes

    def prepare(self, trials: int, tolerance: str = "approx", gradients: bool = False,
                lower: Iterable[torch.dtype] = ()) -> "Reference":
        """Run every trial now (before an in-place rewrite changes the model), and
        the backward pass too when ``gradients``; a model in half precision also
        widened (``noise``), and run under autocast to each of ``lower`` (the half
        precisions the rewrite newly computes in: ``narrowing_noise``): the check may
        need them afterwards."""
        if tolerance != "exact":
            self.stop_recording()  # see _check
        if tolerance == "approx":
            self.half_nodes  # noqa: B018 - read now, while the graph is the original's
        with gc_paused(), torch.inference_mode(False), autocast_off(), cpu_default_device(), fake_mode_off(), \
                preserved_state(self.fn, runs_only=True, watches=(self.watch(),)) as state, \
                running_as_graph(self.fn, force=self._records(), runner=self._recorder()):
            for t in self.trial_indices(trials):
                if not self.repeats(t):
                    try:
                        run = self.run(t, dtypes=tolerance == "approx", state=state)
                    except RuntimeError:
                        if not self.is_small(t):
                            raise
                        continue  # sizes the program does not take: _check skips the trial

                    self.noise(t, state)
                    if _below_unit(run.outputs):  # _confirm_below_unit may ask
                        self.precise(t, state)
                    for dtype in lower:
                        self.narrowing_noise(t, dtype, state)
                    if lower:  # a rewrite newly computing in half precision may let integers flip
                        self.non_finite_births(t, state)
            self.second_call(_second_call_trial(self, trials), tolerance == "approx", state)
            if gradients:
                self.gradients(state)
        self._prepared = True
        return self


@one_thread_at_a_time()
def check_equivalence(reference: Callable, candidate: Callable, example_inputs: Any = None, *,
                      trials: int = 3, seed: int = 0, rtol: Optional[float] = None,
                      atol: Optional[float] = None,
                      input_ranges: Optional[Mapping[InputKey, Range]] = None,
                      fixed_inputs: Iterable[InputKey] = (), tolerance: str = "approx",
                      int_agreement: Optional[float] = None, gradients: bool = False) -> EquivalenceReport:
    """Run ``reference`` and ``candidate`` on the same inputs and compare what the
    caller observes: outputs, inputs written in place, module state written in
    place, and memory shared between outputs, inputs and module constants.

    Trial 0 uses ``example_inputs`` themselves; trials 1.. use
    ``generate_inputs(example_inputs, seed + trial)``. With ``example_inputs``
    None, inputs come from the placeholder metadata of ``reference`` (or
    ``candidate``), which must then be a GraphModule, and every trial is
    random. Both run under ``torch.no_grad()`` in whatever train/eval mode
    they are in (trial 0 with gradients enabled, to compare which outputs require
    grad; under ``no_grad`` if that raises), each on its own copy of the inputs;
    their parameters and buffers are restored afterwards. ``tolerance`` is
    ``"exact"`` (only rounding may differ: ``EXACT_TOLERANCES``) or ``"approx"``
    (``TOLERANCES``). ``rtol``/``atol``, when given, override the table (``atol``
    is then absolute, not scaled). An output an approximate candidate newly
    computes from a lower precision is held to that precision's tolerance and, if
    integer, passes on an agreement rate of at least ``int_agreement`` (default
    ``INT_AGREEMENT``), reported in the report. The check stops at the first trial with a
    mismatch. If the candidate raises, that is reported as a mismatch; if the
    reference raises, the inputs are at fault and the error propagates.

    ``reference`` may be a ``Reference``: its runs are computed once and reused by
    every check against it (its own inputs settings then apply). Trials whose
    inputs equal an earlier trial's are skipped and counted in ``report.skipped``,
    unless the original drew random numbers (each trial has its own seed).
    """
    if tolerance not in ("exact", "approx"):
        raise ValueError(f"tolerance must be 'exact' or 'approx', not {tolerance!r}")
    if not isinstance(reference, Reference):
        graph = reference if isinstance(reference, fx.GraphModule) else candidate
        if example_inputs is None and not isinstance(graph, fx.GraphModule):
            raise ValueError("example_inputs is None and neither callable is a GraphModule")
        reference = Reference(reference, example_inputs, seed=seed, input_ranges=input_ranges,
                              fixed_inputs=fixed_inputs, graph=graph)
    elif reference.example_inputs is None and not isinstance(reference.graph, fx.GraphModule):
        reference.graph = candidate
    # The runs allocate a tensor per node: the cyclic collector would traverse every
    # live object again and again (a full collection on a 10k-node graph: ~0.4 s)
    # for garbage that reference counting frees anyway.
    # Under ``torch.inference_mode`` the private copies of the inputs would be
    # inference tensors, which keep no version counter: the check runs outside it
    # (the models compute the same values; a copy of an inference tensor is a plain one).
    with gc_paused(), torch.inference_mode(False), autocast_off(), cpu_default_device(), fake_mode_off():
        return _check(reference, candidate, trials, rtol, atol, tolerance, int_agreement, gradients)


def _check(reference: "Reference", candidate: Callable, trials: int, rtol: Optional[float],
           atol: Optional[float], tolerance: str, int_agreement: Optional[float],
           gradients: bool = False) -> EquivalenceReport:
    seed = reference.seed
    worst_abs = worst_rel = 0.0
    agreed: Optional[float] = None
    skipped = 0
    compared = False  # some output of some trial held an element
    # One saved state for both (a copy shares the reference's tensors), put back
    # after every run: each starts from the state as it was.
    dtypes = tolerance == "approx"
    watch = _Watch.of(candidate, dtypes, reference.watch(dtypes).static if dtypes else None)
    # both runs start every generator either one draws from where the caller left it
    watch = watch.drawing_from(reference.watch(dtypes).generators)
    reference._watch = reference.watch(dtypes).drawing_from(watch.generators)
    # Modules waiting for their code run their graphs instead (rewrite.trust.runner).
    # In place, the reference ran before the module became the candidate: its watch
    # describes a graph the module no longer has.
    watches = (watch, None if reference.fn is candidate else reference.watch(dtypes))
    low0: Optional[torch.dtype] = None
    # a graph that rounds through int8 values: an approximate rewrite (an int8 kernel
    # for a float op between dequantize and quantize) may land one step away
    quantum = graph_quantum(reference.graph) if tolerance == "approx" else 0.0
    # The reference's runs keep their values where the rewrite's runs can take
    # them instead of computing them again (rewrite.trust.reuse); not when the
    # rewrite's ops are dispatched through the dtype recorder (it must see them all).
    if tolerance != "exact":  # an approximate rule changes values: what follows them is computed anew
        reference.stop_recording()
    records = reference._records()
    with preserved_state(candidate, reference.fn, runs_only=True, watches=watches) as state, \
            running_as_graph(reference.fn), running_as_graph(candidate, force=records) as run_candidate:
        runner = active_runner(run_candidate) if records and not watch.dispatches(dtypes) else None
        plan = ReusePlan(run_candidate, runner.steps, reference._plan) if runner is not None else None
        more_half = _more_half_per_output(reference.half_nodes, half_nodes_per_output(candidate)) \
            if tolerance == "approx" else None
        compare = _Comparison(reference, run_candidate, state, tolerance, rtol, atol, int_agreement, quantum,
                              more_half)
        draws = False  # the original draws random numbers: a trial's own seed can tell, equal inputs or not
        for t in reference.trial_indices(trials):
            if reference.repeats(t) and not draws:
                skipped += 1
                continue
            try:
                ref = reference.run(t, dtypes, state)
            except RuntimeError:
                if not reference.is_small(t):
                    raise
                skipped += 1  # the smallest sizes: the program refuses them (its input guards)
                continue
            draws = draws or _drew_random(ref, seed + t)
            inputs = reference.inputs(t)
            if plan is not None and ref.recorded is not None:
                runner.reuse = (plan, ref.recorded)
            try:
                cand = _call(run_candidate, inputs, seed + t, dtypes, watch, t == 0, state.restore,
                             reference.held_positions() if t == 0 else frozenset())
            except Exception as e:
                mm = Mismatch("output", t, None, None, math.inf, math.inf,
                              f"candidate raised {type(e).__name__}: {e}")
                return EquivalenceReport(False, t + 1, math.inf, math.inf, mm, skipped=skipped)
            finally:
                if runner is not None:
                    runner.reuse = None
                state.restore()
            if plan is not None and runner.reused * 4 < plan.computing:
                reference.stop_recording()  # the rewrite changed values early: most is recomputed
            a, r, share, mm, low = compare.runs(t, ref, cand, inputs)
            compared = compared or _holds_elements(ref.outputs)
            if share is not None:
                agreed = share if agreed is None else min(agreed, share)
            worst_abs, worst_rel = max(worst_abs, a), max(worst_rel, r)
            if mm is None and cand.grad_error is not None and ref.grad_error is None and ref.requires_grad is not None:
                mm = Mismatch("output", t, None, None, math.inf, math.inf,
                              f"the rewrite raises with gradients enabled, where the original runs (a caller "
                              f"training through it would see it): {cand.grad_error}")
            if mm is None and cand.activation_error is not None and ref.activation_error is None \
                    and ref.requires_grad is not None:
                mm = Mismatch("output", t, None, None, math.inf, math.inf,
                              f"the rewrite raises when its floating inputs require grad (as a trained model's "
                              f"activations do), where the original runs: {cand.activation_error}")
            if mm is None:
                mm = _requires_grad_change(t, ref, cand, candidate, functools.partial(
                    _output_moves, run_candidate, inputs, seed + t, watch, state, cand.outputs))
            if mm is not None:
                return EquivalenceReport(False, t + 1, worst_abs, worst_rel, mm, agreed, skipped)
            if t == 0:
                low0 = low
        mm = _second_call_mismatch(compare, watch, trials, dtypes)
        if mm is not None:
            return EquivalenceReport(False, trials, worst_abs, worst_rel, mm, agreed, skipped)
        if gradients:
            mm = _gradient_mismatch(reference, run_candidate, state, tolerance, rtol, atol, low0)
            if mm is not None:
                return EquivalenceReport(False, trials, worst_abs, worst_rel, mm, agreed, skipped)
    return EquivalenceReport(True, trials, worst_abs, worst_rel, None, agreed, skipped, empty=not compared)


def _drew_random(run: _Run, seed: int) -> bool:
    """Whether ``run`` (started from ``seed``) drew random numbers: it moved torch's
    CPU generator, or Python's or numpy's."""
    return run.host_drew or (run.rng_after is not None
                             and not torch.equal(run.rng_after, torch.Generator().manual_seed(seed).get_state()))


@attrs.frozen
class _Comparison:
    """How a pair of runs, the original's and the rewrite's on the same inputs, is
    compared: the check's settings, the same for every trial."""

    reference: "Reference"
    candidate: Callable
    state: Any
    tolerance: str
    rtol: Optional[float]
    atol: Optional[float]
    int_agreement: Optional[float]
    quantum: Union[float, Tuple[float, ...]]
    #: per output leaf, a half precision more of the rewrite's nodes it is computed from
    #: compute in than the original's (``_more_half_per_output``), or None
    more_half: Optional[Tuple[Any, ...]] = None

    def runs(self, t: int, ref: _Run, cand: _Run, inputs: Any
             ) -> Tuple[float, float, Optional[float], Optional[Mismatch], Optional[torch.dtype]]:
        """``(worst abs error, worst rel error, integer agreement or None, first
        mismatch or None, the lower precision the rewrite newly computes in or None)``
        of the outputs and side effects of two runs on trial ``t``'s inputs."""
        reference, state, tolerance, rtol, atol, quantum = (self.reference, self.state, self.tolerance, self.rtol,
                                                            self.atol, self.quantum)
        # per output: only what the rewrite newly computes it from in a lower
        # precision loosens its tolerance (and lets its integers flip)
        given = frozenset(x.dtype for x in input_leaves(inputs)
                          if isinstance(x, torch.Tensor) and x.is_floating_point())
        # (per output first: a model computing float16 on one branch may be lowered
        # to float16 on another, which the whole run's dtypes would not show)
        lows = _new_precisions(ref, cand, given) if tolerance == "approx" else None
        low = loosest({d for d in lows if d is not None}) if lows is not None else None
        lows = lows if low is not None else None
        bound = None if low is None else (INT_AGREEMENT if self.int_agreement is None else self.int_agreement)
        a, r, mm = _compare(t, ref.outputs, cand.outputs, tolerance, rtol, atol, None, agreement=bound,
                            compute_dtypes=lows, quantum=quantum)
        narrowed_low = None  # the precision of the allowance for outputs computed more in it
        more = None
        if mm is not None and rtol is None and atol is None:
            # one newly computed in a lower precision may be as far from the original
            # as torch's autocast to it is; a model in half precision is itself far
            # from exact, and a rewrite may be as far, elsewhere (rewrite.trust.precision)
            noises = reference.narrowing_noise(t, low, state) if low is not None else None
            if noises is None:
                noises = reference.noise(t, state)
            if noises is not None:
                a, r, mm = _compare(t, ref.outputs, cand.outputs, tolerance, rtol, atol, None,
                                    agreement=bound, compute_dtypes=lows, noises=noises, quantum=quantum)
            more = self.more_half
            if more is not None and len(more) != len(pytree.tree_leaves(cand.outputs)):
                more = None
            if mm is not None and low is None and more is not None:
                # no precision is new, but more of the nodes some outputs are computed
                # from compute in one the original used elsewhere (Falcon's ALiBi in
                # bfloat16, an AMP rewrite of its matmuls): those outputs, and only
                # they, may be as far as autocast to it is, on the tolerance as it was
                narrowed_low = loosest({d for d in more if d is not None})
                narrowed = reference.narrowing_noise(t, narrowed_low, state)
                if narrowed is not None:
                    a, r, mm = _compare(t, ref.outputs, cand.outputs, tolerance, rtol, atol, None,
                                        noises=_only_where(narrowed, more), quantum=quantum)
        share = _int_agreement(ref.outputs, cand.outputs, lows) if bound is not None else None
        if share is not None and share < 1.0 and mm is None:
            mm = _flips_from_non_finite(t, reference, self.candidate, state)
        if mm is None and rtol is None and atol is None and not _any_step(quantum):
            if low is None and narrowed_low is not None:
                mm = _confirm_narrowed_below_unit(t, reference, ref, cand, tolerance, state, narrowed_low, None,
                                                  None, only=more)
            elif low is None:
                mm = _confirm_below_unit(t, reference, ref, cand, tolerance, state)
            else:
                mm = _confirm_narrowed_below_unit(t, reference, ref, cand, tolerance, state, low, lows, bound)
        if mm is None:
            mm = _side_effects(t, ref, cand, tolerance, rtol, atol, low)
        return a, r, share, mm, low


def _second_call_trial(reference: "Reference", trials: int) -> int:
    """The trial whose inputs a second call takes: the first random one, or the
    example's when only it runs (a model that needs inputs random ones are not)."""
    return 1 if trials > 1 and not reference.repeats(1) else 0


def _second_call_mismatch(compare: _Comparison, watch: _Watch, trials: int, dtypes: bool) -> Optional[Mismatch]:
    """A model that writes its own state (a step counter, a cache position, running
    statistics) computes its next call from what its first call left: each trial
    starts from the state as it was, so a rewrite right only for that state
    (``mul(n, 3.0) => zeros_like(n)`` while the counter ``n`` is 0) would pass. Both
    are called twice in a row, on trial 0's inputs and then on the next trial's,
    and the second calls compared as a trial's are."""
    k = _second_call_trial(compare.reference, trials)
    ref = compare.reference.second_call(k, dtypes, compare.state)
    if ref is None:
        return None
    inputs = compare.reference.inputs(k)
    try:
        _call(compare.candidate, compare.reference.inputs(0), compare.reference.seed, False, watch)
        cand = _call(compare.candidate, inputs, compare.reference.seed + k, dtypes, watch)
    except Exception as e:  # noqa: BLE001 - reported as the mismatch
        return Mismatch("output", k, None, None, math.inf, math.inf,
                        f"the rewrite raised {type(e).__name__} on a second call in a row (the original runs it): {e}")
    finally:
        compare.state.restore()
    mm = compare.runs(k, ref, cand, inputs)[3]
    if mm is None:
        return None
    return attrs.evolve(mm, message=f"{mm.message} (on a second call in a row, from the module state the first "
                                    "call left: the original writes its own state)")


def _confirm_below_unit(t: int, reference: "Reference", ref: _Run, cand: _Run, kind: str,
                       state: Any) -> Optional[Mismatch]:
    """A second look at outputs whose values are all below 1: the table's ``atol`` is
    absolute there (``Tolerance.unit``: the rounding of values about 1 that cancel), so
    a softmax over many classes or an output scaled by 1e-6 would pass whatever it
    is. Held to their own scale instead, they pass when the rewrite is within the
    tolerance of a float64 run of the original, ``NOISE_MULTIPLIER`` times the
    original's own rounding error around each element allowed on top (``precise``);
    when no float64 run can be made, the unit stands."""
    if not _below_unit(ref.outputs):
        return None
    _, _, strict = _compare(t, ref.outputs, cand.outputs, kind, None, None, unit=0.0)
    if strict is None:
        return None
    precise = reference.precise(t, state)
    if precise is None:
        return None
    _, _, mm = _compare(t, ref.outputs, cand.outputs, kind, None, None, noises=precise, unit=0.0)
    return mm


def _confirm_narrowed_below_unit(t: int, reference: "Reference", ref: _Run, cand: _Run, kind: str, state: Any,
                                 low: torch.dtype, lows: Any, bound: Optional[float],
                                 only: Optional[Tuple[Any, ...]] = None) -> Optional[Mismatch]:
    """``_confirm_below_unit`` for outputs a lower precision newly reaches: the
    precision's ``atol`` is absolute below 1 too, so a wrong rule that also casts to
    bfloat16 would pass on outputs of 1e-4. Held to their own scale, they pass when
    within the tolerance of the original, ``NOISE_MULTIPLIER`` times the original's own
    distance from its run under ``torch.autocast`` to that precision allowed on top
    (what computing it so costs: an underflow autocast shares passes); when no such
    run can be made (an op that runs neither under autocast nor in float32), nothing is allowed on top."""
    if not _below_unit(ref.outputs):
        return None
    _, _, strict = _compare(t, ref.outputs, cand.outputs, kind, None, None, agreement=bound, compute_dtypes=lows,
                            unit=0.0)
    if strict is None:
        return None
    noises = reference.narrowing_noise(t, low, state)
    if noises is None:  # autocast cannot run the original: held to its own scale, nothing on top
        return strict
    _, _, mm = _compare(t, ref.outputs, cand.outputs, kind, None, None, agreement=bound, compute_dtypes=lows,
                        noises=_only_where(noises, only), unit=0.0)
    return mm


def _only_where(noises: tuple, only: Optional[Tuple[Any, ...]]) -> tuple:
    """``noises`` kept for the output leaves ``only`` names (not None), all when None."""
    if only is None:
        return noises
    return tuple(n if i < len(only) and only[i] is not None else None for i, n in enumerate(noises))


def _below_unit(outputs: Any) -> bool:
    """Whether a floating output's finite values are all below 1 (``Tolerance.unit``):
    ``_confirm_below_unit`` may take a second look at it."""
    for leaf in pytree.tree_leaves(outputs):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and not leaf.is_quantized \
                and leaf.numel():
            finite = leaf.detach()[torch.isfinite(leaf.detach())]
            if not finite.numel() or float(finite.abs().max()) < 1.0:
                return True
    return False


def _any_step(quantum: Union[float, Tuple[float, ...]]) -> bool:
    return any(quantum) if isinstance(quantum, tuple) else bool(quantum)


def graph_quantum(fn: Any) -> Union[float, Tuple[float, ...]]:
    """One int8 step of a graph that rounds through int8 values: per output leaf, the
    largest literal scale a value it is computed from was quantized to per tensor
    (``quantize_per_tensor(x, scale, zero_point, dtype)``; 0.0 for an output no such
    value reaches); the largest of the whole graph when its outputs' structure is
    not known from the graph, 0.0 when it is not a graph or quantizes nothing."""
    if not isinstance(fn, fx.GraphModule) or not any(
            op == "call_function" and "quantize_per_tensor" in str(target)
            for op, target, _ in nodes_by_target(fn.graph)):
        return 0.0  # most graphs: one look per distinct target, no walk
    steps: Dict[fx.Node, float] = {}
    largest = 0.0
    output = None
    for node in fn.graph.nodes:
        if node.op == "output":
            output = node
            continue
        step = max((steps.get(i, 0.0) for i in node.all_input_nodes), default=0.0)
        if node.op == "call_function" and "quantize_per_tensor" in str(node.target) and len(node.args) > 1 \
                and isinstance(node.args[1], float):
            step = max(step, node.args[1])
        if step:
            steps[node] = step
            largest = max(largest, step)
    if not largest or output is None or not output.args:
        return largest
    return tuple(steps.get(leaf, 0.0) if isinstance(leaf, fx.Node) else 0.0
                 for leaf in pytree.tree_leaves(output.args[0]))


def new_half_precisions(before: Optional[frozenset], after: Optional[frozenset]) -> Tuple[torch.dtype, ...]:
    """The half precisions in ``after`` and not in ``before`` (the floating dtypes a
    graph's ops compute in before and after a rewrite: ``static_float_dtypes``);
    none when either is not known."""
    if before is None or after is None:
        return ()
    return tuple(sorted((d for d in after - before if d in HALF), key=str))


def _gradient_mismatch(reference: "Reference", candidate: Callable, state: _SavedState, kind: str,
                       rtol: Optional[float], atol: Optional[float],
                       compute_dtype: Optional[torch.dtype]) -> Optional[Mismatch]:
    """The first difference in one backward pass on trial 0's inputs: an output
    gradients reach in one model only, or a gradient of an input or of a parameter
    both models train that differs."""
    ref, _ = reference.gradients(state)
    if ref is None:
        return None  # no gradient in the original to preserve
    try:
        cand = gradient_run(candidate, reference.inputs(0), reference.seed)
    except Exception as e:  # noqa: BLE001 - reported as the mismatch
        return Mismatch("gradients", 0, None, None, math.inf, math.inf,
                        f"the rewrite's backward raised {type(e).__name__}: {e}")
    finally:
        state.restore()
    cand_reached = dict(cand.reached) if cand is not None else {}
    for path, reached in ref.reached:
        if cand_reached.get(path, False) != reached:
            who = "the original, not in the rewrite" if reached else "the rewrite, not in the original"
            return Mismatch("output" + path, 0, None, None, math.inf, math.inf,
                            f"gradients reach this output in {who}")
    if cand is None:
        return None
    for i, grad in ref.inputs.items():
        other = cand.inputs.get(i)
        if other is not None:
            _, _, mm = _compare_tensor(f"gradient of input {i}", 0, grad, other, kind, rtol, atol, compute_dtype)
            if mm is not None:
                return mm
    for name, (tensor_id, grad) in ref.params.items():
        mine = cand.params.get(name)
        if mine is not None and mine[0] == tensor_id:  # the same parameter, still trained
            _, _, mm = _compare_tensor(f"gradient of parameter {name}", 0, grad, mine[1], kind, rtol, atol,
                                       compute_dtype)
            if mm is not None:
                return mm
    return None


def assert_equivalent(reference: Callable, candidate: Callable, example_inputs: Any = None,
                      **kw: Any) -> EquivalenceReport:
    """``check_equivalence`` that raises ``AssertionError(report)`` on a mismatch."""
    report = check_equivalence(reference, candidate, example_inputs, **kw)
    if not report.ok:
        raise AssertionError(str(report))
    return report
