"""rewrite: declarative pattern-rewrite rules for PyTorch graphs.

    import rewrite
    rules = rewrite.load("rules/fusion.rw")
    result = rules.apply(graph_module, example_inputs=(x,))
    result.graph_module, result.counts

See README.md for a tour and docs/language.md for the rule language. Public names are
imported on first use, so ``import rewrite.language`` does not pull in the matcher.
"""

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "load": "rewrite.ruleset",
    "parse": "rewrite.ruleset",
    "RuleSet": "rewrite.ruleset",
    "RewriteResult": "rewrite.ruleset",
    "EquivalenceError": "rewrite.ruleset",
    "rules_dir": "rewrite.ruleset",
    "RuleError": "rewrite.language",
    "NonTerminationError": "rewrite.driver",
    "backend": "rewrite.dynamo",
    "register_predicate": "rewrite.functions.registry",
    "register_query": "rewrite.functions.registry",
    "register_constant": "rewrite.functions.registry",
    "register_module": "rewrite.functions.registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rewrite' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(list(globals()) + __all__)
