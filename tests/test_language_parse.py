"""Tests for rewrite.language.parser: every construct parses to the expected AST,
the printer round-trips, and spans point at the right text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from rewrite.language import RuleError, ast, parse_text
from rewrite.language.parser import DTYPES, grammar_path
from rewrite.language.printer import format_expr, format_module

V, W, L, D = ast.Var, ast.Wildcard, ast.Literal, ast.DTypeLit


def op(*names):
    return ast.OpRef(tuple(names))


def call(name, *args, rest=False, **kwargs):
    names = name if isinstance(name, tuple) else (name,)
    kws = tuple(ast.Keyword(k, v) for k, v in kwargs.items())
    return ast.Call(op(*names), tuple(args), kws, rest)


def rule(text):
    (item,) = parse_text(text).items
    return item


def pattern(text):
    return rule(f"rule r: {text} => x").pattern


def where(text):
    return rule(f"rule r: f(x) where {text} => x").where


def test_grammar_is_found():
    assert grammar_path().name == "rules.lark"
    assert grammar_path().is_file()


# ---------------------------------------------------------------- declarations


def test_simple_rule():
    r = rule("rule mul_one: mul(x, 1) => x")
    assert r == ast.Rule("mul_one", call("mul", V("x"), L(1)), None, V("x"))


def test_rule_options_and_where():
    r = rule("rule conv_bn(priority=10, shared=True, tolerance=\"approx\"): conv(x) where const(x) => x")
    assert r.options == (ast.RuleOption("priority", 10), ast.RuleOption("shared", True),
                         ast.RuleOption("tolerance", "approx"))
    assert r.option("priority") == 10 and r.option("missing", 3) == 3
    assert r.where == call("const", V("x"))


def test_empty_options_and_trailing_commas():
    r = rule("rule r(): f(x, y,) => [x, y,]")
    assert r.options == ()
    assert r.pattern == call("f", V("x"), V("y"))
    assert r.replacement == ast.ListLit((V("x"), V("y")))


def test_newlines_are_not_significant():
    text = "rule\n  r\n  :\n  mul(\n x,\n 1)\n  =>\n x"
    assert rule(text) == ast.Rule("r", call("mul", V("x"), L(1)), None, V("x"))


def test_import_family_ruleset():
    m = parse_text('import "cleanup.rw"\nfamily act = relu | gelu | F.silu\n'
                   "ruleset fusion = fixpoint(a, once(b, c), seq(d))\n")
    assert m.items == (
        ast.Import("cleanup.rw"),
        ast.Family("act", ("relu", "gelu", "F.silu")),
        ast.RuleSetDecl("fusion", ast.Schedule("fixpoint", (
            ast.ScheduleRef("a"),
            ast.Schedule("once", (ast.ScheduleRef("b"), ast.ScheduleRef("c"))),
            ast.Schedule("seq", (ast.ScheduleRef("d"),)),
        ))),
    )


def test_single_op_family():
    assert parse_text("family one = relu").items == (ast.Family("one", ("relu",)),)


def test_comments_and_doc():
    m = parse_text("# banner\n\n# x * 1 -> x\n#   indented\nrule a: mul(x, 1) => x  # trailing\n"
                   "rule b: f(x) => x\n")
    a, b = m.items
    assert a.doc == "x * 1 -> x\n  indented"
    assert b.doc == ""  # a trailing comment on the line above is not a doc comment


def test_empty_file_and_only_comments():
    assert parse_text("").items == ()
    assert parse_text("# nothing here\n   \n").items == ()


def test_module_keeps_path_and_source():
    m = parse_text("rule r: f(x) => x", "a/b.rw")
    assert m.path == "a/b.rw" and m.source == "rule r: f(x) => x"
    assert m.items[0].span == ast.Span("a/b.rw", 1, 1, 1, 18)


# ---------------------------------------------------------------- patterns


def test_wildcard_and_variables():
    assert pattern("add(_, x)") == call("add", W(), V("x"))
    assert pattern("add(_x, x)") == call("add", V("_x"), V("x"))


@pytest.mark.parametrize("text, value", [
    ("1", 1), ("-3", -3), ("0", 0), ("1.5", 1.5), ("-0.25", -0.25), ("1e-5", 1e-5), ("1E5", 1e5),
    ("2.", 2.0), (".5", 0.5), ("-1.5e+3", -1500.0), ("True", True), ("False", False), ("None", None),
    ('"approx"', "approx"), ("'single'", "single"), (r'"a\"b"', 'a"b'), (r'"tab\t"', "tab\t"),
])
def test_literals(text, value):
    lit = pattern(f"f({text})").args[0]
    assert lit == L(value) and type(lit.value) is type(value)


@pytest.mark.parametrize("text", ["1e400", "-1e400", "1.5e309", "-.1e999"])
def test_float_literals_that_overflow_are_refused(text):
    """`fmt` could only print them as `inf`, which reads back as a pattern variable."""
    with pytest.raises(RuleError) as info:
        parse_text(f"rule r: mul(x, {text}) => x\n", "of.rw")
    (d,) = info.value.diagnostics
    assert d.code == "E010" and "out of range" in d.message and d.help
    assert (d.span.path, d.span.line, d.span.col, d.span.end_col) == ("of.rw", 1, 16, 16 + len(text))


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_printer_refuses_non_finite_floats(value):
    """No rule text means them: printing one must not silently change the rule."""
    with pytest.raises(ValueError, match="cannot be written"):
        format_expr(call("mul", V("x"), L(value)))


@pytest.mark.parametrize("value", [1e308, -1.7976931348623157e308, 5e-324, -0.0, 1e16, 1e-400, 123456789.125])
def test_extreme_finite_floats_round_trip(value):
    text = f"rule r: mul(x, {format_expr(L(value))}) => x\n"
    (r,) = parse_text(text).items
    assert r.pattern.args[1] == L(value) and format_module(parse_text(text)) == text


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_dtypes(name):
    assert pattern(f"to(x, torch.{name})").args[1] == D(name)


def test_tuples_and_lists():
    assert pattern("f(())").args[0] == ast.TupleLit(())
    assert pattern("f((x,))").args[0] == ast.TupleLit((V("x"),))
    assert pattern("f((1, 1))").args[0] == ast.TupleLit((L(1), L(1)))
    assert pattern("f((1, 2,))").args[0] == ast.TupleLit((L(1), L(2)))
    assert pattern("f([])").args[0] == ast.ListLit(())
    assert pattern("f([a, [b]])").args[0] == ast.ListLit((V("a"), ast.ListLit((V("b"),))))


def test_parentheses_group_without_making_a_tuple():
    assert pattern("f((x))").args[0] == V("x")


def test_keywords_and_rest():
    p = pattern("batch_norm(x, m, training=False, eps=eps, ...)")
    assert p == call("batch_norm", V("x"), V("m"), rest=True, training=L(False), eps=V("eps"))
    assert pattern("f(...)") == call("f", rest=True)
    assert pattern("f(x, ...,)") == call("f", V("x"), rest=True)


def test_as_names_interior_and_root():
    p = pattern("relu(conv(x, w) as c) as r")
    assert p == ast.As(call("relu", ast.As(call("conv", V("x"), V("w")), "c")), "r")


def test_tuple_binding_of_results():
    p = pattern("split(x, 2, 0) as (a, _, b)")
    assert p == ast.AsTuple(call("split", V("x"), L(2), L(0)), ("a", "_", "b"))
    assert pattern("split(x, 2, 0) as (a, b,)") == ast.AsTuple(call("split", V("x"), L(2), L(0)), ("a", "b"))
    arg = pattern("cat(split(x, s, d) as (_, _), d)")
    assert arg == call("cat", ast.AsTuple(call("split", V("x"), V("s"), V("d")), ("_", "_")), V("d"))
    r = rule("rule r: max(x, 1) as (v, _) => (amax(x, 1), _)")
    assert r.replacement == ast.TupleLit((call("amax", V("x"), L(1)), W()))
    assert format_expr(r.pattern) == "max(x, 1) as (v, _)"


def test_tuple_binding_needs_two_names():
    from rewrite.language import RuleError

    for text in ("rule r: split(x) as (a) => x", "rule r: split(x) as () => x", "rule r: split(x) as (a, 1) => x"):
        with pytest.raises(RuleError):
            parse_text(text)


def test_alternatives_and_qualified_callees():
    assert pattern("(relu | gelu)(x)") == call(("relu", "gelu"), V("x"))
    assert pattern("(relu | F.gelu | aten.silu.default)(x)").op == op("relu", "F.gelu", "aten.silu.default")
    for name in ("aten.conv2d", "F.relu", "nn.Conv2d", "Tensor.clamp", "torch.nn.functional.relu"):
        assert pattern(f"{name}(x)") == call(name, V("x"))


def test_nested_calls():
    assert pattern("add(mul(x, y), mul(x, z))") == call(
        "add", call("mul", V("x"), V("y")), call("mul", V("x"), V("z")))


# ---------------------------------------------------------------- where clauses


@pytest.mark.parametrize("cmp", ["==", "!=", "<", "<=", ">", ">=", "in", "not in"])
def test_comparisons(cmp):
    assert where(f"rank(x) {cmp} 4") == ast.Compare(cmp, call("rank", V("x")), L(4))


def test_boolean_precedence():
    w = where("a(x) or b(x) and not c(x)")
    assert w == ast.BoolOp("or", (call("a", V("x")), ast.BoolOp("and", (
        call("b", V("x")), ast.Not(call("c", V("x")))))))


def test_boolean_chains_are_flat_and_parentheses_nest():
    assert where("a(x) and b(x) and c(x)") == ast.BoolOp("and", tuple(call(n, V("x")) for n in "abc"))
    assert where("(a(x) or b(x)) and c(x)") == ast.BoolOp("and", (
        ast.BoolOp("or", (call("a", V("x")), call("b", V("x")))), call("c", V("x"))))


def test_not_binds_looser_than_comparison():
    assert where("not rank(x) == 4") == ast.Not(ast.Compare("==", call("rank", V("x")), L(4)))


def test_indexing_and_membership():
    w = where("dtype(x) in (torch.float32, torch.bfloat16) and shape(x)[1] > 3 and not is_param(x)")
    assert w == ast.BoolOp("and", (
        ast.Compare("in", call("dtype", V("x")), ast.TupleLit((D("float32"), D("bfloat16")))),
        ast.Compare(">", ast.Index(call("shape", V("x")), L(1)), L(3)),
        ast.Not(call("is_param", V("x"))),
    ))
    assert where("shape(x)[-1][0] == 2").left == ast.Index(ast.Index(call("shape", V("x")), L(-1)), L(0))


def test_brief_example_file():
    text = '''
import "cleanup.rw"                     # path relative to this file
family act = relu | gelu | silu
# x * 1 -> x
rule mul_one: mul(x, 1) => x
rule conv_bn(priority=10):
    batch_norm(conv(x, w, b, stride, padding, dilation, groups) as c,
               mean, var, gamma, beta, training=False, eps=eps, ...)
    where const(w, mean, var, gamma, beta) and single_use(c) and rank(x) == 4
    => conv(x, bn_fold_weight(w, var, gamma, eps), bn_fold_bias(b, mean, var, gamma, beta, eps),
            stride, padding, dilation, groups)
rule act_then_id: identity((relu | gelu)(x) as a) => a
rule cast_same: to(x, d) where dtype(x) == d => x
ruleset fusion = fixpoint(conv_bn, mul_one)
ruleset pipeline = seq(fusion, once(cast_same), cleanup)
'''
    m = parse_text(text)
    assert [type(i).__name__ for i in m.items] == [
        "Import", "Family", "Rule", "Rule", "Rule", "Rule", "RuleSetDecl", "RuleSetDecl"]
    conv_bn = m.items[3]
    assert conv_bn.options == (ast.RuleOption("priority", 10),)
    assert conv_bn.pattern.rest and conv_bn.pattern.args[0].name == "c"
    assert conv_bn.replacement.args[1] == call("bn_fold_weight", V("w"), V("var"), V("gamma"), V("eps"))
    assert m.items[2].doc == "x * 1 -> x"


# ---------------------------------------------------------------- spans


def test_spans_point_at_the_text():
    text = "rule r:\n  relu(conv(x, w) as c)\n  => c"
    r = rule(text)
    assert r.name_span == ast.Span("<string>", 1, 6, 1, 7)
    inner = r.pattern.args[0]
    assert inner.span == ast.Span("<string>", 2, 8, 2, 23)
    assert inner.expr.op.span == ast.Span("<string>", 2, 8, 2, 12)
    assert inner.expr.args[1].span == ast.Span("<string>", 2, 16, 2, 17)
    assert r.replacement.span == ast.Span("<string>", 3, 6, 3, 7)
    assert str(r.replacement.span) == "<string>:3:6"


def test_alternative_names_have_their_own_spans():
    p = pattern("(relu | gelu)(x)")
    assert [s.col for s in p.op.name_spans] == [10, 17]
    fam = parse_text("family a = relu | gelu").items[0]
    assert [s.col for s in fam.op_spans] == [12, 19]


# ---------------------------------------------------------------- round trip


ROUND_TRIP = '''import "other.rw"
family act = relu | gelu
# doc line
rule a(priority=-2, shared=False): batch_norm(conv(x, _, b, ...) as c, m, eps=1e-05) where const(b) and (single_use(c) or rank(x) not in [3, 4]) and not dtype(x) == torch.float16 => conv(x, f(b, "s"), (1,), ())
rule b: (relu | act)(x) as y where shape(x)[0] >= 1 => y
ruleset s = seq(a, fixpoint(b, once(a)))
'''


def test_printer_round_trips():
    m = parse_text(ROUND_TRIP)
    assert format_module(m) == ROUND_TRIP
    assert parse_text(format_module(m)) == m


_names = st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True).filter(
    lambda s: s not in {"rule", "family", "ruleset", "import", "where", "and", "or", "not", "in", "as",
                        "true", "false", "none", "null"})
_floats = st.floats(allow_nan=False, allow_infinity=False)
_literals = st.one_of(st.integers(-10**6, 10**6), _floats, st.booleans(), st.none(),
                      st.text(max_size=8)).map(L)
_leaves = st.one_of(_names.map(V), st.just(W()), _literals, st.sampled_from(sorted(DTYPES)).map(D))


def _extend(children):
    callee = st.lists(_names, min_size=1, max_size=3).map(lambda ns: ast.OpRef(tuple(ns)))
    kwargs = st.lists(st.builds(ast.Keyword, _names, children), max_size=2).map(tuple)
    return st.one_of(
        st.builds(ast.Call, callee, st.lists(children, max_size=3).map(tuple), kwargs, st.booleans()),
        st.lists(children, max_size=3).map(lambda xs: ast.TupleLit(tuple(xs))),
        st.lists(children, max_size=3).map(lambda xs: ast.ListLit(tuple(xs))),
        st.builds(ast.As, st.builds(ast.Call, callee, st.lists(children, max_size=2).map(tuple),
                                    st.just(())), _names),
        st.builds(ast.AsTuple, st.builds(ast.Call, callee, st.lists(children, max_size=2).map(tuple), st.just(())),
                  st.lists(st.one_of(_names, st.just("_")), min_size=2, max_size=3).map(tuple)),
        st.builds(ast.Compare, st.sampled_from(["==", "!=", "<", "<=", ">", ">=", "in", "not in"]),
                  children, children),
        st.builds(ast.BoolOp, st.sampled_from(["and", "or"]), st.lists(children, min_size=2, max_size=3).map(tuple)),
        st.builds(ast.Not, children),
        st.builds(ast.Index, children, children),
    )


_exprs = st.recursive(_leaves, _extend, max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(_exprs)
def test_random_expressions_round_trip(e):
    text = format_expr(e)
    parsed = rule(f"rule r: f(x) where {text} => x").where
    assert parsed == e, text


def test_reserved_words_name_members_after_a_dot():
    import rewrite

    for text in ("rule r: torch.where(_, x, x) => x\n", "rule r: aten.where.self(_, x, x) => x\n",
                 "rule r: torch.ops.aten.where.self(_, x, x) => x\n"):
        assert list(rewrite.parse(text).rules) == ["r"]
    with pytest.raises(rewrite.RuleError, match="reserved word"):
        rewrite.parse("rule where: relu(x) => x\n")
