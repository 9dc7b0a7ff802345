"""Attention masks that may mask a whole row with -inf are not rewritten into sdpa.

softmax over scores that are -inf throughout a row is NaN (0/0) in the written-out
attention and 0 in ``scaled_dot_product_attention``: a caller who masks every key of
a query with -inf observes NaN before the rewrite and 0 after. The attention rules of
``rules/transformer.rw`` fire only on masks the graph proves hold no -inf
(``never_minus_inf``): finite fills and selections of them, constants without -inf,
conversions that cannot overflow. Everything else (a float mask given as an input,
``masked_fill(..., -inf)``, a mask written in place, a conversion to float16 of a
float32 minimum) leaves the attention as it is, and the caller sees what they saw.
"""

import functools

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import rewrite
from rewrite.engine.facts import GraphFacts, Value
from rewrite.functions.transformer import never_minus_inf

MIN32 = torch.finfo(torch.float32).min


@functools.lru_cache(maxsize=None)
def rules():
    return rewrite.load("rules/transformer.rw")["transformer"]


def _qkv(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 2, 4, 8, generator=g).to(dtype) for _ in range(3))


def _keep():
    """Every key of query 0 masked: the row a -inf mask turns into NaN."""
    keep = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    keep[..., 0, :] = False
    return keep


class MaskedAttention(nn.Module):
    def __init__(self, make_mask):
        super().__init__()
        self.make_mask = make_mask

    def forward(self, q, k, v, keep):
        mask = self.make_mask(self, q, keep)
        return torch.softmax(q @ k.transpose(-2, -1) * 0.125 + mask, dim=-1) @ v


def _capture(model, args, level):
    return fx.symbolic_trace(model) if level == "fx" else torch.export.export(model, args, strict=False).module()


def _sdpa_count(gm):
    return sum("scaled_dot_product_attention" in str(n.target) for n in gm.graph.nodes)


def _minus_inf_fill(self, q, keep):
    return torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))


def _minus_inf_where(self, q, keep):
    return torch.where(keep, 0.0, float("-inf"))


def _written_in_place(self, q, keep):
    mask = torch.zeros(keep.shape)
    mask.masked_fill_(~keep, float("-inf"))  # the zeros are -inf by the time attention reads them
    return mask


def _half_of_float32_minimum(self, q, keep):
    return torch.where(keep, 0.0, MIN32).half().float()  # -inf in float16, and back


def _arithmetic(self, q, keep):
    return (1.0 - keep.float()) * MIN32 * 2  # overflows to -inf


MAY_HOLD_MINUS_INF = {
    "masked_fill -inf": _minus_inf_fill,
    "where -inf": _minus_inf_where,
    "written in place": _written_in_place,
    "float32 minimum through float16": _half_of_float32_minimum,
    "arithmetic that may overflow": _arithmetic,
}


@pytest.mark.parametrize("level", ["export", "fx"])
@pytest.mark.parametrize("name", sorted(MAY_HOLD_MINUS_INF))
def test_masks_that_may_hold_minus_inf_are_left_alone(name, level):
    model = MaskedAttention(MAY_HOLD_MINUS_INF[name])
    args = (*_qkv(), _keep())
    gm = _capture(model, args, level)
    expected = gm(*args)
    assert torch.isnan(expected[:, :, 0]).all()  # the fully masked query, written out
    result = rules().apply(gm, example_inputs=args)  # the default check passes: nothing changed
    assert _sdpa_count(result.graph_module) == 0, name
    torch.testing.assert_close(result.graph_module(*args), expected, equal_nan=True)


@pytest.mark.parametrize("level", ["export", "fx"])
def test_a_float_mask_given_as_an_input_is_left_alone(level):
    class InputMask(nn.Module):
        def forward(self, q, k, v, mask):
            return torch.softmax(q @ k.transpose(-2, -1) * 0.125 + mask, dim=-1) @ v

    mask = torch.zeros(1, 1, 4, 4)
    args = (*_qkv(), mask)
    gm = _capture(InputMask(), args, level)
    result = rules().apply(gm, example_inputs=args)
    assert _sdpa_count(result.graph_module) == 0
    # the caller's -inf rows still give what they gave
    masked = mask.clone()
    masked[..., 0, :] = float("-inf")
    out = result.graph_module(*_qkv(), masked)
    assert torch.isnan(out[:, :, 0]).all()


@pytest.mark.parametrize("level", ["export", "fx"])
def test_a_finite_minimum_mask_is_rewritten_and_keeps_fully_masked_rows(level):
    model = MaskedAttention(lambda self, q, keep: torch.where(keep, 0.0, MIN32))
    args = (*_qkv(), _keep())
    gm = _capture(model, args, level)
    result = rules().apply(gm, example_inputs=args)
    assert _sdpa_count(result.graph_module) == 1
    assert not any("softmax" in str(n.target) for n in result.graph_module.graph.nodes)
    out, expected = result.graph_module(*args), gm(*args)
    assert torch.isfinite(expected).all() and torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_a_constant_mask_is_read(causal):
    """A buffer mask: rewritten when it holds no -inf (a finite causal mask), left
    alone when it does (``triu(full(-inf), 1)``: no row is -inf throughout, but a
    slice of it may be, and the rule does not look that far)."""
    class BufferMask(nn.Module):
        def __init__(self):
            super().__init__()
            fill = float("-inf") if causal else MIN32
            self.register_buffer("mask", torch.triu(torch.full((4, 4), fill), 1))

        def forward(self, q, k, v):
            return torch.softmax(q @ k.transpose(-2, -1) * 0.125 + self.mask, dim=-1) @ v

    args = _qkv()
    gm = torch.export.export(BufferMask(), args, strict=False).module()
    result = rules().apply(gm, example_inputs=args)
    assert _sdpa_count(result.graph_module) == (0 if causal else 1)
    torch.testing.assert_close(result.graph_module(*args), gm(*args), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- the predicate itself

_INT_DTYPES = [torch.bool, torch.uint8, torch.int16, torch.int32, torch.int64]
_FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _step(draw, values):
    """One op over the last value (or an input), another value as its second operand."""
    name = values[-1] if len(values) > 3 and draw(st.booleans()) else draw(st.sampled_from(values))
    kind = draw(st.sampled_from(["where", "masked_fill", "cast", "expand", "cat", "add", "neg", "full", "mul"]))
    # finite in float32, not in float16 (-7e4) or bfloat16 (float32's minimum rounds to -inf)
    number = draw(st.sampled_from([0.0, -7e4, MIN32, float("-inf"), -1e300, 3]))
    other = draw(st.sampled_from(values))
    if kind == "where":
        return f"torch.where(keep, {name}, {number!r})"
    if kind == "masked_fill":
        return f"{name}.masked_fill(~keep, {number!r})"
    if kind == "cast":
        return f"{name}.to({draw(st.sampled_from(_FLOAT_DTYPES + [torch.float16, torch.bfloat16]))})"
    if kind == "expand":
        return f"{name}.expand(2, 4, 4)"
    if kind == "cat":
        return f"torch.cat([{name}, {other}], 0)[:1]"
    if kind == "add":
        return f"{name} + {other}"
    if kind == "neg":
        return f"-{name}"
    if kind == "mul":
        return f"{name} * {number!r}"
    return f"torch.full((1, 4, 4), {number!r}, dtype={draw(st.sampled_from(_FLOAT_DTYPES))})"


@st.composite
def _programs(draw):
    ints = draw(st.sampled_from(_INT_DTYPES))
    values = ["keep", "ids", "x"]
    lines = []
    for i in range(draw(st.integers(1, 4))):
        lines.append(f"    v{i} = {_step(draw, values)}")
        values.append(f"v{i}")
    body = "\n".join(lines) + f"\n    return v{len(lines) - 1}"
    return ints, "def forward(self, keep, ids, x):\n" + body


def _build(source):
    scope = {"torch": torch, "inf": float("inf")}
    exec(source, scope)  # noqa: S102 - test programs drawn above, nothing from outside
    module_type = type("Program", (nn.Module,), {"forward": scope["forward"]})
    return fx.symbolic_trace(module_type())


@settings(max_examples=200, deadline=None)
@given(_programs())
def test_never_minus_inf_is_never_wrong(program):
    """Whenever the predicate says a value holds no -inf, running the graph on the
    most hostile inputs (every bool pattern, the integer dtype's extremes, floats of
    -inf and the largest magnitudes) never gives one."""
    ints, source = program
    keep = torch.tensor([[[True, False, True, False]] * 4])
    extremes = [0, 1, -1] if ints == torch.bool else [0, 1, torch.iinfo(ints).min, torch.iinfo(ints).max]
    hostile = []
    for e in extremes:
        ids = torch.full((1, 4, 4), e).to(ints)
        for x in (torch.zeros(1, 4, 4), torch.full((1, 4, 4), float("-inf")), torch.full((1, 4, 4), -3e38)):
            hostile.append((keep, ids, x))
    try:
        gm = _build(source)
        facts = GraphFacts(gm, hostile[0])
        out = gm.graph.output_node().args[0]
        said = never_minus_inf(Value(out, facts))
        results = [gm(*args) for args in hostile]
    except (RuntimeError, TypeError):  # a drawn program torch refuses (dtype or shape rules)
        return
    if said:
        for args, r in zip(hostile, results):
            assert not (r.is_floating_point() and torch.isneginf(r).any()), (source, args)
