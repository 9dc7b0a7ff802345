"""Regressions found in session 47: a where-clause variable compared with an int
as a literal at the argument it was bound at compares (probe BW F6)."""

import pytest
import torch
import torch.nn as nn

import rewrite


class _ConvReshape(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, stride=2)

    def forward(self, x):
        return self.c(x).reshape(16, 16).relu()


def _fires(rule: str) -> int:
    x = torch.randn(4, 3, 9, 9)
    gm = torch.export.export(_ConvReshape(), (x,)).module()
    result = rewrite.parse(rule + "\nruleset main = once(a)").apply(gm, (x,))
    out = result.graph_module(x)
    assert torch.allclose(out, gm(x))
    return sum(result.counts.values())


_CONV = "conv(x, w, b, s, p, d, g)"


@pytest.mark.parametrize("clause, fires", [
    ("s == 2", 1), ("s in (2, 3)", 1), ("s == 2 or s == 3", 1), ("s != 2", 0),
    ("s not in (2, 3)", 0), ("not (s in (2, 3))", 0), ("s == [2, 2]", 1), ("s in ([2, 2],)", 1),
])
def test_a_stride_variable_equals_its_expansion_in_every_spelling(clause, fires):
    """A stride ``[2, 2]`` is "stride 2": ``s == 2`` held but ``s in (2, 3)`` did not
    (the clause compared ``[2, 2] in (2, 3)`` as Python does), so two spellings of one
    condition disagreed."""
    rule = f"rule a: {_CONV} where {clause} => add({_CONV}, 0.0)"
    assert _fires(rule) == fires


@pytest.mark.parametrize("clause, fires", [
    ("s == 16", 0), ("s in (2, 16)", 0), ("s == 16 or s == 2", 0), ("s != 16", 1),
    ("s == [16, 16]", 1), ("s in ([16, 16], [1])", 1),
])
def test_a_size_variable_is_no_expansion_of_an_int(clause, fires):
    """``reshape(x, s) where s == 16`` held for the size ``[16, 16]`` (a size is no int
    repeated per dimension: ``reshape(x, 16)`` is ``[16]``)."""
    assert _fires(f"rule a: reshape(x, s) where {clause} => add(reshape(x, s), 0.0)") == fires


def test_a_one_element_size_still_equals_its_int():
    """``x.mean(0)`` is export's ``mean(x, [0])``: a dims variable bound to ``[1]``
    equals ``1``, as the literal ``mean(x, 1)`` matches it."""
    class M(nn.Module):
        def forward(self, x):
            return x.sum(1) * 2

    x = torch.randn(3, 4)
    gm = torch.export.export(M(), (x,)).module()
    for clause, fires in (("d == 1", 1), ("d in (1,)", 1), ("d == 0", 0)):
        rule = f"rule a: sum(x, d) where {clause} => add(sum(x, d), 0.0)\nruleset main = once(a)"
        result = rewrite.parse(rule).apply(gm, (x,))
        assert torch.allclose(result.graph_module(x), gm(x))
        assert sum(result.counts.values()) == fires, clause


class _Attention(nn.Module):
    """nanoGPT's attention: ``nn.Linear`` projections around a written-out attention."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax((q @ k.transpose(-2, -1)) * (1.0 / self.head_dim ** 0.5), dim=-1)
        return x + self.o((att @ v).transpose(1, 2).reshape(b, t, d))


@pytest.mark.parametrize("capture", ["symbolic_trace", "export"])
def test_attention_fuses_in_every_layer_behind_nn_linear(capture):
    """A correct attention rule fused only the last of three layers of a
    symbolic_trace graph: the layout walk took every module call, ``nn.Linear`` too,
    for one that carries its input's layout on, and the next layer's ``q.view``
    for a reader of the new attention's layout (``F.linear`` stopped it)."""
    from rewrite.capture import symbolic_trace

    model = nn.Sequential(*(_Attention() for _ in range(3))).eval()
    x = torch.randn(2, 5, 16)
    gm = symbolic_trace(model) if capture == "symbolic_trace" else torch.export.export(model, (x,)).module()
    rules = rewrite.load("rules/transformer.rw")["transformer"]
    result = rules.apply(gm, (x,))
    assert result.counts.get("attention_scale") == 3, result.counts
    assert torch.allclose(result.graph_module(x), model(x), atol=1e-5)
    assert "scaled_dot_product_attention" in str(result.graph_module.graph)


@pytest.mark.parametrize("seed", [None, 0, 1, 3])
def test_the_loop_message_names_only_the_rules_of_the_cycle(seed):
    """``p``/``q`` undo each other; ``one`` fires at five other places meanwhile and
    was named among the rules that "undo each other" (probe BW F3)."""
    from rewrite.engine.driver import NonTerminationError

    class M(nn.Module):
        def forward(self, x):
            return -x, *[torch.relu(x + i) * 1 for i in range(5)]

    rules = rewrite.parse("rule p: neg(x) => mul(x, -1)\nrule q: mul(x, -1) => neg(x)\n"
                          "rule one: mul(x, 1) where is_float(x) => x\n")
    with pytest.raises(NonTerminationError) as err:
        rules.apply(torch.fx.symbolic_trace(M()), example_inputs=(torch.randn(4, 5),), check=False,
                    shuffle_seed=seed)
    assert err.value.rules == ("p", "q")
    assert "'one'" not in str(err.value)


# ---------------------------------------------------------------- probe BY: bad input


class _ReluTwice(nn.Module):
    def forward(self, x):
        return torch.relu(torch.relu(x)) * 1


def test_a_graph_without_output_is_a_value_error():
    """A graph whose output node was erased (``lint`` accepts it) leaked a bare
    ``StopIteration``, which silently ends a caller's ``map`` or generator."""
    gm = torch.fx.symbolic_trace(_ReluTwice())
    gm.graph.erase_node(next(n for n in gm.graph.nodes if n.op == "output"))
    rules = rewrite.load("rules/cleanup.rw")
    for kwargs in ({}, {"check": False}, {"inplace": True}):
        with pytest.raises(ValueError, match="no output node"):
            rules.apply(gm, (torch.randn(2, 3),), **kwargs)


@pytest.mark.parametrize("check, inplace", [(False, False), (True, False), (True, True)])
def test_a_graph_lint_refuses_is_named_not_torchs_key_error(check, inplace):
    """A node used before it is defined raised torch's ``KeyError('relu')`` from the
    copy (or a ``RuntimeError`` wrapping an ``UnboundLocalError`` in place). Only a
    failure asks ``lint`` (a walk of the graph): in place without the check nothing
    runs the graph, and nothing is asked."""
    gm = torch.fx.symbolic_trace(_ReluTwice())
    nodes = list(gm.graph.nodes)
    nodes[2].append(nodes[1])  # the second relu before the first
    before = str(gm.graph)
    with pytest.raises(ValueError, match="malformed.*used before it has been defined"):
        rewrite.load("rules/cleanup.rw").apply(gm, (torch.randn(2, 3),), check=check, inplace=inplace)
    assert str(gm.graph) == before


def test_a_get_attr_of_nothing_is_named():
    import warnings

    gm = torch.fx.symbolic_trace(_ReluTwice())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with gm.graph.inserting_after(next(iter(gm.graph.nodes))):
            ghost = gm.graph.get_attr("does_not_exist")
    relu = next(n for n in gm.graph.nodes if n.op == "call_function")
    relu.args = (ghost,)
    with pytest.raises(ValueError, match="malformed.*does_not_exist"):
        rewrite.load("rules/cleanup.rw").apply(gm, (torch.randn(2, 3),))


@pytest.mark.parametrize("option, value", [
    ("shuffle_seed", "a"), ("shuffle_seed", 1.5), ("shuffle_seed", -1), ("shuffle_seed", True),
    ("trials", True),
])
def test_apply_refuses_a_bad_seed_or_trials(option, value):
    gm = torch.fx.symbolic_trace(_ReluTwice())
    with pytest.raises(ValueError, match=option):
        rewrite.load("rules/cleanup.rw").apply(gm, (torch.randn(2, 3),), **{option: value})


def test_load_without_paths_and_a_model_failing_its_own_inputs():
    from rewrite.trust.check import ModelRunError

    with pytest.raises(TypeError, match="at least one"):
        rewrite.load()
    gm = torch.fx.symbolic_trace(_ReluTwice())
    x = torch.randn(2, 3)
    for inputs in ((), (x, x)):
        with pytest.raises(ValueError, match="reference failed on trial 0") as err:
            rewrite.load("rules/cleanup.rw").apply(gm, inputs)
        assert isinstance(err.value, (RuntimeError, ModelRunError))  # what it always was, too


def test_fmt_keeps_a_doc_comment_with_trailing_blanks():
    """``fmt`` drops trailing blanks, and the doc the parser read kept them: parsing
    the formatted text gave another program."""
    from rewrite.language.format import format_source
    from rewrite.language.parser import parse_text

    text = "# x * 1 -> x   \nrule mul_one: mul(x, 1) => x\n"
    assert parse_text(text, "d.rw") == parse_text(format_source(text, "d.rw"), "d.rw")
    assert parse_text(text, "d.rw").items[0].doc == "x * 1 -> x"


def test_the_capture_hint_names_only_levels_the_command_takes(tmp_path, monkeypatch, capsys):
    from rewrite.cli import main

    (tmp_path / "s47_models.py").write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return x.relu() if x.sum() > 0 else x\n"  # data-dependent: symbolic_trace fails
        "def f():\n"
        "    return M(), (torch.ones(2),)\n"
        "def script():\n"
        "    return torch.jit.script(M()), (torch.ones(2),)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["apply", "cleanup.rw", "--model", "s47_models:f"]) == 2
    err = capsys.readouterr().err
    assert "try --capture export, dynamo" in err and "export_core" not in err
    assert main(["apply", "cleanup.rw", "--model", "s47_models:script"]) == 2
    err = capsys.readouterr().err
    assert "TorchScript" in err and "AssertionError" not in err


# ---------------------------------------------------------------- probe BZ: the backend


class _ConvBn(nn.Module):
    def __init__(self, channels=3):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(channels, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class _DriftingStats(_ConvBn):
    """Writes its batch norm's statistic in one dynamo graph, reads it in the next."""

    def forward(self, x):
        self.bn.running_var.mul_(1.5)
        torch._dynamo.graph_break()
        return self.bn(self.conv(x))


@pytest.fixture
def dynamo_reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_buffer_another_graph_writes_is_not_a_stale_constant(dynamo_reset):
    """``conv_bn`` folded ``running_var`` as it was at compile time while the
    graph before the break multiplied it each call: wrong from the second call on."""
    import copy
    import warnings

    model = _DriftingStats().eval()
    eager, results = copy.deepcopy(model), []
    compiled = torch.compile(model, backend=rewrite.backend("rules/fusion.rw", on_result=results.append))
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(8):
            assert torch.allclose(compiled(x), eager(x), atol=1e-5)
    assert any(r.counts.get("conv_bn") for r in results), "the rules ran"
    assert any("between many calls" in str(w.message) for w in caught)


def test_eval_after_training_steps_sees_the_new_statistics(dynamo_reset):
    """Training steps update the batch norm's statistics (its kernel bumps no version
    counter); the eval graph compiled before kept the old ones folded."""
    import copy

    model = _ConvBn()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend=rewrite.backend("rules/fusion.rw"))
    x = torch.randn(8, 3, 8, 8)
    with torch.no_grad():
        for _ in range(2):
            model.train(), eager.train()
            for _ in range(2):
                batch = torch.randn(8, 3, 8, 8) * 3 + 1
                compiled(batch), eager(batch)
            model.eval(), eager.eval()
            for _ in range(2):
                assert torch.allclose(compiled(x), eager(x), atol=1e-5)


def test_instances_sharing_dynamo_graph_each_get_the_rules(dynamo_reset):
    """Blocks of one class compiled apart share dynamo's graph: only the first got
    the rules, the others ran without them (under a wrong "replaced" warning)."""
    import warnings

    blocks = [_ConvBn(4).eval() for _ in range(3)]
    for b in blocks:
        b.bn.running_mean.uniform_(-1, 1), b.bn.running_var.uniform_(0.5, 2)
    results = []
    backend = rewrite.backend("rules/fusion.rw", on_result=results.append)
    compiled = [torch.compile(b, backend=backend) for b in blocks]
    x = torch.randn(2, 4, 8, 8)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            for fast, block in zip(compiled, blocks):
                assert torch.allclose(fast(x), block(x), atol=1e-5)
    assert [r.counts.get("conv_bn") for r in results] == [1, 1, 1]
    assert not [w for w in caught if "rewrite.backend" in str(w.message)]


class _TwoInputs(nn.Module):
    def forward(self, a, b):
        y = b * 3.0  # b used first: dynamo's graph takes it first
        return torch.clamp(a, 0, 1) + y


def test_backend_input_keys_name_the_forwards_arguments(dynamo_reset):
    """``input_ranges={1: ...}`` (the model's b) reached dynamo's first input, a: a
    rule sound only for a in [0, 1] passed and a later batch was off by 13."""
    rules = rewrite.parse("rule clamp01: clamp(x, 0, 1) => x")
    with pytest.raises(ValueError, match="name the forward's argument"):
        rewrite.backend(rules, input_ranges={1: (0.0, 1.0)})
    a, b = torch.rand(16, 16), torch.rand(16, 16)
    refused = torch.compile(_TwoInputs(), backend=rewrite.backend(rules, input_ranges={"b": (0.0, 1.0)}))
    with pytest.raises(Exception, match="clamp01"):
        refused(a, b)
    torch._dynamo.reset()
    results = []
    sound = torch.compile(_TwoInputs(), backend=rewrite.backend(rules, input_ranges={"a": (0.0, 1.0)},
                                                                 on_result=results.append))
    assert torch.allclose(sound(a, b), _TwoInputs()(a, b))
    assert results[0].counts == {"clamp01": 1}


def test_a_compiler_returning_none_is_said_at_compile(dynamo_reset):
    compiled = torch.compile(_TwoInputs(), backend=rewrite.backend("rules/cleanup.rw", compiler=lambda gm, i: None))
    with pytest.raises(Exception, match="the compiler returned NoneType"):
        compiled(torch.rand(2), torch.rand(2))


def test_explain_names_the_training_flag_of_a_train_mode_batch_norm():
    """``explain`` said "False failed / expected: False / actual: True" (probe BT)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).train()
    x = torch.randn(2, 3, 8, 8)
    gm = torch.export.export(model, (x,)).module()
    (miss,) = rewrite.load("rules/fusion.rw").explain(gm, rule="conv_bn", example_inputs=(x,), limit=1)
    assert "training=False failed" in str(miss) and "model.eval()" in str(miss)


def test_models_of_one_class_compiled_in_turn_each_get_the_rules(dynamo_reset):
    """Each model dropped before the next of its class was compiled: from the third
    on, the backend took the new tensors for a reassignment and ran without the rules
    (probe CB F3); a model built under inference mode failed to compile (its tensors
    have no version counter, CB F2)."""
    import warnings

    results = []
    backend = rewrite.backend("rules/fusion.rw", on_result=results.append)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            model = _ConvBn().eval()
            assert torch.allclose(torch.compile(model, backend=backend)(x), model(x), atol=1e-5)
            del model
        with torch.inference_mode():
            model = _ConvBn().eval()
            assert torch.allclose(torch.compile(model, backend=backend)(x), model(x), atol=1e-5)
    assert [r.counts.get("conv_bn") for r in results] == [1] * 6
    assert not [w for w in caught if "rewrite.backend" in str(w.message)]


def test_a_parameter_given_new_data_is_rewritten_for_it(dynamo_reset):
    """``p.data = ...`` hands the graph other memory: its own rewrite (CB F1)."""
    model = _ConvBn().eval()
    compiled = torch.compile(model, backend=rewrite.backend("rules/fusion.rw"))
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        compiled(x)
        model.conv.weight.data = model.conv.weight.data * 2
        model.bn.running_var.data = model.bn.running_var.data * 4
        assert torch.allclose(compiled(x), model(x), atol=1e-5)


def test_a_rewrite_for_new_values_that_fails_runs_dynamos_graph(dynamo_reset):
    """A rule right only for the buffer's first values: after the write its rewrite
    fails the check, and every later call raised it (and redid it; CB F6)."""
    import warnings

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w", torch.ones(3))

        def forward(self, x):
            return torch.relu(x * self.w)

    model = Scaled().eval()
    compiled = torch.compile(model, backend=rewrite.backend(rewrite.parse("rule drop: mul(x, _) => x")))
    x = torch.randn(2, 3)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(compiled(x), model(x))
        model.w.fill_(2.0)
        for _ in range(3):
            assert torch.equal(compiled(x), model(x))
    assert sum("rewriting it again for new values failed" in str(w.message) for w in caught) == 1


def test_backend_keys_read_an_item_in_either_quotes(dynamo_reset):
    class Batch(nn.Module):
        def forward(self, batch):
            return torch.clamp(batch["p"], 0, 1) * 2

    results = []
    rules = rewrite.parse("rule clamp01: clamp(x, 0, 1) => x")
    for key in ("batch['p']", 'batch["p"]', " batch[ 'p' ] "):
        torch._dynamo.reset()
        compiled = torch.compile(Batch(), backend=rewrite.backend(rules, input_ranges={key: (0.0, 1.0)},
                                                                  on_result=results.append))
        batch = {"p": torch.rand(4)}
        assert torch.equal(compiled(batch), Batch()(batch))
    assert [r.counts for r in results] == [{"clamp01": 1}] * 3


# ---------------------------------------------------------------- probe CA: onednn conv + add


class _ResidualReadTwice(nn.Module):
    """The residual is read again after its conv + add, by a second branch; and a
    block whose conv reads the tensor it is added to."""

    def __init__(self, self_add: bool):
        super().__init__()
        self.self_add = self_add
        self.c1, self.c0 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.c2, self.c3 = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        x = torch.relu(self.c1(x))
        if self.self_add:
            return torch.relu(self.c2(x) + x)
        y = torch.relu(self.c2(torch.relu(self.c0(x))) + x)
        return y + self.c3(x)


@pytest.mark.skipif("onednn" not in torch.backends.quantized.supported_engines, reason="no onednn engine")
@pytest.mark.parametrize("self_add", [False, True])
def test_onednn_conv_add_leaves_its_accumulator_as_it_was(self_add):
    """In channels_last onednn's conv2d_add sums into the accumulator's memory: a
    residual read again later (or the conv's own input, ``relu(conv(x) + x)``, which
    no rule lowered before) was overwritten; the int8 model disagreed with its QDQ
    reference (SQNR 2-12 dB, a ``QuantizationError``). Found by probe CA."""
    import rewrite.quant as rq

    torch.manual_seed(0)
    model, x = _ResidualReadTwice(self_add).eval(), torch.randn(2, 3, 16, 16)
    gm = torch.export.export(model, (x,)).module()
    int8 = rq.quantize(gm, [x], backend="onednn", ruleset="onednn")
    state = int8.meta["rewrite.quant"]
    assert state["qdq_sqnr"] >= 30, state["qdq_sqnr"]
    lowered = state["lower_counts"]
    assert lowered.get("lower_conv_add_relu_self" if self_add else "lower_conv_add_relu") == 1, lowered
    assert "left in float" not in str(rq.coverage(int8)) or "none left in float" in str(rq.coverage(int8))


class _OneByOne(nn.Module):
    """A conv + add on a 1x1 map, its residual read again and returned (probe CC)."""

    def __init__(self):
        super().__init__()
        self.down, self.conv, self.head = nn.Conv2d(3, 8, 1, 2), nn.Conv2d(3, 8, 3, 2, 1), nn.Conv2d(8, 8, 1)

    def forward(self, x):
        r = self.down(x)
        return torch.relu(self.conv(x) + r) + self.head(r), r


@pytest.mark.skipif("onednn" not in torch.backends.quantized.supported_engines, reason="no onednn engine")
def test_onednn_conv_add_on_a_one_by_one_map_leaves_its_accumulator():
    """A 1x1 accumulator counts as both layouts: no copy was made, onednn summed into
    it, and the int8 model was wrong at 2x2 inputs even when calibrated at 4x4."""
    import rewrite.quant as rq
    from rewrite.flows.quant import sqnr

    torch.manual_seed(0)
    model = _OneByOne().eval()
    int8, qdq = rq.quantize(model, [torch.randn(1, 3, 4, 4) for _ in range(4)], backend="onednn",
                            ruleset="onednn", reference=True)
    assert int8.meta["rewrite.quant"]["lower_counts"].get("lower_conv_add_relu") == 1
    x = torch.randn(1, 3, 2, 2)
    for expected, got in zip(qdq(x), int8(x)):
        assert sqnr(expected, got) >= 30


def test_memory_swapped_between_instances_is_no_stale_variant(dynamo_reset):
    """Two instances swap their tensors' memory through ``.data``; a counted write
    into A left A's counters equal to those B's tensors had in that memory: the old
    fold was reused (max error 4.98). A key holds the tensor's id too."""
    a, b = _ConvBn().eval(), _ConvBn().eval()
    tensors = lambda m: [m.conv.weight, m.conv.bias, m.bn.weight, m.bn.bias, m.bn.running_mean, m.bn.running_var]
    with torch.no_grad():
        for t in tensors(b):
            for _ in range(3):
                t.mul_(1.0)
    backend = rewrite.backend("rules/fusion.rw")
    fast_a, fast_b = torch.compile(a, backend=backend), torch.compile(b, backend=backend)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        fast_a(x), fast_b(x)
        for ta, tb in zip(tensors(a), tensors(b)):
            ta.data, tb.data = tb.data, ta.data
        a.conv.weight.mul_(3.0)
        for ta, tb in zip(tensors(a), tensors(b)):
            while ta._version < tb._version:
                ta.mul_(1.0)
        assert torch.allclose(fast_a(x), a(x), atol=1e-4)
