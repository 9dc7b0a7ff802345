"""One fact, one place: what the engine knows about an op lives on its vocabulary
entry (``OpDef``), and the stages read it from there.

Verification instances (``OpDef.instances``: generator family, input range, attribute
values), the equivalence check's input ranges (``Instances.operand_ranges``) and
aliasing/writes all come from the table; these tests list the ops that lack a piece
and check that each stage really reads the entry.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from rewrite.ops.base import Instances
from rewrite.ops.vocabulary import OPS
from rewrite.trust.instances import FAMILIES, OUTSIDE_VOCABULARY, generator_for, literal_strategy


def test_every_vocabulary_op_has_an_instance_generator():
    """A missing generator shows in the table: this lists the ops without one."""
    without = sorted(name for name, opdef in OPS.items() if opdef.instances is None)
    assert without == []


def test_every_family_named_by_the_table_exists():
    unknown = {name: opdef.instances.family for name, opdef in OPS.items()
               if opdef.instances is not None and opdef.instances.family not in FAMILIES}
    assert unknown == {}
    assert set(OUTSIDE_VOCABULARY.values()) <= set(FAMILIES)


def test_every_listed_literal_names_a_parameter():
    wrong = [(name, param) for name, opdef in OPS.items() if opdef.instances is not None
             for param, _ in opdef.instances.literals if opdef.param(param) is None]
    assert wrong == []
    wrong = [(name, param) for name, opdef in OPS.items() if opdef.instances is not None
             for param, _ in opdef.instances.operand_ranges if opdef.param(param) is None]
    assert wrong == []


def test_generator_comes_from_the_entry():
    """Changing the entry changes what verification draws: the family is read from
    the OpDef, not from a second table keyed by op name."""
    relu = OPS["relu"]
    assert generator_for(relu) is FAMILIES["unary"]
    as_binary = attrs.evolve(relu, instances=Instances("binary"))
    assert generator_for(as_binary) is FAMILIES["binary"]
    assert generator_for(attrs.evolve(relu, instances=None)) is None


def test_literal_values_come_from_the_entry():
    from rewrite.trust.instances import hypothesis_api

    given, settings = hypothesis_api().given, hypothesis_api().settings
    seen = set()

    @settings(max_examples=60, database=None, derandomize=True)
    @given(literal_strategy(OPS["div"].instances, "rounding_mode"))
    def draw(value):
        seen.add(value)

    draw()
    assert seen == {None, "trunc", "floor"}
    assert literal_strategy(OPS["relu"].instances, "inplace") is None


@pytest.mark.parametrize("op", ["sqrt", "rsqrt", "reciprocal"])
def test_input_range_is_the_ops_domain(op):
    """sqrt/rsqrt/reciprocal draw positive inputs because their entry says so."""
    lo, hi = OPS[op].instances.input_range
    assert 0 < lo < hi
    assert OPS["neg"].instances.input_range[0] < 0


def test_rules_on_previously_ungenerated_ops_verify():
    """sum and embedding had no generator (their rules were reported unverified)."""
    import rewrite
    from rewrite.trust.verify import verify_rules

    rules = rewrite.parse('''
rule sum_neg(tolerance="approx"): sum(neg(x), dim, keepdim) where is_float(x) => neg(sum(x, dim, keepdim))
rule emb_relu: relu(embedding(i, w)) => embedding(i, relu(w))
''')
    report = verify_rules(rules, max_examples=15, seed=0)
    statuses = {v.rule: v.status for v in report.verdicts}
    assert all(s == "ok" for s in statuses.values()), report.table()
    # sum promotes int32 to int64, so negating after it does not wrap like before it
    ints = rewrite.parse("rule ints: sum(neg(x), dim, keepdim) => neg(sum(x, dim, keepdim))")
    assert [v.status for v in verify_rules(ints, max_examples=30, seed=0).verdicts] == ["counterexample"]
    wrong = rewrite.parse("rule bad: sum(neg(x), dim, keepdim) => neg(mean(x, dim, keepdim))")
    bad = verify_rules(wrong, max_examples=30, seed=0)
    assert [v.status for v in bad.verdicts] == ["counterexample"], bad.table()


class _Lookup(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(7, 3)
        self.register_buffer("table", torch.randn(5, 2))
        self.bn = torch.nn.BatchNorm1d(3).eval()

    def forward(self, idx, idx2):
        h = self.bn(self.emb(idx).transpose(1, 2)).sum()
        return h + torch.nn.functional.embedding(idx2, self.table).sum()


def test_check_input_ranges_come_from_the_entries():
    """The equivalence check draws an embedding's indices below its row count and a
    running variance positive because the embedding and batch_norm entries declare
    those operand ranges; export graphs pass both as placeholders."""
    from rewrite.trust.check import inputs_from_graph

    m = _Lookup().eval()
    ep = torch.export.export(m, (torch.zeros(2, 4, dtype=torch.long), torch.zeros(3, dtype=torch.long)))
    core = ep.run_decompositions()  # batch norm read through getitem in core ATen
    for seed, gm in [(s, g) for s in range(4) for g in (ep.graph_module, core.graph_module)]:
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        by_name = dict(zip(names, inputs_from_graph(gm, seed)))
        idx = next(v for k, v in by_name.items() if k.endswith("idx"))
        idx2 = next(v for k, v in by_name.items() if k.endswith("idx2"))
        var = next(v for k, v in by_name.items() if "running_var" in k)
        assert 0 <= int(idx.min()) and int(idx.max()) <= 6
        assert 0 <= int(idx2.min()) and int(idx2.max()) <= 4
        assert float(var.min()) > 0


class _ErfLog(torch.nn.Module):
    def forward(self, x):
        return torch.special.erf(-x) + x.erf() + torch.log(torch.exp(x)) + x.exp().log()


ERF_LOG = '''
rule erf_odd(tolerance="approx"): erf(neg(x)) where is_float(x) => neg(erf(x))
rule log_exp(tolerance="approx"): log(exp(x)) where is_float(x) => x
'''


@pytest.mark.parametrize("level", ["fx", "export", "export_core"])
def test_ops_added_by_one_table_entry_work_at_every_level(level):
    """erf and log were added as one table entry each (commit 'vocabulary: erf and
    log'): they match at every capture level, emit, and verify."""
    import rewrite
    from rewrite.capture import capture

    x = torch.randn(3, 4)
    gm = capture(_ErfLog(), (x,), level)
    result = rewrite.parse(ERF_LOG).apply(gm, example_inputs=(x,))
    assert result.counts.get("log_exp") == 2
    if level == "fx":  # export folds -x into the erf's input the same way
        assert result.counts.get("erf_odd") == 1
    torch.testing.assert_close(result.graph_module(x), _ErfLog()(x), rtol=1e-5, atol=1e-5)


def test_domain_restricted_ops_are_also_drawn_outside_their_domain():
    """exp(log(x)) => x turns log's NaN for x < 0 into a number: the generator draws
    log's input mostly in its domain and sometimes outside it."""
    import rewrite
    from rewrite.trust.verify import verify_rules

    ok = verify_rules(rewrite.parse(ERF_LOG), max_examples=20, seed=0)
    assert ok.ok, ok.table()
    bad = rewrite.parse('rule exp_log(tolerance="approx"): exp(log(x)) where is_float(x) => x')
    assert [v.status for v in verify_rules(bad, max_examples=30, seed=0).verdicts] == ["counterexample"]


def test_docs_reference_is_generated_from_the_registry_and_vocabulary():
    """docs/language.md's op and function lists are ``rewrite.reference``'s output:
    adding an op or a built-in function without regenerating them fails here
    (fix: ``python -m rewrite.reference --write docs/language.md``)."""
    from pathlib import Path

    from rewrite.functions.registry import function_names
    from rewrite.reference import reference_markdown, replace_reference

    docs = (Path(__file__).resolve().parents[1] / "docs" / "language.md").read_text(encoding="utf-8")
    assert replace_reference(docs) == docs
    section = reference_markdown()
    assert all(f"| `{name}` |" in section for name in OPS)
    for name in ("const", "is_float", "same_shape", "module_name", "conv_bn_weight", "minmax_observer"):
        assert name in function_names() and f"| `{name}(" in section


def test_module_name_query_reads_the_module_path():
    """``module_name(x)`` (a registered query) gives the dotted path of the module a
    value came from, so a rule can single out one layer."""
    import rewrite

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4), torch.nn.ReLU())
    x = torch.randn(2, 4)
    rules = rewrite.parse('rule r: relu(x) where module_name(x) == "2" => clamp(x, 0.0, None)')
    for gm in (torch.fx.symbolic_trace(model), torch.export.export(model, (x,)).module()):
        result = rules.apply(gm, example_inputs=(x,))
        assert result.counts.get("r") == 1
        torch.testing.assert_close(result.graph_module(x), model(x))
