"""Limits the front end puts on rule text, checked once, before anything recurses.

Every tool (``rewrite.load``/``parse``, ``rewrite check``, ``check --verify``,
``rewrite fmt``, the printer, the compiler, instance generation) walks rule
expressions recursively. Rather than make each of them iterative, the front end
refuses absurd nesting in one place, on Lark's parse tree (built by an iterative
LALR parser, so any depth reaches this check) and before the tree is turned into
``ast`` records: a file nested deeper than ``MAX_NESTING`` gets one positioned
diagnostic, the same from every tool, and every tool is tested to handle the
deepest file the front end accepts (``tests/test_deep_nesting.py``).

Why 100: real rules nest a handful of levels (the deepest shipped rule nests 8);
100 is far beyond any rule a person writes, and small enough that every tool
handles a file at the limit within 700 frames (the parser's keyword-argument
calls cost the most: about 6 frames a level), leaving 300 of Python's default
recursion limit of 1000 to whoever loads the rules (a ``torch.compile`` backend, a
test runner). It also keeps a literal the rewrite puts into a graph well under
the 200 nested brackets the Python compiler accepts in generated ``forward`` code.

The diagnostic is the same from ``rewrite check``, ``check --verify``, ``fmt``,
``explain`` and ``rewrite.load``: a syntax error at the start of the construct one
level too deep::

    deep.rw:1:126: error: expression nested too deeply (more than 100 levels) [E001]
        rule r: relu(x) => add(x, [[[[[[[[[[[[...                  (line shortened here)
      help: a rule file nests expressions at most 100 levels deep: split the expression over several rules
"""

from __future__ import annotations

from typing import Any

from rewrite.language import ast
from rewrite.language.diagnostics import Diagnostic

__all__ = ["MAX_NESTING", "NESTING_CODE", "nesting_diagnostic", "nesting_depth"]

#: The deepest nesting of expressions (or of schedules) a rule file may use.
MAX_NESTING = 100

#: The code of the diagnostic (a syntax error: the file is not parsed further).
NESTING_CODE = "E001"

# Parse-tree nodes that are one level of nesting: every expression that holds
# sub-expressions, and nested schedules. Structural nodes (``arguments``,
# ``keyword``, ``callee``, ``where_clause``, ...) and parentheses (which make no node)
# do not count, so the depth is the one a reader sees: ``[[1]]`` and ``f(g(x))``
# nest 2 deep, ``not x[0][1]`` 3 deep.
_LEVELS = frozenset({
    "or_test", "and_test", "not_op", "compare", "as_name", "as_tuple", "index", "call",
    "list_lit", "tuple_lit", "schedule",
})


def nesting_diagnostic(tree: Any, path: str, limit: int = MAX_NESTING) -> Diagnostic | None:
    """The diagnostic for the first construct (in source order) nested more than
    ``limit`` levels deep in a Lark parse tree of a rule file, or None.

    Iterative: it handles a tree of any depth. ``tree`` is what the parser's
    ``Lark.parse`` returns (built with ``propagate_positions``); ``path`` names the
    file in the diagnostic's span, which points at the start of the construct that
    goes one level too deep.
    """
    stack = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        data = getattr(node, "data", None)
        if data is None:  # a token
            continue
        if data in _LEVELS:
            depth += 1
            if depth > limit:
                return _too_deep(node, path, limit)
        # children pushed last-first: popped, and so reported, in source order
        stack.extend((child, depth) for child in reversed(node.children) if child is not None)
    return None


def nesting_depth(e: Any) -> int:
    """How deep an ``ast`` expression or schedule nests, counted as
    ``nesting_diagnostic`` counts (a leaf is 0, ``[[1]]`` is 2). Iterative, for
    checking a program built in Python rather than parsed (``MAX_NESTING`` holds for
    every parsed one)."""
    deepest = 0
    stack = [(e, 0)]
    while stack:
        node, depth = stack.pop()
        children = _children(node)
        if children is None:
            continue
        if not isinstance(node, ast.Keyword):  # a keyword argument is its call's level
            depth += 1
            deepest = max(deepest, depth)
        stack.extend((c, depth) for c in children)
    return deepest


def _children(node: Any) -> tuple | None:
    """The sub-expressions of a compound node, or None for a leaf."""
    if isinstance(node, (ast.TupleLit, ast.ListLit, ast.BoolOp, ast.Schedule)):
        return tuple(node.items)
    if isinstance(node, ast.Call):
        return tuple(node.args) + tuple(node.kwargs)
    if isinstance(node, ast.Keyword):
        return (node.value,)
    if isinstance(node, (ast.As, ast.AsTuple, ast.Not)):
        return (node.expr,)
    if isinstance(node, ast.Compare):
        return (node.left, node.right)
    if isinstance(node, ast.Index):
        return (node.expr, node.index)
    return None


def _too_deep(node: Any, path: str, limit: int) -> Diagnostic:
    meta = node.meta
    line, col = getattr(meta, "line", 1), getattr(meta, "column", 1)
    # one character: the construct's whole span may run over thousands of columns
    span = ast.Span(path, line, col, line, col + 1)
    return Diagnostic(span, f"expression nested too deeply (more than {limit} levels)", NESTING_CODE,
                      help=f"a rule file nests expressions at most {limit} levels deep: "
                           "split the expression over several rules")
