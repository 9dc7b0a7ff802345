"""Session 41: the paths a rename missed (each raised NameError), then the findings of
probes AP (results leaving the library), AQ (shipped rule sets on other models), AR
(regressions of the fixes for those) and AS (the rule language as a new user meets it).
Each test shows the behaviour its probe's repro showed failing."""

import pytest
import torch
import torch.nn.functional as F

from rewrite.ops.base import Instances
from rewrite.ops.builders import op
from rewrite.ops.effects import graph_mode


def _traced(fn):
    return torch.fx.symbolic_trace(fn)


def test_graph_mode_reads_a_functional_batch_norm_flag():
    mean, var = torch.zeros(3), torch.ones(3)
    training = _traced(lambda x: F.batch_norm(x, mean, var, training=True))
    evaluating = _traced(lambda x: F.batch_norm(x, mean, var, training=False))
    assert graph_mode(training) is True
    assert graph_mode(evaluating) is False


def test_graph_mode_reads_a_functional_dropout_flag():
    assert graph_mode(_traced(lambda x: F.dropout(x, 0.5))) is True  # training defaults to True
    assert graph_mode(_traced(lambda x: F.dropout(x, 0.5, training=False))) is False


def test_an_op_may_name_its_instance_family():
    opdef = op("s41_neg", "input: T", torch=None, aten=None, instances="unary")
    assert opdef.instances == Instances("unary")


def test_save_refuses_a_folder_where_no_file_can_be_created_before_any_work(tmp_path):
    from rewrite.capture import missing_folder

    assert "cannot create a file in the folder '/proc'" in missing_folder("/proc/out.pt")
    assert missing_folder(tmp_path / "out.pt") is None
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def test_write_atomically_names_the_path_when_no_file_can_be_created():
    import pytest

    from rewrite.capture import SaveError, write_atomically

    with pytest.raises(SaveError, match="cannot write '/proc/out.pt'"):
        write_atomically("/proc/out.pt", lambda f: None)


# ---------------------------------------------------------------- probe AP (results leaving the library)


def test_inductor_cache_key_tells_families_apart():
    """AP F1: two files that differ only in what a family holds compiled to one cache
    key, so Inductor served the graph the first one rewrote to the second."""
    import rewrite

    relu = rewrite.parse("family f = relu\nrule swap(change=True): f(x) => sigmoid(x)\n")
    tanh = rewrite.parse("family f = tanh\nrule swap(change=True): f(x) => sigmoid(x)\n")
    wider = rewrite.parse("family f = relu | tanh\nrule swap(change=True): f(x) => sigmoid(x)\n")
    keys = {rewrite.inductor_pass(r).uuid() for r in (relu, tanh, wider)}
    assert len(keys) == 3 and None not in keys
    again = rewrite.parse("family f = relu\nrule swap(change=True): f(x) => sigmoid(x)\n")
    assert rewrite.inductor_pass(again).uuid() == rewrite.inductor_pass(relu).uuid()


class _ConvBn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


def _fused_dynamic_batch():
    import rewrite

    torch.manual_seed(0)
    model = _ConvBn().eval()
    x2 = torch.randn(2, 3, 8, 8)
    batch = torch.export.Dim("batch", min=1, max=64)
    gm = torch.export.export(model, (x2,), dynamic_shapes=({0: batch},), strict=False).module()
    result = rewrite.load("rules/fusion.rw").apply(gm, example_inputs=(x2,))
    assert result.counts.get("conv_bn") == 1
    return model, result.graph_module


def test_a_pt2_saved_from_a_batch_1_example_keeps_its_dynamic_batch(tmp_path):
    """AP F2: torch specializes a size-1 example dim; the .pt2 took batch 1 only."""
    import warnings

    from rewrite.capture import save

    model, gm = _fused_dynamic_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "exported with the example's sizes"
        path = save(gm, tmp_path / "m.pt2", "export", (torch.randn(1, 3, 8, 8),))
    loaded = torch.export.load(path).module()
    for batch in (1, 4):
        x = torch.randn(batch, 3, 8, 8)
        with torch.no_grad():
            torch.testing.assert_close(loaded(x), model(x), rtol=1e-4, atol=1e-5)


def test_saving_a_result_not_yet_called_takes_its_own_signature(tmp_path):
    """AP F3: until its code is generated, a result's forward is (*args, **kwargs):
    export traced that, took any number of inputs, and named them args_0..."""
    import pytest

    import rewrite
    from rewrite.capture import ExportError, export_program

    model = _ConvBn().eval()
    x = torch.randn(2, 3, 8, 8)
    gm = rewrite.capture.symbolic_trace(model)
    fresh = rewrite.load("rules/fusion.rw").apply(gm, example_inputs=(x,)).graph_module
    with pytest.raises(ExportError):
        export_program(fresh, (x, torch.randn(3)))
    program = export_program(fresh, (x,))
    assert list(program.graph_signature.user_inputs) == ["x"]
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), model(x), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- probe AQ (shipped rule sets)


class _Bf16RmsNorm(torch.nn.Module):
    """A bfloat16 model whose norm upcasts to float32 on purpose (Llama's RMSNorm)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16).to(torch.bfloat16)
        self.weight = torch.nn.Parameter(torch.ones(16, dtype=torch.bfloat16))

    def forward(self, x):
        h = self.proj(x).float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(torch.bfloat16)


def _float32_ops(gm):
    return sorted({n.target.__name__ for n in gm.graph.nodes if n.op == "call_function"
                   and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dtype == torch.float32})


def _amp_bf16_on(model_class):
    """(model, input, float32 ops before, amp_bf16's result) for a bfloat16 model."""
    import rewrite

    torch.manual_seed(0)
    model = model_class().eval()
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    gm = torch.export.export(model, (x,), strict=False).module()
    before = _float32_ops(gm)
    return model, x, before, rewrite.load("rules/amp_bf16.rw").apply(gm, example_inputs=(x,), training=False)


def test_amp_keeps_a_models_own_float32_upcast():
    """AQ F1: the approximate fallthrough rules moved a bfloat16 model's own .float()
    below pow, mean, add and rsqrt, which then ran in bfloat16 (autocast keeps them in
    float32): only a cast a rule inserted moves now."""
    model, x, before, result = _amp_bf16_on(_Bf16RmsNorm)
    assert not {"pow_bf16", "mean_bf16", "rsqrt_bf16", "add_scalar_bf16"} & set(result.counts)
    assert {"pow.Tensor_Scalar", "mean.dim", "rsqrt.default"} <= set(_float32_ops(result.graph_module)) <= set(before)
    x2 = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(result.graph_module(x2), model(x2))


def test_amp_still_moves_the_casts_it_inserted():
    """The other side of AQ F1: on a float32 model the casts AMP inserts still sink
    past an approximate fallthrough op (gelu runs in bfloat16, as under autocast)."""
    import rewrite

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16)).eval()
    x = torch.randn(4, 16)
    gm = torch.export.export(model, (x,), strict=False).module()
    result = rewrite.load("rules/amp_bf16.rw").apply(gm, example_inputs=(x,), training=False)
    assert result.counts.get("gelu_bf16", 0) == 1, result.counts
    gelu = [n for n in result.graph_module.graph.nodes if n.op == "call_function" and "gelu" in str(n.target)]
    assert gelu and all(n.meta["val"].dtype == torch.bfloat16 for n in gelu)


class _Pool3d(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv3d(2, 4, 1)
        self.pool = torch.nn.AdaptiveAvgPool3d((1, 2, 2))

    def forward(self, x):
        return self.pool(self.conv(x)).flatten(1)


def test_onnx_export_of_an_op_torch_onnx_lacks_names_it(tmp_path):
    """AP F4: torch.onnx's ConversionError came through unwrapped (the CLI printed an
    internal error); it is a QuantizationError naming the op now."""
    import pytest

    pytest.importorskip("onnxscript")
    import rewrite.quant as rq

    torch.manual_seed(0)
    inputs = (torch.randn(1, 2, 3, 4, 4),)
    qdq = rq.quantize(_Pool3d().eval(), [inputs], form="qdq")
    with pytest.raises(rq.QuantizationError, match="No ONNX function found for .*adaptive_avg_pool3d"):
        rq.export_onnx(qdq, inputs, tmp_path / "m.onnx")


def test_onnx_export_into_a_file_object_and_run_onnx_refusals(tmp_path, monkeypatch):
    """AP F5: a BytesIO got nothing and a file named after its repr appeared in the
    working directory; AP F6: run_onnx leaked onnxruntime's pybind errors."""
    import io

    import pytest

    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    import onnx

    import rewrite.quant as rq

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model, inputs = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval(), (torch.randn(2, 8),)
    qdq = rq.quantize(model, [inputs], form="qdq")
    buffer = io.BytesIO()
    assert rq.export_onnx(qdq, inputs, buffer) is buffer
    assert list(tmp_path.iterdir()) == []
    ops = {n.op_type for n in onnx.load_from_string(buffer.getvalue()).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    with pytest.raises(rq.QuantizationError, match="no such ONNX file"):
        rq.run_onnx(tmp_path / "missing.onnx", inputs)
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    with pytest.raises(rq.QuantizationError, match="onnxruntime cannot load"):
        rq.run_onnx(tmp_path / "junk.onnx", inputs)


def test_amp_applied_to_its_own_result_stacks_no_contiguous():
    """AQ F2: a second amp_bf16 apply moved casts past the exits' own contiguous and
    left contiguous(contiguous(y)) chains."""
    import rewrite

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3)).eval()
    x = torch.randn(1, 3, 10, 10)
    gm = torch.export.export(model, (x,), strict=False).module()
    amp = rewrite.load("rules/amp_bf16.rw")
    once = amp.apply(gm, example_inputs=(x,), training=False).graph_module
    twice = amp.apply(once, example_inputs=(x,), training=False).graph_module
    contiguous = torch.ops.aten.contiguous.default
    assert not [n for n in twice.graph.nodes if n.target is contiguous
                and isinstance(n.args[0], torch.fx.Node) and n.args[0].target is contiguous]
    with torch.no_grad():
        assert torch.equal(twice(x), once(x))


class _Bf16ViewThenSoftmax(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16).to(torch.bfloat16)

    def forward(self, x):
        s = self.proj(x).float().transpose(1, 2)  # an exact op between the upcast and the softmax
        return torch.relu(s).softmax(-1).pow(2).to(torch.bfloat16)


def test_amp_keeps_a_models_own_upcast_past_exact_ops():
    """AR F3: an exact rule (transpose, relu) moved the model's own cast down, the new
    cast counted as rule-made, and softmax then ran in bfloat16: no fallthrough rule
    moves a model's own cast now."""
    model, x, before, result = _amp_bf16_on(_Bf16ViewThenSoftmax)
    assert _float32_ops(result.graph_module) == before
    with torch.no_grad():
        assert torch.equal(result.graph_module(x), model(x))


# ---------------------------------------------------------------- probe AR (regressions of today's fixes)


def _tiny_qdq():
    import rewrite.quant as rq

    torch.manual_seed(0)
    inputs = (torch.randn(2, 8),)
    return rq.quantize(torch.nn.Sequential(torch.nn.Linear(8, 4)).eval(), [inputs], form="qdq"), inputs


def test_saving_into_a_text_stream_or_a_number_is_refused_before_any_work():
    """AR F1: rq.export(program, io.StringIO()) raised, then torch aborted the process."""
    import io

    import pytest

    import rewrite.quant as rq

    qdq, inputs = _tiny_qdq()
    for target in (123, io.StringIO()):
        for save in (lambda t: rq.export(qdq, inputs, t), lambda t: rq.save(qdq, t),
                     lambda t: rq.export_onnx(qdq, inputs, t)):
            with pytest.raises(ValueError, match="binary file object"):
                save(target)
    buffer = io.BytesIO()
    rq.export(qdq, inputs, buffer)
    assert buffer.getvalue()


def test_onnx_written_where_the_write_fails_is_a_quantization_error(tmp_path):
    """AR F2: a link to a missing folder passed the checks, then the write raised
    FileNotFoundError (the CLI printed an internal error)."""
    import pytest

    pytest.importorskip("onnxscript")
    import rewrite.quant as rq

    qdq, inputs = _tiny_qdq()
    link = tmp_path / "m.onnx"
    link.symlink_to(tmp_path / "missing" / "m.onnx")
    with pytest.raises(rq.QuantizationError, match="cannot write"):
        rq.export_onnx(qdq, inputs, link)
    with pytest.raises(rq.QuantizationError, match="takes the path"):
        rq.run_onnx(b"\x08\x01" * 100, inputs)
    with pytest.raises(rq.QuantizationError, match="a folder"):
        rq.run_onnx(tmp_path, inputs)


def test_a_save_onto_a_symbolic_link_writes_through_it(tmp_path):
    from rewrite.capture import write_atomically

    target, link = tmp_path / "real.pt", tmp_path / "link.pt"
    target.write_bytes(b"old")
    link.symlink_to(target)
    assert write_atomically(link, lambda f: open(f, "wb").write(b"new")) == link
    assert link.is_symlink() and target.read_bytes() == b"new"


# ---------------------------------------------------------------- probe AS (the rule language)



@pytest.mark.parametrize("replacement", [
    "torch.tile(x, [10000, 10000])", "aten.tile(x, [10000, 10000])", "F.pad(x, [100000000, 0])",
    "aten.constant_pad_nd(x, [100000000, 0])", "torch.diag(x, 100000)",
    "F.interpolate(x, scale_factor=30000000.0)", "torch.histc(x, 100000000)",
])
def test_literals_an_op_grows_its_result_with_are_bounded(replacement):
    """AS F1: E207 bounded sizes by a list of parameter names; tile's dims, pad,
    diag's offset, one_hot's num_classes, histc's bins... went through and allocated
    gigabytes on every call of the result."""
    import rewrite
    from rewrite.language.diagnostics import RuleError

    with pytest.raises(RuleError, match="E207"):
        rewrite.parse(f"rule r: relu(x) => {replacement}\n")


def test_small_literals_of_those_arguments_still_load():
    import rewrite

    rewrite.parse("rule r: relu(x) => F.pad(x, [1, 1, 2, 2])\n")
    rewrite.parse("rule r: relu(x) => torch.tile(x, [2, 3])\n")


def test_an_integer_power_of_model_literals_too_large_does_not_fire():
    """AS F2: operator.pow(c, c) with c bound to the model's 2000000 computed 2000000 **
    2000000 at rewrite time and on every call."""
    import rewrite

    rules = rewrite.parse("rule r: mul(x, c) where is_number(c) => mul(x, operator.pow(c, c))\n")
    huge = rules.apply(torch.fx.symbolic_trace(lambda x: x * 2_000_000), check=False)
    assert huge.counts.get("r", 0) == 0 and huge.stats["r"].failed == 1
    small = rules.apply(torch.fx.symbolic_trace(lambda x: x * 3), check=False)  # a wrong rule: only the bound
    assert small.counts["r"] == 1
    x = torch.rand(3)
    assert torch.equal(small.graph_module(x), x * 27)


def test_a_rule_file_path_the_system_refuses_to_look_at_is_a_rule_error():
    """AS F3: a path component over 255 bytes raised OSError while building the E402 hint."""
    import rewrite
    from rewrite.language.diagnostics import RuleError

    with pytest.raises(RuleError, match="E402"):
        rewrite.load("/tmp/" + "a" * 300 + "/x.rw")


@pytest.mark.parametrize("word", ["param", "with", "rule", "import", "family", "ruleset"])
def test_a_declaration_keyword_used_as_a_name_is_called_reserved(word):
    """AS F5: add(x, param) said "'(' was never closed", with a hint that fixed nothing."""
    import rewrite
    from rewrite.language.diagnostics import RuleError

    with pytest.raises(RuleError, match=f"'{word}' is a reserved word"):
        rewrite.parse(f"rule r: add(x, {word}) => x\n")


def test_an_unclosed_bracket_before_the_next_rule_is_still_called_unclosed():
    import rewrite
    from rewrite.language.diagnostics import RuleError

    with pytest.raises(RuleError, match="was never closed"):
        rewrite.parse("rule r: add(x, y => x\nrule s: relu(x) => x\n")


class _Derived(torch.nn.Module):
    def forward(self, x, y):  # x (B, 4), y (2B, 4)
        return torch.cat([x, x]) * y + 0.0


@pytest.mark.parametrize("example_batch", [0, 1, 3])
def test_a_pt2_keeps_a_derived_dynamic_size_whatever_the_example(tmp_path, example_batch):
    """AR F4: a capture whose y has 2*B rows saved a .pt2 refusing batch 1 (from a
    batch-3 example) or taking batch 1 only (from a batch-1 one); a batch-0 example
    fixed the batch at 0, with a warning blaming the rewrite."""
    import warnings

    import rewrite
    from rewrite.capture import save

    make = lambda b: (torch.randn(b, 4), torch.randn(2 * b, 4))  # noqa: E731
    batch = torch.export.Dim("B", min=0, max=32) if example_batch != 3 else torch.export.Dim("B")  # unbounded too
    gm = torch.export.export(_Derived(), make(3), dynamic_shapes=({0: batch}, {0: 2 * batch}), strict=False).module()
    result = rewrite.load("rules/cleanup.rw").apply(gm, example_inputs=make(3))
    assert result.counts.get("add_zero") == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        path = save(result.graph_module, tmp_path / "m.pt2", "export", make(example_batch))
    loaded = torch.export.load(path).module()
    for b in (1, 2, 5):
        x, y = make(b)
        torch.testing.assert_close(loaded(x, y), torch.cat([x, x]) * y)


def test_fmt_wraps_a_long_call_in_a_where_clause_and_a_long_list():
    """AR F6: a where-clause call (and cat's list of operands) longer than 100 columns
    stayed on one line."""
    from rewrite.language import format_source, parse_text

    a, b, c = "weight_of_the_first_convolution_layer", "bias_of_the_first_convolution_layer", "running_mean_of_it"
    texts = [f"rule r: add(mul({a}, {b}), {c}) where const({a}, {b}, {c}) and is_float({a}) => add({b}, {c})\n",
             f"rule s: cat([to({a}, torch.float32), to({b}, torch.float32), to({c}, torch.float32)], 0) => {a}\n"]
    for text in texts:
        out = format_source(text)
        assert all(len(line) <= 100 for line in out.splitlines()), out
        assert parse_text(out) == parse_text(text) and format_source(out) == out


@pytest.mark.parametrize("replacement, word", [
    ("Tensor.new_zeros(x, [3], dtype=8)", "dtype"), ("Tensor.new_zeros(x, 8, 8)", "dtype"),
    ("torch.zeros_like(x, dtype=5)", "dtype"), ('torch.clamp(x, "a")', "min"),
])
def test_literal_types_of_c_bound_torch_functions_and_methods_are_checked(replacement, word):
    """AS F4: the aten spelling of an op had its literals checked (E206), the torch and
    Tensor spellings of the same op loaded and raised on every call."""
    import rewrite
    from rewrite.language.diagnostics import RuleError

    with pytest.raises(RuleError, match=f"E206.*|argument '{word}'"):
        rewrite.parse(f"rule r: relu(x) => {replacement}\n")


@pytest.mark.parametrize("replacement", [
    'Tensor.to(x, "cpu")', "Tensor.to(x, torch.float16)", "Tensor.to(x, x)", "torch.clamp(x, 0.5)",
    "Tensor.new_zeros(x, [8, 8])", "torch.add(x, 2)", "Tensor.sum(x, [0, 1], True)", "torch.pow(2, x)",
    "torch.max(x, 1)", "torch.max(x, x)", 'Tensor.div(x, 2, rounding_mode="floor")', "Tensor.split(x, [1, 2])",
])
def test_what_some_overload_takes_still_loads(replacement):
    import rewrite

    rewrite.parse(f"rule r: relu(x) => {replacement}\n")


class _Scaled(torch.nn.Module):
    def forward(self, x, n: int = 3):
        return x * n + 0.0


@pytest.mark.parametrize("example_batch", [1, 2])
def test_a_pt2_of_a_model_with_an_int_input_keeps_its_dynamic_batch(example_batch):
    """The symbols-kept check counted the int input (a constant of the program, not a
    placeholder) and fell back to static sizes, with a warning, for every such model."""
    import warnings

    import rewrite
    from rewrite.capture import export_program

    x = torch.randn(2, 4)
    batch = torch.export.Dim("b", min=1, max=8)
    gm = torch.export.export(_Scaled(), (x, 3), dynamic_shapes=({0: batch}, None), strict=False).module()
    result = rewrite.load("rules/cleanup.rw").apply(gm, example_inputs=(x, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        program = export_program(result.graph_module, (torch.randn(example_batch, 4), 3))
    y = torch.randn(5, 4)
    torch.testing.assert_close(program.module()(y, 3), y * 3)
