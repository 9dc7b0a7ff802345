"""A robust front end: whatever text or bytes a rule file holds, loading it either works
or raises ``rewrite.RuleError`` whose every diagnostic has a position; never another
exception, never a hang.

Two generators:

* grammar-aware: token sequences built from the grammar's productions (imports,
  families, rules with options, where clauses, calls, alternatives, ``as``, literals,
  comparisons, indexing, rulesets with nested schedules), over the real vocabulary
  (ops, qualified names, predicates, constant functions) so texts get past the parser
  into the checker and compiler; then token-level mutations (drop, duplicate, swap,
  insert a stray token) and random layout (spaces, newlines, comments);
* byte-level: the shipped rule files with bytes flipped, dropped, duplicated or
  inserted (invalid UTF-8, NUL, brackets, quotes), loaded from disk next to the files
  they import.

Each example runs under an alarm, so a hang fails the test instead of stalling it.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rewrite
from rewrite.language import RuleError, format_module, parse_text

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "rules").rglob("*.rw"))
SHIPPED_BYTES = {p: p.read_bytes() for p in SHIPPED}  # read once: draws must not depend on the disk
TIME_LIMIT_S = 20


@contextlib.contextmanager
def _deadline(seconds: int = TIME_LIMIT_S):
    """Fail (instead of hanging) when the body runs longer than ``seconds``."""
    def expire(signum, frame):
        raise TimeoutError(f"loading took longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _assert_diagnostics(err: RuleError, text: str | None = None) -> None:
    assert err.diagnostics, "a RuleError without diagnostics"
    n_lines = len(text.splitlines()) + 1 if text is not None else None
    for d in err.diagnostics:
        assert d.span is not None, f"diagnostic without a position: {d}"
        assert d.span.line >= 1 and d.span.col >= 1, d
        if n_lines is not None and d.span.path in ("fuzz.rw",):
            assert d.span.line <= n_lines, (d, n_lines)
        assert re.fullmatch(r"E\d{3}", d.code), d
        assert d.message
    assert str(err).endswith(err.summary())


def _load_text(text: str) -> None:
    """``rewrite.parse`` (parser, checker, compiler) works or raises a positioned RuleError;
    what parses prints back to the same AST."""
    with _deadline():
        try:
            rewrite.parse(text, "fuzz.rw")
        except RuleError as err:
            _assert_diagnostics(err, text)
        try:
            module = parse_text(text, "fuzz.rw")
        except RuleError as err:
            _assert_diagnostics(err, text)
            return
        assert parse_text(format_module(module), "fuzz.rw") == module


# ---------------------------------------------------------------- grammar-aware texts

OPS = ["relu", "gelu", "conv", "batch_norm", "add", "mul", "to", "permute", "cat", "linear", "reshape",
       "view", "transpose", "silu", "sigmoid", "dropout", "identity", "neg", "embedding", "getitem"]
QUALIFIED = ["aten.conv2d", "F.relu", "nn.Conv2d", "Tensor.clamp", "torch.nn.functional.gelu",
             "aten.add.Tensor", "operator.add", "torch.relu", "aten.hardsigmoid", "F.elu", "torch.float32",
             "torch.flaot16", "os.system", "torch.load", "x.__class__", "__import__", "aten.rleu"]
FUNCTIONS = ["const", "single_use", "is_float", "dtype", "rank", "shape", "conv_bn_weight", "cast",
             "minmax_observer", "perms_cancel", "lossless_cast", "value", "users"]
VARS = ["x", "y", "w", "b", "c", "d", "_x", "p", "q", "eps", "groups"]
ALL_NAMES = OPS + QUALIFIED + FUNCTIONS + VARS
STRAY = ["&&", "->", "!", "@", "$", "=", "==", "|", ",", ":", "(", ")", "[", "]", ".", "...", "=>", "#",
         '"unterminated', "'x", '"\\q"', "1e", "0x10", "1_000", "-", "é", "\x00", "\u202e", "–", "`",
         "rule", "where", "and", "or", "not", "in", "as", "import", "family", "ruleset", "true", "none",
         "9" * 40, "-1.5e300", "1e999", ".5", "2.", "\t", "\\", "'", '"']

_name = st.sampled_from(ALL_NAMES)
_var = st.sampled_from(VARS + ["_"])
_literal = st.one_of(
    st.integers(-10**30, 10**30).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.text(max_size=5).map(repr),
    st.sampled_from(["True", "False", "None", "torch.float32", "torch.bfloat16", "torch.int64"]),
)


def _join(parts: list) -> list:
    return [t for part in parts for t in part]


def _commas(items: list) -> list:
    out: list = []
    for i, item in enumerate(items):
        if i:
            out.append(",")
        out += item
    return out


def _bars(names: list) -> list:
    return [t for i, n in enumerate(names) for t in ((["|"] if i else []) + [n])]


def _exprs(leaf):
    def extend(inner):
        callee = st.one_of(_name.map(lambda n: [n]),
                           st.lists(_name, min_size=2, max_size=3).map(lambda ns: ["("] + _bars(ns) + [")"]))
        arg = st.one_of(inner, st.tuples(st.sampled_from(VARS + ["training", "eps", "alpha"]), inner).map(
            lambda kv: [kv[0], "="] + kv[1]))
        args = st.tuples(st.lists(arg, max_size=4), st.booleans()).map(
            lambda a: _commas(a[0] + ([["..."]] if a[1] else [])))
        call = st.tuples(callee, args).map(lambda ca: ca[0] + ["("] + ca[1] + [")"])
        return st.one_of(
            call,
            st.tuples(call, _var).map(lambda cv: cv[0] + ["as", cv[1]]),
            st.tuples(inner, st.sampled_from(["==", "!=", "<", "<=", ">", ">=", "in", "not in"]), inner).map(
                lambda t: t[0] + t[1].split() + t[2]),
            st.tuples(inner, st.sampled_from(["and", "or"]), inner).map(lambda t: t[0] + [t[1]] + t[2]),
            inner.map(lambda e: ["not"] + e),
            st.tuples(inner, inner).map(lambda t: t[0] + ["["] + t[1] + ["]"]),
            st.lists(inner, max_size=3).map(lambda xs: ["("] + _commas(xs) + ([","] if len(xs) == 1 else []) + [")"]),
            st.lists(inner, max_size=3).map(lambda xs: ["["] + _commas(xs) + ["]"]),
            inner.map(lambda e: ["("] + e + [")"]),
        )

    return st.recursive(leaf, extend, max_leaves=10)


_expr = _exprs(st.one_of(_var.map(lambda v: [v]), _literal.map(lambda v: [v]), _name.map(lambda n: [n])))
_option = st.tuples(st.sampled_from(["priority", "shared", "tolerance", "prority"]),
                    st.one_of(_literal.map(lambda v: [v]), _expr)).map(lambda kv: [kv[0], "="] + kv[1])
_rule = st.tuples(
    st.sampled_from(["r", "mul_one", "conv_bn", "a", "b", "in"]),
    st.one_of(st.none(), st.lists(_option, max_size=3)),
    _expr, st.one_of(st.none(), _expr), _expr,
).map(lambda r: ["rule", r[0]] + ([] if r[1] is None else ["("] + _commas(r[1]) + [")"]) + [":"] + r[2]
      + ([] if r[3] is None else ["where"] + r[3]) + ["=>"] + r[4])
_schedule = st.recursive(
    st.sampled_from(["a", "b", "r", "mul_one"]).map(lambda n: [n]),
    lambda inner: st.tuples(st.sampled_from(["fixpoint", "once", "seq", "fixpiont"]),
                            st.lists(inner, max_size=3)).map(lambda s: [s[0], "("] + _commas(s[1]) + [")"]),
    max_leaves=6,
)
_decl = st.one_of(
    _rule,
    st.sampled_from(['"cleanup.rw"', '"missing.rw"', '"fuzz.rw"', "'../rules/fusion.rw'", '""']).map(
        lambda p: ["import", p]),
    st.tuples(st.sampled_from(["act", "relu", "f"]), st.lists(_name, min_size=1, max_size=3)).map(
        lambda f: ["family", f[0], "="] + _bars(f[1])),
    st.tuples(st.sampled_from(["s", "main", "a"]), _schedule).map(lambda s: ["ruleset", s[0], "="] + s[1]),
)


@st.composite
def _mutated(draw, tokens: list) -> list:
    tokens = list(tokens)
    for _ in range(draw(st.integers(0, 3))):
        i = draw(st.integers(0, len(tokens)))
        kind = draw(st.sampled_from(["drop", "insert", "duplicate", "swap"]))
        if kind == "insert" or not tokens:
            tokens.insert(i, draw(st.sampled_from(STRAY + ALL_NAMES)))
        elif kind == "drop":
            del tokens[min(i, len(tokens) - 1)]
        elif kind == "duplicate":
            j = min(i, len(tokens) - 1)
            tokens.insert(j, tokens[j])
        elif len(tokens) > 1:
            j = min(i, len(tokens) - 2)
            tokens[j], tokens[j + 1] = tokens[j + 1], tokens[j]
    return tokens


@st.composite
def rule_texts(draw) -> str:
    tokens = _join(draw(st.lists(_decl, max_size=4)))
    tokens = draw(_mutated(tokens))
    seps = st.sampled_from([" ", " ", " ", "\n", "  ", "\n    ", "\t", " # note\n", "\r\n", ""])
    out = []
    for t in tokens:
        out += [t, draw(seps)]
    return "".join(out)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rule_texts())
def test_grammar_aware_texts_load_or_raise_positioned_rule_errors(text):
    _load_text(text)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(list("rule:=>()[],.|#\"'\\ \n_xa1-e") + ["where", "relu", "..."]),
               max_size=60).map("".join))
def test_character_soup_loads_or_raises_positioned_rule_errors(text):
    _load_text(text)


# ---------------------------------------------------------------- byte-level mutation


@pytest.fixture(scope="module")
def rules_copy(tmp_path_factory):
    """The shipped rules in a scratch directory, so mutated files keep their imports."""
    dest = tmp_path_factory.mktemp("rules")
    shutil.copytree(ROOT / "rules", dest, dirs_exist_ok=True)
    return dest


_INSERTS = [b"\x00", b"\xff", b"\xc3", b"\xe2\x80\xae", b"(", b")", b"[", b'"', b"'", b"#", b"\n", b"=>",
            b"where", b"...", b" as ", b"rule ", b"\\", b"9" * 30, "é".encode(), b"\r"]


@st.composite
def _byte_mutations(draw):
    source = draw(st.sampled_from(SHIPPED))
    data = bytearray(SHIPPED_BYTES[source])
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(data)))
        kind = draw(st.sampled_from(["flip", "delete", "insert", "duplicate", "truncate"]))
        if kind == "flip" and i < len(data):
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif kind == "delete":
            del data[i:i + draw(st.integers(1, 40))]
        elif kind == "insert":
            data[i:i] = draw(st.sampled_from(_INSERTS))
        elif kind == "duplicate":
            data[i:i] = data[i:i + draw(st.integers(1, 80))]
        elif kind == "truncate":
            del data[i:]
    return source, bytes(data)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_byte_mutations())
def test_mutated_shipped_files_load_or_raise_positioned_rule_errors(rules_copy, case):
    source, data = case
    target = rules_copy / source.relative_to(ROOT / "rules")
    original = target.read_bytes()
    target.write_bytes(data)
    try:
        with _deadline():
            try:
                rewrite.load(str(target))
            except RuleError as err:
                _assert_diagnostics(err)
    finally:
        target.write_bytes(original)
    _load_text(data.decode("utf-8", errors="replace"))


# ---------------------------------------------------------------- pathological inputs


@pytest.mark.parametrize("text", [
    "rule r: " + "relu(" * 2000 + "x" + ")" * 2000 + " => x",
    "rule r: relu(x) where " + "not " * 3000 + "const(x) => x",
    "rule r: f(" + "(" * 3000 + "x" + ")" * 3000 + ") => x",
    "rule r: relu(x) where x" + "[0]" * 2000 + " == 1 => x",
    "rule r: relu(x) => x\n" * 2000,
    "(" * 5000,
    '"' * 5000,
    "rule r: add(x, " + ", ".join(["1"] * 3000) + ") => x",
    "rule r: relu(x) where " + " and ".join(["const(x)"] * 3000) + " => x",
    "\x00" * 100,
    "\ufeffrule r: relu(x) => x",
])
def test_pathological_texts(text):
    _load_text(text)


def test_huge_int_literal_is_a_rule_error():
    _load_text("rule r: mul(x, " + "1" * 5000 + ") => x")


def test_many_unknown_names_get_few_hints(monkeypatch):
    """4000 rulesets naming unknown rules: every error is reported, but did-you-mean
    (a search over every name in scope) runs for the first few only: one search per
    error made checking quadratic (> 30 s for a 100 KB file)."""
    import rewrite.language.check as check
    from rewrite.language import RuleError, load_program_text

    calls = []
    real = check.did_you_mean
    monkeypatch.setattr(check, "did_you_mean", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    text = "rule r: relu(x) => x\n" + "".join(f"ruleset s{i} = fixpoint(r, nope{i})\n" for i in range(4000))
    with pytest.raises(RuleError) as info:
        load_program_text(text, "big.rw")
    assert len(info.value.diagnostics) == 4000
    assert len(calls) <= check._HINTS
