"""What autograd keeps of an op's result for the backward pass.

A rewrite that forwards an existing value in place of a fresh one (``sigmoid(h) *
1.0 => sigmoid(h)``) keeps every forward value, yet the caller may still tell: the
backward of ``sigmoid`` reads its own result, which autograd saved with its version
counter, so an in-place write into the forwarded value afterwards (the model's
``ReLU(inplace=True)``, or the caller's ``out.div_(t)`` on a returned output) makes
``backward()`` raise "modified by an inplace operation" where the original trained.
``rewrite.engine.aliasing`` refuses such a rewrite where the graph may be trained.

``KEPT_RESULT_OPS`` was found by running each op on a tensor that requires grad,
bumping the result's version (an in-place write) and calling backward
(``tests/test_probe_regressions_s44.py`` checks the list against torch). Ops keep
their *inputs* far more often (``mul``, ``matmul``, ``conv``): a reader of a value is
therefore taken to keep it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from rewrite.ops.base import submodule
from rewrite.ops.effects import op_name

__all__ = ["KEPT_RESULT_OPS", "keeps_result"]

#: ops whose backward reads their own result (by name, every spelling and overload:
#: ``torch.sigmoid``, ``x.sigmoid_()``, ``aten.sigmoid.default``); ``pow`` keeps it
#: for a tensor exponent, and is taken to always
KEPT_RESULT_OPS = frozenset({
    "sigmoid", "tanh", "exp", "exp2", "expm1", "relu", "sqrt", "rsqrt", "reciprocal", "tan",
    "softmax", "_softmax", "_safe_softmax", "log_softmax", "_log_softmax", "softmin", "logsumexp",
    "pow", "float_power", "amax", "amin", "max", "min", "cumprod", "prod", "norm", "linalg_vector_norm",
    "std", "std_mean", "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
})

#: torch modules whose forward is one of those ops
_KEPT_RESULT_MODULES = frozenset({"ReLU", "Sigmoid", "Tanh", "Softmax", "LogSoftmax", "Softmin",
                                  "MultiheadAttention"})


def keeps_result(node: fx.Node, gm: Any) -> bool:
    """Whether autograd may keep ``node``'s result for its backward: one of
    ``KEPT_RESULT_OPS`` (or a torch module running one), or code whose backward the
    library cannot read (a user's module or function): it may."""
    if node.op == "call_module":
        try:
            module = submodule(gm, node.target)
        except AttributeError:
            return True
        if type(module).__module__.startswith("torch."):
            return type(module).__name__ in _KEPT_RESULT_MODULES
        return True
    if node.op not in ("call_function", "call_method"):
        return False
    target = node.target
    if op_name(target) in KEPT_RESULT_OPS:
        return True
    if isinstance(target, torch._ops.HigherOrderOperator):
        return True  # its subgraph's last op may
    if node.op == "call_method" or isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return False
    where = (getattr(target, "__module__", None) or "").split(".")[0]
    return where not in ("torch", "operator", "_operator", "builtins", "math")
