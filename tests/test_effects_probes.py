"""Writes and aliasing the engine must see, from an adversarial probe of session 18.

Each case feeds a fresh copy of a caller's tensor (``x * 1``) to something that
writes it or shares its memory, or writes a matched value between a match's first
node and its root. With ``check=False`` only the engine's own analysis stands
between a rule and the caller: the rewritten model must compute what the original
computes, never write the caller's tensors, and never return new aliases.

* a call whose code nothing describes writes what it is given: export's
  ``wrap_with_set_grad_enabled`` / ``wrap_with_autocast`` regions, an ``fx.wrap``
  function, a module of the model's own, a torch module with a hook;
* ``inplace`` given positionally or as a truthy value, a written argument passed by
  keyword under the Python function's own name (``nn.init.normal_(tensor=)``,
  ``_foreach_add_(self=)``), an in-place module called with ``input=``;
* views given their tensor by keyword (``torch.reshape(input=y, ...)``),
  ``z.set_(y)`` and ``x.new(y)`` (they share their second argument's memory),
  ``F.embedding_bag(max_norm=)`` (renormalizes its weight);
* a write between a match's first node and its root (``c = conv(h); h.add_(1);
  bn(c)``: the folded conv would read the written ``h``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import rewrite

RULES = Path(__file__).resolve().parents[1] / "rules"
CLEANUP = rewrite.load(RULES / "cleanup.rw")
FUSION = rewrite.load(RULES / "fusion.rw")


@fx.wrap
def _bump(t):
    t.add_(1)
    return t.sum()


class _Bump(nn.Module):
    def forward(self, t):
        t.add_(1)
        return t.sum()


class _LeafTracer(fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return isinstance(m, _Bump) or super().is_leaf_module(m, qualname)


class _Fn(nn.Module):
    def __init__(self, fn, **modules):
        super().__init__()
        self.fn = fn
        for name, module in modules.items():
            self.add_module(name, module)

    def forward(self, x):
        return self.fn(self, x)


def _no_grad_write(m, x):
    y = x * 1
    with torch.no_grad():
        y.add_(1)
    return y * 2


def _autocast_write(m, x):
    y = x * 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y.mul_(2)
    return y * 3


def _hooked(m, x):
    y = x * 1
    return m.lin(y) + y


def _hook_model():
    model = _Fn(_hooked, lin=nn.Linear(3, 3))
    model.lin.register_forward_pre_hook(lambda mod, args: (args[0].clamp_(min=0), None)[1])
    return model


# name -> (model factory, capture level); each writes x * 1 through a call
WRITERS = {
    "export no_grad region": (lambda: _Fn(_no_grad_write), "export"),
    "export autocast region": (lambda: _Fn(_autocast_write), "export"),
    "torch module with a hook": (_hook_model, "fx"),
    "relu inplace=1": (lambda: _Fn(lambda m, x: _written(x, lambda y: F.relu(y, inplace=1))), "fx"),
    "relu positional inplace": (lambda: _Fn(lambda m, x: _written(x, lambda y: F.relu(y, True))), "fx"),
    "ReLU(inplace) given input=": (lambda: _Fn(lambda m, x: _written(x, lambda y: m.relu(input=y)),
                                               relu=nn.ReLU(inplace=True)), "fx"),
    "init.normal_(tensor=)": (lambda: _Fn(lambda m, x: _written(x, lambda y: nn.init.normal_(y))), "fx"),
    "_foreach_add_(self=)": (lambda: _Fn(lambda m, x: _written(
        x, lambda y: torch._foreach_add_(self=[y], scalar=1.0))), "fx"),
    "write through reshape(input=)": (lambda: _Fn(lambda m, x: _written(
        x, lambda y: torch.reshape(input=y, shape=(-1,)).add_(1))), "fx"),
    "write through transpose(input=)": (lambda: _Fn(lambda m, x: _written(
        x, lambda y: torch.transpose(input=y, dim0=0, dim1=1).add_(1))), "fx"),
    "write through set_": (lambda: _Fn(lambda m, x: _set_then_write(x)), "fx"),
    "write through new": (lambda: _Fn(lambda m, x: _new_then_write(x)), "fx"),
    "embedding_bag max_norm": (lambda: _Fn(lambda m, x: F.embedding_bag(
        torch.tensor([0, 1, 2, 3]), x * 1, torch.tensor([0, 2]), max_norm=1.0)), "fx"),
}


def _written(x, write):
    y = x * 1
    write(y)
    return y + 1


def _set_then_write(x):
    y = x * 1
    z = torch.zeros_like(x)
    z.set_(y)
    z.add_(1)
    return z * 2


def _new_then_write(x):
    y = x * 1
    z = (x + 0.5).new(y)
    z.add_(1)
    return y * 2


def _capture(model, x, level):
    if level == "given":
        return model
    if level == "export":
        return torch.export.export(model, (x,), strict=False).module()
    return fx.symbolic_trace(model)


def _fx_wrap_model():
    class M(nn.Module):
        def forward(self, x):
            y = x * 1
            s = _bump(y)
            return y * 2 + s
    return M()


def _leaf_model():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.bump = _Bump()

        def forward(self, x):
            y = x * 1
            s = self.bump(y)
            return y * 2 + s
    model = M()
    return fx.GraphModule(model, _LeafTracer().trace(model))


WRITERS["fx.wrap function"] = (_fx_wrap_model, "fx")
WRITERS["module of the model's own"] = (_leaf_model, "given")


def _graph(name):
    factory, level = WRITERS[name]
    x = torch.randn(5, 3) * 3
    model = factory()
    return _capture(model, x, level), x


def _seeded(model, x):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return model(x)


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_a_call_that_writes_a_fresh_copy_never_gets_the_callers_tensor(name):
    gm, x = _graph(name)
    expected_x, ours_x = x.clone(), x.clone()
    expected = _seeded(gm, expected_x)  # init.normal_ draws: the same numbers for both
    result = CLEANUP.apply(gm, example_inputs=(x.clone(),), check=False)
    out = _seeded(result.graph_module, ours_x)
    assert result.counts.get("mul_one", 0) == 0, result.graph_module.code
    assert torch.equal(ours_x, expected_x)  # the caller's tensor is written exactly as before (or not)
    torch.testing.assert_close(out, expected)


VIEWS = {
    "reshape": lambda y: torch.reshape(input=y, shape=(-1,)),
    "flatten": lambda y: torch.flatten(input=y),
    "transpose": lambda y: torch.transpose(input=y, dim0=0, dim1=1),
    "select": lambda y: torch.select(input=y, dim=0, index=0),
    "set_": lambda y: torch.zeros_like(y).set_(y),
    "new": lambda y: (y + 0.5).new(y),
}


@pytest.mark.parametrize("name", sorted(VIEWS))
def test_a_returned_view_given_by_keyword_never_aliases_the_input(name):
    view = VIEWS[name]
    gm = fx.symbolic_trace(_Fn(lambda m, x: view(x * 1)))
    x = torch.randn(2, 2)
    result = CLEANUP.apply(gm, example_inputs=(x,), check=False)
    out = result.graph_module(x)
    assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    torch.testing.assert_close(out, view(x * 1))


class _ConvBnWithWrite(nn.Module):
    """A conv and batch norm around an in-place write of the conv's input:
    ``between`` them (a folded conv at the batch norm would read the written value)
    or ``before`` the conv (the original and the fold both read it)."""

    def __init__(self, where):
        super().__init__()
        self.c, self.bn, self.where = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), where

    def forward(self, x):
        h = x * 2.0
        if self.where == "before":
            h.relu_()
        c = self.c(h)
        if self.where == "between":
            h.add_(1)
        return self.bn(c) + h.mean()


def _neg_written(x):
    a = torch.neg(x + 0.0)
    a.view(-1).add_(1)  # the inner neg's value, written between it and the outer neg
    return torch.neg(a) * 2


def _silu_written(x):
    h = x * 2.0
    s = torch.sigmoid(h)
    h.add_(1)
    return h * s


BETWEEN = {
    "conv_bn": (lambda: _ConvBnWithWrite("between").eval(), FUSION, torch.randn(1, 3, 2, 2)),
    "neg_neg": (lambda: _Fn(lambda m, x: _neg_written(x)), CLEANUP, torch.randn(2, 2)),
    "silu_from_sigmoid": (lambda: _Fn(lambda m, x: _silu_written(x)), FUSION, torch.randn(4)),
}


@pytest.mark.parametrize("level", ["fx", "export"])
@pytest.mark.parametrize("name", sorted(BETWEEN))
def test_a_match_never_spans_a_write_into_what_it_reads(name, level):
    factory, rules, x = BETWEEN[name]
    gm = _capture(factory(), x, level)
    result = rules.apply(gm, example_inputs=(x,), check=False)
    assert result.counts.get(name, 0) == 0, result.graph_module.code
    torch.testing.assert_close(result.graph_module(x.clone()), gm(x.clone()))


def test_a_write_before_the_match_does_not_stop_it():
    gm = fx.symbolic_trace(_ConvBnWithWrite("before").eval())
    x = torch.randn(1, 3, 2, 2)
    result = FUSION.apply(gm, example_inputs=(x,))
    assert result.counts.get("conv_bn", 0) == 1
    torch.testing.assert_close(result.graph_module(x), gm(x))


def test_the_check_puts_a_parameters_requires_grad_back():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x):
            self.w.requires_grad_(False)
            return x * 1 + self.w

    gm = fx.symbolic_trace(M())
    CLEANUP.apply(gm, example_inputs=(torch.randn(3),))
    assert gm.w.requires_grad


def test_fp16_avg_pool_with_a_divisor_override_stays_float32():
    amp = rewrite.load(RULES / "amp_fp16.rw")

    class M(nn.Module):
        def forward(self, x):
            return F.avg_pool2d(x.float(), 3, 1, 0, False, True, 1)  # a sum: may outgrow float16

    x = (torch.rand(1, 1, 5, 5) * 1000 + 30000).half()
    gm = fx.symbolic_trace(M())
    result = amp.apply(gm, example_inputs=(x,), check=False)
    assert "avg_pool2d_lowp" not in result.counts
    assert result.graph_module(x).isfinite().all()


def test_a_fold_elsewhere_does_not_excuse_an_output_that_lost_its_gradient():
    drop = rewrite.parse('import "' + str(RULES / "fusion.rw") + '"\n'
                         "rule drop: add(x, mul(_, 0.0)) where is_float(x) => x\n")

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(3, 4, 3)
            self.bn = nn.BatchNorm2d(4)
            self.p = nn.Parameter(torch.randn(5))

        def forward(self, x, y):
            return self.bn(self.c(x)), ((y + 1) + self.p * 0.0) * 2

    gm = fx.symbolic_trace(M().eval())
    with pytest.raises(rewrite.EquivalenceError, match="gradients"):
        drop.apply(gm, example_inputs=(torch.randn(2, 3, 6, 6), torch.randn(5)))
    folded = FUSION.apply(gm, example_inputs=(torch.randn(2, 3, 6, 6), torch.randn(5)))  # the fold alone passes
    assert folded.counts["conv_bn"] == 1


@pytest.mark.parametrize("pre", [False, True])
def test_a_module_with_a_hook_binds_to_no_rule(pre):
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), nn.Identity(), nn.ReLU(), nn.ReLU()).eval()
    gm = fx.symbolic_trace(model)
    for index in ("1", "2", "4"):
        module = gm.get_submodule(index)
        if pre:
            module.register_forward_pre_hook(lambda mod, args: (args[0] + 1,))
        else:
            module.register_forward_hook(lambda mod, args, out: out + 1)
    x = torch.randn(2, 4)
    for rules in (FUSION, CLEANUP):
        result = rules.apply(gm, example_inputs=(x,), check=False)
        called = {n.target for n in result.graph_module.graph.nodes if n.op == "call_module"}
        assert {"1", "2", "4"} <= called, result.graph_module.code
        torch.testing.assert_close(result.graph_module(x), gm(x))


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_int8_results_keep_the_float_models_layout_and_views(capture):
    import rewrite.quant as rq

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(3, 8, 3, padding=1)
            self.pool = nn.AdaptiveAvgPool2d(2)
            self.fc = nn.Linear(32, 10)
            self.c2 = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x):
            h = self.pool(torch.relu(self.c(x)))
            return self.fc(h.view(h.size(0), -1)), self.c2(x)  # a view of a pooled conv; a conv returned

    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(2, 3, 8, 8)
    int8 = rq.quantize(model, [torch.randn(2, 3, 8, 8) for _ in range(4)], example_inputs=(x,), capture=capture)
    logits, features = int8(x)
    assert logits.shape == (2, 10) and features.is_contiguous()


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_ptq_leaves_position_arithmetic_in_float(capture):
    import rewrite.quant as rq

    class PositionEmbedding(nn.Module):  # OPT's learned positions: (cumsum(mask) * mask - 1).long()
        def __init__(self):
            super().__init__()
            self.tok, self.pos, self.fc = nn.Embedding(50, 16), nn.Embedding(32, 16), nn.Linear(16, 16)

        def forward(self, ids):
            mask = torch.ones(ids.shape, dtype=torch.float32)
            positions = (torch.cumsum(mask, dim=1) * mask - 1).long()
            return self.fc(self.tok(ids) + self.pos(positions))

    torch.manual_seed(0)
    model, ids = PositionEmbedding().eval(), torch.randint(0, 50, (2, 12))
    int8 = rq.quantize(model, [(torch.randint(0, 50, (2, 12)),) for _ in range(4)], example_inputs=(ids,),
                       capture=capture)
    with torch.no_grad():
        ref, got = model(ids), int8(ids)
    sqnr = 10 * torch.log10(ref.pow(2).mean() / (ref - got).pow(2).mean())
    assert sqnr > 20  # 3.5 dB when the positions went through int8 and shifted rows


def test_qat_leaves_models_in_other_float_dtypes_alone():
    qat = rewrite.load(RULES / "quant" / "qat.rw")
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2))
    model = model.eval().to(torch.float64)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    result = qat.apply(fx.symbolic_trace(model), example_inputs=(x,))
    assert not result.counts
    result.graph_module(x)


def test_qat_conv_bn_of_an_eval_model_runs_in_eval_mode():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(8, 8, 1, bias=False)
            self.b = nn.BatchNorm2d(8)

        def forward(self, x):
            return torch.relu(self.b(self.c(x)))

    torch.manual_seed(0)
    model = M().eval()
    with torch.no_grad():
        model.b.running_mean.normal_()
        model.b.running_var.uniform_(0.5, 2)
    x = torch.randn(1, 8, 1, 1)  # one value per channel: batch statistics would raise
    result = rewrite.load(RULES / "quant" / "qat.rw").apply(fx.symbolic_trace(model), example_inputs=(x,))
    assert result.counts["qat_conv_bn_8"] == 1
    with torch.no_grad():
        ref, got = model(x), result.graph_module(x)
    assert (ref - got).abs().max() < 0.1 * ref.abs().max()  # fake-quantization noise, not batch statistics


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_lower_rw_passes_its_own_default_check_on_a_dense_block(capture):
    import rewrite.quant as rq

    class Dense(nn.Module):  # concatenations of int8 conv outputs, pooled at the end
        def __init__(self):
            super().__init__()
            self.c0 = nn.Conv2d(3, 8, 3, padding=1)
            self.c1, self.c2 = nn.Conv2d(8, 4, 3, padding=1), nn.Conv2d(12, 4, 3, padding=1)
            self.c3 = nn.Conv2d(16, 8, 1)

        def forward(self, x):
            x = torch.relu(self.c0(x))
            a = torch.cat([x, torch.relu(self.c1(x))], 1)
            b = torch.cat([a, torch.relu(self.c2(a))], 1)
            return F.avg_pool2d(self.c3(torch.relu(b)), 2)

    torch.manual_seed(1)
    model, x = Dense().eval(), torch.randn(2, 3, 8, 8)
    observed = rq.prepare(model, (x,), capture=capture)
    rq.calibrate(observed, [torch.randn(2, 3, 8, 8) for _ in range(4)])
    qdq = rq.convert(observed, lower=False)
    result = rewrite.load(RULES / "quant" / "lower.rw").apply(qdq, example_inputs=(x,))  # the default check
    assert sum(result.counts.values()) >= 3
    out = result.graph_module(x)
    assert out.is_contiguous()
    assert (out - qdq(x)).abs().max() <= 2 * max(n.args[1] for n in qdq.graph.nodes
                                                 if "quantize_per_tensor" in str(n.target))


def test_add_zero_keeps_an_infinite_alpha():
    class M(nn.Module):
        def forward(self, x):
            return torch.add(x, 0, alpha=float("inf")) * 2, torch.sub(x, 0, alpha=float("nan")), (x + 0) * 3

    x = torch.randn(4)
    for gm in (fx.symbolic_trace(M()), torch.export.export(M(), (x,), strict=False).module()):
        result = CLEANUP.apply(gm, example_inputs=(x,), check=False)
        assert result.counts == {"add_zero": 1}  # x + 0 only
        torch.testing.assert_close(result.graph_module(x), gm(x), equal_nan=True)


def test_the_check_leaves_the_callers_version_counters_alone():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

        def forward(self, x):
            return self.bn(self.c(x)) * 1

    gm = fx.symbolic_trace(M().train())
    w = torch.ones(4, requires_grad=True)
    loss = (w * gm.bn.running_mean).sum()  # autograd saved the running mean
    CLEANUP.apply(gm, example_inputs=(torch.randn(2, 3, 6, 6),))  # the check runs the model: BN writes
    loss.backward()  # the running mean's bits and version are as they were


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_folding_a_shared_batch_norm_passes_the_default_check(capture):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2, self.bn = nn.Conv2d(3, 4, 3), nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
            self.bn2 = self.bn  # one module, two names

        def forward(self, x):
            return self.bn(self.c1(x)) + self.bn2(self.c2(x))

    model, x = M().eval(), torch.randn(2, 3, 8, 8)
    gm = fx.symbolic_trace(model) if capture == "fx" else torch.export.export(model, (x,), strict=False).module()
    result = FUSION.apply(gm, example_inputs=(x,))  # its gradient check knew only what the rewrite held
    assert result.counts["conv_bn"] == 2
    torch.testing.assert_close(result.graph_module(x), gm(x), rtol=1e-4, atol=1e-5)


def test_a_dynamic_shape_export_is_rewritten_only_for_what_holds_at_every_size():
    from torch.export import Dim

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)

        def forward(self, x, y):
            return self.bn(self.lin(x).flatten(0, 1)).reshape(y.shape[0], y.shape[1], 8)

    model = M().eval()
    x, y = torch.randn(2, 3, 8), torch.randn(2, 3)
    auto = {0: Dim.AUTO, 1: Dim.AUTO}
    gm = torch.export.export(model, (x, y), dynamic_shapes=(auto, auto), strict=False).module()
    result = FUSION.apply(gm, example_inputs=(x, y))
    assert "linear_view_bn" not in result.counts  # its same_shape held for the example's sizes only
    x2, y2 = torch.randn(2, 3, 8), torch.randn(3, 2)
    assert result.graph_module(x2, y2).shape == gm(x2, y2).shape == (3, 2, 8)

    static = torch.export.export(model, (x, y), strict=False).module()  # one size: the rule may fire
    assert FUSION.apply(static, example_inputs=(x, y)).counts.get("linear_view_bn") == 1


@rewrite.register_constant()
def _doubled_in_place(w):
    return w.mul_(2.0)  # a user's function that writes what it is given


def test_a_users_constant_function_never_writes_the_models_weights():
    rules = rewrite.parse("rule s: batch_norm(conv(x, w, b, st, p, d, g), _, _, _, _, training=False, eps=_, ...) "
                          "where const(w) => conv(x, _doubled_in_place(w), b, st, p, d, g)\n")

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.b = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)

        def forward(self, x):
            return self.b(self.c(x))

    model, x = M().eval(), torch.randn(1, 3, 4, 4)
    weight = model.c.weight.detach().clone()
    for gm in (fx.symbolic_trace(model), torch.export.export(model, (x,), strict=False).module()):
        result = rules.apply(gm, example_inputs=(x,), check=False)
        assert result.counts == {"s": 1}
        assert torch.equal(model.c.weight, weight)


def test_an_all_ones_mask_example_does_not_hide_a_wrong_rule():
    wrong = rewrite.parse("rule drop_mask: mul(x, _) where is_float(x) => x\n")

    class M(nn.Module):
        def forward(self, x, mask):
            return (x * mask).sin()

    gm = fx.symbolic_trace(M())
    with pytest.raises(rewrite.EquivalenceError):  # the random trials draw zeros into the mask
        wrong.apply(gm, example_inputs=(torch.randn(2, 5), torch.ones(2, 5, dtype=torch.int64)))


def test_prepare_qat_says_why_a_float64_model_gets_no_fake_quantizer():
    import rewrite.qat as rqat

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval().to(torch.float64)
    with pytest.raises(rqat.QATError, match="float64"):
        rqat.prepare_qat(model, (torch.randn(2, 3, 6, 6, dtype=torch.float64),))


def test_fp16_keeps_a_clamp_whose_bound_would_round_to_zero():
    amp = rewrite.load(RULES / "amp_fp16.rw")

    class SafeLog(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.log(torch.relu(self.fc(x)).clamp(min=1e-8))  # float16: clamp(min=0), log(0)

    torch.manual_seed(0)
    model, x = SafeLog().eval(), torch.randn(4, 8)
    result = amp.apply(fx.symbolic_trace(model), example_inputs=(x,))  # its own default check
    assert "clamp_lowp" not in result.counts
    assert result.graph_module(x).isfinite().all()
