"""The formatter: ``parse(format(ast)) == ast`` for the printer and for ``rewrite fmt``
(on the shipped rule files and on hypothesis-generated modules), ``fmt`` is idempotent,
keeps every comment, wraps at 100 columns; ``--check`` and ``--write``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rewrite.cli import main
from rewrite.language import ast, format_module, format_source, parse_text
from rewrite.language.limits import MAX_NESTING, nesting_depth
from rewrite.language.parser import DTYPES
from rewrite.language.program import one_line_end

RULES = sorted(str(p) for p in (Path(__file__).resolve().parents[1] / "rules").rglob("*.rw"))
BENCH_RULES = sorted(str(p) for p in (Path(__file__).resolve().parents[1] / "benchmarks").rglob("*.rw"))
KEYWORDS = {"rule", "family", "ruleset", "import", "where", "and", "or", "not", "in", "as",
            "true", "false", "none", "null", "True", "False", "None"}


def _comments(text: str) -> list:
    """Comment texts of a file, in order (a '#' inside a string is not a comment)."""
    no_strings = re.sub(r'"([^"\\\n]|\\.)*"|\'([^\'\\\n]|\\.)*\'', '""', text)
    return [m.strip() for m in re.findall(r"#[^\n]*", no_strings)]


# ---------------------------------------------------------------- shipped files


@pytest.mark.parametrize("path", RULES, ids=lambda p: Path(p).name)
def test_printer_round_trips_shipped_files(path):
    module = parse_text(Path(path).read_text(encoding="utf-8"), path)
    assert parse_text(format_module(module), path) == module


@pytest.mark.parametrize("path", RULES, ids=lambda p: Path(p).name)
def test_fmt_keeps_meaning_and_comments_and_is_idempotent(path):
    text = Path(path).read_text(encoding="utf-8")
    formatted = format_source(text, path)
    assert parse_text(formatted, path) == parse_text(text, path)
    assert _comments(formatted) == _comments(text)
    assert format_source(formatted, path) == formatted
    assert all(len(line) <= 100 for line in formatted.splitlines()), path


@pytest.mark.parametrize("path", RULES + BENCH_RULES, ids=lambda p: Path(p).name)
def test_shipped_rule_files_are_as_fmt_writes_them(path, capsys):
    """`rewrite fmt --check` is what a user runs in their CI: the files we ship pass it."""
    assert main(["fmt", "--check", path]) == 0, capsys.readouterr()


def test_fmt_hangs_a_call_whose_first_argument_does_not_fit_after_its_bracket():
    text = ("rule r: (reshape_as | reshape | view)(batch_norm((flatten | reshape | view)(linear(x, w, b) "
            "as l, ...) as f, mean, var, gamma, beta, training=False, eps=eps, ...), _) as r => x\n")
    lines = format_source(text).splitlines()
    assert lines[1] == "    (reshape_as | reshape | view)("
    assert lines[2].startswith("        batch_norm((flatten | reshape | view)(linear(")
    short_head = "rule r: to(conv(to(x, lowp), cast(w, lowp), cast(b, lowp), stride, padding, dilation, " \
                 "groups, x, y, z), torch.float32) => x\n"
    assert format_source(short_head).splitlines()[1].startswith("    to(conv(")  # hanging would gain 2


def test_fmt_layout_of_a_long_rule():
    text = ("rule conv_bn(priority=10): batch_norm(conv(x, w, b, stride, padding, dilation, groups) as c, "
            "mean, var, gamma, beta, training=False, eps=eps, ...) where const(w, b, mean, var, gamma, beta) "
            "and single_use(c) => conv(x, conv_bn_weight(w, b, mean, var, gamma, beta, eps), "
            "conv_bn_bias(w, b, mean, var, gamma, beta, eps), stride, padding, dilation, groups)\n")
    assert format_source(text) == (
        "rule conv_bn(priority=10):\n"
        "    batch_norm(conv(x, w, b, stride, padding, dilation, groups) as c, mean, var, gamma, beta,\n"
        "               training=False, eps=eps, ...)\n"
        "    where const(w, b, mean, var, gamma, beta) and single_use(c)\n"
        "    => conv(x, conv_bn_weight(w, b, mean, var, gamma, beta, eps),\n"
        "            conv_bn_bias(w, b, mean, var, gamma, beta, eps), stride, padding, dilation, groups)\n"
    )


def test_fmt_normalizes_spacing_and_keeps_comments_where_they_are():
    text = ("# header\n\n\n# doc\nrule a:   mul( x ,1 )   =>  x    # trailing\n"
            "rule b: relu(  # inside\n   x) => x\n   # indented\n\n\nfamily   f = relu|gelu\n"
            "rule c: f(x) => x  rule d: neg(neg(y)) => y\nrule e: add(x, \"# no comment\") => x\n\n")
    assert format_source(text) == (
        "# header\n\n# doc\nrule a: mul(x, 1) => x  # trailing\n"
        "rule b: relu(  # inside\n   x) => x\n# indented\n\nfamily f = relu | gelu\n"
        "rule c: f(x) => x\nrule d: neg(neg(y)) => y\nrule e: add(x, \"# no comment\") => x\n")


def test_fmt_layout_of_a_long_multi_output_rule():
    text = ("rule layer_norm_from_native: aten.native_layer_norm(input, normalized_shape, weight, bias, eps) "
            "as (y, _, _) where single_use(y) => (layer_norm(input, normalized_shape, weight, bias, eps), _, _)\n")
    formatted = format_source(text)
    assert formatted == (
        "rule layer_norm_from_native:\n"
        "    aten.native_layer_norm(input, normalized_shape, weight, bias, eps) as (y, _, _)\n"
        "    where single_use(y)\n"
        "    => (layer_norm(input, normalized_shape, weight, bias, eps), _, _)\n"
    )
    assert parse_text(formatted) == parse_text(text)
    long = "rule r: cat(aten.split_with_sizes.default(some_long_input_name, [1, 2, 3, 4, 5, 6, 7], dim) " \
           "as (a, b, c, d, e, f, g), dim) where single_use(a) and single_use(b) => some_long_input_name\n"
    formatted = format_source(long)
    assert parse_text(formatted) == parse_text(long) and format_source(formatted) == formatted
    assert all(len(line) <= 100 for line in formatted.splitlines())


def test_fmt_of_an_empty_file():
    assert format_source("") == ""
    assert format_source("\n\n# only a comment\n\n") == "# only a comment\n"


# ---------------------------------------------------------------- generated modules

_names = st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,7}", fullmatch=True).filter(lambda s: s not in KEYWORDS)
_dotted = st.lists(_names, min_size=1, max_size=3).map(".".join).filter(
    lambda s: not (s.startswith("torch.") and s.count(".") == 1))
_floats = st.floats(allow_nan=False, allow_infinity=False)
_plain = st.one_of(st.integers(-10**9, 10**9), _floats, st.booleans(), st.none(), st.text(max_size=6))
_leaves = st.one_of(
    _names.map(ast.Var), st.just(ast.Wildcard()), _plain.map(ast.Literal),
    st.sampled_from(sorted(DTYPES)).map(ast.DTypeLit),
)


def _compound(children):
    callee = st.lists(_dotted, min_size=1, max_size=3).map(lambda ns: ast.OpRef(tuple(ns)))
    kwargs = st.lists(st.builds(ast.Keyword, _names, children), max_size=2).map(tuple)
    calls = st.builds(ast.Call, callee, st.lists(children, max_size=4).map(tuple), kwargs, st.booleans())
    return st.one_of(
        calls,
        st.lists(children, max_size=3).map(lambda xs: ast.TupleLit(tuple(xs))),
        st.lists(children, max_size=3).map(lambda xs: ast.ListLit(tuple(xs))),
        st.builds(ast.As, calls, _names),
        st.builds(ast.AsTuple, calls, st.lists(st.one_of(_names, st.just("_")), min_size=2, max_size=4).map(tuple)),
        st.builds(ast.Compare, st.sampled_from(["==", "!=", "<", "<=", ">", ">=", "in", "not in"]),
                  children, children),
        st.builds(ast.BoolOp, st.sampled_from(["and", "or"]), st.lists(children, min_size=2, max_size=3).map(tuple)),
        st.builds(ast.Not, children),
        st.builds(ast.Index, children, children),
    )


exprs = st.recursive(_leaves, _compound, max_leaves=16)
# the parser stores a literal option value as the plain value
_option_values = st.one_of(_plain, exprs.filter(lambda e: not isinstance(e, ast.Literal)))
_options = st.lists(st.builds(ast.RuleOption, _names, _option_values), max_size=3).map(tuple)
rules = st.builds(ast.Rule, _names, exprs, st.one_of(st.none(), exprs), exprs, _options)
_schedules = st.recursive(
    st.builds(ast.Schedule, _names, st.lists(_names.map(ast.ScheduleRef), min_size=0, max_size=4).map(tuple)),
    lambda inner: st.builds(ast.Schedule, _names, st.lists(
        st.one_of(_names.map(ast.ScheduleRef), inner), max_size=4).map(tuple)),
    max_leaves=8,
)
items = st.one_of(
    rules,
    st.builds(ast.Import, st.text(max_size=10)),
    st.builds(ast.Family, _names, st.lists(_dotted, min_size=1, max_size=4).map(tuple)),
    st.builds(ast.RuleSetDecl, _names, _schedules),
)
modules = st.lists(items, max_size=5).map(lambda xs: ast.Module("<string>", tuple(xs)))


@settings(max_examples=150, deadline=None)
@given(modules)
def test_printer_round_trips_generated_modules(module):
    text = format_module(module)
    assert parse_text(text) == module, text


@settings(max_examples=150, deadline=None)
@given(modules)
def test_fmt_round_trips_generated_modules_and_is_idempotent(module):
    formatted = format_source(format_module(module))
    assert parse_text(formatted) == module, formatted
    assert format_source(formatted) == formatted


# ---------------------------------------------------------------- deep nesting

_COMPARE_OPS = st.sampled_from(["==", "!=", "<", "<=", ">", ">=", "in", "not in"])


@st.composite
def _nested(draw, depth):
    """An expression nested exactly ``depth`` levels (as ``limits.nesting_depth``
    counts), one random construct a level, each with leaf siblings."""
    e = draw(_leaves)
    for _ in range(depth):
        sib = draw(_leaves)
        kind = draw(st.sampled_from(["list", "tuple", "call", "keyword", "as", "compare", "bool", "not", "index"]))
        first = draw(st.booleans())
        pair = (e, sib) if first else (sib, e)
        if kind == "list":
            e = ast.ListLit(pair if draw(st.booleans()) else (e,))
        elif kind == "tuple":
            e = ast.TupleLit(pair if draw(st.booleans()) else (e,))
        elif kind == "call":
            e = ast.Call(ast.OpRef((draw(_dotted),)), pair, (), draw(st.booleans()))
        elif kind == "keyword":
            e = ast.Call(ast.OpRef((draw(_dotted),)), (sib,), (ast.Keyword(draw(_names), e),))
        elif kind == "as":
            e = ast.As(e, draw(_names))
        elif kind == "compare":
            e = ast.Compare(draw(_COMPARE_OPS), *pair)
        elif kind == "bool":
            e = ast.BoolOp(draw(st.sampled_from(["and", "or"])), pair)
        elif kind == "not":
            e = ast.Not(e)
        else:
            e = ast.Index(*pair)
    return e


@st.composite
def _deep_modules(draw):
    """A module with one rule whose pattern, where clause, replacement or option value
    nests up to ``MAX_NESTING`` deep, and a ruleset whose schedule nests as deep."""
    depth = draw(st.integers(1, MAX_NESTING))
    deep = draw(_nested(depth))
    assert nesting_depth(deep) == depth
    place = draw(st.sampled_from(["pattern", "where", "replacement", "option"]))
    leaf = ast.Var(draw(_names))
    rule = ast.Rule(draw(_names), deep if place == "pattern" else leaf, deep if place == "where" else None,
                    deep if place == "replacement" else leaf,
                    (ast.RuleOption(draw(_names), deep),) if place == "option" else ())
    schedule = ast.Schedule(draw(_names), (ast.ScheduleRef(rule.name),))
    for _ in range(draw(st.integers(0, MAX_NESTING - 1))):
        schedule = ast.Schedule(draw(_names), (schedule,) if draw(st.booleans()) else
                                (ast.ScheduleRef(draw(_names)), schedule))
    return ast.Module("<string>", (rule, ast.RuleSetDecl(draw(_names), schedule)))


@settings(max_examples=60, deadline=None)
@given(_deep_modules())
def test_fmt_never_changes_the_parsed_program_at_any_depth_the_parser_accepts(module):
    """Random nesting depths up to the front end's limit: the printer round-trips,
    fmt keeps the program and is idempotent (wrapping lines at every depth)."""
    text = format_module(module)
    assert parse_text(text) == module, text
    formatted = format_source(text)
    assert parse_text(formatted) == module, formatted
    assert format_source(formatted) == formatted


# ---------------------------------------------------------------- the command


def test_fmt_command_prints_checks_and_writes(tmp_path, capsys):
    messy = tmp_path / "messy.rw"
    messy.write_text("# x * 1 -> x\nrule   mul_one :mul(x,1)=>x\n")
    assert main(["fmt", str(messy)]) == 0
    assert capsys.readouterr().out == "# x * 1 -> x\nrule mul_one: mul(x, 1) => x\n"
    assert main(["fmt", "--check", str(messy)]) == 1
    assert "not formatted" in capsys.readouterr().err
    assert main(["fmt", "--write", str(messy)]) == 0
    assert messy.read_text() == "# x * 1 -> x\nrule mul_one: mul(x, 1) => x\n"
    assert main(["fmt", "--check", str(messy)]) == 0


def test_fmt_reports_syntax_errors_with_positions(tmp_path, capsys):
    bad = tmp_path / "bad.rw"
    bad.write_text("rule r: relu(x) =>\n")
    assert main(["fmt", str(bad)]) == 1
    assert f"{bad}:1:" in capsys.readouterr().err
    assert main(["fmt", str(tmp_path / "missing.rw")]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_fmt_check_and_write_are_exclusive():
    with pytest.raises(SystemExit):
        main(["fmt", "--check", "--write", "x.rw"])


@pytest.mark.parametrize("sep", ["\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\x0b", "\r"])
def test_fmt_splits_lines_as_the_grammar_does(sep):
    """fmt never changes the program a load reads: a rule after a line separator inside
    a comment stays a comment where the grammar does not end lines (str.splitlines
    splits there), and is a rule where a load does (CR, U+2028, U+2029, U+0085:
    ``one_line_end``; session 39's probe AH F2)."""
    src = f"# a comment{sep}rule hidden: relu(x) => x\nrule r: neg(neg(x)) => x\n"
    out = format_source(src, "t.rw")
    loaded = [i.name for i in parse_text(one_line_end(src), "t.rw").items]
    assert [i.name for i in parse_text(out, "t.rw").items] == loaded
    assert ("hidden" in loaded) == (sep in "\r\x85\u2028\u2029")
