"""Built-in predicates, queries and rewrite-time functions that rule files may name.

Predicates and queries receive ``rewrite.engine.facts.Value`` objects. One that cannot
tell (no shape information on the node) returns None: the fact is *unknown*, and the
where clause is evaluated in three-valued logic (``not unknown`` and any comparison
with an unknown side stay unknown), so a rule whose constraint cannot be decided
does not fire, negated or not.

Rewrite-time constants use torch's own math (``torch.nn.utils.fusion``) rather than
hand-written formulas. A fold computes in at least float32 (as torch's half-precision
batch norm does) and is refused when a constant it makes cannot be held in the
model's dtype: a folding function raises ``FoldOverflowError`` (the replacement is
not built, the rule does not fire) rather than hand the graph an inf or a NaN.
"""

from __future__ import annotations

import math

from typing import Any, Callable, Optional

import torch
from torch.nn.utils import fusion as _fusion

from rewrite.engine.facts import Value
from rewrite.engine.replace import RULE_KEY
from rewrite.ops.vocabulary import bind_node, forms_for_node
from rewrite.functions.registry import (
    register_constant,
    register_module,
    register_predicate,
    register_query,
)

__all__ = ["overflows"]  # the rest is reached through the registry

# ---------------------------------------------------------------- predicates


@register_predicate(local=True)
def const(value: Value, *more: Value) -> bool:
    """All arguments (one at least) are constants: parameters, buffers or literals."""
    return value.is_const and all(v.is_const for v in more)


@register_predicate(local=True)
def is_param(x: Value) -> bool:
    """A parameter of the module (not a buffer, not a literal)."""
    return x.qualname is not None and x.qualname in x.facts.param_names


@register_predicate(local=True)
def is_buffer(x: Value) -> bool:
    """A buffer of the module (running statistics, frozen weights)."""
    return x.qualname is not None and x.qualname not in x.facts.param_names


@register_predicate(local=True)
def is_literal(x: Value) -> bool:
    """A literal written in the graph (int, float, bool, None, tuple...)."""
    return x.is_literal


@register_predicate(local=True)
def is_finite_number(x: Value) -> bool:
    """A finite int or float literal (not a bool, not inf or NaN): ``x + a * 0`` is
    ``x`` only for such an ``a`` (``inf * 0`` is NaN)."""
    v = x.operand if x.is_literal else None
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@register_predicate(local=True)
def is_none(x: Value) -> bool:
    """The literal None (e.g. a conv without bias)."""
    return x.is_literal and x.operand is None


@register_predicate(local=True)
def is_tensor(x: Value) -> bool:
    """A tensor: a graph value or a constant tensor."""
    return x.meta is not None or x.node is not None


@register_predicate()
def single_use(x: Value) -> bool:
    """The node has exactly one user."""
    return x.node is not None and x.users == 1


@register_predicate(local=True)
def is_float(x: Value) -> bool:
    """A floating-point tensor (known from shape information)."""
    m = x.meta
    if m is None:
        return False if x.is_literal else None  # a literal is no tensor; a graph value: unknown
    return m.dtype.is_floating_point


@register_predicate(local=True)
def is_contiguous(x: Value) -> bool:
    """A tensor laid out contiguously (row-major; known from its recorded strides).
    Rules that skip a copy rely on it: a reshape of a transposed tensor copies into
    a contiguous one, the tensor itself keeps its strides (``out.view(-1)`` fails).
    Unknown in an export graph for a value whose strides may follow a graph input's
    (the program accepts inputs of any strides; the example's say nothing). In a
    symbolic_trace graph the example's run recorded it, as it recorded shapes and
    dtypes: the rewrite holds for inputs laid out as the example's."""
    m = x.meta
    if m is None:
        return False if x.is_literal else None
    recorded = getattr(m, "contiguous", None)  # TensorFacts (symbolic_trace graphs)
    if isinstance(recorded, bool):
        return recorded
    if x.node is not None and _layout_from_inputs(x.node, x.facts.gm):
        return None  # torch.export accepts inputs of any strides, or sizes that lay it out otherwise
    try:
        return bool(m.is_contiguous())
    except (AttributeError, TypeError, RuntimeError, NotImplementedError):  # metadata without strides
        return None


#: ops that lay their result out afresh, not in their input's strides: contiguous, or
#: (convolutions, pooling, batch norm) in the input's memory format, which for a 4-d
#: input is taken from the example (a channels_last input makes channels_last results).
#: Not attention: scaled_dot_product_attention lays its output out as q (HF's q is a
#: transposed view), so the walk goes on to q
_FRESH_LAYOUT = frozenset({
    "linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "embedding", "contiguous", "conv",
    "conv_transpose", "batch_norm", "group_norm", "layer_norm", "rms_norm", "max_pool2d", "avg_pool2d",
    "adaptive_avg_pool2d", "interpolate", "sum", "mean", "amax",
    "linalg_vector_norm", "cat", "stack", "topk", "max"})
_LAYOUT_WALK = 256  # nodes looked at before the answer is "may follow": unknown


def _layout_from_inputs(node: Any, gm: Any) -> bool:
    """Whether ``node``'s strides may follow those of a graph input, or the sizes the
    program is called with: a metadata graph (export) records the example's strides,
    and the program accepts others (``x.t()`` for ``x``), which elementwise ops,
    views, clones and casts carry on; and a ``reshape`` of a value not laid out
    contiguously copies or views by its sizes (a symbolic batch of 1 makes it a
    strided view where the example's 2 made a contiguous copy). Walks back until an
    op that lays its result out afresh (``_FRESH_LAYOUT``), a constant, or too far
    (then it may)."""
    def step(n: Any) -> Any:
        if n.op == "placeholder":
            return True
        if n.op == "get_attr":
            return _STOP
        if not any(form.op in _LAYOUT_OPS for _, form in forms_for_node(n, gm)):
            return _GO_ON  # carries its input's layout on however it binds (add, gelu...): no binding needed
        ops = bind_node(n, gm)
        if any(b.op in _RESHAPING for b in ops) and _copy_by_size(n):
            return True
        return _STOP if any(b.op in _FRESH_LAYOUT for b in ops) else _GO_ON

    return _walk_back(node, step, _LAYOUT_WALK, too_far=True, done=False)


_STOP, _GO_ON = object(), object()
#: ops that view their input where its strides allow, and copy it otherwise
_RESHAPING = frozenset({"reshape", "flatten", "reshape_as", "unflatten"})
_LAYOUT_OPS = _FRESH_LAYOUT | _RESHAPING


def _copy_by_size(node: Any) -> bool:
    """Whether a reshaping ``node`` may copy at some sizes and view at others: its
    input is not known to be contiguous (a contiguous one is always viewed) and a
    size is symbolic (the example's sizes chose for every size)."""
    source = node.args[0] if node.args else None
    meta = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if not isinstance(meta, torch.Tensor):
        return True
    result = node.meta.get("val")
    shapes = (*meta.shape, *(result.shape if isinstance(result, torch.Tensor) else ()))
    if not any(isinstance(d, torch.SymInt) for d in shapes):
        return False
    try:
        return not (meta.is_contiguous() is True)
    except (RuntimeError, NotImplementedError, TypeError):
        return True


def _walk_back(node: Any, step: Callable, limit: int, too_far: Any, done: Any) -> Any:
    """Walk from ``node`` to the nodes it is computed from: ``step(n)`` says ``_STOP``
    (not past ``n``), ``_GO_ON`` (on to its inputs) or gives the answer. ``too_far``
    once more than ``limit`` nodes are seen, ``done`` when every way stopped."""
    seen, todo = {node}, [node]
    while todo:
        n = todo.pop()
        if len(seen) > limit:
            return too_far
        verdict = step(n)
        if verdict is _STOP:
            continue
        if verdict is not _GO_ON:
            return verdict
        for i in n.all_input_nodes:
            if i not in seen:
                seen.add(i)
                todo.append(i)
    return done


@register_predicate(local=True)
def same_shape(a: Value, b: Value) -> bool:
    """Both tensors have the same, known shape."""
    ma, mb = a.meta, b.meta
    if ma is None or mb is None:
        return False if a.is_literal or b.is_literal else None
    return tuple(ma.shape) == tuple(mb.shape)


@register_predicate(local=True)
def same_dtype(a: Value, b: Value) -> bool:
    """Both tensors have the same, known dtype."""
    ma, mb = a.meta, b.meta
    if ma is None or mb is None:
        return False if a.is_literal or b.is_literal else None
    return ma.dtype == mb.dtype


@register_predicate(local=True)
def is_observer(x: Value) -> bool:
    """The value is produced by a quantization observer or stub module."""
    node = x.node
    if node is None or node.op != "call_module":
        return False
    mod = x.facts.gm.get_submodule(node.target)
    from torch.ao.quantization import DeQuantStub, QuantStub
    from torch.ao.quantization.observer import ObserverBase

    return isinstance(mod, (ObserverBase, QuantStub, DeQuantStub))


@register_predicate(local=True)
def is_identity_perm(dims: Value) -> bool:
    """A permutation literal that leaves every dim in place: (0, 1, 2, ...)."""
    d = dims.literal
    if not isinstance(d, (list, tuple)):
        return False
    for i, v in enumerate(d):
        if v != i:
            return False
    return True


@register_predicate(local=True)
def perms_cancel(a: Value, b: Value) -> bool:
    """Applying permutation ``a`` then ``b`` gives the identity."""
    pa, pb = a.literal, b.literal
    if not isinstance(pa, (list, tuple)) or not isinstance(pb, (list, tuple)) or len(pa) != len(pb):
        return False
    n = len(pa)
    try:
        return [pa[pb[i] % n] % n for i in range(n)] == list(range(n))
    except (TypeError, IndexError):
        return False


@register_predicate(local=True)
def is_noop_transpose(x: Value, d0: Value, d1: Value) -> bool:
    """``transpose(x, d0, d1)`` with d0 and d1 the same dim (rank known)."""
    m = x.meta
    a, b = d0.literal, d1.literal
    if not isinstance(a, int) or not isinstance(b, int):
        return False
    if m is None:
        return None
    return a % len(m.shape) == b % len(m.shape)


@register_predicate(local=True)
def transposes_cancel(x: Value, a0: Value, a1: Value, b0: Value, b1: Value) -> bool:
    """``transpose(transpose(x, a0, a1), b0, b1)`` is the identity: same dim pair."""
    m = x.meta
    dims = [v.literal for v in (a0, a1, b0, b1)]
    if not all(isinstance(d, int) for d in dims):
        return False
    if m is None:
        return None
    r = len(m.shape)
    return {dims[0] % r, dims[1] % r} == {dims[2] % r, dims[3] % r}


@register_predicate(local=True)
def reshape_is_noop(x: Value, shape: Value) -> bool:
    """Reshaping ``x`` to ``shape`` keeps its known shape exactly."""
    s = shape.literal
    if not isinstance(s, (list, tuple)):
        return False
    inferred = 0
    for d in s:  # plain loops: this predicate meets every view of a transformer
        if not isinstance(d, int):
            return False
        inferred += d == -1
    m = x.meta
    if m is None:
        return None
    have = m.shape
    if len(s) != len(have) or inferred > 1:
        return False
    for d, h in zip(s, have):
        if d != h and d != -1:
            return False
    return True


@register_predicate(local=True)
def broadcasts_to(x: Value, y: Value) -> bool:
    """``y`` (a tensor or scalar) broadcast against ``x`` leaves x's known shape and
    dtype unchanged, so ``x + 0``-style identities are exact."""
    mx = x.meta
    if mx is None:
        return False if x.is_literal else None
    my = y.meta
    if my is None:
        number = y.operand if y.is_literal else None
        if not isinstance(number, (int, float)) or isinstance(number, bool):
            return False
        # a number leaves the shape, and the dtype unless it is of a wider kind
        # (``x + 0.0`` of an int64 ``x`` is float32)
        return torch.result_type(torch.empty(0, dtype=mx.dtype), number) == mx.dtype
    try:
        shape = torch.broadcast_shapes(tuple(mx.shape), tuple(my.shape))
    except RuntimeError:
        return False
    return tuple(shape) == tuple(mx.shape) and torch.promote_types(mx.dtype, my.dtype) == mx.dtype


_FLOAT_WIDTH = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
_INT_BITS = {torch.bool: 1, torch.uint8: 8, torch.int8: 8, torch.int16: 16, torch.int32: 32, torch.int64: 64}


@register_predicate(local=True)
def lossless_cast(x: Value, to: Value) -> bool:
    """Casting ``x`` (dtype known) to dtype ``to`` keeps every value exactly, so a
    cast back restores it (bf16 -> f32, f16 -> f32, f32 -> f64, int8 -> int32...)."""
    m, target = x.meta, to.literal
    if not isinstance(target, torch.dtype):
        return False
    if m is None:
        return False if x.is_literal else None
    src = m.dtype
    if src == target:
        return True
    if src in _FLOAT_WIDTH and target in _FLOAT_WIDTH:
        # f16 and bf16 are not subsets of each other; both fit in f32.
        return _FLOAT_WIDTH[target] > _FLOAT_WIDTH[src]
    if src in _INT_BITS and target in _INT_BITS:
        signed_src, signed_dst = src not in (torch.bool, torch.uint8), target not in (torch.bool, torch.uint8)
        if signed_src and not signed_dst:
            return False
        return _INT_BITS[target] > _INT_BITS[src] or (target == src)
    if src in _INT_BITS and target in _FLOAT_WIDTH:
        mantissa = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}[target]
        return _INT_BITS[src] <= mantissa
    return False


#: ops on no torch.autocast list (CPU or CUDA: lower precision, float32, promote):
#: they compute in their inputs' dtype whether autocast is on or not. Division is not
#: among them (a number divided by a tensor is a reciprocal, on CUDA's float32 list).
_AUTOCAST_NEUTRAL = frozenset({
    "abs", "add", "sub", "mul", "neg", "relu", "relu6", "hardtanh", "leaky_relu", "gelu", "silu", "sigmoid",
    "tanh", "hardswish", "clamp", "masked_fill", "dropout", "identity", "getitem", "chunk", "split", "clone",
    "contiguous", "expand", "expand_as", "flatten", "permute", "reshape", "reshape_as", "select", "slice",
    "squeeze", "unsqueeze", "t", "transpose", "view", "numpy_T", "max_pool2d", "amax", "max", "type_as",
})
_AUTOCAST_WALK = 256  # nodes looked at before the answer is "unknown"


@register_predicate()
def autocast_proof(x: Value) -> bool | None:
    """``x`` has the same dtype whether the graph runs under ``torch.autocast`` or not:
    no op on its way from the graph's inputs and constants changes dtype under
    autocast (a linear, a conv, a softmax do; relu, add, views do not; an explicit
    cast ``to(y, dtype)`` fixes the dtype whatever ``y`` is). The dtype facts of
    the other values were recorded without autocast: removing a model's
    ``logits.float()`` because ``logits`` is float32 changes the dtype the caller
    gets when it runs the result under autocast. Every value of an ATen graph
    (``torch.export``, dynamo's AOT and Inductor graphs) is: those captures resolve
    autocast into explicit casts (export asserts each cast's input dtype, dynamo
    guards on the autocast state). None when the walk is too long."""
    node = x.node
    if node is None:
        return True  # a literal or a constant: autocast changes neither
    if x.facts.dialect == "aten":
        return True
    gm = x.facts.gm

    def step(n: Any) -> Any:
        if n.op in ("placeholder", "get_attr"):
            return _STOP
        bound = bind_node(n, gm)
        if any(b.op == "to" and isinstance(b.args.get("dtype"), torch.dtype) for b in bound):
            return _STOP
        return False if not bound or any(b.op not in _AUTOCAST_NEUTRAL for b in bound) else _GO_ON

    return _walk_back(node, step, _AUTOCAST_WALK, too_far=None, done=True)


@register_predicate(local=True)
def rule_made(x: Value) -> bool:
    """``x`` was computed by a node a rule made (a cast the AMP rules inserted, in this
    rewrite or an earlier one: results keep each new node's rule in its metadata),
    not by one the model wrote."""
    return x.node is not None and RULE_KEY in x.node.meta


# ---------------------------------------------------------------- queries


@register_query()
def users(x: Value) -> int:
    """Number of users of the node (0 for constants and literals)."""
    return x.users


@register_query(local=True)
def dtype(x: Value) -> Optional[torch.dtype]:
    """The tensor's dtype, or None when unknown."""
    m = x.meta
    return None if m is None else m.dtype


@register_query(local=True)
def rank(x: Value) -> Optional[int]:
    """The tensor's number of dims, or None when unknown."""
    m = x.meta
    return None if m is None else len(m.shape)


@register_query(local=True)
def shape(x: Value) -> Optional[tuple]:
    """The tensor's shape as a tuple, or None when unknown."""
    m = x.meta
    return None if m is None else tuple(m.shape)


@register_query(local=True)
def numel(x: Value) -> Optional[int]:
    """The tensor's number of elements, or None when unknown."""
    m = x.meta
    if m is None:
        return None
    n = 1
    for d in m.shape:
        n *= d
    return n


@register_query(local=True)
def device(x: Value) -> Optional[str]:
    """The tensor's device type as a string (``"cpu"``, ``"cuda"``), or None."""
    m = x.meta
    dev = getattr(m, "device", None)
    return None if dev is None else torch.device(dev).type


@register_query(local=True)
def value(x: Value) -> Any:
    """The literal itself (for comparing a bound literal: ``value(p) == 0.0``)."""
    return x.literal


# ---------------------------------------------------------------- constants (rewrite time)


class FoldOverflowError(ValueError):
    """A rewrite-time constant cannot be held in its dtype (it would be inf or NaN
    where the values it is folded from were finite): the fold is refused, so the
    rule does not fire."""


def _wide(t: Any) -> Any:
    """``t`` in at least float32: folds are computed there and rounded once. A bool
    tensor too (bool has no subtraction; no batch norm computes on bool but an empty
    one, which verification meets)."""
    if isinstance(t, torch.Tensor) and (t.dtype == torch.bool or (
            t.is_floating_point() and torch.finfo(t.dtype).bits < 32)):
        return t.float()
    return t


def _fold_dtype(*values: Any) -> Any:
    """The dtype plain torch math on ``values`` gives (their promotion), or None."""
    dtype = None
    for v in values:
        if isinstance(v, torch.Tensor):
            dtype = v.dtype if dtype is None else torch.promote_types(dtype, v.dtype)
    return dtype


def _held(t: Any, dtype: Any, name: str, source: Any = None, out_dim: int = 0) -> Any:
    """The folded constant ``t`` rounded to ``dtype``, detached; ``FoldOverflowError``
    when it is not finite there (an overflow, or a NaN the fold made), or when the
    rounding loses digits the model kept (``_rounding_loses``: ``source`` is the
    weight ``t`` scales element by element, ``out_dim`` its output channels' dim)."""
    out = t.detach() if dtype is None or t.dtype == dtype else t.detach().to(dtype)
    if out.is_floating_point() and not _all_finite(out):
        raise FoldOverflowError(f"{name}: the folded constant is not finite in {dtype or out.dtype} "
                                f"(it overflows, or the values it folds are not finite): not folded")
    if out is not t and out.is_floating_point() and t.is_floating_point() \
            and _rounding_loses(t.detach(), out, source, out_dim):
        raise FoldOverflowError(f"{name}: the folded constant underflows {out.dtype} (its values fall below the "
                                f"dtype's normal range and lose their digits): not folded")
    return out


def _rounding_loses(exact: torch.Tensor, rounded: torch.Tensor, source: Any = None, out_dim: int = 0) -> bool:
    """Whether rounding a folded constant to a narrower dtype loses more than rounding
    in the dtype's normal range does. Per output channel (a bias or a scalar as a
    whole), the largest error must stay within 4 epsilons of the channel's largest
    value; for a weight scaled element by element from ``source`` (a batch norm's
    scale folded in), the error is measured back in the source's terms (divided by
    the scale): a tiny scale for one channel (a float16 fold of gamma 1e-4, whose
    weights land among subnormals) loses digits, while weights the model itself
    keeps tiny (a dead input channel) lose nothing they had."""
    if rounded.numel() == 0 or torch.finfo(rounded.dtype).bits >= torch.finfo(exact.dtype).bits:
        return False
    error = (rounded.to(exact.dtype) - exact).abs()
    bound = 4 * torch.finfo(rounded.dtype).eps
    if exact.dim() < 2:
        return bool(error.max() > bound * exact.abs().max())
    magnitude = exact.abs()
    if isinstance(source, torch.Tensor) and source.shape == exact.shape:
        weight = source.detach().to(exact.dtype).abs()
        error = torch.where(magnitude > 0, error * weight / magnitude.clamp_min(torch.finfo(exact.dtype).tiny),
                            error)
        magnitude = weight
    others = tuple(d for d in range(exact.dim()) if d != out_dim)
    return bool((error.amax(dim=others) > bound * magnitude.amax(dim=others)).any())


def _all_finite(t: torch.Tensor) -> bool:
    """No inf or NaN in ``t``. A finite sum proves it (inf and NaN reach the sum) in
    one reduction, without the boolean tensor ``isfinite`` makes (a third of a
    ResNet-50 fold's time); a sum that overflows is settled element by element."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _memo_last(fn: Any) -> Any:
    """Remember the last result: a fold computes weight and bias in two calls with
    the same arguments, and torch's math returns both at once. Called as
    ``fn(part, *args)``, it returns ``fn(*args)[part]``, each part of a result once:
    a second call for the same part computes it anew, so no two constants (of one
    rewrite or of two) are one tensor (the replacer keeps these without a copy)."""
    last: list = [None, None, None, set()]

    def wrapper(part: int, *args: Any) -> Any:
        key = tuple(id(a) if isinstance(a, torch.Tensor) else a for a in args)
        if last[0] != key or part in last[3]:
            # keep the arguments alive so their ids cannot be reused by other tensors
            last[0], last[1], last[2], last[3] = key, fn(*args), args, set()
        last[3].add(part)
        return last[1][part]

    return wrapper


@_memo_last
def _conv_bn(w: Any, b: Any, mean: Any, var: Any, gamma: Any, beta: Any, eps: float, transpose: bool) -> tuple:
    fw, fb = _fusion.fuse_conv_bn_weights(*map(_wide, (w, b, mean, var)), eps, _wide(gamma), _wide(beta), transpose)
    return (_bn_laid_out(_held(fw, w.dtype, "conv_bn_weight", w, 1 if transpose else 0), w),
            _held(fb, w.dtype if b is None else b.dtype, "conv_bn_bias"))


def _bn_laid_out(fw: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The folded weight laid out so that the conv lays its result out as the batch
    norm it replaces did: CPU's batch norm keeps a channels_last (3d) input so and
    makes anything else contiguous, while a conv lays its result out after its
    weight, so a 1-d conv's channels-last-strided weight (strides ``(k*c, 1, c)``)
    kept would leave a strided result where a ``view`` read a contiguous one."""
    for fmt, rank in ((torch.channels_last, 4), (torch.channels_last_3d, 5)):
        if w.dim() == rank and w.is_contiguous(memory_format=fmt) and not w.is_contiguous():
            return fw.contiguous(memory_format=fmt)
    return fw.contiguous()


@_memo_last
def _linear_bn(w: Any, b: Any, mean: Any, var: Any, gamma: Any, beta: Any, eps: float) -> tuple:
    if gamma is None:
        gamma = torch.ones_like(mean)
    if beta is None:
        beta = torch.zeros_like(mean)
    fw, fb = _fusion.fuse_linear_bn_weights(*map(_wide, (w, b, mean, var)), eps, _wide(gamma), _wide(beta))
    return (_held(fw, w.dtype, "linear_bn_weight", w), _held(fb, w.dtype if b is None else b.dtype, "linear_bn_bias"))


@register_constant()
def conv_bn_weight(w: Any, b: Any, mean: Any, var: Any, gamma: Any, beta: Any, eps: float) -> Any:
    """Weight of ``conv`` followed by eval-mode ``batch_norm``, folded (torch's math)."""
    return _conv_bn(0, w, b, mean, var, gamma, beta, eps, False)


@register_constant()
def conv_bn_bias(w: Any, b: Any, mean: Any, var: Any, gamma: Any, beta: Any, eps: float) -> Any:
    """Bias of ``conv`` followed by eval-mode ``batch_norm``, folded (torch's math)."""
    return _conv_bn(1, w, b, mean, var, gamma, beta, eps, False)


@register_constant()
def conv_transpose_bn_weight(w: Any, b: Any, mean: Any, var: Any, gamma: Any, beta: Any, eps: float) -> Any:
    """Weight of ``conv_transpose`` (groups=1) followed by ``batch_norm``, folded."""
    return _conv_bn(0, w, b, mean, var, gamma, beta, eps, True)


@register_constant()
def conv_transpose_bn_bias(w: Any, b: Any, mean: Any, var: Any, gamma: Any, beta: Any, eps: float) -> Any:
    """Bias of ``conv_transpose`` (groups=1) followed by ``batch_norm``, folded."""
    return _conv_bn(1, w, b, mean, var, gamma, beta, eps, True)


@register_constant()
def linear_bn_weight(w: Any, b: Any, mean: Any, var: Any, gamma: Any, beta: Any, eps: float) -> Any:
    """Weight of ``linear`` followed by eval-mode ``batch_norm`` (2-d input), folded."""
    return _linear_bn(0, w, b, mean, var, gamma, beta, eps)


@register_constant()
def linear_bn_bias(w: Any, b: Any, mean: Any, var: Any, gamma: Any, beta: Any, eps: float) -> Any:
    """Bias of ``linear`` followed by eval-mode ``batch_norm`` (2-d input), folded."""
    return _linear_bn(1, w, b, mean, var, gamma, beta, eps)


@register_constant()
def cast(t: Any, dtype: Any) -> Any:
    """A constant tensor converted to ``dtype`` once, at rewrite time (refused where
    a finite value would overflow to inf in ``dtype``)."""
    if not isinstance(t, torch.Tensor):
        return t
    out = t.to(dtype)
    if _overflowed(t, out):
        raise FoldOverflowError(f"cast: a finite value of the constant overflows {dtype}: not cast")
    return out


def overflows(t: Any, dtype: Any) -> bool:
    """A finite value of the tensor ``t`` becomes inf converted to the floating
    ``dtype`` (-1e5 in float16): what ``cast`` refuses, asked before any cast."""
    return isinstance(t, torch.Tensor) and dtype.is_floating_point and _overflowed(t, t.to(dtype))


def _overflowed(t: torch.Tensor, out: torch.Tensor) -> bool:
    return out.is_floating_point() and t.is_floating_point() and bool((~torch.isfinite(out) & torch.isfinite(t)).any())


# -- batch norms folded through views, into the op after them, into parallel branches
# (rules/fusion.rw). An eval-mode batch norm is an affine map per channel:
# bn(x) = x * s + t with s = gamma / sqrt(var + eps) and t = beta - mean * s.


def _bn_affine(mean: Any, var: Any, gamma: Any, beta: Any, eps: float) -> tuple:
    """``(s, t)`` with ``bn(x) == x * s + t`` per channel (gamma, beta None: 1, 0),
    in at least float32 (the callers round what they fold from them once)."""
    mean, var, gamma, beta = map(_wide, (mean, var, gamma, beta))
    s = torch.rsqrt(var + eps)
    if gamma is not None:
        s = s * gamma
    t = -mean * s
    if beta is not None:
        t = t + beta
    return s.detach(), t.detach()


def _per_weight_entry(v: Any, w: Any, groups: int) -> Any:
    """A per-input-channel vector laid out like ``w[:, :, 0, ...]`` (out, in/groups):
    output channel o of a grouped conv reads input channels of group o // (out/groups)."""
    out_channels, in_per_group = w.shape[0], w.shape[1]
    return v.reshape(groups, in_per_group).repeat_interleave(out_channels // groups, dim=0)


@register_constant()
def bn_conv_weight(w: Any, groups: int, mean: Any, var: Any, gamma: Any, beta: Any, eps: float) -> Any:
    """Weight of an unpadded ``conv`` whose input is an eval-mode ``batch_norm``:
    every input channel's taps scaled by its ``s``."""
    s, _ = _bn_affine(mean, var, gamma, beta, eps)
    scale = _per_weight_entry(s, w, groups).reshape(w.shape[:2] + (1,) * (w.dim() - 2))
    return _held(_wide(w) * scale, _fold_dtype(w, mean, var, gamma, beta), "bn_conv_weight", w)


@register_constant()
def bn_conv_bias(w: Any, b: Any, groups: int, mean: Any, var: Any, gamma: Any, beta: Any, eps: float) -> Any:
    """Bias of an unpadded ``conv`` whose input is an eval-mode ``batch_norm``: the
    conv of the constant shift ``t`` (every tap reads it) added to ``b``."""
    _, t = _bn_affine(mean, var, gamma, beta, eps)
    shift = (_wide(w).sum(dim=tuple(range(2, w.dim()))) * _per_weight_entry(t, w, groups)).sum(dim=1)
    return _held(shift if b is None else _wide(b) + shift, _fold_dtype(w, b, mean, var, gamma, beta), "bn_conv_bias")


@register_constant()
def bn_linear_weight(w: Any, mean: Any, var: Any, gamma: Any, beta: Any, eps: float) -> Any:
    """Weight of a ``linear`` whose 2-d input is an eval-mode ``batch_norm``: each
    input feature's column scaled by its ``s``."""
    s, _ = _bn_affine(mean, var, gamma, beta, eps)
    return _held(_wide(w) * s, _fold_dtype(w, mean, var, gamma, beta), "bn_linear_weight", w)


@register_constant()
def bn_linear_bias(w: Any, b: Any, mean: Any, var: Any, gamma: Any, beta: Any, eps: float) -> Any:
    """Bias of a ``linear`` whose 2-d input is an eval-mode ``batch_norm``: ``b + w @ t``."""
    _, t = _bn_affine(mean, var, gamma, beta, eps)
    shift = _wide(w) @ t.to(_wide(w).dtype)
    return _held(shift if b is None else _wide(b) + shift, _fold_dtype(w, b, mean, var, gamma, beta),
                 "bn_linear_bias")


@register_constant()
def conv_identity_weight(w: Any, groups: int, mean: Any, var: Any, gamma: Any, beta: Any, eps: float) -> Any:
    """Weight of ``conv(x) + batch_norm(x)`` as one conv (RepVGG's identity branch):
    ``s`` added to each output channel's centre tap on its own input channel."""
    s, _ = _bn_affine(mean, var, gamma, beta, eps)
    out = _wide(w).detach().clone()
    centre = tuple(k // 2 for k in w.shape[2:])
    in_per_group = w.shape[1]
    for o in range(w.shape[0]):
        out[(o, o % in_per_group) + centre] += s[o]
    return _held(out, w.dtype, "conv_identity_weight")


@register_constant()
def conv_identity_bias(b: Any, mean: Any, var: Any, gamma: Any, beta: Any, eps: float) -> Any:
    """Bias of ``conv(x) + batch_norm(x)`` as one conv: ``b + t``."""
    _, t = _bn_affine(mean, var, gamma, beta, eps)
    return _held(t if b is None else _wide(b) + t, _fold_dtype(b, mean, var, gamma, beta), "conv_identity_bias")


def _spatial(v: Any, n: int) -> tuple | None:
    """An int-or-list conv argument (stride, padding, dilation) as ``n`` ints, or None
    (``"same"``, a wrong length)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return (v,) * n
    if isinstance(v, (list, tuple)) and all(isinstance(d, int) and not isinstance(d, bool) for d in v):
        return tuple(v) * n if len(v) == 1 else (tuple(v) if len(v) == n else None)
    return None


def _merged_layout(k1: tuple, p1: tuple, k2: tuple, p2: tuple, d: tuple) -> tuple | None:
    """``(K, P, a1, a2)`` per spatial dim: one kernel of size K and padding P whose taps
    a1.. and a2.. are the two kernels' taps, both centred (so every output position
    reads the same inputs), K the larger kernel; None when they do not line up."""
    out = []
    for ka, pa, kb, pb, dd in zip(k1, p1, k2, p2, d):
        big, pad = max(ka, kb), max(pa, pb)
        if (pad - pa) % dd or (pad - pb) % dd:
            return None
        a, b = (pad - pa) // dd, (pad - pb) // dd
        if 2 * a != big - ka or 2 * b != big - kb:
            return None
        out.append((big, pad, a, b))
    return tuple(zip(*out)) if out else None


@register_constant()
def merged_conv_weight(w1: Any, p1: Any, w2: Any, p2: Any, dilation: Any) -> Any:
    """Weight of ``conv(x, w1) + conv(x, w2)`` (same stride, dilation, groups; centred
    kernels) as one conv: the smaller kernel zero-padded to the larger, then added."""
    n = w1.dim() - 2
    layout = _merged_layout(tuple(w1.shape[2:]), _spatial(p1, n), tuple(w2.shape[2:]), _spatial(p2, n),
                            _spatial(dilation, n))
    big, _, a1, a2 = layout
    out = torch.zeros(tuple(w1.shape[:2]) + tuple(big), dtype=_wide(w1).dtype)
    for w, at in ((w1, a1), (w2, a2)):
        index = (slice(None), slice(None)) + tuple(slice(o, o + k) for o, k in zip(at, w.shape[2:]))
        out[index] += _wide(w).detach()
    return _held(out, w1.dtype, "merged_conv_weight")


@register_constant()
def merged_conv_bias(b1: Any, b2: Any) -> Any:
    """Bias of ``conv(x, w1, b1) + conv(x, w2, b2)`` as one conv (None for no bias)."""
    if b1 is None or b2 is None:
        return b2 if b1 is None else b1
    return _held(_wide(b1) + _wide(b2), _fold_dtype(b1, b2), "merged_conv_bias")


@register_constant()
def merged_conv_padding(w1: Any, p1: Any, w2: Any, p2: Any, dilation: Any) -> Any:
    """Padding of ``conv(x, w1) + conv(x, w2)`` as one conv: the larger kernel's."""
    n = w1.dim() - 2
    layout = _merged_layout(tuple(w1.shape[2:]), _spatial(p1, n), tuple(w2.shape[2:]), _spatial(p2, n),
                            _spatial(dilation, n))
    return list(layout[1])


def _tensor_shape(v: Value) -> tuple | None:
    """The shape of a constant tensor or a graph value, or None."""
    m = v.meta
    return None if m is None else tuple(m.shape)


#: how many running standard deviations from zero a batch norm's running mean may
#: be for the batch norm to be folded into the op after it: the fold then loses at
#: most three bits to cancellation, in any dtype
BN_OFFSET_BOUND = 8.0


@register_predicate(local=True)
def bn_input_centred(x: Value, mean: Value, var: Value, eps: Value) -> bool | None:
    """A batch norm of ``x`` folded into the linear or conv that reads it computes
    ``w * s @ x - w * s @ mean`` in one accumulation: where ``|mean|`` is many running
    standard deviations (a raw feature about 1e4, spread 1), the two cancel and the
    rounding of each, ``eps * |mean| / std`` of the result, is left; the batch norm
    subtracts ``mean`` from ``x`` exactly first. True when every channel's
    ``|mean| / sqrt(var)`` is within ``BN_OFFSET_BOUND``: the spread of ``x`` is
    ``sqrt(var)``, not ``sqrt(var + eps)`` (an eps far above the variance would hide
    an offset of 1e5 spreads); a zero mean is centred whatever the variance."""
    m = x.meta
    mean_t = mean.facts.constant_of(mean.operand) if mean.is_const else None
    var_t = var.facts.constant_of(var.operand) if var.is_const else None
    e = eps.literal if eps.is_literal else None
    if m is None or not isinstance(mean_t, torch.Tensor) or not isinstance(var_t, torch.Tensor) \
            or not isinstance(e, (int, float)) or not m.dtype.is_floating_point:
        return None
    if not mean_t.numel():
        return True
    offset = mean_t.double().abs()
    spreads = torch.where(offset == 0, 0.0, offset * torch.rsqrt(var_t.double().clamp(min=0)))
    return bool(spreads.max() <= BN_OFFSET_BOUND)


@register_predicate(local=True)
def no_padding(padding: Value) -> bool:
    """A conv ``padding`` of zeros (``0``, ``[0, 0]``, ``"valid"``): every tap reads
    the input itself, so an affine map of the input passes through the conv."""
    p = padding.literal if padding.is_literal else None
    if p == "valid":
        return True
    pads = _spatial(p, 1) if not isinstance(p, (list, tuple)) else _spatial(p, len(p))
    return pads is not None and not any(pads)


@register_predicate(local=True)
def centre_tap_identity(w: Value, stride: Value, padding: Value, dilation: Value) -> bool:
    """A conv with weight ``w`` whose centre tap reads the output position itself:
    stride 1, odd kernel, padding = dilation * (k - 1) / 2 on every spatial dim, so
    ``x`` is the conv of a kernel with one centre entry (the identity branch)."""
    k = _tensor_shape(w)
    if k is None:
        return None
    k = k[2:]
    n = len(k)
    s, p, d = (_spatial(v.literal, n) if v.is_literal else None for v in (stride, padding, dilation))
    if s is None or p is None or d is None:
        return False
    return all(ss == 1 and kk % 2 == 1 and pp == dd * (kk - 1) // 2 for ss, kk, pp, dd in zip(s, k, p, d))


@register_predicate(local=True)
def convs_merge(w1: Value, p1: Value, w2: Value, p2: Value, dilation: Value) -> bool:
    """Two convs of one input (same stride, dilation, groups) with weights ``w1``,
    ``w2`` are one conv: both kernels centred in the larger one, which covers the
    smaller on every spatial dim (the merged conv costs what the larger did)."""
    k1, k2 = _tensor_shape(w1), _tensor_shape(w2)
    if k1 is None or k2 is None:
        return None
    if len(k1) != len(k2) or k1[:2] != k2[:2]:
        return False
    n = len(k1) - 2
    pads = [_spatial(v.literal, n) if v.is_literal else None for v in (p1, p2, dilation)]
    if any(v is None for v in pads):
        return False
    layout = _merged_layout(k1[2:], pads[0], k2[2:], pads[1], pads[2])
    return layout is not None and tuple(layout[0]) in (k1[2:], k2[2:])


# ---------------------------------------------------------------- modules (inserted)


@register_module(inputs=("x",))
def minmax_observer(x: Any = None) -> torch.nn.Module:
    """torch's per-tensor affine ``MinMaxObserver`` (records the range it sees)."""
    from torch.ao.quantization.observer import MinMaxObserver

    return MinMaxObserver()


@register_module(inputs=("x",))
def histogram_observer(x: Any = None) -> torch.nn.Module:
    """torch's ``HistogramObserver`` (per-tensor affine, better ranges than min/max)."""
    from torch.ao.quantization.observer import HistogramObserver

    return HistogramObserver()
