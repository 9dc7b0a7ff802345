"""The cliff benchmark's inputs are right (benchmarks/cliffs.py): on every case, at a
small scale, this project and torch.fx's replace_pattern make the same rewrites per
rule, and the rewritten graph computes what the original does. No timing here."""

from __future__ import annotations


import pytest
import torch

from tests.fx_helpers import load_benchmark

SCALE = 0.04


cliffs = load_benchmark("bench_cliffs", "cliffs.py")


@pytest.mark.parametrize("name", list(cliffs.CASES))
def test_both_rewriters_make_the_same_rewrites_and_ours_keeps_the_values(name):
    m = cliffs.measure(name, scale=SCALE, repeat_ours=1, repeat_peer=1)
    assert not m.peer.stopped
    assert m.ours.counts == m.peer.counts
    assert all(n > 0 for n in m.ours.counts.values())
    if name == "F":  # no squares but the first unit's
        assert m.ours.counts == {"square": 1}
    else:
        assert sum(m.ours.counts.values()) > 1, m.ours.counts
    assert m.same
    m.ours.gm.graph.lint()
    torch.manual_seed(0)
    inputs = cliffs.CASES[name].inputs()
    with torch.no_grad():
        want = m.original(*inputs)
        got = m.ours.gm(*inputs)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want)


def test_main_prints_the_table(capsys):
    out = cliffs.main(["--cases", "F,K", "--scale", str(SCALE), "--repeat", "1"])
    assert [m.name for m in out] == ["F", "K"]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| case | nodes | apply(inplace=True) ms | replace_pattern ms | ratio | same rewrites |"
    assert lines[2].startswith("| F | ") and lines[2].endswith("| same (1) |")
    assert lines[3].startswith("| K | ") and "| same (" in lines[3]
    assert any(line.startswith("- K: ATen") for line in lines)
