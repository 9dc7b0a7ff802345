"""``torch.<name>`` dtype literals mapped to torch dtypes.

The names are the parser's table (``rewrite.language.parser.DTYPES``: one table, the
parser stays torch-free); a name this torch build lacks fails at load with a
positioned error (``rewrite.language.check``).
"""

from __future__ import annotations

import torch

from rewrite.language.parser import DTYPES as DTYPE_NAMES

__all__ = ["DTYPES"]

DTYPES = {name: getattr(torch, name) for name in sorted(DTYPE_NAMES)
          if isinstance(getattr(torch, name, None), torch.dtype)}
