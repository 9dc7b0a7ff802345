"""What the engine must know about ops it does not rewrite: which return (a view of)
their input, and which write an argument (``rewrite.ops.effects``).

An identity rule (``x * 1 => x``) is sound only when the value it forwards shares
memory with nothing the caller can observe through the rewritten value. These cases
come from an adversarial probe: ops whose aliasing no schema annotates (Python
``getattr`` nodes such as ``x.T``, composite aten ops such as eval-mode
``aten.dropout`` that return their input, list-taking ``broadcast_tensors``,
functions from outside torch) and writes through ``out=``. Each runs with
``check=False`` (the compile-time path, where only the engine's own analysis stands
between a rule and the caller) on ``symbolic_trace`` and ``torch.export`` graphs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import rewrite

CLEANUP = rewrite.load(Path(__file__).resolve().parents[1] / "rules" / "cleanup.rw")


def _identity(x):
    return x


fx.wrap("_identity")


def _capture(fn, x, level):
    module = _Fn(fn)
    if level == "fx":
        return fx.symbolic_trace(module)
    return torch.export.export(module, (x,), strict=False).module()


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _shares_memory(a, b) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# (name, fn, levels): the returned value is op(x) * 1, a fresh tensor in eager
RETURNED = [
    ("T", lambda x: x.T * 1, ("fx", "export")),
    ("mT", lambda x: x.mT * 1, ("fx", "export")),
    ("H", lambda x: x.H * 1, ("fx",)),
    ("atleast_2d", lambda x: torch.atleast_2d(x) * 1, ("fx", "export")),
    ("sum_to_size", lambda x: x.sum_to_size(2, 3) * 1, ("fx", "export")),
    ("dropout_eval", lambda x: F.dropout(x, 0.5, training=False) * 1, ("fx", "export")),
    ("dropout1d_eval", lambda x: F.dropout1d(x, 0.5, training=False) * 1, ("fx", "export")),
    ("alpha_dropout_eval", lambda x: F.alpha_dropout(x, 0.5, training=False) * 1, ("fx", "export")),
    ("broadcast_to", lambda x: torch.broadcast_to(x, (2, 3)) * 1, ("fx", "export")),
    ("broadcast_tensors", lambda x: torch.broadcast_tensors(x, x)[1] * 1, ("fx", "export")),
    ("wrapped_function", lambda x: _identity(x) * 1, ("fx",)),
]


@pytest.mark.parametrize("name,fn,level", [(n, f, lv) for n, f, levels in RETURNED for lv in levels],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_a_returned_identity_never_aliases_the_input(name, fn, level):
    x = torch.randn(2, 3)
    gm = _capture(fn, x, level)
    result = CLEANUP.apply(gm, example_inputs=(x,), check=False)
    out = result.graph_module(x)
    assert not _shares_memory(out, x), f"{name}: the rewritten output shares the caller's input"
    torch.testing.assert_close(out, fn(x))


@pytest.mark.parametrize("level", ["fx", "export"])
def test_a_written_identity_never_writes_the_input(level):
    def fn(x):
        z = x.T * 1
        z.add_(1)
        return z

    x = torch.randn(3, 3)
    gm = _capture(fn, x, level)
    result = CLEANUP.apply(gm, example_inputs=(x,), check=False)
    before = x.clone()
    out = result.graph_module(x)
    assert torch.equal(x, before), "the rewrite wrote into the caller's input"
    torch.testing.assert_close(out, before.T + 1)


@pytest.mark.parametrize("level", ["fx", "export"])
def test_a_write_through_out_is_seen(level):
    def fn(x):
        y = torch.relu(x)
        z = y * 1  # a copy of y taken before the write below
        torch.add(x, 1, out=y)
        return z

    x = torch.randn(2, 3)
    gm = _capture(fn, x, level)
    result = CLEANUP.apply(gm, example_inputs=(x,), check=False)
    assert "mul_one" not in result.counts
    torch.testing.assert_close(result.graph_module(x.clone()), torch.relu(x))


def test_out_writes_are_written_arguments():
    from rewrite.ops.effects import written_nodes

    g = fx.Graph()
    x, y, v, i = (g.placeholder(n) for n in "xyvi")
    plain = g.call_function(torch.add, (x, 1), {"out": y})
    pair = g.call_function(torch.max, (x, 0), {"out": (v, i)})
    aten_out = g.call_function(torch.ops.aten.add.out, (x, 1), {"out": y})
    g.output((plain, pair, aten_out))
    gm = fx.GraphModule(nn.Module(), g)
    assert written_nodes(plain, gm) == [y]
    assert written_nodes(pair, gm) == [v, i]
    assert written_nodes(aten_out, gm) == [y]


@pytest.mark.parametrize("level", ["fx", "export"])
def test_identities_inside_the_graph_still_fire(level):
    # the same ops, when the value is neither returned nor written: nothing to observe
    def fn(x):
        return torch.relu(F.dropout(x, 0.5, training=False) * 1) + torch.atleast_2d(x).T * 1

    x = torch.randn(3, 3)
    gm = _capture(fn, x, level)
    result = CLEANUP.apply(gm, example_inputs=(x,), check=False)
    assert result.counts.get("mul_one", 0) == 2
    torch.testing.assert_close(result.graph_module(x), fn(x))


# ---------------------------------------------------------------- readers of strides

NEEDS_LAYOUT = [
    ("expand_then_view", lambda x: (torch.relu(x)[:1].expand(4, 6) * 1).view(-1)),
    ("strided_slice_then_view", lambda x: (torch.relu(x)[:, ::2] * 1).view(-1)),
    ("cat_single_then_view", lambda x: torch.cat([torch.relu(x)[:, ::2]]).view(-1)),
    ("neg_neg_then_view", lambda x: (-(-torch.relu(x)[:, ::2])).view(-1)),
]


@pytest.mark.parametrize("name,fn", NEEDS_LAYOUT, ids=[n for n, _ in NEEDS_LAYOUT])
@pytest.mark.parametrize("level", ["fx", "export"])
def test_a_copy_a_view_needs_is_kept(name, fn, level):
    x = torch.randn(4, 6)
    gm = _capture(fn, x, level)
    result = CLEANUP.apply(gm, example_inputs=(x,), check=False)
    assert not result.counts, f"{name}: {dict(result.counts)}"
    out = result.graph_module(x)
    torch.testing.assert_close(out, fn(x))
    assert out.stride() == fn(x).stride()


@pytest.mark.parametrize("level", ["fx", "export"])
def test_identities_before_a_view_of_the_same_layout_still_fire(level):
    def fn(x):
        return (torch.relu(x) * 1).view(-1)

    x = torch.randn(4, 6)
    gm = _capture(fn, x, level)
    result = CLEANUP.apply(gm, example_inputs=(x,), check=False)
    assert result.counts.get("mul_one") == 1
    torch.testing.assert_close(result.graph_module(x), fn(x))
