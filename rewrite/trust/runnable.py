"""A ``--model`` spec loaded and run once on its own example inputs.

``rewrite.capture.load_model`` builds ``(model, example_inputs)`` from a
``module:callable`` spec. A factory whose example input the model cannot take (the
wrong number of channels, a number where a tensor goes) would otherwise fail deep in
a capture, the check's first reference run or ``analyze``, and read as a bug of the
library; here it is the user's one-line ``ModelSpecError`` (exit 2 in the CLI).
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import nn

from rewrite.capture import ModelSpecError, load_model
from rewrite.trust.check import inputs_copy, preserved_state

__all__ = ["load_runnable_model"]


def load_runnable_model(spec: str) -> Tuple[nn.Module, tuple]:
    """``load_model(spec)``, raising ``ModelSpecError`` when the model cannot run on
    its example inputs (run once, on copies, its state put back)."""
    model, inputs = load_model(spec)
    tensors = [*model.parameters(), *model.buffers(),
               *(t for t in torch.utils._pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor))]
    if any(t.is_meta for t in tensors):
        raise ModelSpecError(f"{spec}: the model or its example inputs are on the meta device, and the command "
                             "runs the model: load its weights first (to_empty() and a state dict)")
    try:
        with torch.no_grad(), preserved_state(model):
            model(*inputs_copy(inputs))
    except Exception as err:  # noqa: BLE001 - the user's model failed on the user's inputs
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ModelSpecError(f"{spec}: the model raised on its example inputs ({type(err).__name__}: {first})") \
            from err
    return model, inputs
