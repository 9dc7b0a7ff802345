"""Value types for the command lines' options (``rewrite ...`` in ``rewrite.cli``,
``rewrite quantize`` in ``rewrite.flows.quant``): a count out of range is a usage
error before any work, not a surprise after it."""

from __future__ import annotations

import argparse

__all__ = ["positive_int", "non_negative_int"]


def positive_int(text: str) -> int:
    """argparse type: an int of at least 1."""
    return _int_at_least(text, 1, "a positive int")


def non_negative_int(text: str) -> int:
    """argparse type: an int of at least 0."""
    return _int_at_least(text, 0, "a non-negative int")


def _int_at_least(text: str, least: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{value} is not {what}")
    return value
