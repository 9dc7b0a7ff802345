"""Regressions found in session 48 by adversarial probes (each test's docstring
says what failed before)."""

import copy
import random

import numpy as np
import pytest
import torch
import torch.nn as nn

import rewrite


class _ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        return torch.relu(self.bn(self.c(x)))


@pytest.fixture
def inductor_freezing():
    import torch._inductor.config as inductor_config

    before = inductor_config.freezing
    inductor_config.freezing = True
    torch._dynamo.reset()
    try:
        yield
    finally:
        inductor_config.freezing = before
        torch._dynamo.reset()


def test_backend_sees_parameter_writes_under_inductor_freezing(inductor_freezing):
    """With ``torch._inductor.config.freezing = True`` dynamo hands the backend the
    parameters inside the graph (``get_attr``), not as inputs: the backend folded
    them once and kept the first weights after ``load_state_dict``, an in-place
    write and ``p.data = ...`` (errors of 2 to 21, no warning; probe CD F1)."""
    model = _ConvBN().eval()
    reference = copy.deepcopy(model)
    results = []
    compiled = torch.compile(model, backend=rewrite.backend(rewrite.load("rules/fusion.rw"),
                                                            on_result=results.append))
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), reference(x))
        assert results[0].counts and sum(results[0].counts.values()) >= 1  # the batch norm folded
        state = _ConvBN().state_dict()
        model.load_state_dict(state)
        reference.load_state_dict(state)
        torch.testing.assert_close(compiled(x), reference(x))
        model.c.weight.mul_(2)
        reference.c.weight.mul_(2)
        torch.testing.assert_close(compiled(x), reference(x))
        new = torch.randn_like(model.c.weight)
        model.c.weight.data = new
        reference.c.weight.data = new.clone()
        torch.testing.assert_close(compiled(x), reference(x))
    assert len(results) == 4  # rewritten again for each change, not fallen back


class _Accumulate(nn.Module):
    def __init__(self, init):
        super().__init__()
        self.register_buffer("buf", init.clone())

    def forward(self, x):
        self.buf.add_(x)  # an accumulator written in place...
        return self.buf[0]  # ...returned as a view of itself


@pytest.mark.parametrize("inplace", [False, True])
def test_check_compares_an_output_in_written_state_as_returned(inplace):
    """An output that is a view of a buffer the forward writes was compared after the
    state was put back for the next run: both models showed the restored zeros, and a
    rule returning the wrong row passed with "max abs error 0" (probe CG F2, high)."""
    x = torch.randn(2, 3)
    gm = torch.export.export(_Accumulate(torch.zeros(2, 3)), (x,)).module()
    wrong = rewrite.parse("rule wrong: select(b, 0, 0) => select(b, 0, 1)")
    with pytest.raises(rewrite.EquivalenceError, match="output"):
        wrong.apply(gm, example_inputs=(x,), inplace=inplace)
    # the right rewrite of the same graph still passes, sharing the buffer as before
    right = rewrite.parse("rule right: select(b, 0, 0) => select(b, 0, -2)")
    result = right.apply(gm, example_inputs=(x,))
    assert result.counts == {"right": 1}
    reference = _Accumulate(torch.zeros(2, 3))
    out = result.graph_module(x)
    torch.testing.assert_close(out, reference(x))
    assert out.untyped_storage().data_ptr() == result.graph_module.buf.untyped_storage().data_ptr()


def test_check_still_sees_an_output_newly_sharing_written_state():
    """Copies of state-memory outputs keep what they shared: a rewrite that returns the
    buffer's row itself where the original returned a copy of it still fails."""
    class Copying(_Accumulate):
        def forward(self, x):
            self.buf.add_(x)
            return self.buf[0].clone()

    from rewrite.trust.check import check_equivalence

    x = torch.randn(2, 3)
    report = check_equivalence(Copying(torch.zeros(2, 3)), _Accumulate(torch.zeros(2, 3)), (x,))
    assert not report.ok and "shares memory" in report.first_mismatch.message, report
    report = check_equivalence(_Accumulate(torch.zeros(2, 3)), Copying(torch.zeros(2, 3)), (x,))
    assert not report.ok and "shares memory" in report.first_mismatch.message, report
    assert check_equivalence(_Accumulate(torch.zeros(2, 3)), _Accumulate(torch.zeros(2, 3)), (x,)).ok


class _Sampler(nn.Module):
    def forward(self, scale: float):
        base = torch.ones(4) * scale
        u = torch.rand_like(base[0])  # a random decision inside the model
        return torch.where(u > 0.5, base * 2, base * 3)


def test_check_runs_repeated_inputs_of_a_model_drawing_random_numbers():
    """A trial whose inputs equal an earlier trial's was skipped as "cannot tell",
    but each trial runs from its own seed: for a model drawing random numbers a wrong
    rule (right for one draw only) passed with "2 trial(s) skipped" (probe CG F1)."""
    import torch.fx as fx

    gm = fx.symbolic_trace(_Sampler())
    with pytest.raises(rewrite.EquivalenceError, match="output"):
        rewrite.parse("rule wrong: torch.where(_, _, b) => b").apply(gm, example_inputs=(1.0,))
    # a model drawing nothing still skips them: its trials cannot differ
    class Fixed(nn.Module):
        def forward(self, scale: float):
            return torch.relu(torch.relu(torch.ones(4) * scale))

    result = rewrite.parse("rule rr: relu(relu(x)) => relu(x)").apply(fx.symbolic_trace(Fixed()),
                                                                       example_inputs=(1.0,))
    assert result.counts == {"rr": 1} and result.equivalence.skipped == 2


class _LockedHolder:
    def __init__(self):
        import threading

        self.lock = threading.Lock()  # deepcopy refuses it
        self.t = torch.ones(3)


class _ReadsHolder(nn.Module):
    def forward(self, x, o):
        return torch.relu(torch.relu(x)) + o.t


@pytest.mark.parametrize("inplace", [False, True])
def test_an_input_the_check_cannot_copy_is_refused_with_a_type_error(inplace):
    """An input object holding a tensor and a lock: the first deepcopy attempt failed
    halfway and left an emptied copy of its ``__dict__`` in the memo, which the second
    attempt handed out: the model got an object without attributes and the check
    blamed it (ModelRunError ... no attribute 't'), instead of the TypeError the README
    promises (probe CG F3)."""
    import torch.fx as fx

    gm = fx.symbolic_trace(_ReadsHolder())
    x, o = torch.randn(3), _LockedHolder()
    with pytest.raises(TypeError, match="cannot copy it"):
        rewrite.parse("rule rr: relu(relu(x)) => relu(x)").apply(gm, example_inputs=(x, o), inplace=inplace)
    assert gm.code.count("torch.relu(") == 2 and torch.equal(gm(x, o), torch.relu(x) + 1)  # nothing half-applied


class _TwoConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x):
        return torch.sigmoid(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))


def _index(graph):
    """The graph's find_nodes index, its non-empty entries in their order."""
    return {key: [n.name for n in nodes] for key, nodes in graph._find_nodes_lookup_table.table.items() if nodes}


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_failed_in_place_apply_puts_the_find_nodes_index_back(capture):
    """Rolled back, the nodes a rewrite erased came back last in the graph's
    find_nodes index: ``find_nodes(op="call_module", sort=False)`` listed c2, b2, c1,
    b1 where it listed c1, b1, c2, b2 (probe CG F4)."""
    import torch.fx as fx

    x = torch.randn(2, 3, 8, 8)
    model = _TwoConvBN().eval()
    gm = fx.symbolic_trace(model) if capture == "fx" else torch.export.export(model, (x,)).module()
    before, code = _index(gm.graph), gm.code
    rules = rewrite.load("rules/fusion.rw") + rewrite.parse("rule broken: sigmoid(x) => relu(x)")
    with pytest.raises(rewrite.EquivalenceError):
        rules.apply(gm, example_inputs=(x,), inplace=True)
    assert _index(gm.graph) == before
    assert gm.code == code


class _ConvConvRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, 2, 1)
        self.c2 = nn.Conv2d(8, 16, 3, 1, 1)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.c2(self.c1(x))).mean((2, 3)))


class _ConvBNNoBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn1(self.c1(x))).mean((2, 3)))


@pytest.mark.parametrize("model_class", [_ConvConvRelu, _ConvBNNoBias])
@pytest.mark.parametrize("capture", ["fx", "export"])
def test_an_int8_cnn_keeps_no_float_leftovers(model_class, capture):
    """``quantize`` of a symbolic_trace capture left the float conv ``c2`` on the int8
    model with its weight and without its bias (an earlier step replaced its call,
    the lowering folded the bias): ``print(int8)`` raised AttributeError and
    ``state_dict()`` held ``c2.weight`` (probe CF F1); an export capture kept the
    folded batch norm's ``num_batches_tracked``, which export fetches and nothing
    reads (CF F2). The README says an all-int8 model's state_dict is empty."""
    import rewrite.quant as rq

    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16)
    model = model_class().eval()
    int8 = rq.quantize(model, [x], example_inputs=(x,), capture=capture)
    assert "none left in float" in str(rq.coverage(int8))
    assert list(int8.state_dict()) == []
    repr(int8)  # every module left is whole
    assert not any(isinstance(m, (nn.Conv2d, nn.BatchNorm2d, nn.Linear)) for m in int8.modules())
    assert rq.sqnr(model(x), int8(x)) > 20


class _SmallNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.c(x)).mean((2, 3)))


def test_the_quant_steps_say_what_they_take():
    """Misused, the quantization API raised raw AttributeErrors (``coverage`` or
    ``accuracy_report`` given the float model, ``rewrite.qat.convert`` of a float
    model), reported every layer "not observed" for an observed model, took swapped
    arguments and prepared an observed or int8 model again; a NaN calibration said
    "saw no data" only (probe CF F3)."""
    import rewrite.qat as rqat
    import rewrite.quant as rq

    torch.manual_seed(0)
    model, x = _SmallNet().eval(), torch.randn(2, 3, 16, 16)
    observed = rq.prepare(model, (x,))
    rq.calibrate(observed, [x])
    int8 = rq.convert(observed)
    with pytest.raises(TypeError, match="coverage takes the int8 GraphModule"):
        rq.coverage(model)
    with pytest.raises(TypeError, match="not the observed model"):
        rq.coverage(observed)
    with pytest.raises(TypeError, match="observed model first"):
        rq.accuracy_report(int8, observed, [x])
    with pytest.raises(TypeError, match="accuracy_report takes the int8 GraphModule"):
        rq.accuracy_report(observed, model, [x])
    with pytest.raises(TypeError, match="already prepared"):
        rq.prepare(observed, (x,))
    with pytest.raises(TypeError, match="already converted"):
        rq.prepare(int8, (x,))
    with pytest.raises(rqat.QATError, match="prepare_qat returned"):
        rqat.convert(model)
    nan_observed = rq.prepare(model, (x,))
    rq.calibrate(nan_observed, [torch.full_like(x, float("nan"))])
    with pytest.raises(rq.QuantizationError, match="NaN"):
        rq.convert(nan_observed)
    assert "none left in float" in str(rq.coverage(int8))  # the right calls still work
    assert rq.accuracy_report(observed, int8, [x]).coverage is not None


_ACCUMULATOR = torch.zeros(3, 3)  # a module-level tensor a wrapped helper writes


@torch.fx.wrap
def _accumulate(x):
    _ACCUMULATOR.add_(x)
    return _ACCUMULATOR


class _GlobalRow(nn.Module):
    def forward(self, x):
        return _accumulate(x)[0]


class _ListCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.cache = [torch.zeros(3, 3)]  # a tensor the module keeps outside its buffers

    def forward(self, x):
        self.cache[0].add_(x)
        return self.cache[0]


def test_check_compares_an_output_in_memory_outside_the_model_as_returned():
    """Outputs in memory outside the model (a global a wrapped helper writes, a tensor
    a module keeps in a list) were compared after that memory was put back or written
    by the other model's run: a wrong rule passed with error 0 (probe CH F1, high)."""
    import torch.fx as fx

    from rewrite.trust.check import check_equivalence

    x = torch.randn(3, 3)
    with pytest.raises(rewrite.EquivalenceError, match="output"):
        rewrite.parse("rule wrong: getitem(b, 0) => getitem(b, 1)").apply(fx.symbolic_trace(_GlobalRow()),
                                                                          example_inputs=(x,))

    class Row(nn.Module):
        def __init__(self, i):
            super().__init__()
            self.leaf, self.i = _ListCache(), i

        def forward(self, x):
            return self.leaf(x)[self.i]

    assert not check_equivalence(Row(0), Row(1), (x,)).ok
    assert check_equivalence(Row(0), Row(0), (x,)).ok


def _threshold(draw, seed_with):
    """A threshold between the draw of the check's trial 0 (seed 0) and that of a later
    trial (seeds 1 and 2): the coin comes up differently in them."""
    seed_with(0)
    first = draw()
    later = []
    for seed in (1, 2):
        seed_with(seed)
        later.append(draw())
    other = max(later) if first < max(later) else min(later)
    return (first + other) / 2


_PY_THRESHOLD = _threshold(random.random, random.seed)
_NP_THRESHOLD = _threshold(np.random.rand, np.random.seed)


@torch.fx.wrap
def _python_coin(x):
    return torch.tensor(random.random() > _PY_THRESHOLD)


@torch.fx.wrap
def _numpy_coin(x):
    return torch.tensor(bool(np.random.rand() > _NP_THRESHOLD))


class _PythonSampler(nn.Module):
    def forward(self, scale: float):
        base = torch.ones(4) * scale
        return torch.where(_python_coin(base), base * 2, base * 3)


class _NumpySampler(nn.Module):
    def forward(self, scale: float):
        base = torch.ones(4) * scale
        return torch.where(_numpy_coin(base), base * 2, base * 3)


@pytest.mark.parametrize("model_class", [_PythonSampler, _NumpySampler])
@pytest.mark.parametrize("wrong", ["torch.where(_, _, b) => b", "torch.where(_, a, _) => a"])
def test_check_runs_repeated_inputs_of_a_model_drawing_from_python_or_numpy(model_class, wrong):
    """Only torch's generator told a model drawing random numbers: one drawing from
    Python's ``random`` or numpy's still had its repeated trials skipped, and a rule
    right for one draw passed (probe CH F2)."""
    import torch.fx as fx

    gm = fx.symbolic_trace(model_class())
    with pytest.raises(rewrite.EquivalenceError, match="output"):
        rewrite.parse(f"rule wrong: {wrong}").apply(gm, example_inputs=(1.0,))


def test_a_qat_model_is_no_int8_model_nor_a_float_one():
    """``coverage`` of ``prepare_qat``'s model said "no convs or linears", and
    ``prepare`` took it (its convert then had no int8 kernel) (probe CH F4)."""
    import rewrite.qat as rqat
    import rewrite.quant as rq

    torch.manual_seed(0)
    model, x = _SmallNet().eval(), torch.randn(2, 3, 16, 16)
    qat = rqat.prepare_qat(model, (x,), calibration=[x])
    with pytest.raises(TypeError, match="prepare_qat"):
        rq.coverage(qat)
    with pytest.raises(TypeError, match="prepared for QAT"):
        rq.prepare(qat, (x,))
    int8 = rqat.convert(qat)
    assert "none left in float" in str(rq.coverage(int8))


class _ReluTwice(nn.Module):
    def forward(self, x):
        a = torch.relu(torch.neg(torch.neg(x)))  # this relu is rewired to read x
        return torch.sigmoid(torch.relu(a * 2))


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_rollback_puts_a_rewired_node_back_in_its_index_place(capture):
    """A node whose arguments a rewrite rewired moved last in the find_nodes index
    when the rollback set them back (fx re-indexes a node on every attribute set):
    ``find_nodes(target=relu, sort=False)`` gave relu_1, relu (probe CH F3)."""
    import torch.fx as fx

    x = torch.randn(4)
    gm = fx.symbolic_trace(_ReluTwice()) if capture == "fx" else torch.export.export(_ReluTwice(), (x,)).module()
    before, code = _index(gm.graph), gm.code
    rules = rewrite.parse("rule negneg: neg(neg(x)) => x\nrule broken: sigmoid(x) => relu(x)")
    with pytest.raises(rewrite.EquivalenceError):
        rules.apply(gm, example_inputs=(x,), inplace=True)
    assert _index(gm.graph) == before and gm.code == code


def test_a_folded_batch_norm_of_an_export_graph_goes_whole():
    """Export fetches a batch norm's ``num_batches_tracked`` and never reads it: after
    the conv + batch norm fold the module stayed, holding it, and the result's
    state_dict had the key (probe CH F5)."""
    x = torch.randn(2, 3, 8, 8)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)).eval()
    gm = torch.export.export(model, (x,)).module()
    result = rewrite.load("rules/fusion.rw").apply(gm, example_inputs=(x,))
    assert sum(result.counts.values()) >= 1
    assert not any("1." in key for key in result.graph_module.state_dict())  # nothing of the batch norm
    assert "num_batches_tracked" not in result.graph_module.code
    torch.testing.assert_close(result.graph_module(x), model(x), atol=1e-5, rtol=1e-5)
    assert "num_batches_tracked" in gm.code  # the input keeps its own


class _ComplexAccumulate(nn.Module):
    def __init__(self, i=0, view="conj"):
        super().__init__()
        self.register_buffer("buf", torch.zeros(2, 3, dtype=torch.complex64))
        self.i, self.view = i, view

    def forward(self, x):
        self.buf.add_(torch.complex(x, x))
        row = self.buf[self.i]
        return row.conj() if self.view == "conj" else row.conj().imag  # lazy views of the buffer


@pytest.mark.parametrize("view", ["conj", "neg"])
def test_check_compares_a_lazy_view_of_written_state_as_returned(view):
    """A conjugate or negative-bit view of a written buffer was kept as it was by my
    first copy of state outputs, so still compared after the restore (probe CI F2)."""
    from rewrite.trust.check import check_equivalence

    x = torch.randn(2, 3)
    assert not check_equivalence(_ComplexAccumulate(0, view), _ComplexAccumulate(1, view), (x,)).ok
    assert check_equivalence(_ComplexAccumulate(0, view), _ComplexAccumulate(0, view), (x,)).ok


class _Unbound(nn.Module):
    def forward(self, x):
        return torch.relu(torch.relu(x)).unbind(0)


def test_check_of_many_outputs_over_one_memory():
    """Each of an ``unbind``'s rows was copied with its whole memory (quadratic: 640 MB
    for a 1.6 MB output); the rows now share one copy and still compare right."""
    import torch.fx as fx

    x = torch.randn(300, 50)
    result = rewrite.parse("rule rr: relu(relu(x)) => relu(x)").apply(fx.symbolic_trace(_Unbound()),
                                                                       example_inputs=(x,))
    assert result.counts == {"rr": 1} and len(result.graph_module(x)) == 300


class _DrawsWith(nn.Module):
    def forward(self, x, g):
        return torch.relu(torch.relu(x)) + torch.rand(x.shape, generator=g)


def test_a_generator_passed_as_an_input_is_the_checks_own_copy():
    """The check drew from the caller's ``torch.Generator`` itself: a correct rewrite
    was refused (the reference and the rewrite drew different numbers) and the
    caller's generator moved (probe CI F3)."""
    import torch.fx as fx

    x, g = torch.randn(4, 4), torch.Generator().manual_seed(3)
    state = g.get_state().clone()
    result = rewrite.parse("rule rr: relu(relu(x)) => relu(x)").apply(fx.symbolic_trace(_DrawsWith()),
                                                                       example_inputs=(x, g))
    assert result.counts == {"rr": 1}
    assert torch.equal(g.get_state(), state)


class _DetectionHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 6, 1)

    def forward(self, x):
        box, score = self.c2(torch.relu(self.c1(x))).split((4, 2), 1)
        return box, score.sigmoid()


def test_amp_keeps_a_channel_slice_of_a_channels_last_output_servable():
    """``amp_bf16.rw`` failed its own default check on a channels_last detection head:
    the box output, a channel slice of a channels_last conv output (strides (384, 1,
    48, 6)), came back as a row-major copy. A compact copy in the original's
    dimension order (channels_last) serves every view the slice serves, as a
    compact row-major copy of a row-major slice does: apply now makes that copy
    (probe CI F5)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    model = _DetectionHead().eval()
    gm = torch.export.export(model, (x,)).module()
    result = rewrite.load("rules/amp_bf16.rw").apply(gm, example_inputs=(x,), training=False)
    assert result.counts.get("conv_bf16", 0) + result.counts.get("conv_bf16_bias", 0) == 2
    box, score = result.graph_module(x)
    assert box.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(box, model(x)[0], atol=0.05, rtol=0.05)
