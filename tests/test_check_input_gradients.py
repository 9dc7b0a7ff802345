"""The check's gradient trial runs the floating inputs as a trained model's
activations: requiring grad. A parameter-free block (an activation) whose rewrite
keeps every value and cuts the gradient path from its input passed when the example
input required no grad: inside a trained model, ``backward`` then fails (probe N
F01c). The inputs keep their memory and can still be written in place."""

import pytest
import torch

import rewrite

CUT = """
rule abs_cut: abs(x) where dtype(x) == torch.float32
    => Tensor.view(Tensor.view(add(relu(x), relu(neg(x))), torch.int32), torch.float32)
"""


class Act(torch.nn.Module):
    def forward(self, x):
        return torch.abs(x) * 2.0


def _captures(model, x):
    yield "fx", torch.fx.symbolic_trace(model)
    yield "export", torch.export.export(model, (x,)).module()


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_cut_gradient_path_from_an_input_is_refused(capture):
    x = torch.randn(4)
    gm = dict(_captures(Act(), x))[capture]
    with pytest.raises(rewrite.EquivalenceError, match=r"through input 0"):
        rewrite.parse(CUT).apply(gm, (x,))
    # the caller's input is left as it was: no grad, no history, not written
    assert not x.requires_grad and x.grad_fn is None and x._version == 0


def test_the_cut_is_refused_in_place_too_and_the_module_restored():
    x = torch.randn(4)
    gm = torch.fx.symbolic_trace(Act())
    code = gm.code
    with pytest.raises(rewrite.EquivalenceError):
        rewrite.parse(CUT).apply(gm, (x,), inplace=True)
    assert gm.code == code


def test_a_right_rewrite_keeps_the_gradient_path_and_passes():
    x = torch.randn(3, 4)
    gm = torch.fx.symbolic_trace(Act())
    ok = rewrite.parse("rule twice(shared=True): mul(x, 2.0) => add(x, x)\n").apply(gm, (x,))
    assert ok.counts == {"twice": 1}
    h = torch.randn(3, 4, requires_grad=True)
    out = ok.graph_module(h)
    assert out.requires_grad
    (g,) = torch.autograd.grad(out.sum(), h)
    assert torch.allclose(g, 2 * torch.sign(h))


class WritesInput(torch.nn.Module):
    def forward(self, x):
        y = x * 1.0
        x.add_(1.0)
        return y + x


def test_a_model_that_writes_its_input_is_still_checked_with_gradients():
    x = torch.randn(5)
    keep = x.clone()
    gm = torch.fx.symbolic_trace(WritesInput())
    result = rewrite.parse("rule times_one(shared=True): mul(x, 1.0) => aten.clone(x)\n").apply(gm, (x,))
    assert result.counts == {"times_one": 1}
    assert result.equivalence is not None and result.equivalence.ok
    assert torch.equal(x, keep)  # the check wrote only its own copies
    z = x.clone()
    assert torch.equal(result.graph_module(z.clone()), WritesInput()(z.clone()))


class ReturnsInput(torch.nn.Module):
    def forward(self, x):
        return x, torch.relu(torch.relu(x))


def test_an_output_that_is_its_input_stays_its_input():
    """The gradient trial gives the input copies autograd history; an output that is
    the input itself must still count as that input (not as memory it shares)."""
    x = torch.randn(6)
    gm = torch.fx.symbolic_trace(ReturnsInput())
    result = rewrite.parse("rule relu_twice(shared=True): relu(relu(x)) => relu(x)\n").apply(gm, (x,))
    assert result.counts == {"relu_twice": 1}
    out = result.graph_module(x)
    assert out[0] is x and torch.equal(out[1], torch.relu(x))


def test_integer_inputs_are_left_as_they_are():
    emb = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.ReLU(), torch.nn.ReLU())
    ids = torch.randint(0, 10, (2, 3))
    gm = torch.fx.symbolic_trace(emb)
    result = rewrite.parse("rule relu_twice(shared=True): relu(relu(x)) => relu(x)\n").apply(gm, (ids,))
    assert result.counts == {"relu_twice": 1}
    assert torch.equal(result.graph_module(ids), emb(ids))


def test_check_equivalence_names_the_input_whose_path_is_cut():
    from rewrite.trust.check import check_equivalence

    class Cut(torch.nn.Module):
        def forward(self, a, b):
            return a.view(torch.int32).view(torch.float32) * b

    class Kept(torch.nn.Module):
        def forward(self, a, b):
            return a * b

    report = check_equivalence(Kept(), Cut(), (torch.randn(3), torch.randn(3)))
    assert not report.ok
    assert "input 0" in str(report)
    assert check_equivalence(Kept(), Kept(), (torch.randn(3), torch.randn(3))).ok


def test_verify_finds_a_rule_that_cuts_the_gradient_path():
    report = rewrite.parse(CUT).verify(max_examples=10, seed=0)
    (verdict,) = report.verdicts
    assert verdict.status == "counterexample"
    assert "requires grad in the original only" in str(verdict.counterexample)
    kept = rewrite.parse("rule abs_kept: abs(x) where dtype(x) == torch.float32 => add(relu(x), relu(neg(x)))\n")
    assert kept.verify(max_examples=10, seed=0).ok
