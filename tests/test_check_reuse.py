"""The check's rewrite runs reuse the original's values where nothing changed
(``rewrite.trust.reuse``): fewer ops run, and a wrong rewrite is still caught,
wherever it sits."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import rewrite
from rewrite.trust.check import check_equivalence
from rewrite.trust import reuse, runner
from rewrite.trust.reuse import bitwise_same, recordable


class _Blocks(nn.Module):
    """A residual MLP whose every block multiplies by one (``mul_one`` removes it,
    changing no bit) and ends in ``neg``."""

    def __init__(self, n: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x) * 1.0) + x
        return -x


def _exported(n: int = 6):
    torch.manual_seed(0)
    model = _Blocks(n).eval()
    x = torch.randn(2, 8)
    return torch.export.export(model, (x,)).module(), x


class _OpCounter(TorchDispatchMode):
    """Counts the model's own computing ops (not the reads and comparisons of bits)."""

    _COUNTED = ("relu", "addmm", "mm", "add", "neg", "mul")

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self._COUNTED:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "rules.rw"
    path.write_text(text)
    return str(path)


def test_an_exported_functional_graph_is_recordable_and_one_writing_in_place_is_not():
    gm, x = _exported()
    assert recordable(gm)

    class Writes(nn.Module):
        def forward(self, x):
            y = x * 2
            y.add_(1)
            return y

    writes = torch.export.export(Writes(), (x,)).module()
    assert any(n.target == torch.ops.aten.add_.Tensor for n in writes.graph.nodes)
    assert not recordable(writes)


def test_the_rewrites_runs_compute_only_what_changed(tmp_path):
    """A bit-exact cleanup: the rewrite's runs take every value from the
    original's, so they dispatch far fewer ops than the original's runs."""
    gm, x = _exported()
    rules = rewrite.load(_write(tmp_path, "rule mul_one: mul(x, 1) where is_float(x) => x\n"))
    result = rules.apply(gm, check=False)
    assert result.counts == {"mul_one": 6}
    assert not any(n.target == torch.ops.aten.mul.Tensor for n in result.graph_module.graph.nodes)

    counters = []
    original_call = torch.fx.GraphModule.__call__

    def counting_call(self, *args, **kwargs):
        with _OpCounter() as counter:
            out = original_call(self, *args, **kwargs)
        counters.append((self is gm, counter.calls))
        return out

    torch.fx.GraphModule.__call__ = counting_call
    try:
        report = check_equivalence(gm, result.graph_module, (x,), tolerance="exact")
    finally:
        torch.fx.GraphModule.__call__ = original_call
    assert report.ok
    original_ops = [c for mine, c in counters if mine]
    rewrite_ops = [c for mine, c in counters if not mine]
    assert original_ops and rewrite_ops
    # the original runs every op; the rewrite recomputes nothing (its values are bitwise the original's)
    assert max(rewrite_ops) < min(original_ops) / 4, (original_ops, rewrite_ops)


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_wrong_rewrite_is_still_caught_wherever_it_is(tmp_path, where, monkeypatch):
    """Reuse never hides a change: a rule that drops a block's relu (wrong on
    negative values) fails the check, whether it fires at the first block (all
    downstream is recomputed) or only at the output's neg (all upstream reused)."""
    gm, x = _exported()
    if where == "first":
        text = ("rule mul_one: mul(x, 1) where is_float(x) => x\n"
                "rule drop_relu: relu(x) where single_use(x) => x\n")
    else:
        text = ("rule mul_one: mul(x, 1) where is_float(x) => x\n"
                "rule wrong_neg: neg(x) => mul(x, -0.5)\n")
    rules = rewrite.load(_write(tmp_path, text))
    asked = []
    real = reuse.inputs_same
    monkeypatch.setattr(runner, "inputs_same", lambda *a: asked.append(1) or real(*a))  # what the runner calls
    with pytest.raises(rewrite.EquivalenceError):
        rules.apply(gm, example_inputs=(x,))
    assert asked  # the check's runs did try to reuse the original's values
    # and the exact part alone passes
    ok = rewrite.load(_write(tmp_path, "rule mul_one: mul(x, 1) where is_float(x) => x\n"))
    assert ok.apply(gm, example_inputs=(x,)).counts == {"mul_one": 6}


def test_a_sign_of_zero_is_a_difference(tmp_path):
    """``x + 0 => x`` changes -0.0 into itself, where the original made +0.0; a
    later ``1 / y`` tells them apart (-inf against inf): the rewrite's runs must
    not take the original's values past that point."""

    class Recip(nn.Module):
        def forward(self, x):
            return 1.0 / (x + 0.0)

    x = torch.tensor([-0.0, 1.0, -2.0])
    gm = torch.export.export(Recip(), (x,)).module()
    rules = rewrite.load(_write(tmp_path, "rule add_zero_any: add(x, 0) => x\n"))
    result = rules.apply(gm, check=False)
    assert result.counts == {"add_zero_any": 1}
    report = check_equivalence(gm, result.graph_module, (x,), trials=1, tolerance="exact")
    assert not report.ok  # -inf against inf at index 0


def test_bitwise_same_compares_bits_and_layout():
    a = torch.tensor([0.0, 1.0, float("nan")])
    assert bitwise_same(a, a.clone())  # the same NaN bits
    assert not bitwise_same(torch.tensor([0.0]), torch.tensor([-0.0]))
    m = torch.arange(6.0).reshape(2, 3)
    assert not bitwise_same(m.t(), m.t().contiguous())  # same values, other strides
    assert not bitwise_same(m, m.double())
    assert not bitwise_same(torch.tensor([1, 2]), torch.tensor([1.0, 2.0]))
    assert bitwise_same((m, 2, 0.5), (m.clone(), 2, 0.5))
    assert not bitwise_same(0.0, -0.0) and not bitwise_same(1, 1.0) and not bitwise_same(1, True)
    z = torch.tensor([1 + 2j, complex(-0.0, 0.0)])
    assert bitwise_same(z, z.clone()) and not bitwise_same(z, torch.tensor([1 + 2j, 0j]))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1, max_size=8))
def test_bitwise_same_is_equality_of_bits(values):
    a = torch.tensor(values, dtype=torch.float32)
    b = a.clone()
    assert bitwise_same(a, b)
    flipped = b.clone()
    flipped.view(torch.int32)[0] ^= 1  # one bit of the first value
    assert not bitwise_same(a, flipped)
    assert math.isnan(values[0]) or flipped[0].item() != values[0] or values[0] == 0.0
