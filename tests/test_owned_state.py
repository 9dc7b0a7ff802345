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


class _Net(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x):
        return (self.block(x) + 1.0) * 1.0


def _hooked_net(block: nn.Module) -> nn.Module:
    """``block`` inside a model, hooked so the trace keeps it one call (a leaf module
    whose forward the library cannot read)."""
    model = _Net(block).eval()
    model.block.register_forward_hook(lambda m, i, o: None)
    return model


# -- probe CK (session 49): conj/neg views, overlapping memory blocks, containers,
# -- tensors that require grad, norms inside torch modules, module cycles

def _counter_graph(buffers: dict, written: str, read: str, read_imag: bool = False) -> fx.GraphModule:
    """A graph that writes ``written`` in place (a counter: the result owns a copy)
    and reads ``read`` into its output."""
    import operator

    root = nn.Module()
    for name, t in buffers.items():
        root.register_buffer(name, t)
    g = fx.Graph()
    x = g.placeholder("x")
    g.call_method("add_", (g.get_attr(written), 1 + 1j if buffers[written].is_complex() else 1))
    y = g.call_function(operator.mul, (g.call_function(operator.add, (x, 2.0)), 1.0))
    r = g.get_attr(read)
    if read_imag:
        r = g.call_function(torch.imag, (r,))
    g.output(g.call_function(operator.add, (y, g.call_method("sum", (r,)))))
    return fx.GraphModule(root, g)


@pytest.mark.parametrize("bit", ["conj", "neg"])
@pytest.mark.parametrize("check", [False, True])
def test_a_conjugate_or_negative_view_of_a_written_buffer_keeps_its_bit(bit, check):
    """``c = steps.conj()`` (or ``steps.conj().imag``, a negative view) re-made over
    the copy's memory was a plain view: the result read +imag where the input read
    -imag (and the check blamed the exact rule)."""
    def make():
        steps = torch.zeros(2, dtype=torch.complex64)
        view = steps.conj() if bit == "conj" else steps.conj().imag
        return _counter_graph({"steps": steps, "view": view}, "steps", "view", read_imag=bit == "conj")

    x = torch.randn(3)
    want = [make()(x) for _ in range(1)][0]
    gm = make()
    out = _apply(gm, x, check)
    assert out.view.is_conj() == gm.view.is_conj() and out.view.is_neg() == gm.view.is_neg()
    assert _storage(out.view) == _storage(out.steps) != _storage(gm.steps)
    assert torch.allclose(out(x), want)


def test_overlapping_memory_blocks_are_refused_not_miscopied():
    """``torch.from_numpy`` of an array and of its slice: two memory blocks over the
    same bytes. One copy per block would hold uninitialized memory or lose the
    sharing: apply refuses with a clear error, and leaves the input alone."""
    np = pytest.importorskip("numpy")
    x = torch.randn(3)
    for head, tail in ((slice(0, 2), slice(None)), (slice(6, None), slice(None))):
        values = np.arange(8, dtype=np.float32) + 100
        gm = _counter_graph({"part": torch.from_numpy(values[head]), "table": torch.from_numpy(values)},
                            "part", "table")
        before = gm.table.clone()
        for check in (False, True):
            with pytest.raises(ValueError, match="overlaps a tensor its forward writes"):
                rewrite.parse(MUL_ONE).apply(gm, (x,), check=check)
        assert torch.equal(gm.table, before)


def test_a_subclass_view_of_a_written_buffer_is_refused():
    class Sub(torch.Tensor):
        pass

    base = torch.zeros(4).as_subclass(Sub)
    gm = _counter_graph({"s": base, "v": base[1:3]}, "s", "v")
    with pytest.raises(ValueError, match="cannot keep which of its tensors share memory"):
        rewrite.parse(MUL_ONE).apply(gm, (torch.randn(3),), check=False)


@pytest.mark.parametrize("check", [False, True])
def test_tensors_a_leaf_module_keeps_in_a_list_or_dict_are_owned(check):
    """A hooked block (kept as one call) writing ``self.cache[0]`` and
    ``self.stats['n']``: the result's own list and dict held the caller's tensors,
    and every run of the result wrote them."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.cache = [torch.zeros(4)]
            self.stats = {"n": torch.zeros(()), "nested": (torch.zeros(2),)}

        def forward(self, x):
            y = self.lin(x)
            self.cache[0].add_(y.mean(0).detach())
            self.stats["n"].add_(1)
            self.stats["nested"][0].add_(1)
            return y

    model = _hooked_net(Block())
    x = torch.randn(5, 4)
    held = [model.block.cache[0], model.block.stats["n"], model.block.stats["nested"][0]]
    before = [t.clone() for t in held]
    result = rewrite.parse(MUL_ONE).apply(model, (x,), check=check)
    assert result.counts == {"mul_one": 1}
    out = result.graph_module
    out(x)
    out(x)
    assert all(torch.equal(t, b) for t, b in zip(held, before)), "running the result wrote the caller's tensors"
    mine = out.block
    assert mine.cache[0] is not held[0] and mine.stats["n"] is not held[1] and mine.stats["nested"][0] is not held[2]
    assert mine.stats["n"].item() == before[1].item() + 2
    assert model.block.stats["nested"][0] is held[2]  # the caller's nested tuple was not written either


@pytest.mark.parametrize("check", [False, True])
def test_a_tensor_that_requires_grad_stays_the_callers_when_writes_are_unknown(check):
    """A global forward hook (a profiler's) makes what the graph writes unknown: every
    buffer and plain tensor attribute is copied, but not one that requires grad
    (trained by the caller): it kept gradients and ``backward`` worked before."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.alpha = torch.ones(3, requires_grad=True)

        def forward(self, x):
            return self.lin(x) * 1.0 * self.alpha

    model = Scaled()
    gm = fx.symbolic_trace(model)
    x = torch.randn(2, 3)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        out = _apply(gm, x, check)
    finally:
        handle.remove()
    assert out.alpha.requires_grad
    out(x).sum().backward()
    assert gm.alpha.grad is not None  # the gradient reached the caller's tensor


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("check", [False, True])
def test_a_norm_inside_a_torch_module_called_whole_is_owned(mode, check):
    """``TransformerEncoder(..., norm=BatchNorm1d(n))`` is one call in the trace: its
    norm's statistics were neither seen as written (train mode: apply's own runs
    wrote the caller's) nor owned for ``result.train()``."""
    seq, width = 6, 8

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layer = nn.TransformerEncoderLayer(width, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 1, norm=nn.BatchNorm1d(seq), enable_nested_tensor=False)

        def forward(self, x):
            return self.enc(x * 1.0) * 1.0

    torch.manual_seed(0)
    model = Net().train(mode == "train")
    x = torch.randn(3, seq, width)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = rewrite.parse(MUL_ONE).apply(model, (x,), check=check)
    assert result.counts.get("mul_one", 0) >= 1
    out = result.graph_module
    out.train()
    out(x)
    after = model.state_dict()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    assert out.enc.norm.running_mean is not model.enc.norm.running_mean
    assert out.enc.layers[0].linear1.weight is model.enc.layers[0].linear1.weight  # weights stay shared


def test_meta_buffers_do_not_count_as_sharing_memory():
    """Every meta tensor's memory is at address 0: two meta buffers are not views of
    one memory (the smaller was re-made over the larger's storage when every buffer
    is copied)."""
    from rewrite.engine.workspace import own_written_state, shared_copy
    from rewrite.ops.reach import storage_key

    root = nn.Module()
    root.register_buffer("small", torch.empty(2, device="meta"))
    root.register_buffer("big", torch.empty(300, device="meta"))
    g = fx.Graph()
    x = g.placeholder("x")
    g.output((x, g.get_attr("small"), g.get_attr("big")))
    copy_ = shared_copy(fx.GraphModule(root, g))
    assert storage_key(copy_.small) is None
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)  # writes unknown
    try:
        assert own_written_state(copy_) == 2
    finally:
        handle.remove()
    assert copy_.small.untyped_storage().nbytes() == 8 and copy_.big.untyped_storage().nbytes() == 1200


def test_a_module_tree_with_a_cycle_is_refused_clearly():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            return self.lin(x) * 1.0

    model = Net()
    model.lin.owner = model
    with pytest.raises(ValueError, match="cycle in the module tree"):
        rewrite.parse(MUL_ONE).apply(model, (torch.randn(1, 2),))


# -- probe CL (session 49): regressions of the ownership changes

def _unknown_writes():
    """A global forward hook (a profiler's): what any graph writes is unknown."""
    return torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)


def test_a_frozen_rnns_parameters_stay_shared_when_writes_are_unknown():
    """``LSTM._flat_weights`` lists its parameters: with the writes unknown they were
    chosen from that list (they do not require grad) and copied, parameters included."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.LSTM(4, 4, batch_first=True)

        def forward(self, x):
            return self.rnn(x)[0] * 1.0

    gm = fx.symbolic_trace(Model().requires_grad_(False).eval())
    handle = _unknown_writes()
    try:
        out = rewrite.parse(MUL_ONE).apply(gm, (torch.randn(2, 3, 4),)).graph_module
    finally:
        handle.remove()
    theirs = dict(gm.named_parameters())
    assert all(p is theirs[name] for name, p in out.named_parameters())
    assert all(w is theirs[f"rnn.{name}"] for w, name in zip(out.rnn._flat_weights, out.rnn._flat_weights_names))


def test_a_buffer_viewing_a_trained_parameter_stays_shared_when_writes_are_unknown():
    """Copying it would copy the parameter's memory too: the gradient then missed the
    caller's weight."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.register_buffer("wt", self.lin.weight.detach().t())

        def forward(self, x):
            return self.lin(x) * 1.0 + x @ self.wt

    gm = fx.symbolic_trace(Model())
    x = torch.randn(2, 3)
    handle = _unknown_writes()
    try:
        out = _apply(gm, x, check=False)
    finally:
        handle.remove()
    assert out.lin.weight is gm.lin.weight
    out(x).sum().backward()
    assert gm.lin.weight.grad is not None


@pytest.mark.parametrize("kind", ["namedtuple", "dict subclass", "deque", "deep list"])
def test_tensors_in_other_containers_of_a_leaf_module_are_owned(kind):
    import collections

    Pair = collections.namedtuple("Pair", "total other")

    class Registry(dict):
        pass

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            t = torch.zeros(4)
            if kind == "namedtuple":
                self.held, self.get = Pair(t, 1), lambda h: h.total
            elif kind == "dict subclass":
                self.held, self.get = Registry(total=t), lambda h: h["total"]
            elif kind == "deque":
                self.held, self.get = collections.deque([t], maxlen=3), lambda h: h[0]
            else:
                self.held, self.get = [[[[[[t]]]]]], lambda h: h[0][0][0][0][0][0]

        def forward(self, x):
            y = self.lin(x)
            self.get(self.held).add_(1)
            return y

    model = _hooked_net(Block())
    theirs = model.block.get(model.block.held)
    x = torch.randn(2, 4)
    out = rewrite.parse(MUL_ONE).apply(model, (x,), check=True).graph_module
    out(x)
    assert theirs.sum().item() == 0, "running the result wrote the caller's tensor"
    mine = out.block.held
    assert type(mine) is type(model.block.held) and out.block.get(mine) is not theirs
    if kind == "deque":
        assert mine.maxlen == 3


def test_a_container_holding_itself_with_a_written_tensor_is_refused():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.c = [torch.zeros(4)]
            self.c.append(self.c)

        def forward(self, x):
            self.c[0].add_(1)
            return self.lin(x)

    model = _hooked_net(Block())
    with pytest.raises(ValueError, match="contains itself"):
        rewrite.parse(MUL_ONE).apply(model, (torch.randn(2, 4),), check=False)


# -- session 50: tensors a leaf module keeps in its own helper objects (probe CL F4)

class _Totals:
    """A plain state holder of the user's (no container, no module)."""

    def __init__(self) -> None:
        self.total = torch.zeros(4)
        self.inner = _Inner()
        self.calls = 0


class _Inner:
    def __init__(self) -> None:
        self.seen = torch.zeros(())


class _Slotted:
    __slots__ = ("total",)

    def __init__(self) -> None:
        self.total = torch.zeros(4)


class _HelperBlock(nn.Module):
    def __init__(self, holder) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.holder = holder

    def forward(self, x):
        y = self.lin(x)
        self.holder.total.add_(y.mean(0).detach())
        if isinstance(self.holder, _Totals):
            self.holder.inner.seen.add_(1)
            self.holder.calls += 1
        return y


class _TwoBlocks(nn.Module):
    def __init__(self, holder) -> None:
        super().__init__()
        self.a = _HelperBlock(holder)
        self.b = _HelperBlock(holder)

    def forward(self, x):
        return (self.b(self.a(x)) + 1.0) * 1.0


class _LeafTracer(fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return isinstance(m, _HelperBlock) or super().is_leaf_module(m, qualname)


@pytest.mark.parametrize("hooked", [False, True])
@pytest.mark.parametrize("check", [False, True])
def test_tensors_a_leaf_module_keeps_in_a_helper_object_are_owned(hooked, check):
    """``self.holder.total.add_(...)`` in a user's leaf module: the result kept the
    caller's holder, so every run of the result wrote the caller's tensors (writes
    known from the module's reach, or unknown under a hook). The result holds a copy
    of the holder, one for both modules sharing it, with its own tensors."""
    holder = _Totals()
    model = _TwoBlocks(holder).eval()
    if hooked:
        model.a.register_forward_hook(lambda m, i, o: None)
    gm = fx.GraphModule(model, _LeafTracer().trace(model))
    x = torch.randn(3, 4)
    result = rewrite.parse(MUL_ONE).apply(gm, (x,), check=check)
    assert result.counts == {"mul_one": 1}
    out = result.graph_module
    expected = _TwoBlocks(_Totals()).eval()
    expected.load_state_dict(model.state_dict())
    assert torch.equal(out(x), expected(x)) and torch.equal(out(x), expected(x))
    assert holder.total.abs().sum() == 0 and holder.inner.seen.item() == 0 and holder.calls == 0, \
        "running the result wrote the caller's holder"
    mine = out.a.holder
    assert mine is out.b.holder and mine is not holder and type(mine) is _Totals
    assert torch.equal(mine.total, expected.a.holder.total) and mine.inner.seen.item() == 4 and mine.calls == 4


def test_a_written_tensor_in_a_slotted_helper_is_refused_and_inplace_still_works():
    """An object with ``__slots__`` has no ``__dict__`` to rebuild: the copy cannot
    own its tensor, so apply refuses rather than return a result that writes it."""
    holder = _Slotted()
    model = _TwoBlocks(holder).eval()
    gm = fx.GraphModule(model, _LeafTracer().trace(model))
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="__slots__"):
        rewrite.parse(MUL_ONE).apply(gm, (x,), check=False)
    assert holder.total.abs().sum() == 0
    result = rewrite.parse(MUL_ONE).apply(gm, (x,), check=False, inplace=True)
    assert result.counts == {"mul_one": 1} and result.graph_module is gm


# -- session 50: a user's subclass of a torch module that adds nothing that runs (probe CL F6)

class _PlainLayer(nn.TransformerEncoderLayer):
    """Torch's layer under the user's name: its forward is torch's."""


class _OwnNorm(nn.BatchNorm1d):
    def __init__(self, channels: int) -> None:
        super().__init__(channels)


class _BiasWriter(nn.Linear):
    """Overrides forward, writing its own bias: the user's code."""

    def forward(self, x):
        with torch.no_grad():
            self.bias.add_(1.0)
        return super().forward(x)


class _Subclassed(nn.Module):
    def __init__(self, layer: nn.Module, norm: nn.Module) -> None:
        super().__init__()
        self.layer, self.norm = layer, norm

    def forward(self, x):
        return self.norm(self.layer(x) * 1.0)


class _SubclassTracer(fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return isinstance(m, (_PlainLayer, _OwnNorm, _BiasWriter, nn.TransformerEncoder)) \
            or super().is_leaf_module(m, qualname)


@pytest.mark.parametrize("whole", [False, True])
def test_a_subclass_of_a_torch_layer_adding_nothing_keeps_the_callers_weights(whole):
    """``TransformerEncoder`` of (or a leaf) ``class MyLayer(TransformerEncoderLayer): pass``
    counted as the user's code: every weight was copied into the result, so gradients
    of the result missed the caller's parameters. Now its weights stay shared and
    only the norm's running statistics are the result's own."""
    torch.manual_seed(0)
    layer = _PlainLayer(8, 2, 16, dropout=0.0, batch_first=True)
    if whole:
        layer = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    model = _Subclassed(layer, _OwnNorm(3)).train()
    gm = fx.GraphModule(model, _SubclassTracer().trace(model))
    x = torch.randn(2, 3, 8)
    result = rewrite.parse(MUL_ONE).apply(gm, (x,), check=True)
    assert result.counts == {"mul_one": 1}
    out = result.graph_module
    assert out.norm.weight is model.norm.weight and out.norm.running_mean is not model.norm.running_mean
    statistics = model.norm.running_mean.clone()
    out(x).square().sum().backward()
    assert torch.equal(model.norm.running_mean, statistics), "the result's run wrote the caller's statistics"
    assert all(p.grad is not None for p in model.layer.parameters()), "gradients missed the caller's weights"


def test_a_subclass_overriding_forward_is_still_the_users_code():
    """The same rule does not reach a subclass with a forward of its own: it writes its
    bias, and the result must write its own copy."""
    from rewrite.ops.effects import code_class

    assert code_class(_PlainLayer) is nn.TransformerEncoderLayer and code_class(_OwnNorm) is nn.BatchNorm1d
    assert code_class(_BiasWriter) is _BiasWriter
    model = _Subclassed(_BiasWriter(4, 4), nn.Identity()).eval()
    gm = fx.GraphModule(model, _SubclassTracer().trace(model))
    x = torch.randn(2, 4)
    bias = model.layer.bias.detach().clone()
    out = rewrite.parse(MUL_ONE).apply(gm, (x,), check=False).graph_module
    out(x)
    assert torch.equal(model.layer.bias, bias), "running the result wrote the caller's bias"


def test_a_transposed_quantized_buffer_copied_when_writes_are_unknown_keeps_its_strides():
    """A hook hides what the block writes, so its buffers are copied: a quantized
    ``clone`` comes back contiguous, and the result's transposed buffer lost its
    strides (probe CK f6a)."""
    import warnings

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                q = torch.quantize_per_tensor(torch.randn(3, 4), 0.1, 0, torch.qint8)
            self.register_buffer("q", q.t())

        def forward(self, x):
            return x @ self.q.dequantize()

    model = _hooked_net(Block())
    x = torch.randn(2, 4)
    out = rewrite.parse(MUL_ONE).apply(model, (x,), check=True).graph_module
    mine, theirs = out.block.q, model.block.q
    assert mine is not theirs and mine.stride() == theirs.stride() == (1, 4)
    assert torch.equal(mine.dequantize(), theirs.dequantize()) and torch.equal(out(x), model(x))


# -- session 50, probe CP: holders whose copy shares state, globals, modules reached
# -- through helpers, SimpleNamespace holders, a class patched after a first apply

class _SelfCopying(_Totals):
    def __copy__(self):
        return self


def test_a_holder_whose_copy_is_itself_is_refused_not_written_through():
    """``copy.copy`` of it is the caller's object: the result's copies of its tensors
    were written into the caller's holder."""
    holder = _SelfCopying()
    model = _TwoBlocks(holder).eval()
    gm = fx.GraphModule(model, _LeafTracer().trace(model))
    total = holder.total
    with pytest.raises(ValueError, match="shares its state"):
        rewrite.parse(MUL_ONE).apply(gm, (torch.randn(3, 4),), check=False)
    assert holder.total is total and holder.total.abs().sum() == 0


def test_a_simple_namespace_holder_is_owned():
    import types

    holder = types.SimpleNamespace(total=torch.zeros(4))
    model = _TwoBlocks(holder).eval()
    gm = fx.GraphModule(model, _LeafTracer().trace(model))
    x = torch.randn(3, 4)
    out = rewrite.parse(MUL_ONE).apply(gm, (x,), check=True).graph_module
    out(x)
    assert holder.total.abs().sum() == 0 and out.a.holder is not holder and out.a.holder.total.abs().sum() > 0


_GLOBAL_CALLS = torch.zeros(())


class _GlobalCounter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        _GLOBAL_CALLS.add_(1)
        return self.lin(x)


class _GlobalCounterTracer(fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return isinstance(m, _GlobalCounter) or super().is_leaf_module(m, qualname)


def test_a_global_a_leaf_module_writes_is_not_a_reason_to_refuse():
    """The result and the caller share a module-level tensor either way: the first
    version of the unreachable-tensor refusal walked the forward's globals too."""
    model = _Net(_GlobalCounter()).eval()
    gm = fx.GraphModule(model, _GlobalCounterTracer().trace(model))
    result = rewrite.parse(MUL_ONE).apply(gm, (torch.randn(3, 4),), check=False)
    assert result.counts == {"mul_one": 1}


class _Owner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))


class _Context:
    def __init__(self, owner: nn.Module) -> None:
        self.owner = owner


class _ReachesOwner(nn.Module):
    def __init__(self, context: _Context) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.context = context

    def forward(self, x):
        self.context.owner.calls.add_(1)
        return self.lin(x)


class _OwnerNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.counter = _Owner()
        self.block = _ReachesOwner(_Context(self.counter))

    def forward(self, x):
        return (self.block(x) + self.counter.calls) * 1.0


class _OwnerTracer(fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return isinstance(m, _ReachesOwner) or super().is_leaf_module(m, qualname)


def test_a_module_reached_through_a_helper_with_a_written_buffer_is_refused():
    """The result owned ``counter.calls`` in its own module tree, but the helper still
    pointed at the caller's module: running the result wrote the caller's buffer, and
    its graph read a copy that never changed."""
    model = _OwnerNet().eval()
    gm = fx.GraphModule(model, _OwnerTracer().trace(model))
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="through another module"):
        rewrite.parse(MUL_ONE).apply(gm, (x,), check=False)
    assert model.counter.calls.item() == 0
    result = rewrite.parse(MUL_ONE).apply(gm, (x,), check=False, inplace=True)
    assert result.counts == {"mul_one": 1}


def test_a_subclass_patched_after_a_first_apply_is_read_again():
    """``code_class`` answered once per class: a subclass judged torch's before its
    ``forward`` was patched stayed torch's, and apply's runs wrote the caller's buffer."""
    from rewrite.ops.effects import code_class

    class Patched(nn.Linear):
        pass

    assert code_class(Patched) is nn.Linear

    def counting(self, x):
        with torch.no_grad():
            self.bias.add_(1.0)
        return nn.functional.linear(x, self.weight, self.bias)

    Patched.forward = counting
    assert code_class(Patched) is Patched
