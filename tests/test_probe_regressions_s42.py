"""Regressions found in session 42: generic Tensor methods spelled with spread ints,
and whatever the session's probes (in-place rollback, fooling the check) turned up."""

import pytest
import torch

import rewrite


def _symbolic(forward):
    class M(torch.nn.Module):
        pass

    M.forward = lambda self, x: forward(x)
    return torch.fx.symbolic_trace(M())


_FLIP_TWICE = """
rule flip_twice(priority=1):
    Tensor.flip(Tensor.flip(x, [0, 1]), [0, 1]) => x
"""


@pytest.mark.parametrize("forward", [
    lambda x: x.flip(0, 1).flip(0, 1) + 1,
    lambda x: x.flip([0, 1]).flip(0, 1) + 1,
    lambda x: x.flip((0, 1)).flip([0, 1]) + 1,
])
def test_generic_method_matches_spread_and_list_spellings(forward):
    """``x.flip(0, 1)`` is ``x.flip([0, 1])`` in torch's Python binding: a rule naming
    ``Tensor.flip`` (outside the vocabulary) matches both spellings."""
    gm = _symbolic(forward)
    x = torch.randn(2, 3)
    result = rewrite.parse(_FLIP_TWICE).apply(gm, example_inputs=(x,))
    assert result.counts == {"flip_twice": 1}
    assert "flip" not in result.graph_module.code
    torch.testing.assert_close(result.graph_module(x), forward(x))


def test_generic_method_spread_other_dims_does_not_match():
    gm = _symbolic(lambda x: x.flip(0, 1).flip(1) + 1)
    x = torch.randn(2, 3)
    result = rewrite.parse(_FLIP_TWICE).apply(gm, example_inputs=(x,))
    assert result.counts == {}


def test_generic_method_spread_single_int_and_replacement_runs():
    rules = rewrite.parse("""
rule repeat_rows(priority=1):
    Tensor.repeat(y, [2, 1]) => torch.cat([y, y], 0)
""")
    for forward in (lambda x: x.repeat(2, 1) * 2, lambda x: x.repeat([2, 1]) * 2):
        gm = _symbolic(forward)
        x = torch.randn(3, 4)
        result = rewrite.parse("rule none(priority=1):\n    Tensor.repeat(y, [2]) => y\n").apply(
            gm, example_inputs=(x,))
        assert result.counts == {}
        result = rules.apply(gm, example_inputs=(x,))
        assert result.counts == {"repeat_rows": 1}
        assert "repeat" not in result.graph_module.code
        torch.testing.assert_close(result.graph_module(x), forward(x))


def test_spread_ints_in_a_rule_get_a_list_hint():
    with pytest.raises(rewrite.RuleError) as info:
        rewrite.parse("rule p(priority=1):\n    Tensor.permute(x, 1, 0) => x\n")
    text = str(info.value)
    assert "E201" in text and "'dims' as one list" in text


# ---------------------------------------------------------------- diagnostics nits (probe AS, session 41)


def _errors(text: str) -> str:
    with pytest.raises(rewrite.RuleError) as info:
        rewrite.parse(text)
    return str(info.value)


def test_lookalike_letter_is_named_with_its_code_point():
    text = _errors("rule r: relu(x) => \u0430dd(x, x)\n")
    assert "U+0430 CYRILLIC SMALL LETTER A" in text and "E002" in text


@pytest.mark.parametrize("bound, code", [("inf", "E301"), ("-inf", "E002"), ("nan", "E301")])
def test_inf_in_a_rule_says_it_is_not_a_literal(bound, code):
    text = _errors(f"rule r: relu(x) => clamp(x, 0.0, {bound})\n")
    assert "'inf' and 'nan' are not literals" in text and code in text


def test_a_huge_unknown_name_is_cut_in_the_message():
    text = _errors("rule r: relu(x) => " + "a" * 20000 + "(x)\n")
    assert "E102" in text and "(20000 characters)" in text
    assert len(text) < 2000


def test_a_long_quoted_path_keeps_its_file_name_and_is_cut_once():
    import attrs
    from rewrite.language.diagnostics import Diagnostic

    path = "/very/long/folder" * 30 + "/missing.rw"
    diagnostic = Diagnostic(None, f"cannot import '{path}'", "E402")
    assert "missing.rw'" in diagnostic.message and f"({len(path)} characters)" in diagnostic.message
    again = attrs.evolve(diagnostic, related=((None, "note"),))
    assert again.message == diagnostic.message


def test_second_rule_on_a_line_does_not_take_the_first_ones_doc():
    from rewrite.language.program import parse_module

    module, _ = parse_module("# doc of a\nrule a: relu(x) => x rule b: relu(y) => y\n", "<t>")
    assert [(r.name, r.doc) for r in module.items] == [("a", "doc of a"), ("b", "")]


def test_instance_note_printed_once_for_a_clash_inside_one_instance(tmp_path):
    (tmp_path / "clash.rw").write_text("param lowp\nrule scale_cast: to(x, lowp) where dtype(x) == lowp => x\n"
                                       "rule scale_cast_bf16: mul(x, 1) => x\n")
    (tmp_path / "main.rw").write_text('import "clash.rw" with lowp = torch.bfloat16 as bf16\n')
    with pytest.raises(rewrite.RuleError) as info:
        rewrite.load(str(tmp_path / "main.rw"))
    text = str(info.value)
    assert "E401" in text and text.count("in the instance of") == 1


def test_import_of_a_symlink_loop_says_so(tmp_path):
    (tmp_path / "loop.rw").symlink_to(tmp_path / "loop.rw")
    (tmp_path / "main.rw").write_text('import "loop.rw"\n')
    with pytest.raises(rewrite.RuleError) as info:
        rewrite.load(str(tmp_path / "main.rw"))
    assert "symbolic link to nothing" in str(info.value)


# ---------------------------------------------------------------- probe AT (in place and rollback)


def test_inplace_warning_raised_as_error_leaves_the_module_as_it_was():
    """A ``TrainingModeWarning`` a filter turns into an error (``pytest -W error``)
    escapes apply: in place, the module must then be exactly as given, not rewritten
    with no result returned."""
    import warnings

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.relu(self.l(x) * 1.0)

    x = torch.randn(2, 4)
    gm = torch.export.export(MLP().eval(), (x,)).module()
    before_graph, before_code = str(gm.graph), gm.code
    rules = rewrite.load("rules/cleanup.rw") + rewrite.load("rules/amp_bf16.rw")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(rewrite.TrainingModeWarning):
            rules.apply(gm, example_inputs=(x,), inplace=True)
    assert str(gm.graph) == before_graph and gm.code == before_code
    # without the filter, the same call rewrites in place and warns
    with pytest.warns(rewrite.TrainingModeWarning):
        result = rules.apply(gm, example_inputs=(x,), inplace=True)
    assert result.counts and str(gm.graph) != before_graph


# ---------------------------------------------------------------- probe AU (fooling the check and verify)


def test_attention_output_is_laid_out_as_q_in_an_export_graph():
    """``scaled_dot_product_attention`` lays its output out as q: in an export graph,
    where q may be a transposed input of the same shape, its contiguity is unknown and
    ``cat_single`` keeps the cat that makes it contiguous."""
    import torch.nn.functional as F

    class Attention(torch.nn.Module):
        def forward(self, q):
            return torch.cat([F.scaled_dot_product_attention(q, q, q)]).view(2, 4, -1)

    q = torch.randn(2, 4, 8, 16)
    gm = torch.export.export(Attention(), (q,)).module()
    result = rewrite.load("rules/cleanup.rw").apply(gm, example_inputs=(q,))
    assert "cat_single" not in result.counts
    transposed = torch.randn(2, 8, 4, 16).transpose(1, 2)
    torch.testing.assert_close(result.graph_module(transposed), Attention()(transposed))


def test_is_contiguous_still_known_after_an_op_that_lays_out_afresh():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.l(x).contiguous().view(-1)

    gm = torch.fx.symbolic_trace(M())
    x = torch.randn(3, 4)
    result = rewrite.parse("rule c: contiguous(x) where is_contiguous(x) => x").apply(gm, example_inputs=(x,))
    assert result.counts == {"c": 1}
    torch.testing.assert_close(result.graph_module(x), gm(x))


def _status(text: str, max_examples: int = 100) -> str:
    from rewrite.trust.verify import verify_rule

    return verify_rule(rewrite.parse(text), "wrong", max_examples=max_examples, seed=0).status


@pytest.mark.parametrize("text", [
    "rule wrong: slice(x, 1, 0, 512) => x",   # a no-op only up to 512 along dim 1
    "rule wrong: flatten(x, 1, 4) => flatten(x, 1)",   # the same only up to rank 5
])
def test_verify_reaches_one_past_a_patterns_literal(text):
    """Large shapes reach one past the literals a pattern is written with: a size
    (513) or a rank (6) the default draws never meet."""
    assert _status(text) == "counterexample"


def test_verify_draws_attention_dropout():
    """A rule that drops attention dropout is wrong: verify draws ``dropout_p`` > 0
    now and then, pattern and replacement from one seeded generator."""
    text = ("rule wrong: F.scaled_dot_product_attention(q, k, v, m, _, c, s) => "
            "aten.scaled_dot_product_attention(q, k, v, m, 0.0, c, s)")
    assert _status(text) == "counterexample"


# ---------------------------------------------------------------- probe AV (shipped sets on unusual layers)


@pytest.mark.parametrize("kind", ["linear", "conv1x1"])
def test_bn_with_eps_above_its_variance_is_not_folded_into_the_next_layer(kind):
    """``bn_input_centred`` measures the running mean in running standard deviations,
    ``sqrt(var)``: an eps far above the variance (mean 7.9, var 1e-10, eps 1) would
    hide an offset of 1e5 spreads, and the folded model was 5-7% off on inputs the
    batch norm's statistics describe."""
    nn = torch.nn
    if kind == "linear":
        bn, layer, x = nn.BatchNorm1d(16, eps=1.0), nn.Linear(16, 8, bias=False), torch.randn(4, 16)
    else:
        bn, layer, x = nn.BatchNorm2d(16, eps=1.0), nn.Conv2d(16, 8, 1, bias=False), torch.randn(2, 16, 3, 3)
    model = nn.Sequential(bn, layer).eval()
    with torch.no_grad():
        bn.running_mean.fill_(7.9)
        bn.running_var.fill_(1e-10)
    gm = torch.export.export(model, (x,)).module()
    result = rewrite.load("rules/fusion.rw").apply(gm, example_inputs=(x,))
    assert not {"bn_linear", "bn_conv"} & set(result.counts)
    drawn = 7.9 + 1e-5 * torch.randn_like(x)
    with torch.no_grad():
        torch.testing.assert_close(result.graph_module(drawn), model(drawn))


def test_bn_centred_folds_a_dead_channel_and_a_centred_one():
    """A channel with zero mean is centred whatever its variance (a dead ReLU channel:
    mean 0, var 0), and a usual batch norm still folds into the linear after it."""
    nn = torch.nn
    bn, layer = nn.BatchNorm1d(4), nn.Linear(4, 3)
    model = nn.Sequential(bn, layer).eval()
    with torch.no_grad():
        bn.running_mean.copy_(torch.tensor([0.0, 0.5, -1.0, 0.0]))
        bn.running_var.copy_(torch.tensor([0.0, 1.0, 2.0, 1e-12]))
    x = torch.randn(5, 4)
    gm = torch.export.export(model, (x,)).module()
    result = rewrite.load("rules/fusion.rw").apply(gm, example_inputs=(x,))
    assert result.counts.get("bn_linear") == 1
    with torch.no_grad():
        torch.testing.assert_close(result.graph_module(x), model(x), rtol=1e-4, atol=1e-4)


def test_coverage_names_the_padding_mode_of_a_conv_left_float():
    import rewrite.quant as rq

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), torch.nn.ReLU()).eval()
    batches = [(torch.randn(2, 3, 6, 6),) for _ in range(2)]
    quantized = rq.quantize(model, batches, capture="fx")
    text = str(rq.coverage(quantized))
    assert "padding_mode='reflect'" in text and "leaf module" not in text
    with torch.no_grad():
        torch.testing.assert_close(quantized(batches[0][0]), model(batches[0][0]))


@pytest.mark.parametrize("level", ["fx", "export"])
@pytest.mark.parametrize("spelling", ["flatten", "reshape"])
def test_conv_flatten_bn_keeps_the_batch_norms_contiguous_output(level, spelling):
    """A rank-3 batch norm returns a contiguous tensor for any input layout; folded,
    the flatten of a channels_last input's conv output is a strided view (a caller's
    ``out.view(n, -1)`` failed). The fold ends in ``contiguous``: no copy when the
    view is contiguous already."""
    nn = torch.nn

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.bn = nn.Conv2d(2, 3, 2, stride=3, bias=False), nn.BatchNorm1d(3)

        def forward(self, x):
            y = self.c(x)
            return self.bn(y.flatten(2) if spelling == "flatten" else y.reshape(2, 3, -1))

    torch.manual_seed(0)
    model = M().eval()
    example = torch.randn(2, 2, 7, 8)
    gm = torch.fx.symbolic_trace(model) if level == "fx" else torch.export.export(model, (example,)).module()
    result = rewrite.load("rules/fusion.rw").apply(gm, example_inputs=(example,))
    assert sum(result.counts.values()) == 1 and "batch_norm" not in result.graph_module.code
    caller = torch.randn(2, 2, 7, 8).contiguous(memory_format=torch.channels_last)
    out, expected = result.graph_module(caller), model(caller)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert out.stride() == expected.stride()
    out.view(2, -1)


def test_a_tolerance_allows_two_subnormal_steps_and_no_more():
    """A fold whose outputs are subnormal (4e-45 in float32) differs by a step of the
    dtype's smallest subnormal, all rounding: a scale-relative bound fell below one
    step and the README's conv_bn property test failed on such an instance."""
    from rewrite.trust.tolerance import Tolerance, compare_tensors

    step = torch.finfo(torch.float32).tiny * torch.finfo(torch.float32).eps
    ref = torch.tensor([-3 * step, 0.0, step], dtype=torch.float32)
    for kind in ("approx", "exact"):
        tol = _held_to_own_scale(Tolerance.of(torch.float32, kind))
        assert compare_tensors(ref, ref + torch.tensor([-step, 0.0, step]), tol)[2] is None
        assert compare_tensors(ref, ref + torch.tensor([-4 * step, 0.0, 0.0]), tol)[2] is not None
    assert compare_tensors(ref, ref + torch.tensor([step, 0.0, 0.0]), Tolerance.bitwise())[2] is not None


def _held_to_own_scale(tol):
    import attrs

    return attrs.evolve(tol, unit=0.0)  # the check's second look: held to the tensor's own scale


# ---------------------------------------------------------------- probe AX (analysis)


def test_analyze_with_too_few_inputs_says_so():
    from rewrite.analysis import analyze

    class M(torch.nn.Module):
        def forward(self, x, y, z=None):
            return x + y

    gm = torch.fx.symbolic_trace(M())
    with pytest.raises(ValueError, match="analyze got 1 inputs for a graph of 3"):
        analyze(gm, (torch.randn(2),))
    assert analyze(gm, (torch.randn(2), torch.randn(2))).totals.elementwise == 2


def test_fx_and_export_measure_an_eval_batch_norm_alike():
    """An eval-mode batch norm never reads its step counter: a symbolic_trace module
    call was charged for it, an export graph (which reads the other four) was not."""
    from rewrite.analysis import analyze
    from rewrite.capture import capture_with_inputs

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).eval()
    x = torch.randn(1, 3, 8, 8)
    totals = [analyze(*capture_with_inputs(model, (x,), level)).totals for level in ("fx", "export")]
    assert totals[0].bytes_read == totals[1].bytes_read and totals[0].param_bytes == totals[1].param_bytes
    train = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.BatchNorm2d(4)).train())
    assert analyze(train, (torch.randn(2, 4, 3, 3),)).totals.param_bytes == 4 * 4 * 4 + 8  # + the counter


def test_report_says_attention_is_not_counted_on_cpu():
    """A rewrite to scaled_dot_product_attention seemed to save the attention's
    matmuls (FLOPs -8% on a small BERT): CPU attention counts 0 FLOPs, as in
    FlopCounterMode. The report says so, and its op rows stay aligned."""
    transformers = pytest.importorskip("transformers")
    from rewrite.capture import capture_with_inputs

    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, attn_implementation="eager")
    torch.manual_seed(0)
    model, ids = transformers.BertModel(cfg).eval(), torch.randint(0, 50, (1, 6))
    gm, inputs = capture_with_inputs(model, (ids,), "export")
    result = rewrite.load("rules/transformer.rw")["transformer"].apply(gm, example_inputs=inputs)
    assert result.counts
    text = str(result.report())
    assert "attention counts 0 FLOPs on CPU" in text
    rows = [line for line in text.splitlines() if line.startswith(("op ", "scaled_dot_product_attention", "softmax"))]
    assert len({len(line) for line in rows}) == 1  # one column width
