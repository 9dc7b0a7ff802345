"""Regressions from session 38's adversarial probes and open items. Each test
failed before its fix."""
import operator

import pytest
import torch
import torch.nn as nn
from torch.export import Dim

import rewrite
from rewrite.trust.sizes import DECLARED_RANGES, smallest_sizes


class _Reshape(nn.Module):
    def forward(self, x):
        return x.reshape(-1) * 2


@pytest.mark.parametrize("dim, given_ep, batch", [
    ({}, True, 1),  # Dim's default min is 0: the smallest size tried stays 1
    ({"min": 1}, True, 1),
    ({"min": 2}, True, 2),  # declared in ep.range_constraints, not enforced by ep.module()
    ({"min": 2}, False, 1),  # ep.module() alone: the ShapeEnv's 2 says nothing
    ({"min": 3}, False, 3),  # the ShapeEnv's bound above 2 is the Dim's own
    ({"min": 5, "max": 9}, True, 5),
])
def test_the_smallest_sizes_are_the_declared_minimum(dim, given_ep, batch):
    """Session 37's open item: every size symbol was tried at 1, below a declared
    ``Dim(min=3)`` (which the module refuses, so the trial was skipped) and below
    ``Dim(min=2)`` (which it does not refuse, so the check held the program to sizes
    it is not declared for)."""
    x = torch.randn(6, 3)
    ep = torch.export.export(_Reshape(), (x,), dynamic_shapes=({0: Dim("B", **dim)},))
    gm = ep.module()
    if given_ep:
        gm.meta[DECLARED_RANGES] = dict(ep.range_constraints)
    assert smallest_sizes(gm, (x,))[0].shape == (batch, 3)


def test_apply_given_the_exported_program_tries_its_declared_minimum():
    class M(nn.Module):  # row 1 exists only from a batch of 2
        def forward(self, x):
            return -(-x) * x[1]

    x = torch.randn(4, 3)
    ep = torch.export.export(M(), (x,), dynamic_shapes=({0: Dim("B", min=2, max=64)},))
    rules = rewrite.load("rules/cleanup.rw")
    from_module = rules.apply(ep.module(), example_inputs=(x,))
    assert from_module.equivalence.ok and from_module.equivalence.skipped == 1  # batch 1: refused
    from_program = rules.apply(ep, example_inputs=(x,))
    assert from_program.counts == {"neg_neg": 1}
    assert from_program.equivalence.ok and from_program.equivalence.skipped == 0  # batch 2 ran
    assert from_program.equivalence.trials == from_module.equivalence.trials
    out = from_program.graph_module(x)
    torch.testing.assert_close(out, M()(x))


class _AttentionAndViews(nn.Module):
    """A written-out attention returned together with views of it."""

    def __init__(self, views):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.views = views

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 4).permute(2, 0, 3, 1, 4)
        out = torch.softmax(q @ k.transpose(-2, -1) * 0.5, dim=-1) @ v
        if self.views == "transpose":
            return out, out.transpose(1, 2)
        if self.views == "flat":  # view reads strides: the rule does not fire
            return out.view(b, -1), out[0]
        if self.views == "select":
            return out[:, 1], out.unsqueeze(0), out
        if self.views == "two_transposes":  # transformer.rw rebuilds transpose(2, 3)
            return out.transpose(1, 2), out.transpose(2, 3)
        if self.views == "slice_and_transpose":
            return out[:, :, 1:], out.transpose(2, 3)
        return out.transpose(1, 2).reshape(b, n, 16), out


def _shares(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("views", ["transpose", "flat", "reshape", "select"])
@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("check", [False, True])
def test_outputs_sharing_an_sdpa_result_keep_their_layouts(views, capture, check):
    """Probe AC F3 (session 37): ``return out, out.transpose(1, 2)`` after
    transformer.rw made the attention sdpa (its CPU kernel lays the result out as
    the permuted query): both outputs' strides changed with check=False (the check
    refused the rewrite), since a copy of either output would end their sharing.
    The sdpa result is now copied back into the matmul's layout before they view it."""
    torch.manual_seed(0)
    model = _AttentionAndViews(views).eval()
    x = torch.randn(2, 5, 16)
    gm = torch.fx.symbolic_trace(model) if capture == "fx" else torch.export.export(model, (x,)).module()
    result = rewrite.load("rules/transformer.rw").apply(gm, example_inputs=(x,), check=check)
    fired = result.counts.get("attention_scale") == 1
    assert fired or views == "flat" or (views == "reshape" and capture == "export")
    targets = [str(n.target) for n in result.graph_module.graph.nodes]
    assert fired == any("scaled_dot_product_attention" in t for t in targets)
    x2 = torch.randn(2, 5, 16)
    want, got = model(x2), result.graph_module(x2)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        assert b.stride() == a.stride() and b.storage_offset() == a.storage_offset()
    for i in range(len(want)):
        for j in range(i):
            assert _shares(got[i], got[j]) == _shares(want[i], want[j])


class _NegNeg(nn.Module):
    def forward(self, x):
        return -(-x) + 1


@pytest.mark.parametrize("replacement, why", [
    ("Tensor.new_ones(x, [4])", "shape [4] is not the root"),
    ("matmul(x, x)", "shape [] is not the root"),
    ("Tensor.to(x, torch.float64)", "dtype torch.float64 is not the root's torch.float32"),
    ("add(x, Tensor.new_ones(x, [4]))", "cannot be computed on the root's inputs: RuntimeError"),
])
@pytest.mark.parametrize("capture", ["export", "dynamo"])
def test_a_replacement_known_unlike_its_root_does_not_fire(replacement, why, capture):
    """A rule whose replacement has another shape or dtype than the value it
    replaces, or cannot run at all, rewrote export graphs with check=False into
    models that return other shapes or raise: the root's facts were known, the
    replacement's inferred only after the rewrite."""
    x = torch.randn(3)
    if capture == "export":
        gm = torch.export.export(_NegNeg(), (x,)).module()
    else:
        gm = torch._dynamo.export(_NegNeg())(x).graph_module
    rules = rewrite.parse(f"rule r: neg(neg(x)) => {replacement}")
    result = rules.apply(gm, (x,), check=False)
    assert result.counts == {}
    assert why in result.stats["r"].first_error
    torch.testing.assert_close(result.graph_module(x), _NegNeg()(x))


def test_a_replacement_like_its_root_still_fires_with_symbolic_sizes():
    x = torch.randn(4, 3)
    gm = torch.export.export(_NegNeg(), (x,), dynamic_shapes=({0: Dim("B")},)).module()
    rules = rewrite.parse("rule r: neg(neg(x)) => mul(x, Tensor.new_ones(x, [3]))\n"
                          "rule s: add(x, 1) => sub(x, -1)")
    result = rules.apply(gm, (x,), check=False)
    assert result.counts == {"r": 1, "s": 1}
    y = torch.randn(7, 3)
    torch.testing.assert_close(result.graph_module(y), _NegNeg()(y))


def test_a_forwarded_value_of_another_dtype_does_not_fire():
    class Scaled(nn.Module):
        def forward(self, h):
            return h * 1.0  # int64 in, float32 out

    h = torch.arange(6)
    gm = torch.export.export(Scaled(), (h,)).module()
    rules = rewrite.parse("rule r: mul(x, 1) where dtype(x) == torch.int64 => x")
    result = rules.apply(gm, (h,), check=False)
    assert result.counts == {}
    assert "dtype torch.int64 is not the root's torch.float32" in result.stats["r"].first_error
    assert result.graph_module(h).dtype == torch.float32


class _WritesAnAttribute(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.offset = torch.zeros(4)  # a plain tensor attribute, no buffer

    def forward(self, x):
        self.offset.add_(1)
        with torch.no_grad():
            self.lin.weight.mul_(0.5)
        return self.lin(x) + self.offset


@pytest.mark.parametrize("level", ["export", "dynamo"])
def test_capturing_leaves_the_callers_tensors_as_they_were(level):
    """Probe AD F3: a non-strict export and dynamo's recording run execute the
    forward for real; its in-place writes into a plain tensor attribute (both) and
    into a parameter (dynamo) stayed in the caller's model."""
    from rewrite.capture import capture_with_inputs

    torch.manual_seed(0)
    model = _WritesAnAttribute().eval()
    before = model.lin.weight.detach().clone()
    gm, _ = capture_with_inputs(model, (torch.randn(3, 4),), level)
    assert any(n.op == "call_function" for n in gm.graph.nodes)
    assert torch.equal(model.offset, torch.zeros(4))
    assert torch.equal(model.lin.weight, before)


def test_a_user_input_named_like_module_state_is_not_frozen():
    """Probe AD F10: the backend froze an argument whose name held ``_parameters``
    (a functional-style step's weights) into constants: after the caller updated
    them in place, the compiled function returned the old weights' results."""
    from torch.func import functional_call

    from rewrite.capture import capture_with_inputs, lifted_state_positions

    torch._dynamo.reset()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()

    def step(x, model_parameters):
        return functional_call(net, model_parameters, (x,))

    weights = {k: v.detach().clone() for k, v in net.state_dict().items()}
    compiled = torch.compile(step, backend=rewrite.backend(rewrite.load("rules/fusion.rw")))
    x = torch.randn(1, 3, 6, 6)
    with torch.no_grad():
        compiled(x, weights)
        for v in weights.values():
            if v.is_floating_point():
                v.mul_(1.5)
        torch.testing.assert_close(compiled(x, weights), step(x, weights))
    torch._dynamo.reset()

    class Adds(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, extra_buffers):
            return self.lin(x) + extra_buffers

    gm, _ = capture_with_inputs(Adds(), (torch.randn(2, 4), torch.randn(2, 4)), "dynamo")
    assert lifted_state_positions(gm) == (0, 1)  # the Linear's weight and bias, not extra_buffers


def test_an_inductor_pass_calling_a_users_function_is_never_cached():
    """Probe AD F6: ``uuid()`` hashed the rule texts and the package's sources, not
    the registered functions a rule calls: after the user's predicate changed,
    Inductor's on-disk graph cache served the graph the old predicate rewrote."""
    from rewrite.functions import registry

    @rewrite.register_predicate(name="s38_gate")
    def s38_gate(x):
        return True

    try:
        gated = rewrite.parse("rule r: relu(x) where s38_gate(x) => sigmoid(x)")
        plain = rewrite.parse("rule r: relu(x) => sigmoid(x)")
        assert rewrite.inductor_pass(gated).uuid() is None
        assert isinstance(rewrite.inductor_pass(plain).uuid(), str)
        builtin = rewrite.parse("rule r: relu(x) where single_use(x) => sigmoid(x)")
        assert isinstance(rewrite.inductor_pass(builtin).uuid(), str)  # the package's own: hashed
    finally:
        registry._REGISTRY.pop("s38_gate", None)


def test_a_dynamic_dynamo_graph_is_measured_at_the_sizes_its_symints_stand_for():
    """Probe AD F2: ``result.report()`` (``analyze``) on a graph dynamo recompiled for
    a second batch size ran it with the SymInt itself: a traceback from inside torch."""
    from rewrite.analysis import analyze

    flops = []

    def backend(gm, example_inputs):
        flops.append(analyze(gm, tuple(example_inputs)).totals.flops)
        return gm.forward

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 6)

        def forward(self, x):
            return torch.relu(self.lin(x)).reshape(x.shape[0], -1) * 1.0

    torch._dynamo.reset()
    compiled = torch.compile(M().eval(), backend=backend)
    with torch.no_grad():
        compiled(torch.randn(2, 3, 4))
        compiled(torch.randn(5, 3, 4))  # a SymInt among the inputs
    torch._dynamo.reset()
    assert flops == [2 * 2 * 3 * 4 * 6, 2 * 5 * 3 * 4 * 6]


def test_saving_over_a_file_keeps_its_permissions(tmp_path):
    """Probe AD F9: a private (0600) file saved over became world-readable (0644)."""
    import os
    import stat

    from rewrite.capture import save

    x = torch.randn(3)
    for name, level in (("m.pt", "fx"), ("m.pt2", "export")):
        path = tmp_path / name
        path.write_bytes(b"")
        os.chmod(path, 0o600)
        save(torch.fx.symbolic_trace(_NegNeg()), path, example_inputs=(x,), level=level)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    fresh = save(torch.fx.symbolic_trace(_NegNeg()), tmp_path / "new.pt", example_inputs=(x,), level="fx")
    assert stat.S_IMODE(os.stat(fresh).st_mode) != 0o600  # a new file: the umask's, not mkstemp's


def test_saving_an_int8_result_as_pt2_names_the_kernel_and_the_way_out(tmp_path):
    """Probe AD F5: ``save(int8, "m.pt2", level="export")`` failed with torch's
    message about a TorchScript class, no node and no hint (``rq.export`` gave both)."""
    import rewrite.quant as rq
    from rewrite.capture import ExportError, save

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = nn.Conv2d(3, 8, 3, padding=1)

        def forward(self, x):
            return torch.relu(self.c1(x)).mean((2, 3))

    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    observed = rq.prepare(Net().eval(), (x,))
    rq.calibrate(observed, [(torch.randn(2, 3, 8, 8),)])
    int8 = rq.convert(observed)
    with pytest.raises(ExportError, match="form='qdq'") as err:
        save(int8, tmp_path / "int8.pt2", level="export", example_inputs=(x,))
    assert err.value.node is not None and err.value.node.op == "call_module"
    assert not (tmp_path / "int8.pt2").exists()


class _Scaled(nn.Module):
    """Takes an int, which torch.export makes a constant of the program."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, n: int = 3):
        return self.lin(x) * n


def test_onnx_runs_on_the_inputs_it_was_exported_with(tmp_path):
    """Probe AD F8: a model taking an int (``forward(x, n=3)``) exported to ONNX,
    whose program bakes ``n`` in; ``run_onnx`` fed the int too and failed, and so did
    ``rewrite quantize --onnx``'s own comparison (exit 1)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    import rewrite.quant as rq

    torch.manual_seed(0)
    model, inputs = _Scaled().eval(), (torch.randn(2, 4), 3)
    qdq = rq.quantize(model, [inputs], form="qdq")
    path = tmp_path / "m.onnx"
    rq.export_onnx(qdq, inputs, path)
    (out,) = rq.run_onnx(path, inputs)
    assert rq.sqnr(model(*inputs), out) > 20


def test_the_narrowing_estimate_narrows_core_aten_convolutions():
    """Probe AE F3: the check's allowance for new bfloat16 comes from running the
    reference under ``torch.autocast``, which narrows ``conv2d`` but not the core
    ``aten.convolution`` an ``export_core`` graph holds: no allowance there, and the
    AMP files failed their own check on a BiT that passes at ``export``."""
    from rewrite.trust.precision import narrowed_run

    conv = nn.Conv2d(3, 8, 3).eval()
    x = torch.randn(1, 3, 16, 16)
    core = torch.export.export(conv, (x,)).run_decompositions().module()
    assert any(n.target is torch.ops.aten.convolution.default for n in core.graph.nodes)
    with torch.no_grad():
        exact = conv(x)
        eager = narrowed_run(conv, (x,), 0, torch.bfloat16)
        narrowed = narrowed_run(core, (x.clone(),), 0, torch.bfloat16)
    assert eager.dtype == narrowed.dtype == torch.bfloat16
    assert not torch.equal(narrowed.float(), exact)
    torch.testing.assert_close(narrowed, eager)


def test_amp_passes_its_own_check_on_a_core_aten_bit():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BitConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                                 num_groups=8)
    model = transformers.BitModel(cfg).eval()
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    core = torch.export.export(model, (x,), strict=False).run_decompositions().module()
    result = rewrite.load("rules/amp_bf16.rw").apply(core, example_inputs=(x,))
    assert result.counts.get("conv_bf16_nobias", 0) > 0 and result.equivalence.ok
    with torch.no_grad():
        want = model(x).last_hidden_state
        got = result.graph_module(x).last_hidden_state
    assert got.dtype == want.dtype and ((got - want).abs().max() / want.abs().max()) < 0.1


def test_static_dtypes_of_a_dynamo_graph_that_sets_items():
    """Probe AE F2: dynamo records no value for ``t[i] = v`` (nor for torch's usage
    logging): the graph's dtypes were unknown, so the backend's in-place check
    prepared no allowance for the bfloat16 AMP brings, and failed a tiny Mixtral."""
    from rewrite.trust.check import static_float_dtypes

    seen = []

    def backend(gm, example_inputs):
        seen.append((static_float_dtypes(gm), any(n.target is operator.setitem for n in gm.graph.nodes)))
        return gm.forward

    class SetsItems(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, index):
            out = torch.zeros_like(x)
            out[index] = self.lin(x[index])
            return out

    torch._dynamo.reset()
    torch.compile(SetsItems().eval(), backend=backend)(torch.randn(5, 4), torch.tensor([0, 2]))
    torch._dynamo.reset()
    assert seen == [(frozenset({torch.float32}), True)]


def test_amp_passes_its_own_check_on_a_mixtral_under_torch_compile():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64, num_key_value_heads=1,
                                     use_cache=False, num_local_experts=4, num_experts_per_tok=2)
    cfg._attn_implementation = "eager"
    model = transformers.MixtralModel(cfg).eval()
    ids = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(1))
    counts = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=rewrite.backend("rules/amp_bf16.rw",
                                                            on_result=lambda r: counts.append(r.counts)))
    with torch.no_grad():
        got = compiled(ids).last_hidden_state
        want = model(ids).last_hidden_state
    torch._dynamo.reset()
    assert any(c.get("linear_bf16", 0) > 0 for c in counts)
    assert ((got - want).abs().max() / want.abs().max()) < 0.1


@pytest.mark.parametrize("training, kept", [(None, 4), (True, 4), (False, 0)])
def test_apply_can_be_told_an_export_graph_is_trained(training, kept):
    """Probe AE F1: a train-mode model without dropout or batch norm exports to a
    graph that looks like inference (the exported module is always in training
    mode), and AMP folded its weights into bfloat16 constants: no gradient reached
    them. Since session 39 such a graph may train unless told (``training=False``):
    the weights are cast at run time (tests/test_training_mode.py)."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).train()
    x = torch.randn(2, 8)
    gm = torch.export.export(mlp, (x,)).module()
    result = rewrite.load("rules/amp_bf16.rw").apply(gm, example_inputs=(x,), training=training)
    assert result.counts
    params = list(gm.parameters())
    grads = torch.autograd.grad(result.graph_module(x).float().pow(2).mean(), params, allow_unused=True)
    assert sum(g is not None for g in grads) == kept
    with pytest.raises(TypeError, match="training must be True or False"):
        rewrite.load("rules/amp_bf16.rw").apply(gm, example_inputs=(x,), training="yes")


@pytest.mark.parametrize("replacement, param, size", [
    ("add(x, Tensor.new_zeros(x, [-5]))", "size", -5),
    ("add(x, Tensor.new_ones(x, [3, -2]))", "size", -2),
    ("Tensor.repeat(x, [-1])", "repeats", -1),
    ("Tensor.view(x, [-2])", "shape", -2),
])
def test_a_negative_literal_size_is_refused_at_load(replacement, param, size):
    """Session 37's open item: ``new_zeros(x, [-5])`` loaded, and on a graph without
    facts (symbolic_trace) fired into a model that raises on every call."""
    with pytest.raises(rewrite.RuleError) as err:
        rewrite.parse(f"rule r: neg(neg(x)) => {replacement}")
    assert "[E207]" in str(err.value) and f"argument '{param}'" in str(err.value) and f"size {size}" in str(err.value)


def test_the_inferred_size_and_negative_ends_still_load():
    rewrite.parse("rule a: neg(neg(x)) => reshape(x, [-1])\n"
                  "rule b: neg(neg(x)) => Tensor.expand(x, [-1])\n"
                  "rule c: neg(neg(x)) => Tensor.view(x, [2, -1])")


def test_a_function_redefined_under_its_name_warns_and_the_same_source_again_does_not():
    """Probe AC F4 (session 37): a function defined again in the same module, under
    the same name but with another body, replaced the registered one silently (as a
    module imported again must: same source)."""
    import warnings

    from rewrite.functions import registry

    source = "def s38_twice(x):\n    return {body}\n"
    namespace = {"__name__": "s38_user_module"}
    try:
        exec(source.format(body="True"), namespace)
        rewrite.register_predicate()(namespace["s38_twice"])
        exec(source.format(body="True"), namespace)  # the module imported again
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            rewrite.register_predicate()(namespace["s38_twice"])
        exec(source.format(body="False"), namespace)  # redefined
        with pytest.warns(UserWarning, match="'s38_twice' replaces"):
            rewrite.register_predicate()(namespace["s38_twice"])
    finally:
        registry._REGISTRY.pop("s38_twice", None)


def test_a_dynamo_graph_taking_its_sizes_as_inputs_gets_the_smallest_sizes_trial():
    """Session 37's open item: a dynamo graph recompiled with symbolic sizes takes
    them as SymInt inputs; the smallest-sizes trial left such graphs out, since the
    size inputs would have to shrink with the tensors. Now they do."""
    from rewrite.engine.symbolic import size_hint

    trials = []

    class M(nn.Module):
        def forward(self, x):
            return (x * 2).reshape(x.shape[0], -1)

    def backend(gm, example_inputs):
        inputs = tuple(size_hint(i) if isinstance(i, torch.SymInt) else i for i in example_inputs)
        small = smallest_sizes(gm, inputs)
        trials.append(None if small is None else [i if isinstance(i, int) else tuple(i.shape) for i in small])
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(M(), backend=backend)
    compiled(torch.randn(2, 3, 4))
    compiled(torch.randn(5, 3, 4))
    torch._dynamo.reset()
    assert trials == [None, [1, (1, 3, 4)]]


class _HoldsState(nn.Module):
    """A served model's state: an inference-mode table, an expanded NaN fill, a
    static cache in a list, counters in a dict."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        with torch.inference_mode():
            self.table = torch.ones(4)
        self.register_buffer("fill", torch.tensor(float("nan")).expand(4), persistent=False)
        self.cache = [torch.zeros(4)]
        self.stats = {"calls": torch.zeros(1)}

    def forward(self, x):
        self.cache[0].add_(1)
        self.stats["calls"].add_(1)
        return self.lin(x) + self.table + torch.nan_to_num(self.fill) + self.cache[0]


@pytest.mark.parametrize("level", ["export", "dynamo"])
def test_captures_put_back_tensors_in_containers_and_leave_the_rest_alone(level):
    """Probe AF F3, F4, F8: the first TensorValues read every tensor's version (an
    inference tensor has none: every capture failed), wrote back a NaN it compared
    unequal to itself (into an expanded buffer: every capture failed), and left
    tensors held in lists and dicts written."""
    from rewrite.capture import capture_with_inputs

    torch.manual_seed(0)
    model = _HoldsState().eval()
    fill_version = model.fill._version
    capture_with_inputs(model, (torch.randn(2, 4),), level)
    assert torch.equal(model.cache[0], torch.zeros(4)) and torch.equal(model.stats["calls"], torch.zeros(1))
    assert model.fill._version == fill_version


def test_a_recomputed_data_dependent_size_is_no_difference():
    """Probe AF F7: a replacement that recomputes a value of data-dependent size got
    a fresh unbacked size, never statically equal to the root's, and was refused."""
    class Select(nn.Module):
        def forward(self, x, m):
            return torch.masked_select(x, m) * 2

    x, m = torch.randn(4, 5), torch.rand(4, 5) > 0.5
    gm = torch.export.export(Select(), (x, m)).module()
    result = rewrite.parse("rule r: aten.masked_select(x, m) => aten.index.Tensor(x, [m])").apply(gm, (x, m))
    assert result.counts == {"r": 1}
    torch.testing.assert_close(result.graph_module(x, m), Select()(x, m))


def test_folds_fire_on_a_dynamo_graph_traced_under_autocast():
    """Probe AF F9: under an ambient ``torch.autocast`` dynamo records the narrowed
    dtypes; a new conv's facts, inferred outside autocast, said float32, and the
    backend's conv_bn and linear_bn no longer fired."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, 8),
                          nn.BatchNorm1d(8)).eval()
    counts = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=rewrite.backend(rewrite.load("rules/fusion.rw"),
                                                            on_result=lambda r: counts.append(r.counts)))
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        compiled(torch.randn(2, 3, 6, 6))
    torch._dynamo.reset()
    assert counts and counts[0].get("conv_bn") == 1 and counts[0].get("linear_bn") == 1


def test_one_multi_output_call_unlike_the_root_does_not_fire():
    """Probe AF F1: a multi-output root replaced by one multi-output call of other
    shapes fired with check=False (a tuple of values was refused)."""
    class Max(nn.Module):
        def forward(self, x):
            return torch.max(x, 1, keepdim=True)

    x = torch.randn(3, 5)
    gm = torch.export.export(Max(), (x,)).module()
    rules = rewrite.parse("rule r: aten.max.dim(x, 1, k) as (_, _) => aten.max.dim(x, 0, k)")
    result = rules.apply(gm, (x,), check=False)
    assert result.counts == {}
    assert [tuple(t.shape) for t in result.graph_module(x)] == [(3, 1), (3, 1)]


def test_onnx_refuses_another_value_of_an_input_export_baked_in(tmp_path):
    """Probe AF F6: after the fix for AD F8, ``run_onnx(path, (x, 5))`` of a model
    exported with ``n=3`` returned the n=3 result silently."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    import rewrite.quant as rq

    torch.manual_seed(0)
    model, inputs = _Scaled().eval(), (torch.randn(2, 4), 3)
    path = rq.export_onnx(rq.quantize(model, [inputs], form="qdq"), inputs, tmp_path / "m.onnx")
    rq.run_onnx(path, inputs)
    with pytest.raises(rq.QuantizationError, match="fixed in the ONNX model"):
        rq.run_onnx(path, (inputs[0], 5))


@pytest.mark.parametrize("views", ["two_transposes", "slice_and_transpose"])
@pytest.mark.parametrize("check", [False, True])
def test_outputs_sharing_an_sdpa_result_through_rebuilt_views_keep_their_layouts(views, check):
    """Probe AF F2: transformer.rw rebuilds ``out.transpose(2, 3)`` as a new
    ``transpose(-2, -1)``; outputs viewing the sdpa result through it were not copied
    back (only the original graph's own views were trusted): strides changed with
    check=False, and the default check refused the shipped rule set."""
    torch.manual_seed(0)
    model = _AttentionAndViews(views).eval()
    x = torch.randn(2, 5, 16)
    gm = torch.export.export(model, (x,)).module()
    result = rewrite.load("rules/transformer.rw").apply(gm, example_inputs=(x,), check=check)
    assert result.counts.get("attention_scale") == 1
    want, got = model(x), result.graph_module(x)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        assert b.stride() == a.stride() and b.storage_offset() == a.storage_offset()
    assert _shares(got[0], got[1]) == _shares(want[0], want[1])


def test_a_dynamo_capture_leaves_the_callers_inputs_and_lazy_modules_work():
    """Probe AF F10 and F3's lazy module: dynamo's recording run wrote the caller's
    input (``mask.fill_(1)``); a lazy module's uninitialized parameter made
    ``TensorValues`` raise."""
    from rewrite.capture import capture_with_inputs

    class FillsItsInput(nn.Module):
        def forward(self, x, mask):
            mask.fill_(1.0)
            return x * mask

    x, mask = torch.randn(2, 4), torch.zeros(2, 4)
    gm, inputs = capture_with_inputs(FillsItsInput(), (x, mask), "dynamo")
    assert torch.equal(mask, torch.zeros(2, 4))
    assert torch.equal(gm(*inputs)[0] if isinstance(gm(*inputs), (tuple, list)) else gm(*inputs), x)
    lazy = nn.Sequential(nn.LazyLinear(4))
    capture_with_inputs(lazy, (torch.randn(2, 4),), "dynamo")


def test_onnx_baked_inputs_compare_by_value_and_defaults_are_not_inputs(tmp_path):
    """Probe AG F5: an input left at its default at export was not recorded, so
    another value passed silently; 3.0 for a baked 3 was refused."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    import rewrite.quant as rq

    torch.manual_seed(0)
    model, x = _Scaled().eval(), torch.randn(2, 4)
    qdq = rq.quantize(model, [(x, 3)], form="qdq")
    baked = rq.export_onnx(qdq, (x, 3), tmp_path / "baked.onnx")
    rq.run_onnx(baked, (x, 3.0))
    default = rq.export_onnx(qdq, (x,), tmp_path / "default.onnx")
    with pytest.raises(rq.QuantizationError):
        rq.run_onnx(default, (x, 5))


def test_captures_walk_objects_the_model_holds_but_not_its_parameters():
    """Probe AG F1, F2, F8: ``vars(m)['_parameters']`` was walked as a plain dict,
    so export captures still copied every weight; a nested tensor made the
    comparison raise; a tensor in a dataclass attribute kept the capture's write."""
    import dataclasses

    from rewrite.capture import capture_with_inputs
    from rewrite.module_state import TensorValues

    @dataclasses.dataclass
    class Cache:
        keys: torch.Tensor

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.cache = Cache(torch.zeros(4))
            self.ragged = [torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])]

        def forward(self, x):
            self.cache.keys.add_(1)
            return self.lin(x) + self.cache.keys

    model = M().eval()
    saved = TensorValues(model.modules())
    assert not any(t is model.lin.weight for t, *_ in saved._saved)
    for level in ("export", "dynamo"):
        capture_with_inputs(model, (torch.randn(2, 4),), level)
        assert torch.equal(model.cache.keys, torch.zeros(4))


def test_a_dropped_cast_does_not_fire_outside_autocast():
    """Probe AG F4: float32 against bfloat16 was no difference on any graph, so a
    rule dropping a cast fired with check=False (the check then failed the apply)."""
    class Casts(nn.Module):
        def forward(self, x):
            return x.to(torch.bfloat16) * 2

    x = torch.randn(4)
    gm = torch.export.export(Casts(), (x,)).module()
    result = rewrite.parse("rule r: aten.to.dtype(x, _) => x").apply(gm, (x,), check=False)
    assert result.counts == {} and result.graph_module(x).dtype == torch.bfloat16


def test_a_data_dependent_size_for_a_known_one_does_not_fire():
    """Probe AG F6, F7: ``abs(x) => sqrt(v * v)`` of ``v = x[x != 0]`` fired (and
    fooled the check: random inputs hold no zero) or crashed apply."""
    class Abs(nn.Module):
        def forward(self, x):
            return torch.abs(x) + 1

    x = torch.randn(6)
    gm = torch.export.export(Abs(), (x,)).module()
    rules = rewrite.parse("rule r: aten.abs(x) => aten.sqrt(aten.mul(aten.index.Tensor(x, [aten.ne(x, 0)]), "
                          "aten.index.Tensor(x, [aten.ne(x, 0)])))")
    for check in (False, True):
        result = rules.apply(gm, (x,), check=check)
        assert result.counts == {}


def test_a_dynamo_capture_copies_inputs_held_in_objects_with_their_strides():
    """Probe AG F3, F9: inputs in a dataclass were written by dynamo's recording
    run; copies made contiguous changed the branch a forward takes on
    ``is_contiguous()``."""
    import dataclasses

    from rewrite.capture import capture_with_inputs

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        mask: torch.Tensor

    class M(nn.Module):
        def forward(self, batch):
            batch.mask.fill_(1.0)
            return batch.x * 2 if batch.x.is_contiguous() else batch.x * 3

    x = torch.randn(4, 8)[:, ::2]
    batch = Batch(x, torch.zeros(4, 4))
    gm, inputs = capture_with_inputs(M(), (batch,), "dynamo")
    assert torch.equal(batch.mask, torch.zeros(4, 4))
    copies = [t for t in inputs if isinstance(t, torch.Tensor) and t.shape == x.shape and torch.equal(t, x)]
    assert copies and all(t.stride() == x.stride() for t in copies)
    out = gm(*inputs)
    out = out[0] if isinstance(out, (tuple, list)) else out
    torch.testing.assert_close(out, x * 3)
