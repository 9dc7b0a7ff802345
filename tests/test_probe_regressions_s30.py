"""Regressions from session 30: a rule that changes its result's layout verified
(verification compared values only, and its own output restore hid the layout), and
``broadcasts_to`` held for a number of a wider kind than the tensor. Each test
failed before its fix."""

from __future__ import annotations

import pytest
import torch

import rewrite
from rewrite.trust.verify import verify_rule


def _verdict(text: str, name: str, n: int = 10, seed: int = 0):
    return verify_rule(rewrite.parse(text, "probe.rw"), name, max_examples=n, seed=seed)


# ---------------------------------------------------------------- layouts in verification


@pytest.mark.parametrize("name, text", [
    # clone keeps a transposed x transposed: a .view(-1) after it raises
    ("contiguous_clone", "contiguous(x) => clone(x)"),
    # the same, spelled with a memory format the original asks for
    ("contiguous_dropped", "contiguous(x) where is_float(x) => mul(x, 1)"),
])
def test_a_rule_that_changes_its_results_layout_fails_verification(name, text):
    verdict = _verdict(f"rule {name}: {text}", name)
    assert verdict.status == "counterexample"
    assert "view" in verdict.reason and "strides" in verdict.reason


def test_layout_keeping_rules_still_verify():
    for name, text in (("contiguous_twice", "contiguous(contiguous(x)) => contiguous(x)"),
                       ("mul_inside", "mul(contiguous(x), 2) => contiguous(mul(x, 2))"),
                       ("relu_relu", "relu(relu(x)) => relu(x)")):
        assert _verdict(f"rule {name}: {text}", name).status == "ok", name


def test_a_rule_whose_file_relays_the_view_is_not_blamed():
    # the rule alone breaks a view after it; its file lowers such a view to a reshape
    text = """
rule contiguous_clone: contiguous(x) => clone(x)
rule view_reshape: view(clone(x), s) => reshape(clone(x), s)
"""
    assert _verdict(text, "contiguous_clone").status == "ok"


# ---------------------------------------------------------------- broadcasts_to with numbers


class _AddZero(torch.nn.Module):
    def forward(self, x):
        return (x + 0.0) * 2


@pytest.mark.parametrize("x, fires", [(torch.arange(4), False), (torch.arange(4) > 1, False),
                                      (torch.randn(4), True), (torch.randn(4).half(), True)])
def test_broadcasts_to_a_number_keeps_the_dtype(x, fires):
    rules = rewrite.parse("rule add_zero: add(x, c) where broadcasts_to(x, c) and c == 0 => x")
    gm = torch.export.export(_AddZero(), (x,)).module()
    result = rules.apply(gm, (x,), check=False)
    assert bool(result.counts) == fires
    out = result.graph_module(x)
    assert out.dtype == _AddZero()(x).dtype
    assert torch.equal(out, _AddZero()(x))


# ---------------------------------------------------------------- a fold's layout


class _Conv1dBnView(torch.nn.Module):
    """A 1-d conv whose weight is strided as channels last (``(k*c, 1, c)``): the conv's
    result is strided so too, and the batch norm after it makes it contiguous."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(4, 6, 3)
        self.bn = torch.nn.BatchNorm1d(6).eval()
        with torch.no_grad():
            self.conv.weight = torch.nn.Parameter(self.conv.weight.detach().transpose(1, 2).contiguous()
                                                  .transpose(1, 2))
            self.bn.running_mean.normal_()
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        y = self.bn(self.conv(x))
        return y.view(y.shape[0], -1) * 2


def test_a_folded_conv_keeps_the_layout_the_batch_norm_gave():
    # (symbolic_trace: torch.export cannot capture this model, its fake batch norm
    # keeps the strided layout and the view fails while tracing)
    model = _Conv1dBnView().eval()
    x = torch.randn(2, 4, 10)
    assert not model.conv(x).is_contiguous()  # the premise: the conv alone is strided
    gm = torch.fx.symbolic_trace(model)
    result = rewrite.load("rules/fusion.rw").apply(gm, (x,), check=False)
    assert sum(result.counts.values()) == 1
    torch.testing.assert_close(result.graph_module(x), model(x), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- QAT's error names what stays float


class _CircularConvs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = torch.nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular")
        self.c2 = torch.nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect")

    def forward(self, x):
        return self.c2(torch.relu(self.c(x)))


def test_prepare_qat_names_the_convs_it_could_not_quantize():
    import rewrite.qat as rqat

    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(rqat.QATError) as err:
        rqat.prepare_qat(_CircularConvs().eval(), (x,), calibration=[(x,)], capture="fx")
    message = str(err.value)
    assert "has no conv" not in message
    assert "c (conv)" in message and "c2 (conv)" in message and "padding_mode='circular'" in message


# ---------------------------------------------------------------- ops a replacement may not build


@pytest.mark.parametrize("op", [
    "aten._reshape_alias(x, [1024], [1])",     # reads past its storage: a segfault
    "aten._sparse_coo_tensor_unsafe(x, x, [10])",
    "aten.empty_like(x)", "aten.new_empty(x, [4])", "torch.empty_like(x)", "Tensor.new_empty(x, [4])",
    "aten._backward(x, [x])", "Tensor.retain_grad(x)",
])
def test_a_replacement_may_not_build_unsafe_ops(op):
    with pytest.raises(rewrite.RuleError, match=r"E106") as err:
        rewrite.parse(f"rule r: sigmoid(x) => neg({op})", "probe.rw")
    assert "probe.rw:1:" in str(err.value)


def test_a_pattern_may_still_match_them_and_the_vocabularys_spellings_build():
    rewrite.parse("rule r: aten._unsafe_view(x, s) => aten.view(x, s)")
    rewrite.parse("rule r: aten.empty_like(x) => aten.zeros_like(x)")
    rewrite.parse("rule r: sigmoid(x) => aten._unsafe_view(tanh(x), [-1])")


def test_the_memory_unsafe_rule_no_longer_reaches_the_model():
    from rewrite.cli import main

    import pathlib
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "crash.rw"
        path.write_text("rule crash: sigmoid(x) => neg(aten._reshape_alias(x, [1073741824], [1]))\n")
        assert main(["check", "--verify", str(path)]) == 1


# ---------------------------------------------------------------- the language front end (probe H)


def _files(tmp_path, **texts):
    for name, text in texts.items():
        (tmp_path / f"{name}.rw").write_text(text)
    return tmp_path


def test_a_parameter_can_be_a_rules_option(tmp_path):
    _files(tmp_path, tmpl="param p\nparam q\nrule rr(priority=p, shared=q): relu(relu(x)) => relu(x)\n",
           main='import "tmpl.rw" with p = 3, q = True\n')
    (rule,) = rewrite.load(str(tmp_path / "main.rw"))
    assert rule.priority == 3


def test_a_parameter_compared_in_a_where_clause_is_checked_as_bound(tmp_path):
    _files(tmp_path, policy="param lowp\nrule r_lowp: relu(relu(x)) where shape(x) > 3 and dtype(x) == lowp => relu(x)\n",
           main='import "policy.rw" with lowp = "bfloat16" as bf16\n')
    with pytest.raises(rewrite.RuleError) as err:
        rewrite.load(str(tmp_path / "main.rw"))
    codes = [d.code for d in err.value.diagnostics]
    assert codes == ["E306", "E306"]  # shape(x) > 3, and a dtype compared with a string


@pytest.mark.parametrize("literal, ok", [("9223372036854775807", True), ("-9223372036854775808", True),
                                         ("9223372036854775808", False), ("-9223372036854775809", False),
                                         ("1e-400", False), ("0e5", True), ("5e-324", True)])
def test_literals_out_of_range_are_refused_on_both_sides(literal, ok):
    text = f"rule r: add(x, {literal}) => x"
    if ok:
        rewrite.parse(text)
    else:
        with pytest.raises(rewrite.RuleError, match="E010"):
            rewrite.parse(text)


def test_parameters_declared_twice_or_as_the_wildcard_are_refused(tmp_path):
    _files(tmp_path, tmpl="param p\nparam p\nparam _\nrule rr: mul(x, _) where rank(x) == p => x\n",
           main='import "tmpl.rw" with p = 4, _ = 1\n')
    with pytest.raises(rewrite.RuleError) as err:
        rewrite.load(str(tmp_path / "main.rw"))
    assert [d.code for d in err.value.diagnostics] == ["E413", "E413"]


def test_parse_names_a_bad_path_argument():
    with pytest.raises(TypeError, match="path"):
        rewrite.parse("rule r: relu(relu(x)) => relu(x)", None)


def test_fmt_reports_unreadable_files_as_check_does(tmp_path, capsys):
    from rewrite.cli import main

    assert main(["fmt", str(tmp_path / "missing.rw")]) == 1
    assert "[E402]" in capsys.readouterr().err
    bad = tmp_path / "bad.rw"
    bad.write_bytes(b"rule a: relu(relu(x)) => relu(x)\n\xff\n")
    assert main(["fmt", str(bad)]) == 1
    assert "[E402]" in capsys.readouterr().err


def test_fmt_escapes_what_stdout_cannot_encode(tmp_path, monkeypatch, capsys):
    import io
    import sys

    from rewrite.cli import main

    path = tmp_path / "cafe.rw"
    path.write_text("# caf\u00e9\nrule r: relu(relu(x)) => relu(x)\n", encoding="utf-8")
    out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["fmt", str(path)]) == 0
    out.flush()
    assert out.buffer.getvalue().decode("ascii").startswith("# caf\\xe9")


def test_explain_names_a_missing_rule_without_a_model(capsys):
    from rewrite.cli import main

    assert main(["explain", "rules/cleanup.rw", "--rule", "nope"]) == 2
    assert "no rule named 'nope'" in capsys.readouterr().err


def test_fmt_keeps_a_trailing_comment_with_the_declaration_it_follows():
    from rewrite.language import format_source

    out = format_source("rule a: relu(relu(x)) => relu(x) rule b: neg(neg(x)) => x # about b only\n")
    assert out == "rule a: relu(relu(x)) => relu(x)\nrule b: neg(neg(x)) => x  # about b only\n"
    assert format_source(out) == out


@pytest.mark.parametrize("clause", ["module_name(x) > 3", "module_name(x) == 3"])
def test_a_module_name_compared_with_a_number_never_holds(clause):
    with pytest.raises(rewrite.RuleError, match="E306"):
        rewrite.parse(f"rule r: relu(x) where {clause} => x")


# ---------------------------------------------------------------- verification meets large shapes (probe G)


@pytest.mark.parametrize("name, text", [
    # right only when the last dim is 4
    ("mean_ge4", "mean(x, -1) where shape(x)[-1] >= 4 and is_float(x) => mul(sum(x, -1), 0.25)"),
    # right only up to rank 4: a video tensor (N, C, T, H, W) keeps a dim
    ("flat13", "flatten(x, 1, 3) => flatten(x, 1)"),
])
def test_rules_wrong_only_past_rank_4_or_a_dim_of_4_fail_verification(name, text):
    # a large shape is a tenth of the draws (and the leading one's big dim may not be the
    # last): 40 instances meet one whatever hypothesis' state (6 of 6 seeds; 10: 4 of 6)
    assert _verdict(f"rule {name}: {text}", name, n=40).status == "counterexample"


# ---------------------------------------------------------------- quiet fact inference (probe F)


class _Baddbmm(torch.nn.Module):
    def forward(self, bias, q, k):
        return torch.baddbmm(bias, q, k, beta=1.0, alpha=0.5)


def test_a_fact_torch_cannot_infer_logs_no_error(caplog):
    from torch.export import Dim

    torch.manual_seed(0)  # the outputs compared below: the same every run, whatever ran before
    args = (torch.randn(4, 1, 8), torch.randn(4, 8, 16), torch.randn(4, 16, 8))
    b, s = Dim("B", min=1, max=64), Dim("S", min=2, max=64)
    gm = torch.export.export(_Baddbmm(), args, dynamic_shapes=({0: b, 2: s}, {0: b, 1: s}, {0: b, 2: s}),
                             strict=False).module()
    with caplog.at_level("ERROR", logger="torch._subclasses.fake_tensor"):
        result = rewrite.load("rules/amp_bf16.rw").apply(gm, example_inputs=args)
    assert result.counts == {"baddbmm_bf16": 1}
    assert not [r for r in caplog.records if r.name.startswith("torch._subclasses.fake_tensor")]
    # sums of 16 bfloat16 products of unit normals: each rounded at about 1e-2 of its magnitude
    torch.testing.assert_close(result.graph_module(*args), _Baddbmm()(*args), rtol=2e-2, atol=5e-2)
