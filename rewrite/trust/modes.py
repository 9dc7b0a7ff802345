"""Higher-order ops met by the check's dispatch modes.

The check watches a run through ``TorchDispatchMode``s (the dtypes ops compute in,
where a non-finite value is born, a run widened to float64). torch hands a mode a
higher-order op (``torch.cond``, ``while_loop``, ``wrap_with_set_grad_enabled``) only
when the mode says it takes them, and otherwise raises ``NotImplementedError`` for
the whole run: a model holding a ``cond`` could not be checked once an approximate
rule fired. Every mode here takes them and calls ``run_higher_order``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_higher_order", "run_higher_order"]


def is_higher_order(func: Any) -> bool:
    return isinstance(func, torch._ops.HigherOrderOperator)


def run_higher_order(mode: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """``torch.cond`` runs the branch its predicate takes under ``mode`` (the mode
    sees its ops, as it sees the rest of the graph's); other higher-order ops run as
    they are, unseen by it (a mode then knows less inside them: the dtypes recorder
    records fewer precisions, so the check is stricter there, never looser)."""
    if func is torch.ops.higher_order.cond:
        pred, true_fn, false_fn, operands = args
        with mode:
            return (true_fn if bool(pred) else false_fn)(*operands)
    return func(*args, **(kwargs or {}))
