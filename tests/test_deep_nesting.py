"""Deeply nested rule expressions (issue 11 item 6): every input a tool accepts, every
other tool handles; the rest is refused by all of them with one positioned diagnostic.

A list literal nested 400 deep used to load, while ``rewrite fmt`` and ``rewrite check
--verify`` died with ``RecursionError`` ("internal error", exit 2). The front end now
refuses nesting deeper than ``rewrite.language.limits.MAX_NESTING`` (a syntax error at
the construct one level too deep), and every tool handles a file at that limit, even
called from a deep stack.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.fx as fx

import rewrite
from rewrite.cli import main
from rewrite.language import RuleError, ast, format_module, format_source, load_program_text, parse_text
from rewrite.language.limits import MAX_NESTING, NESTING_CODE, nesting_depth
from rewrite.trust.verify import verify_rule

MAX = MAX_NESTING
CRASH = ("Traceback", "RecursionError", "internal error", "maximum recursion depth")


def _nest(n: int) -> str:
    return "[" * n + "1" + "]" * n


# A list literal in each place a rule has an expression: (text before the list, text
# after it). One level (a call, a comparison) lies around the list, so a rule at
# depth n holds a list nested n - 1 deep, and the construct one level too deep is the
# MAX-th '['.
FORMS = {
    "pattern": ("rule r: F.pad(x, ", ") => x\n"),
    "replacement": ("rule r: relu(x) => add(x, ", ")\n"),
    "where": ("rule r: permute(x, d) where d == ", " => x\n"),
}


def _form(form: str, depth: int) -> str:
    before, after = FORMS[form]
    return before + _nest(depth - 1) + after


def _too_deep_col(form: str) -> int:
    return len(FORMS[form][0]) + MAX


# Every construct that nests, at a given depth (each loads: the checker accepts it).
CONSTRUCTS = {
    "list": lambda n: f"rule r: relu(x) => add(x, {_nest(n - 1)})",
    "call pattern": lambda n: f"rule r: {'neg(' * n}x{')' * n} => x",
    "call replacement": lambda n: f"rule r: relu(x) => {'neg(' * n}x{')' * n}",
    "keyword call": lambda n: f"rule r: relu(x) => {'add(x, other=' * n}x{')' * n}",
    "index": lambda n: f"rule r: relu(x) where value(x){'[0]' * (n - 2)} == 1 => neg(x)",
    "not": lambda n: f"rule r: relu(x) where {'not ' * (n - 1)}is_float(x) => neg(x)",
    "and": lambda n: f"rule r: relu(x) where {'(is_float(x) and ' * (n - 1)}is_float(x){')' * (n - 1)} => neg(x)",
    "tuple": lambda n: f"rule r: permute(x, d) where d == {'(' * (n - 1)}1{',)' * (n - 1)} => x",
    "compare": lambda n: f"rule r: relu(x) where {'(' * (n - 2)}is_float(x){' == True)' * (n - 2)} == True => neg(x)",
    "schedule": lambda n: f"rule r: relu(x) => neg(x)\nruleset s = {'seq(' * n}r{')' * n}",
}


def _depth(module: ast.Module) -> int:
    exprs = []
    for item in module.items:
        if isinstance(item, ast.Rule):
            exprs += [item.pattern, item.where, item.replacement]
        elif isinstance(item, ast.RuleSetDecl):
            exprs.append(item.schedule)
    return max(nesting_depth(e) for e in exprs if e is not None)


class _Model(torch.nn.Module):
    def forward(self, x):
        return torch.neg(torch.relu(x)).permute(1, 0)


def _apply(ruleset) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ruleset.apply(fx.symbolic_trace(_Model()), check=False)  # no example inputs: nothing to check on


def _run(capsys, *argv) -> tuple:
    code = main(list(argv))
    out, err = capsys.readouterr()
    for text in (out, err):
        assert not any(c in text for c in CRASH), text[-2000:]
    return code, out, err


# ---------------------------------------------------------------- every tool agrees


def _assert_same_program(formatted: str, text: str) -> None:
    before, after = parse_text(text), parse_text(formatted)
    if _depth(before) <= MAX:
        assert after == before
    else:  # comparing ASTs recurses; these files differ from fmt's output in spacing only
        assert re.sub(r"\s+", "", formatted) == re.sub(r"\s+", "", text)


def _agree(capsys, path, text) -> None:
    """Run check, fmt (plain, --check, --write), check --verify and explain on
    ``path``: if check accepts it, each copes; if check refuses it, each refuses
    it with the same first line, ``path:line:col: error: ... [Ennn]``, and fmt
    --write leaves it alone. None crashes."""
    code, _, err = _run(capsys, "check", str(path))
    if code == 0:  # accepted: the others must cope
        assert _run(capsys, "fmt", str(path))[0] == 0
        assert _run(capsys, "check", "--verify", "--max-examples", "1", "--allow-skipped", str(path))[0] in (0, 1)
        assert _run(capsys, "explain", str(path))[0] == 0
        assert _run(capsys, "fmt", "--write", str(path))[0] == 0
        _assert_same_program(path.read_text(), text)
        assert _run(capsys, "fmt", "--check", str(path))[0] == 0
        return
    assert code == 1
    first = err.splitlines()[0]
    assert re.fullmatch(rf"{re.escape(str(path))}:\d+:\d+: error: .+ \[E\d{{3}}\]", first), first
    assert "  help: " in err
    for argv in (["fmt"], ["fmt", "--check"], ["fmt", "--write"], ["check", "--verify"], ["explain"]):
        code, _, err = _run(capsys, *argv, str(path))
        assert (code, err.splitlines()[0]) == (1, first), argv
    assert path.read_text() == text  # fmt --write left it alone


@pytest.mark.parametrize("depth", [MAX + 1, 400, 1000])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_command_agrees_with_the_loader(tmp_path, capsys, form, depth):
    """What ``rewrite check`` accepts, fmt, check --verify and explain handle; what it
    refuses, every command refuses with the same positioned diagnostic. (At 400,
    before the fix: fmt and check --verify exited 2 with an internal RecursionError.)"""
    path = tmp_path / "deep.rw"
    text = _form(form, depth)
    path.write_text(text)
    _agree(capsys, path, text)


# A 400-deep pattern without the front end's limit: the file loads, and applying it
# recurses once per level of the pattern (rewrite.engine.driver._depth) past Python's limit.
@pytest.mark.parametrize("form, depth", [
    (form, depth) for form in sorted(FORMS) for depth in (MAX + 1, 400, 1000) if (form, depth) != ("pattern", 400)
] + [("pattern", 400)])
def test_load_and_apply_agree_with_check(tmp_path, capsys, form, depth):
    path = tmp_path / "deep.rw"
    path.write_text(_form(form, depth))
    code, _, err = _run(capsys, "check", str(path))
    if code == 0:
        _apply(rewrite.load(str(path)))
        return
    with pytest.raises(RuleError) as info:
        rewrite.load(str(path))
    assert str(info.value).splitlines()[0] == err.splitlines()[0]


@pytest.mark.parametrize("depth", [MAX + 1, 400, 1000, 5000])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_too_deep_is_one_syntax_error_at_the_construct(tmp_path, capsys, form, depth):
    path = tmp_path / "deep.rw"
    path.write_text(_form(form, depth))
    for argv in (["check"], ["fmt"]):
        code, _, err = _run(capsys, *argv, str(path))
        assert code == 1
        lines = err.splitlines()
        assert lines[0] == (f"{path}:1:{_too_deep_col(form)}: error: expression nested too deeply "
                            f"(more than {MAX} levels) [{NESTING_CODE}]")
        # the caret under that '[' (of a long line, the excerpt is the part around it)
        caret = lines[2].index("^")
        assert lines[1][caret] == "[" and len(lines[1]) <= 4 + 120 + 6
        assert lines[3].startswith("  help: ") and str(MAX) in lines[3]
        assert lines[-1] == "1 error"


@pytest.mark.parametrize("depth", [400, 1000])
def test_the_console_script_never_shows_a_traceback(tmp_path, depth):
    path = tmp_path / "deep.rw"
    path.write_text(_form("replacement", depth))
    for argv in (["fmt", "--write"], ["check", "--verify", "--max-examples", "1"]):
        proc = subprocess.run([sys.executable, "-m", "rewrite", *argv, str(path)], capture_output=True, text=True)
        assert proc.returncode in (0, 1), proc.stderr[-2000:]
        assert not any(c in proc.stderr + proc.stdout for c in CRASH), proc.stderr[-2000:]
        if depth == 1000:
            assert proc.returncode == 1
            assert re.match(rf"{re.escape(str(path))}:1:\d+: error: expression nested too deeply", proc.stderr)


# ---------------------------------------------------------------- the limit


@pytest.mark.parametrize("construct", sorted(CONSTRUCTS))
def test_the_front_end_accepts_the_limit(construct):
    text = CONSTRUCTS[construct](MAX)
    assert _depth(parse_text(text)) == MAX  # the parse tree and the AST count alike
    load_program_text(text)  # and the checker takes it


@pytest.mark.parametrize("construct", sorted(CONSTRUCTS))
def test_the_front_end_refuses_one_level_more(construct):
    with pytest.raises(RuleError) as info:
        parse_text(CONSTRUCTS[construct](MAX + 1))
    (diag,) = info.value.diagnostics
    assert (diag.code, diag.message) == (NESTING_CODE, f"expression nested too deeply (more than {MAX} levels)")
    assert diag.span.line >= 1 and diag.span.col > 1


def test_nesting_depth_counts_what_a_reader_sees():
    e = parse_text("rule r: f(g(x), [[1]], not a[0]) => x").items[0].pattern
    assert nesting_depth(e) == 3  # f( [ [  and  f( not a[
    assert nesting_depth(ast.Var("x")) == 0
    deep = ast.Var("x")
    for _ in range(50_000):  # iterative: any depth
        deep = ast.ListLit((deep,))
    assert nesting_depth(deep) == 50_000


# ---------------------------------------------------------------- tools at the limit

# Every tool must handle a file at the limit within this many frames above its
# caller (the rest of Python's default 1000 is the caller's).
FRAMES = 700


def _with_frames(fn, frames: int = FRAMES):
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack(0)) + frames)
    try:
        return fn()
    finally:
        sys.setrecursionlimit(old)


@pytest.mark.parametrize("construct", sorted(CONSTRUCTS))
def test_every_tool_handles_the_limit_from_a_deep_caller(construct):
    text = CONSTRUCTS[construct](MAX)
    module = parse_text(text)
    formatted = _with_frames(lambda: format_source(text))
    assert parse_text(formatted) == module
    assert _with_frames(lambda: format_source(formatted)) == formatted
    assert _with_frames(lambda: parse_text(format_module(module))) == module  # the printer
    _with_frames(lambda: load_program_text(text))  # rewrite check
    _with_frames(lambda: _apply(rewrite.parse(text)))


@pytest.mark.parametrize("form", sorted(FORMS))
def test_verify_builds_instances_of_a_rule_at_the_limit(form):
    """check --verify: plan, instances (the deep literal is a pattern argument the
    generator is handed, a replacement argument, a where-clause operand), rewriting."""
    rules = rewrite.parse(_form(form, MAX))
    verdict = _with_frames(lambda: verify_rule(rules, "r", max_examples=1))
    assert verdict.status in ("ok", "skipped", "counterexample"), verdict
    assert not any(c in str(verdict) for c in CRASH), str(verdict)
