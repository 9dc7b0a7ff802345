"""Progress bars for slow steps: shown on a terminal, silent otherwise.

``tqdm`` draws them when it is installed (the ``show`` extra brings it) and the
stream is a TTY; in a pipe, a log or CI nothing is printed. The bar is created
lazily, so a step that finishes in under a couple of seconds (``mininterval``
plus ``delay``) never draws one.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["progress"]


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress(total: int, desc: str, *, enabled: bool = True, stream: Any = None, unit: str = "node") -> Any:
    """An object with ``update(n)`` and ``close()``: a ``tqdm`` bar on a terminal
    (appearing only after two seconds), a silent stand-in otherwise."""
    stream = stream if stream is not None else sys.stderr
    if not enabled or not getattr(stream, "isatty", lambda: False)():
        return _Silent()
    try:
        from tqdm import tqdm
    except ImportError:
        return _Silent()
    return tqdm(total=total, desc=desc, file=stream, delay=2.0, leave=False, unit=unit)
