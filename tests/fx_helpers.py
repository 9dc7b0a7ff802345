"""Small helpers shared by the engine tests."""

import torch.nn as nn


class Fn(nn.Module):
    """Wraps a one- or two-argument function as a traceable module."""

    def __new__(cls, fn):
        import inspect

        try:
            two = len(inspect.signature(fn).parameters) == 2
        except ValueError:  # torch builtins have no Python signature
            two = False
        return super().__new__(_Fn2 if two else _Fn1)

    def __init__(self, fn):
        super().__init__()
        self.fn = fn


class _Fn1(Fn):
    def forward(self, x):
        return self.fn(x)


class _Fn2(Fn):
    def forward(self, x, y):
        return self.fn(x, y)


def load_benchmark(name: str, filename: str):
    """A module of ``benchmarks/`` (not a package) by file name, loaded once: the
    benchmarks' own graph builders and peers are what their tests check."""
    import importlib.util
    import sys
    from pathlib import Path

    if name in sys.modules:
        return sys.modules[name]
    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    if str(bench) not in sys.path:
        sys.path.insert(0, str(bench))  # a benchmark imports its siblings (synthetic)
    spec = importlib.util.spec_from_file_location(name, bench / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
