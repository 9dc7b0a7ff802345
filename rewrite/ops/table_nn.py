"""The vocabulary, part one: the layers of a network.

Convolution, linear, normalization, activations, dropout, pooling, embedding and
attention: the ops that exist as ``nn`` modules, ``F`` functions and aten ops, and so
are spelled most differently across capture levels. One ``op(...)`` per canonical op;
see ``rewrite.ops.builders`` for the notation. Emission: ``torch`` is what dynamo
records for the op; ``aten`` is what ``torch.export``'s training IR records.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from rewrite.ops import modules
from rewrite.ops.base import Instances
from rewrite.ops.builders import fn, item, method, module, op
from rewrite.ops.forms import EmitError
from rewrite.ops.resolve import resolve

__all__ = ["OPS", "standard"]


def _exists(qualname: str) -> bool:
    try:
        resolve(qualname)
        return True
    except (AttributeError, RuntimeError):
        return False


def standard(name: str, **opts: Any) -> list:
    """Every conventional spelling of op ``name`` that exists in this torch:
    ``torch.name(_)``, ``F.name(_)``, ``x.name(_)()``, ``aten.name(_).default``."""
    specs = []
    for q in (f"torch.{name}", f"torch.{name}_", f"F.{name}", f"F.{name}_",
              f"aten.{name}.default", f"aten.{name}_.default"):
        if _exists(q):
            specs += fn(q, **opts)
    for m in (name, f"{name}_"):
        if hasattr(torch.Tensor, m):
            specs += method(m, **opts)
    return specs


def _rank(args: dict, facts: Callable) -> int | None:
    """Spatial rank of a convolution: from the weight's metadata, else from a
    stride/padding/dilation written per dimension."""
    info = facts(args["weight"]) if isinstance(args["weight"], fx.Node) else args["weight"]
    if getattr(info, "ndim", None) is not None:
        return info.ndim - 2
    for name in ("stride", "padding", "dilation", "output_padding"):
        value = args.get(name)
        if isinstance(value, (list, tuple)) and len(value) >= 2:
            return len(value)
    return None


def _by_rank(pattern: str, fallback: str, padding_overload: str | None = None,
             rank_names: dict | None = None) -> Callable:
    """Choose the 1d/2d/3d target by rank (``rank_names`` for irregular names), the
    rank-generic ``fallback`` when the rank is unknown."""
    def choose(args: dict, facts: Callable) -> str:
        rank = _rank(args, facts)
        if isinstance(args.get("padding"), str):
            if rank not in (1, 2, 3):
                raise EmitError("padding given as a string needs the weight's rank")
            return (padding_overload or pattern).format(rank)
        if rank not in (1, 2, 3):
            return fallback
        return (rank_names or {}).get(rank, pattern.format(rank))

    return choose


_UPSAMPLE = {("nearest", 1): "aten.upsample_nearest1d.vec", ("nearest", 2): "aten.upsample_nearest2d.vec",
             ("nearest", 3): "aten.upsample_nearest3d.vec", ("linear", 1): "aten.upsample_linear1d.vec",
             ("bilinear", 2): "aten.upsample_bilinear2d.vec", ("bicubic", 2): "aten.upsample_bicubic2d.vec",
             ("trilinear", 3): "aten.upsample_trilinear3d.vec",
             ("nearest-exact", 1): "aten._upsample_nearest_exact1d.vec",
             ("nearest-exact", 2): "aten._upsample_nearest_exact2d.vec",
             ("nearest-exact", 3): "aten._upsample_nearest_exact3d.vec"}
_NEAREST = ("nearest", "nearest-exact")


def _upsample_aten(args: dict, facts: Callable) -> tuple:
    """The aten kernel of a mode and spatial rank (the input's rank - 2, from its
    metadata, else the length of a per-dim size or scale); a size or scale given once
    is given per spatial dim, as aten takes it."""
    info = facts(args["input"]) if isinstance(args["input"], fx.Node) else args["input"]
    rank = getattr(info, "ndim", None)
    rank = None if rank is None else rank - 2
    for per_dim in (args["size"], args["scale_factor"]):  # a size or scale written per dim
        if rank is None and isinstance(per_dim, (list, tuple)):
            rank = len(per_dim)
    name = _UPSAMPLE.get((args["mode"], rank))
    if name is None:
        raise EmitError(f"interpolate: no aten kernel for mode {args['mode']!r} on a rank-{rank} input")
    size, scale = args["size"], args["scale_factor"]
    out = dict(args, size=[size] * rank if isinstance(size, int) else size,
               scale_factor=[float(scale)] * rank if isinstance(scale, (int, float)) else scale)
    if args["mode"] not in _NEAREST:
        out["align_corners"] = bool(args["align_corners"])
    return name, out


def _as_list(value: Any) -> Any:
    """``aten.convolution`` takes int lists; a single int broadcasts as ``[int]``."""
    return [value] if isinstance(value, int) else value


def _same(value: Any) -> Any:
    return value


def _none_if_empty(value: Any) -> Any:
    return None if isinstance(value, (list, tuple)) and len(value) == 0 else value


def _empty_if_none(value: Any) -> Any:
    return [] if value is None else value


_CONV_LISTS = {n: (_same, _as_list) for n in ("stride", "padding", "dilation", "output_padding")}
# aten pooling spells "stride defaults to kernel_size" as [], F spells it None
_POOL_STRIDE = {"stride": (_none_if_empty, _empty_if_none)}


def _embedding_aten(args: dict, facts: Callable) -> Any:
    """aten.embedding takes padding_idx -1 for none and non-negative otherwise."""
    idx = args.get("padding_idx")
    if idx is None:
        return "aten.embedding.default", {**args, "padding_idx": -1}
    if idx < 0:
        info = facts(args["weight"])
        if getattr(info, "shape", None) is None:
            raise EmitError("negative padding_idx needs the embedding weight's shape")
        return "aten.embedding.default", {**args, "padding_idx": info.shape[0] + idx}
    return "aten.embedding.default"


OPS = [
    # ---- convolution ---------------------------------------------------------
    # conv: torch.convN d / F.convNd are the same builtin; aten.convolution is shared
    # with conv_transpose and told apart by its `transposed` flag.
    op("conv", "input: T, weight: T, bias: T = None, stride=1, padding=0, dilation=1, groups=1",
       fn("torch.conv1d", "torch.conv2d", "torch.conv3d", "F.conv1d", "F.conv2d", "F.conv3d"),
       fn(*[f"aten.conv{n}d.{ov}" for n in (1, 2, 3) for ov in ("default", "padding")]),
       fn("aten.convolution.default", "torch.convolution", guards={"transposed": False},
          ignore={"output_padding"}, fill={"output_padding": [0]}, convert=_CONV_LISTS),
       module("nn.Conv1d", "nn.Conv2d", "nn.Conv3d", extract=modules.conv),
       instances=Instances("conv"),
       torch=_by_rank("torch.conv{}d", "torch.convolution"),
       aten=_by_rank("aten.conv{}d.default", "aten.convolution.default", "aten.conv{}d.padding"),
       doc="1d/2d/3d convolution (rank from the weight)"),

    op("conv_transpose",
       "input: T, weight: T, bias: T = None, stride=1, padding=0, output_padding=0, groups=1, dilation=1",
       fn("torch.conv_transpose1d", "torch.conv_transpose2d", "torch.conv_transpose3d",
          "F.conv_transpose1d", "F.conv_transpose2d", "F.conv_transpose3d"),
       fn("aten.conv_transpose1d.default", "aten.conv_transpose2d.input", "aten.conv_transpose3d.input"),
       fn("aten.convolution.default", "torch.convolution", guards={"transposed": True}, convert=_CONV_LISTS),
       module("nn.ConvTranspose1d", "nn.ConvTranspose2d", "nn.ConvTranspose3d", extract=modules.conv_transpose),
       instances=Instances("conv_transpose"),
       torch=_by_rank("torch.conv_transpose{}d", "torch.convolution"),
       aten=_by_rank("aten.conv_transpose{}d.input", "aten.convolution.default",
                     rank_names={1: "aten.conv_transpose1d.default"}),
       doc="1d/2d/3d transposed convolution"),

    # ---- linear --------------------------------------------------------------
    # F.linear is torch._C._nn.linear, which is what dynamo records.
    op("linear", "input: T, weight: T, bias: T = None",
       fn("F.linear", "torch._C._nn.linear", "aten.linear.default"),
       module("nn.Linear", extract=modules.linear),
       instances=Instances("linear"),
       torch="F.linear", aten="aten.linear.default",
       doc="y = x @ weight.T + bias (core ATen spells it addmm/mm + permute)"),

    # ---- normalization -------------------------------------------------------
    # torch.batch_norm / aten.batch_norm order (weight, bias, mean, var), F.batch_norm
    # orders (mean, var, weight, bias); core ATen returns a tuple, output 0 is the op.
    op("batch_norm",
       "input: T, running_mean: T, running_var: T, weight: T = None, bias: T = None, "
       "training=False, momentum=0.1, eps=1e-5",
       fn("F.batch_norm"),
       fn("torch.batch_norm", "aten.batch_norm.default", ignore={"cudnn_enabled"}, fill={"cudnn_enabled": False}),
       module("nn.BatchNorm1d", "nn.BatchNorm2d", "nn.BatchNorm3d", extract=modules.batch_norm),
       item("aten._native_batch_norm_legit_no_training.default", fixed={"training": False}),
       item("aten._native_batch_norm_legit_functional.default"),
       item("aten._native_batch_norm_legit.default"),
       item("aten._native_batch_norm_legit.no_stats", fixed={"running_mean": None, "running_var": None}),
       item("aten.native_batch_norm.default"),
       # training (False or True) is drawn by the family: it needs more than one value per channel
       instances=Instances("batch_norm", literals=(("momentum", (0.1, 0.01)), ("eps", (1e-5, 1e-3, 0.1))),
                           operand_ranges=(("running_var", "positive"),)),
       torch="F.batch_norm", aten="aten.batch_norm.default",
       writes=(("running_mean", "training"), ("running_var", "training")),
       doc="batch normalization (eval: running stats; training: batch stats, updates the running ones)"),

    op("layer_norm", "input: T, normalized_shape, weight: T = None, bias: T = None, eps=1e-5",
       fn("F.layer_norm"),
       fn("torch.layer_norm", "aten.layer_norm.default", ignore={"cudnn_enable"}, fill={"cudnn_enable": False}),
       item("aten.native_layer_norm.default"),
       module("nn.LayerNorm", extract=modules.layer_norm),
       instances=Instances("layer_norm", literals=(("eps", (1e-5, 1e-3)),)),
       torch="F.layer_norm", aten="aten.layer_norm.default",
       doc="layer normalization over the trailing normalized_shape dims"),

    # RMSNorm (torch >= 2.4): x * rsqrt(mean(x^2, trailing dims) + eps) * weight; eps=None is finfo(x).eps
    op("rms_norm", "input: T, normalized_shape, weight: T = None, eps=None",
       fn("F.rms_norm", "torch.rms_norm", "aten.rms_norm.default"),
       module("nn.RMSNorm", extract=modules.rms_norm),
       instances=Instances("layer_norm", literals=(("eps", (None, 1e-6, 1e-5)),)),
       torch="F.rms_norm", aten="aten.rms_norm.default",
       doc="root-mean-square normalization over the trailing normalized_shape dims"),

    op("group_norm", "input: T, num_groups, weight: T = None, bias: T = None, eps=1e-5",
       fn("F.group_norm"),
       fn("torch.group_norm", "aten.group_norm.default", ignore={"cudnn_enabled"}, fill={"cudnn_enabled": False}),
       item("aten.native_group_norm.default", rename={"group": "num_groups"}, ignore={"N", "C", "HxW"}),
       module("nn.GroupNorm", extract=modules.group_norm),
       instances=Instances("group_norm", literals=(("eps", (1e-5, 1e-3)),)),
       torch="F.group_norm", aten="aten.group_norm.default",
       doc="group normalization"),

    # ---- activations ---------------------------------------------------------
    # In-place twins (F.relu(x, inplace=True), x.relu_(), aten.relu_) bind to the same
    # op; `rewrite.ops.vocabulary.mutates_input` tells them apart.
    op("relu", "input: T", standard("relu"), module("nn.ReLU", extract=modules.unary),
       instances=Instances("unary"),
       torch="torch.relu", aten="aten.relu.default", elementwise=True, doc="max(x, 0)"),
    op("gelu", "input: T, approximate='none'", standard("gelu"), module("nn.GELU", extract=modules.gelu),
       instances=Instances("unary", literals=(("approximate", ("none", "tanh")),)),
       torch="F.gelu", aten="aten.gelu.default", elementwise=True, doc="Gaussian error linear unit"),
    op("prelu", "input: T, weight: T",
       fn("F.prelu", "torch.prelu", sig="input, weight"), fn("aten.prelu.default"),  # not _prelu_kernel: it broadcasts weight elementwise
       module("nn.PReLU", extract=modules.prelu),
       instances=Instances("prelu"),
       torch="F.prelu", aten="aten.prelu.default", doc="max(x, 0) + weight * min(x, 0), weight per channel"),
    op("silu", "input: T", standard("silu"), module("nn.SiLU", extract=modules.unary),
       instances=Instances("unary"),
       torch="F.silu", aten="aten.silu.default", elementwise=True, doc="x * sigmoid(x)"),
    op("sigmoid", "input: T", standard("sigmoid"), module("nn.Sigmoid", extract=modules.unary),
       instances=Instances("unary"),
       torch="torch.sigmoid", aten="aten.sigmoid.default", elementwise=True, doc="1 / (1 + exp(-x))"),
    op("tanh", "input: T", standard("tanh"), module("nn.Tanh", extract=modules.unary),
       instances=Instances("unary"),
       torch="torch.tanh", aten="aten.tanh.default", elementwise=True, doc="hyperbolic tangent"),
    op("hardswish", "input: T", standard("hardswish"), module("nn.Hardswish", extract=modules.unary),
       instances=Instances("unary"),
       torch="F.hardswish", aten="aten.hardswish.default", elementwise=True, doc="x * relu6(x + 3) / 6"),
    op("hardtanh", "input: T, min_val=-1.0, max_val=1.0", standard("hardtanh"),
       module("nn.Hardtanh", extract=modules.hardtanh),
       module("nn.ReLU6", extract=modules.hardtanh, named=False),  # a Hardtanh(0, 6) subclass
       instances=Instances("unary", literals=(("min_val", (-1.0, 0.0, -2.0, -0.1, -1e5)), ("max_val", (1.0, 6.0, 2.0, 0.1, 1e5)))),
       torch="F.hardtanh", aten="aten.hardtanh.default", elementwise=True, doc="clamp(x, min_val, max_val)"),
    op("leaky_relu", "input: T, negative_slope=0.01", standard("leaky_relu"),
       module("nn.LeakyReLU", extract=modules.leaky_relu),
       instances=Instances("unary", literals=(("negative_slope", (0.01, 0.2, 0.0, 1.0, -0.5, 2.0)),)),
       torch="F.leaky_relu", aten="aten.leaky_relu.default", elementwise=True,
       doc="max(x, 0) + negative_slope * min(x, 0)"),
    # glu halves `dim`: first half * sigmoid(second half); core ATen spells it slice, sigmoid, mul
    op("glu", "input: T, dim=-1", fn("F.glu", "aten.glu.default"), module("nn.GLU", extract=modules.glu),
       instances=Instances("glu"),
       torch="F.glu", aten="aten.glu.default", doc="a * sigmoid(b), a and b the halves of input along dim"),
    # relu6 is also hardtanh(x, 0, 6): nn.ReLU6 calls F.hardtanh, and export records that
    op("relu6", "input: T", standard("relu6"),
       fn("F.hardtanh", "aten.hardtanh.default", "aten.hardtanh_.default",
          guards={"min_val": 0.0, "max_val": 6.0}, named=False),
       module("nn.ReLU6", extract=modules.unary),
       instances=Instances("unary"),
       torch="F.relu6", aten="aten.relu6.default", elementwise=True, doc="min(max(x, 0), 6)"),

    # ---- dropout and identity ------------------------------------------------
    op("dropout", "input: T, p=0.5, training=True",
       fn("F.dropout"),
       fn("torch.dropout", "aten.dropout.default", rename={"train": "training"}),
       item("aten.native_dropout.default", rename={"train": "training"}),
       module("nn.Dropout", extract=modules.dropout),
       instances=Instances("unary", literals=(("p", (0.0, 0.1, 0.5)), ("training", (False, True)))),
       torch="F.dropout", aten="aten.dropout.default",
       doc="zero elements with probability p when training (identity otherwise)"),
    op("identity", "input: T",
       fn("aten.alias.default"), module("nn.Identity", extract=modules.unary),
       instances=Instances("unary"),
       torch="aten.alias.default", aten="aten.alias.default", doc="returns its input"),

    # ---- pooling -------------------------------------------------------------
    op("max_pool2d", "input: T, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False",
       fn("F.max_pool2d", sig="input, kernel_size, stride=None, padding=0, dilation=1, "
                              "ceil_mode=False, return_indices=False", guards={"return_indices": False}),
       fn("torch.max_pool2d", "aten.max_pool2d.default", convert=_POOL_STRIDE),
       item("aten.max_pool2d_with_indices.default", convert=_POOL_STRIDE),
       module("nn.MaxPool2d", extract=modules.max_pool2d),
       instances=Instances("pool", literals=(("ceil_mode", bool),)),
       torch="F.max_pool2d", aten="aten.max_pool2d.default", doc="2d max pooling"),
    op("avg_pool2d",
       "input: T, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True, "
       "divisor_override=None",
       fn("F.avg_pool2d", "aten.avg_pool2d.default", convert=_POOL_STRIDE),
       module("nn.AvgPool2d", extract=modules.avg_pool2d),
       instances=Instances("pool", literals=(("ceil_mode", bool), ("count_include_pad", bool),
                                             ("divisor_override", (None, 1, 3)))),
       torch="F.avg_pool2d", aten="aten.avg_pool2d.default", doc="2d average pooling"),
    op("adaptive_avg_pool2d", "input: T, output_size",
       fn("F.adaptive_avg_pool2d", "torch._C._nn.adaptive_avg_pool2d",
          "aten.adaptive_avg_pool2d.default", "aten._adaptive_avg_pool2d.default"),
       module("nn.AdaptiveAvgPool2d", extract=modules.adaptive_avg_pool2d),
       instances=Instances("adaptive_pool"),
       torch="F.adaptive_avg_pool2d", aten="aten.adaptive_avg_pool2d.default",
       doc="2d average pooling to a fixed output size"),

    # ---- embedding and attention ---------------------------------------------
    # aten.embedding takes (weight, indices) and writes "no padding index" as -1
    op("embedding",
       "input: T, weight: T, padding_idx=None, max_norm=None, norm_type=2.0, "
       "scale_grad_by_freq=False, sparse=False",
       fn("F.embedding"),
       fn("torch.embedding", "aten.embedding.default", rename={"indices": "input"},
          convert={"padding_idx": (lambda v: None if v == -1 else v, _same)}),
       module("nn.Embedding", extract=modules.embedding),
       instances=Instances("embedding", operand_ranges=(("input", "index:weight"),)),
       torch="F.embedding", aten=_embedding_aten, doc="rows of weight indexed by input"),
    # F.interpolate / nn.Upsample; export records aten.upsample_<mode><rank>d.vec (sizes and
    # scales per spatial dim; align_corners False, not None, for the interpolating modes)
    op("interpolate", "input: T, size=None, scale_factor=None, mode='nearest', align_corners=None",
       fn("F.interpolate", guards={"recompute_scale_factor": None, "antialias": False}),
       module("nn.Upsample", extract=modules.upsample),
       *[fn(name, rename={"output_size": "size", "scale_factors": "scale_factor"},
            fixed={"mode": mode, **({"align_corners": None} if mode in _NEAREST else {})})
         for (mode, _), name in _UPSAMPLE.items()],
       instances=Instances("interpolate"),
       torch="F.interpolate", aten=_upsample_aten,
       doc="resize the spatial dims (nearest, linear, bilinear, bicubic, trilinear)"),

    op("scaled_dot_product_attention",
       "query: T, key: T, value: T, attn_mask: T = None, dropout_p=0.0, is_causal=False, "
       "scale=None, enable_gqa=False",
       fn("F.scaled_dot_product_attention", "aten.scaled_dot_product_attention.default"),
       instances=Instances("attention"),
       torch="F.scaled_dot_product_attention", aten="aten.scaled_dot_product_attention.default",
       doc="softmax(q @ k.T * scale + mask) @ v"),
]
