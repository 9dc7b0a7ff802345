"""The registry of Python functions a rule file may name.

Loading a rule file never runs arbitrary code: a call in a rule resolves to an op of
the vocabulary (``rewrite.ops``) or to an entry of this registry, nothing else. Four
kinds of entries, by where a rule may use them:

* ``predicate``: in ``where``; returns bool (``const(w)``, ``single_use(c)``).
* ``query``: in ``where``; returns a value to compare (``dtype(x)``, ``rank(x)``).
* ``constant``: in a replacement; computes a new constant at rewrite time from
  concrete values (``bn_fold_weight(w, var, gamma, eps)``); a tensor result becomes
  a new parameter/buffer of the rewritten module.
* ``module``: in a replacement; returns an ``nn.Module`` that is registered as a
  submodule and called on the ``inputs`` arguments (observers, fake-quant stubs).

Predicates and queries receive ``rewrite.engine.match.Value`` objects (a bound operand with
its graph facts); constants and module factories receive concrete Python values
(tensors for constant operands, plain literals otherwise).
"""

from __future__ import annotations

import inspect
import keyword
import warnings
from typing import Any, Callable

import attrs

__all__ = [
    "FunctionSpec", "register_predicate", "register_query", "register_constant",
    "register_module", "lookup_function", "function_names", "KINDS", "BUILTIN_MODULES", "is_builtin",
]

KINDS = ("predicate", "query", "constant", "module")


@attrs.frozen
class FunctionSpec:
    """A registered function. ``params`` are its parameter names; ``variadic`` when
    it takes ``*args``; ``inputs`` (module kind only) names the parameters that are
    graph values the module is called on, the rest configure the factory."""

    name: str
    fn: Callable
    kind: str
    params: tuple
    required: int
    variadic: bool = False
    inputs: tuple = ()
    doc: str = ""
    local: bool = False  # reads only its arguments' own facts, never how many nodes read them
    #: the arguments from this position on name ops (``feeds(x, "relu")``): the rule
    #: file is checked for names no op has, which would never match (None: none do)
    op_names_from: int | None = None
    #: parameter -> the literal values it takes (``kind``: "histogram", "minmax", ...): a
    #: rule file passing another literal is refused when it loads (E209), where the
    #: function would otherwise raise at rewrite time and the rule silently not fire
    choices: dict = attrs.field(factory=dict)

    def accepts(self, n_positional: int, keywords: tuple) -> str | None:
        """None if a call with this many positional args and these keywords fits,
        else a message saying why not."""
        if not self.variadic and n_positional > len(self.params):
            return f"{self.name}() takes at most {len(self.params)} arguments, got {n_positional}"
        for kw in keywords:
            if kw not in self.params:
                return f"{self.name}() has no parameter {kw!r}"
        given = set(self.params[:n_positional]) | set(keywords)
        missing = [p for p in self.params[: self.required] if p not in given]
        if missing:  # the parameters before a *args are required all the same
            return f"{self.name}() is missing argument {missing[0]!r}"
        return None


_REGISTRY: dict[str, FunctionSpec] = {}
#: words of the rule language a rule file cannot call
_RESERVED = frozenset({"where", "and", "or", "not", "in", "as", "rule", "family", "ruleset", "import", "True",
                       "False", "None"})


def _refuse_name(key: Any, kind: str, fn: Callable) -> None:
    """A registered name a rule file could not call (not an identifier, a word of the
    language) or that would take an op's place in every rule file (``relu``): a
    ``ValueError`` now rather than a rule that silently never works. Registering a
    name again replaces the function, with a warning when it is another one."""
    if not isinstance(key, str) or not key.isidentifier() or keyword.iskeyword(key) or key in _RESERVED:
        raise ValueError(f"cannot register {kind} {key!r}: a rule file calls functions by a plain name "
                         "(an identifier that is not a keyword)")
    from rewrite.ops.vocabulary import lookup_op  # imported late: the vocabulary registers functions too

    if not is_builtin(fn):
        _ensure_builtins()  # a user's registration replaces a built-in, never the other way round
    if lookup_op(key) is not None:
        raise ValueError(f"cannot register {kind} {key!r}: an op has that name, and a rule file would call the "
                         f"{kind} in its place; choose another name")
    old = _REGISTRY.get(key)
    same_definition = (getattr(old.fn, "__module__", None), getattr(old.fn, "__qualname__", None)) == (
        getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)) and _same_code(old.fn, fn) \
        if old is not None else True
    if old is not None and old.fn is not fn and (not same_definition or "<lambda>" in getattr(
            fn, "__qualname__", "<lambda>")):  # a module imported again registers its own functions again
        warnings.warn(f"rewrite: {kind} {key!r} replaces the {old.kind} registered under that name",
                      stacklevel=4)


def _same_code(a: Callable, b: Callable) -> bool:
    """Whether two functions run the same code (a module imported again defines its
    functions anew, from the same source); not when a definition changed (a
    notebook cell run again with another body, the same name redefined in a module)."""
    code_a, code_b = getattr(a, "__code__", None), getattr(b, "__code__", None)
    if code_a is None or code_b is None:
        return code_a is code_b
    return (code_a.co_code, code_a.co_consts, code_a.co_names) == (code_b.co_code, code_b.co_consts, code_b.co_names)


def _register(kind: str, name: Any, inputs: tuple = (), local: bool = False,
              op_names_from: int | None = None, choices: dict | None = None) -> Callable:
    if callable(name) and not isinstance(name, str):  # written without its (): @register_predicate
        return _register(kind, None, inputs, local, op_names_from, choices)(name)
    if name is not None and not isinstance(name, str):
        raise TypeError(f"register_{kind}: the name is a str (or left out), not {type(name).__name__}")

    def deco(fn: Callable) -> Callable:
        sig = inspect.signature(fn)
        params, required, variadic = [], 0, False
        for p in sig.parameters.values():
            if p.kind is p.VAR_POSITIONAL:
                variadic = True
                continue
            if p.kind is p.VAR_KEYWORD:
                continue
            params.append(p.name)
            if p.default is p.empty:
                required = len(params)
        key = name or fn.__name__
        _refuse_name(key, kind, fn)
        doc = (inspect.getdoc(fn) or "").split("\n")[0]
        unknown = set(choices or {}) - set(params)
        if unknown:
            raise ValueError(f"register_{kind}({key!r}): choices for {sorted(unknown)}, which it does not take")
        _REGISTRY[key] = FunctionSpec(key, fn, kind, tuple(params), required, variadic, tuple(inputs), doc, local,
                                      op_names_from, {k: tuple(v) for k, v in (choices or {}).items()})
        return fn

    return deco


def register_predicate(name: str | None = None, *, local: bool = False, op_names_from: int | None = None) -> Callable:
    """Decorator: a ``where`` predicate taking ``Value`` arguments, returning bool.

    ``local=True`` declares that it reads only its arguments' own facts (kind,
    shape, dtype, value), never how many nodes read them (``users``): the fixpoint
    then need not revisit a widely read value's readers each time it loses one. The
    default assumes it may. ``op_names_from=k``: the arguments from position ``k``
    on are op names (string literals, checked against the op vocabulary when the
    rule file is loaded: a misspelt one would never match).

    Example::

        @rewrite.register_predicate()
        def is_depthwise(groups, weight):
            return groups.literal == weight.shape[0]
    """
    return _register("predicate", name, local=local, op_names_from=op_names_from)


def register_query(name: str | None = None, *, local: bool = False) -> Callable:
    """Decorator: a ``where`` query taking ``Value`` arguments, returning a value
    (``local``: as for ``register_predicate``)."""
    return _register("query", name, local=local)


def register_constant(name: str | None = None, *, choices: dict | None = None) -> Callable:
    """Decorator: a rewrite-time function computing a new constant from concrete values.
    ``choices``: parameter -> the literal values it takes, checked when a rule file
    loads (E209)."""
    return _register("constant", name, choices=choices)


def register_module(name: str | None = None, inputs: tuple = ("x",), *, choices: dict | None = None) -> Callable:
    """Decorator: a factory of an ``nn.Module`` inserted by a replacement and called
    on the arguments named in ``inputs``; the other arguments configure the factory.
    ``choices``: as for ``register_constant``."""
    return _register("module", name, inputs, choices=choices)


def lookup_function(name: str) -> FunctionSpec | None:
    """The registered function called ``name``, or None."""
    _ensure_builtins()
    return _REGISTRY.get(name)


def function_names(kind: str | None = None) -> list:
    """Names of registered functions (of one kind, if given), sorted."""
    _ensure_builtins()
    return sorted(n for n, s in _REGISTRY.items() if kind is None or s.kind == kind)


#: Modules whose import registers built-in functions; one line per library area.
BUILTIN_MODULES = ("rewrite.functions.builtins", "rewrite.functions.amp", "rewrite.functions.quant",
                    "rewrite.functions.qat", "rewrite.functions.transformer")


def is_builtin(fn: Any) -> bool:
    """Whether ``fn`` is one of the library's own functions, not one a user registered."""
    return getattr(fn, "__module__", None) in BUILTIN_MODULES


_builtins_loaded = False


def _ensure_builtins() -> None:
    # Importing the built-in modules registers them; done lazily to avoid cycles
    # (once: this runs on every where-clause call).
    global _builtins_loaded
    if _builtins_loaded:
        return
    import importlib

    _builtins_loaded = True  # set first: the modules' own registrations come back here
    try:
        for name in BUILTIN_MODULES:
            importlib.import_module(name)
    except BaseException:
        _builtins_loaded = False
        raise
