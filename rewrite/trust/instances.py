"""Random instances of rule patterns: the generators behind rule verification.

To verify a rule (``rewrite.trust.verify``) or test it (``rewrite.testing.rule_instances``)
we need many small graphs that its pattern matches. An instance is built by emitting
the pattern bottom-up into a fresh graph with the vocabulary's own emitters
(``opdef.emit["torch"]`` or ``["aten"]``, drawn), so it is a graph the engine meets
in practice: a symbolic_trace/dynamo spelling or a torch.export one.

Generator families (``FAMILIES``; an op names its family in its vocabulary entry,
``OpDef.instances``, with its input range and attribute values), draw what the pattern
leaves open so that shapes fit (a batch norm after a conv gets the conv's channel
count; a linear's weight matches its input), attribute values (strides, groups,
eps) and values (positive running variances). They also propose the values a rule's
constraints look for: the inverse of the permutation before, the same transpose
dims, the dtype a value had before a cast, a reshape to the same shape. Variables
in ``const(...)`` become module constants, other tensor variables graph inputs.
Ops outside the vocabulary (``aten.hardsigmoid``) whose attributes all have
defaults get one generic generator; vocabulary ops without a generator make the
rule unsupported (the verifier skips it and says why).

Dtypes: every instance draws one (``Plan.dtypes``): float32, float64, float16,
bfloat16, int64, int32, int16, int8, uint8 and bool, the where clause's hints first
(``dtype(x) == torch.T``) or narrowing the pool (``is_float``); approximate rules meet
half precision only where the where clause asks for it. An op that rejects the dtype
discards the instance, and the draw is retried with another one.

Small tensors get element-wise drawn values so hypothesis shrinks them to readable
numbers; exact rules also meet NaN, infinities and -0.0 (floats), and every rule but
quantized ones meets the integer dtype's extremes and values spread over its range
(``spread_integers``: 12 * 12 wraps in int8, 46341 * 46341 in int32), where
arithmetic wraps: integer outputs must be equal whatever the tolerance; exact rules'
floats also meet the dtype's largest finite values (``2 * x`` overflows) and its
smallest normal one. A quarter of the tensors of rank 2 and more, of every dtype, are
laid out column-major (the same values, not contiguous).

Degenerate shapes (``draw_instance(..., shapes=...)``; verification asks for them,
``instances`` does not): where an op takes them (its family says so: elementwise,
reductions, layout ops, casts, cat and stack), a tenth of the fresh shapes are 0-d
and a tenth have a dim of size 0 (``cat`` items too, and the 1-d empty tensor torch's
``cat`` skips); an instance drawn in mode ``"scalar"``, ``"empty"`` or ``"strided"``
gets mostly those (verification's leading instances; ``"strided"``: every tensor laid
out in reverse dim order). A call that divides an int32 or int64 minimum by -1
rounding toward zero, which traps the CPU in torch's kernel, is not run
(``trapping_division``).

Quantized patterns: ``dequantize(x)`` below another op is built after that op drew a
float value for it, which is then quantized with torch's observers (per-tensor affine
quint8 for activations, 7 bits without VNNI as the flow's observers do; per-channel
symmetric qint8 for constants, as ``quantize_weight``); ``quantize_per_tensor`` takes
its scale and zero point from a MinMaxObserver on its input (or the parameters of the
value it requantizes). Such instances also draw the quantized engine (x86, onednn).

Where-clause hints (``Plan``): ``produced_by(y, "conv", ...)``, ``dequantized(x)`` and
``has_qparams(x, s, z)`` compute the variable in the graph with one of those ops;
``output_quantized(c)`` quantizes the root; ``symmetric_pad``, ``same_shape``,
``rank(x) == N`` and ``dtype(w) != torch.T`` shape what is drawn. Shapes drawn apart
may coincide (``cat([to(a), to(b)])`` needs it).

Adding an op of a known shape: name its family in its table entry
(``instances=Instances("unary", input_range=(0.25, 4.0))``). A new shape: write
``@_family("name") def _name(ctx, a): ...`` returning the values of the parameters it
draws (``a.tensor``, ``a.optional``, ``a.lit`` keep what the pattern fixed; ``a.seed``
is the value a parent drew for this call, when it was deferred). Qualified ops outside
the vocabulary map to a family in ``OUTSIDE_VOCABULARY``.

Needs ``hypothesis`` (a test extra), imported on first use.
"""

from __future__ import annotations

import keyword
import math
import operator
from typing import Any, Callable, Iterator

import attrs
import torch
import torch.fx as fx

from rewrite.engine.compile import (DTYPES, CompiledRule, PCall, PDefault, PLit, PResults, PSeq, PVar, PWild, RConst,
                                    RModule, ROp, RResults, RSeq)
from rewrite.engine.replace import RULE_KEY
from rewrite.language import ast
from rewrite.ops.base import REQUIRED

__all__ = ["Instance", "FAMILIES", "OUTSIDE_VOCABULARY", "literal_strategy", "generator_for", "instances",
           "rule_tolerance", "Plan", "plan_for", "draw_instance",
           "hypothesis_api", "strategies", "spread_integers", "trapping_division"]

_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# uint16/32/64 are left out: most CPU kernels reject them (add, abs, relu, where,
# clamp raise in torch 2.13), so no captured model computes in them
_INTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
#: every dtype an instance may be drawn in: an op that rejects one discards the instance
_ALL = _FLOATS + _INTS + (torch.bool,)
_SPECIALS = (math.nan, math.inf, -math.inf, -0.0)
_DRAWN = 24  # values drawn one by one per tensor; the rest come from a seed


def spread_integers(dtype: torch.dtype) -> tuple:
    """Integers spread over ``dtype``'s whole range, for exact rules to meet beside
    the small values and the extremes: just above the square root of its largest
    value (where ``x * x`` wraps: 12..15 in int8, 182 in int16, 46341 in int32),
    the power of two whose square wraps to 0, 100, and a third and a half of the
    range (where ``3 * x`` and ``x + x`` wrap); negated too where the dtype is
    signed. Sorted by magnitude, so hypothesis shrinks to the smallest."""
    info = torch.iinfo(dtype)
    bits = info.bits - (1 if info.min < 0 else 0)  # value bits
    root = math.isqrt(info.max)
    mags = set(range(root + 1, root + 5)) | {2 ** ((bits + 1) // 2), 100, info.max // 3 + 1, info.max // 2 + 1}
    out: list = []
    for m in sorted(m for m in mags if 4 < m < info.max):
        out += [m, -m] if info.min < 0 else [m]
    return tuple(out)


def trapping_division(args: Any, kwargs: dict) -> None:
    """Raise RuntimeError for a call that divides the int32 or int64 minimum by -1
    rounding toward zero (``div(x, y, rounding_mode="trunc")``): torch's kernel
    traps there (SIGFPE kills the process) where it should wrap or raise. Instances
    and verification's runs call it before every call; the call is then an error,
    as it would be for an op that raises. Other calls pass."""
    if not isinstance(kwargs, dict) or kwargs.get("rounding_mode") != "trunc":
        return
    operands = [*list(args)[:2], *[kwargs[k] for k in ("input", "self", "other") if k in kwargs]]
    if len(operands) < 2:
        return
    num, den = operands[0], operands[1]
    if not isinstance(num, torch.Tensor) or num.dtype not in (torch.int32, torch.int64) or num.is_quantized:
        return
    minus_one = bool((den == -1).any()) if isinstance(den, torch.Tensor) else den == -1
    if minus_one and bool((num == torch.iinfo(num.dtype).min).any()):
        raise RuntimeError(f"{num.dtype} division of its minimum by -1 rounding toward zero traps the CPU")


def hypothesis_api() -> Any:
    """The ``hypothesis`` module, imported on first use (``ImportError`` with the
    install hint when it is missing)."""
    try:
        import hypothesis
        import hypothesis.strategies
    except ImportError as err:  # a test extra, not a runtime dependency
        raise ImportError("rule verification needs hypothesis: pip install hypothesis") from err
    return hypothesis


def strategies() -> Any:
    """``hypothesis.strategies``, imported on first use."""
    return hypothesis_api().strategies


def _plain(value: Any) -> Any:
    """``map_arg``'s result with plain lists and dicts for fx's immutable ones: a
    ``torch.library`` op's binding takes a ``Tensor[]`` argument as a list only (it
    refuses ``immutable_list``, which aten's own bindings take)."""
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@attrs.frozen
class Instance:
    """A random instance of a rule's pattern: a small graph and inputs for it.

    Attributes:
        graph_module: the pattern emitted as a standalone graph (inputs are the
            tensor variables that are not constants; constants are attributes).
        example_inputs: one value per placeholder.
        bindings: pattern variable -> concrete value (tensor or literal).
        dtype: the dtype drawn for fresh tensors.
        dialect: ``"torch"`` (symbolic_trace/dynamo spelling) or ``"aten"`` (export).
        engine: the quantized engine (``"x86"``, ``"onednn"``) the instance is
            rewritten and run with, for patterns with quantized ops; else None.
        wide: its float tensors were drawn up to large magnitudes
            (``draw_instance(wide=True)``): what it tests is that the rewrite makes
            no inf or NaN the original does not, not the tolerance, which large
            values amplify legitimately (a bfloat16 layer norm's rounding times a
            weight of 3e4).
        offset: its float tensors were drawn about a large value, not about zero
            (``draw_instance(offset=...)``): a rewrite must be about as accurate as
            the original there, where a formula that cancels (``E[x^2] - E[x]^2``
            for a variance) loses every digit.
    """

    rule: str
    graph_module: fx.GraphModule
    example_inputs: tuple
    bindings: dict
    dtype: torch.dtype
    dialect: str
    engine: str | None = None  # torch.backends.quantized.engine, for quantized patterns
    wide: bool = False  # floats drawn up to large magnitudes (``_Ctx``): only a new inf or NaN fails
    offset: bool = False  # floats drawn about a large value (``_Ctx``): judged against float64


# ================================================================ rule analysis


def rule_tolerance(rule: CompiledRule) -> str:
    """``"exact"`` or ``"approx"``: the rule's ``tolerance`` option, else approx for
    rules whose replacement computes rewrite-time constants (folds), else exact."""
    option = rule.rule.option("tolerance")
    if option in ("exact", "approx"):
        return option
    return "approx" if _has_constant(rule.replacement) else "exact"


# _has_constant, _conjuncts, _pattern_ops and _leaves walk with an explicit stack
# (children pushed last-first, so visited in source order), not by recursion: they
# never meet Python's recursion limit, however deeply a rule nests.


def _has_constant(r: Any) -> bool:
    todo = [r]
    while todo:
        r = todo.pop()
        if isinstance(r, RConst):
            return True
        if isinstance(r, ROp):
            todo += r.args.values()
        elif isinstance(r, RModule):
            todo += r.inputs
        elif isinstance(r, RSeq):
            todo += r.items
    return False


def _conjuncts(e: Any) -> list:
    """The top-level ``and`` operands of a where clause, nested ``and`` flattened."""
    out, todo = [], [e]
    while todo:
        e = todo.pop()
        if isinstance(e, ast.BoolOp) and e.op == "and":
            todo += reversed(e.items)
        elif e is not None:
            out.append(e)
    return out


@attrs.frozen
class Plan:
    """What the where clause says about how to build instances, read from its
    top-level conjuncts: constants, parameters, a dtype to favour."""

    rule: CompiledRule
    tolerance: str
    consts: frozenset
    params: frozenset
    dtypes: tuple
    unsupported: str | None
    favoured: tuple = ()
    #: variable -> ops that should compute it in the graph (``produced_by(y, "conv")``,
    #: ``dequantized(x)``, ``has_qparams(x, s, z)``) rather than a graph input
    producers: Any = attrs.field(factory=dict)
    #: variables whose every user should quantize them (``output_quantized(c)``)
    quantized_outputs: frozenset = frozenset()
    #: pad variables asked to be symmetric (``symmetric_pad(x, p)``)
    symmetric_pads: frozenset = frozenset()
    #: the pattern has quantized ops: instances also draw the quantized engine
    quantized: bool = False
    #: variables the where clause wants of one shape (``same_shape(x, y)``)
    same_shapes: frozenset = frozenset()
    #: variable -> the rank ``rank(x) == N`` asks for (convolutions read it)
    ranks: Any = attrs.field(factory=dict)
    #: variable -> a dtype ``dtype(w) != torch.T`` rules out for it (a float32 weight
    #: of a layer norm on float16 activations)
    avoided: Any = attrs.field(factory=dict)
    #: variables the where clause wants a Python number (``is_number(s)``,
    #: ``positive_number(s)``), and those of them it wants positive
    numbers: frozenset = frozenset()
    positives: frozenset = frozenset()
    #: variables the where clause wants to broadcast into the other operand without
    #: growing it (``additive_mask(m, scores)``, ``broadcasts_to(x, y)``'s y)
    fitting: frozenset = frozenset()
    #: variables the where clause wants a vector of the last dim (``norm_weight(w, x)``)
    features: frozenset = frozenset()
    #: variable -> the variables ``same_shape``/``shapes_equal`` pair it with (a reshape
    #: back to the shape of a value bound before: ``same_shape(r, l)``)
    partners: Any = attrs.field(factory=dict)
    #: dim variables the where clause wants to be the last dim (``last_dim(x, d)``):
    #: drawn as one of its spellings, not one dim in the rank's
    last_dims: frozenset = frozenset()
    #: variables the where clause asks to be rule-made (``rule_made(u)``): what made a
    #: node never changes its value, so each instance's node is marked as a rule's
    rule_made: frozenset = frozenset()
    #: the int literals the pattern is written with (``slice(x, 1, 0, 512)``,
    #: ``flatten(x, 1, 4)``): large shapes reach one past them (``_Ctx.shape``)
    literal_ints: tuple = ()
    #: variable -> numbers about the bound a comparison puts on it (``value(e) < 1e-4``:
    #: a layer norm's eps is drawn about 1e-4 too, not only from its table's short list,
    #: which the clause may narrow to the one value the replacement writes back)
    bounds: Any = attrs.field(factory=dict)


# where-clause predicates that want a number literal (the positive ones too), and
# those that want their first (broadcasts_to: second) operand to fit the other's shape
_NUMBERS = {"is_number", "is_finite_number", "is_literal", "positive_number", "positive_scalar"}
_POSITIVE = {"positive_number", "positive_scalar"}
_FITTING = {"additive_mask": 0, "additive_bias": 0, "broadcasts_to": 1}
# where-clause predicates that say which op computes a variable
_PRODUCED = {"dequantized": ("dequantize",), "has_qparams": ("quantize_per_tensor",)}
_QUANT_OPS = {"quantize_per_tensor", "dequantize", "torch.fake_quantize_per_tensor_affine",
              "aten.fake_quantize_per_tensor_affine"}


def plan_for(rule: CompiledRule) -> Plan:
    """How to build instances of ``rule``: ``const``/``is_param``/``is_buffer``
    variables become module constants; ``dtype(v) == torch.T`` puts T first among the
    dtypes drawn (hypothesis shrinks toward it, and draws it at least half the time);
    ``is_float`` and ``activation`` keep integers and bool out; ``same_shape`` and
    ``shapes_equal`` make binary operands of one shape; ``produced_by``,
    ``dequantized`` and ``has_qparams`` compute a variable with the op they name;
    ``output_quantized`` quantizes the root; ``symmetric_pad`` draws symmetric pads;
    ``positive_number``/``is_number`` make a binary operand a (positive) number and
    ``additive_mask``/``additive_bias``/``broadcasts_to`` one that fits the other,
    ``norm_weight(w, x)`` a vector of the other's last dim, ``last_dim(x, d)`` a
    reduction's or softmax's ``d`` one of the last dim's spellings.
    Otherwise every dtype is drawn: float32, float64, bfloat16, float16, int64, int32,
    int16, int8, uint8 and bool for exact rules, all but float16 and bfloat16 for approximate
    ones unless favoured (an op that rejects the dtype discards the instance).
    Patterns with quantized ops favour float32."""
    consts, params, favoured, floats_only = set(), set(), [], False
    producers: dict = {}
    quantized_outputs, symmetric_pads, ranks, avoided = set(), set(), {}, {}
    numbers, positives, fitting, features, partners, last_dims = set(), set(), set(), set(), {}, set()
    made: set = set()
    bounds: dict = {}
    for c in _conjuncts(rule.where):
        if isinstance(c, ast.Call):
            name = c.op.names[0]
            vars_ = {a.name for a in c.args if isinstance(a, ast.Var)}
            if name in ("const", "is_param", "is_buffer", "never_minus_inf"):
                # never_minus_inf: a graph input may hold anything; a constant is read
                consts |= vars_
            if name == "is_param":
                params |= vars_
            if name in ("is_float", "activation"):
                floats_only = True
            if name in ("same_shape", "shapes_equal"):
                for v in vars_:
                    partners.setdefault(v, set()).update(vars_ - {v})
            first = c.args[0].name if c.args and isinstance(c.args[0], ast.Var) else None
            if first is not None and name in _NUMBERS:
                numbers.add(first)
                if name in _POSITIVE:
                    positives.add(first)
            if first is not None and name == "norm_weight":
                features.add(first)
            if name == "rule_made":
                made |= vars_
            if name == "last_dim" and len(c.args) == 2 and isinstance(c.args[1], ast.Var):
                last_dims.add(c.args[1].name)
            at = _FITTING.get(name)
            if at is not None and len(c.args) > at and isinstance(c.args[at], ast.Var):
                fitting.add(c.args[at].name)
            if first is not None and name == "produced_by":
                ops_ = tuple(a.value for a in c.args[1:] if isinstance(a, ast.Literal) and isinstance(a.value, str))
                producers[first] = ops_
            elif first is not None and name in _PRODUCED:
                producers[first] = _PRODUCED[name]
            elif first is not None and name == "output_quantized":
                quantized_outputs.add(first)
            elif name == "symmetric_pad" and len(c.args) == 2 and isinstance(c.args[1], ast.Var):
                symmetric_pads.add(c.args[1].name)
        if isinstance(c, ast.Compare) and c.op == "!=":
            for a, b in ((c.left, c.right), (c.right, c.left)):
                if (isinstance(a, ast.Call) and a.op.names[0] == "dtype" and a.args
                        and isinstance(a.args[0], ast.Var) and isinstance(b, ast.DTypeLit)):
                    avoided[a.args[0].name] = DTYPES[b.name]
        elif isinstance(c, ast.Compare) and c.op == "==":
            for a, b in ((c.left, c.right), (c.right, c.left)):
                if isinstance(a, ast.Call) and a.op.names[0] == "dtype" and isinstance(b, ast.DTypeLit):
                    favoured.append(DTYPES[b.name])
                if (isinstance(a, ast.Call) and a.op.names[0] == "rank" and a.args and isinstance(a.args[0], ast.Var)
                        and isinstance(b, ast.Literal) and isinstance(b.value, int)):
                    ranks[a.args[0].name] = b.value
    for c in _comparisons(rule.where):  # anywhere: under or, not, in
        _add_bounds(c, bounds)
    tolerance = rule_tolerance(rule)
    ops = _pattern_ops(rule.pattern)
    missing = sorted({name for name, gen in ops if gen is None})
    unsupported = f"no instance generator for op {', '.join(repr(m) for m in missing)}" if missing else None
    pinned = _pinned_attributes(rule.pattern)
    if unsupported is None and pinned:
        unsupported = (f"verify cannot draw other values of attribute {pinned[1]!r} of op {pinned[0]!r} than its "
                       f"default ({pinned[2]!r}), and the rule claims them all: unverified (a value written as a "
                       "literal in the pattern is verified)")
    quantized = any(name in _QUANT_OPS for name, _ in ops) or any(
        o in ("dequantize", "quantize_per_tensor") for v in producers.values() for o in v)
    if quantized and not favoured:
        favoured.append(torch.float32)  # quantized tensors are quantized from float32
    dtypes = list(favoured)
    pool = _FLOATS if floats_only else _ALL
    if tolerance == "approx":
        # half precision only where the where clause asks for it: an approximate
        # rule is held to a tolerance relative to its output, which a fold rounded
        # to float16 exceeds wherever its terms cancel (conv + batch norm, 9 ulps)
        pool = tuple(d for d in pool if d not in (torch.float16, torch.bfloat16))
    dtypes += [d for d in pool if d not in dtypes]
    return Plan(rule, tolerance, frozenset(consts), frozenset(params), tuple(dtypes), unsupported,
                tuple(dict.fromkeys(favoured)), producers, frozenset(quantized_outputs),
                frozenset(symmetric_pads), quantized, frozenset(partners), ranks, avoided,
                frozenset(numbers), frozenset(positives), frozenset(fitting), frozenset(features),
                {v: frozenset(o) for v, o in partners.items()}, frozenset(last_dims), frozenset(made),
                _literal_ints(rule.pattern), {v: tuple(sorted(n)) for v, n in bounds.items()})


def _comparisons(e: Any) -> Iterator[ast.Compare]:
    """Every comparison in a where clause, at any depth (``or``, ``not``, calls)."""
    todo = [e]
    while todo:
        e = todo.pop()
        if isinstance(e, ast.Compare):
            yield e
            todo += [e.left, e.right]
        elif isinstance(e, ast.BoolOp):
            todo += e.items
        elif isinstance(e, ast.Not):
            todo.append(e.expr)
        elif isinstance(e, ast.Call):
            todo += [*e.args, *(k.value for k in e.kwargs)]


def _add_bounds(c: ast.Compare, bounds: dict) -> None:
    """``v < 1e-4``, ``value(v) >= 2``, ``3 != v``, ``abs(value(v)) > 1``, ``v in (1.0,
    1.5)``...: numbers about each bound, on both sides of it (and their negatives
    under ``abs``), for ``v`` (``Plan.bounds``)."""
    for a, b in ((c.left, c.right), (c.right, c.left)):
        signs = (1,)
        if isinstance(a, ast.Call) and a.op.names[0] == "abs" and len(a.args) == 1:
            a, signs = a.args[0], (1, -1)
        if isinstance(a, ast.Call) and a.op.names[0] == "value" and len(a.args) == 1:
            a = a.args[0]
        if not isinstance(a, ast.Var):
            continue
        items = b.items if c.op in ("in", "not in") and isinstance(b, (ast.TupleLit, ast.ListLit)) else (b,)
        for item in items:
            n = item.value if isinstance(item, ast.Literal) else None
            if not isinstance(n, (int, float)) or isinstance(n, bool) or not math.isfinite(n):
                continue
            # (just inside an open interval too: 0.5 < s < 2 meets 0.55 and 1.8, not only 1)
            near = (n - 1, n, n + 1) if isinstance(n, int) else (
                n, n * 0.9, n * 1.1, n / 2, n * 2, n / 1000, n * 1000, 0.0)
            bounds.setdefault(a.name, set()).update(sign * v for v in near for sign in signs)


def _literal_ints(pattern: Any) -> tuple:
    """The ints a pattern's calls are written with, in lists too, sorted."""
    found: set = set()

    def add(value: Any) -> None:
        if isinstance(value, (list, tuple)):
            for v in value:
                add(v)
        elif isinstance(value, int) and not isinstance(value, bool):
            found.add(abs(value))

    for call in _pattern_calls(pattern):
        for alt in call.alts:
            for _, sub in alt.args:
                if isinstance(sub, PLit):
                    add(sub.value)
                elif isinstance(sub, PSeq):
                    add([i.value for i in sub.items if isinstance(i, PLit)])
    return tuple(sorted(found))


def _pattern_calls(p: Any) -> Iterator[PCall]:
    """Every call of a pattern, arguments included (``as (a, b)`` ones too)."""
    todo = [p]
    while todo:
        p = todo.pop()
        if isinstance(p, PCall):
            yield p
            todo += reversed([sub for alt in p.alts for _, sub in alt.args])
        elif isinstance(p, PSeq):
            todo += reversed(p.items)
        elif isinstance(p, PResults):
            todo.append(p.call)


def _pattern_ops(p: Any) -> list:
    """(op name, generator or None) of every call in the pattern; a call is covered
    when at least one of its alternatives has a generator."""
    out = []
    for call in _pattern_calls(p):
        gens = [(alt.opdef.name, generator_for(alt.opdef)) for alt in call.alts]
        out += gens if not any(g for _, g in gens) else [(n, g) for n, g in gens if g is not None]
    return out


def _pinned_attributes(p: Any) -> tuple | None:
    """(op, attribute, default) of the first attribute a pattern leaves free (a
    variable, ``_``, or a trailing ``...``) on an op only the generic generator
    draws, of a type it cannot vary (a string, a None default): every instance
    would hold the default, and a rule right for it alone would verify."""
    for call in _pattern_calls(p):
        for alt in call.alts:
            if not getattr(generator_for(alt.opdef), "generic", False):
                continue
            written = dict(alt.args)
            for q in alt.opdef.params:
                sub = written.get(q.name)
                if (sub is None or isinstance(sub, (PVar, PWild))) and not q.tensor \
                        and q.default is not REQUIRED and not _other_values(q.default):
                    return alt.opdef.name, q.name, q.default
    return None


# ================================================================ generators


class _Discard(Exception):
    """The drawn instance is not a valid program (shapes that do not fit)."""


_FREE: Any = type("_Free", (), {"__repr__": lambda self: "FREE"})()


class _Ctx:
    """Hypothesis draws with names that read like the shapes they make."""

    def __init__(self, draw: Callable, dtype: torch.dtype, specials: bool, int_specials: bool | None = None,
                 shapes: str | None = None, wide: float = 0.0, offset: float = 0.0, literals: tuple = ()) -> None:
        """``specials``: floats meet NaN, infinities, -0.0 and their largest finite
        values (exact rules); ``int_specials`` (default: ``specials``): integers meet
        their dtype's extremes and values whose arithmetic wraps (every rule: integer
        outputs must be equal whatever the tolerance); ``shapes``: None (ordinary
        shapes only), ``"mixed"`` (a tenth of the fresh shapes 0-d, a tenth with an
        empty dim, where the op takes them), ``"scalar"`` / ``"empty"`` (most of them
        so; see ``shape``), or ``"strided"`` (ranks and dims from 2, every tensor laid
        out in reverse dim order); ``wide`` (a magnitude, ``rewrite.trust.verify.WIDE_DRAWS``): each
        float tensor over an unbounded domain is drawn over its range times it (at
        most a quarter of its dtype's largest value), where a narrower float or an
        exponential overflows; ``offset`` (``rewrite.trust.verify.OFFSET_DRAWS``): each
        such tensor is drawn about this value instead of about zero (its spread
        unchanged), where a formula that subtracts large values cancels."""
        self.draw, self.dtype, self.specials, self.wide, self.offset = draw, dtype, specials, wide, offset
        self.int_specials = specials if int_specials is None else int_specials
        self.mode, self.forced = shapes, False
        self.shapes: list = []  # shapes drawn so far: operands drawn apart may share one
        # one past the pattern's int literals (``literals``): a large dim (slice(x, 1, 0,
        # 512) => x is wrong from 513) and a large rank (flatten(x, 1, 4) => flatten(x, 1)
        # from 6)
        self.past_literals = tuple(n + 1 for n in literals if max(_PAST_POWERS) < n + 1 <= _LARGEST_LITERAL_DIM)
        self.large_rank = max([5] + [n + 2 for n in literals if n + 2 <= _LARGEST_LITERAL_RANK])

    def int(self, lo: int, hi: int) -> int:
        return self.draw(strategies().integers(lo, hi))

    def pick(self, values: Any) -> Any:
        values = list(values)
        return values[0] if len(values) == 1 else self.draw(strategies().sampled_from(values))

    def coin(self) -> bool:
        return self.draw(strategies().booleans())

    def shape(self, lo: int = 1, hi: int = 4, dim_hi: int = 4, scalar: bool = False, empty: bool = False) -> tuple:
        """A fresh shape, or (half the time) one drawn before that fits: the items of
        ``cat([to(a, f32), to(b, f32)])`` or the operands of ``add(to(a), to(b))``
        are drawn apart and must fit together.

        Where the op takes them and the instance draws them (``shapes``), degenerate
        shapes too: ``scalar`` (the op takes a 0-d tensor: rank 0 although ``lo`` is
        1) and ``empty`` (it takes a dim of size 0: one dim is 0). Each is drawn a
        tenth of the time (``"mixed"``; shrinking goes to the ordinary shape), and
        in that mode (``"scalar"`` or ``"empty"``: verification's leading instances)
        the first time, three times in four after. In mode ``"strided"`` ranks and
        dims start at 2 (a tensor that can be laid out otherwise)."""
        scalar = scalar or lo == 0
        if self.mode == "strided" and hi >= 2:
            lo, scalar = max(lo, 2), False
        long = self.mode == "long" and (hi, dim_hi) == (4, 4)
        if (hi, dim_hi) == (4, 4) and self._large():
            hi, dim_hi = self.large_rank, 8
        elif long:
            hi, dim_hi = 3, max(_PAST_POWERS)
        fits = [s for s in dict.fromkeys(self.shapes)
                if (lo <= len(s) or (scalar and not s)) and len(s) <= hi and all(d <= dim_hi for d in s)
                and (empty or 0 not in s)]
        if fits and self.coin():
            return self.pick(fits)
        if long and lo <= 3:  # every dim just past a power of two (rank up to 3, at most _LONG_ELEMENTS)
            rank = self.int(max(lo, 1), 3)
            if self.past_literals:  # one past the pattern's literal, on the last dims it fits in
                dims = [self.pick(self.past_literals)] * rank
                for j in range(rank - 1):
                    if math.prod(dims) > _LITERAL_ELEMENTS:
                        dims[j] = 2
            else:
                dims = [self.pick(_PAST_POWERS[1:3]) for _ in range(rank)]
                while math.prod(dims) > _LONG_ELEMENTS:
                    dims[dims.index(max(dims))] = _PAST_POWERS[1]
            self.shapes.append(tuple(dims))
            return tuple(dims)
        kind = self.degenerate(scalar=scalar, empty=empty)
        if kind == "scalar":
            shape: tuple = ()
        else:
            least = 2 if self.mode == "strided" and dim_hi >= 2 else 1
            shape = tuple(self.int(least, dim_hi if dim_hi <= 4 else 4) for _ in range(self.int(max(lo, 1) if kind
                                                                                              else lo, hi)))
            if dim_hi > 4 and shape:  # a large shape: one dim past 4 (the rest small, to stay cheap)
                i = self.int(0, len(shape) - 1)
                # past 8 half the time: just past a power of two (a slice's literal end, a
                # block size), where a rule right for the dims it usually meets is not
                if self.past_literals and self.coin():
                    size = self.pick(self.past_literals)
                else:
                    size = self.int(5, dim_hi) if self.coin() else self.pick(_PAST_POWERS)
                if size * 4 ** (len(shape) - 1) > _LONG_ELEMENTS:  # the other dims small, to stay cheap
                    shape = tuple(min(d, 2) for d in shape)
                shape = shape[:i] + (size,) + shape[i + 1:]
            if kind == "empty":
                i = self.int(0, len(shape) - 1)
                shape = shape[:i] + (0,) + shape[i + 1:]
        self.shapes.append(shape)
        return shape

    def _large(self) -> bool:
        """Draw a large shape (rank up to 5, one dim from 5 to 8 or just past a power of
        two up to 129: ``_PAST_POWERS``) for an op that takes
        any: always in mode ``"large"`` (a verification's leading instance), a tenth
        of the time in ``"mixed"``. A rule right only up to rank 4 or a dim of 4
        (``flatten(x, 1, 3) => flatten(x, 1)``, ``mean(x, -1) where shape(x)[-1] >= 4
        => sum(x, -1) * 0.25``) meets a shape it is wrong on."""
        if self.mode == "large":
            return True
        return self.mode == "mixed" and self.int(0, 9) == 9  # (9: shrinking goes to 0, an ordinary shape)

    def degenerate(self, scalar: bool = False, empty: bool = False) -> str | None:
        """``"scalar"``, ``"empty"`` or None (an ordinary shape), among the kinds the
        op takes: a tenth of the time each (``"mixed"``); in the instance's mode the
        first time, then three times in four. Draws nothing when the op takes
        neither, or the instance draws ordinary (or strided) shapes only."""
        kinds = [k for k, ok in (("scalar", scalar), ("empty", empty)) if ok]
        if not kinds or self.mode in (None, "strided"):
            return None
        if self.mode in kinds:  # the first such shape always, later ones three times in four
            first, self.forced = not self.forced, True
            return self.mode if first or self.int(0, 3) < 3 else None
        k = self.int(0, 9)
        if k == 8 and "scalar" in kinds:
            return "scalar"
        if k == 9 and "empty" in kinds:
            return "empty"
        return None

    def tensor(self, shape: tuple, lo: float = -4.0, hi: float = 4.0, dtype: Any = None) -> torch.Tensor:
        """The first ``_DRAWN`` values drawn one by one (they shrink to readable
        numbers), the rest from a drawn seed. A larger tensor always costs more
        draws than a smaller one, so hypothesis shrinks shapes too.

        Integers are drawn in ``[lo, hi]`` within the dtype's range (every rule's
        instances but quantized ones also meet its extremes and values spread over
        the whole range, ``spread_integers``, where arithmetic wraps), bool as
        True/False, floats in ``[lo, hi]`` (exact rules also meet NaN, infinities
        and -0.0)."""
        st = strategies()
        dtype = dtype or self.dtype
        n = math.prod(shape)
        k = min(n, _DRAWN)
        if dtype == torch.bool:
            head = torch.tensor(self.draw(st.lists(st.booleans(), min_size=k, max_size=k)), dtype=torch.bool)
            tail = (lambda g, m: torch.rand(m, generator=g) < 0.5)
        elif not dtype.is_floating_point:
            info = torch.iinfo(dtype)
            ilo, ihi = max(math.ceil(lo), info.min), min(math.floor(hi), info.max)
            ilo = min(ilo, ihi)
            element = st.integers(ilo, ihi)
            spread = spread_integers(dtype)
            if self.int_specials and lo < 0 and spread:
                # a quarter of the values spread over the range (products and sums
                # of them wrap); three quarters stay small (shapes, indices, counts),
                # and shrinking goes to the small ones
                small, wide = element, st.sampled_from(spread)
                element = st.integers(0, 3).flatmap(lambda k: wide if k == 3 else small)
            if self.int_specials and lo < 0 and self.draw(st.booleans()):
                element = element | st.sampled_from([info.min, info.max])
            head = torch.tensor(self.draw(st.lists(element, min_size=k, max_size=k)), dtype=dtype)
            tail = (lambda g, m: torch.randint(ilo, ihi + 1, (m,), generator=g, dtype=dtype))
        else:
            if self.wide and hi >= 4.0:  # an unbounded domain (not acos's, a probability's)
                scale = min(self.wide, torch.finfo(dtype).max / 4 / hi)
                lo, hi = (lo * scale if lo < 0 else lo), hi * scale
            element = st.floats(lo, hi, width=32)
            if self.specials and lo < 0 and self.draw(st.booleans()):
                info = torch.finfo(dtype)  # and the largest finite values (2 * x overflows), the smallest normal
                # and an odd multiple of the smallest subnormal (halving it rounds)
                element = element | st.sampled_from(_SPECIALS + (info.max, -info.max, info.tiny,
                                                                 3 * info.tiny * info.eps))
            shift = self.offset if hi >= 4.0 else 0.0
            head = torch.tensor(self.draw(st.lists(element, min_size=k, max_size=k)), dtype=torch.float64)
            tail = (lambda g, m: torch.rand(m, generator=g, dtype=torch.float64) * (hi - lo) + lo)
            if shift:  # (only then: -0.0 + 0.0 is 0.0, and -0.0 is a special drawn on purpose)
                head, tail = head + shift, (lambda g, m, plain=tail: plain(g, m) + shift)
        if n > k:
            g = torch.Generator().manual_seed(self.int(0, 2**31 - 1))
            head = torch.cat([head, tail(g, n - k).to(head.dtype)])
        out = head.reshape(shape).to(dtype)
        if self.mode == "strided" and n > 1:
            # dims laid out in reverse order: the same values, not contiguous (but
            # dense: clone keeps the layout, as it does not a slice's)
            order = tuple(reversed(range(len(shape))))
            return out.permute(order).contiguous().permute(order)
        if len(shape) >= 2 and n > 1 and self.draw(st.integers(0, 3)) == 0:
            # a quarter of them laid out column-major (same values, not contiguous),
            # whatever the dtype: a rule that needs a contiguous input
            # (``reshape => view``) meets one
            out = out.transpose(-1, -2).contiguous().transpose(-1, -2)
        return out


class _Args:
    """One call's arguments while its generator runs: given values (bound by the
    pattern, nested calls, literals) and ``_FREE`` ones the generator draws."""

    def __init__(self, ctx: _Ctx, op: str, given: dict, producers: dict, seed: Any = None,
                 variables: dict | None = None, plan: Plan | None = None, spec: Any = None,
                 output: str | None = None, partner_shapes: list | None = None) -> None:
        self.ctx, self.op, self.given, self.producers = ctx, op, given, producers
        # the op's domain, from its vocabulary entry (sqrt: positive)
        self.input_range = spec.input_range if spec is not None else (-4.0, 4.0)
        # the value a parent drew for this call's output (see _Builder.call: deferred)
        self.seed = seed
        self.variables, self.plan = variables or {}, plan
        self.output = output  # the variable the call's result binds (``... as f``)
        self.partner_shapes = partner_shapes or []  # shapes of values bound before that it must equal
        # fresh operands take the dtype of the floating tensors already there (a batch
        # norm after a cast to float32 gets float32 statistics)
        self.dtype = next((v.dtype for v in _leaves(given.values())
                           if isinstance(v, torch.Tensor) and v.dtype.is_floating_point), ctx.dtype)

    def fresh(self, shape: tuple, lo: float = -4.0, hi: float = 4.0) -> torch.Tensor:
        return self.ctx.tensor(tuple(shape), lo, hi, dtype=self.dtype)

    def get(self, name: str) -> Any:
        return self.given.get(name, _FREE)

    def free(self, name: str) -> bool:
        return self.get(name) is _FREE

    def tensor(self, name: str, shape: Any, lo: float = -4.0, hi: float = 4.0) -> Any:
        v = self.get(name)
        if v is not _FREE:
            return v
        shape = shape() if callable(shape) else tuple(shape)
        avoid = self.plan.avoided.get(self.variables.get(name)) if self.plan is not None else None
        if avoid is not None and avoid == self.dtype:  # dtype(w) != torch.float16
            other = torch.float64 if avoid == torch.float32 else torch.float32
            return self.ctx.tensor(tuple(shape), lo, hi, dtype=other)
        return self.fresh(shape, lo, hi)

    def optional(self, name: str, shape: Any) -> Any:
        """A tensor or None (an absent bias, an affine-free norm)."""
        if self.free(name) and self.ctx.coin():
            return None
        return self.tensor(name, shape)

    def lit(self, name: str, choose: Any) -> Any:
        v = self.get(name)
        if v is not _FREE:
            return v
        return choose() if callable(choose) else self.ctx.draw(choose)

    def is_const(self, name: str) -> bool:
        """The parameter is a pattern variable the where clause makes a constant."""
        var = self.variables.get(name)
        return self.plan is not None and var is not None and var in self.plan.consts

    def hinted(self, name: str, hints: frozenset) -> bool:
        var = self.variables.get(name)
        return var is not None and var in hints

    def producer(self, name: str) -> tuple:
        """(op name, its arguments) that computed a given tensor, or (None, {})."""
        v = self.get(name)
        return self.producers.get(id(v), (None, {}))


def _tensors(out: Any) -> bool:
    """A tensor, or the tuple of tensors of a multi-output op (split, max, topk)."""
    if isinstance(out, (list, tuple)):
        return bool(out) and all(isinstance(t, torch.Tensor) for t in out)
    return isinstance(out, torch.Tensor)


def _leaves(values: Any) -> list:
    """The non-sequence values in nested lists and tuples, in order."""
    out, todo = [], list(values)[::-1]
    while todo:
        v = todo.pop()
        if isinstance(v, (list, tuple)):
            todo += reversed(v)
        else:
            out.append(v)
    return out


def _shape(v: Any) -> tuple | None:
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _rank(v: Any) -> int:
    s = _shape(v)
    if s is None:
        raise _Discard("expected a tensor")
    return len(s)


#: generator family -> function(ctx, args) -> {param: value}. An op names its family
#: in its vocabulary entry (``OpDef.instances``); see ``rewrite.ops.base.Instances``.
FAMILIES: dict = {}
#: qualified ops outside the vocabulary (no table entry to carry a family) -> family
OUTSIDE_VOCABULARY = {
    "aten.slice": "slice", "F.pad": "pad", "aten.pad": "pad", "aten.constant_pad_nd": "pad",
    "torch.constant_pad_nd": "pad", "torch.addbmm": "addbmm", "aten.addbmm": "addbmm",
    "torch.fake_quantize_per_tensor_affine": "fake_quantize",
    "aten.fake_quantize_per_tensor_affine": "fake_quantize",
    "aten.native_layer_norm": "layer_norm",  # as (y, mean, rstd): layer_norm's arguments
}


def _family(name: str) -> Callable:
    def deco(fn: Callable) -> Callable:
        FAMILIES[name] = fn
        return fn
    return deco


def literal_strategy(spec: Any, param: str) -> Any:
    """The hypothesis strategy for an attribute literal of an op, from the values its
    vocabulary entry lists (``Instances.literals``); None when it lists none."""
    if spec is None:
        return None
    for name, values in spec.literals:
        if name == param:
            st = strategies()
            return st.booleans() if values is bool else st.sampled_from(list(values))
    return None


@_family("unary")
def _unary(ctx: _Ctx, a: _Args) -> dict:
    """Values in the op's domain, and sometimes outside it: ``exp(log(x)) => x`` must
    meet the negative ``x`` it turns from NaN into a number."""
    lo, hi = a.input_range if not ctx.coin() else (-4.0, 4.0)
    return {"input": a.tensor("input", lambda: ctx.shape(scalar=True, empty=True), lo=lo, hi=hi)}


#: a large shape's large dim, half the time: just past a power of two, where a rule
#: with a literal size (``slice(x, 1, 0, 16) => x``) meets a dim it is wrong on
_PAST_POWERS = (17, 33, 65, 129)
#: the largest dim and rank a pattern's literal sends large shapes to (one past it)
_LARGEST_LITERAL_DIM = 8193
_LITERAL_ELEMENTS = 2**20  # the most elements a long shape one past a literal holds
_LARGEST_LITERAL_RANK = 8
#: the most elements a ``"long"`` shape (every dim just past a power of two) holds
_LONG_ELEMENTS = 40_000


def _numbers(dtype: torch.dtype, positive: bool = False) -> list:
    """The Python numbers a binary operand is drawn from (``positive_number``: > 0):
    of the other kind too (an int for a float tensor, a float for an integer one,
    ``idx * 0.5``: type promotion makes the result float)."""
    if dtype.is_floating_point:
        return [2.0, 0.5, 0.125, 3] if positive else [2.0, 0.5, -1.0, 3]
    return [2, 3, 0.5] if positive else [2, -1, 3, 0.5]


def _operand_like(ctx: _Ctx, a: _Args, shape: tuple, name: str) -> Any:
    """A tensor of the same shape, of a broadcasting suffix of it, 0-dim, one the first
    operand broadcasts to (a leading dim more: the result is larger than it), one of
    the same rank with size-1 dims (a keepdim reduction's), one each broadcasts to the
    other along (an outer product's), or a Python number. What the where clause asks of the variable ``name`` binds comes
    first: a number (``positive_number(s)``: a positive one) or a tensor that fits
    the other operand (``additive_mask(m, scores)``: the same shape or a suffix)."""
    plan = a.plan
    if plan is not None and a.hinted(name, plan.numbers):
        return ctx.pick(_numbers(a.dtype, positive=a.hinted(name, plan.positives)))
    if plan is not None and a.hinted(name, plan.features) and shape:
        return a.fresh(shape[-1:])  # norm_weight(w, x): a per-feature weight
    fitting = plan is not None and a.hinted(name, plan.fitting)
    kinds = ["same", "suffix"] if fitting else ["same", "suffix", "0-dim", "number", "wider"]
    if shape and not fitting:
        kinds += ["keepdim", "outer"]
    kind = ctx.pick(kinds)
    if kind == "number":
        return ctx.pick(_numbers(a.dtype))
    if kind == "wider":
        return a.fresh((ctx.int(2, 3), *shape))
    if kind == "keepdim":  # x - x.mean(-1, keepdim=True): size-1 dims broadcast, the last one at least
        return a.fresh((*(1 if ctx.coin() else d for d in shape[:-1]), 1))
    if kind == "outer":  # x[:, None] * y[None, :]: each operand broadcasts along the other's size-1 dims
        return a.fresh(tuple(ctx.int(2, 3) if d == 1 else (1 if ctx.coin() else d) for d in shape))
    return a.fresh({"same": shape, "suffix": shape[1:], "0-dim": ()}[kind])


@_family("binary")
def _binary(ctx: _Ctx, a: _Args) -> dict:
    first, second = ("input", "exponent") if a.op == "pow" else ("input", "other")
    x, y = a.get(first), a.get(second)
    if x is _FREE and _shape(y) is not None:
        x = _operand_like(ctx, a, _shape(y), first)  # `2 - x` is sub(2, x)
    elif x is _FREE:
        x = a.fresh(ctx.shape(scalar=True, empty=True))
    if y is _FREE:
        shape = _shape(x)
        same = a.plan is not None and (a.hinted(first, a.plan.same_shapes) or a.hinted(second, a.plan.same_shapes))
        if shape is not None and same:
            y = a.fresh(shape)  # same_shape(x, y)
        else:
            y = (_operand_like(ctx, a, shape, second) if shape is not None
                 else a.fresh(ctx.shape(scalar=True, empty=True)))
    return {first: x, second: y}


# ---------------------------------------------------------------- layout


def _permutation(ctx: _Ctx, a: _Args, rank: int) -> tuple:
    """The identity, the inverse of the permutation before (if any), or a random one."""
    kind, prev = a.producer("input")
    options = ["identity", "random"]
    if kind == "permute" and isinstance(prev.get("dims"), (list, tuple)) and len(prev["dims"]) == rank:
        options.insert(0, "inverse")
    choice = ctx.pick(options)
    if choice == "identity":
        return tuple(range(rank))
    if choice == "inverse":
        inv = [0] * rank
        for i, d in enumerate(prev["dims"]):
            inv[d % rank] = i
        return tuple(inv)
    return tuple(ctx.draw(strategies().permutations(range(rank))))


@_family("permute")
def _permute(ctx: _Ctx, a: _Args) -> dict:
    dims = a.get("dims")
    x = a.tensor("input", lambda: ctx.shape(1, 4, scalar=True, empty=True) if dims is _FREE
                 else ctx.shape(len(dims), len(dims), empty=True))
    return {"input": x, "dims": a.lit("dims", lambda: _permutation(ctx, a, _rank(x)))}


@_family("transpose")
def _transpose(ctx: _Ctx, a: _Args) -> dict:
    x = a.tensor("input", lambda: ctx.shape(1, 4, scalar=True, empty=True))
    r = max(_rank(x), 1)  # a 0-d tensor takes dims 0 and -1
    kind, prev = a.producer("input")

    def pair() -> tuple:
        options = ["random", "same"]
        if kind == "transpose":
            options.insert(0, "undo")
        choice = ctx.pick(options)
        if choice == "undo":
            d0, d1 = prev["dim0"], prev["dim1"]
            return (d1, d0) if ctx.coin() else (d0, d1)
        d0 = ctx.int(-r, r - 1)
        return (d0, d0) if choice == "same" else (d0, ctx.int(-r, r - 1))

    d0, d1 = (a.get("dim0"), a.get("dim1")) if not (a.free("dim0") or a.free("dim1")) else pair()
    return {"input": x, "dim0": a.lit("dim0", lambda: d0), "dim1": a.lit("dim1", lambda: d1)}


@_family("getitem")
def _getitem(ctx: _Ctx, a: _Args) -> dict:
    x = a.tensor("input", lambda: ctx.shape(1, 3, scalar=True, empty=True))
    if isinstance(x, (list, tuple)):  # one result of a multi-output op (split, max, topk)
        return {"input": x, "index": a.lit("index", lambda: ctx.int(-len(x), len(x) - 1))}
    return {"input": x, "index": a.lit("index", lambda: _index(ctx, _shape(x) or ()))}


def _index(ctx: _Ctx, shape: tuple) -> Any:
    """``x[i]``, ``x[a:b:c]``, ``x[i, a:b]``, ``x[..., i]``, ``x[None, i]``: what
    symbolic_trace records as ``operator.getitem``."""
    if not shape:
        return ctx.pick([None, Ellipsis])

    def one(n: int) -> Any:
        if n and ctx.coin():  # an empty dim takes slices only
            return ctx.int(-n, n - 1)
        start, stop = ctx.pick([None, ctx.int(-n, n)]), ctx.pick([None, ctx.int(-n, n)])
        return slice(start, stop, ctx.pick([None, 1, 2]))

    kind = ctx.pick(["one", "two", "ellipsis", "none"] if len(shape) >= 2 else ["one", "ellipsis", "none"])
    if kind == "one":
        return one(shape[0])
    if kind == "two":
        return (one(shape[0]), one(shape[1]))
    if kind == "ellipsis":
        return (Ellipsis, one(shape[-1]))
    return (None, one(shape[0]))


@_family("select")
def _select(ctx: _Ctx, a: _Args) -> dict:
    x = a.tensor("input", lambda: ctx.shape(1, 4, empty=True))
    r = _rank(x)
    if r == 0:
        raise _Discard("select of a 0-d tensor")
    dim = a.lit("dim", lambda: ctx.int(-r, r - 1))
    n = x.shape[dim] if isinstance(dim, int) and -r <= dim < r else 1
    return {"input": x, "dim": dim, "index": a.lit("index", lambda: ctx.int(-n, n - 1))}


@_family("slice")
def _slice(ctx: _Ctx, a: _Args) -> dict:
    """``aten.slice(x, dim, start, end, step)``: export's spelling of ``x[a:b:c]``
    (bounds past the ends are clamped)."""
    x = a.tensor("input", lambda: ctx.shape(1, 4, empty=True))
    r = max(_rank(x), 1)
    dim = a.lit("dim", lambda: ctx.int(-r, r - 1))
    n = x.shape[dim] if isinstance(dim, int) and x.dim() and -r <= dim < r else 1
    return {"input": x, "dim": dim,
            "start": a.lit("start", lambda: ctx.pick([None, 0, ctx.int(-n, n)])),
            "end": a.lit("end", lambda: ctx.pick([None, ctx.int(-n, n), 2**63 - 1])),
            "step": a.lit("step", lambda: ctx.pick([1, 2]))}


@_family("pad")
def _pad(ctx: _Ctx, a: _Args) -> dict:
    """Padding amounts (last dim first) for up to three dims, cropping too; a pad
    the where clause wants symmetric (``symmetric_pad(x, p)``) pads exactly the
    spatial dims of a conv input, as much before as after."""
    symmetric = a.plan is not None and a.hinted("pad", a.plan.symmetric_pads)
    x = a.tensor("input", lambda: ctx.shape(*((3, 5) if symmetric else (1, 4))))
    r = _rank(x)
    if r == 0:
        raise _Discard("pad of a 0-d tensor")

    def amounts() -> tuple:
        if symmetric or ctx.coin():
            dims = r - 2 if symmetric else ctx.int(1, min(r, 3))
            if dims < 1:
                raise _Discard("a symmetric conv pad needs a 3-d to 5-d input")
            return tuple(v for _ in range(dims) for v in [ctx.int(0, 2)] * 2)
        return tuple(ctx.int(-1, 2) for _ in range(2 * ctx.int(1, min(r, 3))))

    out = {"input": x, "pad": a.lit("pad", amounts)}
    constant_nd = a.op.endswith("constant_pad_nd")
    if not constant_nd:
        out["mode"] = a.lit("mode", lambda: ctx.pick(["constant", "reflect", "replicate", "circular"]))
    out["value"] = a.lit("value", lambda: ctx.pick([0 if constant_nd else None, 0.0, 1.5, -2.0, 0.1, 1e5]))
    return out


_RESIZE_MODES = {1: ("nearest", "nearest-exact", "linear"), 2: ("nearest", "nearest-exact", "bilinear", "bicubic"),
                 3: ("nearest", "nearest-exact", "trilinear")}


@_family("interpolate")
def _interpolate(ctx: _Ctx, a: _Args) -> dict:
    """A batch of 1 to 3 spatial dims, resized by a size or by a scale factor (one for
    every dim, or one per dim), in a mode that rank has; align_corners only where the
    mode interpolates."""
    x = a.tensor("input", lambda: (ctx.int(1, 2), ctx.int(1, 2), *[ctx.int(1, 4) for _ in range(ctx.int(1, 3))]))
    rank = _rank(x) - 2
    if rank not in _RESIZE_MODES:
        raise _Discard("interpolate takes a 3-d to 5-d input")
    mode = a.lit("mode", lambda: ctx.pick(_RESIZE_MODES[rank]))
    if mode not in _RESIZE_MODES[rank] or not a.dtype.is_floating_point:
        raise _Discard(f"mode {mode!r} on a rank-{rank} input")
    by_size = a.free("scale_factor") and (not a.free("size") or ctx.coin())
    size = a.lit("size", lambda: (ctx.pick([ctx.int(1, 6), [ctx.int(1, 6) for _ in range(rank)]])
                                  if by_size else None))
    scale = a.lit("scale_factor", lambda: None if size is not None else
                  ctx.pick([ctx.pick([2, 2.0, 0.5, 1.5]), [ctx.pick([2.0, 0.5, 1.0]) for _ in range(rank)]]))
    if (size is None) == (scale is None):
        raise _Discard("interpolate takes a size or a scale factor")
    corners = a.lit("align_corners", lambda: None if mode.startswith("nearest") else ctx.pick([None, False, True]))
    if corners is not None and mode.startswith("nearest"):
        raise _Discard("align_corners with a nearest mode")
    return {"input": x, "size": size, "scale_factor": scale, "mode": mode, "align_corners": corners}


@_family("as")
def _as(ctx: _Ctx, a: _Args) -> dict:
    """``reshape_as``, ``expand_as``, ``type_as``: ``other`` has a shape the input
    reshapes or expands to, or (type_as) any dtype, the input's own included."""
    x = a.tensor("input", lambda: ctx.shape(1, 3, dim_hi=3, scalar=True, empty=True))
    shape = _shape(x) or ()
    if a.op == "type_as":
        dtype = ctx.pick([x.dtype, *_ALL]) if isinstance(x, torch.Tensor) else ctx.dtype
        return {"input": x, "other": a.get("other") if not a.free("other")
                else ctx.tensor(ctx.shape(), dtype=dtype)}
    if a.op == "reshape_as":  # the same number of elements
        target = ctx.pick([shape, tuple(reversed(shape)), (1, *shape), (math.prod(shape),)])
    else:
        target = ctx.pick([shape, tuple(ctx.int(1, 3) if d == 1 else d for d in shape), (2, *shape)])
    return {"input": x, "other": a.tensor("other", target)}


@_family("glu")
def _glu(ctx: _Ctx, a: _Args) -> dict:
    """An input whose size along ``dim`` is even (glu halves it)."""
    dim = a.get("dim")
    x = a.get("input")
    if x is _FREE:
        shape = list(ctx.shape(1, 3))
        d = dim if isinstance(dim, int) else ctx.int(-len(shape), len(shape) - 1)
        shape[d] = 2 * ctx.int(1, 2)
        x, dim = a.fresh(tuple(shape)), d
    r = _rank(x)
    evens = [d for d in range(-r, r) if x.shape[d] % 2 == 0]
    if not evens:
        raise _Discard("glu needs an even-sized dim")
    return {"input": x, "dim": a.lit("dim", lambda: ctx.pick(evens))}


@_family("masked_fill")
def _masked_fill(ctx: _Ctx, a: _Args) -> dict:
    """A bool mask of the input's shape (or a broadcasting suffix of it) and a fill
    value: a number, or a 0-dim tensor of the input's dtype."""
    x = a.tensor("input", lambda: ctx.shape(1, 3, scalar=True, empty=True))
    shape = _shape(x) or ()
    mask = a.get("mask")
    if mask is _FREE:
        mask = ctx.tensor(ctx.pick([shape, shape[1:]]), dtype=torch.bool)
    value = a.get("value")
    if value is _FREE:
        value = ctx.pick([0.0, -1.0, 1e4, -math.inf, "tensor"] if a.dtype.is_floating_point else [0, 1, -1])
        if value == "tensor":
            value = a.fresh(())
    return {"input": x, "mask": mask, "value": value}


#: einsum equations verification draws (letters get sizes; given operands fix theirs)
_EQUATIONS = ("ij,jk->ik", "bij,bjk->bik", "bhqd,bhkd->bhqk", "ij,kj->ik", "bnd,dh->bnh", "ij->ji", "i,i->",
              "ii->i", "bij->bj", "i,j->ij")


@_family("einsum")
def _einsum(ctx: _Ctx, a: _Args) -> dict:
    equation = a.lit("equation", lambda: ctx.pick(_EQUATIONS))
    if not isinstance(equation, str) or "." in equation:
        raise _Discard("einsum equation without ellipsis expected")
    inputs = equation.replace(" ", "").split("->")[0].split(",")
    given = a.get("tensors")
    given = [_FREE] * len(inputs) if given is _FREE else list(given)
    if len(given) != len(inputs):
        raise _Discard("einsum operand count differs from the equation")
    sizes: dict = {}
    for letters, t in zip(inputs, given):
        if isinstance(t, torch.Tensor):
            if t.dim() != len(letters):
                raise _Discard("einsum operand rank differs from the equation")
            for c, d in zip(letters, t.shape):
                sizes.setdefault(c, d)
    tensors = [t if isinstance(t, torch.Tensor)
               else a.fresh(tuple(sizes.setdefault(c, ctx.int(1, 3)) for c in letters))
               for letters, t in zip(inputs, given)]
    return {"equation": equation, "tensors": tensors}


@_family("reduce_dims")
def _reduce_dims(ctx: _Ctx, a: _Args) -> dict:
    """A reduction over an int dim (``max``) or an int/tuple of dims (``amax``; () is
    every dim)."""
    x = a.tensor("input", lambda: ctx.shape(1, 4, scalar=True, empty=True))
    r = max(_rank(x), 1)
    one = lambda: ctx.int(-r, r - 1)  # noqa: E731
    if a.op == "max":
        return {"input": x, "dim": a.lit("dim", one)}
    return {"input": x, "dim": a.lit("dim", lambda: ctx.pick([one(), (), (one(),), tuple(range(r))]))}


@_family("topk")
def _topk(ctx: _Ctx, a: _Args) -> dict:
    x = a.tensor("input", lambda: ctx.shape(1, 3, scalar=True, empty=True))
    r = max(_rank(x), 1)
    dim = a.lit("dim", lambda: ctx.pick([-1, ctx.int(-r, r - 1)]))
    n = x.shape[dim] if x.dim() else 1
    return {"input": x, "dim": dim, "k": a.lit("k", lambda: ctx.int(0, n))}


@_family("split")
def _split(ctx: _Ctx, a: _Args) -> dict:
    """``split``: a piece size, or sizes that sum to the dim; ``chunk``: a count."""
    x = a.tensor("input", lambda: ctx.shape(1, 3, empty=True))
    r = max(_rank(x), 1)
    dim = a.lit("dim", lambda: ctx.int(-r, r - 1))
    n = x.shape[dim] if x.dim() else 1
    if a.op == "chunk":
        return {"input": x, "dim": dim, "chunks": a.lit("chunks", lambda: ctx.int(1, n + 1))}

    def sizes() -> Any:
        if ctx.coin():
            return ctx.int(1, max(n, 1))
        cut = sorted(ctx.int(0, n) for _ in range(ctx.int(0, 2)))
        return [b - e for b, e in zip([*cut, n], [0, *cut])]

    return {"input": x, "dim": dim, "split_size": a.lit("split_size", sizes)}


def _tensor_list(ctx: _Ctx, a: _Args, min_rank: int) -> tuple:
    """The ``tensors`` list of cat/stack (1 to 3 items when the pattern leaves it
    open) and the shape its fresh items take: a given item's, else a drawn one."""
    items = a.get("tensors")
    if items is _FREE:
        items = [_FREE] * ctx.int(1, 3)
    if not isinstance(items, (list, tuple)):
        raise _Discard(f"{a.op} of a non-list")
    known = next((t for t in items if isinstance(t, torch.Tensor)), None)
    return items, (_shape(known) if known is not None else ctx.shape(min_rank, 3, empty=True))


@_family("stack")
def _stack(ctx: _Ctx, a: _Args) -> dict:
    items, shape = _tensor_list(ctx, a, min_rank=0)
    out = [a.fresh(shape) if t is _FREE else t for t in items]
    r = len(shape)
    return {"tensors": type(items)(out) if isinstance(items, tuple) else out,
            "dim": a.lit("dim", lambda: ctx.int(-r - 1, r))}


@_family("prelu")
def _prelu(ctx: _Ctx, a: _Args) -> dict:
    """A weight of one slope, or one per channel (dim 1; nn.PReLU(num_parameters=C))."""
    x = a.tensor("input", lambda: ctx.shape(1, 4))
    s = _shape(x) or ()
    c = s[1] if len(s) >= 2 else 1
    return {"input": x, "weight": a.tensor("weight", lambda: (ctx.pick([1, c]),), lo=-1.0, hi=1.0)}


@_family("attention")
def _sdpa(ctx: _Ctx, a: _Args) -> dict:
    """q (..., L, E), k (..., S, E), v (..., S, Ev); no mask, a bool mask (True:
    attend) or a float one added to the scores, of shape (L, S) or with the batch
    dims too; causal only without a mask; dropout now and then (pattern and
    replacement draw from one seeded generator: a rule that drops it differs)."""
    q, k, v = a.get("query"), a.get("key"), a.get("value")
    known = next((t for t in (q, k, v) if _shape(t) is not None), None)
    batch = tuple(_shape(known)[:-2]) if known is not None else ctx.shape(0, 2, dim_hi=2)
    if known is not None and len(_shape(known)) < 2:
        raise _Discard("attention takes tensors of rank >= 2")
    big_l = _shape(q)[-2] if _shape(q) is not None else ctx.int(1, 4)
    e = _shape(q)[-1] if _shape(q) is not None else (_shape(k)[-1] if _shape(k) is not None else ctx.int(1, 4))
    s = _shape(k)[-2] if _shape(k) is not None else (_shape(v)[-2] if _shape(v) is not None else ctx.int(1, 4))
    # grouped-query attention now and then: one key/value head for all query heads
    gqa = (a.free("enable_gqa") and all(a.free(n) for n in ("query", "key", "value")) and len(batch) >= 1
           and batch[-1] > 1 and ctx.coin())
    kv_batch = (*batch[:-1], 1) if gqa else batch
    q = a.tensor("query", (*batch, big_l, e))
    k = a.tensor("key", (*kv_batch, s, e))
    v = a.tensor("value", lambda: (*kv_batch, s, ctx.int(1, 4)))

    def mask() -> Any:
        kind = ctx.pick(["none", "bool", "float"])
        if kind == "none":
            return None
        shape = ctx.pick([(big_l, s), (*batch, big_l, s)])
        if kind == "bool":
            return ctx.tensor(shape, dtype=torch.bool)
        return a.fresh(shape)

    m = a.lit("attn_mask", mask) if a.free("attn_mask") else a.get("attn_mask")
    return {"query": q, "key": k, "value": v, "attn_mask": m,
            "dropout_p": a.lit("dropout_p", lambda: ctx.pick([0.0, 0.0, 0.5])),
            "is_causal": a.lit("is_causal", lambda: ctx.coin() if m is None else False),
            "scale": a.lit("scale", lambda: ctx.pick([None, 0.5])),
            "enable_gqa": a.lit("enable_gqa", lambda: gqa)}


@_family("t")
def _t(ctx: _Ctx, a: _Args) -> dict:
    return {"input": a.tensor("input", lambda: ctx.shape(1, 2, scalar=True, empty=True))}


def _target_shape(ctx: _Ctx, shape: tuple) -> tuple:
    """A shape with the same number of elements: the same one (a no-op), with one
    -1, flattened, reversed, with a leading 1 (flattened only in mode "strided")."""
    options = [shape, (-1,), tuple(reversed(shape)), (1, *shape), (math.prod(shape),)]
    if ctx.mode == "strided" and len(shape) >= 2:  # a non-contiguous input meets a shape it cannot view as
        return ctx.pick([(-1,), (math.prod(shape),)])
    if shape:
        i = ctx.int(0, len(shape) - 1)
        options.append(shape[:i] + (-1,) + shape[i + 1:])
    return ctx.pick(options)


def _wanted_rank(a: _Args) -> int | None:
    """The rank ``rank(f) == N`` asks of this call's result (``... as f``)."""
    return a.plan.ranks.get(a.output) if a.plan is not None and a.output is not None else None


@_family("reshape")
def _reshape(ctx: _Ctx, a: _Args) -> dict:
    x = a.tensor("input", lambda: ctx.shape(1, 4, scalar=True, empty=True))
    shape, rank = _shape(x) or (), _wanted_rank(a)
    fits = [s for s in a.partner_shapes if math.prod(s) == math.prod(shape)] if a.free("shape") else []
    if fits:
        return {"input": x, "shape": fits[0]}  # same_shape(r, l): back to l's shape
    if rank is not None and rank >= 1 and shape and a.free("shape"):
        # the leading dims merged (flatten before a linear) or leading 1s added
        merged = (math.prod(shape[:len(shape) - rank + 1]), *shape[len(shape) - rank + 1:]) \
            if len(shape) >= rank else (1,) * (rank - len(shape)) + tuple(shape)
        return {"input": x, "shape": merged}
    return {"input": x, "shape": a.lit("shape", lambda: _target_shape(ctx, shape))}


@_family("flatten")
def _flatten(ctx: _Ctx, a: _Args) -> dict:
    rank = _wanted_rank(a)
    least = rank if rank is not None and 1 <= rank <= 4 else 1  # flatten cannot add dims
    x = a.tensor("input", lambda: ctx.shape(least, 4, scalar=least == 1, empty=True))
    r = max(_rank(x), 1)
    if rank is not None and 1 <= rank <= r and a.free("start_dim") and a.free("end_dim"):
        # trailing dims merged (x.flatten(1)) or leading ones (keeping the last dim)
        start, end = ctx.pick([(rank - 1, -1), (0, r - rank)])
        return {"input": x, "start_dim": start, "end_dim": end}
    start = a.lit("start_dim", lambda: ctx.int(0, r - 1))
    return {"input": x, "start_dim": start, "end_dim": a.lit("end_dim", lambda: ctx.pick([-1, r - 1]))}


@_family("unsqueeze")
def _unsqueeze(ctx: _Ctx, a: _Args) -> dict:
    x = a.tensor("input", lambda: ctx.shape(0, 3, empty=True))
    r = _rank(x)
    return {"input": x, "dim": a.lit("dim", lambda: ctx.int(-r - 1, r))}


@_family("squeeze")
def _squeeze(ctx: _Ctx, a: _Args) -> dict:
    x = a.tensor("input", lambda: ctx.shape(1, 4, dim_hi=2, scalar=True, empty=True))
    r = max(_rank(x), 1)  # a 0-d tensor takes dims 0 and -1
    return {"input": x, "dim": a.lit("dim", lambda: ctx.pick([None, ctx.int(-r, r - 1)]))}


@_family("expand")
def _expand(ctx: _Ctx, a: _Args) -> dict:
    x = a.tensor("input", lambda: ctx.shape(1, 3, dim_hi=2, scalar=True, empty=True))
    shape = _shape(x) or ()
    grown = tuple(ctx.int(1, 3) if d == 1 else d for d in shape)
    return {"input": x, "size": a.lit("size", lambda: ctx.pick([shape, grown, (2, *shape)]))}


@_family("cat")
def _cat(ctx: _Ctx, a: _Args) -> dict:
    items, shape = _tensor_list(ctx, a, min_rank=1)
    dim = a.lit("dim", lambda: ctx.int(-len(shape), len(shape) - 1) if shape else 0)
    out = []
    for t in items:
        if t is _FREE:
            s = list(shape)
            kind = ctx.degenerate(empty=True)
            if kind == "empty" and ctx.coin():
                s = [0]  # torch.cat skips 1-d empty tensors whatever the other shapes
            elif s:
                s[dim % len(s)] = 0 if kind == "empty" else ctx.int(1, 3)
            t = a.fresh(tuple(s))
        out.append(t)
    return {"tensors": type(items)(out) if isinstance(items, tuple) else out, "dim": dim}


#: dtype -> dtypes that hold every value of it
_WIDER = {
    torch.bool: (torch.uint8, torch.int32, torch.float32),
    torch.uint8: (torch.int32, torch.int64, torch.float32),
    torch.int8: (torch.int16, torch.int32, torch.int64, torch.float32),
    torch.int16: (torch.int32, torch.int64, torch.float32),
    torch.int32: (torch.int64, torch.float64),
    torch.float16: (torch.float32, torch.float64),
    torch.bfloat16: (torch.float32, torch.float64),
    torch.float32: (torch.float64,),
}


@_family("to")
def _to(ctx: _Ctx, a: _Args) -> dict:
    x = a.tensor("input", lambda: ctx.shape(scalar=True, empty=True))
    kind, prev = a.producer("input")

    def dtype() -> torch.dtype:
        options = ["any"]
        if isinstance(x, torch.Tensor):
            options.insert(0, "same")
        if kind == "to" and isinstance(prev.get("input"), torch.Tensor):
            options.insert(0, "back")  # to where the value came from
        wider = _WIDER.get(x.dtype, ()) if isinstance(x, torch.Tensor) else ()
        if wider:
            options.append("wider")
        choice = ctx.pick(options)
        if choice == "same":
            return x.dtype
        if choice == "back":
            return prev["input"].dtype
        if choice == "wider":  # a cast that keeps every value (and can be undone)
            return ctx.pick(wider)
        return ctx.pick(_ALL)

    return {"input": x, "dtype": a.lit("dtype", dtype)}


# ---------------------------------------------------------------- layers


def _per_dim(ctx: _Ctx, rank: int, lo: int, hi: int) -> Any:
    """An int, or a tuple with one value per spatial dim (modules spell it so)."""
    if ctx.coin():
        return ctx.int(lo, hi)
    return tuple(ctx.int(lo, hi) for _ in range(rank))


def _expand_dims(v: Any, rank: int) -> tuple:
    if isinstance(v, (list, tuple)):
        if len(v) == 1:
            return tuple(v) * rank
        if len(v) != rank:
            raise _Discard("per-dim value of the wrong length")
        return tuple(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise _Discard(f"expected an int, got {v!r}")
    return (v,) * rank


def _conv_rank(ctx: _Ctx, a: _Args) -> int:
    for name in ("input", "weight"):
        s = _shape(a.get(name))
        if s is not None:
            if len(s) not in (3, 4, 5):
                raise _Discard("a convolution takes a 3-d, 4-d or 5-d tensor")
            return len(s) - 2
    hinted = a.plan.ranks.get(a.variables.get("input")) if a.plan is not None else None
    if hinted in (3, 4, 5):
        return hinted - 2
    return ctx.pick([2, 1, 3])  # 2-d convs first: the common case (and onednn's conv + add)


def _conv_common(ctx: _Ctx, a: _Args, transposed: bool) -> dict:
    """Shapes and attributes for conv / conv_transpose that fit together."""
    rank = _conv_rank(ctx, a)
    x, w = a.get("input"), a.get("weight")
    groups = a.lit("groups", lambda: ctx.pick([1, 2]))
    stride = a.lit("stride", lambda: _per_dim(ctx, rank, 1, 2))
    padding = a.lit("padding", lambda: _per_dim(ctx, rank, 0, 1))
    dilation = a.lit("dilation", lambda: _per_dim(ctx, rank, 1, 2))
    if isinstance(padding, str):
        raise _Discard("string padding")
    if not isinstance(groups, int) or groups < 1:
        raise _Discard("bad groups")
    if _shape(w) is not None:
        ws = _shape(w)
        kernel = ws[2:]
        c_in = ws[0] if transposed else ws[1] * groups
        c_out = ws[1] * groups if transposed else ws[0]
    else:
        kernel = tuple(ctx.int(1, 3) for _ in range(rank))
        c_in = _shape(x)[1] if _shape(x) is not None else groups * ctx.int(1, 2)
        c_out = groups * ctx.int(1, 2)
    if c_in % groups or c_out % groups:
        raise _Discard("channels not divisible by groups")
    out = {"groups": groups, "stride": stride, "padding": padding, "dilation": dilation}
    if transposed:
        out["output_padding"] = a.lit("output_padding", lambda: _output_padding(ctx, rank, stride, dilation))
    spatial = [ctx.int(max(1, dil * (k - 1) + 1 - 2 * pad), dil * (k - 1) + 3)
               for k, pad, dil in zip(kernel, _expand_dims(padding, rank), _expand_dims(dilation, rank))]
    out["input"] = a.tensor("input", lambda: (ctx.int(1, 2), c_in, *spatial))
    w_shape = (c_in, c_out // groups, *kernel) if transposed else (c_out, c_in // groups, *kernel)
    out["weight"] = a.tensor("weight", w_shape)
    out["bias"] = a.optional("bias", (c_out,))
    return out


def _output_padding(ctx: _Ctx, rank: int, stride: Any, dilation: Any) -> Any:
    """0, or the largest valid one (below max(stride, dilation) per dim): a rule that
    drops it changes the output's shape."""
    try:
        most = [max(s, d) - 1 for s, d in zip(_expand_dims(stride, rank), _expand_dims(dilation, rank))]
    except _Discard:
        return 0
    if not any(most):
        return 0
    return ctx.pick([0, most[0] if rank == 1 else tuple(most)])


@_family("conv")
def _conv(ctx: _Ctx, a: _Args) -> dict:
    return _conv_common(ctx, a, transposed=False)


@_family("conv_transpose")
def _conv_transpose(ctx: _Ctx, a: _Args) -> dict:
    return _conv_common(ctx, a, transposed=True)


@_family("linear")
def _linear(ctx: _Ctx, a: _Args) -> dict:
    x, w = a.get("input"), a.get("weight")
    n_in = _shape(x)[-1] if _shape(x) else (_shape(w)[1] if _shape(w) else ctx.int(1, 4))
    n_out = _shape(w)[0] if _shape(w) else ctx.int(1, 4)

    def shape() -> tuple:
        batch_rank = ctx.pick([1, 2, 0])  # 2-d inputs first (what folding into BatchNorm1d needs)
        return (*ctx.shape(batch_rank, batch_rank), n_in)

    x = a.tensor("input", shape)
    return {"input": x, "weight": a.tensor("weight", (n_out, n_in)), "bias": a.optional("bias", (n_out,))}


@_family("batch_norm")
def _batch_norm(ctx: _Ctx, a: _Args) -> dict:
    x = a.tensor("input", lambda: ctx.shape(2, 4))
    s = _shape(x)
    if s is None or len(s) < 2:
        raise _Discard("batch_norm takes a tensor of rank >= 2")
    c = (s[1],)
    # training uses the batch statistics: it needs more than one value per channel
    many = math.prod(s) > s[1]
    return {"input": x, "training": a.lit("training", lambda: ctx.pick([False, True]) if many else False),
            "running_mean": a.tensor("running_mean", c),
            "running_var": a.tensor("running_var", c, lo=0.25, hi=4.0),  # a variance: positive
            "weight": a.optional("weight", c), "bias": a.optional("bias", c)}


@_family("layer_norm")
def _layer_norm(ctx: _Ctx, a: _Args) -> dict:
    x = a.tensor("input", lambda: ctx.shape(1, 4))
    s = _shape(x) or ()
    shape = a.lit("normalized_shape", lambda: s[len(s) - ctx.int(1, max(len(s), 1)):])
    out = {"input": x, "normalized_shape": shape,
           "weight": a.optional("weight", tuple(shape)), "bias": a.optional("bias", tuple(shape))}
    if a.free("eps") and a.op == "aten.native_layer_norm":  # no default in its schema
        out["eps"] = ctx.pick([1e-5, 1e-3])
    return out


@_family("group_norm")
def _group_norm(ctx: _Ctx, a: _Args) -> dict:
    groups = a.get("num_groups")
    g = groups if isinstance(groups, int) else ctx.int(1, 2)
    x = a.tensor("input", lambda: (ctx.int(1, 2), g * ctx.int(1, 2), *ctx.shape(0, 2)))
    c = (_shape(x)[1],) if _shape(x) and len(_shape(x)) >= 2 else (1,)
    return {"input": x, "num_groups": a.lit("num_groups", lambda: ctx.pick([d for d in (1, 2) if c[0] % d == 0])),
            "weight": a.optional("weight", c), "bias": a.optional("bias", c)}


@_family("softmax")
def _softmax(ctx: _Ctx, a: _Args) -> dict:
    x = a.tensor("input", lambda: ctx.shape(1, 4, scalar=True, empty=True))
    r = _rank(x)
    if r and _wants_last(a):
        return {"input": x, "dim": a.lit("dim", lambda: ctx.pick([-1, r - 1]))}
    return {"input": x, "dim": a.lit("dim", lambda: ctx.int(-r, r - 1) if r else 0)}


def _wants_last(a: _Args) -> bool:
    """The where clause wants the op's ``dim`` to be the last dim (``last_dim(x, d)``),
    which a dim drawn among the rank's is a quarter of the time at best."""
    return a.plan is not None and a.hinted("dim", a.plan.last_dims)


@_family("reduce")
def _reduce(ctx: _Ctx, a: _Args) -> dict:
    """``sum``, ``mean``, ``linalg_vector_norm``: dim None, one int, or a list of
    dims (one, all of them, or none: ``[]`` is every dim for sum and mean)."""
    x = a.tensor("input", lambda: ctx.shape(1, 4, scalar=True, empty=True))
    r = _rank(x)
    if not r:
        return {"input": x, "dim": a.lit("dim", lambda: ctx.pick([None, 0]))}
    empty = [i for i, size in enumerate(_shape(x) or ()) if size == 0]
    # an empty tensor is reduced over a dim of size 0 (a mean of nothing is NaN)
    one = (lambda: ctx.pick(empty)) if empty else (lambda: ctx.int(-r, r - 1))  # noqa: E731
    if _wants_last(a):
        return {"input": x, "dim": a.lit("dim", lambda: ctx.pick([-1, r - 1, [-1], [r - 1]]))}
    return {"input": x, "dim": a.lit("dim", lambda: ctx.pick([None, one(), [one()], list(range(r)), []]))}


@_family("embedding")
def _embedding(ctx: _Ctx, a: _Args) -> dict:
    """Rows of a float table picked by int64 indices below its row count."""
    weight = a.tensor("weight", lambda: (ctx.int(1, 5), ctx.int(1, 4)))
    rows = (_shape(weight) or (0,))[0]
    indices = a.get("input")
    if indices is _FREE:
        shape = ctx.shape(1, 2)
        indices = ctx.tensor(shape, 0, max(rows - 1, 0), dtype=torch.int64)
    return {"input": indices, "weight": weight,
            "padding_idx": a.lit("padding_idx", lambda: ctx.pick([None, ctx.int(0, max(rows - 1, 0))]))}


def _pool(ctx: _Ctx, a: _Args, adaptive: bool = False) -> dict:
    if adaptive:
        x = a.tensor("input", lambda: (ctx.int(1, 2), ctx.int(1, 2), ctx.int(3, 6), ctx.int(3, 6)))
        return {"input": x, "output_size": a.lit("output_size", lambda: ctx.pick([1, (2, 2), (1, 3)]))}
    k = a.lit("kernel_size", lambda: ctx.pick([1, 2, 3, (2, 2)]))
    out = {"kernel_size": k, "stride": a.lit("stride", lambda: ctx.pick([None, 1, 2])),
           "padding": a.lit("padding", lambda: 0 if k == 1 else ctx.pick([0, 1]))}
    least = 3
    if a.op == "max_pool2d":  # dilated windows span (k - 1) * dilation + 1: inputs at least that large
        out["dilation"] = a.lit("dilation", lambda: 1 if k == 1 else ctx.pick([1, 2]))
        try:
            span = [(kk - 1) * d + 1 for kk, d in zip(_expand_dims(k, 2), _expand_dims(out["dilation"], 2))]
            least = min(max(3, *span), 6)
        except _Discard:
            pass  # values the pattern fixed: torch decides
    out["input"] = a.tensor("input", lambda: (ctx.int(1, 2), ctx.int(1, 2), ctx.int(least, 6), ctx.int(least, 6)))
    return out


FAMILIES["pool"] = _pool
FAMILIES["adaptive_pool"] = lambda ctx, a: _pool(ctx, a, adaptive=True)


@_family("mm")
def _mm(ctx: _Ctx, a: _Args) -> dict:
    second = "mat2" if a.op == "mm" else "other"
    x, y = a.get("input"), a.get(second)
    k = _shape(x)[-1] if _shape(x) else (_shape(y)[0] if _shape(y) else ctx.int(1, 4))
    x = a.tensor("input", lambda: (ctx.int(1, 4), k))
    return {"input": x, second: a.tensor(second, lambda: (k, ctx.int(1, 4)))}


@_family("matmul")
def _matmul(ctx: _Ctx, a: _Args) -> dict:
    """``input @ other`` with the batch dims of whichever operand is given (both
    free: none, one or two of them): ``q @ k.transpose(-2, -1)`` on 4-d heads, then
    ``scores @ v``. A 1-d operand is a vector (``(n, k) @ (k,)``)."""
    x, y = a.get("input"), a.get("other")
    sx, sy = _shape(x), _shape(y)
    if sx is not None and len(sx) >= 2:
        batch, k = sx[:-2], sx[-1]
    elif sy is not None and len(sy) >= 2:
        batch, k = sy[:-2], sy[-2]
    else:
        batch = tuple(ctx.int(1, 3) for _ in range(ctx.int(0, 2)))
        k = sx[-1] if sx else (sy[0] if sy else ctx.int(1, 4))
    x = a.tensor("input", lambda: (*batch, ctx.int(1, 4), k))
    return {"input": x, "other": a.tensor("other", lambda: (*batch, k, ctx.int(1, 4)))}


@_family("bmm")
def _bmm(ctx: _Ctx, a: _Args) -> dict:
    x, y = a.get("input"), a.get("mat2")
    b, k = (_shape(x)[0], _shape(x)[2]) if _shape(x) else ((_shape(y)[0], _shape(y)[1]) if _shape(y)
                                                           else (ctx.int(1, 2), ctx.int(1, 3)))
    x = a.tensor("input", lambda: (b, ctx.int(1, 3), k))
    return {"input": x, "mat2": a.tensor("mat2", lambda: (b, k, ctx.int(1, 3)))}


@_family("addmm")
def _addmm(ctx: _Ctx, a: _Args) -> dict:
    m1, m2 = ("mat1", "mat2") if a.op == "addmm" else ("batch1", "batch2")
    inner = _mm if a.op == "addmm" else _bmm
    sub = _Args(ctx, "mm" if a.op == "addmm" else "bmm",
                {"input": a.get(m1), ("mat2"): a.get(m2)}, a.producers)
    prod = inner(ctx, sub)
    out_shape = tuple(torch.empty(0).new_empty(prod["input"].shape[:-1]).shape) + (prod["mat2"].shape[-1],)
    bias = a.tensor("input", lambda: ctx.pick([out_shape, out_shape[-1:]]))
    return {"input": bias, m1: prod["input"], m2: prod["mat2"]}


@_family("addbmm")
def _addbmm(ctx: _Ctx, a: _Args) -> dict:
    """input (n, p) or a broadcast of it, batch1 (b, n, m), batch2 (b, m, p)."""
    sub = _Args(ctx, "bmm", {"input": a.get("batch1"), "mat2": a.get("batch2")}, a.producers)
    prod = _bmm(ctx, sub)
    out_shape = (prod["input"].shape[1], prod["mat2"].shape[2])
    bias = a.tensor("input", lambda: ctx.pick([out_shape, out_shape[-1:]]))
    return {"input": bias, "batch1": prod["input"], "batch2": prod["mat2"],
            "beta": a.lit("beta", lambda: ctx.pick([1, 0.5])), "alpha": a.lit("alpha", lambda: ctx.pick([1, 2]))}


# ---------------------------------------------------------------- quantization


@_family("dequantize")
def _dequantize(ctx: _Ctx, a: _Args) -> dict:
    """A quantized input: the value the consumer drew (or a fresh one) quantized
    with torch's observers, per-tensor affine quint8 for activations, per-channel
    symmetric qint8 for constants (weights)."""
    x = a.get("input")
    if x is _FREE:
        t = a.seed if a.seed is not None else a.fresh(ctx.shape())
        if not isinstance(t, torch.Tensor) or t.is_quantized:
            raise _Discard("dequantize of a non-float value")
        t = t.detach().float()
        x = _quantize_weight(t) if a.is_const("input") else _quantize_activation(t)
    if not (isinstance(x, torch.Tensor) and x.is_quantized):
        raise _Discard("dequantize takes a quantized tensor")
    return {"input": x}


@_family("quantize")
def _quantize(ctx: _Ctx, a: _Args) -> dict:
    """Scale and zero point from torch's MinMaxObserver on the input (or half or
    twice that scale), or those of the quantized tensor the input was dequantized
    from (a requantization that changes nothing)."""
    x = a.tensor("input", ctx.shape)
    if not _is_float(x):
        raise _Discard("quantize_per_tensor takes a float tensor")
    dtype = a.lit("dtype", lambda: torch.quint8)
    if dtype not in (torch.quint8, torch.qint8, torch.qint32):
        raise _Discard(f"not a quantized dtype: {dtype!r}")
    kind, prev = a.producer("input")
    source = prev.get("input") if kind == "dequantize" else None
    options = ["observed", "scaled"]
    if isinstance(source, torch.Tensor) and _per_tensor(source) and source.dtype == dtype:
        options.insert(0, "same")
    choice = ctx.pick(options)
    if choice == "same":
        scale, zero_point = source.q_scale(), source.q_zero_point()
    else:
        scale, zero_point = _activation_qparams(x, dtype)
        if choice == "scaled":
            scale *= ctx.pick([2.0, 0.5])
    return {"input": x, "scale": a.lit("scale", lambda: scale), "zero_point": a.lit("zero_point", lambda: zero_point),
            "dtype": dtype}


@_family("fake_quantize")
def _fake_quantize(ctx: _Ctx, a: _Args) -> dict:
    """What a calibrated observer stands for: scale and zero point from torch's
    MinMaxObserver over [quant_min, quant_max] (quint8 or qint8 ranges)."""
    x = a.tensor("input", ctx.shape)
    if not _is_float(x):
        raise _Discard("fake quantization takes a float tensor")
    lo, hi = a.get("quant_min"), a.get("quant_max")
    if lo is _FREE or hi is _FREE:
        lo, hi = ctx.pick([(0, 255), (-128, 127), (0, 127)])
    dtype = torch.quint8 if lo >= 0 else torch.qint8
    scale, zero_point = _activation_qparams(x, dtype, lo, hi)
    return {"input": x, "scale": a.lit("scale", lambda: scale), "zero_point": a.lit("zero_point", lambda: zero_point),
            "quant_min": lo, "quant_max": hi}


def _generic(opdef: Any) -> Callable | None:
    """Ops without a generator whose attributes all have defaults: every tensor
    parameter gets a tensor of one shared shape."""
    if any(p.default is REQUIRED and not p.tensor for p in opdef.params):
        return None

    def gen(ctx: _Ctx, a: _Args) -> dict:
        given = [v for p in opdef.params for v in _items(a.get(p.name))]
        known = next((v for v in given if _shape(v) is not None), None)
        shape = _shape(known) if known is not None else ctx.shape(scalar=True, empty=True)
        drawn = {p.name: a.tensor(p.name, shape) for p in opdef.params if p.tensor and p.default is REQUIRED}
        for name, value in drawn.items():  # a tensor list the pattern spells ([a, b]): its free items
            if isinstance(value, (list, tuple)) and any(v is _FREE for v in value):
                drawn[name] = type(value)(a.fresh(shape) if v is _FREE else v for v in value)
        for p in opdef.params:  # a defaulted attribute the pattern leaves free: any value it may take
            if not p.tensor and p.default is not REQUIRED and a.free(p.name):
                others = _other_values(p.default)
                if others:
                    drawn[p.name] = ctx.pick((p.default, *others))
        return drawn

    gen.generic = True  # type: ignore[attr-defined]  # _pinned_attributes: what it cannot vary
    return gen


def _items(value: Any) -> tuple:
    """A value, or the items of a list of them (a ``Tensor[]`` argument)."""
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _other_values(default: Any) -> tuple:
    """Values of a defaulted attribute's type besides its default, for an op nothing
    else is known of (a dim, a scale, a flag); () for other types (a list, a
    string, None), which keep the default."""
    if isinstance(default, bool):
        return (not default,)
    if isinstance(default, int):
        return tuple(v for v in (0, 1, -1, 2) if v != default)
    if isinstance(default, float):
        return tuple(v for v in (0.5, 2.0, -1.5, 0.0) if v != default)
    if isinstance(default, (list, tuple)) and all(type(v) is int for v in default):  # dims, sizes
        return tuple(type(default)(v) for v in ([0], [1], [-1], [0, 1]) if list(v) != list(default))
    return ()


def generator_for(opdef: Any) -> Callable | None:
    """The op's generator: its vocabulary entry's family; a qualified op outside the
    vocabulary (``aten.hardsigmoid``) gets its listed family or the generic one when it
    can; a vocabulary op without ``instances`` gets none (its rules go unverified)."""
    from rewrite.ops import op_names

    if opdef.instances is not None:
        return FAMILIES[opdef.instances.family]
    family = OUTSIDE_VOCABULARY.get(opdef.name)
    if family is not None:
        return FAMILIES[family]
    if opdef.name not in op_names():
        return _generic(opdef)
    return None


# ================================================================ building instances


def _conv_over_padding_only(x: Any, w: Any, values: dict) -> bool:
    """A conv some dim of which has an output position whose window lies wholly in
    the padding: torch 2.13's CPU float16 conv can crash the process there (a
    segfault, not an exception: ``conv2d`` of a (1, 1, 3, 1) input by a 1x1 kernel,
    stride 2, padding 1, dilation 2; a grouped ``conv1d`` of length 1), whether the
    pattern computes in float16 or a replacement does (``amp_fp16.rw``), so no
    instance holds one (such windows give the bias alone: nothing a rule reads)."""
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)) or not x.is_floating_point() or x.dim() < 3:
        return False
    rank = x.dim() - 2

    def per_dim(v: Any, default: int) -> tuple:
        v = default if v is None else v
        return tuple(v) * (rank if len(v) == 1 else 1) if isinstance(v, (list, tuple)) else (v,) * rank

    padding = values.get("padding", 0)
    if isinstance(padding, str):
        return False  # "valid" pads nothing, "same" keeps every window on the input
    try:
        stride, pad = per_dim(values.get("stride"), 1), per_dim(padding, 0)
        dilation = per_dim(values.get("dilation"), 1)
    except TypeError:
        return False
    for n, k, st, p, d in zip(x.shape[2:], w.shape[2:], stride, pad, dilation):
        if not all(isinstance(v, int) and v > 0 for v in (st, d)) or not isinstance(p, int):
            return False
        out = (n + 2 * p - d * (k - 1) - 1) // st + 1
        if any(all(not 0 <= o * st - p + j * d < n for j in range(k)) for o in range(max(out, 0))):
            return True
    return False


def _deferred(p: Any, parent: str) -> bool:
    """A ``dequantize`` call below another op is built after that op's generator
    ran, from the float value the generator drew for it (quantized with torch's
    observers): a conv of two dequantized tensors needs them to fit together.
    Below ``quantize_per_tensor`` it is built first, so the quantize can reuse its
    quantization parameters (``requantize_same``)."""
    return (isinstance(p, PCall) and parent != "quantize_per_tensor"
            and any(alt.opdef.name in _SEEDED for alt in p.alts))


_SEEDED = {"dequantize"}


class _Builder:
    """Emits a pattern bottom-up into a fresh graph, drawing what it does not fix."""

    def __init__(self, ctx: _Ctx, plan: Plan, dialect: str) -> None:
        self.ctx, self.plan, self.dialect = ctx, plan, dialect
        self.graph = fx.Graph()
        self.root = torch.nn.Module()
        self.values: dict = {}  # node -> concrete value
        self.node_of: dict = {}  # id(tensor) -> node
        self.producers: dict = {}  # id(tensor) -> (op name, arguments)
        self.env: dict = {}  # variable -> node or literal
        self.inputs: list = []

    # -- values the generator gets

    def given(self, p: Any) -> Any:
        if p is None or isinstance(p, PWild):
            return _FREE
        if isinstance(p, PVar):
            if p.name not in self.env:
                return _FREE
            return self._concrete(self.env[p.name])
        if isinstance(p, (PLit, PDefault)):
            return p.value
        if isinstance(p, PCall):
            return self.values[self.call(p)]
        if isinstance(p, PSeq):
            return [self.given(i) for i in p.items]
        if isinstance(p, PResults):  # all the results, read through getitems
            return [self.values[g] for g in self.results(self.call(p.call), p.call.results)]
        raise _Discard(f"unsupported pattern {p!r}")

    def results(self, node: fx.Node, names: tuple, wanted: Any = None) -> list:
        """``getitem(node, i)`` for each result (those in ``wanted``, when given),
        binding the names of ``op(...) as (a, b)``."""
        out = self.values[node]
        if not isinstance(out, (list, tuple)) or len(out) != len(names):
            raise _Discard(f"{len(names)} results wanted, the op gave "
                           f"{len(out) if isinstance(out, (list, tuple)) else 1}")
        getitems = []
        for i, (name, value) in enumerate(zip(names, out)):
            if wanted is not None and i not in wanted:
                continue
            g = self.graph.call_function(operator.getitem, (node, i))
            self.values[g], self.node_of[id(value)] = value, g
            if name != "_":
                self.env[name] = g
            getitems.append(g)
        return getitems

    def _concrete(self, v: Any) -> Any:
        if isinstance(v, fx.Node):
            return self.values[v]
        if isinstance(v, (list, tuple)):
            return type(v)(self._concrete(i) for i in v)
        return v

    # -- turning values into graph operands

    def bind(self, p: Any, v: Any) -> Any:
        if isinstance(p, PVar) and p.name in self.env:
            return self.env[p.name]  # a repeated variable is the same value
        if isinstance(p, PSeq):
            if not isinstance(v, (list, tuple)) or len(v) != len(p.items):
                raise _Discard("sequence of the wrong length")
            return type(v)(self.bind(pi, vi) for pi, vi in zip(p.items, v))
        out = self._operand(v, p.name if isinstance(p, PVar) else None)
        if isinstance(p, PVar):
            self.env[p.name] = out
        return out

    def _operand(self, v: Any, var: str | None) -> Any:
        if isinstance(v, torch.Tensor):
            node = self.node_of.get(id(v))
            if node is None:
                node = self._leaf(v, var)
            return node
        if isinstance(v, (list, tuple)):
            if id(v) in self.node_of:  # the results of a multi-output op (split, max): its node
                return self.node_of[id(v)]
            return type(v)(self._operand(i, None) for i in v)
        return v

    def _leaf(self, t: torch.Tensor, var: str | None) -> fx.Node:
        if var is not None and var not in self.plan.consts and var in self.plan.producers:
            node = self._produce(t, self.plan.producers[var])
            if node is not None:
                return node
        if var is not None and var in self.plan.consts:
            return self._constant(t, var, param=var in self.plan.params)
        return self._placeholder(t, var)

    def _placeholder(self, t: torch.Tensor, var: str | None = None) -> fx.Node:
        node = self.graph.placeholder(var or f"t{len(self.values)}")
        self.inputs.append(t)
        self.values[node], self.node_of[id(t)] = t, node
        return node

    def _constant(self, t: torch.Tensor, var: str | None = None, param: bool = False) -> fx.Node:
        name = var or f"c{len(self.values)}"
        if keyword.iskeyword(name) or hasattr(self.root, name):  # `forward`, `training`, `lambda`
            name = f"const_{name}"
        while hasattr(self.root, name):
            name += "_"
        if param and t.is_floating_point():
            self.root.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
        else:
            self.root.register_buffer(name, t)
        node = self.graph.get_attr(name)
        self.values[node], self.node_of[id(t)] = t, node
        return node

    # -- values computed in the graph (where-clause hints)

    def _emit(self, op: str, operands: dict) -> fx.Node:
        """``op`` (a vocabulary op) on ``operands`` (nodes and literals), emitted and run."""
        from rewrite.ops import lookup_op

        opdef = lookup_op(op)
        full = {p.name: operands.get(p.name, p.default) for p in opdef.params}
        try:
            target, cargs, ckwargs = opdef.emit[self.dialect](full, self.values.get)
            concrete = _plain(fx.node.map_arg((cargs, ckwargs), self.values.__getitem__))
            with torch.no_grad():
                trapping_division(concrete[0], concrete[1])
                out = target(*concrete[0], **concrete[1])
        except Exception as err:  # noqa: BLE001 - values that do not fit
            raise _Discard(f"{op}: {type(err).__name__}: {err}") from None
        node = self.graph.call_function(target, tuple(cargs), dict(ckwargs))
        self.values[node], self.node_of[id(out)] = out, node
        self.producers[id(out)] = (op, {k: self._concrete(v) for k, v in full.items()})
        return node

    def _produce(self, t: torch.Tensor, ops: tuple) -> fx.Node | None:
        """A node that computes a tensor like ``t`` (same shape and dtype) with one of
        ``ops``, from fresh inputs: what ``produced_by(y, "conv", "linear")``,
        ``dequantized(x)`` and ``has_qparams(x, s, z)`` ask for. None: a graph input."""
        choices = [o for o in ops if o in _PRODUCERS and _PRODUCERS[o][0](t)]
        if not choices:
            return None
        return _PRODUCERS[self.ctx.pick(choices)][1](self, t)

    # -- one call

    def call(self, p: PCall, seed: Any = None) -> fx.Node:
        alts = [alt for alt in p.alts if generator_for(alt.opdef) is not None]
        alt = self.ctx.pick(range(len(alts))) if len(alts) > 1 else 0
        alt = alts[alt]
        opdef, pats = alt.opdef, dict(alt.args)
        given, deferred = {}, {}
        for param in opdef.params:
            pat = pats.get(param.name)
            if _deferred(pat, opdef.name):
                given[param.name], deferred[param.name] = _FREE, pat
            elif isinstance(pat, PSeq) and any(_deferred(i, opdef.name) for i in pat.items):
                given[param.name] = [_FREE if _deferred(i, opdef.name) else self.given(i) for i in pat.items]
                deferred[param.name] = pat
            else:
                given[param.name] = self.given(pat)
        variables = {name: pat.name for name, pat in pats.items() if isinstance(pat, PVar)}
        for name, pat in deferred.items():  # dequantize(acc): the variable it reads
            inner = dict(pat.alts[0].args).get("input") if isinstance(pat, PCall) else None
            if isinstance(inner, PVar):
                variables[name] = inner.name
        partners = (self._concrete(self.env[o]) for o in sorted(self.plan.partners.get(p.name, ())) if o in self.env)
        args = _Args(self.ctx, opdef.name, given, self.producers, seed, variables, self.plan, opdef.instances,
                     output=p.name, partner_shapes=[tuple(v.shape) for v in partners if isinstance(v, torch.Tensor)])
        try:
            drawn = generator_for(opdef)(self.ctx, args)
        except (TypeError, ValueError, IndexError, KeyError, AttributeError, ZeroDivisionError,
                RuntimeError) as err:
            # values the pattern fixed that the generator cannot build around
            raise _Discard(f"{opdef.name}: cannot draw its arguments ({type(err).__name__}: {err})") from None
        values = {}
        for param in opdef.params:
            v = drawn.get(param.name, given[param.name])
            if v is _FREE:
                strategy = literal_strategy(opdef.instances, param.name)
                near = self.plan.bounds.get(variables.get(param.name), ())
                if near and (strategy is not None or param.default is not REQUIRED):
                    # about the where clause's bound, half the time (Plan.bounds)
                    strategy = strategies().sampled_from(near) | (
                        strategy if strategy is not None else strategies().just(param.default))
                if strategy is not None:
                    v = self.ctx.draw(strategy)
                elif param.default is not REQUIRED:
                    v = param.default
                else:
                    raise _Discard(f"cannot draw argument {param.name!r} of {opdef.name}")
            values[param.name] = v
        for name, pat in deferred.items():  # built from what the generator drew for them
            v = values[name]
            if isinstance(pat, PSeq):
                if not isinstance(v, (list, tuple)) or len(v) != len(pat.items):
                    raise _Discard("sequence of the wrong length")
                values[name] = type(v)(self._seeded(pi, vi) if _deferred(pi, opdef.name) else vi
                                       for pi, vi in zip(pat.items, v))
            else:
                values[name] = self._seeded(pat, v)
        if opdef.name == "conv" and _conv_over_padding_only(self._concrete(values.get("input")),
                                                            self._concrete(values.get("weight")), values):
            raise _Discard("a conv with windows that read padding only (torch's float16 conv crashes there)")
        operands = {name: self.bind(pats.get(name), v) for name, v in values.items()}
        try:
            target, cargs, ckwargs = opdef.emit[self.dialect](operands, self.values.get)
        except Exception as err:  # noqa: BLE001 - arguments this dialect cannot spell
            raise _Discard(f"{opdef.name} cannot be emitted: {err}") from None
        node = self.graph.call_function(target, tuple(cargs), dict(ckwargs))
        try:
            concrete = _plain(fx.node.map_arg((cargs, ckwargs), self.values.__getitem__))
            with torch.no_grad():
                trapping_division(concrete[0], concrete[1])
                out = target(*concrete[0], **concrete[1])
        except Exception as err:  # noqa: BLE001 - shapes or values that do not fit
            raise _Discard(f"{opdef.name}: {type(err).__name__}: {err}") from None
        if not _tensors(out):
            raise _Discard(f"{opdef.name} did not return a tensor (or a tuple of them)")
        self.values[node], self.node_of[id(out)] = out, node
        self.producers[id(out)] = (opdef.name, values)
        if p.name is not None:
            self.env[p.name] = node
        return node

    def _seeded(self, p: PCall, v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            raise _Discard(f"{p.alts[0].opdef.name} of a non-tensor")
        return self.values[self.call(p, seed=v)]

    def finish(self, root: fx.Node, name: str | None = None) -> Instance:
        # The program consumes the root rather than returning it: a rewrite never lets
        # the graph return a module constant (rewrite.engine.replace refuses), and folds
        # into constants must still be verifiable. A root the where clause wants
        # quantized (output_quantized(c)) is quantized first.
        results = self.plan.rule.pattern.results
        if results is not None:  # a multi-output root: the results the replacement gives
            return self._finish_results(root, results)
        last = root
        value = self.values[root]
        if name is not None and name in self.plan.quantized_outputs and _is_float(value):
            scale, zero_point = _activation_qparams(value, torch.quint8)
            last = self._emit("quantize_per_tensor", {"input": root, "scale": scale, "zero_point": zero_point,
                                                      "dtype": torch.quint8})
        clone = torch.ops.aten.clone.default if self.dialect == "aten" else torch.clone
        out = self.graph.call_function(clone, (last,))
        self.values[out] = self.values[last]
        self.graph.output(out)
        self._mark_rule_made()
        gm = fx.GraphModule(self.root, self.graph)
        bindings = {k: self._concrete(v) for k, v in self.env.items()}
        return Instance(self.plan.rule.name, gm, tuple(self.inputs), bindings, self.ctx.dtype, self.dialect)


    def _mark_rule_made(self) -> None:
        """The nodes ``rule_made(u)`` asks about marked as a rule's (an instance's
        nodes are otherwise the model's own, and the clause would hold on none)."""
        for name in self.plan.rule_made:
            node = self.env.get(name)
            if isinstance(node, fx.Node):
                node.meta[RULE_KEY] = ("verify", None)

    def _finish_results(self, root: fx.Node, names: tuple) -> Instance:
        replacement = self.plan.rule.replacement
        given = range(len(names)) if not isinstance(replacement, RResults) else \
            [i for i, item in enumerate(replacement.items) if item is not None]
        clone = torch.ops.aten.clone.default if self.dialect == "aten" else torch.clone
        outs = []
        for g in self.results(root, names, set(given)):
            outs.append(self.graph.call_function(clone, (g,)))
            self.values[outs[-1]] = self.values[g]
        self.graph.output(tuple(outs))
        self._mark_rule_made()
        gm = fx.GraphModule(self.root, self.graph)
        bindings = {k: self._concrete(v) for k, v in self.env.items()}
        return Instance(self.plan.rule.name, gm, tuple(self.inputs), bindings, self.ctx.dtype, self.dialect)


# ---------------------------------------------------------------- producers (where-clause hints)


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not t.is_quantized and t.dtype.is_floating_point


def _produce_binary(op: str) -> Callable:
    def build(b: _Builder, t: torch.Tensor) -> fx.Node:
        other = b.ctx.tensor(tuple(t.shape), dtype=t.dtype)
        return b._emit(op, {"input": b._placeholder(t), "other": b._placeholder(other)})
    return build


def _produce_linear(b: _Builder, t: torch.Tensor) -> fx.Node:
    k = b.ctx.int(1, 4)
    x = b.ctx.tensor((*t.shape[:-1], k), dtype=t.dtype)
    w = b.ctx.tensor((t.shape[-1], k), dtype=t.dtype)
    bias = b._constant(b.ctx.tensor((t.shape[-1],), dtype=t.dtype)) if b.ctx.coin() else None
    return b._emit("linear", {"input": b._placeholder(x), "weight": b._constant(w), "bias": bias})


def _produce_conv(b: _Builder, t: torch.Tensor) -> fx.Node:
    """A 1x1 conv: the output has the input's spatial shape."""
    c_in = b.ctx.int(1, 3)
    x = b.ctx.tensor((t.shape[0], c_in, *t.shape[2:]), dtype=t.dtype)
    w = b.ctx.tensor((t.shape[1], c_in, *([1] * (t.dim() - 2))), dtype=t.dtype)
    bias = b._constant(b.ctx.tensor((t.shape[1],), dtype=t.dtype)) if b.ctx.coin() else None
    return b._emit("conv", {"input": b._placeholder(x), "weight": b._constant(w), "bias": bias})


def _produce_dequantize(b: _Builder, t: torch.Tensor) -> fx.Node:
    q = _quantize_activation(t)
    return b._emit("dequantize", {"input": b._placeholder(q)})


def _produce_quantize(b: _Builder, t: torch.Tensor) -> fx.Node:
    """``quantize_per_tensor`` of a float input with literal parameters: the graph
    says what the quantized tensor's scale and zero point are."""
    return b._emit("quantize_per_tensor", {"input": b._placeholder(t.dequantize()), "scale": t.q_scale(),
                                           "zero_point": t.q_zero_point(), "dtype": t.dtype})


def _per_tensor(t: torch.Tensor) -> bool:
    return t.is_quantized and t.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric)


#: op -> (whether it can compute a tensor like t, how)
_PRODUCERS = {
    "add": (_is_float, _produce_binary("add")),
    "mul": (_is_float, _produce_binary("mul")),
    "linear": (lambda t: _is_float(t) and t.dim() >= 1, _produce_linear),
    "conv": (lambda t: _is_float(t) and t.dim() in (3, 4, 5), _produce_conv),
    "dequantize": (lambda t: _is_float(t) and t.dtype == torch.float32, _produce_dequantize),
    "quantize_per_tensor": (lambda t: isinstance(t, torch.Tensor) and _per_tensor(t), _produce_quantize),
}


# ---------------------------------------------------------------- quantized values (torch's observers)


def _activation_qparams(t: torch.Tensor, dtype: torch.dtype = torch.quint8, quant_min: int | None = None,
                        quant_max: int | None = None) -> tuple:
    """(scale, zero point) torch's ``MinMaxObserver`` computes for ``t``'s finite
    values (per-tensor affine; 7 bits on CPUs without VNNI, as the activation
    observers of ``rules/quant`` do, unless the range is given)."""
    import warnings

    from rewrite.functions.quant import FiniteMinMaxObserver, vnni_available

    kwargs: dict = {"dtype": dtype}
    if quant_min is not None:
        kwargs.update(quant_min=quant_min, quant_max=quant_max)
    else:
        kwargs["reduce_range"] = not vnni_available()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        obs = FiniteMinMaxObserver(**kwargs)
        obs(t.detach().float())
        if not bool(torch.isfinite(obs.min_val)):  # nothing finite seen
            obs(torch.zeros(1))
        scale, zero_point = obs.calculate_qparams()
    return float(scale), int(zero_point)


def _quantize_activation(t: torch.Tensor, dtype: torch.dtype = torch.quint8) -> torch.Tensor:
    scale, zero_point = _activation_qparams(t, dtype)
    return torch.quantize_per_tensor(t.detach().float(), scale, zero_point, dtype)


def _quantize_weight(t: torch.Tensor) -> torch.Tensor:
    """Per-channel symmetric int8 (torch's ``PerChannelMinMaxObserver``, what
    ``quantize_weight`` in the quant rules does); per-tensor below rank 2."""
    from rewrite.functions.quant import quantize_weight

    w = t.detach().float().nan_to_num(nan=0.0, posinf=4.0, neginf=-4.0)
    return quantize_weight(w, "per_channel_symmetric" if w.dim() >= 2 else "per_tensor_symmetric")


def draw_instance(draw: Callable, plan: Plan, attempts: int = 3, shapes: str | None = None,
                  wide: float = 0.0, offset: float = 0.0) -> Instance | str:
    """An instance, or the reason the drawn one is not a valid program.

    A drawn instance that is not a program (an op rejects the dtype drawn, shapes
    that do not fit) is drawn again, with a fresh dtype, up to ``attempts`` times:
    every draw comes from ``draw``, so hypothesis replays and shrinks it. ``shapes``:
    None, ordinary shapes only; ``"mixed"``, also (a tenth of the time each) 0-d
    tensors and dims of size 0 where the ops take them; ``"scalar"``, ``"empty"``:
    mostly those; ``"strided"``: tensors of rank 2 and more, none contiguous (dims
    laid out in reverse order); ``"long"``: every dim of a shape just past a power of two
    (33 or 65; rank up to 3), where a literal size (``slice(x, 1, 0, 16) => x``) is
    wrong, on any dim. ``wide``: float tensors' ranges scaled by this
    magnitude (``Instance.wide``); ``offset``: float tensors drawn about this value
    (``Instance.offset``)."""
    st = strategies()
    dtypes = st.sampled_from(plan.dtypes)
    if plan.favoured:  # what the where clause asks for, at least half the time
        dtypes = st.sampled_from(plan.favoured) | dtypes
    why = "no instance drawn"
    for _ in range(attempts):
        dtype = draw(dtypes)
        dialect = draw(st.sampled_from(("torch", "aten")))
        # quantizing NaN or an infinity is not defined: quantized patterns meet finite values
        ctx = _Ctx(draw, dtype, specials=plan.tolerance == "exact" and not plan.quantized,
                   int_specials=not plan.quantized, shapes=shapes, wide=wide, offset=offset,
                   literals=plan.literal_ints)
        builder = _Builder(ctx, plan, dialect)
        try:
            inst = builder.finish(builder.call(plan.rule.pattern), plan.rule.pattern.name)
        except _Discard as err:
            why = str(err)
            continue
        if plan.quantized:
            inst = attrs.evolve(inst, engine=draw(st.sampled_from(quantized_engines())))
        return attrs.evolve(inst, wide=bool(wide), offset=bool(offset)) if wide or offset else inst
    return why


def quantized_engines() -> tuple:
    """The quantized engines instances of quantized patterns are drawn with."""
    supported = torch.backends.quantized.supported_engines
    return tuple(e for e in ("x86", "onednn", "fbgemm") if e in supported)[:2] or (torch.backends.quantized.engine,)


def instances(rule: CompiledRule, accept: Callable | None = None, attempts: int = 10) -> Any:
    """A hypothesis strategy of ``Instance``s of ``rule``'s pattern.

    Drawn instances that are not valid programs, or that ``accept`` (if given)
    refuses, are drawn again, up to ``attempts`` times before hypothesis is told to
    reject the example. Raises ValueError when an op of the pattern has no generator.
    """
    plan = plan_for(rule)
    if plan.unsupported:
        raise ValueError(f"rule {rule.name!r}: {plan.unsupported}")

    def draw_one(draw: Callable) -> Instance:
        for _ in range(attempts):
            inst = draw_instance(draw, plan)
            if isinstance(inst, Instance) and (accept is None or accept(inst)):
                return inst
        hypothesis_api().reject()

    return strategies().composite(draw_one)()
