"""The vocabulary, part two: tensor arithmetic, shapes, casts and indexing.

These ops have no module form but the most spellings: ``x + y``, ``x += y``,
``torch.add``, ``x.add``, ``x.add_``, ``aten.add.Tensor``, ``aten.add.Scalar``.
Methods that take varargs (``x.view(2, -1)``) are written ``sig="self, *size"``.
See ``rewrite.ops.builders`` for the notation.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from rewrite.ops import modules
from rewrite.ops.base import Instances
from rewrite.ops.builders import fn, method, module, op
from rewrite.ops.forms import EmitError, OneOf
from rewrite.ops.table_nn import standard

__all__ = ["OPS"]

_BINARY = "input, other"
_PRESERVE = OneOf(None, torch.preserve_format)


def _is_dtype(args: dict) -> bool:
    return isinstance(args.get("dtype"), torch.dtype)


def _not_dtype(name: str) -> Callable:
    """``x.view(torch.int32)`` reinterprets bits: not a shape view."""
    return lambda args: not isinstance(args.get(name), torch.dtype)


def _is_node(value: Any) -> bool:
    return isinstance(value, fx.Node)


def _div_aten(args: dict, facts: Callable) -> str:
    return "aten.div.Tensor" if args["rounding_mode"] is None else "aten.div.Tensor_mode"


def _pow_aten(args: dict, facts: Callable) -> str:
    if not _is_node(args["input"]):
        return "aten.pow.Scalar"
    return "aten.pow.Tensor_Tensor" if _is_node(args["exponent"]) else "aten.pow.Tensor_Scalar"


def _mean_aten(args: dict, facts: Callable) -> str:
    return "aten.mean.default" if args["dim"] is None and not args["keepdim"] else "aten.mean.dim"


def _sum_aten(args: dict, facts: Callable) -> str:
    return "aten.sum.default" if args["dim"] is None and not args["keepdim"] else "aten.sum.dim_IntList"


def _squeeze_aten(args: dict, facts: Callable) -> str:
    dim = args["dim"]
    if dim is None:
        return "aten.squeeze.default"
    return "aten.squeeze.dims" if isinstance(dim, (list, tuple)) else "aten.squeeze.dim"


def _clamp_aten(args: dict, facts: Callable) -> str:
    tensor_bound = _is_node(args["min"]) or _is_node(args["max"])
    return "aten.clamp.Tensor" if tensor_bound else "aten.clamp.default"


def _cast(method_name: str, dtype: torch.dtype) -> list:
    """``x.float()`` is ``to(x, torch.float32)``."""
    return method(method_name, sig="self, memory_format=None", fixed={"dtype": dtype},
                  guards={"memory_format": _PRESERVE})


_TO_GUARDS = {"non_blocking": False, "copy": False, "memory_format": _PRESERVE}


def _int_dim(args: dict) -> bool:
    """``torch.max(x, 1)`` reduces a dim; ``torch.max(x, y)`` is an elementwise maximum."""
    return isinstance(args.get("dim"), int) and not isinstance(args.get("dim"), bool)


def _split_aten(args: dict, facts: Callable) -> str:
    return "aten.split.Tensor" if isinstance(args["split_size"], int) else "aten.split_with_sizes.default"


def _masked_fill_aten(args: dict, facts: Callable) -> str:
    return "aten.masked_fill.Tensor" if _is_node(args["value"]) else "aten.masked_fill.Scalar"


def _as_tuple(value: Any) -> Any:
    """One operand (a lone node) or several: always a tuple, as aten's list."""
    return (value,) if isinstance(value, fx.Node) else tuple(value) if isinstance(value, list) else value


_TENSOR_LIST = {"tensors": (_as_tuple, list)}


def _no_bool_dim(args: dict) -> bool:
    """``torch.var(x, True)`` is the ``unbiased`` overload: a bool is no dim (nor is
    a graph value, whose kind the call does not show)."""
    dim = args.get("dim")
    if dim is None or (isinstance(dim, int) and not isinstance(dim, bool)):
        return True
    return isinstance(dim, (list, tuple)) and all(isinstance(d, int) and not isinstance(d, bool) for d in dim)


def _bool_unbiased(args: dict) -> bool:
    return isinstance(args.get("unbiased", True), bool)


def _correction_from_unbiased(value: Any) -> Any:
    return 1 if value is True else 0 if value is False else value


def _unbiased_from_correction(value: Any) -> bool:
    if value is True or value is False or value not in (0, 1):
        raise EmitError(f"correction {value!r} has no unbiased spelling")
    return bool(value)


#: ``correction=None`` is Bessel's 1; ``unbiased`` is correction 1 (True) or 0 (False)
_CORRECTION = {"correction": (lambda v: 1 if v is None else int(v) if isinstance(v, bool) else v, lambda v: v)}
_UNBIASED = {"correction": (_correction_from_unbiased, _unbiased_from_correction)}


def _variance(name: str) -> tuple:
    """The surfaces of ``var``/``std``: torch calls them with a correction
    (``x.var(-1, correction=0)``), with ``unbiased`` after the dims
    (``x.var(-1, False, True)``, ``unbiased=False``) or with ``unbiased`` alone
    (``torch.var(x, False)``); each spelling is a form of its own, told apart by
    what its arguments are (``_no_bool_dim``)."""
    by_correction = "dim=None, *, correction=None, keepdim=False"
    by_unbiased = "dim, unbiased=True, keepdim=False"
    alone = {"rename": {"unbiased": "correction"}, "convert": _UNBIASED, "check": _bool_unbiased,
             "fixed": {"dim": None, "keepdim": False}}
    return (
        fn(f"torch.{name}", sig=f"input, {by_correction}", check=_no_bool_dim, convert=_CORRECTION),
        fn(f"torch.{name}", sig=f"input, {by_unbiased}", rename={"unbiased": "correction"}, check=_no_bool_dim,
           convert=_UNBIASED),
        fn(f"torch.{name}", sig="input, unbiased=True", **alone),
        method(name, sig=f"self, {by_correction}", check=_no_bool_dim, convert=_CORRECTION),
        method(name, sig=f"self, {by_unbiased}", rename={"unbiased": "correction"}, check=_no_bool_dim,
               convert=_UNBIASED),
        method(name, sig="self, unbiased=True", **alone),
        fn(f"aten.{name}.correction", convert=_CORRECTION),
        fn(f"aten.{name}.dim", rename={"unbiased": "correction"}, check=_no_bool_dim, convert=_UNBIASED),
        fn(f"aten.{name}.default", **alone),
    )

OPS = [
    # ---- arithmetic ----------------------------------------------------------
    # x + y, x += y, torch.add, x.add, x.add_, aten.add.{Tensor,Scalar}: add(x, y, alpha=1)
    op("add", "input: T, other: T, alpha=1",
       fn("operator.add", "operator.iadd", sig=_BINARY),
       fn("torch.add", "aten.add.Tensor", "aten.add.Scalar", "aten.add_.Tensor", "aten.add_.Scalar"),
       method("add", "add_"),
       instances=Instances("binary", literals=(("alpha", (1, 2, -1, 0.5, 0)),)),
       torch="torch.add", aten="aten.add.Tensor", commutative=True, elementwise=True,
       doc="input + alpha * other"),
    # rsub(a, b, alpha) = b - alpha * a = sub(b, a, alpha): `1 - x` is aten.rsub(x, 1)
    op("sub", "input: T, other: T, alpha=1",
       fn("operator.sub", "operator.isub", sig=_BINARY),
       fn("torch.sub", "aten.sub.Tensor", "aten.sub.Scalar", "aten.sub_.Tensor", "aten.sub_.Scalar"),
       method("sub", "sub_"),
       fn("torch.rsub", rename={"input": "other", "other": "input"}),
       fn("aten.rsub.Scalar", "aten.rsub.Tensor", rename={"self": "other", "other": "input"}),
       instances=Instances("binary", literals=(("alpha", (1, 2, -1, 0.5, 0)),)),
       torch="torch.sub", aten="aten.sub.Tensor", elementwise=True, doc="input - alpha * other"),
    op("mul", "input: T, other: T",
       fn("operator.mul", "operator.imul", sig=_BINARY),
       fn("torch.mul", "aten.mul.Tensor", "aten.mul.Scalar", "aten.mul_.Tensor", "aten.mul_.Scalar"),
       method("mul", "mul_"),
       instances=Instances("binary"),
       torch="torch.mul", aten="aten.mul.Tensor", commutative=True, elementwise=True, doc="input * other"),
    # a // b on tensors is div(a, b, rounding_mode="floor")
    op("div", "input: T, other: T, rounding_mode=None",
       fn("operator.truediv", "operator.itruediv", sig=_BINARY),
       fn("operator.floordiv", "operator.ifloordiv", sig=_BINARY, fixed={"rounding_mode": "floor"}),
       fn("torch.div", sig="input, other, *, rounding_mode=None"),
       method("div", "div_", sig="self, other, *, rounding_mode=None"),
       fn("aten.div.Tensor", "aten.div.Scalar", "aten.div.Tensor_mode", "aten.div.Scalar_mode",
          "aten.div_.Tensor", "aten.div_.Scalar", "aten.div_.Tensor_mode"),
       instances=Instances("binary", literals=(("rounding_mode", (None, "trunc", "floor")),)),
       torch="torch.div", aten=_div_aten, elementwise=True, doc="input / other, optionally rounded"),

    # ---- pointwise math --------------------------------------------------------
    op("neg", "input: T", standard("neg"), fn("torch.negative", "operator.neg", sig="input"),
       instances=Instances("unary"),
       torch="torch.neg", aten="aten.neg.default", elementwise=True, doc="-x"),
    op("abs", "input: T", standard("abs"), fn("operator.abs", sig="input"),
       instances=Instances("unary"),
       torch="torch.abs", aten="aten.abs.default", elementwise=True, doc="|x|"),
    op("exp", "input: T", standard("exp"),
       instances=Instances("unary"),
       torch="torch.exp", aten="aten.exp.default", elementwise=True, doc="e ** x"),
    op("erf", "input: T", standard("erf"), fn("torch.special.erf", sig="input"),
       instances=Instances("unary"),
       torch="torch.erf", aten="aten.erf.default", elementwise=True, doc="the error function"),
    op("log", "input: T", standard("log"),
       instances=Instances("unary", input_range=(0.25, 4.0)),
       torch="torch.log", aten="aten.log.default", elementwise=True, doc="natural logarithm"),
    op("sin", "input: T", standard("sin"),
       instances=Instances("unary"),
       torch="torch.sin", aten="aten.sin.default", elementwise=True, doc="sine"),
    op("cos", "input: T", standard("cos"),
       instances=Instances("unary"),
       torch="torch.cos", aten="aten.cos.default", elementwise=True, doc="cosine"),
    # x.masked_fill(mask, v): v a number (aten .Scalar) or a 0-dim tensor (.Tensor)
    op("masked_fill", "input: T, mask: T, value",
       standard("masked_fill"), fn("aten.masked_fill.Scalar", "aten.masked_fill.Tensor", "aten.masked_fill_.Scalar",
                                   "aten.masked_fill_.Tensor"),
       instances=Instances("masked_fill"),
       torch="torch.masked_fill", aten=_masked_fill_aten, doc="input with value where mask is true"),
    op("sqrt", "input: T", standard("sqrt"),
       instances=Instances("unary", input_range=(0.25, 4.0)),
       torch="torch.sqrt", aten="aten.sqrt.default", elementwise=True, doc="x ** 0.5"),
    op("rsqrt", "input: T", standard("rsqrt"),
       instances=Instances("unary", input_range=(0.25, 4.0)),
       torch="torch.rsqrt", aten="aten.rsqrt.default", elementwise=True, doc="x ** -0.5"),
    op("reciprocal", "input: T", standard("reciprocal"),
       instances=Instances("unary", input_range=(0.25, 4.0)),
       torch="torch.reciprocal", aten="aten.reciprocal.default", elementwise=True, doc="1 / x"),
    op("pow", "input: T, exponent: T",
       fn("operator.pow", "operator.ipow", sig="input, exponent"), standard("pow"),
       fn("aten.pow.Tensor_Tensor", "aten.pow.Tensor_Scalar", "aten.pow.Scalar", "aten.pow_.Scalar",
          "aten.pow_.Tensor"),
       instances=Instances("binary"),
       torch="torch.pow", aten=_pow_aten, elementwise=True, doc="input ** exponent"),
    op("clamp", "input: T, min=None, max=None",
       standard("clamp"), standard("clip"), fn("aten.clamp.Tensor"),
       instances=Instances("unary", literals=(("min", (None, -1.0, 0.0, 1e-6, 1e5)), ("max", (None, 1.0, 2.0, 0.1, -1e5)))),
       torch="torch.clamp", aten=_clamp_aten, elementwise=True, doc="min(max(x, min), max)"),

    # ---- matrix products -----------------------------------------------------
    op("matmul", "input: T, other: T", fn("operator.matmul", "operator.imatmul", sig=_BINARY), standard("matmul"),
       instances=Instances("matmul"),
       torch="torch.matmul", aten="aten.matmul.default", doc="input @ other (broadcasting)"),
    op("mm", "input: T, mat2: T", standard("mm"),
       instances=Instances("mm"),
       torch="torch.mm", aten="aten.mm.default", doc="2d matrix product"),
    op("bmm", "input: T, mat2: T", standard("bmm"),
       instances=Instances("bmm"),
       torch="torch.bmm", aten="aten.bmm.default", doc="batched 3d matrix product"),
    op("addmm", "input: T, mat1: T, mat2: T, beta=1, alpha=1", standard("addmm"),
       instances=Instances("addmm", literals=(("beta", (1, 0.5, 0)), ("alpha", (1, 2)))),
       torch="torch.addmm", aten="aten.addmm.default", doc="beta * input + alpha * (mat1 @ mat2)"),
    op("baddbmm", "input: T, batch1: T, batch2: T, beta=1, alpha=1", standard("baddbmm"),
       instances=Instances("addmm", literals=(("beta", (1, 0.5, 0)), ("alpha", (1, 2)))),
       torch="torch.baddbmm", aten="aten.baddbmm.default", doc="beta * input + alpha * (batch1 @ batch2)"),

    # torch.einsum(eq, a, b) takes varargs (or one list); aten.einsum takes the list
    op("einsum", "equation, tensors: T",
       fn("torch.einsum", sig="equation, *operands", rename={"operands": "tensors"}, convert=_TENSOR_LIST),
       fn("aten.einsum.default", guards={"path": None}, convert=_TENSOR_LIST),
       instances=Instances("einsum"),
       torch="torch.einsum", aten="aten.einsum.default", doc="Einstein summation over the tensors"),

    # ---- reductions and softmax ----------------------------------------------
    op("mean", "input: T, dim=None, keepdim=False",
       fn("torch.mean", sig="input, dim=None, keepdim=False, *, dtype=None", guards={"dtype": None}),
       method("mean", sig="self, dim=None, keepdim=False, *, dtype=None", guards={"dtype": None}),
       fn("aten.mean.default", "aten.mean.dim", guards={"dtype": None}),
       instances=Instances("reduce", literals=(("keepdim", bool),)),
       torch="torch.mean", aten=_mean_aten, doc="mean over dim (all dims when None)"),
    op("sum", "input: T, dim=None, keepdim=False",
       fn("torch.sum", sig="input, dim=None, keepdim=False, *, dtype=None", guards={"dtype": None}),
       method("sum", sig="self, dim=None, keepdim=False, *, dtype=None", guards={"dtype": None}),
       fn("aten.sum.default", "aten.sum.dim_IntList", guards={"dtype": None}),
       instances=Instances("reduce", literals=(("keepdim", bool),)),
       torch="torch.sum", aten=_sum_aten, doc="sum over dim (all dims when None)"),
    # var(x, dim, correction) / std: torch.var(x, -1, keepdim=True), x.var(-1, unbiased=False),
    # torch.var(x, False), aten.var.{correction,dim,default}
    op("var", "input: T, dim=None, correction=1, keepdim=False", *_variance("var"),
       instances=Instances("reduce", literals=(("correction", (1, 0)), ("keepdim", bool))),
       torch="torch.var", aten="aten.var.correction", doc="variance over dim (all dims when None), "
       "divided by the count less correction"),
    op("std", "input: T, dim=None, correction=1, keepdim=False", *_variance("std"),
       instances=Instances("reduce", literals=(("correction", (1, 0)), ("keepdim", bool))),
       torch="torch.std", aten="aten.std.correction", doc="standard deviation over dim (all dims when None), "
       "from the count less correction"),
    op("amax", "input: T, dim=(), keepdim=False", standard("amax"),
       instances=Instances("reduce_dims", literals=(("keepdim", bool),)),
       torch="torch.amax", aten="aten.amax.default", doc="maximum over dim (all dims when empty)"),
    # max(x, dim) returns (values, indices); torch.max(x) and torch.max(x, y) are other ops
    op("max", "input: T, dim, keepdim=False",
       fn("torch.max", sig="input, dim, keepdim=False", check=_int_dim),
       method("max", sig="self, dim, keepdim=False", check=_int_dim),
       fn("aten.max.dim"),
       instances=Instances("reduce_dims", literals=(("keepdim", bool),)),
       torch="torch.max", aten="aten.max.dim", doc="(values, indices) of the maximum along dim"),
    op("topk", "input: T, k, dim=-1, largest=True, sorted=True", standard("topk"),
       instances=Instances("topk", literals=(("largest", bool),)),
       torch="torch.topk", aten="aten.topk.default", doc="(values, indices) of the k largest (or smallest) along dim"),
    # torch.norm / x.norm dispatch on p and dim in Python: not bound; export records this
    op("linalg_vector_norm", "input: T, ord=2, dim=None, keepdim=False",
       fn("torch.linalg.vector_norm", sig="input, ord=2, dim=None, keepdim=False, *, dtype=None",
          guards={"dtype": None}),
       fn("aten.linalg_vector_norm.default", guards={"dtype": None}),
       instances=Instances("reduce", literals=(("ord", (2, 1, float("inf"), 3, 0, -1, float("-inf"), 0.5)),
                                               ("keepdim", bool))),
       torch="torch.linalg.vector_norm", aten="aten.linalg_vector_norm.default",
       doc="(sum |x| ** ord) ** (1 / ord) over dim (all dims when None)"),
    # F.softmax carries _stacklevel; core ATen's _softmax carries half_to_float
    op("softmax", "input: T, dim, dtype=None",
       fn("F.softmax", ignore={"_stacklevel"}),
       fn("torch.softmax", "aten.softmax.int"), method("softmax"),
       fn("aten._softmax.default", guards={"half_to_float": False}),
       module("nn.Softmax", extract=modules.softmax),
       instances=Instances("softmax", literals=(("dtype", (None, torch.float32, torch.float64)),)),
       torch="torch.softmax", aten="aten.softmax.int", doc="softmax along dim"),

    # ---- shapes and views ----------------------------------------------------
    op("reshape", "input: T, shape",
       fn("torch.reshape", "aten.reshape.default"), method("reshape", sig="self, *shape"),
       instances=Instances("reshape"),
       torch="torch.reshape", aten="aten.reshape.default", doc="same data, new shape (copies if needed)"),
    op("view", "input: T, shape",
       method("view", sig="self, *size", rename={"size": "shape"}, check=_not_dtype("size")),
       fn("aten.view.default", "aten._unsafe_view.default", rename={"size": "shape"}),
       instances=Instances("reshape"),
       torch="Tensor.view", aten="aten.view.default", doc="same storage, new shape"),
    op("flatten", "input: T, start_dim=0, end_dim=-1",
       fn("torch.flatten", "aten.flatten.using_ints"), method("flatten"),
       module("nn.Flatten", extract=modules.flatten),
       instances=Instances("flatten"),
       torch="torch.flatten", aten="aten.flatten.using_ints", doc="merge dims start_dim..end_dim"),
    op("permute", "input: T, dims",
       fn("torch.permute", "aten.permute.default"), method("permute", sig="self, *dims"),
       instances=Instances("permute"),
       torch="torch.permute", aten="aten.permute.default", doc="reorder dims"),
    op("transpose", "input: T, dim0, dim1",
       fn("torch.transpose", "aten.transpose.int"), method("transpose"),
       instances=Instances("transpose"),
       torch="torch.transpose", aten="aten.transpose.int", doc="swap two dims"),
    op("t", "input: T", standard("t"),
       instances=Instances("t"),
       torch="torch.t", aten="aten.t.default", doc="transpose of a <= 2d tensor"),
    # x.T as torch.export spells it (Falcon's linears compute x @ self.weight.T)
    op("numpy_T", "input: T", fn("aten.numpy_T.default"),
       instances=Instances("unary"),
       torch="aten.numpy_T.default", aten="aten.numpy_T.default", doc="dims reversed (x.T)"),
    op("unsqueeze", "input: T, dim", standard("unsqueeze"),
       instances=Instances("unsqueeze"),
       torch="torch.unsqueeze", aten="aten.unsqueeze.default", doc="insert a size-1 dim"),
    op("squeeze", "input: T, dim=None",
       fn("torch.squeeze", sig="input, dim=None"), method("squeeze", sig="self, dim=None"),
       fn("aten.squeeze.default", "aten.squeeze.dim", "aten.squeeze.dims"),
       instances=Instances("squeeze"),
       torch="torch.squeeze", aten=_squeeze_aten, doc="drop size-1 dims (all when dim is None)"),
    op("expand", "input: T, size",
       method("expand", sig="self, *size, implicit=False", guards={"implicit": False}),
       fn("aten.expand.default", guards={"implicit": False}),
       instances=Instances("expand"),
       torch="Tensor.expand", aten="aten.expand.default", doc="broadcast to size without copying"),
    op("reshape_as", "input: T, other: T", method("reshape_as"), fn("aten.reshape_as.default"),
       instances=Instances("as"),
       torch="Tensor.reshape_as", aten="aten.reshape_as.default", doc="reshape(input, other.shape)"),
    op("expand_as", "input: T, other: T", method("expand_as"), fn("aten.expand_as.default"),
       instances=Instances("as"),
       torch="Tensor.expand_as", aten="aten.expand_as.default", doc="expand(input, other.shape)"),
    # split_size: an int (pieces of that size) or a list of sizes; returns a tuple
    op("split", "input: T, split_size, dim=0",
       fn("torch.split", rename={"tensor": "input", "split_size_or_sections": "split_size"}),
       method("split"),
       fn("aten.split.Tensor", "aten.split.sizes"),
       fn("aten.split_with_sizes.default", rename={"split_sizes": "split_size"}),
       instances=Instances("split"),
       torch="torch.split", aten=_split_aten, doc="pieces of input along dim (a tuple)"),
    op("chunk", "input: T, chunks, dim=0", standard("chunk"),
       instances=Instances("split"),
       torch="torch.chunk", aten="aten.chunk.default", doc="input in `chunks` pieces along dim (a tuple)"),
    # x[a:b:c] is getitem at the fx level; export spells it aten.slice
    op("slice", "input: T, dim=0, start=None, end=None, step=1", fn("aten.slice.Tensor"),
       instances=Instances("slice"),
       torch="aten.slice.Tensor", aten="aten.slice.Tensor", doc="input[start:end:step] along dim"),
    # F.pad (dynamo: torch._C._nn.pad); core ATen's constant_pad_nd is pad(mode="constant")
    op("pad", "input: T, pad, mode='constant', value=None",
       fn("F.pad", "torch._C._nn.pad", "aten.pad.default"),
       fn("aten.constant_pad_nd.default", "torch.constant_pad_nd", fixed={"mode": "constant"}, defaults={"value": None},
          named=False),
       instances=Instances("pad"),
       torch="F.pad", aten="aten.pad.default", doc="input padded by pad (last dim first)"),
    # core ATen writes x.contiguous() as clone(x, memory_format=contiguous_format)
    op("contiguous", "input: T",
       method("contiguous", sig="self, memory_format=None", guards={"memory_format": torch.contiguous_format},
              defaults={"memory_format": torch.contiguous_format}),
       fn("aten.contiguous.default", guards={"memory_format": torch.contiguous_format},
          defaults={"memory_format": torch.contiguous_format}),
       fn("aten.clone.default", guards={"memory_format": torch.contiguous_format}, named=False),
       instances=Instances("unary"),
       torch="Tensor.contiguous", aten="aten.contiguous.default", doc="x in contiguous memory"),
    op("clone", "input: T",
       fn("torch.clone", "aten.clone.default", guards={"memory_format": _PRESERVE}),
       method("clone", guards={"memory_format": _PRESERVE}),
       instances=Instances("unary"),
       torch="torch.clone", aten="aten.clone.default", doc="a copy of x"),
    op("cat", "tensors: T, dim=0",
       fn("torch.cat", "torch.concat", "aten.cat.default"),
       instances=Instances("cat"),
       torch="torch.cat", aten="aten.cat.default", doc="concatenate along dim"),
    op("stack", "tensors: T, dim=0",
       fn("torch.stack", sig="tensors, dim=0"), fn("aten.stack.default"),
       instances=Instances("stack"),
       torch="torch.stack", aten="aten.stack.default", doc="stack along a new dim"),

    # ---- casts ---------------------------------------------------------------
    # Only dtype casts: x.to("cuda") and x.to(other) are not this op.
    op("to", "input: T, dtype",
       method("to", sig="self, dtype, non_blocking=False, copy=False, *, memory_format=None",
              guards=_TO_GUARDS, check=_is_dtype),
       method("type", sig="self, dtype=None, non_blocking=False", guards={"non_blocking": False},
              check=_is_dtype),
       _cast("float", torch.float32), _cast("double", torch.float64), _cast("half", torch.float16),
       _cast("bfloat16", torch.bfloat16), _cast("int", torch.int32), _cast("long", torch.int64),
       _cast("bool", torch.bool),
       fn("aten.to.dtype", guards=_TO_GUARDS),
       fn("aten.to.dtype_layout", check=_is_dtype, guards={**_TO_GUARDS, "layout": OneOf(None, torch.strided),
                                                           "device": None, "pin_memory": None}),
       fn("aten._to_copy.default", check=_is_dtype, guards={
           "layout": OneOf(None, torch.strided), "device": None, "pin_memory": None,
           "non_blocking": False, "memory_format": _PRESERVE}),
       instances=Instances("to"),
       torch="Tensor.to", aten="aten.to.dtype", doc="cast to dtype"),

    op("type_as", "input: T, other: T", method("type_as"), fn("aten.type_as.default"),
       instances=Instances("as"),
       torch="Tensor.type_as", aten="aten.type_as.default", doc="input cast to other's dtype"),

    # ---- indexing ------------------------------------------------------------
    op("select", "input: T, dim, index",
       fn("torch.select", sig="input, dim, index"), method("select", sig="self, dim, index"),
       fn("aten.select.int"),
       instances=Instances("select"),
       torch="torch.select", aten="aten.select.int", doc="input[..., index, ...] along dim (dim dropped)"),
    op("getitem", "input: T, index",
       fn("operator.getitem", sig="input, index"),
       instances=Instances("getitem"),
       torch="operator.getitem", aten="operator.getitem", doc="input[index] (also a tuple output)"),

    # ---- quantization --------------------------------------------------------
    op("quantize_per_tensor", "input: T, scale, zero_point, dtype",
       fn("torch.quantize_per_tensor", "aten.quantize_per_tensor.default"),
       instances=Instances("quantize"),
       torch="torch.quantize_per_tensor", aten="aten.quantize_per_tensor.default",
       doc="affine quantization to a quantized tensor"),
    op("dequantize", "input: T", fn("torch.dequantize", "aten.dequantize.self"), method("dequantize"),
       instances=Instances("dequantize"),
       torch="torch.dequantize", aten="aten.dequantize.self", doc="quantized tensor back to float"),
]
