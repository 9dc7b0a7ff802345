"""Count batch norms in a captured graph, whatever the capture level.

Tests and benchmarks need to know whether fusion left any foldable batch norm
behind. A batch norm is spelled differently at each level (an ``nn.BatchNorm2d``
call_module, ``F.batch_norm``, ``aten.batch_norm``,
``aten._native_batch_norm_legit_no_training``), and so is the conv or linear
before it; this module recognizes them all by node target, independently of
the engine's own op vocabulary so that it can check that vocabulary.
"""

from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F
from torch import fx, nn

__all__ = ["is_batch_norm", "is_conv_or_linear", "batch_norm_nodes", "foldable_batch_norms",
           "count_batch_norms", "count_foldable_batch_norms"]

_aten = torch.ops.aten

_BN_TARGETS = {
    F.batch_norm, torch.batch_norm, torch.native_batch_norm,
    _aten.batch_norm.default,
    _aten._native_batch_norm_legit_no_training.default,
    _aten._native_batch_norm_legit.default,
    _aten._native_batch_norm_legit.no_stats,
    _aten.native_batch_norm.default,
    _aten._batch_norm_with_update.default,
    _aten._batch_norm_no_update.default,
    _aten.cudnn_batch_norm.default,
}

_CONV_TARGETS = {
    F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
    torch.conv1d, torch.conv2d, torch.conv3d,
    torch.conv_transpose1d, torch.conv_transpose2d, torch.conv_transpose3d,
    torch.convolution,
    F.linear, torch._C._nn.linear, torch.addmm,
    _aten.conv1d.default, _aten.conv2d.default, _aten.conv3d.default,
    _aten.conv1d.padding, _aten.conv2d.padding, _aten.conv3d.padding,
    _aten.conv_transpose1d.default, _aten.conv_transpose2d.input, _aten.conv_transpose3d.input,
    _aten.convolution.default, _aten._convolution.default,
    _aten.linear.default, _aten.addmm.default,
}

_CONV_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                 nn.ConvTranspose3d, nn.Linear)


def _module(gm: fx.GraphModule, node: fx.Node):
    try:
        return gm.get_submodule(node.target)
    except AttributeError:
        return None


def is_batch_norm(gm: fx.GraphModule, node: fx.Node) -> bool:
    """True for a batch-norm node at any capture level."""
    if node.op == "call_module":
        return isinstance(_module(gm, node), nn.modules.batchnorm._BatchNorm)
    return node.op == "call_function" and node.target in _BN_TARGETS


def is_conv_or_linear(gm: fx.GraphModule, node: fx.Node) -> bool:
    """True for a conv, transposed conv or linear (incl. core ATen's addmm) node."""
    if node.op == "call_module":
        return isinstance(_module(gm, node), _CONV_MODULES)
    return node.op == "call_function" and node.target in _CONV_TARGETS


def batch_norm_nodes(gm: fx.GraphModule) -> List[fx.Node]:
    """All batch-norm nodes of ``gm``, in graph order."""
    return [n for n in gm.graph.nodes if is_batch_norm(gm, n)]


def foldable_batch_norms(gm: fx.GraphModule) -> List[fx.Node]:
    """Batch norms whose input is a conv/linear that has no other user.

    These are exactly the ones eval-mode fusion should have removed. A batch norm
    module without running statistics (``track_running_stats=False``) normalizes
    by the batch's own and is never foldable; a functional one without running
    statistics (``running_mean=None``) likewise. (Constness and training=False
    are left to the model: every example model satisfies them.)
    """
    out = []
    for n in batch_norm_nodes(gm):
        src = n.args[0] if n.args else n.kwargs.get("input")
        if isinstance(src, fx.Node) and len(src.users) == 1 and is_conv_or_linear(gm, src) \
                and _has_running_stats(gm, n):
            out.append(n)
    return out


def _has_running_stats(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_module":
        return getattr(_module(gm, node), "running_mean", None) is not None
    if node.target is _aten._native_batch_norm_legit.no_stats:
        return False
    # F.batch_norm(input, running_mean, ...); torch's and aten's put weight and bias first
    at = 1 if node.target is F.batch_norm else 3
    mean = node.args[at] if len(node.args) > at else node.kwargs.get("running_mean")
    return mean is not None


def count_batch_norms(gm: fx.GraphModule) -> int:
    return len(batch_norm_nodes(gm))


def count_foldable_batch_norms(gm: fx.GraphModule) -> int:
    return len(foldable_batch_norms(gm))
