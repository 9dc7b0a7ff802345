"""Functions and predicates that rule files may name (see ``registry``)."""

from rewrite.functions.registry import (
    FunctionSpec,
    function_names,
    lookup_function,
    register_constant,
    register_module,
    register_predicate,
    register_query,
)

__all__ = [
    "FunctionSpec", "function_names", "lookup_function", "register_constant",
    "register_module", "register_predicate", "register_query",
]
