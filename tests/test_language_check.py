"""Tests for rewrite.language.check and rewrite.language.program: name resolution,
argument and variable checks, declarations, imports, and the Program value.

Each error test pins the code, the position and the exact message (and help where
it carries the fix), against the real op vocabulary and function registry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest

from rewrite.language import Program, RuleError, ast, load_program, load_program_text


def diags(text: str, path: str = "t.rw") -> list:
    """(code, 'line:col', message) of every diagnostic of a text program."""
    with pytest.raises(RuleError) as info:
        load_program_text(text, path)
    return [(d.code, f"{d.span.line}:{d.span.col}", d.message) for d in info.value.diagnostics]


def one(text: str) -> object:
    """The single diagnostic of a text program."""
    with pytest.raises(RuleError) as info:
        load_program_text(text, "t.rw")
    (d,) = info.value.diagnostics
    return d


def ok(text: str) -> Program:
    return load_program_text(text, "t.rw")


# ---------------------------------------------------------------- callee names


def test_misspelled_op_in_pattern():
    d = one("rule r: rleu(x) => x")
    assert (d.code, str(d.span), d.message, d.help) == (
        "E102", "t.rw:1:9", "unknown op 'rleu'", "did you mean 'relu'?")


def test_misspelled_qualified_op_keeps_its_prefix():
    d = one("rule r: F.rleu(x) => x")
    assert (d.code, d.message, d.help) == ("E102", "unknown op 'F.rleu'", "did you mean 'F.relu'?")


def test_misspelled_op_in_replacement():
    d = one("rule r: relu(x) => rleu(x)")
    assert (d.code, str(d.span), d.message, d.help) == (
        "E102", "t.rw:1:20", "unknown op or function 'rleu'", "did you mean 'relu'?")


def test_misspelled_alternative_points_at_that_name():
    d = one("rule r: (relu | geul)(x) => x")
    assert (d.code, str(d.span), d.message, d.help) == (
        "E102", "t.rw:1:17", "unknown op 'geul'", "did you mean 'gelu'?")


def test_unknown_predicate_in_where():
    d = one("rule r: relu(x) where singel_use(x) => x")
    assert (d.code, str(d.span), d.message, d.help) == (
        "E103", "t.rw:1:23", "unknown predicate or query 'singel_use'", "did you mean 'single_use'?")


def test_predicate_in_replacement():
    d = one("rule r: relu(x) => single_use(x)")
    assert (d.code, str(d.span), d.message, d.help) == (
        "E104", "t.rw:1:20",
        "'single_use' is a predicate; a replacement can only call ops and constant or module functions",
        "use it in the where clause")


def test_op_in_where():
    d = one("rule r: relu(x) where relu(x) => x")
    assert (d.code, str(d.span), d.message) == (
        "E104", "t.rw:1:23", "'relu' is an op; a where clause can only call predicates and queries")


def test_function_in_pattern():
    d = one("rule r: single_use(x) => x")
    assert (d.code, d.message, d.help) == (
        "E104", "'single_use' is a predicate, not an op; a pattern can only call ops and families",
        "use it in the where clause")


def test_constant_function_in_replacement_is_fine():
    prog = ok("rule r: to(to(x, d), e) where const(x) => to(cast(x, d), e)")
    assert prog.rules[0].replacement.args[0].op.names == ("cast",)


def test_family_in_replacement():
    assert diags("family act = relu | gelu\nrule r: relu(x) => act(x)") == [
        ("E104", "2:20", "'act' is a family; a replacement must call one op")]


# ---------------------------------------------------------------- arguments


def test_too_many_arguments():
    d = one("rule r: relu(x, x) => x")
    assert (d.code, str(d.span), d.message, d.help) == (
        "E201", "t.rw:1:17", "too many arguments for 'relu': it takes 1, got 2", "signature: relu(input)")


def test_unknown_keyword():
    d = one("rule r: relu(x, inptu=_) => x")
    assert (d.code, str(d.span), d.message, d.help) == (
        "E202", "t.rw:1:17", "'relu' has no parameter 'inptu'",
        "did you mean 'input'? (signature: relu(input))")


def test_keyword_given_twice():
    assert diags("rule r: relu(input=x, input=x) => x") == [
        ("E203", "1:23", "keyword argument 'input' given twice")]
    assert diags("rule r: relu(x, input=x) => x") == [
        ("E203", "1:17", "argument 'input' of 'relu' given both by position and by keyword")]


def test_missing_argument():
    d = one("rule r: relu() as y => y")
    assert d.code == "E204" and str(d.span) == "t.rw:1:9"
    assert d.message == "missing argument 'input' for 'relu'"
    assert d.help == "signature: relu(input); in a pattern, end the call with '...' to match the rest"


def test_rest_allows_missing_arguments():
    ok("rule r: relu(...) as y => y")


def test_function_arguments():
    d = one("rule r: relu(x) where single_use(x, x) => x")
    assert (d.code, str(d.span), d.help) == ("E205", "t.rw:1:23", "signature: single_use(x)")
    assert "single_use()" in d.message


def test_family_members_are_each_checked():
    got = diags("family act = relu | gelu\nrule r: act(x, foo=1) => x")
    assert got == [
        ("E202", "2:16", "'relu' (in family 'act') has no parameter 'foo'"),
        ("E202", "2:16", "'gelu' (in family 'act') has no parameter 'foo'"),
    ]


# ---------------------------------------------------------------- variables


def test_unbound_variable():
    d = one("rule r: mul(x, x) => xx")
    assert (d.code, str(d.span), d.message, d.help) == (
        "E301", "t.rw:1:22", "unbound variable 'xx'", "did you mean 'x'?")


def test_unbound_variable_in_where_and_dtype_hint():
    assert diags("rule r: relu(x) where dtype(x) == float16 => x") == [
        ("E301", "1:35", "unbound variable 'float16'")]
    assert one("rule r: relu(x) where dtype(x) == float16 => x").help == "did you mean 'torch.float16'?"


def test_unused_pattern_variable():
    d = one("rule r: add(x, b) => x")
    assert (d.code, str(d.span), d.message) == ("E302", "t.rw:1:16", "unused pattern variable 'b'")
    assert d.help.startswith("write _ to match anything")


def test_used_repeated_underscored_and_named_variables_are_fine():
    ok("rule r: add(x, x) => mul(x, 2)")  # a repeated variable is a constraint
    ok("rule r: add(x, _y) => x")  # leading underscore: deliberately unused
    ok("rule r: relu(relu(_) as inner) => inner")
    ok("rule r: add(x, y) where rank(y) == 0 => x")  # used in where only


def test_unused_as_name():
    assert diags("rule r: relu(relu(x) as inner) => relu(x)") == [
        ("E302", "1:25", "unused pattern variable 'inner'")]


def test_duplicate_as_names():
    assert diags("rule r: add(relu(x) as c, relu(y) as c) => add(x, y)") == [
        ("E303", "1:38", "'c' names two nodes with 'as'")]
    assert diags("rule r: add(relu(x) as x, y) => y") == [
        ("E303", "1:24", "'x' names a node that would read itself")]


def test_an_as_name_written_again_is_the_same_node():
    """A value the pattern reads twice (a layer norm's x - mean): the `as` name written
    again elsewhere in the pattern is that node, in either order."""
    ok("rule r: div(sub(x, mean(x, -1, True)) as d, sqrt(mean(mul(d, d), -1, True))) => d")
    ok("rule r: add(d, relu(neg(y)) as d) => add(d, y)")


def test_as_on_the_root_is_allowed():
    prog = ok("rule r: relu(x) as out where single_use(out) => x")
    assert isinstance(prog.rules[0].pattern, ast.As)


# ---------------------------------------------------------------- multi-output ops


def test_multi_output_rules_check():
    ok("rule r: aten.max.dim(x, d, k) as (_, _) => (aten.amax(x, [d], k), aten.argmax(x, d, k))")
    ok("rule r: aten.max.dim(x, d, k) as (v, _) where single_use(v) => (aten.amax(x, [d], k), _)")
    ok("rule r: aten.native_layer_norm(x, s, w, b, eps) as (_, _, _) => (layer_norm(x, s, w, b, eps), _, _)")
    ok("rule r: aten.split.Tensor(x, 2, d) as (_, _) where shape(x)[d] == 4 => aten.chunk(x, 2, d)")
    ok("rule r: cat(aten.split.Tensor(_, _, d) as (a, b), d) where single_use(a) => add(a, b)")
    ok("rule r: add(cat(aten.split.Tensor(x, _, d) as (a, _), d), a) => add(x, a)")  # the same value


@pytest.mark.parametrize("text, expected", [
    ("rule r: aten.max.dim(x, d, k) as (_, _) => (aten.amax(x, [d], k), _, _)",
     ("E305", "1:44", "the pattern binds 2 results but the replacement gives 3 values")),
    ("rule r: aten.max.dim(x, d, k) as (_, _, _) => (x, _, _)",
     ("E305", "1:9", "'aten.max.dim' returns 2 values; the pattern binds 3")),
    ("rule r: relu(x) as (_, _) => (x, _)",
     ("E305", "1:9", "'relu' returns one value; 'as (...)' binds the results of an op that returns several")),
    ("rule r: relu(x) => (x, x)",
     ("E305", "1:20", "a tuple replacement needs a pattern whose root binds the results of a multi-output op")),
    ("rule r: aten.max.dim(x, d, k) as (_, _) => relu(x)",
     ("E305", "1:44", "'relu' returns one value; the pattern binds 2 results")),
    ("rule r: aten.max.dim(x, d, k) as (_, _) => aten.topk(x, 1, d, k)", None),
    ("rule r: aten.max.dim(x, d, k) as (_, _) => x",
     ("E305", "1:44", "the pattern binds 2 results; a replacement for them is a tuple of values or a call of "
                      "a multi-output op, not variable 'x'")),
    ("rule r: aten.max.dim(x, d, k) as (v, _) => (v, _)",
     ("E305", "1:45", "'v' is a result of the matched op, which the replacement replaces")),
    ("rule r: aten.max.dim(x, d, k) as (v, v) => (x, _)",
     ("E303", "1:38", "'v' is bound twice; each result needs a new name")),
    ("rule r: aten.max.dim(v, d, k) as (v, _) => (d, _)",
     ("E303", "1:35", "'v' is bound twice; each result needs a new name")),
    ("rule r: relu(x) => relu(x) as (a, b)", ("E304", "1:20", "'as (...)' can only be used in a pattern")),
    ("rule r: aten.max.dim(x, d, k) as (v, _) => (x, _)", ("E302", "1:35", "unused pattern variable 'v'")),
])
def test_multi_output_diagnostics(text, expected):
    if expected is None:  # topk also returns 2 values: fine
        ok(text)
    else:
        assert expected in diags(text)


# ---------------------------------------------------------------- placement


@pytest.mark.parametrize("text, expected", [
    ("rule r: relu(x) => _", ("E304", "1:20", "'_' can only be used in a pattern")),
    ("rule r: relu(x) => relu(...)", ("E304", "1:20", "'...' can only be used in a pattern")),
    ("rule r: relu(x) => (relu | gelu)(x)", ("E304", "1:20", "alternatives can only be used in a pattern")),
    ("rule r: relu(x) where (const | single_use)(x) => x",
     ("E304", "1:23", "alternatives can only be used in a pattern")),
    ("rule r: relu(x) => relu(x) as y", ("E304", "1:31", "'as' can only be used in a pattern")),
    ("rule r: relu(x as y) => y", ("E304", "1:19", "'as' can only name a call, not variable 'x'")),
    ("rule r: relu(x and y) => x", ("E304", "1:14", "'and' can only be used in a where clause")),
    ("rule r: relu(x) => not x", ("E304", "1:20", "'not' can only be used in a where clause")),
    ("rule r: relu(x) => shape(x)[0]", ("E304", "1:20", "indexing can only be used in a where clause")),
    ("rule r: relu(x) where _ => x", ("E304", "1:23", "'_' can only be used in a pattern")),
    ("rule r: x => x", ("E304", "1:9", "a pattern must be an op call, found variable 'x'")),
    ("rule r: mul(_, 0) => 0", ("E304", "1:22", "a replacement must produce a graph value, found literal 0")),
])
def test_constructs_out_of_place(text, expected):
    assert expected in diags(text)


# ---------------------------------------------------------------- options


def test_rule_options():
    prog = ok('rule r(priority=-3, shared=True, tolerance="approx"): relu(x) => x')
    assert prog.rules[0].option("priority") == -3


def test_bad_rule_options():
    got = diags('rule r(prority=1, priority="high", shared=1, tolerance="loose", priority=2): relu(x) => x')
    assert got == [
        ("E405", "1:8", "unknown rule option 'prority'"),
        ("E406", "1:19", "option 'priority' must be an integer, got \"high\""),
        ("E406", "1:36", "option 'shared' must be True or False, got 1"),
        ("E406", "1:46", "option 'tolerance' must be \"exact\" or \"approx\", got \"loose\""),
        ("E406", "1:65", "option 'priority' given twice"),
    ]
    assert one("rule r(prority=1): relu(x) => x").help == "did you mean 'priority'?"


def test_option_value_must_be_a_literal():
    assert diags("rule r(priority=x): relu(x) => x") == [
        ("E406", "1:8", "option 'priority' must be an integer, got x")]


# ---------------------------------------------------------------- declarations


def test_duplicate_rule_points_at_both():
    d = one("rule a: relu(x) => x\nrule a: gelu(x) => x")
    assert (d.code, str(d.span), d.message) == ("E401", "t.rw:2:6", "duplicate name 'a': already defined as a rule")
    assert [(str(s), m) for s, m in d.related] == [("t.rw:1:6", "'a' first defined here")]


def test_rule_and_ruleset_share_a_namespace():
    assert diags("rule a: relu(x) => x\nruleset a = once(a)") == [
        ("E401", "2:9", "duplicate name 'a': already defined as a rule")]


def test_family_named_like_an_op():
    assert diags("family relu = gelu | silu") == [("E401", "1:8", "family 'relu' has the name of an op")]


def test_family_members():
    assert diags("family act = relu | rleu") == [("E101", "1:21", "unknown op 'rleu' in family 'act'")]
    assert diags("family act = relu | const") == [
        ("E104", "1:21", "'const' is a predicate, not an op; a family lists ops")]


def test_families_nest_and_expand():
    prog = ok("family a = relu | b\nfamily b = gelu | silu | relu\nrule r: a(x) => x")
    assert prog.families == {"a": ("relu", "gelu", "silu"), "b": ("gelu", "silu", "relu")}


def test_recursive_family():
    assert diags("family a = relu | b\nfamily b = gelu | a") == [
        ("E404", "2:19", "family 'a' contains itself: a -> b -> a")]


def test_ruleset_items():
    got = diags("family act = relu\nrule r: relu(x) => x\n"
                "ruleset s = fixpoint(r, rr, act, sq(r), once())")
    assert got == [
        ("E407", "3:25", "unknown rule or ruleset 'rr'"),
        ("E407", "3:29", "'act' is a family, not a rule or ruleset"),
        ("E408", "3:34", "unknown schedule 'sq'"),
        ("E408", "3:41", "empty schedule 'once()'"),
    ]


def test_recursive_ruleset():
    assert diags("rule r: relu(x) => x\nruleset a = seq(r, b)\nruleset b = once(fixpoint(a))") == [
        ("E404", "3:27", "ruleset 'a' contains itself: a -> b -> a")]
    assert diags("rule r: relu(x) => x\nruleset a = seq(r, a)") == [
        ("E404", "2:20", "ruleset 'a' contains itself: a -> a")]


def test_all_errors_are_collected_in_source_order():
    got = diags("rule a: rleu(x) => y\nrule b: relu(x) => x\nrule c: gelu(x, 1, 2) => z")
    assert [(c, p) for c, p, _ in got] == [
        ("E102", "1:9"), ("E302", "1:14"), ("E301", "1:20"),
        ("E302", "3:14"), ("E201", "3:20"), ("E301", "3:26")]


# ---------------------------------------------------------------- programs and imports


def write(dir: Path, name: str, text: str) -> Path:
    path = dir / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_program_contents(tmp_path):
    write(tmp_path, "lib/cleanup.rw", "family act = relu | gelu\nrule id: identity(x) => x\n")
    main = write(tmp_path, "lib/main.rw", 'import "cleanup.rw"\n# x * 1 -> x\nrule mul_one: mul(x, 1) => x\n'
                                          "rule act_id: identity(act(_) as a) => a\n"
                                          "ruleset all = seq(fixpoint(mul_one, act_id), once(id))\n")
    prog = load_program([main])
    assert [r.name for r in prog.rules] == ["id", "mul_one", "act_id"]  # imports first
    assert prog.rules[1].doc == "x * 1 -> x"
    assert prog.families == {"act": ("relu", "gelu")}
    assert prog.rulesets["all"] == ast.Schedule("seq", (
        ast.Schedule("fixpoint", (ast.ScheduleRef("mul_one"), ast.ScheduleRef("act_id"))),
        ast.Schedule("once", (ast.ScheduleRef("id"),))))
    display = str(main)
    assert prog.files == (str(tmp_path / "lib" / "cleanup.rw"), display)
    assert set(prog.sources) == set(prog.files)
    assert prog.rule("id").pattern.op.names == ("identity",)
    assert load_program(str(main)).files == prog.files  # one path may be given bare


def test_diamond_import_is_loaded_once(tmp_path):
    write(tmp_path, "d.rw", "rule d: relu(x) => x\n")
    write(tmp_path, "b.rw", 'import "d.rw"\nrule b: gelu(x) => x\n')
    write(tmp_path, "c.rw", 'import "./d.rw"\nrule c: silu(x) => x\n')
    a = write(tmp_path, "a.rw", 'import "b.rw"\nimport "c.rw"\nruleset all = seq(b, c, d)\n')
    assert [r.name for r in load_program([a]).rules] == ["d", "b", "c"]


def test_import_not_found(tmp_path):
    write(tmp_path, "cleanup.rw", "rule c: relu(x) => x\n")
    a = write(tmp_path, "a.rw", '\nimport "clenaup.rw"\n')
    with pytest.raises(RuleError) as info:
        load_program([a])
    (d,) = info.value.diagnostics
    assert (d.code, str(d.span)) == ("E402", f"{a}:2:1")
    assert d.message == f"cannot import '{tmp_path / 'clenaup.rw'}': no such file"
    assert d.help == "did you mean 'cleanup.rw'?"


def test_missing_root_file(tmp_path):
    missing = tmp_path / "nope.rw"
    with pytest.raises(RuleError) as info:
        load_program([missing])
    (d,) = info.value.diagnostics
    assert d.code == "E402" and d.message == f"cannot read rule file '{missing}': No such file or directory"


def test_import_cycle(tmp_path):
    write(tmp_path, "a.rw", 'import "b.rw"\nrule a: relu(x) => x\n')
    write(tmp_path, "b.rw", '# b\nimport "a.rw"\nrule b: gelu(x) => x\n')
    with pytest.raises(RuleError) as info:
        load_program([tmp_path / "a.rw"])
    (d,) = info.value.diagnostics
    a, b = tmp_path / "a.rw", tmp_path / "b.rw"
    assert (d.code, str(d.span), d.message) == ("E403", f"{b}:2:1", f"import cycle: {a} -> {b} -> {a}")


def test_self_import(tmp_path):
    a = write(tmp_path, "a.rw", 'import "a.rw"\n')
    with pytest.raises(RuleError) as info:
        load_program([a])
    assert [d.message for d in info.value.diagnostics] == [f"import cycle: {a} -> {a}"]


def test_duplicate_across_files_points_at_both(tmp_path):
    write(tmp_path, "lib.rw", "rule dup: relu(x) => x\n")
    main = write(tmp_path, "main.rw", 'import "lib.rw"\n\nrule dup: gelu(x) => x\n')
    with pytest.raises(RuleError) as info:
        load_program([main])
    (d,) = info.value.diagnostics
    assert (d.code, str(d.span)) == ("E401", f"{main}:3:6")
    assert [str(s) for s, _ in d.related] == [f"{tmp_path / 'lib.rw'}:1:6"]


def test_names_are_visible_only_through_imports(tmp_path):
    a = write(tmp_path, "a.rw", "family act = relu | gelu\n")
    b = write(tmp_path, "b.rw", "rule r: act(x) => x\n")
    with pytest.raises(RuleError) as info:
        load_program([a, b])
    assert [(d.code, d.message) for d in info.value.diagnostics] == [("E102", "unknown op 'act'")]


def test_errors_from_several_files_are_all_reported(tmp_path):
    write(tmp_path, "lib.rw", "rule l: rleu(x) => x\n")
    main = write(tmp_path, "main.rw", 'import "lib.rw"\nrule m: relu(_) => y\n')
    with pytest.raises(RuleError) as info:
        load_program([main])
    assert [(Path(d.span.path).name, d.code) for d in info.value.diagnostics] == [
        ("lib.rw", "E102"), ("main.rw", "E301")]
    assert str(info.value).endswith("\n2 errors")


def test_syntax_error_in_import_hides_unknown_names_from_it(tmp_path):
    write(tmp_path, "lib.rw", "family act = relu |\n")
    main = write(tmp_path, "main.rw", 'import "lib.rw"\nrule m: act(x) => x\nruleset s = once(m, nothere)\n')
    with pytest.raises(RuleError) as info:
        load_program([main])
    assert [(Path(d.span.path).name, d.code) for d in info.value.diagnostics] == [("lib.rw", "E004")]


def test_text_program_imports_resolve_from_the_cwd(tmp_path, monkeypatch):
    write(tmp_path, "lib.rw", "rule l: relu(x) => x\n")
    monkeypatch.chdir(tmp_path)
    prog = load_program_text('import "lib.rw"\nruleset s = once(l)')
    assert [r.name for r in prog.rules] == ["l"] and prog.files == ("lib.rw", "<string>")


def test_import_not_found_without_a_close_name_says_where_it_looked(tmp_path):
    a = write(tmp_path, "a.rw", 'import "sub/zzz.rw"\n')
    with pytest.raises(RuleError) as info:
        load_program([a])
    (d,) = info.value.diagnostics
    assert d.help == f"looked for {tmp_path / 'sub' / 'zzz.rw'}"


def test_unreadable_bytes_are_reported(tmp_path):
    a = tmp_path / "bin.rw"
    a.write_bytes(b"rule r: relu(x) => x\xff\n")
    with pytest.raises(RuleError) as info:
        load_program([a])
    assert [(d.code, d.message) for d in info.value.diagnostics] == [
        ("E402", f"cannot read rule file '{a}': not valid UTF-8 at line 1, column 21 (byte 20)")]


@pytest.mark.parametrize("name", sorted(__import__("rewrite.language.parser", fromlist=["DTYPES"]).DTYPES))
def test_every_dtype_the_parser_accepts_compiles(name):
    """One dtype table: every ``torch.<dtype>`` the parser accepts loads, compiles and
    reaches the matcher as that dtype (``torch.uint16`` once crashed the compiler)."""
    import torch

    import rewrite
    from rewrite.engine.compile import DTYPES

    rules = rewrite.parse(f"rule r: to(x, d) where d == torch.{name} => to(x, torch.{name})")
    assert DTYPES[name] is getattr(torch, name)
    assert rules.rules["r"].replacement.args["dtype"].value is getattr(torch, name)


# ---------------------------------------------------------------- E409: endless rules

@pytest.mark.parametrize("text, term", [
    ("rule r: add(x, y) => add(y, x)", "add(y, x)"),  # commutation
    ("rule r: neg(x) => neg(neg(neg(x)))", "neg(neg(neg(x)))"),  # growth
    ("rule r: relu(_) as t => neg(relu(t))", "relu(t)"),  # insertion whose new node matches again
    ("rule r: mul(x, 2) => add(mul(x, 2), 0)", "mul(x, 2)"),  # the matched op rebuilt inside
    ("rule r: (relu | gelu)(x) => gelu(relu(x))", "gelu(relu(x))"),  # alternatives
    ("family act = relu | gelu\nrule r: act(x) => neg(gelu(x))", "gelu(x)"),  # a family
    ("rule r: torch.relu(x) => neg(torch.relu(x))", "torch.relu(x)"),  # one spelling
    ("rule r: conv(x, w, b, ...) => conv(x, w, b, [1, 1])", "conv(x, w, b, [1, 1])"),
    ("rule r: aten.add.Tensor(x, y) => aten.add.Tensor(y, x)", "aten.add.Tensor(y, x)"),
])
def test_a_rule_that_matches_its_own_replacement_is_rejected(text, term):
    found = diags(text)
    assert len(found) == 1
    code, _, message = found[0]
    assert code == "E409" and f"matches the {term} it builds" in message


@pytest.mark.parametrize("text", [
    "rule r: relu(_) as t => neg(neg(t))",  # insertion of other ops: settles
    "rule r: relu(relu(x)) => relu(x)",  # shrinks: the new relu's input is unknown
    "rule r: add(x, 0) => add(x, 0.0)",  # 0 and 0.0 are different literals
    "rule r: add(x, y) where is_float(x) => add(y, x)",  # a where clause may stop it
    "rule r: add(x, y) => add(y, x)\nruleset s = once(r)",  # run once on purpose
    "rule r: conv(x, w, b, [1, 1]) => conv(x, w, b, [2, 2])",  # literal differs
    "rule r: mul(x, x) => mul(x, neg(x))",  # a repeated variable needs equal terms
    "rule r: nn.ReLU(nn.Conv2d(x, w, b, s, p, d, g)) => relu(conv(x, w, b, s, p, d, g))",  # module form only
])
def test_a_rule_that_settles_is_not_rejected(text):
    load_program_text(text, "t.rw")  # raises RuleError on any diagnostic


# ---------------------------------------------------------------- E306: where clauses that never decide


@pytest.mark.parametrize("clause, position, message", [
    ("shape(x) > 3", "1:23", "'>' cannot order a sequence and an int: the comparison never holds"),
    ("3", "1:23", "a where clause must be a condition; this is an int"),
    ("rank(x)", "1:23", "a where clause must be a condition; this is an int"),
    ("shape(x)", "1:23", "a where clause must be a condition; this is a sequence"),
    ("dtype(x) == 4", "1:23", "a dtype is never equal to an int: '==' never holds"),
    ('is_float(x) and dtype(x) == "float16"', "1:39", "a dtype is never equal to a string: '==' never holds"),
    ("not (rank(x) > shape(x))", "1:28", "'>' cannot order an int and a sequence: the comparison never holds"),
    ('dtype(x) in ["float16", "bfloat16"]', "1:23", "a dtype is never one of these items: 'in' never holds"),
    ("dtype(x) < torch.float16", "1:23", "'<' cannot order a dtype and a dtype: the comparison never holds"),
    ("rank(x)[0] == 1", "1:23", "indexing an int: only a sequence (a shape, a tuple, a list) can be indexed"),
    ('shape(x)["a"] == 1', "1:32", "an index must be an int, not a string"),
    ("1 in 3", "1:23", "'in' needs a sequence on its right, not an int"),
    ("rank(x) == 2 or (shape(x) >= 1)", "1:40", "'>=' cannot order a sequence and an int: the comparison never holds"),
    ("rank(x) == None", "1:23", "a fact is never None (None is what a query gives when the fact is unknown, and a "
     "comparison with an unknown fact does not hold): '==' never holds"),
    ("None == dtype(x)", "1:23", "a fact is never None (None is what a query gives when the fact is unknown, and a "
     "comparison with an unknown fact does not hold): '==' never holds"),
    ("rank(x) in []", "1:23", "nothing is in an empty sequence: 'in' never holds"),
    ("is_float(x) and rank(x) in ()", "1:39", "nothing is in an empty sequence: 'in' never holds"),
    ("[1, 2] < (1, 2)", "1:23", "'<' cannot order a list and a tuple (a shape is a tuple): the comparison never holds"),
    ("shape(x) >= [1, 1]", "1:23",
     "'>=' cannot order a list and a tuple (a shape is a tuple): the comparison never holds"),
    ('shape(x) == (2, "a")', "1:23", "a shape holds ints, never a string: '==' never holds"),
    # a shape is no int, as in Python (a variable bound at a stride is of any kind: s == 1 holds for [1, 1])
    ("shape(x) == 1", "1:23", "a sequence is never equal to an int: '==' never holds"),
    ("[2, None] == shape(x)", "1:23", "a shape holds ints, never None: '==' never holds"),
])
def test_where_clause_that_never_decides(clause, position, message):
    assert diags(f"rule r: relu(x) where {clause} => x") == [("E306", position, message)]


def test_a_predicate_s_parameters_before_its_varargs_are_required():
    # const() of nothing would hold everywhere: const takes one value at least
    assert diags("rule r: relu(x) where const() => x") == [("E205", "1:23", "const() is missing argument 'value'")]


@pytest.mark.parametrize("clause", [
    "shape(x)[0] > 3", "shape(x)[-1] == 1 and rank(x) >= 2", "shape(x) != 1", "shape(x) == (1, 2)",
    "dtype(x) in (torch.float16, torch.bfloat16)", "dtype(x) != torch.int64", 'device(x) == "cpu"',
    "numel(x) > 0 and users(x) == 1", "value(x) == 0.0", "value(x)", "x", "not x", "x == 3", "x > 1",
    "shape(x) < (3, 4)", "rank(x) > 1.5", "single_use(x) and not is_float(x)", "True",
    # inside and/or/not a value counts by its truth; a never-true comparison may be meant there
    "not numel(x)", "rank(x) and is_float(x)", "users(x) or is_float(x)", "rank(x) != None",
    'dtype(x) != "float16"', "not (dtype(x) == 4)", "is_float(x) or dtype(x) == 4",
    "value(x) == None", "x == None", "rank(x) in [] or is_float(x)", "not rank(x) == None", "[1] < [2]",
    "shape(x) == [2, 3]", "(2, 3) == shape(x)", "shape(x)[0] in [1, 2]", "const(x)", "const(x, x)",
])
def test_where_clauses_of_known_kinds_that_can_decide(clause):
    ok(f"rule r: relu(x) where {clause} => x")


def _e306_channels(x) -> Optional[int]:  # a query's kind is its return annotation
    return None


def _e306_anything(x):  # no annotation: anything
    return None


def _e306_odd(x) -> [int]:  # an annotation that is no type: anything
    return None


def test_where_kinds_of_a_users_query_come_from_its_return_annotation():
    import rewrite

    rewrite.register_query("e306_channels")(_e306_channels)
    rewrite.register_query("e306_anything")(_e306_anything)
    assert diags("rule r: relu(x) where e306_channels(x) => x") == [
        ("E306", "1:23", "a where clause must be a condition; this is an int")]
    ok("rule r: relu(x) where e306_channels(x) > 3 => x")
    ok("rule r: relu(x) where e306_anything(x) => x")
    ok("rule r: relu(x) where e306_anything(x) > 3 => x")
    rewrite.register_query("e306_odd")(_e306_odd)
    ok("rule r: relu(x) where e306_odd(x) => x")
