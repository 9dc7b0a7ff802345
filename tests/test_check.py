"""Tests for rewrite.trust.check: randomized equivalence and its input generator."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import fx, nn

import rewrite
from rewrite.trust.check import (
    EquivalenceReport,
    Mismatch,
    assert_equivalent,
    check_equivalence,
    generate_inputs,
    inputs_from_graph,
    random_like,
)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Perturbed(nn.Module):
    """Wraps a module and perturbs one output by ``eps``."""

    def __init__(self, inner, eps, key=None):
        super().__init__()
        self.inner, self.eps, self.key = inner, eps, key

    def forward(self, *args):
        out = self.inner(*args)
        if self.key is None:
            return out + self.eps
        out = dict(out) if isinstance(out, dict) else list(out)
        out[self.key] = out[self.key] + self.eps
        return out if isinstance(out, dict) else tuple(out)


class TwoOut(nn.Module):
    def forward(self, x):
        return x * 2, x.sum(dim=-1)


class DictOut(nn.Module):
    def forward(self, x):
        return {"logits": x * 3, "hidden": x + 1}


def test_identical_modules_pass():
    torch.manual_seed(0)
    m = MLP()
    rep = check_equivalence(m, m, (torch.randn(5, 4),))
    assert rep.ok and rep.trials == 3 and rep.first_mismatch is None
    assert rep.max_abs_error == 0.0
    assert "equivalent over 3 trial" in str(rep)
    assert bool(rep)


def test_traced_copy_passes():
    torch.manual_seed(0)
    m = MLP().eval()
    gm = fx.symbolic_trace(m)
    assert_equivalent(m, gm, (torch.randn(5, 4),), trials=5)


def test_small_perturbation_fails_with_path():
    torch.manual_seed(0)
    m = MLP()
    rep = check_equivalence(m, Perturbed(m, 0.05), (torch.randn(5, 4),))
    assert not rep.ok
    mm = rep.first_mismatch
    assert isinstance(mm, Mismatch)
    assert mm.path == "output" and mm.trial == 0
    assert mm.shape == (5, 3) and mm.dtype == "float32"
    assert mm.max_abs_error == pytest.approx(0.05, rel=1e-3)
    assert "NOT equivalent" in str(rep) and "output" in str(rep)


def test_tiny_rounding_difference_passes():
    torch.manual_seed(0)
    m = MLP()
    assert check_equivalence(m, Perturbed(m, 1e-6), (torch.randn(5, 4),)).ok


def test_tuple_output_path():
    m = TwoOut()
    rep = check_equivalence(m, Perturbed(m, 1.0, key=1), (torch.randn(2, 3),))
    assert not rep.ok and rep.first_mismatch.path == "output[1]"
    assert rep.first_mismatch.shape == (2,)


def test_dict_output_path():
    m = DictOut()
    rep = check_equivalence(m, Perturbed(m, 0.5, key="hidden"), (torch.randn(2, 3),))
    assert not rep.ok and rep.first_mismatch.path == "output['hidden']"


def test_shape_mismatch_fails():
    class Flat(nn.Module):
        def forward(self, x):
            return (x * 2).flatten()

    rep = check_equivalence(lambda x: x * 2, Flat(), (torch.randn(2, 3),))
    assert not rep.ok and "shape" in rep.first_mismatch.message


def test_dtype_mismatch_fails():
    rep = check_equivalence(lambda x: x * 2, lambda x: (x * 2).double(), (torch.randn(2, 3),))
    assert not rep.ok and "dtype" in rep.first_mismatch.message


def test_structure_mismatch_fails():
    rep = check_equivalence(TwoOut(), lambda x: (x * 2,), (torch.randn(2, 3),))
    assert not rep.ok and "structure" in rep.first_mismatch.message


def test_integer_outputs_exact():
    rep = check_equivalence(lambda x: x.argmax(-1), lambda x: x.argmax(-1) + 1, (torch.randn(4, 5),))
    assert not rep.ok and "exact" in rep.first_mismatch.message


def test_candidate_exception_is_a_mismatch():
    def broken(x):
        raise RuntimeError("boom")

    rep = check_equivalence(lambda x: x, broken, (torch.randn(2),))
    assert not rep.ok and "boom" in rep.first_mismatch.message


def test_assert_equivalent_raises_with_report():
    with pytest.raises(AssertionError, match="NOT equivalent"):
        assert_equivalent(lambda x: x, lambda x: x + 1, (torch.randn(3),))


def test_tolerance_scales_with_magnitude():
    big = torch.randn(10, generator=torch.Generator().manual_seed(0)) * 1e4
    # 1e-3 relative to the largest magnitude: fine for float32 ...
    assert check_equivalence(lambda x: x, lambda x: x + 5.0, (big,), trials=1).ok
    # ... but not for float64
    assert not check_equivalence(lambda x: x, lambda x: x + 5.0, (big.double(),), trials=1).ok


def test_bfloat16_looser():
    x = torch.randn(16, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert check_equivalence(lambda x: x, lambda x: x * 1.005, (x,), trials=1).ok
    assert not check_equivalence(lambda x: x.float(), lambda x: x.float() * 1.005, (x,), trials=1).ok


def test_nan_matches_nan():
    x = torch.tensor([1.0, float("nan"), float("inf")])
    assert check_equivalence(lambda x: x * 1, lambda x: x.clone(), (x,), trials=1).ok


def test_explicit_tolerances_override():
    x = torch.randn(8)
    assert check_equivalence(lambda x: x, lambda x: x + 0.1, (x,), atol=0.2, trials=2).ok


def test_inputs_not_mutated_and_mode_kept():
    x = torch.randn(3, 4)
    keep = x.clone()

    def inplace(t):
        return t.add_(1)

    m = MLP().train()
    check_equivalence(inplace, inplace, (x,))
    check_equivalence(m, m, (x,))
    assert torch.equal(x, keep)
    assert m.training


def test_dropout_in_train_mode_is_reproducible():
    m = nn.Dropout(0.5).train()
    assert check_equivalence(m, nn.Dropout(0.5).train(), (torch.randn(64),)).ok


def test_the_check_leaves_the_callers_random_state_and_draws_the_same_per_trial():
    """Each run starts from its trial's seed, whatever the caller drew before; the
    caller's generator is as it was after the check."""
    m = nn.Dropout(0.5).train()
    x = torch.randn(256)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    reports = [check_equivalence(m, nn.Dropout(0.5).train(), (x,), trials=2)]
    assert torch.equal(torch.random.get_rng_state(), before)
    torch.rand(1000)  # the caller draws in between: the check's draws do not move
    reports.append(check_equivalence(m, nn.Dropout(0.5).train(), (x,), trials=2))
    assert all(r.ok and r.max_abs_error == 0 for r in reports)
    # a candidate drawing once more before its dropout draws different numbers: caught
    torch.rand(1)
    assert not check_equivalence(m, _DrawsFirst(), (x,), trials=1).ok


class _DrawsFirst(nn.Module):
    def forward(self, x):
        torch.rand(1)
        return nn.functional.dropout(x, 0.5, training=True)


def test_embedding_indices_stay_in_range():
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4)
    seen = []

    def spy(ids):
        seen.append(ids.clone())
        return emb(ids)

    ids = torch.tensor([[0, 3, 9], [2, 2, 5]])
    rep = check_equivalence(spy, emb, (ids,), trials=20)
    assert rep.ok and len(seen) == 20
    for t in seen:
        assert t.dtype == torch.int64 and t.shape == ids.shape
        assert int(t.min()) >= 0 and int(t.max()) <= 9
    assert any(not torch.equal(t, ids) for t in seen[1:])


def test_nested_inputs_and_non_tensors():
    def f(pair, cfg):
        a, b = pair
        return a * cfg["scale"] + b["bias"]

    ex = ((torch.randn(3), {"bias": torch.randn(3)}), {"scale": 2.0})
    gen = generate_inputs(ex, seed=1)
    assert gen[1]["scale"] == 2.0
    assert gen[0][0].shape == (3,) and not torch.equal(gen[0][0], ex[0][0])
    assert check_equivalence(f, f, ex).ok


def test_fixed_inputs_pass_through_and_parameters_are_drawn():
    p = nn.Parameter(torch.randn(3))
    buf = torch.randn(3)
    x = torch.randn(3)
    gen = generate_inputs((p, buf, x), seed=3, fixed_inputs=[1])
    assert isinstance(gen[0], nn.Parameter) and not torch.equal(gen[0], p)
    assert gen[1] is buf and not torch.equal(gen[2], x)
    gen = generate_inputs((p, buf, x), seed=3, fixed_inputs=["[2]"])
    assert gen[2] is x


def test_input_ranges():
    gen = generate_inputs((torch.zeros(1000), torch.zeros(50, dtype=torch.int32)), seed=0,
                          input_ranges={0: (2.0, 3.0), "[1]": (5, 7)})
    assert 2.0 <= float(gen[0].min()) and float(gen[0].max()) <= 3.0
    assert set(gen[1].tolist()) <= {5, 6, 7} and gen[1].dtype == torch.int32


def test_nonnegative_examples_stay_nonnegative():
    var = torch.rand(100) + 0.1
    out = random_like(var, torch.Generator().manual_seed(0))
    assert float(out.min()) >= 0


def test_inputs_from_export_metadata():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(7, 4)
            self.fc = nn.Linear(4, 2)

        def forward(self, ids, x):
            return self.fc(self.emb(ids)) + x

    m = Net().eval()
    ex = (torch.tensor([[1, 2, 3]]), torch.randn(1, 3, 2))
    gm = torch.export.export(m, ex, strict=False).module()
    args = inputs_from_graph(gm, seed=0)
    assert args[0].shape == (1, 3) and args[0].dtype == torch.int64
    assert 0 <= int(args[0].min()) and int(args[0].max()) <= 6
    assert args[1].shape == (1, 3, 2) and args[1].dtype == torch.float32
    for seed in range(20):
        assert int(inputs_from_graph(gm, seed=seed)[0].max()) <= 6
    rep = check_equivalence(gm, gm, None)
    assert rep.ok and rep.trials == 3


def test_inputs_from_tensor_meta():
    from torch.fx.passes.shape_prop import ShapeProp

    gm = fx.symbolic_trace(MLP())
    ShapeProp(gm).propagate(torch.randn(6, 4))
    (x,) = inputs_from_graph(gm, seed=0)
    assert x.shape == (6, 4) and x.dtype == torch.float32


def test_inputs_from_graph_without_metadata_errors():
    gm = fx.symbolic_trace(MLP())
    with pytest.raises(ValueError, match="metadata"):
        inputs_from_graph(gm)


def test_report_is_frozen():
    rep = EquivalenceReport(True, 1, 0.0, 0.0)
    with pytest.raises(Exception):
        rep.ok = False  # type: ignore[misc]


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
           torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool]


@st.composite
def example_tensors(draw):
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=4)))
    dtype = draw(st.sampled_from(_DTYPES))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=g).bool()
    elif dtype.is_floating_point:
        scale = draw(st.floats(0.01, 100.0))
        shift = draw(st.floats(-50.0, 50.0))
        t = (torch.randn(shape, generator=g, dtype=torch.float64) * scale + shift).to(dtype)
        if draw(st.booleans()):
            t = t.abs()
    else:
        info = torch.iinfo(dtype)
        lo = draw(st.integers(max(info.min, -1000), min(info.max, 1000)))
        hi = draw(st.integers(lo, min(info.max, lo + 1000)))
        t = torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int64).to(dtype)
    return t


@settings(max_examples=150, deadline=None)
@given(ex=example_tensors(), seed=st.integers(0, 2**31 - 1))
def test_generator_properties(ex, seed):
    out = random_like(ex, torch.Generator().manual_seed(seed))
    assert out.shape == ex.shape and out.dtype == ex.dtype and out.device == ex.device
    if ex.numel() == 0:
        return
    if ex.dtype == torch.bool:
        return
    if ex.dtype.is_floating_point:
        if bool((ex >= 0).all()):
            assert bool((out >= 0).all())
        assert not bool(torch.isnan(out).any())
    else:  # within the example's range; an all-ones example (a mask) draws zeros too
        lo = 0 if bool((ex == 1).all()) else int(ex.min())
        assert int(out.min()) >= lo and int(out.max()) <= int(ex.max())


@settings(max_examples=50, deadline=None)
@given(exs=st.lists(example_tensors(), min_size=1, max_size=4), seed=st.integers(0, 1000))
def test_generate_inputs_preserves_structure_and_is_deterministic(exs, seed):
    tree = {"a": tuple(exs[:2]), "b": list(exs[2:]), "n": 3}
    g1, g2 = generate_inputs(tree, seed), generate_inputs(tree, seed)
    assert g1["n"] == 3 and len(g1["a"]) == len(tree["a"]) and len(g1["b"]) == len(tree["b"])
    for x, y, e in zip(list(g1["a"]) + g1["b"], list(g2["a"]) + g2["b"], exs):
        assert torch.equal(x, y) and x.shape == e.shape and x.dtype == e.dtype


@settings(max_examples=50, deadline=None)
@given(ex=example_tensors())
def test_self_equivalence_over_random_inputs(ex):
    assert check_equivalence(lambda t: t.clone(), lambda t: t.clone(), (ex,)).ok


# ---------------------------------------------------------------- what the check does not see
# README, "What it cannot promise": these pin the limits it states.


class _ConvDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(torch.relu(self.conv(x)))


def test_dropout_after_the_low_precision_region_draws_the_same_masks_in_train_mode():
    """A train-mode dropout after the bfloat16 region fills a tensor laid out as the
    model's, so its masks land where eager's do and the check passes: in train mode
    the weight is cast at run time (the caller's parameter keeps its gradient) and the
    conv's output stays contiguous; in eval mode its channels_last constant makes the
    output channels_last and ``exit_contiguous_lowp`` gives it the model's layout back."""
    import rewrite

    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    amp = rewrite.load("rules/amp_bf16.rw")
    model = _ConvDropout()
    train = amp.apply(fx.symbolic_trace(model.train()), (x,))
    assert "conv_bf16_bias" in train.counts and train.equivalence.ok
    evaluated = amp.apply(fx.symbolic_trace(model.eval()), (x,))
    assert "conv_bf16" in evaluated.counts and evaluated.equivalence.ok
    assert any(n.target in ("contiguous", torch.Tensor.contiguous) for n in evaluated.graph_module.graph.nodes)


def test_a_model_taking_keyword_only_inputs_gets_a_clear_error_when_checked():
    class KeywordOnly(torch.nn.Module):
        def forward(self, *, x):
            return torch.relu(-(-x))

    x = torch.randn(2, 3)
    rules = rewrite.load("rules/cleanup.rw")
    ep = torch.export.export(KeywordOnly(), (), {"x": x}, strict=False)
    for model, args in ((KeywordOnly(), (x,)), (ep, None), (ep.module(), ())):
        with pytest.raises(ValueError, match="takes 'x' by keyword only: pass check=False"):
            rules.apply(model, args)
    assert rules.apply(ep, check=False).counts == {"neg_neg": 1}
