"""Parametrized rule files: ``param`` + ``import ... with NAME = value as TAG``.

The shipped AMP rule sets are two instances of ``rules/amp/policy.rw``; these tests
hold the mechanism (substitution, renaming, errors, one fixpoint across instances)
and the promise it exists for: a rule written once in the policy is the same rule,
dtype aside, in both rule sets.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import rewrite
from rewrite.language import RuleError
from rewrite.language.printer import format_rule

RULES = Path(__file__).resolve().parents[1] / "rules"

POLICY = """
param lowp
family act_lowp = relu | gelu
rule sink_lowp(shared=True):
    relu(to(y, torch.float32)) where dtype(y) == lowp => to(relu(y), torch.float32)
rule never_lowp: act_lowp(x) where dtype(x) == lowp and is_none(x) => x
ruleset policy_lowp = fixpoint(sink_lowp, never_lowp)
"""


def _write(tmp_path: Path, **files: str) -> None:
    for name, text in files.items():
        (tmp_path / f"{name}.rw").write_text(text)


def test_two_instances_substitute_the_value_and_rename_the_declarations(tmp_path):
    _write(tmp_path, policy=POLICY, main=(
        'import "policy.rw" with lowp = torch.bfloat16 as bf16\n'
        'import "policy.rw" with lowp = torch.float16 as fp16\n'
        "ruleset main = fixpoint(policy_bf16, policy_fp16)\n"))
    rules = rewrite.load(tmp_path / "main.rw")
    assert sorted(rules.rules) == ["never_bf16", "never_fp16", "sink_bf16", "sink_fp16"]
    assert {"policy_bf16", "policy_fp16", "main"} <= set(rules.sets)
    bf16 = format_rule(rules.rules["sink_bf16"].rule, doc=False)
    assert "dtype(y) == torch.bfloat16" in bf16 and "lowp" not in bf16
    assert format_rule(rules.rules["never_bf16"].rule, doc=False).startswith("rule never_bf16: act_bf16(x)")
    assert "dtype(y) == torch.float16" in format_rule(rules.rules["sink_fp16"].rule, doc=False)


def test_an_instance_rewrites_only_its_own_dtype(tmp_path):
    _write(tmp_path, policy=POLICY, main='import "policy.rw" with lowp = torch.float16 as fp16\n')
    rules = rewrite.load(tmp_path / "main.rw")

    class M(nn.Module):
        def forward(self, a, b):
            return torch.relu(a.float()), torch.relu(b.float())

    gm = fx.symbolic_trace(M())
    a, b = torch.randn(4).half(), torch.randn(4).bfloat16()
    result = rules.apply(gm, example_inputs=(a, b))
    assert result.counts == {"sink_fp16": 1}  # the bfloat16 input is not this instance's
    for got, want in zip(result.graph_module(a, b), gm(a, b)):
        torch.testing.assert_close(got, want)


def test_without_a_tag_names_stay_and_two_instances_clash(tmp_path):
    _write(tmp_path, policy=POLICY, main=(
        'import "policy.rw" with lowp = torch.bfloat16\n'
        'import "policy.rw" with lowp = torch.float16\n'))
    with pytest.raises(RuleError) as info:
        rewrite.load(tmp_path / "main.rw")
    assert {d.code for d in info.value.diagnostics} == {"E401"}


@pytest.mark.parametrize("main, code", [
    ('import "policy.rw" with lowp = torch.bfloat16, scale = 2', "E410"),
    ('import "policy.rw" with lowp = torch.bfloat16, lowp = torch.float16', "E410"),
    ('import "policy.rw"', "E411"),
    ('import "policy.rw" with lowp = dtype(x)', "E412"),
    ('import "policy.rw" with lowp = y', "E412"),
])
def test_bad_bindings_are_reported_at_the_import(tmp_path, main, code):
    _write(tmp_path, policy=POLICY, main=main + "\n")
    with pytest.raises(RuleError) as info:
        rewrite.load(tmp_path / "main.rw")
    codes = [d.code for d in info.value.diagnostics]
    assert codes == [code]
    (d,) = info.value.diagnostics
    assert d.span.path.endswith("main.rw") and d.span.line == 1


def test_a_template_loaded_directly_names_its_parameter(tmp_path):
    _write(tmp_path, policy=POLICY)
    with pytest.raises(RuleError) as info:
        rewrite.load(tmp_path / "policy.rw")
    (d,) = info.value.diagnostics
    assert d.code == "E411" and "'lowp'" in d.message


def test_a_fixpoint_inside_a_fixpoint_is_one_fixpoint():
    # Joined, the nested set's higher-priority rule wins the node; run one after the
    # other, `to_mul` (listed first) would rewrite it before `to_sub` saw it.
    rules = rewrite.parse("""
        rule to_mul: neg(x) => mul(x, -1)
        rule to_sub(priority=10): neg(x) => sub(0, x)
        ruleset inner = fixpoint(to_sub)
        ruleset main = fixpoint(to_mul, inner)
    """)
    gm = fx.symbolic_trace(lambda x: -x)
    x = torch.randn(5)
    result = rules.apply(gm, example_inputs=(x,))
    assert result.counts == {"to_sub": 1}
    torch.testing.assert_close(result.graph_module(x), -x)


# ------------------------------------------------------------ the shipped AMP policy


def _without_dtype(text: str, dtype: str, tag: str) -> str:
    return text.replace(f"torch.{dtype}", "LOWP").replace(tag, "LOWP")


def test_every_policy_rule_is_the_same_rule_in_both_amp_rule_sets():
    names = re.findall(r"^rule (\w+)", (RULES / "amp" / "policy.rw").read_text(), re.M)
    bf16, fp16 = rewrite.load(RULES / "amp_bf16.rw"), rewrite.load(RULES / "amp_fp16.rw")
    assert len(names) > 50
    for name in names:
        b = format_rule(bf16.rules[name.replace("lowp", "bf16")].rule, doc=False)
        f = format_rule(fp16.rules[name.replace("lowp", "fp16")].rule, doc=False)
        assert _without_dtype(b, "bfloat16", "bf16") == _without_dtype(f, "float16", "fp16"), name
    # and each rule set runs every policy rule (its `amp` fixpoint joins the policy's;
    # `main` runs the exits after it)
    for rules, tag in ((bf16, "bf16"), (fp16, "fp16")):
        scheduled = set(rules["main"].scheduled_rules())
        assert {n.replace("lowp", tag) for n in names} <= {getattr(r, "name", r) for r in scheduled}
