"""Synthetic ATen graphs of a requested size, shaped like real models, with rewrite
opportunities planted at a known density. Used by ``benchmarks/matcher.py``.

The graphs are built node by node with the ``torch.fx.Graph`` API (no tracing), in
the op set ``torch.export.export(...).module()`` produces: ``aten.linear``,
``aten.layer_norm``, ``aten.view``, ``aten.permute``, ``aten.transpose.int``,
``aten.matmul``, ``aten.softmax.int``, ``aten.gelu``, ``aten.add.Tensor`` for
transformer blocks; ``aten.conv2d``, ``aten.batch_norm``, ``aten.relu``,
``aten.add.Tensor`` for residual conv blocks. Parameters are ``get_attr`` nodes of
small tensors (so copying the module is dominated by the graph, not by weights).
Every node carries ``meta["val"]``, a FakeTensor, as export graphs do: this
project's shape predicates and Inductor's pattern matcher both read it.

Between the ops of each block, at "hook" points whose consumer cannot form a
pattern with what is planted (a linear, a matmul, gelu, a conv, a batch norm),
the generator plants one *motif* (``x * 1``, ``relu(relu(x))``, a double
transpose, ``x * sigmoid(x)`` ...) at ``density`` motifs per 1000 nodes, taking the
motifs round-robin. Each motif records the rule applications it will cause, so a
rewriter that reaches the fixpoint must report exactly ``SyntheticGraph.expected``.
Motifs never touch each other, so that number does not depend on the order in
which a rewriter visits nodes or rules.

    >>> g = transformer_graph(1000, density=20)
    >>> len(g.gm.graph.nodes), sum(g.planted.values()), sum(g.expected.values())
    (1000, 18, 19)
"""

from __future__ import annotations

import collections
import math
import operator
import random
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["GENERATORS", "MOTIFS", "SyntheticGraph", "conv_graph", "make_inputs", "transformer_graph"]

aten = torch.ops.aten
F32, F64 = torch.float32, torch.float64
CONTIG = torch.contiguous_format


@attrs.frozen
class SyntheticGraph:
    """A generated graph: ``gm`` (every node with ``meta['val']``), the rule
    applications a fixpoint rewrite must make (``expected``: rule name -> count),
    the motifs planted (``planted``: motif name -> count) and the shapes of the
    inputs (``input_shapes``)."""

    name: str
    gm: fx.GraphModule
    expected: dict[str, int]
    planted: dict[str, int]
    input_shapes: tuple[tuple[int, ...], ...]


class _Builder:
    """Appends ATen calls to an fx.Graph, computing each node's FakeTensor value."""

    def __init__(self, seed: int) -> None:
        self.graph = fx.Graph()
        self.root = torch.nn.Module()
        self.mode = FakeTensorMode()
        self.gen = torch.Generator().manual_seed(seed)
        self.n_params = 0
        self.inputs: list[tuple[int, ...]] = []
        self.vals: dict[Any, Any] = {}

    def __len__(self) -> int:
        return len(self.graph.nodes)

    def input(self, shape: tuple[int, ...]) -> fx.Node:
        node = self.graph.placeholder(f"x{len(self.inputs)}")
        node.meta["val"] = self.mode.from_tensor(torch.empty(shape))
        self.inputs.append(tuple(shape))
        return node

    def param(self, *shape: int, init: str = "randn") -> fx.Node:
        name = f"p{self.n_params}"
        self.n_params += 1
        if init == "ones":
            t = torch.ones(shape)
        elif init == "var":
            t = torch.rand(shape, generator=self.gen) + 0.5
        else:
            # half the variance-preserving scale, so residual stacks stay finite
            fan_in = math.prod(shape[1:]) if len(shape) > 1 else 4
            t = torch.randn(shape, generator=self.gen) * (0.5 / math.sqrt(fan_in))
        self.root.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
        node = self.graph.get_attr(name)
        node.meta["val"] = self.vals.get(("param", shape))
        if node.meta["val"] is None:
            node.meta["val"] = self.vals["param", shape] = self.mode.from_tensor(torch.empty(shape))
        return node

    def call(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        # Blocks repeat, so the same op meets the same input layouts again and
        # again: compute each FakeTensor result once and share it (10x faster at 100k).
        key = (target, _signature(args), _signature(kwargs))
        val = self.vals.get(key)
        if val is None:
            fargs, fkwargs = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
            with self.mode:
                val = self.vals[key] = target(*fargs, **fkwargs)
        node.meta["val"] = val
        return node

    def getitem(self, node: fx.Node, i: int) -> fx.Node:
        out = self.graph.call_function(operator.getitem, (node, i))
        out.meta["val"] = node.meta["val"][i]
        return out

    def finish(self, out: fx.Node) -> fx.GraphModule:
        self.graph.output(out)
        return fx.GraphModule(self.root, self.graph)


def _signature(a: Any) -> Any:
    """A hashable description of call arguments: tensors by layout, literals as is."""
    if isinstance(a, fx.Node):
        v = a.meta["val"]
        return ("T", tuple(v.shape), v.stride(), v.storage_offset(), v.dtype)
    if isinstance(a, (list, tuple)):
        return (type(a).__name__,) + tuple(_signature(x) for x in a)
    if isinstance(a, dict):
        return tuple((k, _signature(v)) for k, v in a.items())
    return (type(a).__name__, a)


# ---------------------------------------------------------------- motifs
#
# A motif takes the builder, the value at the hook, a second value of the same
# shape (for binary motifs) and an rng; it returns the value to hand on and the
# rule applications it causes.

Motif = Callable[[_Builder, fx.Node, fx.Node, random.Random], tuple[fx.Node, dict[str, int]]]


def _rank(n: fx.Node) -> int:
    return n.meta["val"].dim()


def _shape(n: fx.Node) -> list[int]:
    return list(n.meta["val"].shape)


def _m_mul_one(b, h, r, rng):
    return b.call(aten.mul.Tensor, h, 1), {"mul_one": 1}


def _m_div_one(b, h, r, rng):
    return b.call(aten.div.Tensor, h, 1), {"div_one": 1}


def _m_add_zero(b, h, r, rng):
    return b.call(aten.add.Tensor, h, 0), {"add_zero": 1}


def _m_sub_zero(b, h, r, rng):
    return b.call(aten.sub.Tensor, h, 0), {"sub_zero": 1}


def _m_neg_neg(b, h, r, rng):
    return b.call(aten.neg.default, b.call(aten.neg.default, h)), {"neg_neg": 1}


def _m_relu_relu(b, h, r, rng):
    return b.call(aten.relu.default, b.call(aten.relu.default, h)), {"relu_relu": 1}


def _m_contiguous(b, h, r, rng):
    inner = b.call(aten.clone.default, h, memory_format=CONTIG)
    return b.call(aten.clone.default, inner, memory_format=CONTIG), {"contiguous_contiguous": 1}


def _m_transpose_transpose(b, h, r, rng):
    a, c = rng.choice([(1, 2), (-2, -1), (0, 1)])
    second = rng.choice([(a, c), (c, a)])
    return b.call(aten.transpose.int, b.call(aten.transpose.int, h, a, c), *second), {"transpose_transpose": 1}


def _m_transpose_same(b, h, r, rng):
    d = rng.choice([1, -1])
    other = d if rng.random() < 0.5 else d % _rank(h)
    return b.call(aten.transpose.int, h, d, other), {"transpose_same_dim": 1}


def _m_permute_permute(b, h, r, rng):
    n = _rank(h)
    p = [0] + list(range(2, n)) + [1]  # NCHW -> NHWC (channels last), or swap of the last two
    q = [p.index(i) for i in range(n)]  # its inverse
    return b.call(aten.permute.default, b.call(aten.permute.default, h, p), q), {"permute_permute": 1}


def _m_permute_identity(b, h, r, rng):
    return b.call(aten.permute.default, h, list(range(_rank(h)))), {"permute_identity": 1}


def _m_reshape_reshape(b, h, r, rng):
    s = _shape(h)
    flat = b.call(aten.view.default, h, [s[0] * s[1]] + s[2:])
    # view(view(h, a), shape(h)) -> reshape(h, shape(h)) -> h
    return b.call(aten.view.default, flat, s), {"reshape_reshape": 1, "reshape_noop": 1}


def _m_reshape_noop(b, h, r, rng):
    s = _shape(h)
    if rng.random() < 0.5:
        s[-1] = -1
    return b.call(aten.view.default, h, s), {"reshape_noop": 1}


def _m_cat_single(b, h, r, rng):
    return b.call(aten.cat.default, [h], rng.choice([0, 1, -1])), {"cat_single": 1}


def _m_to_same(b, h, r, rng):
    return b.call(aten._to_copy.default, h, dtype=F32), {"to_same_dtype": 1}


def _m_to_roundtrip(b, h, r, rng):
    wide = b.call(aten._to_copy.default, h, dtype=F64)
    return b.call(aten._to_copy.default, wide, dtype=F32), {"to_roundtrip": 1}


def _m_squeeze_unsqueeze(b, h, r, rng):
    d = rng.choice([0, 1, -1])
    return b.call(aten.squeeze.dim, b.call(aten.unsqueeze.default, h, d), d), {"squeeze_unsqueeze": 1}


def _m_abs_abs(b, h, r, rng):
    return b.call(aten.abs.default, b.call(aten.abs.default, h)), {"abs_abs": 1}


def _m_abs_neg(b, h, r, rng):
    return b.call(aten.abs.default, b.call(aten.neg.default, h)), {"abs_neg": 1}


def _other(b: _Builder, h: fx.Node, r: fx.Node) -> fx.Node:
    """A second operand distinct from ``h``: ``r``, or else a constant of h's shape
    (``x + (-x)`` would bind two pattern variables to one node, which
    replace_pattern's one-to-one matcher never does)."""
    return r if r is not h else b.param(*_shape(h))


def _m_add_neg(b, h, r, rng):
    n = b.call(aten.neg.default, _other(b, h, r))
    args = (h, n) if rng.random() < 0.5 else (n, h)
    return b.call(aten.add.Tensor, *args), {"add_neg": 1}


def _m_sub_neg(b, h, r, rng):
    return b.call(aten.sub.Tensor, h, b.call(aten.neg.default, _other(b, h, r))), {"sub_neg": 1}


def _m_mul_neg_one(b, h, r, rng):
    return b.call(aten.mul.Tensor, h, -1), {"mul_neg_one": 1}


def _m_silu(b, h, r, rng):
    s = b.call(aten.sigmoid.default, h)
    args = (h, s) if rng.random() < 0.5 else (s, h)
    return b.call(aten.mul.Tensor, *args), {"silu_from_sigmoid": 1}


#: motif name -> planting function; each motif exercises the rule(s) it names.
MOTIFS: dict[str, Motif] = {
    "mul_one": _m_mul_one,
    "div_one": _m_div_one,
    "add_zero": _m_add_zero,
    "sub_zero": _m_sub_zero,
    "neg_neg": _m_neg_neg,
    "relu_relu": _m_relu_relu,
    "contiguous_contiguous": _m_contiguous,
    "transpose_transpose": _m_transpose_transpose,
    "transpose_same_dim": _m_transpose_same,
    "permute_permute": _m_permute_permute,
    "permute_identity": _m_permute_identity,
    "reshape_reshape": _m_reshape_reshape,
    "reshape_noop": _m_reshape_noop,
    "cat_single": _m_cat_single,
    "to_same_dtype": _m_to_same,
    "to_roundtrip": _m_to_roundtrip,
    "squeeze_unsqueeze": _m_squeeze_unsqueeze,
    "abs_abs": _m_abs_abs,
    "abs_neg": _m_abs_neg,
    "add_neg": _m_add_neg,
    "sub_neg": _m_sub_neg,
    "mul_neg_one": _m_mul_neg_one,
    "silu_from_sigmoid": _m_silu,
}


class _Planter:
    """Decides, at each hook, whether to plant a motif (``density`` per 1000 nodes)."""

    def __init__(self, b: _Builder, density: float, motifs: list[str], seed: int) -> None:
        self.b = b
        self.density = density
        self.motifs = motifs
        self.rng = random.Random(seed)
        self.next = 0
        self.credit = 0.0
        self.seen = 0
        self.expected: collections.Counter = collections.Counter()
        self.planted: collections.Counter = collections.Counter()

    def hook(self, h: fx.Node, other: fx.Node | None = None) -> fx.Node:
        """Maybe plant a motif on ``h``; binary motifs use ``other`` (same shape,
        default ``h``) as their second operand."""
        grown = len(self.b) - self.seen
        self.seen = len(self.b)
        self.credit += grown * self.density / 1000.0
        if self.credit < 1.0 or not self.motifs:
            return h
        self.credit -= 1.0
        name = self.motifs[self.next % len(self.motifs)]
        self.next += 1
        out, fired = MOTIFS[name](self.b, h, h if other is None else other, self.rng)
        self.seen = len(self.b)
        self.expected.update(fired)
        self.planted[name] += 1
        return out


# ---------------------------------------------------------------- blocks


def _linear(b: _Builder, x: fx.Node, fan_in: int, fan_out: int) -> fx.Node:
    return b.call(aten.linear.default, x, b.param(fan_out, fan_in), b.param(fan_out))


def _layer_norm(b: _Builder, x: fx.Node, e: int) -> fx.Node:
    return b.call(aten.layer_norm.default, x, [e], b.param(e, init="ones"), b.param(e), 1e-5)


def _transformer_block(b: _Builder, p: _Planter, x: fx.Node, batch: int, seq: int, heads: int, dim: int) -> fx.Node:
    """Pre-norm attention + MLP, as export spells it (38 nodes without motifs)."""
    e = heads * dim
    h = p.hook(_layer_norm(b, x, e), x)
    qkv = b.call(aten.split.Tensor, _linear(b, h, e, 3 * e), e, -1)
    q, k, v = (b.call(aten.permute.default, b.call(aten.view.default, b.getitem(qkv, i), [batch, seq, heads, dim]),
                      [0, 2, 1, 3]) for i in range(3))
    scores = b.call(aten.matmul.default, q, b.call(aten.transpose.int, k, -2, -1))
    probs = b.call(aten.softmax.int, b.call(aten.mul.Tensor, scores, 1.0 / math.sqrt(dim)), -1)
    probs = p.hook(probs)
    o = b.call(aten.permute.default, b.call(aten.matmul.default, probs, v), [0, 2, 1, 3])
    o = _linear(b, b.call(aten.reshape.default, o, [batch, seq, e]), e, e)
    x = b.call(aten.add.Tensor, x, o)
    h = p.hook(_layer_norm(b, x, e), x)
    h = p.hook(_linear(b, h, e, 4 * e))
    h = p.hook(b.call(aten.gelu.default, h))
    return b.call(aten.add.Tensor, x, _linear(b, h, 4 * e, e))


def _batch_norm(b: _Builder, x: fx.Node, c: int) -> fx.Node:
    return b.call(aten.batch_norm.default, x, b.param(c, init="ones"), b.param(c), b.param(c),
                  b.param(c, init="var"), False, 0.1, 1e-5, True)


def _conv_block(b: _Builder, p: _Planter, x: fx.Node, channels: int) -> fx.Node:
    """ResNet basic block: conv-bn-relu-conv-bn, residual add, relu (17 nodes)."""
    c = channels
    h = p.hook(b.call(aten.conv2d.default, x, b.param(c, c, 3, 3), None, [1, 1], [1, 1]), x)
    h = b.call(aten.relu.default, _batch_norm(b, h, c))
    h = p.hook(b.call(aten.conv2d.default, h, b.param(c, c, 3, 3), None, [1, 1], [1, 1]), x)
    h = _batch_norm(b, h, c)
    return b.call(aten.relu.default, b.call(aten.add.Tensor, h, x))


def _fill(b: _Builder, h: fx.Node, n_nodes: int) -> fx.Node:
    """Pad to exactly ``n_nodes`` (the output node included) with ``h * 0.5``."""
    while len(b) < n_nodes - 1:
        h = b.call(aten.mul.Tensor, h, 0.5)
    return h


def _motif_list(motifs: Any) -> list[str]:
    names = list(MOTIFS) if motifs is None else list(motifs)
    unknown = [m for m in names if m not in MOTIFS]
    if unknown:
        raise ValueError(f"unknown motifs {unknown}; have {sorted(MOTIFS)}")
    return names


def transformer_graph(n_nodes: int, density: float = 20.0, seed: int = 0, motifs: Any = None,
                      batch: int = 1, seq: int = 4, heads: int = 2, dim: int = 4) -> SyntheticGraph:
    """A stack of transformer blocks with exactly ``n_nodes`` nodes.

    Args:
        n_nodes: total nodes, placeholders and output included (at least 60).
        density: planted motifs per 1000 nodes.
        seed: for weights and the motifs' variations.
        motifs: names from ``MOTIFS`` to plant, round-robin (default: all).
        batch, seq, heads, dim: activation shapes (small: the graph is the point).
    """
    if n_nodes < 60:
        raise ValueError("a transformer graph needs at least 60 nodes")
    b = _Builder(seed)
    p = _Planter(b, density, _motif_list(motifs), seed)
    x = b.input((batch, seq, heads * dim))
    per_block = 38 + 5 * 3  # 5 hooks, motifs of at most 3 nodes
    while len(b) + per_block + 2 < n_nodes:
        x = _transformer_block(b, p, x, batch, seq, heads, dim)
    gm = b.finish(_fill(b, x, n_nodes))
    return SyntheticGraph(f"transformer-{_k(n_nodes)}", gm, dict(p.expected), dict(p.planted), tuple(b.inputs))


def conv_graph(n_nodes: int, density: float = 20.0, seed: int = 0, motifs: Any = None,
               batch: int = 1, channels: int = 4, size: int = 4) -> SyntheticGraph:
    """A stack of residual conv blocks (conv, batch_norm, relu, add) with exactly
    ``n_nodes`` nodes; arguments as for ``transformer_graph``."""
    if n_nodes < 30:
        raise ValueError("a conv graph needs at least 30 nodes")
    b = _Builder(seed)
    p = _Planter(b, density, _motif_list(motifs), seed)
    x = b.input((batch, channels, size, size))
    per_block = 17 + 2 * 3
    while len(b) + per_block + 2 < n_nodes:
        x = _conv_block(b, p, x, channels)
    gm = b.finish(_fill(b, x, n_nodes))
    return SyntheticGraph(f"conv-{_k(n_nodes)}", gm, dict(p.expected), dict(p.planted), tuple(b.inputs))


def _k(n: int) -> str:
    return f"{n // 1000}k" if n % 1000 == 0 and n >= 1000 else str(n)


#: family name -> generator
GENERATORS: dict[str, Callable[..., SyntheticGraph]] = {"transformer": transformer_graph, "conv": conv_graph}


def make_inputs(g: SyntheticGraph, seed: int = 0) -> tuple:
    """Real random inputs for running ``g.gm``."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, generator=gen) for s in g.input_shapes)
