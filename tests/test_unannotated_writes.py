"""Writes no schema annotates: ``batch_norm`` with ``training`` not False updates its
running statistics in place, ``instance_norm`` with ``use_input_stats`` does too when
given them, and ``F.embedding`` with ``max_norm`` renormalizes the weight rows it
reads. ``aten.batch_norm``'s schema says ``Tensor? running_mean`` (no ``a!``), so the
engine reads these from ``rewrite.ops.effects.flagged_writes``.

Each case feeds a fresh copy of a caller's tensor (``rm * 1``) to the writing op:
forwarding the caller's tensor instead (``mul_one``) would make the graph write into
it. Run with ``check=False``: only the engine's alias analysis stands between the
rule and the caller. The same graphs with the flag literally False (nothing written)
must still be rewritten.
"""

from __future__ import annotations

import operator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import rewrite
from rewrite.engine.aliasing import graph_writes
from rewrite.ops.effects import written_args

CLEANUP = rewrite.load(Path(__file__).resolve().parents[1] / "rules" / "cleanup.rw")
aten = torch.ops.aten


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, a, b):
        return self.fn(x, a, b)


def _bn_f(flag):
    return lambda x, a, b: F.batch_norm(x, a * 1, b * 1, training=flag)


def _bn_f_positional(flag):
    return lambda x, a, b: F.batch_norm(x, a * 1, b * 1, None, None, flag)


def _bn_torch(flag):
    return lambda x, a, b: torch.batch_norm(x, None, None, a * 1, b * 1, flag, 0.1, 1e-5, False)


def _bn_aten(flag):
    return lambda x, a, b: aten.batch_norm.default(x, None, None, a * 1, b * 1, flag, 0.1, 1e-5, False)


def _native_bn_aten(flag):
    return lambda x, a, b: aten.native_batch_norm.default(x, None, None, a * 1, b * 1, flag, 0.1, 1e-5)[0]


def _instance_norm(flag):
    return lambda x, a, b: F.instance_norm(torch.stack([x, -x], -1), a * 1, b * 1, use_input_stats=flag)


def _embedding(flag):
    return lambda x, a, b: F.embedding(torch.tensor([0, 2]), x * 1, max_norm=0.5 if flag else None)


CASES = {"F.batch_norm": _bn_f, "F.batch_norm positional": _bn_f_positional, "torch.batch_norm": _bn_torch,
         "aten.batch_norm": _bn_aten, "aten.native_batch_norm": _native_bn_aten,
         "F.instance_norm": _instance_norm, "F.embedding": _embedding}


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, generator=g) * 3, torch.randn(3, generator=g), torch.rand(3, generator=g) + 0.5


def _run(gm, inputs):
    copies = tuple(t.clone() for t in inputs)
    out = gm(*copies)
    return out, copies


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_training_statistics_write_is_seen(name):
    gm = fx.symbolic_trace(_Fn(CASES[name](True)))
    writers = [n for n in gm.graph.nodes if n.op == "call_function" and written_args(n, gm)]
    assert graph_writes(gm)
    assert len(writers) == 1 and writers[0].target is not operator.mul, gm.code
    written = [writers[0].args[p] if isinstance(p, int) else writers[0].kwargs[p]
               for p in written_args(writers[0], gm)]
    assert written and all(w.target is operator.mul for w in written)  # the fresh copies


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_identity_never_forwards_a_tensor_the_op_writes(name):
    gm = fx.symbolic_trace(_Fn(CASES[name](True)))
    inputs = _inputs()
    expected, eager_inputs = _run(gm, inputs)
    result = CLEANUP.apply(gm, example_inputs=inputs, check=False)
    out, seen_inputs = _run(result.graph_module, inputs)
    assert result.counts.get("mul_one", 0) == 0, result.graph_module.code
    for before, after in zip(eager_inputs, seen_inputs):
        assert torch.equal(before, after)  # the caller's tensors are never written
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_identity_still_fires_when_nothing_is_written(name):
    gm = fx.symbolic_trace(_Fn(CASES[name](False)))
    inputs = _inputs()
    expected, _ = _run(gm, inputs)
    assert not graph_writes(gm)
    result = CLEANUP.apply(gm, example_inputs=inputs)  # with the check
    assert result.counts.get("mul_one", 0) >= 1, result.graph_module.code
    out, seen_inputs = _run(result.graph_module, inputs)
    torch.testing.assert_close(out, expected)
    for before, after in zip(inputs, seen_inputs):
        assert torch.equal(before, after)


def test_a_flag_the_graph_computes_counts_as_a_write():
    class M(nn.Module):
        def forward(self, x, a, b, flag: bool):
            return F.batch_norm(x, a * 1, b * 1, training=flag)

    gm = fx.symbolic_trace(M())
    writer = next(n for n in gm.graph.nodes if "batch_norm" in str(n.target))
    assert written_args(writer, gm) == (1, 2)
