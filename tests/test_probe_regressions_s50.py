"""Regressions from the session-50 probes: Python arithmetic on literals in a
replacement (probe CN F1, F4, F5), verification of rules that move the random stream
(CN F2), the autocast allowance of an in-place rewrite whose new nodes carry no
dtypes (probe CO F1: rewrite.backend), and apply's side effects on generators and
under an ambient default device (probe CQ)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import fx, nn

import rewrite
from rewrite.trust.check import named_half_precisions

class _TimesFour(nn.Module):
    def forward(self, x):
        return x * 4


@pytest.mark.parametrize("level", ["fx", "export"])
def test_a_power_of_a_negative_literal_computes_what_the_check_saw(level):
    """``operator.pow(-2, 2)`` in a replacement: fx prints it ``-2 ** 2``, which is
    -(2 ** 2), so the returned module computed ``x * -4`` while the check and verify,
    which run the graph node by node, saw ``x * 4``."""
    x = torch.randn(3)
    gm = fx.symbolic_trace(_TimesFour()) if level == "fx" else torch.export.export(_TimesFour(), (x,)).module()
    rules = rewrite.parse("rule r: mul(x, 4) => mul(x, operator.pow(-2, 2))")
    result = rules.apply(gm, (x,))
    assert result.counts == {"r": 1}
    assert torch.equal(result.graph_module(x), x * 4)
    assert "-2 **" not in result.graph_module.code


@pytest.mark.parametrize("text", [
    "rule r: relu(x) => Tensor.new_ones(x, operator.mul([100000], 2))",
    "rule r: relu(x) => Tensor.new_ones(x, [operator.mul(100000, 100000)])",
    "rule r: relu(x) => torch.linspace(0, 1, operator.pow(10, 10))",
    "rule r: relu(x) => F.pad(x, [operator.mul(10000, 10000), 0])",
])
def test_sizes_computed_from_literals_are_bounded_as_literals_are(text):
    """E207 bounded sizes written out (``[100000, 100000]``) but not the same size
    computed by ``operator`` arithmetic on literals, which the rewritten model would
    allocate on every call."""
    with pytest.raises(rewrite.RuleError, match="E207"):
        rewrite.parse(text)


@pytest.mark.parametrize("text, error", [
    ("rule r: neg(x) => add(x, operator.truediv(1, 0))", "ZeroDivisionError"),
    ("rule r: neg(x) => add(x, operator.getitem([1, 2], 5))", "IndexError"),
])
def test_arithmetic_on_literals_that_raises_is_refused_where_it_is_written(text, error):
    """The rewritten model (``check=False``) raised on every call."""
    with pytest.raises(rewrite.RuleError, match="E210") as info:
        rewrite.parse(text)
    assert error in str(info.value) and "<string>:1:" in str(info.value)


def test_arithmetic_on_literals_that_holds_still_loads():
    rules = rewrite.parse("rule r: mul(x, 4) => mul(x, operator.mul(2, operator.add(1, 1)))")
    x = torch.randn(3)
    result = rules.apply(fx.symbolic_trace(_TimesFour()), (x,))
    assert result.counts == {"r": 1} and torch.equal(result.graph_module(x), x * 4)


def test_verify_finds_rules_that_add_or_drop_a_random_draw():
    """apply's check refuses them (the caller's next torch.rand would differ);
    verification said ok, comparing outputs only."""
    rules = rewrite.parse(
        "rule adds_draw: relu(x) where dtype(x) == torch.float32 => "
        "add(clamp(x, 0.0), mul(torch.rand_like(x), 0))\n"
        "rule drops_draw: mul(torch.rand_like(x), 0) => torch.zeros_like(x)\n")
    verdicts = rules.verify(max_examples=10, seed=0)
    for name in ("adds_draw", "drops_draw"):
        assert verdicts[name].status == "counterexample", (name, verdicts[name])
        assert "random stream" in str(verdicts[name])


def test_the_half_precisions_a_graph_names():
    """What an in-place check prepares autocast runs for when the rewritten graph's
    metadata does not tell its dtypes (new nodes of a dynamo graph of static sizes)."""
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_method("to", (x, torch.bfloat16))
    g.output(g.call_function(torch.relu, (y,)))
    assert named_half_precisions(fx.GraphModule(nn.Module(), g)) == {torch.bfloat16}
    assert named_half_precisions(fx.symbolic_trace(_TimesFour())) == frozenset()


def test_amp_bf16_through_the_backend_passes_its_check_where_autocast_is_as_far():
    """A tiny DeiT through ``torch.compile(backend=rewrite.backend(amp_bf16))``: the
    rewritten dynamo graph's new nodes carry no dtypes, so the in-place check prepared
    no autocast run and held the outputs to bfloat16's plain tolerance; autocast
    itself is 3.4% off on one output, and the check refused the rewrite."""
    transformers = pytest.importorskip("transformers")

    class Tuple(nn.Module):
        def __init__(self, m: nn.Module) -> None:
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(x).to_tuple()

    torch.manual_seed(0)
    config = transformers.DeiTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, image_size=16, patch_size=4, attn_implementation="eager")
    model = Tuple(transformers.DeiTForImageClassificationWithTeacher(config).eval()).eval()
    x = torch.randn(1, 3, 16, 16)
    results = []
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(model, backend=rewrite.backend(rewrite.load("rules/amp_bf16.rw"),
                                                                on_result=results.append))
        with torch.no_grad():
            got, want = compiled(x), model(x)
    torch._dynamo.reset()
    assert results and results[0].counts.get("linear_bf16") and results[0].equivalence.ok
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=0.1, atol=0.05)


# -- probe CQ: apply's side effects on generators, and the ambient default device


class _DrawsFromItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, g):
        return torch.relu(torch.relu(self.lin(x))) + torch.rand(x.shape, generator=g)


@pytest.mark.parametrize("check", [True, False])
def test_a_generator_given_as_an_input_is_not_moved_by_apply(check):
    """Recording the facts of a traced module drew from the caller's generator (the
    check's copies of the inputs copied it; the recording's did not)."""
    g = torch.Generator().manual_seed(5)
    result = rewrite.load("rules/cleanup.rw").apply(_DrawsFromItsInput(), (torch.randn(2, 4), g), check=check)
    assert result.counts == {"relu_relu": 1}
    assert torch.equal(torch.rand(3, generator=g), torch.rand(3, generator=torch.Generator().manual_seed(5)))


_NUMPY_DRAWS = None


@torch.fx.wrap
def _numpy_noise(x):
    return x + torch.from_numpy(_NUMPY_DRAWS.standard_normal(tuple(x.shape)).astype("float32"))


class _WrappedNoise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return _numpy_noise(self.lin(x) * 2.0)


def test_a_module_whose_wrapped_helper_draws_from_numpy_is_not_a_capture_error():
    """apply(nn.Module) compares its own trace with the module: the module's runs did
    not restart the numpy generator the helper draws from (only the trace shows it),
    so the trace looked wrong (CaptureError) though it is the model."""
    global _NUMPY_DRAWS
    np = pytest.importorskip("numpy")
    _NUMPY_DRAWS = np.random.default_rng(0)
    state = _NUMPY_DRAWS.bit_generator.state
    torch.manual_seed(0)
    result = rewrite.parse("rule twice: mul(x, 2) where is_float(x) => add(x, x)").apply(
        _WrappedNoise().eval(), (torch.randn(2, 4),))
    assert result.counts == {"twice": 1} and result.equivalence.ok
    assert _NUMPY_DRAWS.bit_generator.state == state  # and apply left it where it was


def test_apply_under_a_meta_default_device_checks_a_cpu_model():
    """The check drew its inputs on the ambient default device: a raw torch error
    (``Cannot copy out of meta tensor``) for a model and inputs on the CPU."""
    model, x = _TimesFour(), torch.randn(3)
    with torch.device("meta"):
        result = rewrite.parse("rule r: mul(x, 4) => add(add(x, x), add(x, x))").apply(fx.symbolic_trace(model), (x,))
    assert result.counts == {"r": 1} and result.equivalence.ok
    assert torch.equal(result.graph_module(x), x * 4)


def test_nested_powers_of_literals_are_refused_without_being_computed():
    """Computing literal arithmetic at load time raised the nested powers E207 refuses
    to numbers of millions of digits first (five levels: a hang)."""
    text = "rule r: relu(x) => add(x, " + "operator.pow(" * 5 + "10" + ", 64)" * 5 + ")"
    with pytest.raises(rewrite.RuleError, match="E207"):
        rewrite.parse(text)
