"""Gradients in the equivalence check.

Some rewrites keep every forward value and change the gradients: removing a
``detach`` (gradients now flow where the original stopped them), putting a
rounding where a straight-through fake quantizer was (gradients become zero),
moving a grad-mode switch. The forward comparison cannot see that, so when a rule
that fired names such an op (``touches_gradients``, read from the compiled rule:
its pattern or its replacement), the check also compares one backward pass on the
first trial's inputs (``gradient_run``): which floating outputs gradients reach,
and the vector-Jacobian product of a fixed random cotangent with respect to every
floating input and every trainable parameter both models hold.

Rules that touch none of these ops cost nothing here: a fusion or a cast rewrite
is not run backward.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Optional, Tuple

import attrs
import torch
from torch.utils import _pytree as pytree

from rewrite.trust.rng import model_generators, seeded
from rewrite.trust.runner import call_with

__all__ = ["GRADIENT_OPS", "GradientRun", "grad_leaves", "gradient_reach", "gradient_run", "moved",
           "redrawn", "touches_gradients"]

#: Name parts (``aten.detach.default`` -> ``detach``) of ops whose gradient differs
#: from what their forward values suggest: stop-gradients, grad-mode switches,
#: piecewise-constant ops (zero gradient almost everywhere), quantizers (no
#: gradient) and fake quantizers (straight-through gradients).
GRADIENT_OPS = frozenset({
    "detach", "detach_", "detach_copy", "requires_grad_", "_set_grad_enabled", "set_grad_enabled",
    "wrap_with_set_grad_enabled", "no_grad", "enable_grad", "inference_mode",
    "round", "floor", "ceil", "trunc", "fix", "sign", "sgn", "signbit", "heaviside", "floor_divide",
    # arguments that change only the gradient (padding_idx, scale_grad_by_freq, sparse)
    "embedding", "embedding_bag",
})
#: Substrings that mark quantizer and fake-quantizer ops and modules.
_GRADIENT_WORDS = ("quantize", "fake_quant", "fakequant")


def _gradient_name(name: str) -> bool:
    for part in name.split("."):
        low = part.lower()
        if low in GRADIENT_OPS or any(word in low for word in _GRADIENT_WORDS):
            return True
    return False


def _names(node: Any) -> Any:
    """Op and module names a compiled pattern or replacement calls (read by shape:
    ``PCall.alts``, ``PAlt``/``ROp.opdef``, ``RModule.spec``, and their operands)."""
    if isinstance(node, (list, tuple)):
        for item in node:
            yield from _names(item)
        return
    if isinstance(node, dict):
        yield from _names(tuple(node.values()))
        return
    opdef = getattr(node, "opdef", None)
    if opdef is not None:
        yield opdef.name
    spec = getattr(node, "spec", None)
    if spec is not None and hasattr(node, "inputs"):  # an inserted module (not a rewrite-time constant)
        yield spec.name
    for field in ("alts", "args", "call", "items", "inputs"):
        child = getattr(node, field, None)
        if child is not None and not isinstance(child, (str, bytes)):
            yield from _names(child)


@functools.lru_cache(maxsize=4096)
def touches_gradients(rule: Any) -> bool:
    """Whether ``rule`` (a ``CompiledRule``) matches or emits an op in ``GRADIENT_OPS`` (or a quantizer):
    the rewrite may change gradients without changing a forward value."""
    return any(_gradient_name(name) for part in (rule.pattern, rule.replacement) for name in _names(part))


@attrs.frozen
class GradientRun:
    """One forward and backward pass: per floating output (by path) whether a
    gradient reaches it, the cotangent-weighted gradient of each floating input
    leaf (by index) and of each trainable parameter (by name, with the tensor's
    id: a parameter a rewrite folded away is not compared)."""

    reached: Tuple[Tuple[str, bool], ...]
    inputs: Dict[int, torch.Tensor]
    params: Dict[str, Tuple[int, torch.Tensor]]


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def gradient_run(fn: Any, inputs: Any, seed: int) -> Optional[GradientRun]:
    """Run ``fn`` on copies of ``inputs`` that require grad (the floating ones) with
    gradients enabled, then backward from the floating outputs with a random
    cotangent drawn from ``seed`` (the same for any two models whose outputs have
    the same shapes). None when no gradient reaches any output. Parameters'
    ``.grad`` fields are not touched (``torch.autograd.grad``); the caller restores
    module state the forward wrote (batch-norm statistics in training mode)."""
    args = pytree.tree_map(lambda t: t.detach().clone().requires_grad_(True) if _floating(t)
                           else (t.clone() if isinstance(t, torch.Tensor) else t), inputs)
    leaves = pytree.tree_leaves(args)
    params = {}
    if isinstance(fn, torch.nn.Module):
        params = {name: p for name, p in fn.named_parameters(remove_duplicate=False)
                  if p.requires_grad and _floating(p)}
    with torch.enable_grad(), seeded(seed, model_generators(fn)):
        out = call_with(fn, args)
    flat = [(pytree.keystr(kp), t) for kp, t in pytree.tree_flatten_with_path(out)[0] if _floating(t)]
    reached = tuple((path, bool(t.requires_grad)) for path, t in flat)
    generator = torch.Generator().manual_seed(seed)
    cotangents = [torch.randn(t.shape, generator=generator, dtype=torch.float64).to(t.dtype) for _, t in flat]
    outs = [(t, c) for (_, t), c in zip(flat, cotangents) if t.requires_grad]
    if not outs:
        return None
    wrt_inputs = [(i, t) for i, t in enumerate(leaves) if _floating(t)]
    wrt = [t for _, t in wrt_inputs] + list(params.values())
    grads = torch.autograd.grad([t for t, _ in outs], wrt, [c for _, c in outs], allow_unused=True)

    def dense(g: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(like).detach() if g is None else g.detach()

    n = len(wrt_inputs)
    return GradientRun(
        reached,
        {i: dense(g, t) for (i, t), g in zip(wrt_inputs, grads[:n])},
        {name: (id(p), dense(g, p)) for (name, p), g in zip(params.items(), grads[n:])},
    )


def grad_leaves(root: Any) -> list:
    """The tensors a gradient from ``root`` (a ``grad_fn`` or a leaf tensor) would
    accumulate into: the parameters and inputs an output requires grad through
    (read from the autograd graph; no backward runs). Each node is pushed once and
    only ``AccumulateGrad`` nodes are asked for their ``variable`` (asking every node
    raises and catches an AttributeError per node: three times the walk)."""
    if isinstance(root, torch.Tensor):
        return [root]
    if root is None:
        return []
    out, stack, seen = [], [root], {id(root)}
    while stack:
        node = stack.pop()
        if type(node) is _ACCUMULATE_GRAD:
            variable = node.variable
            if isinstance(variable, torch.Tensor):
                out.append(variable)
            continue
        for n, _ in getattr(node, "next_functions", ()):
            if n is not None and id(n) not in seen:
                seen.add(id(n))
                stack.append(n)
    return out


_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad


def gradient_reach(fn: Any, inputs: Tuple[Any, ...]) -> Optional[Tuple[Tuple[str, bool, frozenset], ...]]:
    """Per floating output leaf of ``fn(*inputs)`` run with gradients enabled on
    copies of the floating inputs that require grad: ``(path, requires grad, the
    input positions a gradient from it would reach)``. What a rewrite that keeps
    every value may still cut (``x.view(torch.int32).view(torch.float32)``); read
    from the autograd graph, no backward. None when ``fn`` cannot run so (it writes
    an input in place)."""
    args = tuple(t.detach().clone().requires_grad_(True) if _floating(t) and not t.is_complex()
                 else (t.clone() if isinstance(t, torch.Tensor) else t) for t in inputs)
    position = {id(t): i for i, t in enumerate(args) if isinstance(t, torch.Tensor) and t.requires_grad}
    try:
        with torch.enable_grad(), seeded(0, model_generators(fn)):
            out = call_with(fn, args)
    except Exception:  # noqa: BLE001 - nothing to compare
        return None
    reach = []
    for kp, t in pytree.tree_flatten_with_path(out)[0]:
        if _floating(t):
            root = t.grad_fn if t.grad_fn is not None else t
            reached = frozenset(position[id(x)] for x in grad_leaves(root) if id(x) in position) \
                if t.requires_grad else frozenset()
            reach.append((pytree.keystr(kp), bool(t.requires_grad), reached))
    return tuple(reach)


def redrawn(t: torch.Tensor, seed: int) -> Optional[torch.Tensor]:
    """``t`` moved by noise on its own scale (seeded): an input drawn again, to tell
    whether an output's value depends on it; None for a tensor that cannot tell (not
    floating, empty)."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or not t.numel():
        return None
    generator = torch.Generator().manual_seed(seed + 7919)
    scale = 1.0 + float(t.detach().abs().nan_to_num(0.0, 0.0, 0.0).max())
    return t.detach() + (torch.randn(t.shape, generator=generator, dtype=torch.float64) * scale).to(t.dtype)


def moved(before: Any, after: Any) -> bool:
    """Whether an output leaf differs between two runs (NaN equal to NaN); True when
    they cannot be compared."""
    if not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor) or before.shape != after.shape:
        return True
    return not torch.equal(before.detach().nan_to_num(0.0, 1.0, -1.0), after.detach().nan_to_num(0.0, 1.0, -1.0))
