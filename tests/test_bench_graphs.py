"""The matcher benchmark's inputs are right: synthetic graphs are valid, runnable and
of the requested size, and this project, torch.fx's replace_pattern and Inductor's
pattern matcher make the same rewrites on them (benchmarks/matcher.py compares
their speed only when that holds). No timing here."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import fx

from tests.fx_helpers import load_benchmark


synthetic = load_benchmark("synthetic", "synthetic.py")
bench = load_benchmark("bench_matcher", "matcher.py")

# every motif planted at least once in 300 nodes
SMALL = {"n_nodes": 300, "density": 120.0}


@pytest.fixture(scope="module", params=["transformer", "conv"])
def small(request):
    return synthetic.GENERATORS[request.param](**SMALL)


@pytest.mark.parametrize("family", ["transformer", "conv"])
@pytest.mark.parametrize("n", [60, 300, 3000])
def test_generator_makes_valid_graph_of_requested_size(family, n):
    g = synthetic.GENERATORS[family](n, density=20.0, seed=1)
    assert len(g.gm.graph.nodes) == n
    g.gm.graph.lint()
    for node in g.gm.graph.nodes:
        if node.op != "output":
            assert "val" in node.meta, node
    inputs = synthetic.make_inputs(g)
    out = g.gm(*inputs)
    assert tuple(out.shape) == g.input_shapes[0]
    assert torch.isfinite(out).all()
    assert sum(g.expected.values()) >= sum(g.planted.values())
    if n >= 300:
        assert g.planted


def test_small_graph_plants_every_motif(small):
    assert set(small.planted) == set(synthetic.MOTIFS)
    assert len(small.gm.graph.nodes) == SMALL["n_nodes"]


def test_generator_is_deterministic():
    a, b = synthetic.transformer_graph(500, seed=3), synthetic.transformer_graph(500, seed=3)
    assert a.expected == b.expected
    assert [str(n.target) for n in a.gm.graph.nodes] == [str(n.target) for n in b.gm.graph.nodes]


def test_every_rule_has_peer_patterns():
    ours = {r.name for r in bench.Ours().rules}
    assert len(ours) >= 20
    assert {r.name for r in bench.peer_rules(bench._Aten)} == ours
    assert {r.name for r in bench.peer_rules(bench._Torch)} == ours
    assert set(synthetic.MOTIFS) == ours  # every rule gets work


def _check_outputs(original: fx.GraphModule, rewritten: fx.GraphModule, g) -> None:
    inputs = synthetic.make_inputs(g, seed=7)
    with torch.no_grad():
        torch.testing.assert_close(rewritten(*inputs), original(*inputs), rtol=1e-5, atol=1e-6)


def test_this_project_makes_the_planted_rewrites(small):
    run = bench.Ours().rewrite(small.gm, budget=60)
    assert run.counts == small.expected
    result = bench.Ours().rules.apply(small.gm, example_inputs=synthetic.make_inputs(small))  # checked
    assert result.equivalence.ok


def test_replace_pattern_makes_the_same_rewrites(small):
    gm = copy.deepcopy(small.gm)
    run = bench.ReplacePattern(bench.peer_rules(bench._Aten)).rewrite(gm, budget=120)
    assert run.complete
    assert run.counts == small.expected
    _check_outputs(small.gm, gm, small)


@pytest.mark.parametrize("graph_patterns_only", [False, True], ids=["register_replacement", "graph_patterns"])
def test_inductor_makes_the_same_rewrites(small, graph_patterns_only):
    gm = copy.deepcopy(small.gm)
    run = bench.Inductor(bench.peer_rules(bench._Aten), graph_patterns_only).rewrite(gm, budget=120)
    assert run.complete
    assert run.counts == small.expected
    _check_outputs(small.gm, gm, small)


@pytest.mark.parametrize("shape", ["fan-out", "fan-in-output", "fan-in-cat"])
def test_fan_out_benchmark_runs_and_both_rewriters_agree(shape, capsys, monkeypatch):
    """benchmarks/fan_out.py: both rewriters make every rewrite (it asserts the
    counts itself) and it prints one row per size. No timing here."""
    fan_out = load_benchmark("bench_fan_out", "fan_out.py")
    monkeypatch.setattr(sys, "argv", ["fan_out.py", "--sizes", "20,40", "--shape", shape])
    fan_out.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 20 |") or
            line.startswith("| 40 |")]
    assert len(rows) == 2


def test_rule_set_scaling_benchmark_runs(capsys, monkeypatch):
    """benchmarks/rule_set_scaling.py prints a row per rule file and graph family."""
    scaling = load_benchmark("bench_rule_set_scaling", "rule_set_scaling.py")
    monkeypatch.setattr(sys, "argv", ["rule_set_scaling.py", "--sizes", "200,400",
                                      "--files", "rules/cleanup.rw,rules/fusion.rw"])
    scaling.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| rules/")]
    assert len(rows) == 4
