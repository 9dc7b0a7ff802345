"""rules/transformer.rw on transformers models built with eager attention (small configs,
random weights, export capture) and on hand-written modules: every written-out
attention, RMSNorm, LayerNorm and tanh-GELU is replaced by its one op, the written-out
ops are gone, outputs match; and the rules stay put where their identity fails."""

import collections
import functools
import math

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import rewrite
from rewrite.ops import bind_node

transformers = pytest.importorskip("transformers")


@functools.lru_cache(maxsize=None)
def rules():
    return rewrite.load("rules/transformer.rw")["transformer"]


def ops(gm):
    """Canonical op -> count (every spelling at every level)."""
    return collections.Counter(b[0].op for n in gm.graph.nodes for b in [bind_node(n, gm)] if b)


def kinds_of(counts):
    """Rewrites per kind: every attention rule counts as one attention."""
    out = collections.Counter()
    for name, n in counts.items():
        if name.startswith("attention_") and "dropout" not in name:
            out["attention"] += n
    return out


def export(model, args):
    """A plain export: its ``aten._assert_tensor_metadata`` checks after each ``.to()``
    do not block the rules (the engine removes them with the value they check)."""
    return torch.export.export(model, args, strict=False).module()


def rewritten(model, args, level="export"):
    # an inference model (const(w) is false for the trained weights of a train-mode trace)
    gm = export(model.eval(), args) if level == "export" else fx.symbolic_trace(model.eval())
    # an exported graph keeps no trace of .eval(): said to be inference
    result = rules().apply(gm, example_inputs=args, training=False)  # checked: raises if outputs differ
    with torch.no_grad():
        torch.testing.assert_close(result.graph_module(*args), gm(*args), rtol=1e-4, atol=1e-5)
    return result, ops(gm), ops(result.graph_module)


def _tokens(vocab=100, seq=8):
    return (torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(0)),)


# ---------------------------------------------------------------- transformers models

LAYERS = 2


def bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=2, intermediate_size=64,
                        vocab_size=100, max_position_embeddings=64, attn_implementation="eager")
    return BertModel(config).eval(), _tokens()


def llama(kv_heads=4):
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=kv_heads, intermediate_size=64, vocab_size=100,
                         max_position_embeddings=64, attn_implementation="eager", use_cache=False)
    return LlamaModel(config).eval(), _tokens()


def vit():
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(0)
    config = ViTConfig(hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=2, intermediate_size=64,
                       image_size=32, patch_size=8, attn_implementation="eager")
    return ViTModel(config).eval(), (torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)),)


def gpt2():
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=LAYERS, n_head=2, vocab_size=100, n_positions=64, use_cache=False,
                        bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    return GPT2Model(config).eval(), _tokens()


@functools.lru_cache(maxsize=None)
def hf_rewritten(build):
    """One capture and rewrite per model, shared by the tests that count in it."""
    return rewritten(*build())


@pytest.mark.parametrize("build", [bert, llama, vit, gpt2], ids=["bert", "llama", "vit", "gpt2"])
def test_every_eager_attention_becomes_sdpa(build):
    result, before, after = hf_rewritten(build)
    assert before["matmul"] == 2 * LAYERS and before["softmax"] == LAYERS
    assert kinds_of(result.counts)["attention"] == LAYERS
    assert after["scaled_dot_product_attention"] == LAYERS
    assert after["softmax"] == 0 and after["matmul"] == 0


def test_llama_rms_norms_become_rms_norm():
    result, before, after = hf_rewritten(llama)
    norms = 2 * LAYERS + 1  # input and post-attention norm per layer, one final
    assert before["rsqrt"] == norms and before["pow"] == norms
    assert result.counts["rms_norm_cast"] == norms
    assert after["rms_norm"] == norms
    assert after["rsqrt"] == after["pow"] == after["mean"] == 0


def test_gpt2_gelu_new_becomes_tanh_gelu():
    result, before, after = hf_rewritten(gpt2)
    assert before["tanh"] == LAYERS and before["gelu"] == 0
    assert result.counts["gelu_tanh"] == LAYERS
    gm = result.graph_module
    gelus = [b[0] for n in gm.graph.nodes for b in [bind_node(n, gm)] if b and b[0].op == "gelu"]
    assert len(gelus) == LAYERS and all(g.args["approximate"] == "tanh" for g in gelus)
    assert after["tanh"] == after["pow"] == 0


def test_grouped_query_attention_becomes_sdpa_on_the_repeated_heads():
    """Llama with 2 key/value heads for 4 query heads repeats k and v (unsqueeze,
    expand, reshape) before the matmul; sdpa takes the repeated k and v as they are
    (the repeat stays in the graph: enable_gqa on the unrepeated ones is not used)."""
    model, args = llama(kv_heads=2)
    result, before, after = rewritten(model, args)
    assert after["scaled_dot_product_attention"] == LAYERS and after["softmax"] == 0
    assert after["expand"] == before["expand"]
    assert after["rms_norm"] == 2 * LAYERS + 1


def test_llama_under_torch_compile():
    """The same rewrites on dynamo's graph, through rewrite.backend (which freezes the
    parameters dynamo passes as inputs, so the norm weights are constants)."""
    model, args = llama()
    results = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=rewrite.backend(rules(), on_result=results.append))
    with torch.no_grad():
        torch.testing.assert_close(compiled(*args).last_hidden_state, model(*args).last_hidden_state,
                                   rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()
    assert len(results) == 1
    assert results[0].counts["rms_norm_cast"] == 2 * LAYERS + 1
    assert kinds_of(results[0].counts)["attention"] == LAYERS
    after = ops(results[0].graph_module)
    assert after["scaled_dot_product_attention"] == LAYERS and after["softmax"] == after["rsqrt"] == 0


# ---------------------------------------------------------------- hand-written modules


class Attention(nn.Module):
    """Attention as users write it; ``form`` picks the spelling. The scale is a
    number known when the module is built (as transformers' ``self.scaling``): under
    symbolic_trace, ``q.shape[-1]`` would be a graph value, and the rules do not fire
    on a scale they cannot read."""

    def __init__(self, form="mul", softmax_dim=-1, scale=None, mask_op="add", masked=False, keep=False):
        super().__init__()
        self.form, self.softmax_dim, self.scale, self.mask_op = form, softmax_dim, scale, mask_op
        self.masked = masked or mask_op != "add"
        self.keep = keep  # the mask input is a bool "attend here" mask, made additive in the graph

    def forward(self, q, k, v, mask=None):
        if self.keep:  # as transformers builds it: 0 where attended, a finite minimum elsewhere
            mask = torch.where(mask, 0.0, -3.4028234663852886e38)
        d = 8  # the head dim of _qkv()
        scale = self.scale if self.scale is not None else 1 / math.sqrt(d)
        if self.form == "mul":
            scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        elif self.form == "div":
            scores = q @ k.transpose(2, 3) / math.sqrt(d)
        elif self.form == "q":
            scores = (q * scale) @ k.transpose(-2, -1)
        else:
            scores = q @ k.transpose(-2, -1)
        if self.masked:
            scores = scores + mask if self.mask_op == "add" else scores * mask
        probs = F.dropout(F.softmax(scores, dim=self.softmax_dim), p=0.1, training=False)
        return probs @ v


def _qkv(b=2, h=2, lq=5, s=5, e=8, ev=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, lq, e, generator=g), torch.randn(b, h, s, e, generator=g), torch.randn(b, h, s, ev, generator=g)


@pytest.mark.parametrize("level", ["export", "fx"])
@pytest.mark.parametrize("form", ["mul", "div", "q", "none"])
@pytest.mark.parametrize("masked", [False, True])
def test_attention_spellings(form, masked, level):
    q, k, v = _qkv()
    args = (q, k, v, torch.randn(1, 1, 5, 5) > -1) if masked else (q, k, v)
    _, _, after = rewritten(Attention(form, masked=masked, keep=masked), args, level)
    assert after["scaled_dot_product_attention"] == 1
    assert after["softmax"] == after["matmul"] == after["dropout"] == 0


@settings(max_examples=8, deadline=None)
@given(b=st.integers(1, 2), h=st.integers(1, 3), lq=st.integers(1, 6), s=st.integers(1, 6), e=st.integers(1, 8),
       ev=st.integers(1, 8), scale=st.floats(0.01, 4.0), mask=st.sampled_from([None, "full", "row", "col"]))
def test_attention_on_random_shapes(b, h, lq, s, e, ev, scale, mask):
    q, k, v = _qkv(b, h, lq, s, e, ev)
    masks = {"full": (b, h, lq, s), "row": (lq, s), "col": (b, 1, 1, s)}
    args = (q, k, v) if mask is None else (q, k, v, torch.randn(masks[mask]) > -1)
    _, _, after = rewritten(Attention("mul", scale=scale, masked=mask is not None, keep=mask is not None), args, "fx")
    assert after["scaled_dot_product_attention"] == 1 and after["softmax"] == 0


@pytest.mark.parametrize("model, args, why", [
    (Attention(softmax_dim=-2), _qkv(), "softmax over another dim"),
    (Attention(scale=-0.125), _qkv(), "a negative scale"),
    (Attention(mask_op="mul"), (*_qkv(), torch.rand(1, 1, 5, 5)), "a multiplicative mask"),
    (Attention(masked=True), (*_qkv(), torch.randn(5, 5).half()), "a float16 mask on float32 scores"),
    (Attention(masked=True), (*_qkv(), torch.randn(2, 2, 2, 5, 5)), "a mask that broadcasts the scores up"),
])
def test_attention_rules_do_not_fire(model, args, why):
    result, before, after = rewritten(model, args)
    assert after["scaled_dot_product_attention"] == 0, why
    assert after["softmax"] == 1 and after["matmul"] == 2, why


class TensorScale(nn.Module):
    """The scale is a graph input: its value is unknown when rewriting."""

    def forward(self, q, k, v, scale):
        return torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1) @ v


def test_attention_with_a_computed_scale_is_left_alone():
    result, _, after = rewritten(TensorScale(), (*_qkv(), torch.tensor(0.3)))
    assert after["scaled_dot_product_attention"] == 0 and after["softmax"] == 1


class RMSNorm(nn.Module):
    """T5LayerNorm-style (no casts); ``form`` misplaces what the identity needs."""

    def __init__(self, d=16, eps=1e-6, form="ok"):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.eps, self.form = eps, form

    def forward(self, x):
        if self.form == "ok":
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        if self.form == "dim":
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-2, keepdim=True) + self.eps))
        if self.form == "eps":  # eps added after the rsqrt
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) + self.eps)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1) + self.eps).unsqueeze(-1))  # "keepdim"


class LayerNorm(nn.Module):
    """LayerNorm written out: ``"tree"`` computes the mean for the numerator and the
    variance separately (sqrt/div), ``"rsqrt"`` the same with rsqrt/mul; ``"twice"`` is
    the pre-nn.LayerNorm BertLayerNorm (one mean read by two ``x - u``), ``"once"``
    reads one ``x - u`` twice."""

    def __init__(self, d=16, eps=1e-12, form="twice"):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.bias = nn.Parameter(torch.randn(d))
        self.eps, self.form = eps, form

    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        if self.form == "tree":
            x = (x - x.mean(-1, keepdim=True)) / torch.sqrt((x - u).pow(2).mean(-1, keepdim=True) + self.eps)
        elif self.form == "rsqrt":
            x = (x - x.mean(-1, keepdim=True)) * torch.rsqrt((x - u).pow(2).mean(-1, keepdim=True) + self.eps)
        elif self.form == "twice":
            s = (x - u).pow(2).mean(-1, keepdim=True)
            x = (x - u) / torch.sqrt(s + self.eps)
        elif self.form == "once":
            xc = x - u
            x = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + self.eps)
        elif self.form == "dim":  # statistics over another dim
            u = x.mean(1, keepdim=True)
            x = (x - u) / torch.sqrt((x - u).pow(2).mean(1, keepdim=True) + self.eps)
        return self.weight * x + self.bias


def _x(*shape):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(1)),)


@pytest.mark.parametrize("level", ["export", "fx"])
@pytest.mark.parametrize("form", ["tree", "rsqrt"])
def test_layer_norm_written_out_becomes_layer_norm(form, level):
    model = LayerNorm(form=form)
    result, _, after = rewritten(model, _x(2, 5, 16), level)
    assert after["layer_norm"] == 1
    assert after["mean"] == after["pow"] == after["sqrt"] == after["rsqrt"] == after["sub"] == 0
    torch.testing.assert_close(result.graph_module(*_x(2, 5, 16)),
                               F.layer_norm(*_x(2, 5, 16), [16], model.weight, model.bias, 1e-12))


@pytest.mark.parametrize("level", ["export", "fx"])
@pytest.mark.parametrize("form", ["twice", "once"])
def test_layer_norm_with_a_shared_mean_becomes_layer_norm(form, level):
    """The usual spellings read one mean (or one x - mean) twice: a name bound by `as`
    and written again in the pattern is that shared node."""
    _, before, after = rewritten(LayerNorm(form=form), _x(2, 5, 16), level)
    assert after["layer_norm"] == 1 and after["mean"] == 0 and after["sub"] == 0
    assert before["mean"] == 2


@pytest.mark.parametrize("level", ["export", "fx"])
def test_rms_norm_written_out_becomes_rms_norm(level):
    result, _, after = rewritten(RMSNorm(), _x(3, 16), level)
    assert after["rms_norm"] == 1 and after["rsqrt"] == after["mean"] == 0


class BufferEps(RMSNorm):
    """eps kept in a 0-d buffer (exported as a constant): its value is read at rewrite time."""

    def __init__(self, eps):
        super().__init__()
        self.register_buffer("eps_t", torch.tensor(eps))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps_t))


@pytest.mark.parametrize("eps, fires", [(1e-6, True), (-1e-6, False)])
def test_rms_norm_eps_in_a_buffer(eps, fires):
    _, _, after = rewritten(BufferEps(eps), _x(3, 16))
    assert after["rms_norm"] == int(fires) and after["rsqrt"] == int(not fires)


@pytest.mark.parametrize("model", [RMSNorm(form="dim"), RMSNorm(form="eps"), RMSNorm(form="keepdim"),
                                   LayerNorm(form="dim")], ids=["rms-dim", "rms-eps", "rms-keepdim", "ln-dim"])
def test_norm_rules_do_not_fire(model):
    _, before, after = rewritten(model, _x(2, 16, 16))
    assert after["rms_norm"] == after["layer_norm"] == 0
    assert after["mean"] == before["mean"]


def test_layer_norm_weight_of_another_size_is_left_alone():
    model = LayerNorm(d=1)  # broadcasts over 16 features, but is no layer_norm weight
    _, _, after = rewritten(model, _x(2, 16))
    assert after["layer_norm"] == 0


class TanhGelu(nn.Module):
    def __init__(self, c=0.044715):
        super().__init__()
        self.c = c

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + self.c * torch.pow(x, 3.0))))


def test_tanh_gelu_with_another_constant_is_left_alone():
    _, _, after = rewritten(TanhGelu(c=0.044), _x(4, 8))
    assert after["gelu"] == 0 and after["tanh"] == 1
    _, _, after = rewritten(TanhGelu(), _x(4, 8), "fx")
    assert after["gelu"] == 1 and after["tanh"] == 0


class _PackedAttention(nn.Module):
    """q, k, v from one packed linear, heads transposed: attention's output follows
    q's layout, the matmul it replaces is contiguous."""

    def __init__(self, view_after):
        super().__init__()
        self.c_attn, self.view_after = nn.Linear(16, 48), view_after

    def forward(self, x, mask):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, 4, 4).transpose(1, 2) for t in (q, k, v))
        y = torch.softmax(q @ k.transpose(-2, -1) * 0.5 + mask, dim=-1) @ v
        return y.view(B, -1) if self.view_after else y


@pytest.mark.parametrize("view_after", [True, False])
@pytest.mark.parametrize("level", ["fx", "export"])
def test_attention_keeps_the_layout_a_view_or_the_caller_sees(view_after, level):
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16)
    mask = torch.zeros(1, 1, 8, 8).masked_fill(torch.tril(torch.ones(8, 8)) == 0, -1e4)
    model = _PackedAttention(view_after).eval()
    gm = torch.fx.symbolic_trace(model) if level == "fx" else torch.export.export(model, (x, mask)).module()
    result = rewrite.load("rules/transformer.rw")["transformer"].apply(gm, (x, mask))
    out = result.graph_module(x, mask)
    assert out.stride() == model(x, mask).stride()
    torch.testing.assert_close(out, model(x, mask), atol=1e-5, rtol=1e-4)
