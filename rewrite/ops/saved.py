"""What autograd keeps of an op's result for the backward pass.

A rewrite that forwards an existing value in place of a fresh one (``sigmoid(h) *
1.0 => sigmoid(h)``) keeps every forward value, yet the caller may still tell: the
backward of ``sigmoid`` reads its own result, which autograd saved with its version
counter, so an in-place write into the forwarded value afterwards (the model's
``ReLU(inplace=True)``, or the caller's ``out.div_(t)`` on a returned output) makes
``backward()`` raise "modified by an inplace operation" where the original trained.
``rewrite.engine.aliasing`` refuses such a rewrite where the graph may be trained.

Many ops keep their result (``sigmoid``, ``exp``, ``softmax``, ``torch.special``'s
spellings, ``inverse``, ``cdist``, an LSTM, every in-place activation...), so the
list kept here is the other one: ops known *not* to keep their result
(``RESULT_NOT_KEPT``: views, linear algebra, most elementwise ops), each checked
against torch by writing its result in place and calling backward
(``tests/test_probe_regressions_s44.py``). Any other op, an in-place call, a module
with ``inplace=True``, or code the library cannot read may keep it.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from rewrite.ops.base import submodule
from rewrite.ops.effects import op_name, written_args

__all__ = ["RESULT_NOT_KEPT", "keeps_result"]

#: ops (by ``op_name``: every spelling, ``torch.add``, ``x.add``, ``aten.add.Tensor``,
#: ``operator.add``) whose out-of-place backward reads no result of theirs
RESULT_NOT_KEPT = frozenset({
    # views, copies, casts, shapes (not split's or chunk's pieces: autograd refuses a
    # write into one view of several an op returned)
    "view", "reshape", "_unsafe_view", "flatten", "unflatten", "permute", "transpose", "t", "expand",
    "expand_as", "squeeze", "unsqueeze", "select", "slice", "narrow", "as_strided",
    "view_as", "reshape_as", "contiguous", "clone", "alias", "to", "_to_copy", "type_as", "float", "half",
    "double", "bfloat16", "repeat", "tile", "roll", "flip", "pad", "constant_pad_nd", "cat", "stack",
    # linear algebra
    "linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "conv1d", "conv2d", "conv3d",
    "convolution", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "embedding",
    # elementwise
    "add", "sub", "rsub", "mul", "div", "truediv", "neg", "abs", "where", "clamp", "clamp_min", "clamp_max",
    "maximum", "minimum", "hardtanh", "relu6", "leaky_relu", "elu", "selu", "celu", "gelu", "silu", "mish",
    "softplus", "hardswish", "hardsigmoid", "log", "log1p", "log2", "sin", "cos", "erf", "square", "sign",
    "threshold",
    # norms, reductions, pooling, dropout
    "layer_norm", "batch_norm", "group_norm", "instance_norm", "sum", "mean", "var", "avg_pool1d",
    "avg_pool2d", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "max_pool1d", "max_pool2d", "interpolate",
    "dropout",
})

#: multi-output ops whose first result (the normalized or pooled value) is not kept
_FIRST_NOT_KEPT = frozenset({
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training", "native_layer_norm", "native_group_norm", "max_pool2d_with_indices",
})

#: torch modules whose forward keeps no result of its own (unless ``inplace=True``)
_RESULT_NOT_KEPT_MODULES = frozenset({
    "Linear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
    "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "LayerNorm", "GroupNorm", "InstanceNorm1d", "InstanceNorm2d",
    "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "Identity", "Flatten", "Unflatten", "MaxPool1d",
    "MaxPool2d", "AvgPool1d", "AvgPool2d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "GELU", "SiLU", "Mish",
    "Softplus", "Hardswish", "Hardsigmoid", "Hardtanh", "ReLU6", "LeakyReLU", "ELU", "SELU", "CELU",
    "Embedding", "Upsample", "ZeroPad2d", "ConstantPad2d",
})


def keeps_result(node: fx.Node, gm: Any) -> bool:
    """Whether autograd may keep ``node``'s result for its backward: unless it is an
    out-of-place call of an op (or a torch module) known not to (``RESULT_NOT_KEPT``),
    it may. One result of a multi-output op (``getitem``) is asked of the op."""
    if node.op == "call_module":
        try:
            module = submodule(gm, node.target)
        except AttributeError:
            return True
        return not (type(module).__module__.startswith("torch.") and type(module).__name__ in _RESULT_NOT_KEPT_MODULES
                    and not getattr(module, "inplace", False) and not getattr(module, "return_indices", False))
    if node.op not in ("call_function", "call_method"):
        return False  # an input or a constant: no op of the graph made it
    target = node.target
    if target is operator.getitem and isinstance(node.args[0], fx.Node):
        source = node.args[0]
        if node.args[1] == 0 and source.op == "call_function" and op_name(source.target) in _FIRST_NOT_KEPT:
            return False  # a norm's output (its statistics, results 1 and 2, are kept)
        return keeps_result(source, gm)
    if op_name(target) not in RESULT_NOT_KEPT or any(p in (0, "input", "self") for p in written_args(node, gm)):
        return True  # an in-place call keeps what it wrote (relu_, leaky_relu(x, inplace=True))
    if node.op == "call_method" or isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return False
    where = (getattr(target, "__module__", None) or "torch").split(".")[0]  # (a method descriptor has none)
    return where not in ("torch", "operator", "_operator", "builtins", "math")
