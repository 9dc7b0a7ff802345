"""rewrite: declarative pattern-rewrite rules for PyTorch graphs.

    import rewrite
    rules = rewrite.load("rules/fusion.rw")
    result = rules.apply(graph_module, example_inputs=(x,))
    result.graph_module, result.counts

See README.md for a tour and docs/language.md for the rule language. Public names are
imported on first use, so ``import rewrite.language`` does not pull in the matcher.
"""

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "load": "rewrite.ruleset",
    "parse": "rewrite.ruleset",
    "RuleSet": "rewrite.ruleset",
    "RewriteResult": "rewrite.ruleset",
    "EquivalenceError": "rewrite.ruleset",
    "CaptureError": "rewrite.ruleset",
    "rules_dir": "rewrite.ruleset",
    "RuleError": "rewrite.language",
    "NonTerminationError": "rewrite.engine.driver",
    "TrainingModeWarning": "rewrite.engine.facts",
    "backend": "rewrite.flows.dynamo",
    "freeze_parameters": "rewrite.flows.dynamo",
    "inductor_pass": "rewrite.flows.dynamo",
    "register_predicate": "rewrite.functions.registry",
    "register_query": "rewrite.functions.registry",
    "register_constant": "rewrite.functions.registry",
    "register_module": "rewrite.functions.registry",
}

__all__ = sorted(_EXPORTS)

#: Short public module names -> where the module lives (the package tree follows the
#: pipeline: engine/, trust/, flows/). ``import rewrite.quant`` gives the very module
#: object of ``rewrite.flows.quant``, never a second copy.
MODULE_ALIASES = {
    "rewrite.quant": "rewrite.flows.quant",
    "rewrite.qat": "rewrite.flows.qat",
    "rewrite.dynamo": "rewrite.flows.dynamo",
    "rewrite.check": "rewrite.trust.check",
    "rewrite.verify": "rewrite.trust.verify",
    "rewrite.instances": "rewrite.trust.instances",
    "rewrite.explain": "rewrite.trust.explain",
    **{f"rewrite.{name}": f"rewrite.engine.{name}" for name in (
        "compile", "match", "prefilter", "replace", "driver", "facts", "workspace",
        "aliasing", "leaves")},
}


class _AliasLoader(importlib.abc.Loader):
    """Loads an alias as the target module itself; ``python -m`` runs the target's code."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:
        pass

    def get_code(self, fullname):  # runpy (python -m rewrite.quant)
        return importlib.util.find_spec(self.target).loader.get_code(self.target)


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        real = MODULE_ALIASES.get(fullname)
        if real is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(real))


if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
    sys.meta_path.append(_AliasFinder())


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None and f"rewrite.{name}" in MODULE_ALIASES:  # rewrite.quant as an attribute
        return importlib.import_module(f"rewrite.{name}")
    if module is None:
        raise AttributeError(f"module 'rewrite' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(list(globals()) + __all__)
