"""Grad-mode and autocast regions of a graph: where a value is computed matters.

torch.compile (dynamo) keeps ``with torch.no_grad():`` and ``with torch.autocast():``
blocks as calls that switch the mode (``torch._C._set_grad_enabled(False)``, then
``True``; ``_enter_autocast`` / ``_exit_autocast``) between the nodes they cover. A
value computed under ``no_grad`` does not require grad, one computed under autocast
has autocast's dtype: a rewrite that moves a computation across such a call, or
makes readers inside a region read a value from outside it (``c = x * 1.0`` under
``no_grad`` forwarded as ``x``), changes what the caller's gradients reach, or the
output's dtype. So a match must lie in one region, and a value forwarded to its
readers must come from the root's region. A graph without such calls has one
region and costs nothing here.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
import torch.fx as fx

from rewrite.capture import AUTOCAST_OFF_LOST
from rewrite.ops.effects import call_argument

__all__ = ["MODE_SWITCHES", "Regions"]

#: calls that switch grad mode or autocast for the nodes after them
MODE_SWITCHES = frozenset(f for f in (
    torch._C._set_grad_enabled,
    torch.amp.autocast_mode._enter_autocast,
    torch.amp.autocast_mode._exit_autocast,
    getattr(torch, "set_autocast_enabled", None),
    getattr(torch._C, "_set_autocast_enabled", None),
) if f is not None)


class Regions:
    """Which region each node of a graph lies in (numbered in graph order), worked
    out on first use; nodes created later are placed by the nearest known node
    before them (a replacement is inserted right before its root)."""

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph
        self._switches: bool | None = None
        self._region: dict = {}
        self._autocast_off: set = set()  # regions inside a block the model runs with autocast disabled

    def any(self) -> bool:
        """Whether the graph switches modes at all (asked once)."""
        if self._switches is None:
            self._switches = any(self.graph.find_nodes(op="call_function", target=t) for t in MODE_SWITCHES)
        return self._switches

    def of(self, node: fx.Node) -> int:
        if not self._region:
            region = 0
            devices = _device_types(self.graph)
            autocast: list = []  # (enter node, enabled) of the blocks entered for these devices, innermost last
            for n in self.graph.nodes:
                if n.op == "call_function" and n.target in MODE_SWITCHES:
                    region += 1
                    if n.target is torch.amp.autocast_mode._enter_autocast:
                        device = call_argument(n, 0, "device_type", "cuda")
                        if device in devices:
                            autocast.append((n, _runs_enabled(device, call_argument(n, 1, "dtype", None),
                                                              call_argument(n, 2, "enabled", True))))
                    elif n.target is torch.amp.autocast_mode._exit_autocast:
                        autocast = [entry for entry in autocast if entry[0] is not call_argument(n, 0, "mode", None)]
                    if autocast and autocast[-1][1] is False:
                        self._autocast_off.add(region)
                self._region[n] = region
        found = self._region.get(node)
        if found is None:
            before = node.prev
            while before.op != "root" and before not in self._region:
                before = before.prev
            found = self._region.get(before, 0)
            self._region[node] = found
        return found

    def autocast_disabled(self, node: fx.Node) -> bool:
        """Whether ``node`` lies in a block the model runs with ``torch.autocast(...,
        enabled=False)`` (a part kept in float32 on purpose): no rewrite may newly
        compute a value there in a half precision (``Replacer``)."""
        if self.graph.owning_module is not None and self.graph.owning_module.meta.get(AUTOCAST_OFF_LOST):
            return True  # a symbolic_trace of a forward with such a block: where it was is not known
        return self.any() and self.of(node) in self._autocast_off

    def spanned(self, nodes: tuple, root: fx.Node, forwarded: fx.Node | None) -> str | None:
        """Why a match of ``nodes`` at ``root`` (replaced by the existing value
        ``forwarded``, if any) would move a computation across a mode switch, or None."""
        if not self.any():
            return None
        where = self.of(root)
        if any(self.of(n) != where for n in nodes):
            return "the match spans a grad-mode or autocast switch (torch.no_grad(), torch.autocast())"
        if forwarded is not None and self.of(forwarded) != where:
            return ("the value forwarded comes from another grad-mode or autocast region than the one it "
                    "would be read in")
        return None


def _device_types(graph: fx.Graph) -> Any:
    """The device types of the graph's inputs: an autocast block for another device
    leaves these ops alone. Unknown (no input facts): every block counts."""
    known = {val.device.type for n in graph.find_nodes(op="placeholder")
             for val in (n.meta.get("val", n.meta.get("example_value")),) if isinstance(val, torch.Tensor)}
    return known or _EveryDevice()


class _EveryDevice:
    def __contains__(self, device: object) -> bool:
        return True


@functools.lru_cache(maxsize=None)
def _runs_enabled(device: str, dtype: Any, enabled: Any) -> bool:
    """Whether torch runs an autocast block so written enabled: it switches one off
    whose dtype its device does not take (``torch.autocast("cpu", dtype=torch.float32)``,
    the usual way to keep a region in float32), which dynamo records as written.
    Unknown (torch refuses the arguments): off, the safe reading."""
    if enabled is not True:  # written off, or a flag computed at run time: off, the safe reading
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return bool(torch.amp.autocast_mode.autocast(device, dtype=dtype, enabled=True)._enabled)
    except Exception:  # noqa: BLE001 - a device or dtype torch does not know
        return False
