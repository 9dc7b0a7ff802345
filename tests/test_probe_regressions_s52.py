"""Regressions from session 52: QAT on an exported model (probe CV F1 of session 51).

``torch.export`` captures the eval-mode copy, so a batch norm the QAT rules do not
fold and every dropout were ``training=False`` calls: they stayed in eval mode while
the QAT model trained, where ``capture="fx"`` (and the float model) train them."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import rewrite.qat as rqat


class _LinearHead(nn.Module):
    """A conv (its batch norm folds into a QAT conv), then batch norms the QAT rules
    do not fold: after a ReLU, after a linear (a head's BatchNorm1d), and dropouts."""

    def __init__(self, momentum=0.1, affine=True):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.bn_after_relu = nn.BatchNorm2d(4, momentum=momentum, affine=affine)
        self.drop2d = nn.Dropout2d(0.5)
        self.fc = nn.Linear(4 * 6 * 6, 8)
        self.bn1d = nn.BatchNorm1d(8, momentum=momentum, affine=affine)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        y = self.drop2d(self.bn_after_relu(torch.relu(self.bn(self.conv(x)))))
        return self.drop(self.bn1d(self.fc(y.flatten(1))))


def _x(seed=0):
    return torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(seed)) * 2 + 1


def _stats(qat):
    return {k: v.clone() for k, v in qat.state_dict().items() if k.endswith(("running_mean", "running_var"))}


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_unfolded_batch_norms_train_on_batch_statistics(capture):
    """Under export the BatchNorm1d and the BatchNorm2d after the ReLU kept their
    running statistics unchanged through a training step, and the train-mode
    output was the eval-mode output (no dropout either)."""
    torch.manual_seed(0)
    model = _LinearHead().eval()
    caller = copy.deepcopy(model.state_dict())
    qat = rqat.prepare_qat(model, (_x(),), capture=capture)
    norms = [m for m in qat.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(norms) == 3  # the QAT conv's own, and the two the rules leave
    before = _stats(qat)
    assert len(before) == 6
    qat.train()
    out = qat(_x(1))
    out.sum().backward()
    after = _stats(qat)
    assert all(not torch.equal(before[k], after[k]) for k in before), \
        [k for k in before if torch.equal(before[k], after[k])]
    # the unfolded norms' affine weights train, and they are the QAT model's parameters
    trained = {id(p) for p in qat.parameters()}
    for m in norms:
        assert m.weight.grad is not None and id(m.weight) in trained
    # dropouts drop in train mode and not in eval mode
    torch.manual_seed(1)
    a = qat(_x(2))
    b = qat(_x(2))
    assert not torch.equal(a, b)
    qat.eval()
    assert torch.equal(qat(_x(2)), qat(_x(2)))
    # the caller's model is untouched
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in caller.items())
    assert not model.training


def test_export_and_fx_train_alike():
    """The same model prepared at both capture levels gives the same train-mode
    batch-norm outputs (dropout off) and updates the same running statistics."""
    torch.manual_seed(0)
    model = _LinearHead().eval()
    model.drop.p = model.drop2d.p = 0.0
    outs, means = [], []
    for capture in ("fx", "export"):
        qat = rqat.prepare_qat(model, (_x(),), capture=capture)
        qat.train()
        with torch.no_grad():
            outs.append(qat(_x(3)))
        means.append(sorted(v.sum().item() for k, v in _stats(qat).items() if k.endswith("running_mean")))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    assert means[0] == pytest.approx(means[1], rel=1e-4, abs=1e-5)


def test_convert_reads_the_trained_statistics():
    """After training, ``convert`` computes with the statistics the export QAT model
    trained (its eval-mode output), within int8 rounding."""
    torch.manual_seed(0)
    model = _LinearHead().eval()
    qat = rqat.prepare_qat(model, (_x(),), capture="export")
    opt = torch.optim.SGD(qat.parameters(), lr=1e-2)
    qat.train()
    for step in range(3):
        loss = qat(_x(10 + step)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    qat.eval()
    int8 = rqat.convert(qat)
    with torch.no_grad():
        ref, got = qat(_x(20)), int8(_x(20))
    import rewrite.quant as rq

    assert rq.sqnr(ref, got) >= 20
    # the trainable modules became eval-mode calls again: no batch norm module left
    assert not [m for m in int8.modules() if isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.Dropout))]


@pytest.mark.parametrize("variant", ["momentum_none", "subclass", "functional"])
def test_unknown_facts_leave_the_eval_call(variant):
    """A batch norm whose momentum exports as 0 (``momentum=None``), a user's
    subclass, or ``F.batch_norm`` called directly stays as captured."""

    class MyNorm(nn.BatchNorm1d):
        def forward(self, x):
            return super().forward(x) * 1.0

    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("mean", torch.zeros(4))
            self.register_buffer("var", torch.ones(4))

        def forward(self, x):
            return nn.functional.batch_norm(self.fc(x), self.mean, self.var, training=False)

    if variant == "functional":
        model = Functional()
    else:
        norm = nn.BatchNorm1d(4, momentum=None) if variant == "momentum_none" else MyNorm(4)
        model = nn.Sequential(nn.Linear(4, 4), norm)
    x = torch.randn(5, 4)
    qat = rqat.prepare_qat(model.eval(), (x,), capture="export")
    assert not [m for m in qat.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    [norm] = [n for n in qat.graph.nodes if n.target is torch.ops.aten.batch_norm.default]
    assert norm.args[5] is False
    stats = [getattr(qat, a.target) if "." not in a.target else qat.get_submodule(a.target.rpartition(".")[0])
             .get_buffer(a.target.rpartition(".")[2]) for a in norm.args[3:5]]
    before = [t.clone() for t in stats]
    qat.train()
    qat(x * 3 + 2)
    assert all(torch.equal(a, b) for a, b in zip(before, stats))
