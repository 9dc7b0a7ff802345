"""Where a run first makes inf or NaN: ops whose floating results hold a non-finite
value though every floating tensor they read is finite.

The check lets integer and bool outputs of a rewrite that newly computes in a lower
precision differ in a few places (``rewrite.trust.check.INT_AGREEMENT``): an argmax
over rounded logits may pick a neighbour. A flip because a value became inf is no
rounding: ``log(1 - sigmoid(z)) > -15`` is True in float32 for z = 8 and False once a
bfloat16 sigmoid rounds to 1.0 and the log gives -inf. Counting the ops that create
non-finite values in both runs tells the two apart.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from rewrite.trust.modes import is_higher_order, run_higher_order

__all__ = ["NonFiniteCounter", "non_finite_births"]


def _floats(tree: Any) -> list:
    return [t for t in pytree.tree_leaves(tree)
            if isinstance(t, torch.Tensor) and t.dtype.is_floating_point and t.numel()]


class NonFiniteCounter(TorchDispatchMode):
    """Counts, per op, the calls that turn finite floating inputs into a non-finite
    result (a Python scalar argument such as ``masked_fill``'s ``-inf`` counts as
    input: the model asked for it, in both runs alike)."""

    supports_higher_order_operators = True  # rewrite.trust.modes

    def __init__(self) -> None:
        super().__init__()
        self.births: dict = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if is_higher_order(func):
            return run_higher_order(self, func, args, kwargs)
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        results = _floats(out)
        if results and not all(bool(torch.isfinite(t).all()) for t in results):
            if all(bool(torch.isfinite(t).all()) for t in _floats((args, kwargs))) and not _asks_for_inf(args, kwargs):
                name = str(getattr(func, "__name__", func))
                self.births[name] = self.births.get(name, 0) + 1
        return out


def _asks_for_inf(args: Any, kwargs: Any) -> bool:
    """A Python float argument that is itself inf or NaN (``full(-inf)``, ``masked_fill``)."""
    return any(isinstance(a, float) and not (a - a == 0) for a in pytree.tree_leaves((args, kwargs)))


def non_finite_births(run: Callable[[], Any]) -> int:
    """How many op calls create inf or NaN from finite values while ``run()`` runs."""
    counter = NonFiniteCounter()
    with counter, torch.no_grad():
        run()
    return sum(counter.births.values())
