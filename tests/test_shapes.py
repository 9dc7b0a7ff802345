"""The elementwise shortcut for new nodes' ``val`` (rewrite.engine.shapes) gives what
running the op on fake tensors gives, or declines."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from rewrite.engine.shapes import fresh_like, like_input

aten = torch.ops.aten

UNARY = [aten.neg.default, aten.abs.default, aten.relu.default, aten.sigmoid.default, aten.tanh.default,
         aten.silu.default, aten.exp.default, aten.rsqrt.default, aten.hardswish.default, torch.neg, torch.sigmoid,
         F.silu, F.gelu, operator.neg, "relu", "sigmoid", "neg"]
BINARY = [aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.maximum.default, torch.add,
          torch.mul, operator.add, operator.sub, operator.truediv, "add", "mul", "div"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
          torch.uint8]


def _make(mode: FakeTensorMode, shape: tuple, dtype: torch.dtype, layout: str) -> torch.Tensor:
    with mode:
        if layout == "channels_last" and len(shape) == 4:
            return torch.empty(shape, dtype=dtype).to(memory_format=torch.channels_last)
        if layout == "transposed" and len(shape) >= 2:
            return torch.empty(shape[::-1], dtype=dtype).transpose(0, -1)
        if layout == "expanded" and shape:
            return torch.empty((1,) + tuple(shape[1:]), dtype=dtype).expand(shape)
        if layout == "odd_unit_stride" and 1 in shape:
            i = shape.index(1)
            t = torch.empty(shape, dtype=dtype)
            stride = list(t.stride())
            stride[i] = 7
            return torch.empty_strided(shape, stride, dtype=dtype)
        return torch.empty(shape, dtype=dtype)


def _node(target, args, kwargs=None):
    g = fx.Graph()
    ins = [g.placeholder(f"x{i}") if isinstance(a, torch.Tensor) else a for i, a in enumerate(args)]
    op = "call_method" if isinstance(target, str) else "call_function"
    node = g.create_node(op, target, tuple(ins), kwargs or {})
    values = {n: a for n, a in zip(ins, args) if isinstance(n, fx.Node)}
    return node, values


def _real(mode, target, args, kwargs):
    with mode:
        if isinstance(target, str):
            return getattr(args[0], target)(*args[1:], **kwargs)
        return target(*args, **kwargs)


def _agrees(mode, target, args, kwargs=None):
    kwargs = kwargs or {}
    node, values = _node(target, args, kwargs)
    same = like_input(node, values)
    if same is None:
        return False
    try:
        real = _real(mode, target, args, kwargs)
    except Exception:  # noqa: BLE001 - the op refuses these inputs: the shortcut must not answer
        pytest.fail(f"shortcut answered for {target} on inputs the op refuses")
    got = fresh_like(same)
    assert (got.shape, got.stride(), got.dtype, got.device) == (real.shape, real.stride(), real.dtype, real.device)
    assert got.fake_mode is mode and got.untyped_storage() is not same.untyped_storage()
    return True


shapes = st.lists(st.integers(1, 4), min_size=0, max_size=4).map(tuple)
layouts = st.sampled_from(["contiguous", "channels_last", "transposed", "expanded", "odd_unit_stride"])


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(UNARY), shapes, st.sampled_from(DTYPES), layouts)
def test_unary_shortcut_matches_fake_propagation(target, shape, dtype, layout):
    mode = FakeTensorMode()
    x = _make(mode, shape, dtype, layout)
    _agrees(mode, target, (x,))


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(BINARY), shapes, shapes, st.sampled_from(DTYPES), st.sampled_from(DTYPES), layouts, layouts,
       st.sampled_from([None, 2, 0.5, True]))
def test_binary_shortcut_matches_fake_propagation(target, s1, s2, d1, d2, l1, l2, scalar):
    mode = FakeTensorMode()
    x = _make(mode, s1, d1, l1)
    y = scalar if scalar is not None else _make(mode, s2, d2, l2)
    _agrees(mode, target, (x, y))


def _broadcast_pair(big: tuple):
    """``(big, a shape that broadcasts to it)``: a suffix of ``big`` with some sizes 1."""
    return st.integers(0, len(big)).flatmap(
        lambda k: st.tuples(*[st.sampled_from([1, d]) for d in big[len(big) - k:]])).map(lambda small: (big, small))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(BINARY), shapes.flatmap(_broadcast_pair), st.booleans(), st.sampled_from(DTYPES),
       st.sampled_from(DTYPES), layouts, layouts)
def test_broadcast_shortcut_matches_fake_propagation(target, pair, swap, d1, d2, l1, l2):
    mode = FakeTensorMode()
    big, small = _make(mode, pair[0], d1, l1), _make(mode, pair[1], d2, l2)
    _agrees(mode, target, (small, big) if swap else (big, small))


def test_shortcut_answers_the_common_cases_and_declines_the_rest():
    mode = FakeTensorMode()
    x = _make(mode, (2, 3, 4, 5), torch.float32, "contiguous")
    cl = _make(mode, (2, 3, 4, 5), torch.float32, "channels_last")
    assert _agrees(mode, aten.neg.default, (x,))
    assert _agrees(mode, aten.sub.Tensor, (x, x))
    assert _agrees(mode, aten.mul.Tensor, (cl, 0.5))
    assert _agrees(mode, aten.gelu.default, (x,), {"approximate": "tanh"})
    # one full-size contiguous operand and one that broadcasts to it (a bias): answered
    bias = _make(mode, (3, 1, 1), torch.float32, "contiguous")
    assert _agrees(mode, aten.add.Tensor, (x, bias))
    assert _agrees(mode, operator.mul, (_make(mode, (5,), torch.float32, "contiguous"), x))
    # both broadcast, broadcasting onto channels_last, promotion, in-place flags,
    # integer inputs to float ops: declined
    assert like_input(*_node(aten.add.Tensor, (_make(mode, (3, 1), torch.float32, "contiguous"),
                                               _make(mode, (1, 4), torch.float32, "contiguous")))) is None
    assert like_input(*_node(aten.add.Tensor, (cl, bias))) is None
    assert like_input(*_node(aten.add.Tensor, (x, _make(mode, (5,), torch.float16, "contiguous")))) is None
    assert like_input(*_node(aten.add.Tensor, (x, _make(mode, (2, 3, 4, 5), torch.float16, "contiguous")))) is None
    assert like_input(*_node(F.relu, (x, True))) is None
    assert like_input(*_node(aten.sigmoid.default, (_make(mode, (3,), torch.int64, "contiguous"),))) is None
    assert like_input(*_node(aten.div.Tensor, (x, x), {"rounding_mode": "floor"})) is None
    assert like_input(*_node(aten.add.Tensor, (x, cl))) is None  # different strides


FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
CASTS = [
    (aten.to.dtype, lambda d: ((d,), {})),
    (aten.to.dtype, lambda d: ((d, False, False), {})),
    (aten.to.dtype, lambda d: ((d,), {"memory_format": torch.preserve_format})),
    (aten._to_copy.default, lambda d: ((), {"dtype": d})),
    (aten._to_copy.default, lambda d: ((), {"dtype": d, "layout": torch.strided, "device": None})),
    (aten.to.dtype, lambda d: ((d,), {"memory_format": torch.contiguous_format})),  # declined
    (aten._to_copy.default, lambda d: ((), {"dtype": d, "device": torch.device("cpu")})),  # declined
    (aten.to.dtype, lambda d: ((d, False, True, torch.channels_last), {})),  # declined
]


@settings(max_examples=150, deadline=None)
@given(shape=shapes, layout=layouts, src=st.sampled_from(DTYPES), dst=st.sampled_from(DTYPES),
       which=st.integers(0, len(CASTS) - 1))
def test_cast_shortcut_gives_what_fake_propagation_gives(shape, layout, src, dst, which):
    """A cast's shortcut ``val`` has the real propagation's shape, strides, dtype and
    device, in fresh storage; it answers only for dense floating-to-floating casts
    that change the dtype and pass nothing that moves or re-lays the result."""
    from rewrite.engine.shapes import cast_of, fresh_cast

    mode = FakeTensorMode()
    x = _make(mode, shape, src, layout)
    target, extra = CASTS[which]
    args, kwargs = extra(dst)
    node, values = _node(target, (x, *args), kwargs)
    found = cast_of(node, values)
    if found is None:
        return
    assert which < 5 and src != dst and src.is_floating_point and dst.is_floating_point
    real = _real(mode, target, (x, *args), kwargs)
    got = fresh_cast(*found)
    assert (got.shape, got.stride(), got.dtype, got.device) == (real.shape, real.stride(), real.dtype, real.device)
    assert got.fake_mode is mode and got.untyped_storage() is not x.untyped_storage()


def test_cast_shortcut_answers_for_the_casts_amp_inserts():
    mode = FakeTensorMode()
    x = _make(mode, (2, 3, 4, 4), torch.float32, "channels_last")
    for target, (args, kwargs) in ((aten.to.dtype, ((torch.bfloat16,), {})),
                                   (aten._to_copy.default, ((), {"dtype": torch.float16}))):
        from rewrite.engine.shapes import cast_of

        node, values = _node(target, (x, *args), kwargs)
        assert cast_of(node, values) is not None
    same, _ = _node(aten.to.dtype, (x, torch.float32))  # to the same dtype: the input itself
    from rewrite.engine.shapes import cast_of

    assert cast_of(same, {same.args[0]: x}) is None


def _targets(numel: int):
    """Shapes with ``numel`` elements (one size may be -1), and some without."""
    factors = st.lists(st.sampled_from([1, 2, 3, 4]), max_size=4)

    def build(parts, free, wrong):
        sizes, rest = [], numel
        for p in parts:
            if rest % p == 0:
                sizes.append(p)
                rest //= p
        sizes.append(rest + (1 if wrong else 0))
        if free is not None:
            sizes[free % len(sizes)] = -1
        return sizes

    return st.builds(build, factors, st.none() | st.integers(0, 4), st.booleans())


@settings(max_examples=200, deadline=None)
@given(shape=shapes, layout=layouts, dtype=st.sampled_from(DTYPES), op=st.sampled_from([aten.view.default,
                                                                                        aten.reshape.default]),
       data=st.data())
def test_view_shortcut_gives_what_fake_propagation_gives(shape, layout, dtype, op, data):
    """A view's shortcut ``val`` has the real propagation's shape, strides, offset,
    dtype and device, and shares the input's storage as dispatch's does (what
    Inductor's reinplacing reads); it answers only for inputs with exactly the
    contiguous strides of their shape, and never for a shape the op refuses."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from rewrite.engine.shapes import fresh_view, view_of

    mode = FakeTensorMode()
    x = _make(mode, shape, dtype, layout)
    sizes = data.draw(_targets(x.numel()))
    node, values = _node(op, (x, sizes))
    found = view_of(node, values)
    if found is None:
        return
    assert x.is_contiguous() and x.numel() > 0
    real = _real(mode, op, (x, sizes), {})  # raises if the shortcut answered for a shape the op refuses
    got = fresh_view(*found)
    assert (got.shape, got.stride(), got.storage_offset(), got.dtype, got.device) == (
        real.shape, real.stride(), real.storage_offset(), real.dtype, real.device)
    assert got.fake_mode is mode
    assert StorageWeakRef(got.untyped_storage()) == StorageWeakRef(x.untyped_storage()) == StorageWeakRef(
        real.untyped_storage())


def test_view_shortcut_answers_for_contiguous_inputs_and_declines_the_rest():
    from rewrite.engine.shapes import view_of

    mode = FakeTensorMode()
    x = _make(mode, (2, 3, 4), torch.float32, "contiguous")
    assert view_of(*_node(aten.view.default, (x, [6, -1])))[1] == (6, 4)
    assert view_of(*_node(aten.reshape.default, (x, [24])))[1] == (24,)
    assert view_of(*_node(aten.view.default, (x, [5, -1]))) is None  # 24 is not a multiple of 5
    assert view_of(*_node(aten.view.default, (x, [-1, -1]))) is None
    assert view_of(*_node(aten.view.default, (_make(mode, (2, 3, 4), torch.float32, "transposed"), [24]))) is None
    assert view_of(*_node(aten._unsafe_view.default, (x, [24]))) is None  # not a view by its schema
