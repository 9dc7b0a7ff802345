"""Measure a captured graph node by node: shapes, FLOPs, bytes, parameters, memory.

``analyze(gm, example_inputs)`` runs the graph once, node by node, on real tensors
(``torch.no_grad``) and records for every node:

* its canonical op (the rule language's name, ``conv``, ``linear``, ``add``...),
  output shape and dtype;
* **FLOPs** as ``torch.utils.flop_counter.FlopCounterMode`` counts them: the aten
  ops a node dispatches to are looked up in ``torch.utils.flop_counter.flop_registry``
  (matmuls, convolutions, attention), decomposing ops that are not registered exactly
  as ``FlopCounterMode`` does. No formula is written here, so the totals equal
  ``FlopCounterMode`` on the eager model whenever the graph dispatches the same aten ops;
* **elementwise ops**: what ``FlopCounterMode`` does not count (norms, activations,
  adds, softmax) as one op per output element of a computing node, so that a fold
  that removes a batch norm shows up;
* bytes read (every distinct tensor input, parameters included) and written (the
  outputs; nothing for a view), parameter bytes, and arithmetic intensity;
* int8 kernels (``quantized::conv2d``, ``quantized::linear``), whose prepacked weights
  FlopCounterMode cannot see into, counted with the registry's formula for the float
  op they compute on the unpacked weight; the packed weight counts as parameters;
  ``quantized::matmul`` is counted as the float matmul of its operands' shapes;
* ``torch.cond``: the FLOPs of its costlier branch, as ``FlopCounterMode`` counts it
  (other higher-order ops run uncounted, with a warning);
* whether the output is a view of an input or written in place.

Peak activation memory comes from a liveness walk over the same run: a tensor's
storage is live from the node that allocates it to the last node that reads any
view of it (graph outputs to the end). Inputs and parameters are not activations.

Example::

    from rewrite.analysis import analyze
    a = analyze(torch.fx.symbolic_trace(model), (x,))
    a.totals.flops, a.peak_bytes
    print(a.table(by="op"))
    a.to_json(), a.to_csv()
"""

from __future__ import annotations

import collections
import csv
import io
import json
import operator
import re
import warnings
from typing import Any, Iterable, Sequence

import attrs
import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from rewrite.analysis.progress import progress
from rewrite.capture import (as_input_tuple, is_export_guard, lifted_state_positions, mha_fastpath_off,
                             normalize_module_path)
from rewrite.engine.replace import RULE_KEY
from rewrite.engine.symbolic import size_hint
from rewrite.language.diagnostics import printable
from rewrite.ops import bind_node
from rewrite.trust.modes import fake_mode_off, one_thread_at_a_time

__all__ = ["NodeStats", "Totals", "GroupStats", "GraphAnalysis", "analyze", "RULE_KEY", "module_path",
           "GUARD_OP"]

#: the ``op`` of a ``torch.export`` module's input guard (``_guards_fn``): it checks the
#: inputs' shapes and computes nothing, so it is measured as nothing (no bytes, not a node)
GUARD_OP = "export_guard"
_INT8 = {torch.int8, torch.uint8, torch.qint8, torch.quint8, torch.qint32}
_CASTS = {"to", "type_as", "float", "half", "bfloat16", "double", "int", "long"}


@attrs.frozen
class NodeStats:
    """One node of the graph, measured.

    Attributes:
        name: the fx node name.
        kind: ``placeholder``, ``get_attr``, ``call_function``, ``call_method``,
            ``call_module`` or ``output``.
        op: the canonical op name (the rule language's), else the target's name.
        module: the module path the node was called in (``layer1.0.conv1``), or "".
        shape: output shape (a tuple of shapes for a tuple output; () for a scalar).
        dtype: output dtype (``float32``), "" when not a tensor.
        flops: FLOPs as FlopCounterMode counts them (matmul, conv, attention).
        elementwise: output elements of a computing node FlopCounterMode does not count.
        bytes_read: bytes of the distinct tensors the node reads (parameters included).
        bytes_written: bytes of the tensors it produces (0 for a view).
        param_bytes: bytes of the parameters and buffers it reads.
        alias: ``"view"`` (output shares an input's memory), ``"inplace"`` (writes an
            input), or "".
        rule: the rule that created the node (after a rewrite), else "".
        rule_at: where that rule is written (``fusion.rw:12:1``), else "".
    """

    name: str
    kind: str
    op: str
    module: str
    shape: tuple
    dtype: str
    flops: int = 0
    elementwise: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    param_bytes: int = 0
    alias: str = ""
    rule: str = ""
    rule_at: str = ""

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved (0 when nothing moves)."""
        moved = self.bytes_read + self.bytes_written
        return self.flops / moved if moved else 0.0

    @property
    def is_compute(self) -> bool:
        return self.kind.startswith("call_") and self.op != GUARD_OP

    def to_dict(self) -> dict:
        d = attrs.asdict(self)
        d["shape"] = _jsonable_shape(self.shape)
        d["intensity"] = round(self.intensity, 4)
        return d


@attrs.frozen
class Totals:
    """Sums over a graph (parameters counted once however often they are read)."""

    nodes: int
    flops: int
    elementwise: int
    bytes_read: int
    bytes_written: int
    param_bytes: int
    peak_bytes: int
    casts: int
    int8_ops: int

    @property
    def intensity(self) -> float:
        moved = self.bytes_read + self.bytes_written
        return self.flops / moved if moved else 0.0

    def to_dict(self) -> dict:
        return {**attrs.asdict(self), "intensity": round(self.intensity, 4)}


@attrs.frozen
class GroupStats:
    """A roll-up: nodes of one module or one op."""

    key: str
    nodes: int
    flops: int
    elementwise: int
    bytes_read: int
    bytes_written: int
    param_bytes: int

    def to_dict(self) -> dict:
        return attrs.asdict(self)


@attrs.frozen
class GraphAnalysis:
    """What ``analyze`` returns: per-node records, totals, roll-ups and peak memory.

    Attributes:
        nodes: ``NodeStats`` in graph order (placeholders and output included).
        totals: ``Totals``.
        peak_bytes: peak activation memory of the liveness walk (also in ``totals``).
        peak_node: the node during which the peak is reached.
        input_bytes: bytes of the graph's inputs (not activations).
    """

    nodes: tuple
    totals: Totals
    peak_bytes: int
    peak_node: str
    input_bytes: int

    def __getitem__(self, name: str) -> NodeStats:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node named {name!r}")

    def by_op(self) -> tuple:
        """``GroupStats`` per canonical op, most FLOPs first."""
        return _group(self.nodes, lambda n: n.op)

    def by_module(self, depth: int | None = None) -> tuple:
        """``GroupStats`` per module path, cut to its first ``depth`` components
        (``layer1.0.conv1`` at depth 2 is ``layer1.0``); nodes outside any module
        are grouped under ``(top)``."""
        def key(n: NodeStats) -> str:
            path = n.module.split(".") if n.module else []
            return ".".join(path[:depth] if depth else path) or "(top)"
        return _group(self.nodes, key)

    def to_dict(self) -> dict:
        """Plain data: ``{"nodes": [...], "totals": {...}, "peak_node": ..., "input_bytes": ...}``."""
        return {
            "nodes": [n.to_dict() for n in self.nodes],
            "totals": self.totals.to_dict(),
            "peak_node": self.peak_node,
            "input_bytes": self.input_bytes,
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def to_csv(self) -> str:
        """One row per node, the columns of ``NodeStats.to_dict``."""
        rows = [n.to_dict() for n in self.nodes]
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=list(rows[0]) if rows else ["name"], lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "shape": json.dumps(row["shape"])})
        return out.getvalue()

    def table(self, by: str | None = None, depth: int | None = 2, limit: int | None = None) -> str:
        """A text table: every computing node (``by=None``), or roll-ups
        (``by="op"`` or ``"module"``), then the totals."""
        if by is None:
            rows = [(n.name, n.op, _fmt_shape(n.shape), n.flops, n.elementwise, n.bytes_read, n.bytes_written,
                     n.param_bytes) for n in self.nodes if n.is_compute]
            head = ("node", "op", "shape", "FLOPs", "elemwise", "read", "written", "params")
        elif by in ("op", "module"):
            groups = self.by_op() if by == "op" else self.by_module(depth)
            rows = [(g.key, g.nodes, g.flops, g.elementwise, g.bytes_read, g.bytes_written, g.param_bytes)
                    for g in groups]
            head = (by, "nodes", "FLOPs", "elemwise", "read", "written", "params")
        else:
            raise ValueError(f"by must be None, 'op' or 'module', not {by!r}")
        if limit is not None:
            rows = rows[:limit]
        text = 3 if by is None else 1
        lines = [_row(head, text)] + [_row(tuple(_human(v) for v in r), text) for r in rows]
        t = self.totals
        lines.append("")
        lines.append(f"nodes {t.nodes}  FLOPs {_human(t.flops)}  elementwise {_human(t.elementwise)}  "
                     f"read {_bytes(t.bytes_read)}  written {_bytes(t.bytes_written)}  "
                     f"params {_bytes(t.param_bytes)}  peak activations {_bytes(t.peak_bytes)} "
                     f"(at {self.peak_node or '-'})")
        return "\n".join(lines)


def _group(nodes: Iterable[NodeStats], key: Any) -> tuple:
    acc: dict = collections.defaultdict(lambda: [0, 0, 0, 0, 0, 0])
    for n in nodes:
        if not n.is_compute:
            continue
        a = acc[key(n)]
        for i, v in enumerate((1, n.flops, n.elementwise, n.bytes_read, n.bytes_written, n.param_bytes)):
            a[i] += v
    groups = [GroupStats(k, *v) for k, v in acc.items()]
    return tuple(sorted(groups, key=lambda g: (-g.flops, -g.elementwise, g.key)))


# ---------------------------------------------------------------- formatting


def _row(cells: tuple, text_columns: int) -> str:
    """The first column 40 wide, the next text columns 20 wide, numbers right-aligned."""
    out = []
    for i, cell in enumerate(printable(str(c)) for c in cells):  # a module name may hold escapes
        if i == 0:
            out.append(f"{cell[:40]:<40}")
        elif i < text_columns:
            out.append(f"{cell[:20]:<20}")
        else:
            out.append(f"{cell[:12]:>12}")
    return " ".join(out)


def _human(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, int):
        return str(v)
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.2f}{unit}"
    return str(v)


def _bytes(v: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if v >= scale:
            return f"{v / scale:.2f} {unit}"
    return f"{v} B"


def _fmt_shape(shape: tuple) -> str:
    if shape and isinstance(shape[0], tuple):
        return ",".join(_fmt_shape(s) for s in shape)
    return "x".join(str(d) for d in shape) if shape else "-"


def _jsonable_shape(shape: tuple) -> list:
    return [(_jsonable_shape(s) if isinstance(s, tuple) else int(s)) for s in shape]


# ---------------------------------------------------------------- module paths

def module_path(node: fx.Node) -> str:
    """The module a node was called in, as a dotted path (``layer1.0.conv1``):
    from ``nn_module_stack`` (any capture level; dynamo's ``L['self'].layer1[0]``
    spelling is normalized), else a ``call_module`` node's own target."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1]
        path = path[0] if isinstance(path, tuple) else str(path)
        return normalize_module_path(path)
    if node.op == "call_module":
        return str(node.target)
    return ""


# ---------------------------------------------------------------- the run


#: namespaces whose ops without a FLOP formula compute elementwise (adds, casts, the
#: quantize and dequantize of the QDQ form); another library's op (a custom op) may
#: hide a matmul: ``analyze`` says its FLOPs are not counted
_ELEMENTWISE_NAMESPACES = frozenset({"aten", "prims", "prim", "quantized_decomposed"})


#: aten ops with no FLOP formula that are no elementwise op: a recurrent cell's or
#: layer's kernel hides matmuls (warned of, unless counted: ``_rnn_layer``)
_RECURRENT = re.compile(r"rnn|lstm|gru", re.IGNORECASE)


def _warn_uncounted(name: str) -> None:
    warnings.warn(f"analyze: {name} has no FLOP formula, so its FLOPs are not counted (its output elements count "
                  "as elementwise ops); torch.utils.flop_counter.register_flop_formula gives it one", stacklevel=2)


_SKIPPED = {
    torch.ops.aten.sym_is_contiguous.default, torch.ops.aten.is_contiguous.default,
    torch.ops.aten.is_contiguous.memory_format, torch.ops.aten.is_strides_like_format.default,
    torch.ops.aten.is_non_overlapping_and_dense.default, torch.ops.aten.size.default,
    torch.ops.aten.sym_size.default, torch.ops.aten.stride.default, torch.ops.aten.sym_stride.default,
    torch.ops.aten.storage_offset.default, torch.ops.aten.sym_storage_offset.default,
    torch.ops.aten.numel.default, torch.ops.aten.sym_numel.default, torch.ops.aten.dim.default,
    torch.ops.prim.layout.default,
} if hasattr(torch.ops.aten, "sym_is_contiguous") else set()


class _Counter(TorchDispatchMode):
    """Counts the FLOPs of the aten ops dispatched while it is active, exactly as
    ``FlopCounterMode``'s dispatch mode does: registered ops are counted with
    ``flop_registry``'s formula, others are decomposed when they can be; also notes
    whether any op mutated an input (its schema says so)."""

    supports_higher_order_operators = True  # torch.cond and the like come to __torch_dispatch__

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0
        self.mutated = False
        self.packed: dict = {}  # id of a prepacked int8 weight -> its bytes (weight + bias)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SKIPPED:
            return NotImplemented
        if isinstance(func, torch._ops.HigherOrderOperator):
            return self._higher_order(func, args, kwargs)
        if func._overloadpacket not in flop_registry and func is not torch.ops.prim.device.default:
            with self:
                r = func.decompose(*args, **kwargs)
                if r is not NotImplemented:
                    return r
        out = func(*args, **kwargs)
        if func._schema.is_mutable:
            self.mutated = True
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        elif func._overloadpacket is torch.ops.aten.mkldnn_rnn_layer:
            self._rnn_layer(args)
        elif func.namespace == "quantized":
            self._int8_kernel(func, args, out)
        elif func.namespace not in _ELEMENTWISE_NAMESPACES or _RECURRENT.search(func._schema.name):
            _warn_uncounted(func._overloadpacket._qualified_op_name)
        return out

    def _rnn_layer(self, args: tuple) -> None:
        """``aten.mkldnn_rnn_layer``, one direction of one layer of an ``nn.LSTM`` on
        CPU, which the registry does not list (``FlopCounterMode`` counts it 0): its
        matmuls, every step's input and hidden state by the gates' weights, with the
        registry's ``mm`` formula (what the decomposed LSTM of an ``export_core``
        capture counts)."""
        x, w_ih, w_hh = args[:3]
        rows = x.numel() // x.shape[-1]
        for w in (w_ih, w_hh):
            self.flops += int(flop_registry[torch.ops.aten.mm](
                torch.empty(rows, w.shape[1], device="meta"), torch.empty(w.shape[::-1], device="meta"),
                out_val=torch.empty(rows, w.shape[0], device="meta")))

    def _higher_order(self, func, args, kwargs) -> Any:
        """``torch.cond`` counts its costlier branch, as ``FlopCounterMode`` does, and
        returns the branch taken; other higher-order ops (``while_loop``, ``map``...),
        which ``FlopCounterMode`` cannot count either, run uncounted, with a warning."""
        if func is not torch.ops.higher_order.cond:
            warnings.warn(f"analyze: the FLOPs inside {func.name()} are not counted", stacklevel=2)
            return func(*args, **kwargs)
        pred, true_fn, false_fn, operands = args
        before, counts, outs = self.flops, [], []
        for branch in (true_fn, false_fn):
            self.flops = 0
            with self:
                outs.append(branch(*operands))
            counts.append(self.flops)
        self.flops = before + max(counts)
        return outs[0] if bool(pred) else outs[1]

    def _int8_kernel(self, func, args, out) -> None:
        """``quantized::conv*``/``linear*`` take a prepacked weight FlopCounterMode
        cannot see into: count them with the registry's formula for the float op
        they compute (conv -> aten.convolution, linear -> aten.mm) on the unpacked
        weight, and note the packed weight's bytes as parameters; ``quantized::matmul``
        is counted as ``torch.matmul`` of float tensors of its operands' shapes."""
        name = func._schema.name.split("::")[-1]
        if name == "matmul" and all(isinstance(a, torch.Tensor) for a in args[:2]):
            with self:  # the float op's aten ops, counted on shapes alone
                torch.matmul(*(torch.empty(a.shape, device="meta") for a in args[:2]))
            return
        packed = next((a for a in args if isinstance(a, torch.ScriptObject) and hasattr(a, "unpack")), None)
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if packed is None or x is None or not isinstance(out, torch.Tensor):
            return
        weight, bias = packed.unpack()[:2]
        self.packed[id(packed)] = _nbytes(weight) + (_nbytes(bias) if isinstance(bias, torch.Tensor) else 0)
        if name.startswith("conv") and hasattr(packed, "stride"):
            self.flops += int(flop_registry[torch.ops.aten.convolution](
                x, weight, bias, packed.stride(), packed.padding(), packed.dilation(), bool(packed.transpose()),
                None, packed.groups(), out_val=out))
        elif name.startswith("linear"):
            rows = x.numel() // x.shape[-1]
            self.flops += int(flop_registry[torch.ops.aten.mm](
                torch.empty(rows, x.shape[-1], device="meta"), torch.empty(weight.shape[::-1], device="meta"),
                out_val=torch.empty(rows, weight.shape[0], device="meta")))


def _tensors(value: Any) -> list:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _storage_key(t: torch.Tensor) -> Any:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # quantized or opaque tensors
        return ("tensor", id(t))


def _storage_bytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return _nbytes(t)


def _nbytes(t: torch.Tensor) -> int:
    """The bytes of the elements a tensor holds: an ``expand``ed (broadcast) dimension,
    stride 0, repeats one element, read once (as ``x + y`` broadcasting ``y`` itself
    is charged ``y``'s bytes, so is ``x + y.expand_as(x)``)."""
    if t.numel() == 0:
        return 0
    try:
        strides = t.stride()
    except (RuntimeError, NotImplementedError):  # sparse, nested: as many as it holds
        return t.numel() * t.element_size()
    held = 1
    for size, stride in zip(t.shape, strides):
        if stride != 0:
            held *= size
    return held * t.element_size()


def _shape_dtype(value: Any) -> tuple:
    if isinstance(value, torch.Tensor):
        return tuple(int(d) for d in value.shape), str(value.dtype).replace("torch.", "")
    if isinstance(value, (tuple, list)):
        tensors = [v for v in value if isinstance(v, torch.Tensor)]
        if tensors:
            return (tuple(tuple(int(d) for d in t.shape) for t in tensors),
                    str(tensors[0].dtype).replace("torch.", ""))
    return (), ""


def _canonical_op(node: fx.Node, gm: fx.GraphModule) -> str:
    if not node.op.startswith("call_"):
        return node.op
    if node.op == "call_module" and is_export_guard(gm, node.target):
        return GUARD_OP
    try:
        ops = {b.op for b in bind_node(node, gm)}
    except Exception:  # noqa: BLE001 - a name is all we need; binding is best effort here
        ops = set()
    if ops:
        return sorted(ops)[0]
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)).__name__
    target = node.target
    name = getattr(target, "__name__", None) or str(target)
    return str(name).split(".")[0] if isinstance(target, torch._ops.OpOverload) else str(name)


def _inputs_from_meta(gm: fx.GraphModule) -> tuple:
    """Inputs made from placeholder metadata when none are given: normal floats
    (from a generator of their own: the caller's random stream is left as it was),
    zeros for integers (valid indices)."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = next((node.meta[k] for k in ("val", "example_value") if k in node.meta), None)
        if not isinstance(val, torch.Tensor):
            raise ValueError(f"analyze: placeholder {node.name!r} records no shape: pass example_inputs")
        shape = tuple(size_hint(d) for d in val.shape)  # int(d) would pin a dynamic size for good
        if val.dtype.is_floating_point or val.dtype.is_complex:
            out.append(torch.randn(shape, generator=generator).to(val.dtype))
        else:
            out.append(torch.zeros(shape, dtype=val.dtype))
    return tuple(out)


class _Runner(fx.Interpreter):
    """Runs the graph node by node, measuring each one."""

    def __init__(self, gm: fx.GraphModule, params: set, show_progress: bool) -> None:
        super().__init__(gm, garbage_collect_values=False)  # storages stay alive: their ids stay unique
        self.params = params  # storage keys of parameters and buffers
        self.records: list = []
        self.values: dict = {}
        self.packed: dict = {}  # node name -> bytes of the prepacked int8 weights it read
        self._progress = progress(len(gm.graph.nodes), "analyze", enabled=show_progress)

    def run_node(self, n: fx.Node) -> Any:
        counter = _Counter()
        if n.op.startswith("call_"):
            with counter:
                out = super().run_node(n)
        else:
            out = super().run_node(n)
        self.values[n] = out
        if counter.packed:  # per node: a ScriptObject's id is not stable across calls
            self.packed[n.name] = sum(counter.packed.values())
        self.records.append((n, counter.flops, counter.mutated, sum(counter.packed.values())))
        self._progress.update(1)
        return out

    def close(self) -> None:
        self._progress.close()


@one_thread_at_a_time()
@fake_mode_off()
def analyze(gm: Any, example_inputs: Sequence[Any] | None = None, *, show_progress: bool = False) -> GraphAnalysis:
    """Measure every node of a captured graph (see the module docstring).

    Args:
        gm: a ``torch.fx.GraphModule`` from ``symbolic_trace``, ``torch.export``'s
            ``.module()`` (or the ``ExportedProgram`` itself), or a dynamo graph
            (called with the inputs dynamo recorded, parameters included:
            ``rewrite.capture.capture_with_inputs``).
        example_inputs: the graph's inputs; when omitted they are made from the
            placeholders' ``meta['val']``.
        show_progress: a progress bar on a terminal (never when not a TTY).

    Returns:
        ``GraphAnalysis``. The graph module is run once, under ``torch.no_grad``,
        on copies of the inputs; it is not modified, and the state its forward
        writes (a buffer it updates) is restored.

    Example::

        a = analyze(torch.export.export(model, (x,)).module(), (x,))
        a.totals.flops          # == FlopCounterMode on model(x), within what the
                                # capture changed (see README: "Measuring a graph")
    """
    if isinstance(gm, torch.export.ExportedProgram):
        gm = gm.module()
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"analyze wants a torch.fx.GraphModule or ExportedProgram, not {type(gm).__name__}")
    from rewrite.trust.check import laid_out_copy, preserved_state
    from rewrite.trust.rng import seeded

    inputs = as_input_tuple(example_inputs) if example_inputs is not None else _inputs_from_meta(gm)
    from torch._subclasses.fake_tensor import FakeTensor

    from rewrite.trust.held import input_leaves

    if any(isinstance(t, FakeTensor) for t in input_leaves(inputs)):
        raise ValueError("analyze runs the graph once on its example inputs, and these hold FakeTensors: pass "
                         "real tensors of the same shapes, or none (they are made from the placeholders' "
                         "metadata)")
    # a dynamic dynamo graph's example inputs hold its sizes as SymInts: measured at
    # the sizes they stand for, as the check runs them
    inputs = torch.utils._pytree.tree_map_only(torch.SymInt, size_hint, inputs)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    required = sum(1 for p in placeholders if not p.args)  # (a placeholder's args hold its default)
    if type(gm.graph._codegen) is fx.graph.CodeGen and not required <= len(inputs) <= len(placeholders):
        # (an export graph takes its inputs as the model's pytree; the interpreter
        # would quietly leave extra inputs out, and fail deep inside on missing ones)
        raise ValueError(f"analyze got {len(inputs)} inputs for a graph of {len(placeholders)}: pass "
                         f"example_inputs as a tuple of the graph's inputs")
    # a measurement leaves no trace: the graph runs on copies of the inputs (a model
    # may write its input; a dynamo graph's lifted parameters and buffers are the
    # caller's model's own, a train-mode BatchNorm writes its running statistics), and
    # the state its forward writes (a step counter, running statistics) is put back
    lifted = set(lifted_state_positions(gm))
    with torch.no_grad():
        inputs = tuple(laid_out_copy(inputs))
    params = {_storage_key(t) for t in list(gm.parameters()) + list(gm.buffers())}
    params |= {_storage_key(inputs[i]) for i in lifted if i < len(inputs) and isinstance(inputs[i], torch.Tensor)}
    runner = _Runner(gm, params, show_progress)
    try:
        # no fused fast path (nn.MultiheadAttention, nn.TransformerEncoderLayer in eval
        # mode under no_grad): its kernels are opaque to the FLOP registry
        # and a train-mode dropout draws from a generator of its own, not the caller's
        with torch.no_grad(), preserved_state(gm, runs_only=True), mha_fastpath_off(), seeded(0):
            runner.run(*inputs)
    finally:
        runner.close()
    return _summarize(gm, runner, {placeholders[i] for i in lifted if i < len(placeholders)})


def _node_inputs(gm: fx.GraphModule, node: fx.Node, values: dict) -> list:
    """The tensors a node reads: its argument nodes' values, and for a module call
    the module's own parameters and buffers."""
    tensors: list = []
    for arg in node.all_input_nodes:
        tensors.extend(_tensors(values.get(arg)))
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        tensors.extend(mod.parameters())
        tensors.extend(b for name, b in mod.named_buffers() if b is not None and not _unread_buffer(mod, name))
    return tensors


def _unread_buffer(mod: torch.nn.Module, name: str) -> bool:
    """A buffer the module's forward does not read: an eval-mode batch norm's step
    counter (``num_batches_tracked``, counted only while training; an export graph of
    the same model reads the other four, and the totals must agree)."""
    return name == "num_batches_tracked" and isinstance(mod, torch.nn.modules.batchnorm._BatchNorm) \
        and not mod.training


def _summarize(gm: fx.GraphModule, runner: _Runner, lifted: set) -> GraphAnalysis:
    values, params = runner.values, runner.params
    records, order = [], {}
    owner: dict = {}  # storage key -> (bytes, index of the node that allocated it)
    last_use: dict = {}  # storage key -> index of the last node reading it
    input_bytes = 0
    seen_params: dict = {}
    inputs: set = set()
    counts = collections.Counter()
    for i, (node, flops, mutated, packed) in enumerate(runner.records):
        order[node] = i
        out = values.get(node)
        outs = _tensors(out)
        shape, dtype = _shape_dtype(out)
        op = _canonical_op(node, gm)
        read = written = param_bytes = elementwise = 0
        alias = ""
        if node.op == "placeholder":
            if node in lifted:
                for t in outs:
                    seen_params[_storage_key(t)] = _storage_bytes(t)
            else:
                input_bytes += sum(_nbytes(t) for t in outs)
                inputs.update(_storage_key(t) for t in outs)  # not activations either
        elif node.op == "get_attr":
            for t in outs:
                params.add(_storage_key(t))
        elif op == GUARD_OP:
            pass
        elif node.op.startswith("call_"):
            ins = _node_inputs(gm, node, values)
            in_keys = {_storage_key(t) for t in ins}
            distinct = {id(t): t for t in ins}.values()
            for t in distinct:
                key = _storage_key(t)
                last_use[key] = i
                if key in params:
                    param_bytes += _nbytes(t)
                    seen_params[key] = _storage_bytes(t)
            param_bytes += packed
            out_keys = [_storage_key(t) for t in outs]
            aliased = bool(outs) and all(k in in_keys for k in out_keys)
            region = _assigned_region(node, values)
            if region is not None:  # ``t[i] = v``: reads v, writes t[i], as export's copy_ into t[i] counts
                alias = "inplace"
                written = _nbytes(region)
                read = written + sum(_nbytes(t) for t in _tensors(values.get(node.args[2])))
                elementwise = region.numel()
            elif aliased and not mutated:
                alias = "view"
            else:
                alias = "inplace" if aliased else ""
                read = sum(_nbytes(t) for t in distinct) + packed
                written = sum(_nbytes(t) for t in outs)
                if not flops and node.target is not operator.getitem and outs:
                    elementwise = sum(t.numel() for t in outs)
            for t, key in zip(outs, out_keys):
                if key not in owner and key not in params and key not in inputs and key not in in_keys:
                    owner[key] = (_storage_bytes(t), i)
            if op in _CASTS or (node.op == "call_function" and _is_cast(node)):
                counts["casts"] += 1
            if alias != "view" and any(t.dtype in _INT8 for t in list(outs) + list(ins)):
                counts["int8_ops"] += 1
        elif node.op == "output":
            for t in _node_inputs(gm, node, values):
                last_use[_storage_key(t)] = len(runner.records)
        rule, rule_at = node.meta.get(RULE_KEY, ("", ""))
        records.append(NodeStats(node.name, node.op, op, module_path(node), shape, dtype, flops, elementwise,
                                 read, written, param_bytes, alias, rule, rule_at))
    peak, peak_at = _peak(owner, last_use, len(runner.records))
    peak_node = records[peak_at].name if peak_at is not None else ""
    compute = [r for r in records if r.is_compute]
    totals = Totals(
        nodes=len(compute),
        flops=sum(r.flops for r in compute),
        elementwise=sum(r.elementwise for r in compute),
        bytes_read=sum(r.bytes_read for r in compute),
        bytes_written=sum(r.bytes_written for r in compute),
        param_bytes=sum(seen_params.values()) + sum(runner.packed.values()),
        peak_bytes=peak,
        casts=counts["casts"],
        int8_ops=counts["int8_ops"],
    )
    return GraphAnalysis(tuple(records), totals, peak, peak_node, input_bytes)


def _assigned_region(node: fx.Node, values: dict) -> torch.Tensor | None:
    """The part of a tensor ``t[i] = v`` (dynamo's ``operator.setitem``, which returns
    nothing) assigns, or None for any other node."""
    if node.op != "call_function" or node.target is not operator.setitem or len(node.args) != 3:
        return None
    base = values.get(node.args[0]) if isinstance(node.args[0], fx.Node) else None
    if not isinstance(base, torch.Tensor):
        return None
    index = fx.node.map_arg(node.args[1], lambda n: values.get(n))
    try:
        return base[index]
    except Exception:  # noqa: BLE001 - an index the tensor does not take now: measured as any call
        return None


def _is_cast(node: fx.Node) -> bool:
    target = node.target
    return target in (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default) or (
        isinstance(target, torch._ops.OpOverload) and target._overloadpacket in (torch.ops.aten.to,))


def _peak(owner: dict, last_use: dict, end: int) -> tuple:
    """The largest sum of live storages at any node: a storage is live from the
    node that allocates it to the last node that reads it (at least its own)."""
    delta = collections.defaultdict(int)
    for key, (size, start) in owner.items():
        stop = max(last_use.get(key, start), start)
        delta[start] += size
        delta[min(stop, end) + 1] -= size
    live = peak = 0
    peak_at = None
    for i in range(end + 1):
        live += delta.get(i, 0)
        if live > peak:
            peak, peak_at = live, i
    return peak, peak_at
