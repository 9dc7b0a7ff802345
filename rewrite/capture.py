"""Get a model in, capture it, and save the result: the one place for each.

The command line (``rewrite apply``/``explain``/``quantize``), the quantization
flow, the tests and the benchmarks all capture through ``capture`` and load
``--model`` specs through ``load_model``, so the levels behave the same
everywhere. The same rule has to match a model whatever the user captured it
with, so tests run each rule set on the graphs of all four levels:

``"fx"``
    ``torch.fx.symbolic_trace``: ``call_module`` nodes for layers, torch
    functions and Tensor methods for the rest.
``"export"``
    ``torch.export.export(..., strict=False).module()``: ATen ops at the
    pre-dispatch training-IR level (``aten.conv2d``, ``aten.batch_norm``),
    parameters as ``get_attr``.
``"export_core"``
    ``ep.run_decompositions().module()``: core ATen
    (``aten.convolution``, ``aten._native_batch_norm_legit_no_training``).
``"dynamo"``
    the first ``GraphModule`` that ``torch.compile`` hands its backend: torch
    functions, with parameters lifted to placeholders. It cannot be called
    with the user's inputs, so the level also yields the inputs dynamo used
    (``capture_with_inputs``).
"""

from __future__ import annotations

import ast
import contextlib
import copy
import importlib
import inspect
import io
import linecache
import os
import re
import stat
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Iterator, List, Sequence, Tuple

import torch
from torch import fx, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.fx._lazy_graph_module import _LazyGraphModule

from rewrite.module_state import AttributeSnapshot, TensorValues
from rewrite.trust.held import laid_out_copy
from rewrite.trust.modes import one_thread_at_a_time

__all__ = ["LEVELS", "INFERENCE_KEY", "AUTOCAST_OFF_LOST", "DYNAMO_SOURCE", "ExportError", "ModelSpecError",
           "SaveError", "higher_order_ops",
           "as_input_tuple",
           "capture", "capture_with_inputs", "symbolic_trace", "capture_dynamo", "GraphBreakError", "mha_fastpath_off",
           "dynamic_shapes_of",
           "export_keeping_sizes", "export_program", "is_export_guard", "is_module_state_source", "is_tensor_method",
           "lifted_state_positions",
           "load_model", "save", "save_format", "save_path_problem", "missing_folder", "file_problem",
           "file_object_problem", "is_path", "write_atomically", "normalize_module_path"]

LEVELS: Tuple[str, ...] = ("fx", "export", "export_core", "dynamo")

#: placeholder meta key where ``capture_dynamo`` keeps dynamo's input source.
DYNAMO_SOURCE = "dynamo_source"


def as_input_tuple(example_inputs: Any) -> tuple:
    """A model's positional inputs as a tuple: a tuple as is, a list's items, and
    anything else (a bare tensor) as the only input, never iterated (a tensor's
    rows are not its inputs)."""
    if isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    return (example_inputs,)


def capture_dynamo(model: nn.Module, example_inputs: Sequence[Any]) -> Tuple[fx.GraphModule, List[Any]]:
    """Return dynamo's graph of ``model`` and the inputs it was called with
    (``GraphBreakError`` when dynamo splits it into several: one would be only part
    of the model; the multi-head attention fast path is off, as ``mha_fastpath_off``
    says why).

    Dynamo deletes each placeholder's ``meta["grapharg"]`` (which says whether
    it is a parameter, a buffer or a user input) once compilation ends, so the
    recorder copies its source, as a string, to ``meta["dynamo_source"]``
    (``DYNAMO_SOURCE``); it mentions ``_parameters`` or ``_buffers`` for
    lifted module state.

    The recording backend returns the graph's own ``forward``, so the model
    still runs, once, on the example inputs: its buffers, attributes and the
    caller's random stream are left as they were. ``torch._dynamo.reset()`` is called first so a cached compilation
    from an earlier call cannot bypass the backend (and after, so the recording
    backend is not left in dynamo's cache).
    """
    import torch._dynamo

    recorded: List[Tuple[fx.GraphModule, List[Any]]] = []

    def record(gm: fx.GraphModule, inputs: List[Any]):
        for node in gm.graph.nodes:
            source = getattr(node.meta.get("grapharg"), "source", None)
            if node.op == "placeholder" and source is not None:
                node.meta[DYNAMO_SOURCE] = str(source)
        recorded.append((gm, list(inputs)))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=record, fullgraph=False, dynamic=False)
    # the recording run is the caller's model's own: what it writes (a train-mode batch
    # norm's statistics, attributes) is put back, and its random draws come from a fork
    attributes = AttributeSnapshot(list(model.modules()))
    values = TensorValues(model.modules(), parameters=True)  # its graph runs on the real weights
    # and it runs on copies of the caller's inputs (a forward may write one: mask.fill_(1)),
    # laid out as they are (a forward may branch on is_contiguous()), also those held in
    # objects pytree does not open (a dataclass, transformers' BatchEncoding)
    inputs = laid_out_copy(as_input_tuple(example_inputs))
    try:
        with torch.no_grad(), mha_fastpath_off(), torch.random.fork_rng(devices=[]):
            compiled(*inputs)
    finally:
        torch._dynamo.reset()
        values.restore()
        attributes.restore()
    if not recorded:
        raise RuntimeError("torch.compile produced no graph for this model")
    if len(recorded) > 1:
        raise GraphBreakError(
            f"dynamo split this model into {len(recorded)} graphs at graph breaks (a print, an .item(), "
            "a data-dependent branch): one graph is only part of the model. Capture it with 'export' or "
            "'fx', or rewrite every graph with rewrite.backend(rules) under torch.compile")
    gm, inputs = recorded[0]
    return gm, inputs


class GraphBreakError(ValueError):
    """A dynamo capture that came out as several graphs (``capture_dynamo``)."""


@contextlib.contextmanager
def mha_fastpath_off() -> Iterator[None]:
    """nn.MultiheadAttention and nn.TransformerEncoderLayer without their fused fast
    path (taken in eval mode under no_grad) while the block runs: a capture or a
    measurement then sees the attention's and the layer's own ops, not one opaque
    kernel (``aten._transformer_encoder_layer_fwd``) the FLOP registry cannot count
    nor a rule match."""
    mha = getattr(torch.backends, "mha", None)
    if mha is None or not hasattr(mha, "set_fastpath_enabled"):
        yield
        return
    was = mha.get_fastpath_enabled()
    mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        mha.set_fastpath_enabled(was)


#: every table of hooks torch keeps on a module (forward, backward, state_dict)
HOOK_TABLES = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
               "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def hooked(module: nn.Module) -> bool:
    """Whether the caller registered a hook on ``module`` itself (the tables beside
    a hook table, ``_with_kwargs`` and ``_always_called``, only mark its entries)."""
    return any(getattr(module, kind, None) for kind in HOOK_TABLES if not kind.endswith(("_kwargs", "_called")))


#: frames that are not the model's: torch's and this library's (but its example models')
_LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.abspath(__file__)) + os.sep)
_EXAMPLES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "examples") + os.sep


class _HookKeepingTracer(fx.Tracer):
    """fx's tracer, keeping every hooked submodule a call of its own: inlined, its
    hooks would run once, at trace time, on Proxies (a feature hook on
    ``model.layer1`` appending a Proxy to the caller's list), and never again."""

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        """fx's node, with the model's source line that made it (``stack_trace``, as
        export and dynamo record it, for error reports): the innermost frame outside
        torch and this library. (fx's own ``record_stack_traces`` imports much of
        torch on first use, seconds, and records its own frames after the model's.)"""
        node = super().create_node(*args, **kwargs)
        if "stack_trace" not in node.meta:
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS) \
                    and not frame.f_code.co_filename.startswith(_EXAMPLES_DIR):
                frame = frame.f_back
            if frame is not None:
                code = frame.f_code
                line = linecache.getline(code.co_filename, frame.f_lineno).strip()
                node.meta["stack_trace"] = (f'File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}'
                                            + (f"\n    {line}" if line else ""))
        return node

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return hooked(m) or super().is_leaf_module(m, module_qualified_name)


def symbolic_trace(model: nn.Module) -> fx.GraphModule:
    """``torch.fx.symbolic_trace(model)`` that leaves ``model`` as it was.

    fx's tracer runs the forward's Python on the caller's own module objects. What
    that Python does to them besides the traced values is undone or refused:

    - attributes it sets or deletes on any submodule (``self.calls += 1``, a cache
      filled with a Proxy, the ``_tensor_constant0`` attributes the tracer itself
      adds for tensors the forward reads from elsewhere), and lists, dicts and sets
      it fills in place, are put back (``AttributeSnapshot``); the GraphModule keeps
      its own references to the constants;
    - a write in place into a tensor that existed before the trace (a buffer
      ``self.step.add_(1)``, weights clamped through ``self.parameters()`` or
      ``p.data``, a plain tensor attribute) is stopped before it happens and the
      capture refused (``ValueError``): the tracer would run it once on the real
      tensor and record nothing of it, so the graph would not compute what the
      model does. Writes into tensors the forward creates itself are run as usual;
    - a parameter or buffer the forward replaces (``self.n = self.n + 1``) likewise:
      the tracer would compute the new value once and freeze it into the graph.

    A submodule with hooks of the caller's stays one call (``_HookKeepingTracer``),
    which runs them each time; rules see it as a module call, not inside it.
    """
    snapshot = AttributeSnapshot(model.modules())
    tables = [(prefix, m, dict(m._buffers), dict(m._parameters)) for prefix, m in model.named_modules()]
    guard = _NoWritesToExisting()
    try:
        with guard, _autocast_entries() as entered:
            tracer = _HookKeepingTracer()
            graph = tracer.trace(model)
            gm = fx.GraphModule(tracer.root, graph, model.__class__.__name__)
        _name_call_sites(gm.graph, model)
        if False in entered:
            gm.meta[AUTOCAST_OFF_LOST] = True
            warnings.warn(f"{type(model).__name__}'s forward runs a block with torch.autocast(..., enabled=False): "
                          "torch.fx.symbolic_trace keeps no trace of it, so no rule may compute in a half precision "
                          "anywhere in this graph (the AMP rule sets do nothing); capture with torch.export or "
                          "torch.compile (rewrite.backend), which keep the block", stacklevel=3)
        replaced = next((f"{prefix}.{name}" if prefix else name for prefix, m, buffers, params in tables
                         for name, t in [*buffers.items(), *params.items()]
                         if m._buffers.get(name, m._parameters.get(name)) is not t), None)
        if replaced is not None:
            raise ValueError(
                f"tracing {type(model).__name__} replaces {replaced!r} (self.{replaced.rpartition('.')[2]} = ...): "
                "torch.fx.symbolic_trace computes the new value once, at trace time, and the graph never updates "
                "it (the model was left as it was); capture the model with "
                "torch.export.export(model, example_inputs, strict=False).module() (capture='export' in the "
                "quantization flows, --capture export on the command line)")
    except _ExistingWrite as write:
        names = _tensor_names(model).get(write.memory)
        what = f"{names[0]!r}" if names else f"a tensor of shape {write.shape} the forward did not create"
        raise ValueError(
            f"tracing {type(model).__name__} would write {what} in place ({write.op}): torch.fx.symbolic_trace "
            "runs such a write on the real tensor and leaves it out of the graph (nothing was written); capture the "
            "model with torch.export.export(model, example_inputs, strict=False).module() (capture='export' in the "
            "quantization flows, --capture export on the command line)") from None
    finally:
        snapshot.restore()
    return gm


def _name_call_sites(graph: fx.Graph, root: nn.Module) -> None:
    """Name a shared module in the graph's ``nn_module_stack`` under the module that
    called it.

    fx names a module reachable under several names (a Linear shared by ``blocks.0``
    and ``blocks.1``) by its first name wherever it is called, so measurements and
    pictures credited the call inside ``blocks.1`` to ``blocks.0.fc``. The calling
    module is the entry before it in the stack: where the first name is not under it
    (certainly not the call site), the module's first name under the caller is. Where
    the first name is under the caller (the model calling ``self.fc`` that is also
    ``blocks.0.fc``), fx cannot tell which name the forward used, and it stays. Call
    targets keep fx's name (the GraphModule holds the module under that name only)."""
    if not _shares_modules(root):
        return
    found: dict = {}

    def call_site(caller: str, first: str) -> str:
        if not caller or not first or first.startswith(caller + "."):
            return first
        if (caller, first) not in found:
            module = root.get_submodule(first)
            found[caller, first] = next((f"{caller}.{name}" for name, m in root.get_submodule(caller).named_modules()
                                         if name and m is module), first)
        return found[caller, first]

    sites_of: dict = {}
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if not stack:
            continue
        key = tuple(entry[0] for entry in stack.values())
        sites = sites_of.get(key)
        if sites is None:
            sites, caller = [], ""
            for first in key:
                caller = call_site(caller, first)
                sites.append(caller)
            sites_of[key] = sites
        node.meta["nn_module_stack"] = type(stack)(
            (k, (site, entry[1])) for (k, entry), site in zip(stack.items(), sites))


def _shares_modules(root: nn.Module) -> bool:
    """Whether some module of ``root`` is held in more than one place (linear: each
    module's children are read once)."""
    held: set = set()
    for module in root.modules():
        for child in module._modules.values():
            if child is not None:
                if id(child) in held:
                    return True
                held.add(id(child))
    return False


@contextlib.contextmanager
def _autocast_entries() -> Iterator[list]:
    """Whether each ``torch.autocast`` block the tracing thread enters meanwhile is
    enabled (the tracer runs the forward's ``with`` statements and records nothing
    of them). Blocks of every device count: a symbolic_trace graph runs wherever its
    caller moves it (a model built on the meta device, a CPU trace of a model meant
    for CUDA). A block counts as torch runs it (a dtype its device does not take
    switches it off), except one torch switches off for want of CUDA: there the
    flag the forward wrote tells (enabled, for a block built before the trace).
    Another thread's blocks are not the graph's."""
    entered: list = []
    tracing = threading.get_ident()
    cls = torch.amp.autocast_mode.autocast
    original_init, original_enter = cls.__init__, cls.__enter__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self.__dict__["_rewrite_written_enabled"] = bool(kwargs.get("enabled", args[2] if len(args) > 2 else True))

    def enter(self: Any) -> Any:
        if threading.get_ident() == tracing:
            if getattr(self, "device", None) == "cuda" and torch.cuda.amp.common.amp_definitely_not_available():
                entered.append(self.__dict__.get("_rewrite_written_enabled", True))
            else:
                entered.append(bool(getattr(self, "_enabled", True)))
        return original_enter(self)

    cls.__init__, cls.__enter__ = init, enter
    try:
        yield entered
    finally:
        cls.__init__, cls.__enter__ = original_init, original_enter


class _ExistingWrite(Exception):
    def __init__(self, op: str, t: torch.Tensor) -> None:
        super().__init__(op)
        self.op, self.memory, self.shape = op, _memory(t), tuple(t.shape)


def _tensor_names(model: nn.Module) -> dict:
    """Memory -> the names of the model's tensors there (parameters, buffers, plain
    tensor attributes)."""
    names: dict = {}
    for prefix, m in model.named_modules(remove_duplicate=False):
        for name, value in [*m._parameters.items(), *m._buffers.items(), *vars(m).items()]:
            if isinstance(value, torch.Tensor):
                names.setdefault(_memory(value), []).append(f"{prefix}.{name}" if prefix else name)
    return names


class _NoWritesToExisting(TorchDispatchMode):
    """Stops an op that writes in place into memory that existed before the mode
    was entered (raising ``_ExistingWrite`` before it runs); memory the ops run
    under it allocate (a mask the forward builds and fills) may be written."""

    def __init__(self) -> None:
        super().__init__()
        self.fresh: set = set()  # storages allocated under the mode (their data pointers)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor) and _memory(t) not in self.fresh:
                    raise _ExistingWrite(str(func), t)
        out = func(*args, **kwargs)
        inputs = {_memory(t) for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and _memory(t) not in inputs:  # new memory, not a view of an input's
                self.fresh.add(_memory(t))
        return out


def _memory(t: torch.Tensor) -> int:
    """Where ``t``'s elements live (0 when nowhere: empty, or no storage to ask)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


@one_thread_at_a_time()
def capture_with_inputs(model: nn.Module, example_inputs: Any, level: str) -> Tuple[fx.GraphModule, tuple]:
    """Capture ``model`` at ``level``; return ``(graph_module, inputs_to_call_it_with)``.

    For every level except ``"dynamo"`` the inputs are ``example_inputs``
    themselves; for ``"dynamo"`` they are the placeholders dynamo recorded
    (parameters and buffers included).
    """
    args = as_input_tuple(example_inputs)
    if level == "fx":
        return symbolic_trace(model), args
    if level in ("export", "export_core"):
        _warn_hooks_lost(model, level)
        # non-strict export runs the caller's forward: a list or dict attribute it
        # appends to is swapped for a new one and the old one keeps the trace's entry
        attributes = AttributeSnapshot(list(model.modules()))
        values = TensorValues(model.modules())  # what the forward writes in place, for real
        try:
            ep = torch.export.export(model, args, strict=False)
        finally:
            values.restore()
            attributes.restore()
        if level == "export_core":
            ep = ep.run_decompositions()
        return _noted_mode(ep.module(), model), args
    if level == "dynamo":
        gm, inputs = capture_dynamo(model, args)
        return _noted_mode(gm, model), tuple(inputs)
    raise ValueError(f"unknown capture level {level!r}; expected one of {LEVELS}")


#: ``GraphModule.meta`` key saying the graph does not train: left by a capture of a
#: model with every module in eval mode (``rewrite.capture``), and by an apply that knew
#: (a later apply knows it too: a fold may have removed the eval-mode batch norm that told)
INFERENCE_KEY = "rewrite_inference"


#: ``GraphModule.meta`` key: the traced forward ran a block with autocast disabled, which
#: ``symbolic_trace`` keeps no trace of (no rewrite newly computes in a half precision)
AUTOCAST_OFF_LOST = "rewrite_autocast_off_lost"


def _noted_mode(gm: fx.GraphModule, model: nn.Module) -> fx.GraphModule:
    """``gm`` marked as an inference graph (``INFERENCE_KEY`` True) when every module of
    ``model`` is in eval mode, else as one that may train (False: a model fine-tuned with
    ``model.train(); model.bn.eval()`` exports an eval-mode batch norm all the same). An
    ATen graph keeps no trace of ``model.eval()`` (its module is always in training
    mode), and without it apply cannot tell whether a parameter may be folded into a
    constant (AMP's weights cast once)."""
    gm.meta[INFERENCE_KEY] = not any(m.training for m in model.modules())
    return gm


def _warn_hooks_lost(model: nn.Module, level: str) -> None:
    """torch.export runs the forward hooks of the caller's modules once, at capture
    time, and the graph never runs them again (a feature-extraction hook would see
    one call): say so, naming the modules."""
    names = [name or "(the model)" for name, m in model.named_modules() if hooked(m)]
    if names:
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        warnings.warn(f"capture {level!r}: {len(names)} module(s) of {type(model).__name__} have hooks ({shown}): "
                      "torch.export ran them once, while capturing, and the graph never runs them (capture 'fx' "
                      "keeps a hooked module as one call that runs them)", stacklevel=3)


@one_thread_at_a_time()
def capture(model: nn.Module, example_inputs: Any, level: str) -> fx.GraphModule:
    """Capture ``model`` at ``level`` (one of ``LEVELS``) and return the GraphModule.

    For ``"dynamo"`` the returned graph takes dynamo's lifted inputs, not the
    user's: use ``capture_with_inputs`` to get them too.
    """
    return capture_with_inputs(model, example_inputs, level)[0]


#: a dynamo source (its text) that is a module's parameter or buffer: a
#: ``ParamBufferSource`` or an attribute read of a module's ``_parameters`` or
#: ``_buffers`` table, not a user input whose name or dict key merely says so
#: (``LocalSource(local_name='model_parameters')``)
_MODULE_STATE_SOURCE = re.compile(r"\bParamBufferSource\(|\bUnspecializedParamBufferSource\(|"
                                  r"member='_(?:parameters|buffers)'")


def is_module_state_source(source: Any) -> bool:
    """Whether a dynamo placeholder's source (or its text, ``DYNAMO_SOURCE``) is a
    module's parameter or buffer rather than something the caller passed."""
    return source is not None and bool(_MODULE_STATE_SOURCE.search(str(source)))


def lifted_state_positions(gm: fx.GraphModule) -> Tuple[int, ...]:
    """Positions of the placeholders of a ``capture_dynamo`` graph that are module
    parameters or buffers (not user inputs), from ``meta["dynamo_source"]``, or from
    dynamo's own ``meta["grapharg"]`` while a backend of the caller's runs (a graph
    analyzed inside ``torch.compile(backend=...)``).

    Pass them as ``fixed_inputs`` to ``rewrite.trust.check.check_equivalence`` to
    vary only the real inputs.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return tuple(i for i, n in enumerate(placeholders)
                 if is_module_state_source(n.meta.get(DYNAMO_SOURCE)
                                           or getattr(n.meta.get("grapharg"), "source", None)))


class ModelSpecError(ValueError):
    """A ``module:callable`` model spec that cannot be loaded; the message says why."""


def load_model(spec: str) -> Tuple[nn.Module, tuple]:
    """``package.module:callable`` -> ``(model in eval mode, example inputs tuple)``.

    The callable takes no arguments and returns ``(model, example_inputs)``. The
    current directory is searched first, as ``python -m rewrite`` does, so the
    ``rewrite`` console script finds ``mymodel.py`` next to the user too.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ModelSpecError(f"--model wants 'module:callable', got {spec!r}")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    if module_name.startswith("."):
        raise ModelSpecError(f"--model wants an absolute module path, got {module_name!r} in {spec!r}")
    try:
        factory = importlib.import_module(module_name)
        for part in attr.split("."):
            factory = getattr(factory, part)
    except (ImportError, AttributeError) as err:
        raise ModelSpecError(f"cannot load {spec!r}: {err}") from None
    except (Exception, SystemExit) as err:  # noqa: BLE001 - the user's module failed on import: one line
        raise ModelSpecError(f"cannot load {spec!r}: {type(err).__name__} while loading it: {err}") from None
    if not callable(factory):
        raise ModelSpecError(f"{spec} is not callable: it must return (model, example_inputs)")
    try:
        built = factory()
    except (Exception, SystemExit) as err:  # noqa: BLE001 - the user's factory failed: say where, one line
        raise ModelSpecError(f"{spec}() raised {type(err).__name__}: {err}") from err
    if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module)):
        raise ModelSpecError(f"{spec} must return (model, example_inputs), got {type(built).__name__}")
    model, inputs = built
    training = next((name or "the model itself" for name, m in model.named_modules() if m.training), None)
    if training is not None:  # said, not done silently: a train-mode batch norm would compute otherwise
        warnings.warn(f"{spec} returned a model in training mode ({training}): it is put in eval mode "
                      "(model.eval()) and rewritten for inference", stacklevel=2)
    try:
        model = model.eval()
    except (Exception, SystemExit) as err:  # noqa: BLE001 - the user's eval() failed
        raise ModelSpecError(f"{spec}: the model's eval() raised {type(err).__name__}: {err}") from err
    return model, as_input_tuple(inputs)



class SaveError(ValueError):
    """A GraphModule ``torch.save`` cannot write faithfully (``picklable``); the
    message says which format keeps it."""


class ExportError(RuntimeError):
    """``torch.export`` could not capture a GraphModule; the message names the node
    it failed at (``.node``), with its source line when the graph recorded one."""

    def __init__(self, message: str, node: fx.Node | None = None) -> None:
        super().__init__(message)
        self.node = node


def export_program(gm: fx.GraphModule, example_inputs: Any) -> "torch.export.ExportedProgram":
    """``torch.export.export(gm, example_inputs, strict=False)`` for a (rewritten)
    GraphModule, with a clear error when it fails. A graph captured with symbolic
    sizes (``torch.export`` with ``dynamic_shapes``) is exported with them again
    (``dynamic_shapes_of``), so the program still takes other sizes.

    Raises:
        ExportError: export failed; the message names the node that could not be
            exported (found by exporting again node by node), its op and target, and
            torch's own reason, e.g. ``torch.export cannot capture node 'to_numpy'
            (call_function to_numpy, from model.py:12): RuntimeError: ...``.
    """
    args = as_input_tuple(example_inputs)
    try:
        return export_keeping_sizes(gm, args)
    except Exception as err:  # noqa: BLE001 - any failure: name the node, keep torch's reason
        node = _failing_node(gm, args)
        reason = f"{type(err).__name__}: {_first_line(err)}"
        if node is None:
            node = _script_object_holder(gm)
            if node is not None:  # export fails lifting constants, before any node runs
                reason = (f"module {node.target!r} holds a TorchScript object (an int8 kernel's packed "
                          f"weights), which torch.export cannot lift; for an int8 result, "
                          f"rewrite.quant.convert(..., form='qdq') gives the exportable QDQ form ({reason})")
        if node is None:
            raise ExportError(f"torch.export cannot capture this graph: {reason}") from err
        target = getattr(node.target, "__name__", None) or str(node.target)
        where = _source_line(node)
        raise ExportError(f"torch.export cannot capture node {node.name!r} ({node.op} {target}"
                          f"{', from ' + where if where else ''}): {reason}", node) from err


def _script_object_holder(gm: fx.GraphModule) -> fx.Node | None:
    """The first module call whose module holds a TorchScript object as an attribute
    (``torch.ops.quantized``'s packed weights), or None."""
    for node in gm.graph.find_nodes(op="call_module"):
        try:
            module = gm.get_submodule(node.target)
        except AttributeError:
            continue
        if any(isinstance(v, torch.ScriptObject) for m in module.modules() for v in vars(m).values()):
            return node
    return None


def export_keeping_sizes(gm: fx.GraphModule, args: tuple) -> "torch.export.ExportedProgram":
    """``torch.export.export(gm, args, strict=False)``, with the symbolic sizes ``gm``
    was captured with (``dynamic_shapes_of``); with the example's sizes, and a
    warning, when the rewritten graph no longer exports with them.

    torch specializes a dimension whose example size is 0 or 1 (a batch-1 example
    would give a program that takes batch 1 only), so such a dimension is exported
    from the example widened to 2 along it (``_widened``), and the program is asked
    afterwards whether every dimension is still symbolic. A lazily compiled result
    gets its code first: until then its ``forward`` takes ``(*args, **kwargs)``, which
    export would trace as the program's signature (any number of inputs, named
    ``args_0``...)."""
    if isinstance(gm, _LazyGraphModule):
        gm.real_recompile()
    dynamic = dynamic_shapes_of(gm, args)
    if dynamic is not None:
        try:
            program = torch.export.export(gm, _widened(gm, args), dynamic_shapes=dynamic, strict=False)
        except Exception:  # noqa: BLE001 - a rewrite fixed a size: the example's sizes, said so
            program = None
        if program is not None and _keeps_symbolic_sizes(gm, program):
            return program
        warnings.warn("the rewritten graph does not export with the symbolic sizes it was captured with "
                      "(a rewrite fixed a size, or torch fixed one the example inputs give as 0 or 1); "
                      "exported with the example inputs' sizes", stacklevel=3)
    return torch.export.export(gm, args, strict=False)


def _symbolic_dims(gm: fx.GraphModule) -> list:
    """Per placeholder, ``(node, {dim: sympy expression})`` of its recorded symbolic sizes."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        shape = val.shape if isinstance(val, torch.Tensor) else ()
        out.append((node, {i: d.node.expr for i, d in enumerate(shape) if isinstance(d, torch.SymInt)}))
    return out


def _linear_forms(gm: fx.GraphModule) -> list:
    """``_symbolic_dims`` with each expression as ``_linear`` reads it (None: another form)."""
    return [(node, {i: _linear(expr) for i, expr in found.items()}) for node, found in _symbolic_dims(gm)]


def _linear(expr: Any) -> tuple | None:
    """``(symbol, a, b)`` when a recorded size is ``a * symbol + b`` with ints ``a >= 1``
    and ``b`` (a plain symbol is ``(s, 1, 0)``; ``2*s`` one that another size derives
    from), else None."""
    symbols = getattr(expr, "free_symbols", ())
    if len(symbols) != 1:
        return None
    (symbol,) = symbols
    a, b = expr.coeff(symbol), expr.subs(symbol, 0)
    if not (getattr(a, "is_Integer", False) and getattr(b, "is_Integer", False)) or int(a) < 1 \
            or (expr - (a * symbol + b)).expand() != 0:
        return None
    return symbol, int(a), int(b)


def _widened(gm: fx.GraphModule, args: tuple) -> tuple:
    """``args`` with every symbol the capture recorded that the example gives the value
    0 or 1 set to 2, each dimension computed from it resized to match (its slices
    repeated; zeros where it was empty): an example torch will not specialize.
    Unchanged when there is none, or when a size is not ``a * symbol + b`` or a value
    cannot be solved."""
    leaves, spec = torch.utils._pytree.tree_flatten(args)
    forms = [found for _, found in _linear_forms(gm)]
    if len(forms) != len(leaves):
        return args
    values: dict = {}
    for leaf, found in zip(leaves, forms):
        for i, form in found.items():
            if form is None or not isinstance(leaf, torch.Tensor) or i >= leaf.dim():
                return args
            symbol, a, b = form
            value, rest = divmod(leaf.shape[i] - b, a)
            if rest or values.setdefault(symbol, value) != value:
                return args  # not a size this symbol gives, or sized otherwise elsewhere
    wider = {symbol: 2 for symbol, value in values.items() if value < 2}
    if not wider:
        return args
    values.update(wider)
    out = []
    for leaf, found in zip(leaves, forms):
        for i, (symbol, a, b) in found.items():
            size, now = a * values[symbol] + b, leaf.shape[i]
            if size != now:
                if now == 0:  # nothing to repeat: zeros (export traces sizes, not values)
                    shape = list(leaf.shape)
                    shape[i] = size
                    leaf = leaf.new_zeros(shape)
                else:
                    leaf = leaf.index_select(i, torch.arange(size, device=leaf.device) % now)
        out.append(leaf)
    return torch.utils._pytree.tree_unflatten(out, spec)


def _keeps_symbolic_sizes(gm: fx.GraphModule, program: "torch.export.ExportedProgram") -> bool:
    """Whether every input dimension ``gm`` holds as a symbol is one in ``program``'s
    inputs too (torch may specialize one without an error)."""
    user = set(program.graph_signature.user_inputs)
    inputs = [n for n in program.graph.nodes if n.op == "placeholder" and n.name in user
              and isinstance(n.meta.get("val"), torch.Tensor)]  # an int input is a constant there
    wanted = [dims for node, dims in _symbolic_dims(gm) if isinstance(node.meta.get("val"), torch.Tensor)]
    if len(inputs) != len(wanted):
        return False
    for node, dims in zip(inputs, wanted):
        val = node.meta.get("val")
        if dims and not (isinstance(val, torch.Tensor)
                         and all(i < val.dim() and isinstance(val.shape[i], torch.SymInt) for i in dims)):
            return False
    return True


def dynamic_shapes_of(gm: fx.GraphModule, args: tuple) -> Any:
    """``dynamic_shapes`` for exporting ``gm`` on ``args`` again: ``Dim.AUTO`` for
    every dimension its inputs' recorded facts hold as a symbol (a dynamic batch),
    in the structure of ``args``; None when no input size is symbolic, or the
    placeholders do not line up with the inputs."""
    leaves, spec = torch.utils._pytree.tree_flatten(args)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(leaves):
        return None
    found, specs = False, []
    for node, leaf in zip(placeholders, leaves):
        val = node.meta.get("val")
        dims = None
        if isinstance(leaf, torch.Tensor) and isinstance(val, torch.Tensor) and val.dim() == leaf.dim():
            dims = {i: torch.export.Dim.AUTO for i, d in enumerate(val.shape) if isinstance(d, torch.SymInt)} or None
        found = found or dims is not None
        specs.append(dims)
    if not found:
        return None
    derived = _derived_dims(gm)
    if derived is not None:
        specs = [None if d is None else derived[k] for k, d in enumerate(specs)]
    shapes = torch.utils._pytree.tree_unflatten(specs, spec)
    params = [p for p in inspect.signature(gm.forward).parameters.values() if p.kind is not p.VAR_KEYWORD]
    if len(params) == 1 and params[0].kind is inspect.Parameter.VAR_POSITIONAL:
        return (shapes,)  # ``forward(*args)`` (an export's ``.module()``): one tuple input
    return shapes


def _derived_dims(gm: fx.GraphModule) -> list | None:
    """Per placeholder, ``{dim: Dim}`` naming each recorded symbol once, with a size
    derived from one (``2*s``: a ``y`` of twice ``x``'s rows) as that ``Dim`` times and
    plus ints, ranged as recorded (torch records a batch that may be 1 from 2 on);
    None when no size is derived (``Dim.AUTO`` serves) or one is not of that form.
    ``Dim.AUTO`` would make a derived size a symbol of its own, ranged from 2 on: a
    program that refuses a batch the capture took."""
    try:
        return _explicit_dims(gm)
    except Exception:  # noqa: BLE001 - ranges or forms torch will not take: Dim.AUTO serves
        return None


def _explicit_dims(gm: fx.GraphModule) -> list | None:
    """``_derived_dims``'s work, which may raise on a range torch does not take."""
    forms = _linear_forms(gm)
    every = [form for _, found in forms for form in found.values()]
    if None in every or all(form[1:] == (1, 0) for form in every):
        return None
    roots: dict = {}
    out = []
    for node, found in forms:
        specs = {}
        for i, (symbol, a, b) in found.items():
            if symbol not in roots:
                size = node.meta["val"].shape[i]
                bounds = size.node.shape_env.var_to_range.get(symbol)
                low = 1 if bounds is None or int(bounds.lower) <= 2 else int(bounds.lower)
                try:
                    high = int(bounds.upper) if bounds is not None else None
                except Exception:  # noqa: BLE001 - unbounded (sympy's and torch's infinities differ)
                    high = None
                if high is not None and high >= 2 ** 62:
                    high = None
                roots[symbol] = torch.export.Dim(f"d_{symbol}", min=low, **({"max": high} if high else {}))
            specs[i] = roots[symbol] * a + b if (a, b) != (1, 0) else roots[symbol]
        out.append(specs or None)
    return out


class _NodeTracker(fx.Interpreter):
    """Runs a graph node by node, remembering the node being run."""

    current: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        return super().run_node(n)


class _Tracked(nn.Module):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__()
        self.gm = gm
        self.tracker = _NodeTracker(gm)

    def forward(self, *args: Any) -> Any:
        self.tracker.current = None
        return self.tracker.run(*args)


def _failing_node(gm: fx.GraphModule, args: tuple) -> fx.Node | None:
    """The node export fails at: export the graph again, run by an interpreter that
    records the node it is at (None when that export succeeds or fails elsewhere)."""
    tracked = _Tracked(gm)
    try:
        torch.export.export(tracked, args, strict=False)
    except Exception:  # noqa: BLE001 - the failure we are locating
        return tracked.tracker.current
    return None


def _first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    return lines[0] if lines else ""


def _source_line(node: fx.Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    frames = [ln.strip() for ln in trace.splitlines() if ln.strip().startswith("File ")]
    return frames[-1] if frames else ""


def save_format(level: str) -> str:
    """The file a ``level``'s result is saved as: ``".pt2"`` (``torch.export.save``)
    for the export levels, whose GraphModules do not pickle, else ``".pt"``."""
    return ".pt2" if level in ("export", "export_core") else ".pt"


def save_path_problem(path: Any, level: str) -> str | None:
    """Why ``path`` cannot hold a ``level`` result (None when it can): checked by
    ``save`` and, before any work, by ``rewrite apply --save``."""
    problem = _level_problem(level)
    if problem is not None:
        return problem
    wanted = save_format(level)
    if Path(path).suffix != wanted:
        kind = "an ExportedProgram (torch.export.save)" if wanted == ".pt2" else "a pickled GraphModule (torch.save)"
        return f"a {level!r} result is saved as {kind}: name the file *{wanted}, not {Path(path).name!r}"
    return missing_folder(path)


def _write_all(file: Any, data: memoryview) -> None:
    """Write all of ``data``: a raw stream may take part of it per call, and says so."""
    while len(data):
        written = file.write(data)
        if written is None:  # a buffered writer: took it all
            return
        if not written:
            raise SaveError(f"the file object took none of the last {len(data)} bytes: the file is incomplete")
        data = data[written:]


def _level_problem(level: str) -> str | None:
    """Why a ``level`` result cannot be saved at all (None when it can)."""
    if level == "dynamo":
        return ("a dynamo capture's graphs live inside torch.compile and cannot be saved; "
                "use --capture fx or export")
    if level not in LEVELS:
        return f"unknown capture level {level!r}; expected one of {LEVELS}"
    return None


def missing_folder(path: Any) -> str | None:
    """Why nothing can be written at ``path`` (its folder does not exist, is not
    writable, or a folder stands in its place), or None: asked before any work by
    every command that saves. Writability is tried, not guessed from permission bits
    (root passes every ``os.access`` test, yet cannot create a file in ``/proc``)."""
    folder = Path(path).parent
    if not folder.is_dir():
        return f"the folder {str(folder)!r} does not exist"
    if Path(path).is_dir():
        return f"{str(path)!r} is a folder: name a file to write"
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{Path(path).name}.", suffix=".probe", dir=folder)
    except OSError as err:
        return f"cannot create a file in the folder {str(folder)!r}: {err.strerror or err}"
    os.close(fd)
    os.unlink(probe)
    return None


def picklable(gm: fx.GraphModule) -> fx.GraphModule:
    """A plain GraphModule computing what ``gm`` does, sharing its modules and tensors
    (``gm`` is not changed), that ``torch.save`` can write: what fx cannot pickle goes.
    String type annotations on placeholders are dropped; an emitted
    ``torch.Tensor.m(x, ...)`` call becomes ``x.m(...)`` (fx would write its import as
    ``from torch._C import TensorBase.m``); a ``torch.export`` capture's input guard
    (``_guards_fn``, a local function) is left out, so the copy does not check its
    inputs' shapes.

    Raises:
        SaveError: the graph holds a higher-order op (``torch.cond``, an autocast
            or ``no_grad`` region of an export capture): ``torch.load`` re-traces
            the code ``torch.save`` writes, which calls the op's subgraph as a plain
            submodule, so the file would load without it (and run in float32, or
            with gradients, or not at all). ``torch.export.save`` (``.pt2``) keeps it.
    """
    held = higher_order_ops(gm)
    if held:
        raise SaveError(
            f"the graph holds {', '.join(held)} (a higher-order op: torch.cond, an autocast or no_grad "
            "region), which torch.save cannot keep (torch.load re-traces the code without it): save an "
            "export capture as .pt2 (rewrite.capture.save(..., level='export'), rq.export, --pt2)")
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    for node in list(graph.nodes):
        if isinstance(node.type, str):
            node.type = None
        if node.op == "call_function" and is_tensor_method(node.target):
            node.op, node.target = "call_method", node.target.__name__
        elif node.op == "call_module" and not node.users and is_export_guard(gm, node.target):
            graph.erase_node(node)
    plain = fx.GraphModule(gm, graph)
    # the root's own flag only: the submodules are gm's own (shared), each in its
    # own mode (a BatchNorm left in train mode in an eval model stays so, in gm too)
    plain.training = gm.training
    return plain


def higher_order_ops(gm: fx.GraphModule) -> list:
    """The names of the higher-order ops (``cond``, ``wrap_with_autocast``,
    ``wrap_with_set_grad_enabled``...) ``gm``'s graphs call, its subgraphs' too."""
    names: dict = {}
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
                    names[node.target.name()] = None
    return list(names)


def is_tensor_method(target: Any) -> bool:
    """A ``torch.Tensor`` method (``torch.Tensor.to``), not a function or an
    OpOverload: fx writes a call_function of one as an import pickled code cannot
    run, so graphs call it as a method."""
    name = getattr(target, "__name__", None)
    return (isinstance(name, str) and not isinstance(target, torch._ops.OpOverload)
            and getattr(torch.Tensor, name, None) is target)


def is_export_guard(gm: fx.GraphModule, target: Any) -> bool:
    """Whether the submodule ``target`` of ``gm`` is a ``torch.export`` module's input
    guard (``_guards_fn``: it checks the inputs' shapes and computes nothing)."""
    module = getattr(gm, str(target), None)
    return type(module).__name__ == "GuardsFn" and type(module).__module__.startswith("torch.export")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def require_graph_module(gm: Any, who: str) -> None:
    """A ``TypeError`` that says what ``who`` takes, for anything but a GraphModule
    (a plain ``nn.Module`` has no graph to save or export: capture it first)."""
    if not isinstance(gm, fx.GraphModule):
        hint = " (capture it first: rewrite.capture.capture(model, example_inputs, level))" \
            if isinstance(gm, torch.nn.Module) else ""
        raise TypeError(f"{who} takes a torch.fx.GraphModule (a rewrite's result.graph_module, a capture), "
                        f"not {type(gm).__name__}{hint}")


def save(gm: fx.GraphModule, path: Any, level: str = "fx", example_inputs: Any = None) -> Any:
    """Save a rewritten GraphModule, all or nothing.

    ``"fx"``/``"dynamo"`` results are ``torch.save``d (string type annotations on
    placeholders, which fx cannot pickle, are dropped); ``"export"`` results are
    exported again from ``example_inputs`` and written with ``torch.export.save``
    (load with ``torch.export.load``). The file is written next to its target and
    renamed into place only once complete: a failure leaves no partial file and
    an existing file untouched. ``path`` may also be a binary file object
    (``io.BytesIO``, ``open(..., "wb")``), as ``torch.save`` takes: it gets the bytes
    once they are all made, and is returned.

    Raises:
        ValueError: the path's suffix does not match the level's format, names a
            folder, or the level is unknown; an export level without example_inputs;
            a file object that is not binary and writable.
        ExportError: an export level's result cannot be exported (names the node).
    """
    require_graph_module(gm, "save")
    problem = save_path_problem(path, level) if is_path(path) else _level_problem(level) or file_object_problem(path)
    if problem is None and save_format(level) == ".pt2" and example_inputs is None:
        problem = f"a {level!r} result is exported again to be saved: pass its example_inputs"
    if problem is not None:
        raise ValueError(problem)
    if save_format(level) == ".pt2":
        program = export_program(gm, example_inputs)
        write = lambda f: torch.export.save(program, f)  # noqa: E731
    else:
        plain = picklable(gm)
        write = lambda f: torch.save(plain, f)  # noqa: E731
    if not is_path(path):
        buffer = io.BytesIO()  # made whole before the caller's file gets a byte
        write(buffer)
        _write_all(path, buffer.getbuffer())
        return path
    return write_atomically(Path(path), write)


_QUOTED = r"""('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")"""  # a Python string literal, as repr writes a key
_PATH_PIECE = re.compile(rf"\.?_modules\[{_QUOTED}\]|\[(\d+)\]|\[{_QUOTED}\]")
#: dynamo's name of the module whose forward was compiled: ``L['self']``, or whatever
#: the forward calls its first parameter (``def forward(this, x)``: ``L['this']``)
_DYNAMO_ROOT = re.compile(rf"^L\[{_QUOTED}\]\.?")


def normalize_module_path(path: str) -> str:
    """A module path as any capture level's ``nn_module_stack`` writes it, dotted:
    dynamo's ``L['self'].layer1[0]`` (or ``L['this']...`` for a forward whose first
    parameter is not ``self``, ``._modules['key']`` for a container key, quotes and
    all) is ``layer1.0``. A child module named ``self`` (BERT's attention has one)
    keeps its name: no capture writes the root as ``self.``."""
    path = _DYNAMO_ROOT.sub("", path)
    path = _PATH_PIECE.sub(lambda m: "." + _key(next(g for g in m.groups() if g is not None)), path)
    return path.strip(".")


def _key(piece: str) -> str:
    """A container key as written in a path: an index, or a quoted string (any key)."""
    return str(ast.literal_eval(piece)) if piece[:1] in "'\"" else piece


def is_path(target: Any) -> bool:
    """Whether ``target`` names a file (a str or path-like), rather than being a file object."""
    return isinstance(target, (str, os.PathLike))


def file_object_problem(target: Any) -> str | None:
    """Why ``target`` (not a path) cannot take the bytes of a saved model, or None: a
    text stream or a non-file would reach torch's writer, which aborts the process on
    some (``torch.export.save(program, 123)``)."""
    mode = getattr(target, "mode", "b")  # (gzip's files give an int)
    binary = hasattr(target, "write") and not isinstance(target, io.TextIOBase) \
        and not (isinstance(mode, str) and "b" not in mode)
    if not binary:
        return (f"expected a path or a binary file object opened for writing (open(..., 'wb'), io.BytesIO), "
                f"not {type(target).__name__}")
    if getattr(target, "closed", False):
        return "the file object is closed"
    writable = getattr(target, "writable", None)
    try:
        if callable(writable) and not writable():
            return "the file object is not open for writing (open(..., 'wb'))"
    except ValueError:  # io's answer for a file closed meanwhile
        return "the file object is closed"
    return None


def file_problem(path: Any, suffix: str) -> str | None:
    """Why ``path`` cannot take a ``suffix`` file (None when it can): its name, a
    missing folder, a folder in its place. Asked before any work."""
    if Path(path).suffix != suffix:
        return f"name the file *{suffix}, not {Path(path).name!r}"
    return missing_folder(path)


def write_atomically(path: Any, write: Any) -> Path:
    """``write(name)`` into a file next to ``path``, renamed onto it only once complete:
    a failure leaves no partial file and an existing file untouched. The file gets
    the permissions any new file gets (``mkstemp`` makes it private, 0600: a serving
    process could not read it), or those of the file it replaces (a private 0600 one
    stays private, as ``torch.save`` onto it keeps it). A symbolic link is written
    through. ``SaveError`` when no file can be created next to ``path``."""
    given = path = Path(path)
    if path.is_symlink():  # written through, as torch.save does: the link stays a link
        path = path.resolve()
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:  # no such file (yet)
        mode = 0o666 & ~_umask()
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".partial{path.suffix}", dir=path.parent or ".")
    except OSError as err:  # the folder went away or became read-only since it was asked
        raise SaveError(f"cannot write {str(path)!r}: {err.strerror or err}") from err
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return given
