"""Instances of parametrized rule files, and literals of the wrong type.

Two instances of one ``param`` template live in one program: a declaration that
depends on no parameter is the same in both and is loaded once (as a file imported
twice is), one that depends on a parameter gets an instance-specific name. A literal
argument an op's parameter can never take (``softmax(x, "a")``, ``to(x, 3)``, a
``param`` bound to ``3`` where it is used as a dtype) is E206 at ``file:line:col``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import rewrite
from rewrite.language import RuleError

RULES = Path(__file__).resolve().parents[1] / "rules"

POLICY = (
    "param lowp\n"
    "rule relu_lowp(shared=True):\n"
    "    relu(to(y, torch.float32)) where dtype(y) == lowp => to(relu(y), torch.float32)\n"
    "rule neg_neg: neg(neg(x)) => x\n"
    "rule cast_back: sigmoid(to(y, torch.float32)) where dtype(y) == lowp => to(sigmoid(y), torch.float32)\n"
    "ruleset policy_lowp = fixpoint(relu_lowp, neg_neg, cast_back)\n"
    "ruleset everything = fixpoint(policy_lowp)\n"
)

BOTH = (
    'import "policy.rw" with lowp = torch.bfloat16 as bf16\n'
    'import "policy.rw" with lowp = torch.float16 as fp16\n'
    "ruleset main = seq(policy_bf16, policy_fp16)\n"
)


def _write(tmp_path: Path, **files: str) -> None:
    for name, text in files.items():
        (tmp_path / f"{name}.rw").write_text(text)


def _errors(*paths) -> list:
    with pytest.raises(RuleError) as info:
        rewrite.load(*paths)
    return info.value.diagnostics


def _parse_errors(text: str) -> list:
    with pytest.raises(RuleError) as info:
        rewrite.parse(text, "t.rw")
    return [(d.code, f"{d.span.line}:{d.span.col}", d.message) for d in info.value.diagnostics]


# ------------------------------------------------------------ two instances of one template


def test_two_instances_of_a_template_load_together(tmp_path):
    _write(tmp_path, policy=POLICY, main=BOTH)
    rules = rewrite.load(tmp_path / "main.rw")
    # neg_neg depends on no parameter: one rule; cast_back uses lowp: one per instance
    assert sorted(rules.rules) == ["cast_back_bf16", "cast_back_fp16", "neg_neg", "relu_bf16", "relu_fp16"]
    # `everything` names a renamed ruleset, so it differs between instances too
    assert {"policy_bf16", "policy_fp16", "everything_bf16", "everything_fp16", "main"} <= set(rules.sets)
    assert {getattr(r, "name", r) for r in rules["policy_fp16"].scheduled_rules()} == {
        "relu_fp16", "neg_neg", "cast_back_fp16"}


def test_the_shared_rule_is_loaded_once(tmp_path):
    _write(tmp_path, policy=POLICY, main=BOTH)
    from rewrite.language import load_program

    program = load_program([tmp_path / "main.rw"])
    names = [r.name for r in program.rules]
    assert names.count("neg_neg") == 1 and len(names) == len(set(names))


def test_the_shipped_policy_instantiated_twice_loads(tmp_path):
    policy = (RULES / "amp" / "policy.rw").resolve()
    _write(tmp_path, main=(
        f'import "{policy}" with lowp = torch.bfloat16 as bf16\n'
        f'import "{policy}" with lowp = torch.float16 as fp16\n'
        "ruleset main = fixpoint(policy_bf16, policy_fp16)\n"))
    rules = rewrite.load(tmp_path / "main.rw")
    assert {"conv_bf16", "conv_fp16", "fold_cast", "to_chain", "type_as_f32"} <= set(rules.rules)
    assert "fold_cast_bf16" not in rules.rules  # no parameter in it: the same rule in both


def test_amp_bf16_and_amp_fp16_together_clash_only_on_their_own_rulesets():
    # The policy's rules no longer clash. Both files also declare `ruleset amp` and
    # `ruleset main`, two different rulesets with one name each: those are real
    # duplicates, reported at amp_fp16.rw with the first definition in amp_bf16.rw.
    bf16, fp16 = RULES / "amp_bf16.rw", RULES / "amp_fp16.rw"
    try:
        rewrite.load(bf16, fp16)
    except RuleError as err:
        diags = err.diagnostics
    else:
        return
    assert diags and all(d.code == "E401" for d in diags)
    assert all(d.span.path.endswith("amp_fp16.rw") for d in diags), [str(d) for d in diags]
    for d in diags:
        (prev, note), = d.related
        assert prev.path.endswith("amp_bf16.rw") and "first defined here" in note


def test_the_reproducer_of_the_duplicate_name_error_loads(tmp_path):
    _write(tmp_path, policy=(
        "param lowp\n"
        "rule relu_lowp(shared=True):\n"
        "    relu(to(y, torch.float32)) where dtype(y) == lowp => to(relu(y), torch.float32)\n"
        "rule neg_neg: neg(neg(x)) => x\n"
        "ruleset policy_lowp = fixpoint(relu_lowp, neg_neg)\n"), both=BOTH)
    rules = rewrite.load(tmp_path / "both.rw")
    assert sorted(rules.rules) == ["neg_neg", "relu_bf16", "relu_fp16"]


def test_two_different_rules_with_one_name_are_still_a_duplicate(tmp_path):
    _write(tmp_path, a="rule r: neg(neg(x)) => x\n", b="\nrule r: relu(relu(x)) => relu(x)\n")
    (d,) = _errors(tmp_path / "a.rw", tmp_path / "b.rw")
    assert (d.code, d.span.path.endswith("b.rw"), d.span.line, d.span.col) == ("E401", True, 2, 6)
    ((prev, note),) = d.related
    assert prev.path.endswith("a.rw") and (prev.line, prev.col) == (1, 6) and "first defined here" in note


def test_a_rule_like_the_shared_one_in_another_file_is_a_duplicate(tmp_path):
    # the same text, but another declaration: not merged with the template's
    _write(tmp_path, policy=POLICY, main=BOTH + "rule neg_neg: neg(neg(x)) => x\n")
    (d,) = _errors(tmp_path / "main.rw")
    assert d.code == "E401" and d.span.path.endswith("main.rw") and d.span.line == 4
    assert d.related[0][0].path.endswith("policy.rw") and d.related[0][0].line == 4


def test_untagged_instances_clash_with_notes_at_both_imports(tmp_path):
    _write(tmp_path, policy=POLICY, main=(
        'import "policy.rw" with lowp = torch.bfloat16\n'
        'import "policy.rw" with lowp = torch.float16\n'))
    diags = _errors(tmp_path / "main.rw")
    # relu_lowp, cast_back, policy_lowp and everything depend on lowp; neg_neg does not
    assert sorted(d.message.split("'")[1] for d in diags) == ["cast_back", "everything", "policy_lowp", "relu_lowp"]
    d = next(d for d in diags if "'cast_back'" in d.message)
    assert d.code == "E401" and d.span.path.endswith("policy.rw") and d.span.line == 5
    first, one, other = d.related
    assert first[0].path.endswith("policy.rw") and "first defined here" in first[1]
    assert (one[0].path.endswith("main.rw"), one[0].line) == (True, 1) and "torch.bfloat16" in one[1]
    assert (other[0].path.endswith("main.rw"), other[0].line) == (True, 2) and "torch.float16" in other[1]
    assert "tag" in d.help


def test_an_error_in_a_shared_rule_is_reported_once_and_in_a_dependent_one_per_instance(tmp_path):
    _write(tmp_path, policy=(
        "param lowp\n"
        "rule shared_bad: relu(x) => add(x, y)\n"
        "rule cast_lowp: neg(x) where dtype(x) == lowp => add(x, z)\n"), main=BOTH.replace(
            "ruleset main = seq(policy_bf16, policy_fp16)\n", ""))
    diags = _errors(tmp_path / "main.rw")
    assert sorted((d.code, d.span.line) for d in diags) == [("E301", 2), ("E301", 3), ("E301", 3)]
    per_instance = [d for d in diags if d.span.line == 3]
    assert sorted(d.related[-1][0].line for d in per_instance) == [1, 2]  # which import made it


# ------------------------------------------------------------ E206: literals of the wrong type


def test_the_reproducer_literals_are_refused_with_positions():
    got = _parse_errors('rule u: tanh(x) => softmax(x, "a")\n'
                        'rule s: neg(x) => add(x, "str")\n'
                        "rule r: relu(x) => to(x, 3)\n")
    assert got == [
        ("E206", "1:31", "argument 'dim' of 'softmax' takes an int, not the string \"a\""),
        ("E206", "2:26", "argument 'other' of 'add' takes a tensor or a number, not the string \"str\""),
        ("E206", "3:26", "argument 'dtype' of 'to' takes a dtype or None, not the int 3"),
    ]


def test_the_hint_names_the_signature():
    with pytest.raises(RuleError) as info:
        rewrite.parse('rule u: tanh(x) => softmax(x, "a")\n', "t.rw")
    (d,) = info.value.diagnostics
    assert d.help == "signature: softmax(input, dim, dtype=None)"
    assert str(d) == 't.rw:1:31: error: argument \'dim\' of \'softmax\' takes an int, not the string "a" [E206]'
    with pytest.raises(RuleError) as info:
        rewrite.parse('rule u: tanh(x) => to(x, "cuda")\n', "t.rw")
    assert "torch.float32" in info.value.diagnostics[0].help


@pytest.mark.parametrize("text, position", [
    ('rule r: softmax(x, "a") => x', "1:20"),  # in a pattern too
    ("rule r: softmax(x, 1.5) => x", "1:20"),  # a float is no int
    ("rule r: tanh(x) => softmax(x, None)", "1:31"),  # dim is not optional
    ('rule r: tanh(x) => mean(x, keepdim="yes")', "1:36"),  # by keyword
    ('rule r: tanh(x) => permute(x, [0, "a"])', "1:35"),  # an item of a list
    ("rule r: tanh(x) => softmax(x, torch.float32)", "1:31"),  # a dtype is no int
    ('rule r: tanh(x) => gelu(x, 1)', "1:28"),  # approximate is a string
    ('rule r: tanh(x) => leaky_relu(x, "a")', "1:34"),
    ("rule r: tanh(x) => mm(x, 2)", "1:26"),  # a number for a tensor no form turns into one
    ("rule r: tanh(x) => matmul(x, 1.5)", "1:30"),
    ("rule r: tanh(x) => linear(x, weight=2)", "1:37"),
])
def test_literals_no_form_can_take_are_refused(text, position):
    got = _parse_errors(text + "\n")
    assert [(c, p) for c, p, _ in got] == [("E206", position)]


def test_an_item_of_a_list_is_named():
    (got,) = _parse_errors('rule r: tanh(x) => permute(x, [0, "a"])\n')
    assert got[2] == "argument 'dims' of 'permute' takes a list of ints, not a list holding the string \"a\""


@pytest.mark.parametrize("text", [
    "rule r: leaky_relu(x, 1) => x",  # an int is a valid float
    "rule r: tanh(x) => dropout(x, 1, False)",
    "rule r: linear(x, w, None) => linear(x, w)",  # None for an optional parameter
    "rule r: tanh(x) => to(x, torch.float16)",
    "rule r: conv(x, w, b, 1, 0, 1, 1) => conv(x, w, b, (1, 1), [0, 0], 1, 1)",  # one value for a list
    'rule r: gelu(x, "tanh") => x',
    "rule r: mul(x, 1) => x",  # a number for a tensor
    "rule r: sub(0, x) => neg(x)",
    "rule r: tanh(x) => div(x, 2)",  # torch turns numbers into tensors for add/sub/mul/div
    "rule r: tanh(x) => pow(2, x)",  # another form (aten.pow.Scalar) takes a number
    "rule r: tanh(x) => clamp(x, 0, 1)",
    "rule r: tanh(x) => masked_fill(x, x, 0)",
    "rule r: mean(x, -1, True) => x",
    'rule r: tanh(x) => getitem(x, "a")',  # no schema: anything
    'rule r: tanh(x) => pad(x, [1, 1], "constant", 0)',
    "rule r: tanh(x) => softmax(x, True)",  # aten takes a bool as an int
])
def test_literals_a_form_can_take_are_accepted(text):
    rewrite.parse(text + "\n", "t.rw")


def test_a_call_with_an_arity_error_is_not_also_a_type_error():
    assert [c for c, _, _ in _parse_errors("rule c: tanh(x) => gelu(x, 1, 2)\n")] == ["E201"]


# ------------------------------------------------------------ E206: param bindings


CAST_POLICY = (
    "param lowp\n"
    "rule tanh_lowp(tolerance=\"approx\"):\n"
    "    tanh(x) where dtype(x) == torch.float32 => to(tanh(to(x, lowp)), torch.float32)\n"
    "rule sigmoid_lowp(tolerance=\"approx\"):\n"
    "    sigmoid(x) where dtype(x) == torch.float32 => to(sigmoid(to(x, lowp)), torch.float32)\n"
)


@pytest.mark.parametrize("value, what", [("3", "the int 3"), ('"cuda"', 'the string "cuda"'),
                                         ("2.5", "the float 2.5"), ("(1, 2)", "a tuple")])
def test_a_binding_used_as_a_dtype_must_be_a_dtype(tmp_path, value, what):
    _write(tmp_path, policy=CAST_POLICY, main=f'import "policy.rw" with lowp = {value} as x\n')
    (d,) = _errors(tmp_path / "main.rw")  # once, at the binding, not once per use
    assert d.code == "E206"
    assert d.span.path.endswith("main.rw") and (d.span.line, d.span.col) == (1, 32)
    assert d.message == (f"parameter 'lowp' is bound to {what}, but it is passed as argument 'dtype' of 'to', "
                         "which takes a dtype or None")
    ((use, note),) = d.related
    assert use.path.endswith("policy.rw") and (use.line, use.col) == (3, 62)
    assert note == "'lowp' is used here (and in 1 more place like it)"


def test_a_binding_that_fits_loads(tmp_path):
    _write(tmp_path, policy=CAST_POLICY, main=(
        'import "policy.rw" with lowp = torch.bfloat16 as bf16\n'
        'import "policy.rw" with lowp = torch.float16 as fp16\n'))
    assert sorted(rewrite.load(tmp_path / "main.rw").rules) == [
        "sigmoid_bf16", "sigmoid_fp16", "tanh_bf16", "tanh_fp16"]


def test_the_shipped_policy_refuses_a_binding_that_is_no_dtype(tmp_path):
    policy = (RULES / "amp" / "policy.rw").resolve()
    for value in ("3", '"cuda"'):
        _write(tmp_path, main=f'import "{policy}" with lowp = {value} as x\n')
        (d,) = _errors(tmp_path / "main.rw")
        assert d.code == "E206" and d.span.path.endswith("main.rw") and d.span.line == 1
        assert d.related[0][0].path.endswith("policy.rw")
    _write(tmp_path, main=f'import "{policy}" with lowp = torch.float16 as x\n')
    assert "conv_x" in rewrite.load(tmp_path / "main.rw").rules


def test_a_binding_only_compared_is_checked_as_bound(tmp_path):
    # dtype(x) == 3 never holds: the rule would never fire (E306, with a note at the import)
    _write(tmp_path, policy="param lowp\nrule r_lowp: relu(x) where dtype(x) == lowp => x\n",
           main='import "policy.rw" with lowp = 3 as x\n')
    (d,) = _errors(tmp_path / "main.rw")
    assert d.code == "E306" and d.span.path.endswith("policy.rw")
    _write(tmp_path, main='import "policy.rw" with lowp = torch.float16 as x\n')
    assert list(rewrite.load(tmp_path / "main.rw").rules) == ["r_x"]


def test_a_bad_item_of_a_bound_sequence_is_reported_at_the_binding(tmp_path):
    _write(tmp_path, policy="param dims\nrule r: relu(x) => permute(relu(x), dims)\n",
           main='import "policy.rw" with dims = [1, "a"] as x\n')
    (d,) = _errors(tmp_path / "main.rw")
    assert d.code == "E206" and d.span.path.endswith("main.rw") and (d.span.line, d.span.col) == (1, 36)


# ------------------------------------------------------------ the shipped rules


@pytest.mark.parametrize("path", sorted(p.name for p in RULES.glob("*.rw")) +
                         sorted(f"quant/{p.name}" for p in (RULES / "quant").glob("*.rw")))
def test_every_shipped_rule_file_loads(path):
    assert rewrite.load(RULES / path).rules
