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
precision the rewritten model computes in that the original does not (a bfloat16
rewrite of a float32 model is held to bfloat16's tolerance, whose rounding leaves
no room for a local scale: floor 1, the tensor's largest value). Integer and bool
outputs must be equal; structure, shapes and dtypes must match exactly; NaNs match
NaNs; a finite value that becomes inf or NaN never passes.

Besides the outputs, the check compares what else the caller can observe: the
inputs after the call (a model that writes its input must write the same values;
one that did not must not start to), the module state the call writes (BatchNorm
statistics in training mode), and memory sharing: an output of the candidate may
not share memory with an input, a module constant or another output where the
reference's did not. Both models are run on private copies of the inputs, and
their parameters and buffers are restored after the check: checking has no side
effects on either.
"""

from __future__ import annotations

import contextlib
import math
import operator
from typing import Any, Callable, Dict, Iterable, Iterator, Mapping, Optional, Tuple, Union

import attrs
import torch
from torch import fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from rewrite.engine.shapes import layout_of
from rewrite.engine.workspace import gc_paused
from rewrite.ops.base import ConstRef, attribute
from rewrite.ops.effects import state_writes
from rewrite.ops.vocabulary import CALL_OPS, OPS, bind_node
from rewrite.trust.gradients import GradientRun, gradient_run
from rewrite.trust.runner import call_with, running_as_graph
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
    "inputs_from_graph",
]

#: A rewrite that newly computes in lower precision (bfloat16 for a float32 model) may
#: flip an integer output computed from floats (argmax, codebook indices) where two
#: candidates are within rounding: such integer outputs pass when at least this share
#: of their elements is equal. Exact runs, and approximate ones in the model's own
#: precision, compare integers exactly.
INT_AGREEMENT = 0.95

#: Range for integer placeholders when neither an example nor the graph bounds them.
DEFAULT_INT_RANGE = (0, 3)

Range = Tuple[float, float]
InputKey = Union[int, str]


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

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        errs = f"max abs error {self.max_abs_error:.3g}, max rel error {self.max_rel_error:.3g}"
        if self.int_agreement is not None:
            errs += f", integer outputs agree on {self.int_agreement:.1%}"
        if self.skipped:
            errs += (f"; {self.skipped} trial(s) skipped: their inputs would equal an earlier trial's "
                     "(nothing the check can vary)")
        if self.ok:
            return f"equivalent over {self.trials} trial(s) ({errs})"
        return f"NOT equivalent: {self.first_mismatch} [{errs} over {self.trials} trial(s)]"


# --------------------------------------------------------------------------- inputs


def _is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def random_like(example: torch.Tensor, generator: torch.Generator,
                value_range: Optional[Range] = None) -> torch.Tensor:
    """A random tensor with ``example``'s shape, dtype and device.

    Floats: normal with the example's mean/std (std 1 when it is 0 or
    undefined), folded to non-negative when the example has no negative
    entries. Integers: uniform in the example's ``[min, max]``. Bools: fair
    coin. ``value_range`` overrides both with a uniform ``[low, high]``.
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
            if not dtype.is_complex and finite.numel() and bool((finite >= 0).all()):
                out = out.abs()
        out = out.to(dtype)
    else:
        if value_range is not None:
            lo, hi = int(value_range[0]), int(value_range[1])
        elif ex.numel():
            lo, hi = int(ex.min()), int(ex.max())
        else:
            lo, hi = DEFAULT_INT_RANGE
        out = torch.randint(lo, hi + 1, shape, generator=generator, dtype=torch.int64).to(dtype)
    return out.to(example.device)


def _lookup_range(ranges: Optional[Mapping[InputKey, Range]], index: int, path: str) -> Optional[Range]:
    if not ranges:
        return None
    if index in ranges:
        return ranges[index]
    return ranges.get(path)


def generate_inputs(example_inputs: Any, seed: int = 0, *,
                    input_ranges: Optional[Mapping[InputKey, Range]] = None,
                    fixed_inputs: Iterable[InputKey] = ()) -> Any:
    """Random inputs with the same pytree structure as ``example_inputs``.

    Leaves are addressed by flat index or by ``pytree.keystr`` path (``"[0]"``,
    ``"[1]['mask']"``). ``input_ranges`` maps leaves to a uniform range;
    ``fixed_inputs`` lists leaves passed through unchanged. ``nn.Parameter``
    leaves (weights lifted to inputs by dynamo) and non-tensors are always
    passed through.
    """
    generator = torch.Generator().manual_seed(seed)
    fixed = set(fixed_inputs)
    leaves, spec = pytree.tree_flatten_with_path(example_inputs)
    out = []
    for i, (kp, leaf) in enumerate(leaves):
        path = pytree.keystr(kp)
        if (not isinstance(leaf, torch.Tensor) or isinstance(leaf, torch.nn.Parameter)
                or i in fixed or path in fixed):
            out.append(leaf)
        else:
            out.append(random_like(leaf, generator, _lookup_range(input_ranges, i, path)))
    return pytree.tree_unflatten(out, spec)


def _concrete(n: Any) -> int:
    if isinstance(n, int):
        return n
    try:
        from torch.fx.experimental.symbolic_shapes import optimization_hint
        return int(optimization_hint(n, fallback=2))
    except Exception:  # older torch or an unbacked symbol
        try:
            return int(n)
        except Exception:
            return 2


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


def _clone(tree: Any) -> Any:
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)


def _state(fn: Any) -> Dict[str, torch.Tensor]:
    """Parameters and buffers of a module by qualified name (empty for plain callables)."""
    if not isinstance(fn, torch.nn.Module):
        return {}
    out = dict(fn.named_parameters(remove_duplicate=False))
    out.update(fn.named_buffers(remove_duplicate=False))
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


@attrs.frozen
class _Watch:
    """What the check needs to know of one callable before running it, worked out
    once per check rather than per run (on a 10k-node graph with 5k parameters each
    piece costs several milliseconds): its parameters and buffers by name and the
    storages they hold, the names a run may write (all of them unless the graph
    tells otherwise: ``rewrite.ops.effects.state_writes``) and which of those are
    buffers, and the floating dtypes its nodes' metadata records (None: unknown)."""

    state: Dict[str, torch.Tensor]
    storages: frozenset
    writable: Optional[frozenset]
    watched: Tuple[str, ...]
    buffers: frozenset
    static: Optional[frozenset]

    @classmethod
    def of(cls, fn: Any, dtypes: bool = True) -> "_Watch":
        """``dtypes``: read the static dtypes (approximate checks need them)."""
        state = _state(fn)
        writable = state_writes(fn)
        watched = tuple(name for name, t in state.items() if writable is None or id(t) in writable)
        buffer_ids = {id(t) for t in fn.buffers()} if isinstance(fn, torch.nn.Module) else set()
        return cls(state, frozenset(_storage(t) for t in state.values()) - {None}, writable, watched,
                   frozenset(name for name in watched if id(state[name]) in buffer_ids),
                   _static_dtypes(fn) if dtypes else None)


class _DtypeRecorder(TorchDispatchMode):
    """Records the floating dtypes of every tensor an op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
                self.dtypes.add(t.dtype)
        return out


def _new_precision(ref: _Run, cand: _Run) -> Optional[torch.dtype]:
    """The lowest floating precision the candidate computes in that the reference
    does not (bfloat16 for a mixed-precision rewrite of a float32 model), or None."""
    new = cand.dtypes - ref.dtypes
    if not new:
        return None
    return loosest(new)


_META_KEYS = ("val", "example_value", "rewrite_facts", "tensor_meta")


def _static_dtypes(fn: Any) -> Optional[frozenset]:
    """The floating dtypes a GraphModule's ops compute in, read from the metadata
    its nodes carry (export and dynamo graphs, rewritten ones included), or None
    when a call node carries none (then the ops are watched as they run)."""
    if not isinstance(fn, fx.GraphModule):
        return None
    out = set()
    for node in fn.graph.nodes:
        if node.op not in CALL_OPS:
            continue
        meta = node.meta
        val = meta.get("val")
        if val is None:
            val = next((meta[k] for k in _META_KEYS if meta.get(k) is not None), None)
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


def _call(fn: Callable, inputs: Any, rng_seed: int, dtypes: bool = True, watch: Optional[_Watch] = None) -> _Run:
    """Run ``fn`` on a private copy of ``inputs`` with a fixed RNG state.

    The fixed seed makes stochastic ops (dropout in training mode) draw the
    same numbers in the reference and the candidate; ``fork_rng`` leaves the
    caller's RNG untouched. Version counters tell which inputs and which
    parameters/buffers the call wrote in place. ``watch``: ``_Watch.of(fn, dtypes)``
    when the caller has it.
    """
    watch = watch if watch is not None else _Watch.of(fn, dtypes)
    args = _clone(inputs)
    leaves = pytree.tree_leaves(args)
    before = [t._version if isinstance(t, torch.Tensor) else None for t in leaves]
    state = watch.state
    versions = {name: state[name]._version for name in watch.watched}
    # Kernels update some buffers without bumping their version (batch norm's running
    # statistics): buffers are compared by value; parameters by version counter.
    buffers_before = {name: state[name].detach().clone() for name in watch.buffers}
    # The floating dtypes ops compute in matter only to approximate checks (a
    # lower precision loosens the tolerance); recording them dispatches every op
    # through Python, which costs more than the op on small tensors: on request only.
    static = watch.static if dtypes else None
    recorder = _DtypeRecorder() if dtypes and static is None else contextlib.nullcontext()
    with torch.no_grad(), torch.random.fork_rng(devices=[]), recorder:
        torch.manual_seed(rng_seed)
        out = call_with(fn, args)
    written = frozenset(i for i, (t, v) in enumerate(zip(leaves, before))
                        if isinstance(t, torch.Tensor) and t._version != v)
    state_written = {name: state[name].detach().clone() for name in watch.watched
                     if state[name]._version != versions[name]
                     or (name in buffers_before and not _same_values(state[name], buffers_before[name]))}
    seen = static if static is not None else (frozenset(recorder.dtypes) if dtypes else frozenset())
    return _Run(out, args, written, state_written, state, seen, watch.storages)


class _SavedState:
    """Parameters and buffers of some modules as they were, and their modes: ``restore``
    puts back what changed (parameters by version counter, buffers also by value:
    kernels update some without bumping their version), as often as needed.
    ``runs_only``: the block does nothing but call the modules, so a GraphModule's
    state its graph cannot write is not saved (cloning ResNet-50's 25M parameters
    costs more than the rest of the check's bookkeeping)."""

    def __init__(self, fns: Any, runs_only: bool = False, watches: Iterable[Optional[_Watch]] = ()) -> None:
        self.saved, self.modes, seen = [], [], set()
        watches = list(watches)
        for i, fn in enumerate(fns):
            if not isinstance(fn, torch.nn.Module):
                continue
            self.modes += [(m, m.training) for m in fn.modules()]
            # A block that only runs graphs can write only what their nodes may
            # write (rewrite.ops.effects.state_writes): ResNet-50 in eval mode, nothing.
            watch = watches[i] if i < len(watches) else None
            writable = None if not runs_only else watch.writable if watch is not None else state_writes(fn)
            if writable is not None and not writable:
                continue
            buffers = {id(t) for t in fn.buffers()}
            for t in (watch.state if watch is not None else _state(fn)).values():
                if id(t) not in seen and (writable is None or id(t) in writable):
                    seen.add(id(t))
                    self.saved.append([t, t._version, t.detach().clone(), id(t) in buffers])

    def restore(self) -> None:
        with torch.no_grad():
            for entry in self.saved:
                t, version, copy, buffer = entry
                if t._version != version or (buffer and not _same_values(t, copy)):
                    t.copy_(copy)
                    entry[1] = t._version
        for m, training in self.modes:
            m.training = training


@contextlib.contextmanager
def preserved_state(*fns: Any, runs_only: bool = False, watches: Iterable[Any] = ()) -> Iterator[_SavedState]:
    """Run a block and put every parameter and buffer of the given modules back as
    it was (values written in place, e.g. BatchNorm statistics in training mode,
    are restored), and every submodule in the mode it was in. The block gets the
    saved state: ``state.restore()`` puts it back midway too. ``runs_only=True``:
    the block only calls the modules, so what their graphs cannot write is not
    saved (see ``_SavedState``); ``watches``: their ``_Watch``es, when known."""
    state = _SavedState(fns, runs_only, watches)
    try:
        yield state
    finally:
        state.restore()


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit the same values (NaN equals NaN)."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b) or (
        a.is_floating_point() and ((a == b) | (torch.isnan(a) & torch.isnan(b))).all()))


def _compare_tensor(path: str, trial: int, ref: torch.Tensor, cand: Any, kind: str,
                    rtol: Optional[float], atol: Optional[float],
                    compute_dtype: Optional[torch.dtype] = None,
                    agreement: Optional[float] = None) -> Tuple[float, float, Optional[Mismatch]]:
    """Compare one tensor (``rewrite.trust.tolerance``); ``compute_dtype``, the lowest
    precision the candidate computed in (a rewrite to bfloat16 casts back to float32
    at the end), loosens the tolerance to that dtype's when it is looser than the
    output's."""
    tol_dtype = ref.dtype
    if compute_dtype is not None and compute_dtype.is_floating_point and ref.is_floating_point():
        tol_dtype = loosest((ref.dtype, compute_dtype), kind)
    max_abs, max_rel, problem = compare_tensors(ref, cand, Tolerance.of(tol_dtype, kind, rtol, atol), agreement)
    if problem is None:
        return max_abs, max_rel, None
    shape, dtype = tuple(ref.shape), str(ref.dtype).replace("torch.", "")
    return problem.abs_error, problem.rel_error, Mismatch(path, trial, shape, dtype, problem.abs_error,
                                                          problem.rel_error, problem.message)


def _compare(trial: int, ref_out: Any, cand_out: Any, kind: str, rtol: Optional[float],
             atol: Optional[float], compute_dtype: Optional[torch.dtype] = None,
             prefix: str = "output", agreement: Optional[float] = None) -> Tuple[float, float, Optional[Mismatch]]:
    ref_leaves, ref_spec = pytree.tree_flatten_with_path(ref_out)
    cand_leaves, cand_spec = pytree.tree_flatten_with_path(cand_out)
    if ref_spec != cand_spec:
        return math.inf, math.inf, Mismatch(
            prefix, trial, None, None, math.inf, math.inf,
            f"{prefix} structure differs: expected {len(ref_leaves)} leaves {ref_spec}, "
            f"got {len(cand_leaves)} {cand_spec}")
    worst_abs = worst_rel = 0.0
    first: Optional[Mismatch] = None
    for (kp, r), (_, c) in zip(ref_leaves, cand_leaves):
        path = prefix + pytree.keystr(kp)
        if isinstance(r, torch.Tensor):
            a, rel, mm = _compare_tensor(path, trial, r, c, kind, rtol, atol, compute_dtype, agreement)
        else:
            equal = type(r) is type(c) and (r == c or (isinstance(r, float) and math.isnan(r) and math.isnan(c)))
            a, rel = (0.0, 0.0) if equal else (math.inf, math.inf)
            mm = None if equal else Mismatch(path, trial, None, None, a, rel,
                                             f"expected {r!r}, got {c!r}")
        worst_abs, worst_rel = max(worst_abs, a), max(worst_rel, rel)
        if mm is not None and first is None:
            first = mm
    return worst_abs, worst_rel, first


def _int_agreement(ref_out: Any, cand_out: Any) -> Optional[float]:
    """The smallest share of equal elements over integer/bool outputs, or None."""
    shares = [float((r == c).float().mean()) for r, c in zip(pytree.tree_leaves(ref_out), pytree.tree_leaves(cand_out))
              if isinstance(r, torch.Tensor) and isinstance(c, torch.Tensor) and not _is_float(r.dtype)
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


def _sharing(run: _Run) -> set:
    """Which outputs share memory with an input, a module constant or another output."""
    inputs = {}
    for i, t in enumerate(pytree.tree_leaves(run.inputs)):
        ptr = _storage(t)
        if ptr is not None:
            inputs.setdefault(ptr, i)
    state = run.storages
    out, seen = set(), {}
    for kp, t in pytree.tree_flatten_with_path(run.outputs)[0]:
        ptr, path = _storage(t), "output" + pytree.keystr(kp)
        if ptr is None:
            continue
        if ptr in inputs:
            out.add((path, f"input {inputs[ptr]}"))
        if ptr in state:
            out.add((path, "a module constant"))
        if ptr in seen and seen[ptr] != path:
            out.add((path, seen[ptr]))
        seen.setdefault(ptr, path)
    return out


def _side_effects(trial: int, ref: _Run, cand: _Run, kind: str, rtol: Optional[float],
                  atol: Optional[float]) -> Optional[Mismatch]:
    """What the caller observes besides the outputs: new memory sharing, inputs
    written, module state written."""
    for path, other in sorted(_sharing(cand) - _sharing(ref)):
        return Mismatch(path, trial, None, None, math.inf, math.inf,
                        f"shares memory with {other} in the rewrite, not in the original "
                        "(writing into one would change the other)")
    layout = _layout_change(ref.outputs, cand.outputs, trial)
    if layout is not None:
        return layout
    ref_inputs, cand_inputs = pytree.tree_leaves(ref.inputs), pytree.tree_leaves(cand.inputs)
    for i in sorted(ref.inputs_written | cand.inputs_written):
        if i not in ref.inputs_written:
            return Mismatch(f"input {i}", trial, None, None, math.inf, math.inf,
                            "the rewrite writes into this input in place; the original does not")
        if i not in cand.inputs_written:
            return Mismatch(f"input {i}", trial, None, None, math.inf, math.inf,
                            "the original writes into this input in place; the rewrite does not")
        _, _, mm = _compare_tensor(f"input {i} (as written)", trial, ref_inputs[i], cand_inputs[i], kind, rtol, atol)
        if mm is not None:
            return mm
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
                                   cand.state_written[name], kind, rtol, atol)
        if mm is not None:
            return mm
    return None


def _layout_change(ref_out: Any, cand_out: Any, trial: int) -> Optional[Mismatch]:
    """An output laid out contiguously (or channels_last) in the original and not so
    in the rewrite: the caller sees it (``out.view(-1)`` fails, ``is_contiguous()``
    changes). An original output with other strides may become any layout."""
    ref_leaves = pytree.tree_flatten_with_path(ref_out)[0]
    cand_leaves = pytree.tree_leaves(cand_out)
    for (kp, r), c in zip(ref_leaves, cand_leaves):
        if not (isinstance(r, torch.Tensor) and isinstance(c, torch.Tensor)) or r.shape != c.shape \
                or r.numel() < 2 or r.layout != torch.strided or c.layout != torch.strided:
            continue
        mine, theirs = layout_of(r), layout_of(c)
        if mine not in (None, "strided") and mine != theirs:
            return Mismatch("output" + pytree.keystr(kp), trial, tuple(r.shape), str(r.dtype).replace("torch.", ""),
                            0.0, 0.0, f"memory layout changed: {mine} (strides {tuple(r.stride())}) in the original, "
                                      f"{theirs} (strides {tuple(c.stride())}) in the rewrite (out.view() or "
                                      "is_contiguous() would tell)")
    return None


def _same_inputs(a: Any, b: Any) -> bool:
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
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
        self.example_inputs = example_inputs
        self.seed = seed
        self.input_ranges = input_ranges
        self.fixed_inputs = tuple(fixed_inputs)
        self.graph = graph if graph is not None else fn
        self._inputs: Dict[int, Any] = {}
        self._runs: Dict[int, _Run] = {}
        self._with_dtypes: Dict[int, bool] = {}
        self._repeats: Dict[int, bool] = {}
        self._watch: Optional[_Watch] = None
        self._gradients: Optional[Tuple[Optional[GradientRun], Optional[str]]] = None

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
                                       fixed_inputs=self.fixed_inputs)
            self._inputs[trial] = made
        return self._inputs[trial]

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
        ops compute in (approximate checks need them)."""
        if trial not in self._runs or (dtypes and not self._with_dtypes[trial]):
            with self._running(state) as fn:
                try:
                    self._runs[trial] = _call(fn, self.inputs(trial), self.seed + trial, dtypes, self.watch())
                except Exception as e:
                    raise RuntimeError(f"reference failed on trial {trial} inputs: {type(e).__name__}: {e}") from e
            self._with_dtypes[trial] = dtypes
        return self._runs[trial]

    def gradients(self, state: Optional[_SavedState] = None) -> Tuple[Optional[GradientRun], Optional[str]]:
        """The reference's backward pass on trial 0's inputs (``rewrite.trust.gradients``),
        computed once: ``(run, None)``, or ``(None, why)`` when there is nothing to
        compare (no gradient reaches an output, or its backward fails)."""
        if self._gradients is None:
            with self._running(state) as fn:
                try:
                    run = gradient_run(fn, self.inputs(0), self.seed)
                    self._gradients = (run, None if run is not None else "no gradient reaches an output")
                except Exception as e:  # noqa: BLE001 - no gradient to preserve
                    self._gradients = (None, f"the original's backward failed: {type(e).__name__}: {e}")
        return self._gradients

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

    def watch(self) -> _Watch:
        """What the check watches of the reference (worked out on its first run: an
        in-place rewrite changes the module's graph afterwards)."""
        if self._watch is None:
            self._watch = _Watch.of(self.fn)
        return self._watch

    def prepare(self, trials: int, tolerance: str = "approx", gradients: bool = False) -> "Reference":
        """Run every trial now (before an in-place rewrite changes the model), and
        the backward pass too when ``gradients``."""
        with gc_paused(), preserved_state(self.fn, runs_only=True, watches=(self.watch(),)) as state, \
                running_as_graph(self.fn):
            for t in range(trials):
                if not self.repeats(t):
                    self.run(t, dtypes=tolerance == "approx", state=state)
            if gradients:
                self.gradients(state)
        return self


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
    they are in, each on its own copy of the inputs; their parameters and
    buffers are restored afterwards. ``tolerance`` is ``"exact"`` (only
    rounding may differ: ``EXACT_TOLERANCES``) or ``"approx"`` (``TOLERANCES``).
    ``rtol``/``atol``, when given, override the table (``atol`` is then
    absolute, not scaled). When an approximate candidate newly computes in a
    lower precision, integer outputs pass on an agreement rate of at least
    ``int_agreement`` (default ``INT_AGREEMENT``), reported in the report. The check stops at the first trial with a
    mismatch. If the candidate raises, that is reported as a mismatch; if the
    reference raises, the inputs are at fault and the error propagates.

    ``reference`` may be a ``Reference``: its runs are computed once and reused by
    every check against it (its own inputs settings then apply). Trials whose
    inputs equal an earlier trial's are skipped and counted in ``report.skipped``.
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
    with gc_paused():
        return _check(reference, candidate, trials, rtol, atol, tolerance, int_agreement, gradients)


def _check(reference: "Reference", candidate: Callable, trials: int, rtol: Optional[float],
           atol: Optional[float], tolerance: str, int_agreement: Optional[float],
           gradients: bool = False) -> EquivalenceReport:
    seed = reference.seed
    worst_abs = worst_rel = 0.0
    agreed: Optional[float] = None
    skipped = 0
    # One saved state for both (a copy shares the reference's tensors), put back
    # after every run: each starts from the state as it was.
    dtypes = tolerance == "approx"
    watch = _Watch.of(candidate, dtypes)
    # Modules waiting for their code run their graphs instead (rewrite.trust.runner).
    # In place, the reference ran before the module became the candidate: its watch
    # describes a graph the module no longer has.
    watches = (watch, None if reference.fn is candidate else reference.watch())
    low0: Optional[torch.dtype] = None
    with preserved_state(candidate, reference.fn, runs_only=True, watches=watches) as state, \
            running_as_graph(reference.fn), running_as_graph(candidate) as run_candidate:
        for t in range(trials):
            if reference.repeats(t):
                skipped += 1
                continue
            ref = reference.run(t, dtypes, state)
            inputs = reference.inputs(t)
            try:
                cand = _call(run_candidate, inputs, seed + t, dtypes, watch)
            except Exception as e:
                mm = Mismatch("output", t, None, None, math.inf, math.inf,
                              f"candidate raised {type(e).__name__}: {e}")
                return EquivalenceReport(False, t + 1, math.inf, math.inf, mm, skipped=skipped)
            finally:
                state.restore()
            low = _new_precision(ref, cand) if tolerance == "approx" else None
            bound = None if low is None else (INT_AGREEMENT if int_agreement is None else int_agreement)
            a, r, mm = _compare(t, ref.outputs, cand.outputs, tolerance, rtol, atol, low, agreement=bound)
            if bound is not None:
                share = _int_agreement(ref.outputs, cand.outputs)
                if share is not None:
                    agreed = share if agreed is None else min(agreed, share)
            worst_abs, worst_rel = max(worst_abs, a), max(worst_rel, r)
            if mm is None:
                mm = _side_effects(t, ref, cand, tolerance, rtol, atol)
            if mm is not None:
                return EquivalenceReport(False, t + 1, worst_abs, worst_rel, mm, agreed, skipped)
            if t == 0:
                low0 = low
        if gradients:
            mm = _gradient_mismatch(reference, run_candidate, state, tolerance, rtol, atol, low0)
            if mm is not None:
                return EquivalenceReport(False, trials, worst_abs, worst_rel, mm, agreed, skipped)
    return EquivalenceReport(True, trials, worst_abs, worst_rel, None, agreed, skipped)


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
