"""What a result owns of the state its runs may write (``rewrite.engine.workspace``
``own_written_state``, ``own_state_training_writes``): the copies are made per
memory, so they keep each tensor's layout (strides, offset, storage size) and what
shares memory with what, and every place that holds a copied tensor holds its copy.
The copies are cheap for the common case (a buffer alone over its memory is cloned)
and exact for the rest (a storage shared by views is copied once)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import fx, nn

import rewrite

MUL_ONE = "rule mul_one: mul(x, 1) where is_float(x) => x"


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _layout(t: torch.Tensor) -> tuple:
    return t.size(), t.stride(), t.storage_offset(), t.untyped_storage().nbytes()


class _Norms(nn.Module):
    """Two batch norms; a rule fires on the multiply, the norms stay."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.a = nn.BatchNorm1d(channels)
        self.b = nn.BatchNorm1d(channels)

    def forward(self, x):
        return self.b(self.a(x) * 1.0)


def _randomized(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for bn in (model.a, model.b):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
    return model.eval()


def _apply(gm: fx.GraphModule, x: torch.Tensor, check: bool) -> fx.GraphModule:
    result = rewrite.parse(MUL_ONE).apply(gm, (x,), check=check)
    assert result.counts == {"mul_one": 1}
    return result.graph_module


def _train_run_leaves_caller_alone(gm: fx.GraphModule, out: fx.GraphModule, x: torch.Tensor) -> None:
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    out.train()
    out(x)
    after = gm.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "the caller's running statistics changed"
    assert not torch.equal(out.get_submodule("a").running_mean, before["a.running_mean"])


@pytest.mark.parametrize("check", [False, True])
@settings(max_examples=15, deadline=None)
@given(channels=st.integers(1, 5), pad=st.integers(0, 3), offset=st.integers(0, 3), transposed=st.booleans())
def test_a_buffer_over_part_of_a_larger_memory_keeps_its_layout(check, channels, pad, offset, transposed):
    """running_mean as a strided view into a larger tensor (offset, gaps, a size-1
    dimension with an odd stride): the result's copy has the same layout, and a
    train-mode run of the result writes only the copy."""
    model = _randomized(_Norms(channels))
    base = torch.randn(offset + (channels + pad) * 2 + 1)
    view = base[offset:offset + channels * 2:2] if not transposed else base[offset:offset + channels]
    with torch.no_grad():
        view.copy_(model.a.running_mean)
    model.a.running_mean = view  # a registered buffer, assigned: stays a buffer
    gm = fx.symbolic_trace(model)
    x = torch.randn(6, channels)
    out = _apply(gm, x, check)
    theirs, ours = gm.get_submodule("a").running_mean, out.get_submodule("a").running_mean
    assert _layout(ours) == _layout(theirs) and _storage(ours) != _storage(theirs)
    assert torch.equal(ours, theirs)
    _train_run_leaves_caller_alone(gm, out, x)


def test_a_contiguous_buffer_with_odd_strides_on_size_one_dimensions_keeps_them():
    model = _randomized(_Norms(1))
    odd = torch.empty_strided((1,), (7,))
    odd.copy_(model.a.running_var)
    model.a.running_var = odd
    gm = fx.symbolic_trace(model)
    out = _apply(gm, torch.randn(5, 1), check=False)
    copied = out.get_submodule("a").running_var
    assert copied.stride() == (7,) and _layout(copied) == _layout(odd) and _storage(copied) != _storage(odd)


@pytest.mark.parametrize("check", [False, True])
def test_a_buffer_shared_by_two_norms_stays_shared_in_the_result(check):
    """Tied statistics (one tensor registered in two modules): the result's two
    modules hold one copy, so its writes reach both, as the input's did."""
    model = _randomized(_Norms())
    model.b.running_mean = model.a.running_mean
    gm = fx.symbolic_trace(model)
    x = torch.randn(6, 4)
    out = _apply(gm, x, check)
    a, b = out.get_submodule("a"), out.get_submodule("b")
    assert a.running_mean is b.running_mean
    assert a.running_mean is not gm.get_submodule("a").running_mean
    _train_run_leaves_caller_alone(gm, out, x)


@pytest.mark.parametrize("check", [False, True])
def test_a_tensor_viewing_a_copied_buffer_views_the_copy(check):
    """A plain attribute (or another buffer) over a written buffer's memory views
    the copy's memory in the result: what the result's run writes, it reads."""
    model = _randomized(_Norms())
    model.a.mirror = model.a.running_var[1:]  # a plain tensor attribute, a view
    model.b.register_buffer("head", model.a.running_mean[:2])  # a buffer of another module, a view
    gm = fx.symbolic_trace(model)
    x = torch.randn(6, 4)
    out = _apply(gm, x, check)
    a, b = out.get_submodule("a"), out.get_submodule("b")
    assert _storage(a.mirror) == _storage(a.running_var) != _storage(gm.get_submodule("a").running_var)
    assert _storage(b.head) == _storage(a.running_mean) != _storage(gm.get_submodule("b").head)
    assert a.mirror.storage_offset() == a.running_var.storage_offset() + 1
    _train_run_leaves_caller_alone(gm, out, x)
    assert torch.equal(out.get_submodule("a").mirror, out.get_submodule("a").running_var[1:])


def test_tensors_without_strided_memory_beside_the_statistics_are_left_alone():
    """A sparse or quantized tensor attribute of a module (no memory the walk can
    read cheaply) is neither copied nor an obstacle."""
    model = _randomized(_Norms())
    model.a.sparse = torch.eye(4).to_sparse()
    model.b.packed = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    gm = fx.symbolic_trace(model)
    x = torch.randn(6, 4)
    out = _apply(gm, x, check=True)
    assert out.get_submodule("a").sparse is gm.get_submodule("a").sparse
    assert out.get_submodule("b").packed is gm.get_submodule("b").packed
    _train_run_leaves_caller_alone(gm, out, x)


def test_a_parameter_among_the_copies_stays_a_parameter():
    """A forward that writes a parameter's memory in place (a weight viewed by a
    buffer the graph writes): its copy is a Parameter with the same requires_grad."""

    class Writes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4), requires_grad=False)
            self.register_buffer("lead", self.w.data[:2])

        def forward(self, x):
            self.lead.add_(1)
            return x * 1.0 + self.w

    x = torch.randn(4)
    gm = torch.export.export(Writes(), (x,)).module()
    assert gm.lead.untyped_storage().data_ptr() == gm.w.untyped_storage().data_ptr()
    before = gm.w.detach().clone()
    out = rewrite.parse(MUL_ONE).apply(gm, (x,), check=False).graph_module
    out(x)
    assert torch.equal(gm.w, before)
    assert isinstance(out.w, nn.Parameter) and not out.w.requires_grad
    assert _storage(out.lead) == _storage(out.w) != _storage(gm.w)
