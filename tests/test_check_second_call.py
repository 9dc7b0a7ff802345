"""A model that writes its own state (a call counter, a cache position, running
statistics) computes its next call from what the first call left. Each trial starts
from the saved state, so a rewrite right only for the state the model starts in
passed: the check now also compares a second call in a row (probe N F12)."""

import pytest
import torch

import rewrite
from rewrite.trust.check import check_equivalence

WRONG_UNLESS_ZERO = "rule wrong(shared=True): mul(b, 3.0) => aten.clone(b)   # right only while b == 0\n"
RIGHT = "rule times_one(shared=True): mul(b, 1.0) => aten.clone(b)\n"


class Counter(torch.nn.Module):
    """Adds three times the number of earlier calls."""

    def __init__(self, factor: float = 3.0) -> None:
        super().__init__()
        self.factor = factor
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        out = x * 1.0 + self.n * self.factor
        self.n.add_(1.0)
        return out


class FullCache(torch.nn.Module):
    """Refuses a second call: its one-slot cache is full after the first."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("used", torch.zeros(()))

    def forward(self, x):
        torch._check(self.used.item() == 0)
        self.used.add_(1.0)
        return x * 1.0 + 2.0


def _exported(model, x):
    return torch.export.export(model, (x,)).module()


@pytest.mark.parametrize("inplace", [False, True])
def test_a_rewrite_right_only_for_the_starting_state_is_refused(inplace):
    x = torch.randn(4)
    gm = _exported(Counter(), x)
    with pytest.raises(rewrite.EquivalenceError, match="second call in a row"):
        rewrite.parse(WRONG_UNLESS_ZERO).apply(gm, (x,), inplace=inplace)
    assert float(gm.n) == 0.0  # the check's calls left the counter where it was
    assert torch.equal(gm(x), x)  # the model still starts from zero (and is the original)
    assert float(gm.n) == 1.0


@pytest.mark.parametrize("inplace", [False, True])
def test_a_right_rewrite_of_a_stateful_model_passes_and_leaves_its_state(inplace):
    x = torch.randn(4)
    gm = _exported(Counter(), x)
    muls = sum(n.target == torch.ops.aten.mul.Tensor for n in gm.graph.nodes)
    result = rewrite.parse(RIGHT).apply(gm, (x,), inplace=inplace)
    assert result.counts == {"times_one": 1}
    assert sum(n.target == torch.ops.aten.mul.Tensor for n in result.graph_module.graph.nodes) == muls - 1
    assert float(gm.n) == 0.0 and float(result.graph_module.n) == 0.0
    reference = Counter()
    for _ in range(3):  # the same sequence of outputs as the eager model
        assert torch.equal(result.graph_module(x), reference(x))


def test_a_model_that_refuses_a_second_call_is_still_checked_by_its_trials():
    x = torch.randn(4)
    gm = _exported(FullCache(), x)
    result = rewrite.parse(RIGHT).apply(gm, (x,))
    assert result.counts == {"times_one": 1}
    assert float(gm.used) == 0.0
    with pytest.raises(rewrite.EquivalenceError):  # a wrong rule is still caught by the first calls
        rewrite.parse("rule wrong(shared=True): add(b, 2.0) => b\n").apply(gm, (x,))


def test_check_equivalence_compares_the_second_call_of_two_modules():
    class Drifting(Counter):  # the same first call, a different second
        def forward(self, x):
            out = x + self.n * 3.0
            self.n.add_(2.0)
            return out

    x = torch.randn(3)
    ok = check_equivalence(Counter(), Counter(), (x,))
    assert ok.ok
    # the state written differs already on the first call: a trial sees it
    assert not check_equivalence(Counter(), Drifting(), (x,)).ok

    class Lagging(Counter):  # writes the same state, reads it differently only once it moved
        def forward(self, x):
            out = x + self.n * 4.0
            self.n.add_(1.0)
            return out

    report = check_equivalence(Counter(), Lagging(), (x,))
    assert not report.ok
    assert "second call in a row" in str(report)


def test_train_mode_batch_norm_still_passes_a_right_fold():
    """Running statistics move on every call in training mode: the second call must
    not turn a right rewrite into a false alarm."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                torch.nn.ReLU()).train()
    x = torch.randn(2, 3, 8, 8)
    for gm in (torch.fx.symbolic_trace(model), torch.export.export(model, (x,)).module()):
        before = {k: v.clone() for k, v in gm.state_dict().items()}
        result = rewrite.parse("rule relu_twice(shared=True): relu(relu(x)) => relu(x)\n").apply(gm, (x,))
        assert result.counts == {"relu_twice": 1}
        assert result.equivalence is not None and result.equivalence.ok
        after = gm.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
