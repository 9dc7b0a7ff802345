"""Session 40's probes and the open items of session 39's (AJ: regressions in the
autocast-block fixes): each test is the behaviour a repro showed failing."""

import threading
import time
import warnings

import pytest
import torch
import torch.nn as nn

import rewrite
from rewrite.capture import AUTOCAST_OFF_LOST


class _OtherDeviceBlock(nn.Module):
    """Written for a GPU: its autocast block says nothing of how the CPU computes."""

    def __init__(self, enabled: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.enabled = enabled

    def forward(self, x):
        h = self.a(x)
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.enabled):
            return self.b(h)


def _amp() -> rewrite.RuleSet:
    return rewrite.load(rewrite.rules_dir() / "amp_bf16.rw")


# AJ F2: an autocast block torch switched off for lack of CUDA counted as one the model
# disables (symbolic_trace), and any other device's block as one of the graph's (dynamo).
def test_a_block_torch_switches_off_for_a_missing_device_is_not_one_the_model_disables():
    model, x = _OtherDeviceBlock(enabled=True).eval(), torch.randn(4, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: CUDA is not available, autocast disabled
        result = _amp().apply(model, (x,))
    assert result.counts.get("linear_bf16") == 2
    assert not result.graph_module.meta.get(AUTOCAST_OFF_LOST)


def test_under_dynamo_another_devices_disabled_block_leaves_the_cpu_rules_on():
    model, x = _OtherDeviceBlock(enabled=False).eval(), torch.randn(4, 16)
    results = []
    torch._dynamo.reset()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.compile(model, backend=rewrite.backend(_amp(), on_result=results.append))(x)
    assert sum(r.counts.get("linear_bf16", 0) for r in results) == 2


# AM F1: symbolic_trace graphs run wherever the caller moves them (a model built on the
# meta device, a CPU trace of a CUDA model): a disabled block of any device counts there.
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_symbolic_trace_counts_a_disabled_block_of_any_device(device):
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            h = self.a(x)
            with torch.autocast(device, enabled=False):
                return self.b(h.float())

    with torch.device("meta"):
        model = M()
    model = model.to_empty(device="cpu").eval()
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.normal_(p)
    with pytest.warns(UserWarning, match="enabled=False"):
        result = _amp().apply(model, (torch.randn(4, 16),))
    assert "linear_bf16" not in result.counts


class _Slow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        time.sleep(0.2)  # a long trace, while another thread runs its own blocks
        return self.b(torch.relu(self.a(x)))


# AJ F3: the trace counted another thread's autocast(enabled=False) blocks as the model's.
def test_another_threads_autocast_block_is_not_the_traced_models():
    stop = threading.Event()

    def serving() -> None:
        while not stop.is_set():
            with torch.autocast("cpu", enabled=False):
                time.sleep(0.002)

    thread = threading.Thread(target=serving)
    thread.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no "enabled=False" warning either
            warnings.filterwarnings("ignore", category=rewrite.TrainingModeWarning)
            result = _amp().apply(_Slow().eval(), (torch.randn(4, 16),))
    finally:
        stop.set()
        thread.join()
    assert result.counts.get("linear_bf16") == 2 and not result.graph_module.meta.get(AUTOCAST_OFF_LOST)


class _Norms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.inorm = nn.InstanceNorm1d(4, track_running_stats=True)

    def forward(self, x):
        h = self.bn(self.lin(x) * 1.0)
        return self.inorm(h.unsqueeze(-1).repeat(1, 1, 3)) + 0.0


# AL F1: an eval model's result shared its batch and instance norms' running statistics
# with the caller; after result.train(), running the result wrote the caller's buffers.
@pytest.mark.parametrize("traced", [True, False])
def test_running_a_result_put_in_training_mode_leaves_the_callers_statistics(traced):
    model, x = _Norms().eval(), torch.randn(8, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    given = torch.fx.symbolic_trace(model) if traced else model
    result = rewrite.load(rewrite.rules_dir() / "cleanup.rw").apply(given, (x,))
    assert result.counts == {"mul_one": 1, "add_zero": 1}
    result.graph_module.train()
    result.graph_module(x)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not torch.equal(result.graph_module.bn.running_mean, before["bn.running_mean"])  # it trains its own
    assert result.graph_module.lin.weight is model.lin.weight  # the weights stay shared


def test_a_folded_batch_norms_statistics_are_not_copied():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    result = rewrite.load(rewrite.rules_dir() / "fusion.rw").apply(model, (torch.randn(1, 3, 8, 8),))
    assert not [m for m in result.graph_module.modules() if isinstance(m, nn.BatchNorm2d)]


_VIEWS = torch.library.Library("rws40", "DEF")
_VIEWS.define("myview(Tensor(a) x) -> Tensor(a)")
_VIEWS.impl("myview", lambda x: x.view(-1), "CompositeExplicitAutograd")
_VIEWS.impl("myview", lambda x: x.view(-1), "Meta")


class _WritesThroughCustomView(nn.Module):
    def forward(self, x):
        h = x + 1
        v = torch.ops.rws40.myview(h)
        v.add_(1)  # writes h through the view
        return h


# AK F3: a custom op whose schema says it returns a view (Tensor(a) -> Tensor(a)) was
# taken for fresh memory: replacing it by a copy lost the write through it (check=False).
@pytest.mark.parametrize("level", ["fx", "export"])
def test_a_custom_ops_declared_view_is_not_replaced_by_a_copy(level):
    model, x = _WritesThroughCustomView(), torch.randn(2, 3)
    gm = torch.fx.symbolic_trace(model) if level == "fx" else torch.export.export(model, (x,)).module()
    result = rewrite.parse("rule r: rws40.myview(x) => flatten(clone(x))\n").apply(gm, (x,), check=False)
    assert result.counts == {}
    torch.testing.assert_close(result.graph_module(x), model(x))


@torch.library.custom_op("rws40::rsum", mutates_args=())
def _rsum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return x.sum(dim)


@_rsum.register_fake
def _(x, dim=-1):
    return x.sum(dim)


@torch.library.custom_op("rws40::scl", mutates_args=())
def _scl(x: torch.Tensor, s: float = 1.0) -> torch.Tensor:
    return x * s


@_scl.register_fake
def _(x, s=1.0):
    return torch.empty_like(x)


# AK F4: verify drew a custom op's (or an out-of-vocabulary aten op's) defaulted
# attribute at its default only: rules right for the default alone verified "ok".
@pytest.mark.parametrize("text", [
    "rule r: rws40.rsum(x, d) where is_number(d) => sum(x, -1)",
    "rule r: rws40.scl(x, s) where is_number(s) => mul(x, 1.0)",
    "rule r: aten.celu.default(x, a) where is_number(a) => aten.elu.default(x)",
])
def test_verify_draws_the_attributes_a_pattern_binds(text):
    report = rewrite.parse(text + "\n").verify(max_examples=100, seed=0)
    assert not report.ok and "counterexample" in report.table()


@pytest.mark.parametrize("text", [
    "rule r: rws40.rsum(x, d) where is_number(d) => sum(x, d)",
    "rule r: rws40.scl(x, s) where is_number(s) => mul(x, s)",
    "rule r: aten.hardtanh.default(x, lo, hi) where is_float(x) and is_number(lo) and is_number(hi)"
    " => clamp(x, lo, hi)",
])
def test_rules_right_for_every_attribute_value_still_verify(text):
    assert rewrite.parse(text + "\n").verify(max_examples=100, seed=0).ok


@torch.library.custom_op("rws40::red", mutates_args=())
def _red(x: torch.Tensor, mode: str = "sum") -> torch.Tensor:
    return x.sum(0) if mode == "sum" else x.mean(0)


@_red.register_fake
def _(x, mode="sum"):
    return x.sum(0)


_VIEWS.define("lsum(Tensor x, int[] dims=[0]) -> Tensor")
_VIEWS.impl("lsum", lambda x, dims=(0,): x.sum(list(dims)), "CompositeExplicitAutograd")
_VIEWS.impl("lsum", lambda x, dims=(0,): x.sum(list(dims)), "Meta")


# AM F3: a string or None attribute the generic generator cannot vary verified "ok"
# at its default; a list of dims was never varied either.
def test_an_attribute_verify_cannot_vary_leaves_the_rule_unverified():
    report = rewrite.parse("rule r: rws40.red(x, _) => sum(x, 0)\n").verify(max_examples=50, seed=0)
    assert [v.status for v in report.verdicts] == ["skipped"] and "'mode'" in report.verdicts[0].reason


def test_a_list_of_dims_a_pattern_binds_is_drawn():
    wrong = rewrite.parse("rule r: rws40.lsum(x, _) => sum(x, 0)\n").verify(max_examples=100, seed=0)
    assert [v.status for v in wrong.verdicts] == ["counterexample"]
    assert rewrite.parse("rule r: rws40.lsum(x, d) => sum(x, d)\n").verify(max_examples=100, seed=0).ok


_VIEWS.define("halves(Tensor(a) x) -> (Tensor(a), Tensor(a))")
_VIEWS.impl("halves", lambda x: (x.view(-1), x.view(-1)), "CompositeExplicitAutograd")
_VIEWS.impl("halves", lambda x: (x.view(-1), x.view(-1)), "Meta")


class _WritesThroughCustomViews(nn.Module):
    def forward(self, x):
        h = x + 1
        a, b = torch.ops.rws40.halves(h)
        b.add_(1)  # writes h through the second view
        return h, a


# AM F2: the multi-output form of AK F3: an op returning several views was fresh memory
@pytest.mark.parametrize("level", ["fx", "export"])
def test_a_custom_ops_declared_views_are_not_replaced_by_copies(level):
    model, x = _WritesThroughCustomViews(), torch.randn(2, 3)
    gm = torch.fx.symbolic_trace(model) if level == "fx" else torch.export.export(model, (x,)).module()
    rules = rewrite.parse("rule r: rws40.halves(x) as (_, _) => (flatten(clone(x)), flatten(clone(x)))\n")
    result = rules.apply(gm, (x,), check=False)
    assert result.counts == {}
    torch.testing.assert_close(result.graph_module(x), model(x))


@rewrite.register_module("s40_drawing_adapter", inputs=("x",))
def _drawing_adapter(x=None, w=None):
    import random

    random.random()
    return nn.Linear(w.shape[1], w.shape[0])  # kaiming init draws from torch's generator


# AM F7: a module factory that draws moved the caller's torch generator in apply, and
# torch's and Python's in explain
def test_a_drawing_factory_leaves_every_generator_as_it_was():
    import random

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) * 1.0

    rules = rewrite.parse("rule r: mul(linear(x, w, _), 1.0) where const(w) => s40_drawing_adapter(x, w)\n")
    model, x = M().eval(), torch.randn(2, 4)
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    result = rules.apply(model, (x,), check=False)
    assert result.counts == {"r": 1}
    explained = rules.explain(model, rule="r", example_inputs=(x,))
    assert explained and explained[0].matched
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == python_state


# AN F4: a replacement could build aten.resize (uninitialized memory when it grows)
# and aten.to_mkldnn (a layout nothing downstream takes)
@pytest.mark.parametrize("replacement", ["aten.resize(x, [8])", "aten.to_mkldnn(x)"])
def test_a_replacement_may_not_build_unchecked_memory_or_layouts(replacement):
    with pytest.raises(rewrite.RuleError, match="E106"):
        rewrite.parse(f"rule r: mul(x, 1.0) => {replacement}\n")


# AN F3: an infinite tolerance made the check pass any rewrite keeping shapes and dtypes
@pytest.mark.parametrize("option", [{"atol": float("inf")}, {"rtol": float("nan")}, {"atol": True}])
def test_apply_refuses_a_tolerance_that_passes_everything(option):
    with pytest.raises(ValueError, match="finite non-negative"):
        rewrite.load(rewrite.rules_dir() / "cleanup.rw").apply(_Norms().eval(), (torch.randn(8, 4),), **option)


# AN F2: with the check on (the default) and no inputs to run it on, apply warned and
# returned the rewrite unchecked
def test_apply_refuses_to_return_a_rewrite_its_check_cannot_run():
    wrong = rewrite.parse("rule broken: mul(sigmoid(x), 2) => add(x, x)\n")

    class M(nn.Module):
        def forward(self, x):
            return torch.sigmoid(x) * 2

    gm = torch.fx.symbolic_trace(M())
    with pytest.raises(ValueError, match="example_inputs"):
        wrong.apply(gm)
    assert wrong.apply(gm, check=False).counts == {"broken": 1}  # asked for unchecked
    with pytest.raises(rewrite.EquivalenceError):
        wrong.apply(gm, (torch.randn(4),))


class _Float32Pinned(nn.Module):
    """torch.autocast("cpu", dtype=torch.float32): the usual way to keep a region in
    float32 (torch switches such a block off; dynamo records it as written, enabled)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        y = self.a(x)
        with torch.autocast("cpu", dtype=torch.float32):
            return self.b(y.float())


# AO F3: a block torch switches off for its dtype was no longer counted (symbolic_trace),
# and dynamo's record of it (enabled as written) never was
def test_a_block_autocast_runs_off_for_its_dtype_stays_float32():
    model, x = _Float32Pinned().eval(), torch.randn(4, 16)
    with pytest.warns(UserWarning, match="enabled=False"):
        assert "linear_bf16" not in _amp().apply(model, (x,)).counts
    results = []
    torch._dynamo.reset()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.compile(model, backend=rewrite.backend(_amp(), on_result=results.append))(x)
    assert sum(r.counts.get("linear_bf16", 0) for r in results) == 1  # a only


class _DecoratedForCuda(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    @torch.autocast("cuda")  # built before any trace; torch switches it off here for want of CUDA
    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


# AO F1: a decorator's (pre-built) CUDA block read as one the model disables
def test_a_prebuilt_cuda_block_torch_switches_off_is_not_read_as_disabled():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = _amp().apply(_DecoratedForCuda().eval(), (torch.randn(4, 16),))
    assert result.counts.get("linear_bf16") == 2 and not result.graph_module.meta.get(AUTOCAST_OFF_LOST)


# AO F2: attributes left to a trailing ... escaped the unverifiable-attribute guard
def test_an_attribute_left_to_a_trailing_ellipsis_is_not_pinned_silently():
    report = rewrite.parse("rule r: rws40.red(x, ...) => sum(x, 0)\n").verify(max_examples=50, seed=0)
    assert [v.status for v in report.verdicts] == ["skipped"] and "'mode'" in report.verdicts[0].reason


# AO F4: E106's words refused a dense op that merely has mkldnn in its name
def test_mkldnn_convolution_may_be_built():
    rewrite.parse("rule r: conv(x, w, b, [1, 1], [0, 0], [1, 1], 1) => "
                  "aten.mkldnn_convolution(x, w, b, [0, 0], [1, 1], [1, 1], 1)\n")


_VIEWS.define("pair(Tensor(a) x) -> (Tensor, Tensor(a))")
_VIEWS.impl("pair", lambda x: (x + 1, x.view(-1)), "CompositeExplicitAutograd")
_VIEWS.impl("pair", lambda x: (x + 1, x.view(-1)), "Meta")


class _WritesThroughSecondView(nn.Module):
    def forward(self, x):
        h = x + 1
        a, b = torch.ops.rws40.pair(h)
        b.add_(1)
        return h, a


# AO F5: only the first result's alias annotation was read
@pytest.mark.parametrize("level", ["fx", "export"])
def test_a_custom_ops_second_result_view_is_kept(level):
    model, x = _WritesThroughSecondView(), torch.randn(2, 3)
    gm = torch.fx.symbolic_trace(model) if level == "fx" else torch.export.export(model, (x,)).module()
    rules = rewrite.parse("rule r: rws40.pair(x) as (_, _) => (add(x, 1), flatten(clone(x)))\n")
    result = rules.apply(gm, (x,), check=False)
    assert result.counts == {}
    torch.testing.assert_close(result.graph_module(x), model(x))


# AO F7: torch.hsplit's pieces were fresh memory at the fx level (torch.split's were views)
@pytest.mark.parametrize("split, pattern", [(lambda h: torch.hsplit(h, 2), "torch.hsplit(x, _)"),
                                            (lambda h: h.hsplit(2), "Tensor.hsplit(x, _)")])
def test_the_pieces_of_hsplit_are_views(split, pattern):
    class M(nn.Module):
        def forward(self, x):
            h = x + 1
            a, b = split(h)
            b.add_(1)  # writes h through the second piece
            return h, a

    x = torch.randn(2, 4)
    rules = rewrite.parse(f"rule r: {pattern} as (_, _) => "
                          "(clone(aten.narrow(x, 1, 0, 2)), clone(aten.narrow(x, 1, 2, 2)))\n")
    result = rules.apply(torch.fx.symbolic_trace(M()), (x,), check=False)
    assert result.counts == {}
    torch.testing.assert_close(result.graph_module(x), M()(x))
