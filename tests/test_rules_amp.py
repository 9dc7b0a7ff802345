"""rules/amp_bf16.rw and rules/amp_fp16.rw: torch.autocast's policy as graph rewrites.

Where casts land for every op class (lower precision, fallthrough, float32, promote),
weight casts folded into constants, casts that cancel between neighbouring
lower-precision ops, tensors that must never be cast (integer, bool, float64), the
outputs' dtypes, transformers models through torch.export, agreement with
torch.autocast, and the torch.compile backend.
"""

import functools

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import rewrite
from rewrite.ops import bind_node

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOL = dict(rtol=5e-2, atol=5e-2)  # what the randomized check allows a bf16/fp16 graph


@functools.lru_cache(maxsize=None)
def amp(kind: str = "bf16"):
    return rewrite.load(f"rules/amp_{kind}.rw")


class Fn(nn.Module):
    """``fn(self, *inputs)`` as a traceable module (one to three inputs), with
    submodules and buffers given by keyword."""

    def __new__(cls, fn, **children):
        import inspect

        arity = len(inspect.signature(fn).parameters) - 1
        return super().__new__({1: _Fn1, 2: _Fn2, 3: _Fn3}[arity])

    def __init__(self, fn, **children):
        super().__init__()
        self.fn = fn
        for name, value in children.items():
            if isinstance(value, nn.Module):
                self.add_module(name, value)
            else:
                self.register_buffer(name, value)


class _Fn1(Fn):
    def forward(self, a):
        return self.fn(self, a)


class _Fn2(Fn):
    def forward(self, a, b):
        return self.fn(self, a, b)


class _Fn3(Fn):
    def forward(self, a, b, c):
        return self.fn(self, a, b, c)


def _capture(model, inputs, level):
    if level == "fx":
        return fx.symbolic_trace(model)
    ep = torch.export.export(model, inputs)
    return (ep.run_decompositions() if level == "export_core" else ep).module()


def rewrite_amp(model, inputs, kind="bf16", level="fx"):
    """Capture, apply the rule set (checked against the fp32 graph), return the result."""
    gm = _capture(model.eval(), inputs, level)
    # an inference graph: an exported one keeps no trace of model.eval() (TrainingModeWarning)
    return amp(kind).apply(gm, example_inputs=inputs, training=False, **TOL)


def dtypes(gm, inputs):
    """node -> dtype of the tensor it computes, from one run."""
    seen = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                seen[n] = out.dtype
            return out

    with torch.no_grad():
        Recorder(gm).run(*inputs)
    return seen


def nodes_of(gm, op):
    return [n for n in gm.graph.nodes if any(b.op == op for b in bind_node(n, gm))]


def is_cast(gm, n):
    return any(b.op == "to" for b in bind_node(n, gm))


def ran_in(gm, inputs, op):
    """The dtypes the nodes of canonical ``op`` computed in (their outputs)."""
    seen = dtypes(gm, inputs)
    return [seen[n] for n in nodes_of(gm, op)]


def casts(gm):
    """(dtype cast to, op feeding the cast) for every cast left in the graph."""
    out = []
    for n in nodes_of(gm, "to"):
        bound = next(b for b in bind_node(n, gm) if b.op == "to")
        src = bound.args["input"]
        ops = {b.op for b in bind_node(src, gm)} if isinstance(src, fx.Node) else set()
        out.append((bound.args["dtype"], src.op if not ops else "/".join(sorted(ops))))
    return out


def cast_dtypes(gm):
    """The dtypes cast to, sorted: ["bfloat16", "float32"] for one cast in, one out."""
    return sorted(str(d).replace("torch.", "") for d, _ in casts(gm))


def x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- lower precision


LOWER = {
    "conv1d": (lambda: nn.Sequential(nn.Conv1d(3, 4, 3)), lambda: (x(2, 3, 8),)),
    "conv2d": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3, bias=False)), lambda: (x(2, 3, 8, 8),)),
    "conv3d": (lambda: nn.Sequential(nn.Conv3d(3, 4, 3)), lambda: (x(1, 3, 5, 5, 5),)),
    "conv_transpose2d": (lambda: nn.Sequential(nn.ConvTranspose2d(3, 4, 3, stride=2)), lambda: (x(2, 3, 5, 5),)),
    "linear": (lambda: nn.Sequential(nn.Linear(8, 4)), lambda: (x(3, 8),)),
    "matmul": (lambda: Fn(lambda m, a, b: a @ b), lambda: (x(2, 3, 8), x(8, 5, seed=1))),
    "mm": (lambda: Fn(lambda m, a, b: torch.mm(a, b)), lambda: (x(3, 8), x(8, 5, seed=1))),
    "bmm": (lambda: Fn(lambda m, a, b: torch.bmm(a, b)), lambda: (x(2, 3, 8), x(2, 8, 5, seed=1))),
    "addmm": (lambda: Fn(lambda m, c, a, b: torch.addmm(c, a, b)), lambda: (x(5), x(3, 8), x(8, 5, seed=1))),
    "baddbmm": (lambda: Fn(lambda m, c, a, b: torch.baddbmm(c, a, b, alpha=0.5)),
                lambda: (x(2, 3, 5), x(2, 3, 8), x(2, 8, 5, seed=1))),
    "addbmm": (lambda: Fn(lambda m, c, a, b: torch.addbmm(c, a, b)),
               lambda: (x(3, 5), x(2, 3, 8), x(2, 8, 5, seed=1))),
    "prelu": (lambda: Fn(lambda m, a: F.prelu(a, m.w), w=torch.full((3,), 0.25)), lambda: (x(2, 3, 4),)),
    "prelu_module": (lambda: Fn(lambda m, a: m.act(a), act=nn.PReLU(3)), lambda: (x(2, 3, 4),)),
    "sdpa": (lambda: Fn(lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v)),
             lambda: (x(1, 2, 4, 8), x(1, 2, 4, 8, seed=1), x(1, 2, 4, 8, seed=2))),
    "sdpa_float_mask": (lambda: Fn(lambda m, q, k: F.scaled_dot_product_attention(q, k, k, attn_mask=m.mask),
                                   mask=x(4, 4, seed=3)),
                        lambda: (x(1, 2, 4, 8), x(1, 2, 4, 8, seed=1))),
    "sdpa_bool_mask": (lambda: Fn(lambda m, q, k: F.scaled_dot_product_attention(q, k, k, attn_mask=m.mask),
                                  mask=torch.ones(4, 4, dtype=torch.bool).tril()),
                       lambda: (x(1, 2, 4, 8), x(1, 2, 4, 8, seed=1))),
}


def _root_op(name):
    """The canonical op of a LOWER case; None for ops outside the vocabulary."""
    if name.startswith("sdpa"):
        return "scaled_dot_product_attention"
    return {"conv1d": "conv", "conv2d": "conv", "conv3d": "conv", "conv_transpose2d": "conv_transpose",
            "prelu_module": "prelu", "addbmm": None}.get(name, name)


# every op at both capture levels in bf16; the fp16 rules are the same rules with
# another dtype, so a sample of them
# (conv3d stays float32 in bf16: torch's CPU bfloat16 conv3d is wrong on small shapes,
# lowp_conv_broken; it is lowered in fp16)
LOWER_CASES = ([(n, "bf16", "fx") for n in sorted(LOWER) if n != "conv3d"]
               + [(n, "bf16", "export") for n in sorted(LOWER) if n != "conv3d"]
               + [(n, "fp16", "fx") for n in ("conv2d", "conv3d", "linear", "matmul", "prelu", "sdpa_float_mask")])


@pytest.mark.parametrize("level", ["fx", "export"])
@pytest.mark.parametrize("batched", [True, False])
def test_a_bf16_conv3d_keeps_float32(level, batched):
    build, inputs = LOWER["conv3d"]
    model, inputs = build().eval(), inputs()
    if not batched:  # a 4-d input: the conv is told by its weight
        inputs = (inputs[0][0],)
    result = rewrite_amp(model, inputs, "bf16", level)
    assert not any(k.startswith("conv_bf16") for k in result.counts), result.counts
    torch.testing.assert_close(result.graph_module(*inputs), model(*inputs))


@pytest.mark.parametrize("name,kind,level", LOWER_CASES)
def test_lower_precision_ops_run_in_low_precision_between_casts(name, kind, level):
    build, inputs = LOWER[name]
    model, inputs = build().eval(), inputs()
    result = rewrite_amp(model, inputs, kind, level)
    gm, low = result.graph_module, LOW[kind]
    op = _root_op(name)
    if op is not None:
        (node,) = nodes_of(gm, op)
    else:  # outside the vocabulary: the one call left that is not a cast
        (node,) = [n for n in gm.graph.nodes if n.op == "call_function" and not is_cast(gm, n)]
    seen = dtypes(gm, inputs)
    assert seen[node] == low
    # every floating input of the op was cast to low precision (weights at rewrite
    # time); an attention mask is not cast (sdpa adds a float32 one in float32)
    for arg in node.all_input_nodes:
        mask = op == "scaled_dot_product_attention" and arg not in node.args[:3]
        assert seen[arg] in ((torch.float32, torch.bool) if mask else (low,)), (arg, seen[arg])
    # its result is cast back to float32, so the graph's output keeps its dtype (a
    # channels_last convolution output is made contiguous first, as the model's was)
    (user,) = node.users
    if nodes_of(gm, "contiguous") and user in nodes_of(gm, "contiguous"):
        assert op == "conv" and seen[user] == low
        (user,) = user.users
    assert is_cast(gm, user) and seen[user] == torch.float32
    assert gm(*inputs).dtype == torch.float32


def test_non_constant_weights_are_cast_in_the_graph():
    model = Fn(lambda m, a, w: F.linear(a, w).sum() + F.conv2d(a.view(1, 3, 1, 4), w.view(1, 3, 1, 4)).sum())
    inputs = (x(3, 4), x(3, 4, seed=1))
    result = rewrite_amp(model, inputs)
    assert result.counts["linear_bf16_nobias"] == 1 and result.counts["conv_bf16_nobias"] == 1
    assert ran_in(result.graph_module, inputs, "linear") == [torch.bfloat16]


# ---------------------------------------------------------------- fallthrough


FALLTHROUGH = {
    "relu": lambda m, h: torch.relu(h),
    "gelu_tanh": lambda m, h: F.gelu(h, approximate="tanh"),
    "silu_sigmoid_tanh": lambda m, h: torch.tanh(F.silu(h) * torch.sigmoid(h)),
    "hardswish_hardtanh_relu6": lambda m, h: F.relu6(F.hardtanh(F.hardswish(h), -2.0, 2.0)),
    "neg_abs_clamp": lambda m, h: (-h).abs().clamp(0.1, 2.0),
    "arith": lambda m, h: (h + h * 0.5 - 1.0) / 2.0 - h,
    "shapes": lambda m, h: h.view(2, 3, 4).transpose(1, 2).permute(0, 2, 1).reshape(6, 4).unsqueeze(0).squeeze(0)
    .contiguous().flatten(0, 1).view(6, 4),
    "dropout_eval": lambda m, h: F.dropout(h, 0.3, training=False),
    "getitem_expand": lambda m, h: h[1:, :].expand(2, 5, 4)[0],
    "cat_stack": lambda m, h: torch.cat([h, h * 2.0], 0)[:6] + torch.stack([h, h * 0.5], 0).mean(0),
}


@pytest.mark.parametrize("level", ["fx", "export"])
@pytest.mark.parametrize("name", sorted(FALLTHROUGH))
def test_fallthrough_ops_stay_in_bf16_between_lower_precision_ops(name, level):
    fn = FALLTHROUGH[name]
    model = Fn(lambda m, a: m.l2(fn(m, m.l1(a))), l1=nn.Linear(4, 4), l2=nn.Linear(4, 4))
    inputs = (x(6, 4),)
    result = rewrite_amp(model, inputs, "bf16", level)
    gm = result.graph_module
    # one cast in, one cast out: everything between the two linears ran in bf16
    assert cast_dtypes(gm) == ["bfloat16", "float32"], casts(gm)
    seen = dtypes(gm, inputs)
    computed = [n for n in gm.graph.nodes if n.op.startswith("call_") and n in seen and not is_cast(gm, n)]
    assert {seen[n] for n in computed} == {torch.bfloat16}


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_norms_softmax_follow_the_device_policy(kind):
    """CPU autocast runs layer_norm and softmax in the input's dtype; CUDA runs them
    in float32: casts land around them under amp_fp16.rw only."""
    model = Fn(lambda m, a: m.l2(torch.softmax(m.ln(m.l1(a)), -1)), l1=nn.Linear(4, 8), ln=nn.LayerNorm(8),
               l2=nn.Linear(8, 4))
    inputs = (x(3, 4),)
    gm = rewrite_amp(model, inputs, kind).graph_module
    low = LOW[kind]
    if kind == "bf16":
        assert ran_in(gm, inputs, "layer_norm") == [low] and ran_in(gm, inputs, "softmax") == [low]
        assert len(casts(gm)) == 2
    else:
        assert ran_in(gm, inputs, "layer_norm") == [torch.float32]
        assert ran_in(gm, inputs, "softmax") == [torch.float32]
        assert sorted(casts(gm), key=str) == sorted(
            [(low, "placeholder"), (torch.float32, "linear"), (low, "softmax"), (torch.float32, "linear")], key=str)


def test_cpu_fp32_list_op_keeps_float32():
    """reflection padding is on the CPU fp32 list: the cast back lands before it and
    the next linear casts again."""
    model = Fn(lambda m, a: m.l2(F.pad(m.l1(a), (1, 1), mode="reflect")), l1=nn.Linear(4, 4), l2=nn.Linear(6, 4))
    inputs = (x(2, 3, 4),)
    gm = rewrite_amp(model, inputs).graph_module
    seen = dtypes(gm, inputs)
    (pad,) = [n for n in gm.graph.nodes if "pad" in str(n.target)]
    assert seen[pad] == torch.float32
    assert sorted(casts(gm), key=str) == sorted(
        [(torch.bfloat16, "placeholder"), (torch.float32, "linear"), (torch.bfloat16, "pad"),
         (torch.float32, "linear")], key=str)


def test_fp16_policy_upcasts_a_float16_tensor_the_model_made():
    model = Fn(lambda m, a: torch.softmax(a.half() * 2.0, -1).float())
    inputs = (x(3, 4),)
    result = rewrite_amp(model, inputs, "fp16")
    assert result.counts.get("softmax_fp32") == 1
    assert ran_in(result.graph_module, inputs, "softmax") == [torch.float32]


# ---------------------------------------------------------------- promote and binary ops


@pytest.mark.parametrize("level", ["fx", "export"])
def test_promote_and_binary_ops_take_the_widest_input(level):
    # both operands bf16: bf16; one float32 operand: float32, as under autocast
    model = Fn(lambda m, a: (torch.cat([m.l1(a), m.l2(a)], 1), torch.cat([m.l1(a), a], 1),
                             m.l1(a) + m.l2(a), m.l1(a) + a, torch.stack([m.l1(a), m.l2(a)])),
               l1=nn.Linear(4, 4), l2=nn.Linear(4, 4))
    inputs = (x(3, 4),)
    gm = rewrite_amp(model, inputs, "bf16", level).graph_module
    assert sorted(map(str, ran_in(gm, inputs, "cat"))) == ["torch.bfloat16", "torch.float32"]
    assert sorted(map(str, ran_in(gm, inputs, "add"))) == ["torch.bfloat16", "torch.float32"]
    seen = dtypes(gm, inputs)
    (stack,) = [n for n in gm.graph.nodes if "stack" in str(n.target)]
    assert seen[stack] == torch.bfloat16
    outs = gm(*inputs)
    assert all(o.dtype == torch.float32 for o in outs)


# ---------------------------------------------------------------- folding and cancelling


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.fc = nn.Linear(8, 5)

    def forward(self, a):
        h = torch.relu(self.conv1(a))
        h = F.max_pool2d(torch.relu(self.conv2(h)) + h, 2)
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


@pytest.mark.parametrize("level", ["fx", "export"])
def test_weights_are_cast_once_into_bf16_constants(level):
    model = ConvNet().eval()
    inputs = (x(2, 3, 8, 8),)
    result = rewrite_amp(model, inputs, "bf16", level)
    gm = result.graph_module
    consts = dict(gm.named_parameters()) | dict(gm.named_buffers())
    assert len(consts) == 5 and all(t.dtype == torch.bfloat16 for t in consts.values()), consts.keys()
    # conv weights are laid out channels_last (oneDNN's fast bf16 path)
    weights = [t for t in consts.values() if t.dim() == 4]
    assert len(weights) == 2 and all(t.is_contiguous(memory_format=torch.channels_last) for t in weights)
    for n in nodes_of(gm, "to"):
        assert n.args[0].op != "get_attr", n.format_node()
    # the graph casts the input once and the output once; everything else is bf16
    assert cast_dtypes(gm) == ["bfloat16", "float32"]
    assert gm(*inputs).dtype == torch.float32


def test_cast_of_a_constant_operand_folds_also_through_a_view():
    # core ATen spells linear as addmm(b, x, permute(w)): the cast moves above the
    # permute and folds into a new constant
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
    inputs = (x(3, 8),)
    result = rewrite_amp(model, inputs, "bf16", "export_core")
    gm = result.graph_module
    assert result.counts["fold_cast_permute"] == 2 and result.counts["fold_cast"] == 4
    assert all(t.dtype == torch.bfloat16 for t in gm.state_dict().values())
    assert len(casts(gm)) == 2
    # a buffer multiplied in: its cast folds too
    model = Fn(lambda m, a: a @ m.proj, proj=x(8, 3))
    gm = rewrite_amp(model, inputs).graph_module
    assert [t.dtype for t in gm.state_dict().values()] == [torch.bfloat16]
    assert len(casts(gm)) == 2


@pytest.mark.parametrize("level", ["fx", "export"])
def test_casts_between_adjacent_lower_precision_ops_cancel(level):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2)).eval()
    inputs = (x(4, 8),)
    result = rewrite_amp(model, inputs, "bf16", level)
    gm = result.graph_module
    assert result.counts["linear_bf16"] == 4 and result.counts["to_roundtrip"] == 3
    assert casts(gm) == [(torch.bfloat16, "placeholder"), (torch.float32, "linear")]
    assert ran_in(gm, inputs, "linear") == [torch.bfloat16] * 4


def test_a_cast_the_model_writes_keeps_what_follows_in_float32():
    """h.float() before a norm (HF's RMSNorm) keeps the norm in float32 under autocast;
    the rules keep it too, and match autocast exactly."""

    def rms(m, a):
        h = m.l1(a).float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return m.l2(h)

    model = Fn(rms, l1=nn.Linear(8, 8), l2=nn.Linear(8, 4)).eval()
    inputs = (x(3, 8),)
    gm = rewrite_amp(model, inputs).graph_module
    assert ran_in(gm, inputs, "pow") == [torch.float32] and ran_in(gm, inputs, "rsqrt") == [torch.float32]
    with torch.autocast("cpu", torch.bfloat16):
        expected = model(*inputs)
    assert torch.equal(gm(*inputs), expected.float())


# ---------------------------------------------------------------- what is never cast


def test_integer_and_bool_tensors_are_never_cast():
    def fn(m, ids, mask):
        h = m.emb(ids).masked_fill(mask.unsqueeze(-1), 0.0)
        return m.fc(h), torch.matmul(ids, ids.t()), mask.logical_not()

    model = Fn(fn, emb=nn.Embedding(10, 8), fc=nn.Linear(8, 3)).eval()
    inputs = (torch.randint(0, 10, (4, 5)), torch.rand(4, 5) > 0.5)
    for level in ("fx", "export"):
        result = rewrite_amp(model, inputs, "bf16", level)
        gm = result.graph_module
        assert result.counts == {"linear_bf16": 1}, result.counts
        assert cast_dtypes(gm) == ["bfloat16", "float32"]  # into and out of the linear only
        out, out_ref = gm(*inputs), model(*inputs)
        assert [o.dtype for o in out] == [o.dtype for o in out_ref]
        assert torch.equal(out[1], out_ref[1]) and torch.equal(out[2], out_ref[2])
        assert gm.state_dict()[next(k for k in gm.state_dict() if "emb" in k)].dtype == torch.float32


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_float64_models_are_left_alone(kind):
    model = ConvNet().double().eval()
    inputs = (x(2, 3, 8, 8).double(),)
    result = amp(kind).apply(fx.symbolic_trace(model), example_inputs=inputs)
    assert result.counts == {}


def test_outputs_keep_the_models_dtypes():
    torch.manual_seed(0)  # the weights, whatever ran before (an argmax of 2 may flip in bfloat16)
    model = Fn(lambda m, a: (m.fc(a), m.fc(a).argmax(-1), m.fc(a).double()), fc=nn.Linear(4, 3)).eval()
    inputs = (x(2, 4),)
    gm = rewrite_amp(model, inputs).graph_module
    assert [o.dtype for o in gm(*inputs)] == [torch.float32, torch.int64, torch.float64]


# ---------------------------------------------------------------- models from outside, autocast


def _hf(builder):
    from rewrite.examples import hf

    model, inputs = getattr(hf, builder)()
    return model, inputs, torch.export.export(model, inputs, strict=False).module()


def test_hf_bert_end_to_end_through_export_matches_autocast():
    model, inputs, gm = _hf("hf_bert")
    result = amp("bf16").apply(gm, example_inputs=inputs, **TOL)
    assert result.counts["linear_bf16"] == 13 and result.counts["sdpa_bf16"] == 2
    out = result.graph_module(*inputs)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        expected = model(*inputs)
    # same policy, same kernels, weights rounded the same way: the same numbers
    assert torch.equal(out[0], expected[0]) and out[0].dtype == torch.float32
    assert len(casts(result.graph_module)) == 14  # per layer: q/k/v input x3, attention out, mlp in, mlp out


def test_hf_resnet_end_to_end_through_export():
    model, inputs, gm = _hf("hf_resnet")
    # 16 convs in bf16: outputs of magnitude ~6 differ by up to ~1% of that
    result = amp("bf16").apply(gm, example_inputs=inputs, rtol=5e-2, atol=1e-1)
    assert result.counts["conv_bf16"] == 16
    gm = result.graph_module
    assert cast_dtypes(gm) == ["bfloat16", "float32", "float32"]  # two outputs
    out = gm(*inputs)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        expected = model(*inputs)
    assert out[0].dtype == torch.float32
    torch.testing.assert_close(out[0], expected[0].float(), rtol=2e-2, atol=2e-2)


def test_mlp_is_bitwise_autocast():
    model = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(16, 16), nn.GELU())]).eval()
    inputs = (x(8, 16),)
    gm = rewrite_amp(model, inputs, "bf16", "export").graph_module
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        expected = model(*inputs)
    assert torch.equal(gm(*inputs), expected.float())


def test_torch_compile_backend():
    model = ConvNet().eval()
    inputs = (x(2, 3, 8, 8),)
    results = []
    compiled = torch.compile(model, backend=rewrite.backend(amp("bf16"), check=False, on_result=results.append))
    with torch.no_grad():
        out = compiled(*inputs)
        with torch.autocast("cpu", torch.bfloat16):
            expected = model(*inputs)
    assert results[0].counts["conv_bf16"] == 2 and results[0].counts["linear_bf16"] == 1
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, model(*inputs), **TOL)
    torch.testing.assert_close(out, expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("builder", ["hf_bert", "hf_resnet", "hf_vit"])
def test_shipped_amp_passes_its_default_check(builder):
    """With default arguments the check holds a bfloat16 rewrite of a float32 model to
    bfloat16's tolerance (the precision it newly computes in), so the shipped rule set
    passes on real models, while exact rule sets stay held to rounding."""
    model, inputs, gm = _hf(builder)
    result = amp("bf16").apply(gm, example_inputs=inputs)
    assert result.equivalence.ok and sum(result.counts.values()) > 0
    assert any(n.target in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype)
               for n in result.graph_module.graph.nodes if n.op == "call_function")


def test_an_approximate_failure_says_so_and_suggests_the_fix():
    model, inputs, gm = _hf("hf_resnet")
    with pytest.raises(rewrite.EquivalenceError) as info:
        amp("bf16").apply(gm, example_inputs=inputs, rtol=1e-5, atol=1e-5)
    text = str(info.value)
    assert info.value.tolerance == "approx"
    assert "Approximate rules fired" in text and "no single rule need be wrong" in text and "rtol=" in text


def test_integer_outputs_downstream_of_bfloat16_pass_on_agreement():
    """argmax over bfloat16 logits may flip where two logits are within rounding: an
    approximate run that newly computes in lower precision compares integer outputs
    by agreement rate (>= rewrite.trust.check.INT_AGREEMENT), reported in the verdict."""
    from rewrite.trust.check import INT_AGREEMENT, check_equivalence

    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10)).eval()

    class Classify(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = body

        def forward(self, x):
            logits = self.body(x)
            return logits, logits.argmax(-1)

    x = torch.randn(256, 16)
    result = amp("bf16").apply(fx.symbolic_trace(Classify()), (x,))
    report = result.equivalence
    assert report.ok and report.int_agreement is not None and report.int_agreement >= INT_AGREEMENT
    assert "integer outputs agree on" in result.summary()
    # the same flips in a float32 rewrite are a failure: integers are exact there
    flip = lambda x: (body(x), body(x).argmax(-1).flip(0))  # noqa: E731
    assert not check_equivalence(Classify(), flip, (x,), tolerance="approx").ok


def _unet_block(i, o):
    return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.ReLU(), nn.Conv2d(o, o, 3, padding=1),
                         nn.GroupNorm(2, o), nn.SiLU())


class _SmallUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.d1, self.d2, self.mid = _unet_block(3, 8), _unet_block(8, 16), _unet_block(16, 16)
        self.up1, self.u1 = nn.ConvTranspose2d(16, 16, 2, 2), _unet_block(32, 8)
        self.up2, self.u2 = nn.Upsample(scale_factor=2, mode="bilinear"), _unet_block(16, 8)
        self.out = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        a = self.d1(x)
        b = self.d2(F.max_pool2d(a, 2))
        m = self.mid(F.max_pool2d(b, 2))
        u = self.u1(torch.cat([self.up1(m), b], 1))
        return self.out(self.u2(torch.cat([self.up2(u), a], 1)))


def test_amp_fp16_passes_its_default_check_on_a_deep_conv_net():
    # float16 rounding over ~13 layers: held to float16's tolerance (the tie with
    # float32's table entry once made the check use float32's scale floor)
    torch.manual_seed(0)
    model, x = _SmallUNet().eval(), torch.randn(1, 3, 16, 16)
    result = rewrite.load("amp_fp16.rw").apply(fx.symbolic_trace(model), (x,))
    assert result.counts["conv_fp16"] == 11 and result.equivalence.ok


class _FlattenByView(nn.Module):
    """A classic CNN head: ``x.view(x.size(0), -1)`` after the convolutions."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2, self.fc = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3), nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.c2(torch.relu(self.c1(x)))), 2)
        return self.fc(x.view(x.size(0), -1))


@pytest.mark.parametrize("file", ["amp_bf16.rw", "amp_fp16.rw"])
@pytest.mark.parametrize("level", ["fx", "export"])
def test_amp_views_a_channels_last_convolution_output(file, level):
    # the channels_last weights make the convolutions' outputs channels_last, which
    # .view cannot flatten: the lowered view is a reshape (the cast after it copies anyway)
    model, x = _FlattenByView().eval(), torch.randn(2, 3, 12, 12)
    gm = fx.symbolic_trace(model) if level == "fx" else torch.export.export(model, (x,), strict=False).module()
    result = rewrite.load(file).apply(gm, (x,))
    assert result.equivalence.ok and sum(v for k, v in result.counts.items() if k.startswith("view_")) == 1


# ---------------------------------------------------------------- layouts leaving the lowered region
#
# The convolutions' channels_last weights make their lowp outputs channels_last. Under
# the float16 policy batch_norm (and the residual add) stay float32, so the region ends
# right after each convolution: the value cast back must have the model's layout again,
# or the classic head's x.view(x.size(0), -1) fails and a returned feature map comes
# back channels_last.


def _conv_bn(i, o):
    return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU())


class _VGGish(nn.Module):
    """conv-BN-relu x2, max pool, avg pool, x.view(x.size(0), -1), linear."""

    n_convs = 3

    def __init__(self):
        super().__init__()
        self.b1, self.b2, self.b3 = _conv_bn(3, 8), _conv_bn(8, 8), _conv_bn(8, 8)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(self.b2(self.b1(x)), 2)
        x = F.avg_pool2d(self.b3(x), 2)
        x = x.view(x.size(0), -1)
        return self.fc(x)


class _ResNetish(nn.Module):
    """A stem and one basic block (conv-BN-relu-conv-BN + identity, relu), then the
    feature map (returned too) through a flatten head and a view head (a reshape
    with ``view=False``: a channels_last model cannot view it)."""

    n_convs = 3

    def __init__(self, view=True):
        super().__init__()
        self.view = view
        self.stem = _conv_bn(3, 8)
        self.c1, self.n1 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.c2, self.n2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        x = self.stem(x)
        feats = torch.relu(self.n2(self.c2(torch.relu(self.n1(self.c1(x))))) + x)
        pooled = F.max_pool2d(feats, 2)
        flat = pooled.view(pooled.size(0), -1) if self.view else pooled.reshape(pooled.size(0), -1)
        logits = self.fc(torch.flatten(pooled, 1)) + self.fc(flat)
        return logits, feats


def _randomized(model):
    """Non-trivial batch norm statistics, so a lowered graph that skipped one shows."""
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5), m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5), m.bias.data.uniform_(-0.5, 0.5)
    return model.eval()


def _same_layout(got, want):
    return (got.is_contiguous() == want.is_contiguous()
            and got.is_contiguous(memory_format=torch.channels_last)
            == want.is_contiguous(memory_format=torch.channels_last))


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
@pytest.mark.parametrize("level", ["fx", "export", "export_core"])
@pytest.mark.parametrize("net", [_VGGish, _ResNetish])
def test_classic_cnn_with_batch_norm_and_a_view_head_keeps_its_layouts(net, level, kind):
    torch.manual_seed(0)
    model = _randomized(net())
    inputs = (torch.randn(2, 3, 16, 16),)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    gm = _capture(model, inputs, level)
    code = gm.code
    with torch.no_grad():
        expected = model(*inputs)
    result = amp(kind).apply(gm, example_inputs=inputs)  # the default check
    assert result.equivalence.ok
    out_gm, low = result.graph_module, LOW[kind]
    # every convolution was lowered, with channels_last constant weights
    assert result.counts[f"conv_{kind}"] == net.n_convs
    assert ran_in(out_gm, inputs, "conv") == [low] * net.n_convs
    convs = nodes_of(out_gm, "conv")
    weights = [getattr(out_gm, n.args[1].target) for n in convs]
    assert all(w.dtype == low and w.is_contiguous(memory_format=torch.channels_last) for w in weights)
    if kind == "fp16":
        # batch_norm stays float32 (fp16 policy): each convolution's region ends at it,
        # and the value leaving it is made contiguous again (in float16, before the cast)
        assert ran_in(out_gm, inputs, "batch_norm") == [torch.float32] * net.n_convs
        assert result.counts["exit_contiguous_fp16"] == net.n_convs
        assert sorted(str(d) for d, src in casts(out_gm) if src == "contiguous") == ["torch.float32"] * net.n_convs
    else:
        # bfloat16 keeps batch_norm in the region: one cast in, casts out at the ends
        assert set(ran_in(out_gm, inputs, "batch_norm")) == {low}
        assert cast_dtypes(out_gm).count("bfloat16") == 1
    # the outputs match at the lowp tolerance, in the model's dtypes and layouts
    with torch.no_grad():
        got = out_gm(*inputs)
    got, want = (got, expected) if isinstance(got, tuple) else ((got,), (expected,))
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=5e-2, atol=5e-2)
        assert _same_layout(g, w), (g.stride(), w.stride())
    # the model and the captured graph it was given are unchanged
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert gm.code == code
    with torch.no_grad():
        again = gm(*inputs)
    for g, w in zip(again if isinstance(again, tuple) else (again,), want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
@pytest.mark.parametrize("level", ["fx", "export"])
def test_a_channels_last_model_keeps_channels_last_where_the_region_ends(level, kind):
    # a model run channels_last computes channels_last already: nothing is made
    # contiguous on the way out, and the feature map comes back channels_last
    torch.manual_seed(0)
    model = _randomized(_ResNetish(view=False)).to(memory_format=torch.channels_last)
    inputs = (torch.randn(2, 3, 16, 16).to(memory_format=torch.channels_last),)
    with torch.no_grad():
        expected = model(*inputs)
    assert expected[1].is_contiguous(memory_format=torch.channels_last)
    result = amp(kind).apply(_capture(model, inputs, level), example_inputs=inputs)
    assert result.equivalence.ok and result.counts[f"conv_{kind}"] == 3
    assert "exit_contiguous_" + kind not in result.counts
    with torch.no_grad():
        got = result.graph_module(*inputs)
    for g, w in zip(got, expected):
        torch.testing.assert_close(g, w, rtol=5e-2, atol=5e-2)
        assert _same_layout(g, w)
