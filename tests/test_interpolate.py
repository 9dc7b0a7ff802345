"""``interpolate``: F.interpolate, nn.Upsample and export's aten.upsample_*.vec kernels
as one op, matched and emitted at every capture level, and verified."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import rewrite
from rewrite.capture import capture
from rewrite.trust.verify import verify_rules

RULES = """
# nearest copies elements: it commutes with relu
rule relu_after_nearest: interpolate(relu(x), s, f, "nearest", c) => relu(interpolate(x, s, f, "nearest", c))
# linear interpolation is linear: it commutes with scaling by a number
rule scale_after_linear(tolerance="approx"):
    interpolate(mul(x, 2.0), s, f, m, c) where is_float(x) and m in ("linear", "bilinear", "trilinear")
    => mul(interpolate(x, s, f, m, c), 2.0)
"""


class Resize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Upsample(scale_factor=2)

    def forward(self, x):
        return (F.interpolate(torch.relu(x), scale_factor=2, mode="nearest"), self.up(torch.relu(x - 1)),
                F.interpolate(x * 2.0, size=(5, 7), mode="bilinear"),
                F.interpolate(x * 2.0, scale_factor=1.5, mode="bilinear", align_corners=True),
                F.interpolate(x * 2.0, size=(5, 5), mode="bicubic"))  # bicubic is not linear: kept


@pytest.mark.parametrize("level", ["fx", "dynamo", "export", "export_core"])
def test_every_spelling_binds_and_the_rewrite_emits_the_level_s_own(level):
    x = torch.randn(2, 3, 4, 4)
    gm = capture(Resize(), (x,), level)
    result = rewrite.parse(RULES).apply(gm, example_inputs=(x,))
    assert result.counts == {"relu_after_nearest": 2, "scale_after_linear": 2}
    targets = [str(n.target) for n in result.graph_module.graph.nodes if n.op == "call_function"]
    if level.startswith("export"):
        assert sum("upsample_bilinear2d" in t for t in targets) == 2 and not any("interpolate" in t for t in targets)
    for got, want in zip(result.graph_module(x), Resize()(x)):
        torch.testing.assert_close(got, want)


def test_rules_over_interpolate_verify_and_a_wrong_one_is_caught():
    report = verify_rules(rewrite.parse(RULES), max_examples=10, seed=0)
    assert {v.rule: v.status for v in report.verdicts} == {"relu_after_nearest": "ok", "scale_after_linear": "ok"}
    wrong = rewrite.parse('rule w(tolerance="approx"): interpolate(relu(x), s, f, "bicubic", c) where is_float(x) '
                          '=> relu(interpolate(x, s, f, "bicubic", c))')  # bicubic overshoots: not monotone
    assert [v.status for v in verify_rules(wrong, max_examples=30, seed=0).verdicts] == ["counterexample"]
