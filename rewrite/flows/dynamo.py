"""A ``torch.compile`` backend that applies a rule set to dynamo graphs.

Dynamo passes parameters and buffers to the graph as inputs (placeholders), so a
folding rule would see them as runtime values and never fire. The backend freezes
them first: every placeholder whose source is a module parameter or buffer becomes a
constant attribute of the graph (``get_attr``), as Inductor's freezing does. The
compiled function then ignores those inputs; a frozen tensor written in place
between calls (seen by its version counter, or counted when a graph the backend
runs writes it) makes the graph rewritten again from its new values
(``_FrozenGraph``); a change no counter sees (an eager training step on the same
model) needs a new compile.

Example::

    fused = torch.compile(model.eval(), backend=rewrite.backend(rewrite.load("rules/fusion.rw")))
    fused(x)

The rewritten graph runs as Python by default. With ``compiler="inductor"`` it is
handed to Inductor (``torch._inductor.compile_fx.compile_fx``) after the rules, so
the user keeps Inductor's kernels and gains the rule sets::

    torch._inductor.config.freezing = True      # optional: Inductor's own constant folding too
    fast = torch.compile(model.eval(), backend=rewrite.backend(rules, compiler="inductor"))

For users who already run Inductor, ``inductor_pass(rules)`` is the reverse hook: a
``CustomGraphPass`` that applies the rule set to Inductor's post-grad ATen graph::

    torch._inductor.config.post_grad_custom_pre_pass = rewrite.inductor_pass(rules)
    torch.compile(model)(x)
"""

from __future__ import annotations

import copy
import functools
import hashlib
import os
import operator
import re
import warnings
from pathlib import Path
from typing import Any, Callable

import attrs
import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from rewrite.capture import is_module_state_source
from rewrite.language.printer import format_rule
from rewrite.ops.base import OpDef
from rewrite.trust.modes import ambient_autocast, inside_torch_compile

__all__ = ["COMPILERS", "FROZEN_INPUTS", "backend", "freeze_parameters", "inductor_pass"]

#: ``gm.meta`` key where ``freeze_parameters`` notes each frozen buffer's input position
FROZEN_INPUTS = "rewrite_frozen_inputs"

#: The compilers ``backend(..., compiler=...)`` names; a callable works too.
COMPILERS = ("python", "inductor")


def _input_source(node: fx.Node) -> Any:
    """Where a dynamo placeholder's input came from (``L['b']``,
    ``L['self']._modules['conv']._parameters['weight']``), or None. While the backend
    runs, meta["grapharg"] says so; dynamo deletes it after compiling but keeps
    node._dynamo_source; recorders may have saved it as meta["dynamo_source"]."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    if source is None:
        source = getattr(node, "_dynamo_source", None) or node.meta.get("dynamo_source")
    return source


def _is_module_state(node: fx.Node, example: Any) -> bool:
    source = _input_source(node)
    if source is not None:
        return is_module_state_source(source)
    return isinstance(example, torch.nn.Parameter)


def _module_scalar(node: fx.Node, example: Any) -> bool:
    """A module's float attribute that dynamo passes as a 0-d tensor read with
    ``.item()`` (``bn.eps`` and ``bn.momentum`` under ``dynamic=True``)."""
    if not isinstance(example, torch.Tensor) or example.dim() != 0 or not example.is_floating_point():
        return False
    source = _input_source(node)
    text = str(source)
    return source is not None and text.startswith("AttrSource(") and "NNModuleSource" in text and bool(node.users) \
        and all(u.op == "call_method" and u.target == "item" for u in node.users)


def _inline_scalar(gm: fx.GraphModule, node: fx.Node, value: float) -> None:
    """Readers of ``node.item()`` read ``value`` itself; the placeholder goes."""
    for item in list(node.users):
        for reader in list(item.users):
            reader.args = fx.node.map_arg(reader.args, lambda n: value if n is item else n)
            reader.kwargs = fx.node.map_arg(reader.kwargs, lambda n: value if n is item else n)
        gm.graph.erase_node(item)
    gm.graph.erase_node(node)


def freeze_parameters(gm: fx.GraphModule, example_inputs: list) -> tuple:
    """Turn placeholders fed by module parameters/buffers into ``get_attr`` constants.

    Dynamo hands a backend the model's parameters and buffers as graph inputs, so a
    folding rule (``const(w, ...)``) never sees them as constants. After freezing,
    they are buffers of ``gm`` (sharing storage with the model's tensors), as
    Inductor's ``freezing`` does; later in-place updates of the model's weights are
    not seen by a graph compiled from it. A module's float attribute that dynamo passes
    as a 0-d tensor read with ``.item()`` (``bn.eps`` under ``dynamic=True``) is read
    as the number it is (``backend`` compares it on each call and runs the graph as
    dynamo gave it when it changed).

    Args:
        gm: the GraphModule dynamo passed to the backend (mutated: use a copy if
            dynamo still needs the original, as ``backend`` does).
        example_inputs: the example inputs dynamo passed with it, one per placeholder.

    Returns:
        ``(kept_indices, kept_example_inputs)``: the positions of the inputs the
        frozen graph still takes, and their example values. Call the frozen graph
        with ``[args[i] for i in kept_indices]``.

    Example::

        def my_backend(gm, example_inputs):
            gm = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
            kept, inputs = rewrite.freeze_parameters(gm, example_inputs)
            result = rules.apply(gm, example_inputs=tuple(inputs))
            return lambda *args: result.graph_module(*[args[i] for i in kept])
    """
    if len(example_inputs) != sum(1 for n in gm.graph.nodes if n.op == "placeholder"):
        raise ValueError(f"freeze_parameters: {len(example_inputs)} example inputs for a graph with "
                         f"{sum(1 for n in gm.graph.nodes if n.op == 'placeholder')} placeholders")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    kept = []
    frozen = gm.meta.setdefault(FROZEN_INPUTS, {})
    first_real = next((n for n in gm.graph.nodes if n.op != "placeholder"), None)
    for i, (node, example) in enumerate(zip(placeholders, example_inputs)):
        if _module_scalar(node, example):
            _inline_scalar(gm, node, example.item())
            continue
        if not isinstance(example, torch.Tensor) or not _is_module_state(node, example):
            kept.append(i)
            continue
        name = re.sub(r"\W", "_", node.target).strip("_") or f"frozen_{i}"
        while hasattr(gm, name):
            name += "_"
        gm.register_buffer(name, example.detach())
        frozen[name] = i
        with gm.graph.inserting_before(first_real):
            attr = gm.graph.get_attr(name)
        attr.meta.update({k: v for k, v in node.meta.items() if k in ("val", "example_value", "tensor_meta")})
        node.replace_all_uses_with(attr)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return tuple(kept), [example_inputs[i] for i in kept]


def backend(rules: Any, *, compiler: Any = "python", check: bool = True, on_result: Callable | None = None,
            **apply_options: Any) -> Callable:
    """A ``torch.compile`` backend applying ``rules`` (a RuleSet) to each graph.

    Each graph dynamo hands over is copied, its parameters frozen
    (``freeze_parameters``), the rules applied, and the result compiled by
    ``compiler``.

    Args:
        rules: the RuleSet to apply.
        compiler: what runs the rewritten graph: ``"python"`` (the GraphModule
            itself, the default), ``"inductor"`` (Inductor's ``compile_fx``: its
            kernels after the rules; ``torch._inductor.config`` applies, e.g.
            ``freezing``), or a backend callable ``(gm, example_inputs) -> callable``.
        check: run the randomized equivalence check on each graph.
        on_result: called with each ``RewriteResult`` (for logging or tests).
        apply_options: passed to ``RuleSet.apply`` (``rtol``, ``atol``, ``trials``,
            ``on_mismatch``...), e.g. looser tolerances for mixed precision.

    Raises:
        ValueError: ``compiler`` is neither a known name nor callable.

    Example::

        rules = rewrite.load("rules/fusion.rw", "rules/cleanup.rw")
        fast = torch.compile(model.eval(), backend=rewrite.backend(rules, compiler="inductor"))
    """
    rules = _as_ruleset(rules, "backend")
    compile_graph = _compiler(compiler)
    _validate_options("backend", check, on_result, apply_options)
    _validate_input_names(apply_options)

    def build(as_given: fx.GraphModule, example_inputs: list) -> "_Variant":
        # Dynamo reads the graph it handed us after we return: work on a copy (of
        # the graph: parameters are shared until apply's own copy; code generated
        # only for the final graph, on its first call).
        gm = _LazyGraphModule(as_given, copy.deepcopy(as_given.graph))
        _sources_only(gm.graph)
        kept, kept_inputs = freeze_parameters(gm, list(example_inputs))
        kept_set = set(kept)
        frozen = tuple(i for i in range(len(example_inputs)) if i not in kept_set)
        if torch.is_grad_enabled() and any(isinstance(example_inputs[i], torch.Tensor)
                                           and example_inputs[i].requires_grad for i in frozen):
            _warn_no_gradients()
        # the caller's input keys name the forward's arguments; a graph dynamo split
        # off may not take them all
        options = {name: _graph_keys(as_given, kept, value) if name in ("fixed_inputs", "input_ranges") else value
                   for name, value in apply_options.items()}
        # in place on our copy (a failed check puts it back; no second copy)
        # the graph runs under the autocast it was traced in; torch's compile lock is held
        with ambient_autocast(), inside_torch_compile():
            result = rules.apply(gm, example_inputs=tuple(kept_inputs), check=check, **{"inplace": True, **options})
        if on_result is not None:
            on_result(result)
        written = _frozen_written(result.graph_module)  # read before a compiler may change the graph
        compiled = compile_graph(result.graph_module, kept_inputs)
        if not callable(compiled):
            raise TypeError(f"rewrite.backend: the compiler returned {type(compiled).__name__}, not a callable "
                            "running the graph (a backend is (gm, example_inputs) -> callable)")
        return _Variant(kept, compiled, written=written)

    def compile_fn(gm: fx.GraphModule, example_inputs: list) -> Callable:
        return _FrozenGraph(gm, example_inputs, build).run

    return compile_fn


def _count_writes(written: tuple, args: Any) -> None:
    """Count a run's writes into the frozen tensors at ``written`` by memory: its
    kernels may bump no version counter (a training batch norm's statistics)."""
    if written:
        _WRITE_CLOCK[0] += 1
        for i in written:
            address = args[i].untyped_storage().data_ptr()
            _WRITES[address] = _WRITES.get(address, 0) + 1


def _forget_real_tensors(template: fx.GraphModule) -> None:
    """Drop what the kept copy of dynamo's graph refers to weakly among the model's
    tensors: ``torch.utils.swap_tensors`` (``.to()`` and ``load_state_dict`` under
    ``set_swap_module_params_on_conversion``) refuses a tensor something refers to
    weakly. Each placeholder's ``grapharg`` keeps only its source (what the backend
    reads); the fake mode's memo of the real tensors it converted, a cache, is
    emptied (a later rewrite converts again)."""
    from torch._guards import detect_fake_mode

    _sources_only(template.graph)
    values = [v for node in template.graph.nodes if isinstance(v := node.meta.get("example_value"), torch.Tensor)]
    try:
        mode = detect_fake_mode(values)
    except AssertionError:  # values of more than one fake mode: leave them
        return
    converter = getattr(mode, "fake_tensor_converter", None)
    for memo in (getattr(converter, "tensor_memo", None),
                 getattr(getattr(getattr(converter, "meta_converter", None), "describer", None), "lookup_tensor", None),
                 getattr(getattr(getattr(converter, "meta_converter", None), "describer", None), "lookup_storage", None)):
        if hasattr(memo, "clear"):
            memo.clear()


def _sources_only(graph: fx.Graph) -> None:
    """Each placeholder's ``grapharg`` (dynamo's, with a weak reference to the real
    tensor) replaced by its source, which is all the backend reads of it."""
    import types

    for node in graph.find_nodes(op="placeholder"):
        arg = node.meta.get("grapharg")
        if arg is not None and not isinstance(arg, types.SimpleNamespace):
            node.meta["grapharg"] = types.SimpleNamespace(source=getattr(arg, "source", None))


def _has_version_counter(t: torch.Tensor) -> bool:
    """An inference tensor has no version counter, and neither has a parameter made
    under inference mode whose data was replaced since (``p.data = t``: not an
    inference tensor any more, yet reading ``_version`` raises)."""
    if t.is_inference():
        return False
    try:
        t._version  # noqa: B018 - raises where there is no counter
    except RuntimeError:
        return False
    return True


#: parameter sets one dynamo graph keeps a rewrite for (instances of one module class
#: compiled apart share dynamo's graph); past it, the least recently used goes
MAX_VARIANTS = 64


@attrs.define(eq=False)
class _Variant:
    """A dynamo graph rewritten for one set of module tensors (frozen into it)."""

    kept: tuple  # the positions of the inputs the rewritten graph still takes
    compiled: Callable
    written: tuple = ()  # the positions of the frozen tensors the graph writes in place
    versions: tuple = ()  # the frozen tensors' version counters after the last run
    writes: tuple = ()  # the writes counted in their memory, as of ``clock``
    clock: int = -1  # the write clock when ``writes`` was read
    pinned: tuple = ()  # aliases of the frozen tensors: their memory stays theirs


class _FrozenGraph:
    """One graph dynamo handed the backend, run as rewritten with the module tensors
    frozen into it, one variant per memory those tensors hold (instances of one
    module class compiled apart share dynamo's graph; a tensor the model replaced,
    ``self.step = self.step + 1`` or ``p.data = ...``, holds other memory): a call
    with tensors in other memory gets a variant rewritten for them (the least
    recently used of ``MAX_VARIANTS`` goes). A frozen tensor written in place between
    calls (an in-place op or ``load_state_dict``: its version counter; a graph the
    backend runs, such as a training step's batch norm, whose kernel bumps no
    counter: ``_WRITES``) makes the variant rewritten again for its new values. A
    graph rewritten on more than a quarter of its calls (after ``_FREE_REBUILDS``: the
    model replaces or writes its tensors on every call) or whose rewrite failed runs
    as dynamo gave it (warned). Keys are memory addresses and the tensors' ids, not
    the tensors: the backend holds no reference to the model's tensors
    (``swap_tensors`` refuses a tensor something refers to weakly); a variant keeps
    its tensors' memory (through aliases), so no other tensor takes an address while
    it is a key. The tensors dynamo puts in the graph itself (``get_attr``: the
    parameters under Inductor's ``freezing``) count as frozen ones too. A write no
    counter sees (through ``.data`` or ``.numpy()``; any write to an inference
    tensor, which has no counter) is not seen."""

    def __init__(self, as_given: fx.GraphModule, example_inputs: list, build: Callable) -> None:
        self.as_given, self.build = as_given, build
        # dynamo strips its graph's metadata (the inputs' sources and fake values)
        # once compiled: a variant built later starts from this copy
        self.template = _LazyGraphModule(as_given, copy.deepcopy(as_given.graph))
        first = build(self.template, example_inputs)
        kept = set(first.kept)
        frozen = [i for i in range(len(example_inputs)) if i not in kept]
        # a module's float (bn.eps) comes as a new 0-d tensor each call: its value counts
        placeholders = self.template.graph.find_nodes(op="placeholder")
        self.scalars = tuple(i for i in frozen if _module_scalar(placeholders[i], example_inputs[i]))
        self.tensors = tuple(i for i in frozen if i not in self.scalars)
        # an inference tensor has no version counter (nothing writes it outside inference mode)
        self.counted = tuple(i for i in self.tensors if _has_version_counter(example_inputs[i]))
        # tensors dynamo put in the graph itself (the model's parameters under Inductor's
        # ``freezing``, lifted constants): read, written and replaced as frozen inputs are
        self.attributes = _attribute_tensors(self.template)
        self.counted_attributes = tuple(t for t in self.attributes if _has_version_counter(t))
        self.variants: dict = {}  # key -> _Variant, least recently used first
        self.fallback = ""  # why calls run the graph as dynamo gave it, once they do
        # the frozen tensors the graph writes, rewritten or not (the rules keep its writes):
        # counted when it runs as dynamo gave it too (a training batch norm's statistics,
        # which another graph's fold reads)
        self.written = first.written
        self.calls = self.rebuilds = 0
        self._keep(example_inputs, first)
        self.forgotten = False  # the fake mode's memo of real tensors, emptied on the first call

    def _key(self, args: Any) -> tuple:
        # the memory and the tensor (swapping ``.data`` between two instances hands one
        # tensor the other's memory): a key no other tensor has while the variant lives
        return (tuple((args[i].data_ptr(), id(args[i])) for i in self.tensors),
                tuple(float(args[i]) for i in self.scalars), tuple(t.data_ptr() for t in self.attributes))

    def _versions(self, args: Any) -> tuple:
        return tuple(args[i]._version for i in self.counted) + tuple(t._version for t in self.counted_attributes)

    def _writes(self, args: Any) -> tuple:
        return tuple(_WRITES.get(args[i].untyped_storage().data_ptr(), 0) for i in self.tensors)

    def _note_state(self, variant: _Variant, args: Any) -> None:
        """What ``variant``'s tensors hold now, to tell a later write: their version
        counters, and (when a graph wrote a frozen tensor since last asked) the writes
        counted in their memory."""
        variant.versions = self._versions(args)
        if variant.clock != _WRITE_CLOCK[0]:
            variant.writes, variant.clock = self._writes(args), _WRITE_CLOCK[0]

    def _keep(self, args: Any, variant: _Variant) -> None:
        key = self._key(args)
        variant.clock = -1
        self._note_state(variant, args)
        # its tensors' memory, kept (aliases, not the model's tensors): a key is that
        # memory's address, which no other tensor gets while the variant lives
        variant.pinned = tuple(args[i].detach() for i in self.tensors) + tuple(t.detach() for t in self.attributes)
        self.variants.pop(key, None)
        self.variants[key] = variant
        while len(self.variants) > MAX_VARIANTS:
            del self.variants[next(iter(self.variants))]

    def _written_since(self, variant: _Variant, args: Any) -> bool:
        if self._versions(args) != variant.versions:
            return True
        # no graph wrote a frozen tensor since: nothing more to look up
        return variant.clock != _WRITE_CLOCK[0] and self._writes(args) != variant.writes

    def _rebuilt(self, args: Any, why: str) -> _Variant | None:
        """A variant rewritten for ``args``' tensors, or None once the graph falls back."""
        self.rebuilds += 1
        if self.rebuilds > _FREE_REBUILDS and _REBUILD_SHARE * self.rebuilds > self.calls:
            self._fall_back(why)
            return None
        try:
            variant = self.build(self.template, list(args))
        except Exception as err:  # noqa: BLE001 - the rules fail on these values: dynamo's graph computes them
            self._fall_back(f"rewriting it again for new values failed ({type(err).__name__}: {err})")
            return None
        _forget_real_tensors(self.template)  # what the rewrite converted: no weak reference kept
        self._keep(args, variant)
        return variant

    def run(self, *args: Any) -> Any:
        if not self.forgotten:  # dynamo is done with its fake mode once the graph runs
            self.forgotten = True
            _forget_real_tensors(self.template)
        if self.fallback:
            out = self.as_given(*args)
            _count_writes(self.written, args)
            return out
        self.calls += 1
        key = self._key(args)
        variant = self.variants.get(key)
        if variant is None:
            variant = self._rebuilt(args, _REPLACED)
        elif self._written_since(variant, args):
            variant = self._rebuilt(args, _WRITTEN)  # folded again from the new values
        elif key != next(reversed(self.variants)):
            self.variants[key] = self.variants.pop(key)  # the most recently used
        if variant is None:  # it falls back from this call on
            out = self.as_given(*args)
            _count_writes(self.written, args)
            return out
        out = variant.compiled(*[args[i] for i in variant.kept])
        _count_writes(variant.written, args)
        self._note_state(variant, args)  # its own writes are no change
        return out

    def _fall_back(self, why: str) -> None:
        self.fallback = why
        self.variants.clear()
        warnings.warn(f"rewrite.backend: {why}: its calls run the graph as dynamo gave it, without the rules",
                      stacklevel=4)


#: rewrites of one graph after its first that are always made; past them, a graph
#: rewritten on more than one call in ``_REBUILD_SHARE`` runs as dynamo gave it
_FREE_REBUILDS = 4
_REBUILD_SHARE = 4

#: writes a graph the backend runs made into frozen tensors' memory (a batch norm's
#: running statistics in training mode: its kernel bumps no version counter), by the
#: address of the storage (a view at an offset is written too), and a clock of all
#: such writes (unchanged: nothing to look up per call)
_WRITES: dict = {}
_WRITE_CLOCK = [0]

_REPLACED = ("the model replaces a parameter or buffer its graph was compiled with on many calls "
             "(self.step = self.step + 1)")
_WRITTEN = ("the model writes in place a parameter or buffer its graph was compiled with between many calls "
            "(another graph of it writes it): a constant the rules folded from it would be stale")


def _attribute_tensors(gm: fx.GraphModule) -> tuple:
    """The tensors ``gm``'s ``get_attr`` nodes read, once each, in graph order."""
    found: dict = {}
    for node in gm.graph.find_nodes(op="get_attr"):
        try:
            value = _fetch(gm, node.target)
        except AttributeError:
            continue
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), value)
    return tuple(found.values())


def _frozen_written(gm: fx.GraphModule) -> tuple:
    """The input positions of the frozen tensors ``gm`` writes in place (through
    views too); every frozen one where a write's target is not known."""
    from rewrite.engine.aliasing import storage_base
    from rewrite.ops.effects import written_nodes

    frozen = gm.meta.get(FROZEN_INPUTS, {})
    written: set = set()
    for node in gm.graph.nodes:
        for target in written_nodes(node, gm) if node.op != "output" else ():
            base = storage_base(target, gm)
            if isinstance(base, fx.Node) and base.op == "get_attr" and base.target in frozen:
                written.add(frozen[base.target])
            elif not (isinstance(base, fx.Node) and base.op in ("placeholder", "call_function", "call_method")):
                written.update(frozen.values())
    return tuple(sorted(written))


def _validate_input_names(apply_options: dict) -> None:
    """Under the backend, ``input_ranges`` and ``fixed_inputs`` name the forward's
    arguments (``"b"``, ``"batch['lengths']"``): a dynamo graph takes them in an
    order of its own (first use, sizes first), so a flat index would reach another."""
    keys = list(apply_options.get("input_ranges") or {}) + list(apply_options.get("fixed_inputs") or ())
    for key in keys:
        if not (isinstance(key, str) and re.match(r"[A-Za-z_]\w*(\[.+\])?$", re.sub(r"\s+", "", key))):
            raise ValueError(f"rewrite.backend: input key {key!r}: name the forward's argument (input_ranges="
                             "{'b': (0, 1)}, fixed_inputs=['lengths'], an item as \"batch['lengths']\"): a dynamo "
                             "graph takes the model's inputs in an order of its own")


def _graph_keys(gm: fx.GraphModule, kept: tuple, keys: Any) -> Any:
    """``keys`` (by the forward's argument names) as the frozen graph's input
    positions, by dynamo's source of each input (``L['b']``); a name the graph
    does not take is left out (a graph dynamo split off)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    position = {}
    for at, i in enumerate(kept):
        source = _input_source(placeholders[i])
        if source is not None:
            name = source.name if isinstance(source.name, str) else source.name()
            position[name] = at

    def spelled(key: str) -> str:
        head, _, rest = re.sub(r"\s+", "", key).partition("[")
        rest = re.sub(r'\["([^"\]]*)"\]', r"['\1']", f"[{rest}") if rest else ""  # batch["x"] is batch['x']
        return f"L[{head!r}]" + rest
    if isinstance(keys, dict):
        return {position[spelled(k)]: v for k, v in keys.items() if spelled(k) in position}
    return tuple(position[spelled(k)] for k in keys if spelled(k) in position)


def _validate_options(where: str, check: Any, on_result: Any, apply_options: dict) -> None:
    """The options checked when the backend (or pass) is made: a misspelt one
    (``trails=3``) or a wrong value would fail only at the first compile, wrapped in
    dynamo's error, or never with ``suppress_errors`` on (the rules silently not run)."""
    from rewrite.ruleset import validate_apply_options

    if on_result is not None and not callable(on_result):
        raise TypeError(f"{where}: on_result is called with each RewriteResult, not {type(on_result).__name__}")
    try:
        validate_apply_options(check=check, **apply_options)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{where}: {err}") from None


def _warn_no_gradients() -> None:  # once per place under the default filter (not per process: a test sees it)
    warnings.warn("rewrite.backend freezes the model's parameters into the compiled graph: with gradients "
                  "enabled, they get none through it (the backend is for inference: compile model.eval() and "
                  "call it under torch.no_grad(); to train a rewritten model, use rewrite.qat)", stacklevel=3)


def _compiler(compiler: Any) -> Callable:
    if callable(compiler):
        return compiler
    if compiler == "python":
        return lambda gm, inputs: gm
    if compiler == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx
    raise ValueError(f"rewrite.backend: unknown compiler {compiler!r}; expected one of {COMPILERS} or a callable "
                     "(gm, example_inputs) -> callable")


# ---------------------------------------------------------------- Inductor custom pass


@functools.lru_cache(maxsize=1)
def _rules_pass_class() -> type:
    # Importing torch._inductor takes seconds: only when a pass is asked for.
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class RulesPass(CustomGraphPass):
        """A rule set as an Inductor custom graph pass (``inductor_pass`` builds one).

        Inductor calls it with the ``torch.fx.Graph`` of its post-grad ATen graph and
        expects the graph mutated in place: the rules are applied to the graph's
        owning module (a copy, as ``RuleSet.apply`` always works), then the rewritten
        nodes replace the graph's own (placeholders kept) and the constants the rules
        created (folded weights) are registered on the owning module, where Inductor
        reads them as constants.

        ``uuid()`` keys Inductor's FX graph cache: it hashes the rule texts, the
        schedule and the ``rewrite`` sources, so editing a rule recompiles. A graph
        Inductor finds in its cache is not passed through the rules again (and
        ``on_result`` is not called for it).
        """

        def __init__(self, rules: Any, *, check: bool = False, on_result: Callable | None = None,
                     **apply_options: Any) -> None:
            _validate_options("inductor_pass", check, on_result, apply_options)
            self.rules = rules
            self.check = check
            self.on_result = on_result
            self.apply_options = apply_options

        def __call__(self, graph: fx.Graph) -> None:
            gm = graph.owning_module
            if gm is None:
                raise ValueError("rewrite.inductor_pass: the graph has no owning GraphModule")
            from rewrite.ruleset import EquivalenceError

            try:
                with inside_torch_compile():
                    result = self.rules.apply(gm, check=self.check, **self.apply_options)
            except EquivalenceError as err:
                # Inductor passes the weights as graph inputs: the check drew them too
                err.args = (f"{err.args[0]}. rewrite.inductor_pass checks on inputs drawn from the post-grad "
                            "graph's metadata, the model's weights among them (Inductor passes them as graph "
                            "inputs), so an approximate rule set is checked on random weights: "
                            "rewrite.backend(rules, compiler=\"inductor\") checks with the model's own",)
                raise
            if self.on_result is not None:
                self.on_result(result)
            if result.counts:
                _transplant(result.graph_module, gm)
                _decompose_for_inductor(gm)

        def uuid(self) -> Any:
            compiled = [self.rules.rules[name] for name in sorted(self.rules.rules)]
            texts = [format_rule(rule.rule) for rule in compiled]
            if _calls_user_functions(texts):
                return None  # what a user's function decides is not in any text: no cache
            # a family's name is in the text, its members only in the compiled rule
            texts += [" ".join(_resolved_ops((rule.pattern, rule.replacement))) for rule in compiled]
            digest = hashlib.sha256(_sources_hash().encode())
            digest.update(repr(self.rules.schedule).encode())
            for text in texts:
                digest.update(text.encode())
            digest.update(repr((self.check, sorted(self.apply_options.items()))).encode())
            return digest.hexdigest()

    return RulesPass


def inductor_pass(rules: Any, *, check: bool = False, on_result: Callable | None = None,
                  **apply_options: Any) -> Any:
    """``rules`` as an Inductor custom pass on its post-grad ATen graph.

    Args:
        rules: the RuleSet to apply.
        check: run the randomized equivalence check (off by default: the graph is
            being compiled, each check runs it; verify rule sets with
            ``rules.verify()`` or ``rewrite check`` instead).
        on_result: called with each ``RewriteResult`` (counts, per-rule stats).
        apply_options: passed to ``RuleSet.apply``.

    Returns:
        A ``torch._inductor.custom_graph_pass.CustomGraphPass``; assign it to
        ``torch._inductor.config.post_grad_custom_pre_pass`` (before Inductor's
        own post-grad passes) or ``post_grad_custom_post_pass`` (after them).

    Example::

        with torch._inductor.config.patch(post_grad_custom_pre_pass=rewrite.inductor_pass(rules)):
            torch.compile(model)(x)
    """
    return _rules_pass_class()(_as_ruleset(rules, "inductor_pass"), check=check, on_result=on_result,
                               **apply_options)


def _as_ruleset(rules: Any, where: str) -> Any:
    """A RuleSet, or a rule file's path loaded as one (``rewrite.load``); anything
    else is refused here, not inside torch.compile."""
    from rewrite.ruleset import RuleSet, load

    if isinstance(rules, (str, os.PathLike)):
        return load(str(rules))
    if not isinstance(rules, RuleSet):
        raise TypeError(f"rewrite.{where} needs a RuleSet (rewrite.load(...)) or a rule file's path, "
                        f"not {type(rules).__name__}")
    return rules


def _transplant(source: fx.GraphModule, target: fx.GraphModule) -> None:
    """Make ``target``'s graph compute what ``source``'s does, in place: the same
    placeholders, ``source``'s other nodes, and ``source``'s constants that
    ``target`` lacks registered on it."""
    graph = target.graph
    for node in source.graph.find_nodes(op="get_attr"):
        if not _has_attr(target, node.target):
            owner_name, _, attr = node.target.rpartition(".")
            owner = target.get_submodule(owner_name) if owner_name else target
            owner.register_buffer(attr, _fetch(source, node.target))
    for node in source.graph.find_nodes(op="call_module"):
        if not _has_attr(target, node.target):
            target.add_submodule(node.target, source.get_submodule(node.target))
    old = [n for n in graph.nodes if n.op == "placeholder"]
    new = [n for n in source.graph.nodes if n.op == "placeholder"]
    for node in reversed(list(graph.nodes)):
        if node.op != "placeholder":
            graph.erase_node(node)
    value, output = graph.graph_copy(source.graph, dict(zip(new, old)), return_output_node=True)
    graph.output(value, output.type).meta.update(output.meta)
    graph.lint()
    target.recompile()


def _decompose_for_inductor(gm: fx.GraphModule) -> None:
    """Inductor lowers its post-grad graph op by op and has no lowering for the ops
    it decomposes (``aten.silu`` is ``x * sigmoid(x)`` there). Replace each such op a
    rule created by its decomposition, traced as Inductor traces its own pattern
    replacements (``fwd_only``) on the nodes' FakeTensor values."""
    from torch._guards import detect_fake_mode
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.lowering import lowerings
    from torch._inductor.pattern_matcher import fwd_only

    table = select_decomp_table()
    graph = gm.graph
    todo = [n for n in graph.nodes if n.op == "call_function" and n.target in table and n.target not in lowerings]
    if not todo:
        return
    for node in todo:
        inputs = node.all_input_nodes
        fake_mode = detect_fake_mode([n.meta.get("val") for n in inputs])
        values = [_fake_value(gm, n, fake_mode) for n in inputs]
        if fake_mode is None or any(v is None for v in values):
            raise ValueError(f"rewrite.inductor_pass: Inductor cannot lower {node.target} (node {node.name}) and "
                             "its inputs carry no meta['val'] to decompose it with")

        def call(*tensors: Any, node: fx.Node = node, inputs: list = inputs) -> Any:
            env = dict(zip(inputs, tensors))
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
            return node.target(*args, **kwargs)

        with fake_mode:
            decomposed = fwd_only(call, values)
        placeholders = [n for n in decomposed.graph.nodes if n.op == "placeholder"]
        with graph.inserting_before(node):
            value = graph.graph_copy(decomposed.graph, dict(zip(placeholders, inputs)))
        node.replace_all_uses_with(value)
        graph.erase_node(node)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()


def _fake_value(gm: fx.GraphModule, node: fx.Node, fake_mode: Any) -> Any:
    val = node.meta.get("val")
    if val is None and node.op == "get_attr" and fake_mode is not None:
        return fake_mode.from_tensor(_fetch(gm, node.target), static_shapes=True)
    return val


def _has_attr(gm: fx.GraphModule, qualname: str) -> bool:
    try:
        _fetch(gm, qualname)
    except AttributeError:
        return False
    return True


def _fetch(gm: fx.GraphModule, qualname: str) -> Any:
    return operator.attrgetter(qualname)(gm)


def _resolved_ops(tree: Any) -> list:
    """The ops a compiled pattern or replacement calls, in tree order: what a rule
    text leaves to its file's families (``family f = relu`` makes ``f(x)`` a relu)."""
    out, todo, seen = [], [tree], set()
    while todo:
        value = todo.pop()
        if isinstance(value, OpDef):
            out.append(f"{value.name}{'!' if value.qualified else ''}")
        elif attrs.has(type(value)) and id(value) not in seen:
            seen.add(id(value))
            todo += reversed([getattr(value, f.name) for f in attrs.fields(type(value))])
        elif isinstance(value, (tuple, list)):
            todo += reversed(value)
        elif isinstance(value, dict):
            todo += reversed(list(value.values()))
    return out


def _calls_user_functions(texts: list) -> bool:
    """Whether rule texts name a function registered from outside the package
    (``register_predicate``, ``register_constant``, ...): its code, and whatever it
    reads, decide what the pass does, and may change between compilations, so
    Inductor must not serve a graph cached under the rules' texts alone. Every name
    in the texts is looked up (a variable of the same name counts: no cache)."""
    from rewrite.functions.registry import function_names, is_builtin, lookup_function

    names = set(function_names())
    return any(not is_builtin(lookup_function(word).fn)
               for text in texts for word in set(re.findall(r"[A-Za-z_]\w*", text)) if word in names)


@functools.lru_cache(maxsize=1)
def _sources_hash() -> str:
    """A hash of the ``rewrite`` package's Python sources (the engine and the
    registered functions a rule set runs)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()
