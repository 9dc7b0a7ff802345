"""Predicates and modules of the quantization-aware training rule set.

``rules/quant/qat.rw`` names these (see ``rewrite.qat`` for the flow):

* ``activation_fake_quant`` inserts a ``QATFakeQuantize`` (torch's ``FakeQuantize``:
  per-tensor affine ``quint8``, a moving-average min/max observer) where the PTQ
  rules insert observers; ``fake_quantized``, ``output_fake_quantized`` and
  ``kernel_output_fake_quantized`` ask where fake quantizers already are;
* ``qat_conv``, ``qat_conv_bn`` and ``qat_linear`` replace a conv (with the batch
  norm after it) or a linear by a trainable module that fake-quantizes its weight
  (per channel or per tensor, symmetric, any width from 2 to 8 bits) on every call.

Fake quantization is torch's: ``torch.fake_quantize_per_tensor_affine`` and
``torch.fake_quantize_per_channel_affine``, whose gradient is the straight-through
estimator (the incoming gradient, zeroed where the input was clamped).

Train and eval: activation fake quantizers update their range in training mode
only; in eval mode they quantize with the range they last computed. Weight fake
quantizers compute the range of the current weight on every call (a min/max
observer with averaging constant 1): what ``rewrite.qat.convert`` then rounds.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization import FakeQuantize, FakeQuantizeBase
from torch.ao.quantization import observer as _observer

from rewrite.engine.facts import Value
from rewrite.functions.quant import (
    FiniteMinMaxObserver,
    FiniteMovingAverageMinMaxObserver,
    ops_of,
    passthrough_input,
    reaches,
    vnni_available,
)
from rewrite.functions.registry import register_module, register_predicate

__all__ = [
    "QATFakeQuantize", "QATLayer", "QATConv", "QATConvBn", "QATLinear", "TrainableBatchNorm",
    "is_fake_quant_node", "is_qat_layer_node", "weight_fake_quant", "WEIGHT_SCHEMES",
]

WEIGHT_SCHEMES = {"per_channel_symmetric": torch.per_channel_symmetric,
                  "per_tensor_symmetric": torch.per_tensor_symmetric}
_ACT_OBSERVERS = {"moving_average": FiniteMovingAverageMinMaxObserver, "minmax": FiniteMinMaxObserver}
_FUSABLE = ("conv", "linear", "add", "mul")
_ACTIVATIONS = ("relu", "hardtanh", "relu6")


class QATFakeQuantize(FakeQuantize):
    """torch's ``FakeQuantize`` whose observer follows the module's mode: it records
    ranges in training mode (or always, ``observe_in_eval=True``, for weights) and
    the fake quantization runs in both modes with the last computed parameters."""

    #: a call writes its observer's range, its scale and zero point (buffers), never its
    #: input (``rewrite.ops.effects.state_writes``)
    WRITES_BUFFERS_ONLY = True

    def __init__(self, *args: Any, observe_in_eval: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.observe_in_eval = observe_in_eval

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.training or self.observe_in_eval) and self.observer_enabled[0] == 1:
            self.activation_post_process(x.detach())
            scale, zero_point = self.calculate_qparams()
            if self.scale.shape != scale.shape:
                self.scale.resize_(scale.shape)
                self.zero_point.resize_(zero_point.shape)
            self.scale.copy_(scale)
            self.zero_point.copy_(zero_point)
        if self.fake_quant_enabled[0] != 1:
            return x
        # rounded to this module's range (quant_min, quant_max), which may be wider
        # than the one its observer computes the scale for (a reduced range)
        if self.is_per_channel:
            return torch.fake_quantize_per_channel_affine(x, self.scale, self.zero_point, self.ch_axis,
                                                          self.quant_min, self.quant_max)
        return torch.fake_quantize_per_tensor_affine(x, self.scale, self.zero_point, self.quant_min, self.quant_max)


#: the literals a QAT layer's ``bits`` and ``scheme`` take (E209 when a rule file loads)
_LAYER_CHOICES = {"bits": tuple(range(2, 9)), "scheme": tuple(WEIGHT_SCHEMES)}


def weight_fake_quant(bits: int = 8, scheme: str = "per_channel_symmetric") -> QATFakeQuantize:
    """A weight fake quantizer: signed ``bits``-bit integers in
    ``[-2**(bits-1), 2**(bits-1) - 1]``, symmetric, per output channel (axis 0) or per
    tensor, the range of the current weight (computed on every call)."""
    if not isinstance(bits, int) or isinstance(bits, bool) or not 2 <= bits <= 8:
        raise ValueError(f"weight bits must be an int from 2 to 8, got {bits!r}")
    if scheme not in WEIGHT_SCHEMES:
        raise ValueError(f"unknown weight scheme {scheme!r}; expected one of {sorted(WEIGHT_SCHEMES)}")
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    if scheme == "per_channel_symmetric":
        obs = _observer.MovingAveragePerChannelMinMaxObserver
        extra = {"ch_axis": 0}
    else:
        obs = _observer.MovingAverageMinMaxObserver
        extra = {}
    return QATFakeQuantize(observer=obs, quant_min=lo, quant_max=hi, dtype=torch.qint8,
                           qscheme=WEIGHT_SCHEMES[scheme], averaging_constant=1.0,
                           observe_in_eval=True, **extra)


class TrainableBatchNorm(nn.modules.batchnorm._BatchNorm):
    """``nn.BatchNorm{1,2,3}d`` for any input rank >= 2 (the capture may have lost
    which class it was): batch statistics in training mode, running ones in eval."""

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected an input of rank >= 2, got rank {x.dim()}")


def _param(t: Any) -> nn.Parameter | None:
    """A trainable copy of a model tensor; one the model had frozen stays frozen."""
    if t is None:
        return None
    frozen = isinstance(t, torch.Tensor) and isinstance(t, nn.Parameter) and not t.requires_grad
    return nn.Parameter(torch.as_tensor(t).detach().clone().float(), requires_grad=not frozen)


def _conv_fn(rank: int) -> Any:
    try:
        return {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[rank]
    except KeyError:
        raise ValueError(f"QAT conv: weight of rank {rank + 2}, expected 3 to 5") from None


class QATLayer(nn.Module):
    """Base of the QAT conv and linear modules: ``frozen()`` gives what convert
    builds the int8 layer from."""

    #: a call writes buffers only (batch statistics, the fake quantizer's range), never
    #: the weights: a rewrite's result shares those with the model it was made from
    WRITES_BUFFERS_ONLY = True

    kind = ""

    def frozen(self) -> tuple:
        """``(float weight, bias or None)`` the eval-mode layer computes with (batch
        norm folded), and the weight rounded as the fake quantizer rounds it, as a
        ``qint8`` tensor (values within the quantizer's range). ``ValueError`` for a
        fold that is not finite (running statistics or a parameter became inf or NaN
        in training): no int8 weight is made of it."""
        w, b = self.folded()
        if not torch.isfinite(w).all() or (b is not None and not torch.isfinite(b).all()):
            raise ValueError("its folded weight or bias is not finite (a batch norm's running statistics or a "
                             "parameter became inf or NaN in training): no int8 model is made of it")
        fq = self.weight_fake_quant
        with torch.no_grad():
            fq.activation_post_process(w.detach())
            scale, zp = fq.calculate_qparams()
            lo, hi = fq.quant_min, fq.quant_max
            if fq.qscheme == torch.per_channel_symmetric:
                grid = torch.fake_quantize_per_channel_affine(w, scale.float(), zp.int(), 0, lo, hi)
                q = torch.quantize_per_channel(grid, scale.double(), zp.long(), 0, torch.qint8)
            else:
                s, z = float(scale.reshape(-1)[0]), int(zp.reshape(-1)[0])
                grid = torch.fake_quantize_per_tensor_affine(w, s, z, lo, hi)
                q = torch.quantize_per_tensor(grid, s, z, torch.qint8)
        return q, (None if b is None else b.detach().clone())

    def folded(self) -> tuple:
        return self.weight, self.bias


class QATConv(QATLayer):
    """``conv{1,2,3}d(x, fake_quant(weight), bias)``: the weight and bias trainable."""

    kind = "conv"

    def __init__(self, weight: Any, bias: Any, stride: Any, padding: Any, dilation: Any, groups: int,
                 bits: int = 8, scheme: str = "per_channel_symmetric") -> None:
        super().__init__()
        self.weight = _param(weight)
        self.bias = _param(bias)
        self.rank = self.weight.dim() - 2
        self._conv = _conv_fn(self.rank)
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups
        self.weight_fake_quant = weight_fake_quant(bits, scheme)

    def conv(self, x: torch.Tensor, w: torch.Tensor, b: Any) -> torch.Tensor:
        return self._conv(x, w, b, self.stride, self.padding, self.dilation, self.groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x, self.weight_fake_quant(self.weight), self.bias)

    def facts_forward(self, x: torch.Tensor) -> torch.Tensor:
        """A result with the forward's shape, dtype and layout, computable on fake
        tensors (``rewrite.engine.facts``: the fake quantizer is data-dependent)."""
        return self.conv(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"weight={list(self.weight.shape)}, stride={self.stride}, padding={self.padding}, "
                f"bits={self.weight_fake_quant.quant_max.bit_length() + 1}")


class QATConvBn(QATConv):
    """A conv and the batch norm after it, trained with the fold simulated as
    torch.ao's ``ConvBn2d`` QAT module does (``_forward_approximate``): the weight is
    scaled by ``gamma / sqrt(running_var + eps)`` and fake-quantized (what the folded
    int8 conv will hold), the conv output scaled back, and the batch norm applied to
    it: batch statistics (updating the running ones) in training mode, running
    statistics in eval mode, where it computes exactly the folded conv."""

    kind = "conv"

    def __init__(self, weight: Any, bias: Any, mean: Any, var: Any, gamma: Any, beta: Any, stride: Any,
                 padding: Any, dilation: Any, groups: int, eps: float = 1e-5, momentum: float = 0.1,
                 bits: int = 8, scheme: str = "per_channel_symmetric") -> None:
        super().__init__(weight, bias, stride, padding, dilation, groups, bits, scheme)
        n = self.weight.shape[0]
        self.bn = TrainableBatchNorm(n, eps=float(eps), momentum=float(momentum))
        with torch.no_grad():
            self.bn.running_mean.copy_(torch.as_tensor(mean).float())
            self.bn.running_var.copy_(torch.as_tensor(var).float())
            self.bn.weight.copy_(torch.ones(n) if gamma is None else torch.as_tensor(gamma).float())
            self.bn.bias.copy_(torch.zeros(n) if beta is None else torch.as_tensor(beta).float())
        for mine, given in ((self.bn.weight, gamma), (self.bn.bias, beta)):
            # one the model froze stays frozen; a batch norm without one (affine=False) gets none to train
            if given is None or (isinstance(given, nn.Parameter) and not given.requires_grad):
                mine.requires_grad_(False)

    def _scale(self) -> torch.Tensor:
        return self.bn.weight / torch.sqrt(self.bn.running_var + self.bn.eps)

    def _divisible_scale(self) -> torch.Tensor:
        """``_scale`` with 1 for a channel whose gamma is 0 (a residual branch's last
        batch norm, zero-initialised): the conv output is divided by it, and 0/0 would
        make that channel NaN (and the running statistics with it). The batch norm's
        gamma of 0 makes the channel its beta either way; its statistics and its gamma's
        gradient come from the conv with the plain weight."""
        scale = self._scale()
        return torch.where(scale == 0, torch.ones_like(scale), scale)

    def _shape(self, t: torch.Tensor, axis: int) -> torch.Tensor:
        shape = [1] * (self.rank + 2)
        shape[axis] = -1
        return t.reshape(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self._divisible_scale()
        w = self.weight_fake_quant(self.weight * self._shape(scale, 0))
        y = self.conv(x, w, None) / self._shape(scale, 1)
        if self.bias is not None:
            y = y + self._shape(self.bias, 1)
        return self.bn(y)

    def folded(self) -> tuple:
        scale = self._scale()
        w = self.weight * self._shape(scale, 0)
        b = self.bias if self.bias is not None else torch.zeros_like(self.bn.running_mean)
        return w, (b - self.bn.running_mean) * scale + self.bn.bias


class QATLinear(QATLayer):
    """``linear(x, fake_quant(weight), bias)``: the weight and bias trainable."""

    kind = "linear"

    def __init__(self, weight: Any, bias: Any, bits: int = 8, scheme: str = "per_channel_symmetric") -> None:
        super().__init__()
        self.weight = _param(weight)
        self.bias = _param(bias)
        self.weight_fake_quant = weight_fake_quant(bits, scheme)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight_fake_quant(self.weight), self.bias)

    def facts_forward(self, x: torch.Tensor) -> torch.Tensor:
        """As ``QATConv.facts_forward``."""
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"weight={list(self.weight.shape)}, bits={self.weight_fake_quant.quant_max.bit_length() + 1}"


# ---------------------------------------------------------------- modules the rules insert


@register_module(inputs=("x",), choices={"kind": tuple(_ACT_OBSERVERS)})
def activation_fake_quant(x: Any = None, kind: str = "moving_average") -> nn.Module:
    """An activation fake quantizer: torch's ``FakeQuantize``, per-tensor affine
    ``quint8`` (the scale computed for 7 bits on CPUs without VNNI, as PTQ's
    observers reduce their range; values still rounded to all 256 levels, as the
    int8 model's tensors hold them), with a
    ``MovingAverageMinMaxObserver`` (``kind="moving_average"``, torch.ao's QAT
    default) or a ``MinMaxObserver`` (``"minmax"``) recording finite values only."""
    if kind not in _ACT_OBSERVERS:
        raise ValueError(f"unknown observer kind {kind!r}; expected one of {sorted(_ACT_OBSERVERS)}")
    fq = QATFakeQuantize(observer=_ACT_OBSERVERS[kind], quant_min=0, quant_max=255, dtype=torch.quint8,
                         qscheme=torch.per_tensor_affine)
    if not vnni_available():
        # the scale spreads the observed range over 128 levels (fbgemm without VNNI
        # can saturate), the rounding clamps to all 256, as the int8 tensors will
        fq.activation_post_process = _ACT_OBSERVERS[kind](quant_min=0, quant_max=127, dtype=torch.quint8,
                                                          qscheme=torch.per_tensor_affine)
        fq.quant_min, fq.quant_max = 0, 255
    return fq


@register_module(inputs=("x",), choices=_LAYER_CHOICES)
def qat_conv(x: Any = None, weight: Any = None, bias: Any = None, stride: Any = 1, padding: Any = 0,
             dilation: Any = 1, groups: int = 1, bits: int = 8, scheme: str = "per_channel_symmetric") -> nn.Module:
    """A conv whose weight is fake-quantized to ``bits`` (``scheme``) as it trains."""
    return QATConv(weight, bias, stride, padding, dilation, groups, bits, scheme)


@register_module(inputs=("x",), choices=_LAYER_CHOICES)
def qat_conv_bn(x: Any = None, weight: Any = None, bias: Any = None, mean: Any = None, var: Any = None,
                gamma: Any = None, beta: Any = None, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
                groups: int = 1, eps: float = 1e-5, momentum: float = 0.1, bits: int = 8,
                scheme: str = "per_channel_symmetric") -> nn.Module:
    """A conv and its batch norm, the fold simulated while they train (``QATConvBn``),
    in eval mode as the batch norm it replaces was (``training=False``: running
    statistics); ``model.train()`` (``rewrite.qat.prepare_qat`` does) makes it use
    and update batch statistics."""
    if momentum is None or not isinstance(momentum, (int, float)) or not math.isfinite(momentum):
        raise ValueError(f"qat_conv_bn: momentum must be a number, got {momentum!r}")
    return QATConvBn(weight, bias, mean, var, gamma, beta, stride, padding, dilation, groups, eps, momentum,
                     bits, scheme).eval()


@register_module(inputs=("x",), choices=_LAYER_CHOICES)
def qat_linear(x: Any = None, weight: Any = None, bias: Any = None, bits: int = 8,
               scheme: str = "per_channel_symmetric") -> nn.Module:
    """A linear whose weight is fake-quantized to ``bits`` (``scheme``) as it trains."""
    return QATLinear(weight, bias, bits, scheme)


# ---------------------------------------------------------------- predicates


def _submodule(node: Any, gm: Any) -> Any:
    if not isinstance(node, fx.Node) or node.op != "call_module":
        return None
    try:
        return gm.get_submodule(node.target)
    except AttributeError:
        return None


def is_fake_quant_node(node: Any, gm: Any) -> bool:
    """``node`` calls a torch fake quantizer module."""
    return isinstance(_submodule(node, gm), FakeQuantizeBase)


def is_qat_layer_node(node: Any, gm: Any) -> bool:
    """``node`` calls a QAT conv or linear (``QATLayer``)."""
    return isinstance(_submodule(node, gm), QATLayer)


def _single_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _all_fake_quantized(node: fx.Node, gm: Any) -> bool:
    return bool(node.users) and all(is_fake_quant_node(u, gm) for u in node.users)


def _through(node: fx.Node, gm: Any) -> Any:
    """The input whose quantization ``node``'s output keeps: a passthrough op's
    (pooling, relu, reshapes, zero padding), or a dropout's (the identity in eval
    mode and in the int8 model; PTQ's cleanup rules delete it)."""
    bound = ops_of(node, gm).get("dropout")
    return bound.args.get("input") if bound is not None else passthrough_input(node, gm)


@register_predicate()
def fake_quantized(x: Value) -> bool:
    """``x`` comes out of a fake quantizer, directly or through passthrough ops
    (pooling, relu, reshapes, zero padding, dropout) that keep its quantization
    parameters."""
    return reaches(x.node, x.facts.gm, is_fake_quant_node, _through)


@register_predicate()
def output_fake_quantized(x: Value) -> bool:
    """Every user of ``x`` is a fake quantizer (and it has at least one)."""
    node = x.node
    return node is not None and _all_fake_quantized(node, x.facts.gm)


def _conv_bn(node: Any, gm: Any) -> bool:
    """``node`` is a batch norm of a conv output that nothing else reads."""
    bound = ops_of(node, gm).get("batch_norm")
    if bound is None:
        return False
    inner = bound.args.get("input")
    return isinstance(inner, fx.Node) and "conv" in ops_of(inner, gm) and _single_user(inner) is node


@register_predicate()
def conv_bn_output(x: Value) -> bool:
    """``x`` is a batch norm of a conv output that nothing else reads: one QAT layer."""
    return _conv_bn(x.node, x.facts.gm)


@register_predicate()
def fused_producer(x: Value) -> bool:
    """``x`` is computed by an op an int8 kernel fuses an activation into: conv,
    linear, add, mul, or a batch norm of a conv (folded into it)."""
    node, gm = x.node, x.facts.gm
    return bool(set(ops_of(node, gm)) & set(_FUSABLE)) or _conv_bn(node, gm)


@register_predicate()
def kernel_output_fake_quantized(x: Value) -> bool:
    """What one int8 kernel computes from ``x`` on is fake-quantized: every user of
    ``x`` is a fake quantizer, or its one user is a batch norm (folded into the
    conv) or a fusable activation (relu, hardtanh, relu6) whose users all are."""
    node, gm = x.node, x.facts.gm
    if node is None:
        return False
    for _ in range(3):
        if _all_fake_quantized(node, gm):
            return True
        node = _single_user(node)
        if node is None or not set(ops_of(node, gm)) & {*_ACTIVATIONS, "batch_norm"}:
            return False
    return False
