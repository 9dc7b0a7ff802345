"""``state_writes`` (the parameters and buffers a graph may write) answers graphs
whose every call is an aten op that writes nothing with its arguments from the
graph's target index, without walking the graph. The answer must be the walk's:
each graph here is asked both ways (the index path turned off by monkeypatch)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from rewrite.ops.effects import state_writes

aten = torch.ops.aten


class _ConvBn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class _Counter(_ConvBn):
    def forward(self, x):
        self.steps.add_(1)
        return super().forward(x) * self.steps


class _AtenBn(nn.Module):
    def __init__(self, training):
        super().__init__()
        self.register_buffer("rm", torch.zeros(3))
        self.register_buffer("rv", torch.ones(3))
        self.training_flag = training

    def forward(self, x):
        return aten.batch_norm.default(x, None, None, self.rm, self.rv, self.training_flag, 0.1, 1e-5, False)


class _Out(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("acc", torch.zeros(4, 3))

    def forward(self, x):
        return aten.add.out(x, x, out=self.acc)


def _export(model, x):
    return torch.export.export(model, (x,), strict=False).module()


X4 = torch.randn(2, 3, 8, 8)
X2 = torch.randn(4, 3)
GRAPHS = {
    "export eval conv-bn": (lambda: _export(_ConvBn().eval(), X4), False),
    "export train conv-bn": (lambda: _export(_ConvBn().train(), X4), True),
    "export counter": (lambda: _export(_Counter().eval(), X4), True),
    "aten batch_norm eval": (lambda: fx.symbolic_trace(_AtenBn(False)), False),
    "aten batch_norm train": (lambda: fx.symbolic_trace(_AtenBn(True)), True),
    "aten add.out": (lambda: fx.symbolic_trace(_Out()), True),
    "symbolic_trace train conv-bn": (lambda: fx.symbolic_trace(_ConvBn().train()), True),
    "symbolic_trace eval conv-bn": (lambda: fx.symbolic_trace(_ConvBn().eval()), False),
    "F.batch_norm train": (lambda: fx.symbolic_trace(_FBn()), True),
}


class _FBn(_AtenBn):
    def __init__(self):
        super().__init__(True)

    def forward(self, x):
        return F.batch_norm(x, self.rm, self.rv, training=True)


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_the_index_answers_as_the_walk_does(name, monkeypatch):
    build, writes = GRAPHS[name]
    gm = build()
    fast = state_writes(gm)
    monkeypatch.setattr("rewrite.ops.effects._only_quiet_calls", lambda graph: False)
    walked = state_writes(gm)
    assert fast == walked
    assert bool(fast) == writes, (fast, gm.code)
