"""rewrite.trust.instances: the generators behind rule verification build valid programs for
every op the shipped rules use (attention, prelu, indexing, padding, stacking, addbmm,
quantize/dequantize with torch's observers) and follow the where clause's hints."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.fx as fx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rewrite
from rewrite.trust.instances import instances, plan_for

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

_SETTINGS = settings(max_examples=12, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def _rule(text: str) -> object:
    rules = rewrite.parse(text, "gen.rw")
    return rules, rules.rules[next(iter(rules.rules))]


def _targets(gm: fx.GraphModule) -> set:
    return {str(getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes if n.op == "call_function"}


def _runs(inst) -> object:
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        return inst.graph_module(*inst.example_inputs)


@pytest.mark.parametrize("pattern, op", [
    ("prelu(_, _)", "prelu"),
    ("scaled_dot_product_attention(_, _, _, _, _, _, _, _)", "scaled_dot_product_attention"),
    ("select(_, _, _)", "select"),
    ("getitem(_, _)", "getitem"),
    ("aten.slice(_, _, _, _, _)", "slice"),
    ('F.pad(_, _, "constant", _)', "pad"),
    ('aten.pad(_, _, "constant", _)', "pad"),
    ("aten.constant_pad_nd(_, _, _)", "constant_pad_nd"),
    ("stack([_, _], _)", "stack"),
    ("torch.addbmm(_, _, _, beta=_, alpha=_)", "addbmm"),
    ("aten.addbmm(_, _, _, beta=_, alpha=_)", "addbmm"),
    ("dequantize(_)", "dequantize"),
    ("quantize_per_tensor(_, _, _, _)", "quantize_per_tensor"),
    ("torch.fake_quantize_per_tensor_affine(_, _, _, _, _)", "fake_quantize_per_tensor_affine"),
    # issue 13's vocabulary
    ("leaky_relu(_, _)", "leaky_relu"), ("glu(_, _)", "glu"), ("sin(_)", "sin"), ("cos(_)", "cos"),
    ("masked_fill(_, _, _)", "masked_fill"), ("einsum(_, _)", "einsum"), ("amax(_, _, _)", "amax"),
    ("getitem(max(_, _, _), 0)", "max"), ("getitem(topk(_, _, _, _, _), 1)", "topk"),
    ("linalg_vector_norm(_, _, _, _)", "vector_norm"), ("reshape_as(_, _)", "reshape_as"),
    ("expand_as(_, _)", "expand_as"), ("type_as(_, _)", "type_as"), ("getitem(split(_, _, _), 0)", "split"),
    ("getitem(chunk(_, _, _), -1)", "chunk"), ("slice(_, _, _, _, _)", "slice"), ("pad(_, _, _, _)", "pad"),
])
def test_every_new_op_gets_valid_instances(pattern, op):
    _, rule = _rule(f"rule r: {pattern} as out => out")
    assert plan_for(rule).unsupported is None

    @_SETTINGS
    @given(inst=instances(rule))
    def check(inst):
        assert any(op in t for t in _targets(inst.graph_module)), inst.graph_module.code
        out = _runs(inst)
        assert isinstance(out, torch.Tensor)

    check()


def test_attention_draws_masks_of_every_kind():
    _, rule = _rule("rule r: scaled_dot_product_attention(q, k, v, m, p, c, s, g) as o "
                    "where is_tensor(q) and is_tensor(k) and is_tensor(v) and is_literal(p) and is_literal(c) "
                    "and is_literal(s) and is_literal(g) and (is_none(m) or is_tensor(m)) => o")
    seen, dropouts, gqa, batched_masks = set(), set(), set(), set()

    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(inst=instances(rule))
    def check(inst):
        m, q, k = inst.bindings.get("m"), inst.bindings["q"], inst.bindings["k"]
        seen.add("none" if m is None else str(m.dtype))
        if inst.bindings.get("c") is True:
            assert m is None  # causal only without a mask
        dropouts.add(inst.bindings.get("p"))  # dropout too: one seeded generator for both sides
        if inst.bindings.get("g"):
            assert q.dim() >= 3 and k.shape[-3] == 1 < q.shape[-3]  # one key/value head for every query head
            gqa.add(True)
        if m is not None:
            batched_masks.add(m.dim() > 2)
        _runs(inst)

    check()
    assert {"none", "torch.bool"} <= seen and any("float" in s for s in seen)
    assert dropouts == {0.0, 0.5} and gqa and batched_masks == {False, True}


def test_quantized_operands_come_from_torch_observers():
    _, rule = _rule("rule r: conv(dequantize(x), dequantize(w), b, _, _, _, _) as c "
                    "where const(w, b) and is_tensor(x) => c")

    @_SETTINGS
    @given(inst=instances(rule))
    def check(inst):
        x, w = inst.bindings["x"], inst.bindings["w"]
        assert x.dtype == torch.quint8 and x.qscheme() == torch.per_tensor_affine
        assert w.dtype == torch.qint8 and w.qscheme() in (torch.per_channel_affine, torch.per_tensor_affine)
        assert int(w.int_repr().min()) >= -128  # symmetric: zero points 0
        assert not bool(w.q_per_channel_zero_points().any()) if w.qscheme() == torch.per_channel_affine else True
        assert 0 <= x.q_zero_point() <= 255
        assert inst.engine in torch.backends.quantized.supported_engines
        # the dequantized input fits the conv drawn around it
        _runs(inst)

    check()


def test_where_clause_hints_build_what_the_rule_needs():
    rules = rewrite.load("rules/quant/lower.rw")
    plan = plan_for(rules.rules["requantize_same"])
    assert plan.producers == {"x": ("quantize_per_tensor",)}
    observe = rewrite.load("rules/quant/observe.rw")
    assert plan_for(observe.rules["observe_relu_output"]).producers["y"] == ("conv", "linear", "add", "mul")
    assert plan_for(observe.rules["pad_into_conv"]).symmetric_pads == {"p"}
    convert = rewrite.load("rules/quant/convert.rw")
    plan = plan_for(convert.rules["conv_weight"])
    assert plan.quantized_outputs == {"c"} and plan.producers["x"] == ("dequantize",)
    avoid = rewrite.parse("rule ln: layer_norm(x, s, w, b, eps) where dtype(w) != torch.float16 "
                          "and dtype(b) != torch.float16 => layer_norm(x, s, w, b, eps)")
    assert plan_for(avoid.rules["ln"]).avoided == {"w": torch.float16, "b": torch.float16}

    # produced_by(y, ...): y is computed in the graph by one of the ops, single use
    @_SETTINGS
    @given(inst=instances(observe.rules["observe_relu_output"]))
    def produced(inst):
        (relu,) = [n for n in inst.graph_module.graph.nodes if "relu" in str(n.target)]
        y = relu.args[0]
        assert y.op == "call_function" and any(k in str(y.target) for k in ("conv", "linear", "add", "mul"))

    produced()

    # output_quantized(c): the root's one user quantizes it
    @_SETTINGS
    @given(inst=instances(convert.rules["conv_weight"]))
    def quantized(inst):
        out = _runs(inst)
        assert out.is_quantized

    quantized()


def test_shapes_drawn_apart_fit_together():
    # cat([to(a), to(b)]) and stack need their items to fit: instances share shapes
    rules = rewrite.load("rules/amp_bf16.rw")
    for name in ("cat2_bf16", "stack2_bf16"):
        fired = []

        @settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(inst=instances(rules.rules[name]))
        def check(inst):
            fired.append(bool(rules[name].apply(inst.graph_module, inst.example_inputs, check=False).counts))

        check()
        assert sum(fired) >= 3, (name, fired)


@given(data=st.data())
@settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_integer_and_bool_tensors_are_drawn_in_range(data):
    _, rule = _rule("rule r: neg(x) as o where dtype(x) == torch.uint8 => o")
    inst = data.draw(instances(rule))
    (x,) = inst.example_inputs
    if x.dtype == torch.uint8:
        assert int(x.min()) >= 0  # never a negative number cast to uint8
    if not x.dtype.is_floating_point and x.dtype != torch.bool:
        info = torch.iinfo(x.dtype)
        assert info.min <= int(x.min()) and int(x.max()) <= info.max


@pytest.mark.parametrize("pattern, var, default", [
    ("max_pool2d(_, _, _, _, v, _)", "v", 1),
    ("softmax(_, _, v)", "v", None),
    ("conv_transpose(_, _, _, _, _, v, _, _)", "v", 0),
    ("avg_pool2d(_, _, _, _, _, _, v)", "v", None),
    ("batch_norm(_, _, _, _, _, v, _, _)", "v", False),
])
def test_attributes_a_rule_may_drop_are_drawn_away_from_their_default(pattern, var, default):
    """A rule that drops an attribute (`max_pool2d(x, k, s, p, _, c) => max_pool2d(x, k, s, p)`)
    is wrong only where the attribute is not its default: verification must meet such values."""
    _, rule = _rule(f"rule r: {pattern} as out where is_none({var}) or is_literal({var}) => out")
    seen = []

    @settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(inst=instances(rule))
    def check(inst):
        seen.append(inst.bindings[var])
        assert isinstance(_runs(inst), torch.Tensor)

    check()
    assert default in seen and any(v != default for v in seen), seen
