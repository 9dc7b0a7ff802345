"""``nn.Module`` calls as canonical ops: what each module's ``forward`` computes.

A ``call_module`` node in a ``symbolic_trace`` graph hides its op inside the module.
Each extractor here reads the module's configuration and returns the canonical
arguments of the functional call its ``forward`` makes, with the module's tensors as
``ConstRef`` operands (``ConstRef("layer1.0.conv1.weight")``) so rules can fold them
like any constant. An extractor returns None when the module's forward would not be
exactly that op (a conv with ``padding_mode="reflect"`` pads first; a training
BatchNorm with ``momentum=None`` keeps a cumulative average no functional call
expresses; extra forward arguments such as ``output_size``).

Signature of every extractor: ``(module, node, qualname) -> dict | None``.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from rewrite.ops.base import ConstRef

__all__ = [
    "unary", "conv", "conv_transpose", "linear", "batch_norm", "layer_norm", "group_norm",
    "gelu", "hardtanh", "dropout", "flatten", "softmax", "max_pool2d", "avg_pool2d",
    "adaptive_avg_pool2d", "embedding", "leaky_relu", "glu", "reads_forward_input",
]


def _input(node: fx.Node) -> Any:
    """The single forward argument, or None when the call has any other."""
    if len(node.args) == 1 and not node.kwargs:
        return node.args[0]
    if not node.args and set(node.kwargs) == {"input"}:
        return node.kwargs["input"]
    return None


def _ref(module: Any, qualname: str, attr: str) -> ConstRef | None:
    return None if getattr(module, attr, None) is None else ConstRef(f"{qualname}.{attr}")


def _with_input(node: fx.Node, **args: Any) -> dict | None:
    x = _input(node)
    return None if x is None else {"input": x, **args}


# ---- elementwise activations and identity -------------------------------------


def unary(module: Any, node: fx.Node, qualname: str) -> dict | None:
    """``nn.ReLU``, ``nn.SiLU``, ``nn.Identity``, ...: forward(x) = op(x)."""
    return _with_input(node)


def gelu(module: Any, node: fx.Node, qualname: str) -> dict | None:
    return _with_input(node, approximate=module.approximate)


def upsample(module: Any, node: fx.Node, qualname: str) -> dict | None:
    """``nn.Upsample``: F.interpolate with the module's settings (recompute_scale_factor
    changes the computation: not bound)."""
    if module.recompute_scale_factor:
        return None
    return _with_input(node, size=module.size, scale_factor=module.scale_factor, mode=module.mode,
                       align_corners=module.align_corners)


def leaky_relu(module: Any, node: fx.Node, qualname: str) -> dict | None:
    return _with_input(node, negative_slope=module.negative_slope)


def glu(module: Any, node: fx.Node, qualname: str) -> dict | None:
    return _with_input(node, dim=module.dim)


def hardtanh(module: Any, node: fx.Node, qualname: str) -> dict | None:
    """``nn.Hardtanh`` and its subclass ``nn.ReLU6`` (bounds 0 and 6)."""
    return _with_input(node, min_val=module.min_val, max_val=module.max_val)


# ---- convolution and linear ----------------------------------------------------


def conv(module: Any, node: fx.Node, qualname: str) -> dict | None:
    if module.padding_mode != "zeros":
        return None  # forward pads with F.pad first, then convolves with padding 0
    return _with_input(
        node, weight=_ref(module, qualname, "weight"), bias=_ref(module, qualname, "bias"),
        stride=module.stride, padding=module.padding, dilation=module.dilation, groups=module.groups,
    )


def conv_transpose(module: Any, node: fx.Node, qualname: str) -> dict | None:
    if module.padding_mode != "zeros":
        return None
    return _with_input(  # a call with output_size computes output_padding: not bound
        node, weight=_ref(module, qualname, "weight"), bias=_ref(module, qualname, "bias"),
        stride=module.stride, padding=module.padding, output_padding=module.output_padding,
        groups=module.groups, dilation=module.dilation,
    )


def linear(module: Any, node: fx.Node, qualname: str) -> dict | None:
    return _with_input(node, weight=_ref(module, qualname, "weight"), bias=_ref(module, qualname, "bias"))


# ---- normalization -------------------------------------------------------------


def batch_norm(module: Any, node: fx.Node, qualname: str) -> dict | None:
    """Mirrors ``_BatchNorm.forward``: batch statistics when training or when there
    are no running stats; running stats passed unless training without tracking."""
    tracking = module.running_mean is not None and module.running_var is not None
    training = module.training or not tracking
    if module.momentum is None:
        if module.training and module.track_running_stats:
            return None  # cumulative moving average: momentum changes every call
        momentum = 0.0
    else:
        momentum = module.momentum
    pass_stats = not module.training or module.track_running_stats
    return _with_input(
        node,
        running_mean=_ref(module, qualname, "running_mean") if pass_stats else None,
        running_var=_ref(module, qualname, "running_var") if pass_stats else None,
        weight=_ref(module, qualname, "weight"), bias=_ref(module, qualname, "bias"),
        training=training, momentum=momentum, eps=module.eps,
    )


def layer_norm(module: Any, node: fx.Node, qualname: str) -> dict | None:
    return _with_input(
        node, normalized_shape=tuple(module.normalized_shape), weight=_ref(module, qualname, "weight"),
        bias=_ref(module, qualname, "bias"), eps=module.eps,
    )


def rms_norm(module: Any, node: fx.Node, qualname: str) -> dict | None:
    return _with_input(node, normalized_shape=tuple(module.normalized_shape),
                       weight=_ref(module, qualname, "weight"), eps=module.eps)


def group_norm(module: Any, node: fx.Node, qualname: str) -> dict | None:
    return _with_input(
        node, num_groups=module.num_groups, weight=_ref(module, qualname, "weight"),
        bias=_ref(module, qualname, "bias"), eps=module.eps,
    )


# ---- dropout, shape, softmax ---------------------------------------------------


def dropout(module: Any, node: fx.Node, qualname: str) -> dict | None:
    return _with_input(node, p=module.p, training=module.training)


def flatten(module: Any, node: fx.Node, qualname: str) -> dict | None:
    return _with_input(node, start_dim=module.start_dim, end_dim=module.end_dim)


def softmax(module: Any, node: fx.Node, qualname: str) -> dict | None:
    return _with_input(node, dim=module.dim)


# ---- pooling -------------------------------------------------------------------


def max_pool2d(module: Any, node: fx.Node, qualname: str) -> dict | None:
    if module.return_indices:
        return None
    return _with_input(
        node, kernel_size=module.kernel_size, stride=module.stride, padding=module.padding,
        dilation=module.dilation, ceil_mode=module.ceil_mode,
    )


def avg_pool2d(module: Any, node: fx.Node, qualname: str) -> dict | None:
    return _with_input(
        node, kernel_size=module.kernel_size, stride=module.stride, padding=module.padding,
        ceil_mode=module.ceil_mode, count_include_pad=module.count_include_pad,
        divisor_override=module.divisor_override,
    )


def adaptive_avg_pool2d(module: Any, node: fx.Node, qualname: str) -> dict | None:
    return _with_input(node, output_size=module.output_size)


# ---- embedding -----------------------------------------------------------------


def embedding(module: Any, node: fx.Node, qualname: str) -> dict | None:
    return _with_input(
        node, weight=_ref(module, qualname, "weight"), padding_idx=module.padding_idx,
        max_norm=module.max_norm, norm_type=module.norm_type,
        scale_grad_by_freq=module.scale_grad_by_freq, sparse=module.sparse,
    )


def prelu(module: Any, node: fx.Node, qualname: str) -> dict | None:
    return _with_input(node, weight=_ref(module, qualname, "weight"))


#: Extractors whose canonical ``input`` is the call's single forward argument
#: (``_input``): ``node.args[0]``, or keyword ``input``. The prefilter reads it there
#: without looking the module up (``engine/prefilter.py``).
_FORWARD_INPUT = frozenset({
    unary, gelu, upsample, leaky_relu, glu, hardtanh, conv, conv_transpose, linear, batch_norm,
    layer_norm, rms_norm, group_norm, dropout, flatten, softmax, max_pool2d, avg_pool2d,
    adaptive_avg_pool2d, embedding, prelu,
})


def reads_forward_input(extract: Any) -> bool:
    """Whether ``extract`` binds canonical ``input`` to the call's forward argument,
    as every extractor here does (one registered elsewhere may not)."""
    return extract in _FORWARD_INPUT
