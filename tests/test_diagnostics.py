"""Tests for rewrite.language.diagnostics and rewrite.language.syntax: the printed
form of diagnostics, friendly syntax errors (exact message, code and position), and
that no input of any kind makes the front end raise anything but RuleError."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import rewrite
from rewrite.language import Diagnostic, RuleError, ast, format_diagnostic, load_program, load_program_text, parse_text
from rewrite.language.diagnostics import did_you_mean


def syntax(text: str) -> tuple:
    """(code, 'line:col', message, help) of the single syntax error of ``text``."""
    with pytest.raises(RuleError) as info:
        parse_text(text, "bad.rw")
    (d,) = info.value.diagnostics
    return d.code, f"{d.span.line}:{d.span.col}", d.message, d.help


# ---------------------------------------------------------------- printed form


def test_format_diagnostic_full_form():
    source = "# comment\n\nrule r: rleu(x) => x\n"
    d = Diagnostic(ast.Span("rules/bad.rw", 3, 9, 3, 13), "unknown op 'rleu'", "E102", help="did you mean 'relu'?")
    assert format_diagnostic(d, source) == (
        "rules/bad.rw:3:9: error: unknown op 'rleu' [E102]\n"
        "    rule r: rleu(x) => x\n"
        "            ^^^^\n"
        "  help: did you mean 'relu'?"
    )
    assert str(d) == "rules/bad.rw:3:9: error: unknown op 'rleu' [E102]"
    assert format_diagnostic(d) == str(d) + "\n  help: did you mean 'relu'?"


def test_format_multiline_span_underlines_to_end_of_first_line_and_notes():
    source = "rule a:\n  relu(x)\n  => x\n"
    d = Diagnostic(ast.Span("f.rw", 2, 3, 3, 7), "something", "E999", severity="warning",
                   related=((ast.Span("f.rw", 1, 6, 1, 7), "see here"),))
    assert format_diagnostic(d, source) == (
        "f.rw:2:3: warning: something [E999]\n"
        "      relu(x)\n"
        "      ^^^^^^^\n"
        "  note: f.rw:1:6: see here"
    )


def test_format_expands_tabs_consistently():
    d = Diagnostic(ast.Span("f.rw", 1, 2, 1, 6), "m", "E1")
    assert format_diagnostic(d, "\trleu(x)").splitlines()[1:] == ["        rleu(x)", "        ^^^^"]


def test_format_without_span_or_outside_source():
    assert str(Diagnostic(None, "nested too deeply", "E001")) == "error: nested too deeply [E001]"
    d = Diagnostic(ast.Span("f.rw", 9, 1, 9, 2), "m", "E1")
    assert format_diagnostic(d, "one line") == "f.rw:9:1: error: m [E1]"


def test_rule_error_str_and_summary():
    source = "rule a: rleu(x) => y\n"
    with pytest.raises(RuleError) as info:
        load_program_text(source, "t.rw")
    err = info.value
    text = str(err)
    assert text.startswith("t.rw:1:9: error: unknown op 'rleu' [E102]\n    rule a: rleu(x) => y\n            ^^^^\n")
    assert text.endswith("\n3 errors")
    assert err.summary() == "3 errors" and len(err.diagnostics) == 3
    assert err.sources == {"t.rw": source}
    one = RuleError([Diagnostic(None, "m", "E1"), Diagnostic(None, "w", "W1", severity="warning")])
    assert one.summary() == "1 error, 1 warning"


def test_rule_error_pickles():
    with pytest.raises(RuleError) as info:
        parse_text("rule r x", "p.rw")
    again = pickle.loads(pickle.dumps(info.value))
    assert again.diagnostics == info.value.diagnostics and str(again) == str(info.value)


def test_did_you_mean():
    assert did_you_mean("rleu", ["relu", "gelu", "selu"]) == "did you mean 'relu'?"
    assert did_you_mean("zzz", ["relu"]) is None
    assert did_you_mean("F.rleu", ["relu"], valid=lambda n: n == "F.relu") == "did you mean 'F.relu'?"
    assert did_you_mean("X.rleu", ["relu"], valid=lambda n: False) == "did you mean 'relu'?"


# ---------------------------------------------------------------- syntax errors


@pytest.mark.parametrize("text, expected", [
    # missing =>
    ("rule r: mul(x, 1) x", ("E007", "1:19", "expected '=>' after the pattern, found 'x'",
                             "a rule reads: rule NAME: PATTERN [where CONDITION] => REPLACEMENT")),
    ("rule r: relu(x) where single_use(x) x", ("E007", "1:37", "expected '=>' after the condition, found 'x'",
                                               "a rule reads: rule NAME: PATTERN [where CONDITION] => REPLACEMENT")),
    ("rule r: relu(x) = x", ("E007", "1:17", "expected '=>' after the pattern, found '='",
                             "a rule reads: rule NAME: PATTERN [where CONDITION] => REPLACEMENT")),
    ("rule r: relu(x) -> x", ("E007", "1:17", "expected '=>', found '->'",
                              "the pattern and the replacement are separated by '=>'")),
    ("rule r: relu(x) wehre single_use(x) => x",
     ("E007", "1:17", "expected '=>' after the pattern, found 'wehre'", "did you mean 'where'?")),
    # unbalanced brackets
    ("rule r: mul(x, 1", ("E005", "1:12", "'(' was never closed", "add ')' before end of file at 1:17")),
    ("rule r: mul(x, relu(y) => x\nrule s: relu(x) => x",
     ("E005", "1:12", "'(' was never closed", "add ')' before '=>' at 1:24")),
    ("rule r: f([x, y) => x", ("E005", "1:16", "mismatched ')': '[' at 1:11 is still open", "close it with ']' first")),
    ("rule r: relu(x)) => x", ("E005", "1:16", "unmatched ')'", "remove it, or add the '(' it closes")),
    # missing ':'
    ("rule r relu(x) => x", ("E008", "1:8", "expected ':' after the rule name 'r', found 'relu'",
                             "a rule reads: rule NAME: PATTERN [where CONDITION] => REPLACEMENT")),
    ("rule r(priority=1) relu(x) => x", ("E008", "1:20", "expected ':' after the rule name 'r', found 'relu'",
                                         "a rule reads: rule NAME: PATTERN [where CONDITION] => REPLACEMENT")),
    # = for ==
    ("rule r: to(x, d) where dtype(x) = d => x",
     ("E006", "1:33", "'=' is not a comparison; write '=='", "conditions compare with ==, !=, <, <=, >, >=, in")),
    # strings and characters
    ('rule r: to(x, "float32) => x', ("E003", "1:15", "unterminated string", 'close the string with " on the same line')),
    ("rule r: relu(x) $ => x", ("E002", "1:17", "unexpected character '$'", None)),
    ("rule r: relu(x) where a(x) && b(x) => x",
     ("E002", "1:28", "unexpected character '&'", "write 'and' to combine conditions")),
    ("rule r: relu(x) => x\x00", ("E002", "1:21", "unexpected character U+0000", None)),
    # end of file and missing parts
    ("rule r: relu(x) =>", ("E004", "1:19", "expected a replacement after '=>', found end of file",
                            "a rule reads: rule NAME: PATTERN [where CONDITION] => REPLACEMENT")),
    ("rule r: relu(x) where => x", ("E001", "1:23", "expected a condition after 'where', found '=>'",
                                    "a rule reads: rule NAME: PATTERN [where CONDITION] => REPLACEMENT")),
    ("rule", ("E004", "1:5", "unexpected end of file; expected a name", None)),
    # keywords and stray tokens
    ("rule in: relu(x) => x", ("E001", "1:6", "'in' is a reserved word and cannot be used as a name",
                               "choose another name")),
    ("rlue r: relu(x) => x", ("E001", "1:1",
                              "unexpected 'rlue'; expected 'family', 'import', 'param', 'rule', 'ruleset' or end of file",
                              "did you mean 'rule'?")),
    ("rule r: f(x y) => x", ("E001", "1:13", "unexpected 'y'; expected ')' or ','", None)),
    # errors found while building the AST
    ("rule r: f(a=1, x, y) => x", ("E009", "1:16", "positional argument after a keyword argument",
                                "write positional arguments first, then name=value arguments")),
    ("rule r: f(..., x, y) => x", ("E009", "1:11", "'...' must be the last argument of a call",
                                "move '...' to the end: it stands for the arguments not written")),
    ("rule r: to(x, torch.flaot32) => x", ("E010", "1:15", "unknown dtype 'torch.flaot32'",
                                           "did you mean 'torch.float32'?")),
    ("rule r: f(x, a.b) => x", ("E010", "1:14", "'a.b' is not a value; a qualified name can only be called",
                                "call it, 'a.b(...)', or bind a variable in the pattern")),
    ("rule r(shared=true): f(x) => x", ("E010", "1:15", "'true' is not a literal; write 'True'",
                                        "literals use Python spelling: True, False, None")),
])
def test_syntax_errors(text, expected):
    assert syntax(text) == expected


def test_syntax_errors_span_multiple_lines():
    assert syntax("rule a: relu(x) => x\n\nrule b:\n  gelu(x\n\nrule c: silu(x) => x")[:3] == (
        "E005", "4:7", "'(' was never closed")


def test_several_ast_errors_are_reported_together():
    with pytest.raises(RuleError) as info:
        parse_text("rule r: f(a=1, x) => torch.half2")
    assert [d.code for d in info.value.diagnostics] == ["E009", "E010"]


def test_deep_nesting_is_an_error_not_a_crash():
    depth = 5000
    with pytest.raises(RuleError) as info:
        parse_text("rule r: " + "f(" * depth + "x" + ")" * depth + " => x")
    assert info.value.diagnostics[0].code == "E001"


# ---------------------------------------------------------------- robustness


VALID = '''import "lib.rw"
family act = relu | gelu
# x * 1 -> x
rule mul_one(priority=2): mul(x, 1) => x
rule f32(shared=False): (relu | act)(x) as y where dtype(x) in (torch.float32, torch.bfloat16) and shape(x)[1] > 3 and not is_param(x) => y
rule cb: batch_norm(conv(x, w, b, ...) as c, m, v, g, bb, training=False, eps=1e-5, ...) where const(w) => c
ruleset s = seq(fixpoint(mul_one, f32), once(cb))
'''


def _only_rule_errors(text: str) -> None:
    for call in (lambda: parse_text(text, "fuzz.rw"), lambda: load_program_text(text, "<fuzz>")):
        try:
            call()
        except RuleError as err:
            str(err)  # formatting must not fail either


@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",)), max_size=80))
def test_random_text_raises_only_rule_error(text):
    _only_rule_errors(text)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=list("rule family ruleset import where and or not in as ()[]|,:=>._x1\"'#\n."), max_size=60))
def test_random_token_soup_raises_only_rule_error(text):
    _only_rule_errors(text)


@st.composite
def _mutations(draw):
    data = bytearray(VALID.encode())
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "delete", "insert", "truncate"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[pos] = draw(st.integers(0, 255))
        elif kind == "delete" and data:
            del data[pos: pos + draw(st.integers(1, 8))]
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=4))
        else:
            del data[pos:]
    return bytes(data)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_mutations())
def test_byte_mutations_raise_only_rule_error(tmp_path, data):
    (tmp_path / "lib.rw").write_text("rule lib: relu(x) => x\n")
    _only_rule_errors(data.decode("utf-8", "replace"))
    path = tmp_path / "main.rw"
    path.write_bytes(data)
    try:
        load_program([path])
    except RuleError as err:
        str(err)


# ---------------------------------------------------------------- the documentation


DOC = Path(__file__).resolve().parents[1] / "docs" / "language.md"
_SECTION = re.compile(r"### (E\d{3}): [^\n]*\n\n```rw\n(.*?)```\n\n```text\n(.*?)\n```", re.S)


def _doc_sections() -> list:
    return _SECTION.findall(DOC.read_text())


def test_every_error_code_is_documented():
    source = "".join(p.read_text() for p in (Path(__file__).resolve().parents[1] / "rewrite" / "language").glob("*.py"))
    emitted = set(re.findall(r'"(E\d{3})"', source))
    documented = {code for code, _, _ in _doc_sections()}
    assert emitted and emitted == documented


@pytest.mark.parametrize("code, example, output", _doc_sections(), ids=lambda v: v if str(v).startswith("E") else "")
def test_documented_error_examples_are_exact(code, example, output, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if code == "E402":
        (tmp_path / "rules").mkdir()
        (tmp_path / "rules" / "cleanup.rw").write_text("")
        (tmp_path / "rules" / "main.rw").write_text(example)
        paths = ["rules/main.rw"]
    elif code == "E403":
        a, b = example.split("# b.rw\n")
        (tmp_path / "a.rw").write_text(a)
        (tmp_path / "b.rw").write_text("# b.rw\n" + b)
        paths = ["a.rw"]
    elif "# policy.rw\n" in example:  # E410, E412: an import of a parametrized file
        main, policy = example.split("# policy.rw\n")
        (tmp_path / "example.rw").write_text(main)
        (tmp_path / "policy.rw").write_text(policy)
        paths = ["example.rw"]
    else:
        (tmp_path / "example.rw").write_text(example)
        paths = ["example.rw"]
    with pytest.raises(RuleError) as info:
        load_program(paths)
    (d,) = info.value.diagnostics
    assert d.code == code
    assert format_diagnostic(d, info.value.sources[d.span.path]) == output


def test_documented_rule_text_parses():
    text = DOC.read_text()
    reference = text.index("## Error reference")
    blocks = re.findall(r"```rw\n(.*?)```", text[:reference], re.S)
    assert len(blocks) >= 5
    for block in blocks:
        parse_text(block, "doc.rw")
    # The opening example is a whole program: it must also pass the checker, next to
    # the shipped cleanup.rw it imports (a rule of the same name would be an E401).
    opening = "\n".join(line for line in blocks[0].splitlines() if not line.startswith("import"))
    assert [r.name for r in load_program_text(opening).rules] == ["times_one", "conv_bn", "act_then_id", "cast_same"]
    shipped = rewrite.load(str(Path(__file__).resolve().parents[1] / "rules" / "cleanup.rw"))
    assert "times_one" in rewrite.parse(blocks[0], str(DOC.parents[1] / "rules" / "doc.rw")).rules
    assert not set(shipped.rules) & {"times_one", "conv_bn", "act_then_id", "cast_same"}


# ---------------------------------------------------------------- API misuse: told, not a traceback


def _tiny():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).eval()
    return model, torch.randn(1, 3, 8, 8)


def test_apply_refuses_what_it_cannot_rewrite_with_a_clear_error():
    rules = rewrite.load("fusion.rw")
    model, x = _tiny()
    with pytest.raises(TypeError, match="needs a torch.fx.GraphModule.*not str"):
        rules.apply("model", (x,))
    with pytest.raises(TypeError, match="TorchScript"):
        rules.apply(torch.jit.script(model), (x,))

    class Untraceable(torch.nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x  # control flow on a value

    with pytest.raises(TypeError, match="could not capture Untraceable.*torch.export.export"):
        rules.apply(Untraceable(), (x,))


@pytest.mark.parametrize("options, message", [
    ({"trials": 0}, "trials must be a positive int"),
    ({"rtol": -1.0}, "rtol must be a finite non-negative number"),
    ({"atol": float("nan")}, "atol must be a finite non-negative number"),
])
def test_apply_refuses_bad_check_options(options, message):
    model, x = _tiny()
    with pytest.raises(ValueError, match=message):
        rewrite.load("fusion.rw").apply(torch.fx.symbolic_trace(model), (x,), **options)


def test_backend_and_inductor_pass_take_a_rule_set_or_its_path():
    with pytest.raises(TypeError, match="needs a RuleSet"):
        rewrite.backend(42)
    with pytest.raises(TypeError, match="needs a RuleSet"):
        rewrite.inductor_pass(["fusion.rw"])
    model, x = _tiny()
    path = str(rewrite.rules_dir() / "fusion.rw")
    compiled = torch.compile(model, backend=rewrite.backend(path))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))


def test_explain_names_the_rules_it_has():
    model, _ = _tiny()
    with pytest.raises(KeyError, match="no rule named 'nope'; have .*conv_bn"):
        rewrite.load("fusion.rw").explain(torch.fx.symbolic_trace(model), rule="nope")


def test_a_where_clause_after_the_replacement_says_where_it_goes():
    with pytest.raises(RuleError) as info:
        rewrite.parse("rule r: add(x, 0) => x where is_float(x)\n")
    text = str(info.value)
    assert ":1:24:" in text and "between the pattern and '=>'" in text
    with pytest.raises(RuleError, match="reserved word"):
        rewrite.parse("rule where: relu(x) => x\n")


@pytest.mark.parametrize("bom", [b"", b"\xef\xbb\xbf"])
def test_a_byte_that_is_not_utf8_is_reported_where_it_is(bom, tmp_path, capsys):
    from rewrite.cli import main

    path = tmp_path / "latin1.rw"
    path.write_bytes(bom + b"rule r: relu(x) => x\n# caf\xe9\n")
    with pytest.raises(rewrite.RuleError) as info:
        rewrite.load(str(path))
    assert ":2:6:" in str(info.value) and "E402" in str(info.value)
    assert main(["fmt", str(path)]) == 1
    assert f"{path}:2:6: error" in capsys.readouterr().err
