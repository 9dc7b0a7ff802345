"""Per-graph facts the matcher and the ``where`` clause need: what a bound operand
is (graph value, constant tensor, literal), its shape/dtype, its users.

A ``Value`` is what registered predicates and queries receive. It is a thin view
over an operand (an ``fx.Node``, a ``ConstRef`` to a module tensor, or a literal)
plus the ``GraphFacts`` of the graph being rewritten.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from typing import Any

import attrs
import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor

from rewrite.capture import INFERENCE_KEY
from rewrite.engine.symbolic import as_traced, size_hint, symbolic_env
from rewrite.engine.shapes import cast_of, fresh_cast, fresh_constant, fresh_like, fresh_view, like_input, view_of
from rewrite.ops.base import ConstRef, attribute, by_identity
from rewrite.ops.effects import graph_mode, op_name, state_writes, written_args
from rewrite.ops.reach import storage_key
from rewrite.ops.vocabulary import detect_dialect

class _QuietWhileInferring(logging.Filter):
    """Drops torch's fake-tensor error log records while a fact is inferred: a meta
    kernel that cannot take the sizes given (``baddbmm`` of a bias with concrete
    sizes among symbolic ones) leaves the fact unknown, which is no error of the
    caller's model; torch would print its traceback for each."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0

    def filter(self, record: logging.LogRecord) -> bool:
        return self.depth == 0


_QUIET = _QuietWhileInferring()
logging.getLogger("torch._subclasses.fake_tensor").addFilter(_QUIET)

__all__ = ["GraphFacts", "Value", "TensorFacts", "FACTS_KEY", "INFERENCE_KEY", "NEW_NODE_KEY", "TrainingModeWarning",
           "keeps_shape", "fetch_attr",
           "forget_recorded_facts",
           "tensor_meta_of"]

#: ``node.meta`` key of the facts this library records on graphs without ``val``.
FACTS_KEY = "rewrite_facts"


#: Ops that only check a value's metadata at run time: torch.export puts an
#: ``aten._assert_tensor_metadata`` after each ``.to()``. They read a value without
#: using it, so they do not keep it alive: a rewrite that removes the value removes
#: its checks, and they count as no reader for ``single_use`` or interior nodes.
METADATA_CHECKS = frozenset({torch.ops.aten._assert_tensor_metadata.default})


def is_metadata_check(node: fx.Node) -> bool:
    """``node`` only checks the metadata of its input (see ``METADATA_CHECKS``)."""
    return node.op == "call_function" and node.target in METADATA_CHECKS


def readers(node: fx.Node) -> list:
    """The users of ``node`` that use its value (metadata checks left out)."""
    return [u for u in node.users if not is_metadata_check(u)]


@attrs.frozen
class TensorFacts:
    """Shape, dtype and device of a tensor value: what rules ask about, recorded on
    symbolic_trace graphs (which carry no ``meta['val']``) without the cost of
    building FakeTensors."""

    shape: tuple
    dtype: torch.dtype
    device: torch.device
    contiguous: bool | None = None  # laid out row-major (None: not recorded)
    stride: tuple | None = None
    storage_offset: int | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @classmethod
    def of(cls, t: Any) -> "TensorFacts":
        strided = t.layout == torch.strided
        return cls(tuple(t.shape), t.dtype, t.device, t.is_contiguous() if strided else None,
                   tuple(t.stride()) if strided else None, t.storage_offset() if strided else None)


fetch_attr = attribute  # ``root.a.b.c`` by dotted name (rewrite.ops.base.attribute)


def tensor_meta_of(node: fx.Node) -> Any:
    """Shape/dtype information recorded on a node: ``meta['val']`` (export, dynamo,
    our own emitted nodes) or ``meta['tensor_meta']`` (ShapeProp). None if absent."""
    for key in ("val", "example_value", FACTS_KEY, "tensor_meta"):
        val = node.meta.get(key)
        if val is not None:
            return val
    return None


class TrainingModeWarning(UserWarning):
    """Parameters that require grad were not folded into constants because nothing
    tells whether the graph trains (``apply(training=...)`` says)."""


class GraphFacts:
    """Facts about one GraphModule under rewrite, cached where they are costly."""

    def __init__(self, gm: fx.GraphModule, example_inputs: tuple | None = None, on_meta: Any = None,
                 training: bool | None = None) -> None:
        self.gm = gm
        #: the caller's word on whether the graph is trained (``apply(training=...)``):
        #: None leaves it to the graph (``_trains``, ``_owner_trains``)
        self.training = training
        self._on_meta = on_meta  # told before facts are recorded on the input's nodes
        self.before_run: Any = None  # called before the graph runs (pending rewiring is written back)
        # Graphs from export and dynamo carry facts; symbolic_trace graphs get them
        # recorded from the example inputs on the first question about a node that
        # has none (also on a graph an earlier rewrite recorded facts on: its new
        # nodes have none).
        carried = _first_vals(gm, 8)
        self._example_inputs = None if carried or _carries(gm, "example_value") else example_inputs
        self.recorded = False  # facts were recorded from the example inputs (forget_recorded_facts)
        # Graphs whose values are FakeTensors (export, dynamo) get a FakeTensor
        # ``val`` on every new node that survives the rewrite (``settle``), for later
        # consumers of the graph; any node's facts are inferred earlier when a rule
        # asks. Nodes created and replaced again meanwhile never cost a propagation.
        self.fake_mode = _own_mode([v for v in carried if isinstance(v, torch.Tensor)]) \
            or _symbolic_example_mode(gm)
        #: the ShapeEnv of a graph with symbolic sizes (a dynamic-shape export), else
        #: None: where clauses decide only what holds for every size (rewrite.engine.symbolic)
        self.shape_env = symbolic_env(self.fake_mode)
        self._fakes: dict = {}  # id(real constant) -> (constant, its FakeTensor)
        #: node -> its facts inferred again after a rewrite changed the layout of
        #: what it reads (``relay``): read before what the node recorded
        self._relaid: dict = {}
        self._inference_errors: dict = {}  # new node -> why its op rejects its inputs' facts
        #: parameters not taken as constants only because nothing tells whether the graph trains
        self.unknown_training: set = set()

    def _fake_of(self, mode: Any, v: Any) -> Any:
        """``_fake``, converting each real constant (a weight new nodes read) once
        per rewrite: the fake mode's own memo is a lookup through its converter."""
        if v.__class__ is not torch.Tensor and v.__class__ is not torch.nn.Parameter:
            return _fake(mode, v)
        return by_identity(self._fakes, v, lambda t: _fake(mode, t))

    def fake_of_constant(self, tensor: torch.Tensor, registered: torch.Tensor) -> Any:
        """The FakeTensor ``val`` of a constant a rewrite made (``tensor``, registered
        on the module as ``registered``: a Parameter sharing its data, or itself),
        built directly when it can be (``fresh_constant``). Inferring a later node
        that reads ``registered`` takes a FakeTensor of it built the same way (no
        conversion through ``from_tensor``)."""
        fake = fresh_constant(tensor, self.fake_mode)
        if fake is None:
            fake = _fake(self.fake_mode, tensor)
        if registered is not tensor:
            mine = fresh_constant(registered, self.fake_mode)
            if mine is not None:
                self._fakes[id(registered)] = (registered, mine)
        else:
            self._fakes[id(registered)] = (registered, fake)
        return fake

    @functools.cached_property
    def param_names(self) -> set:
        return {name for name, _ in self.gm.named_parameters(remove_duplicate=False)}

    def constant_of(self, operand: Any) -> Any:
        """The concrete value of a constant operand (tensor for get_attr/ConstRef,
        the literal itself otherwise); raises ValueError for graph values. Inside a
        user's predicate or query (``showing_copies``) a tensor is a copy: the
        model's own would let a predicate that writes what it reads change the
        caller's model, whatever apply decides."""
        if isinstance(operand, (list, tuple)):
            return type(operand)(self.constant_of(o) for o in operand)
        return self._shown(self._constant(operand))

    def _constant(self, operand: Any) -> Any:
        """``constant_of`` without the copy: the model's own tensor."""
        if isinstance(operand, ConstRef):
            return fetch_attr(self.gm, operand.qualname)
        if isinstance(operand, fx.Node):
            if operand.op == "get_attr":
                return fetch_attr(self.gm, operand.target)
            raise ValueError(f"{operand.name} is computed by the graph, not a constant")
        return operand

    @staticmethod
    def _shown(value: Any) -> Any:
        """``value``, or in a user's code a copy of it (made per call and kept by
        nobody here: a predicate reading every weight of a model at its one reader
        holds one copy at a time)."""
        if not _SHOWING_COPIES.depth or not isinstance(value, torch.Tensor):
            return value
        return value.detach().clone()

    def is_const(self, operand: Any) -> bool:
        """A literal, or a parameter/buffer the graph never writes in place (an
        EMA update, running statistics in training mode): a rule may fold its value
        at rewrite time only if every call reads that same value."""
        if isinstance(operand, ConstRef):
            return self._unwritten(operand.qualname)
        if isinstance(operand, fx.Node):
            return operand.op == "get_attr" and self._unwritten(operand.target)
        if isinstance(operand, (list, tuple)):
            return all(self.is_const(o) for o in operand)
        return True

    def _unwritten(self, qualname: str) -> bool:
        try:
            value = fetch_attr(self.gm, qualname)
        except AttributeError:
            return False
        if not isinstance(value, torch.Tensor):
            return True
        if value.requires_grad and self._may_train(qualname):
            return False  # folded into a new tensor, it would no longer get the caller's gradients
        written = self._written_state
        return written is not None and id(value) not in written[0] and storage_key(value) not in written[1]

    def _may_train(self, qualname: str) -> bool:
        """Whether the parameter ``qualname`` may be trained: a rule that folds it
        (AMP's weights cast once) would leave the caller's optimizer with nothing to
        update. The caller's word first (``apply(training=...)``), then the graph's
        ops (``graph_mode``: a batch norm updating running statistics, a dropout that
        drops), then the modules' flags where they are the caller's (a
        ``symbolic_trace`` graph), then what a capture of the model or an earlier
        apply knew (``INFERENCE_KEY``), then an eval-mode batch norm or dropout. A
        graph none of them tells of (an MLP ``torch.export`` captured, its module
        always in training mode) may train: its parameters are not folded."""
        if self.training is not None:
            return self.training
        mode = self._graph_mode
        if mode is True:
            return True
        if self._flags_are_callers:
            return self._owner_trains(qualname)
        marked = self.gm.meta.get(INFERENCE_KEY)
        if marked is not None:  # a capture of the model, or an apply, knew
            return not marked
        if mode is None:
            self.unknown_training.add(qualname)  # apply warns (``TrainingModeWarning``)
            return True
        return False

    @functools.cached_property
    def _graph_mode(self) -> bool | None:
        return graph_mode(self.gm)

    @property
    def inference(self) -> bool:
        """The graph is known not to train (``INFERENCE_KEY``, kept on the result)."""
        if self.training is not None:
            return not self.training
        marked = self.gm.meta.get(INFERENCE_KEY)
        return marked if marked is not None else self._graph_mode is False

    @property
    def differentiated(self) -> bool:
        """Whether gradients may flow through the graph (a backward pass reads what
        autograd kept of its values): not an inference graph (``inference``), nor a
        ``symbolic_trace`` graph of a model in eval mode."""
        if self.inference:
            return False
        return self.training is not None or not (self._flags_are_callers and not self.gm.training)

    @property
    def trained(self) -> bool:
        """Whether the graph is known to be trained: the caller said so
        (``apply(training=True)``), or it runs a batch norm updating its statistics
        or a dropout that drops."""
        return self.training if self.training is not None else self._graph_mode is True

    def _owner_trains(self, qualname: str) -> bool:
        """The module holding ``qualname`` is in training mode, where that flag is the
        caller's: a module ``symbolic_trace`` kept (a ``Linear``, a user's own class).
        A model fine-tuned around frozen parts (``model.train(); model.bn.eval()``)
        trains the conv before that batch norm. The plain ``Module`` containers fx
        and ``torch.export`` make for attribute paths (in training mode whatever the
        model's) and a GraphModule say nothing of their own: there the root's flag
        counts when it is the traced model's (``_traced_in_training``): a parameter a
        train-mode model reads functionally (``F.linear(x, self.w)``, a submodule
        ``symbolic_trace`` inlined) is being trained."""
        path = qualname.rpartition(".")[0]
        try:
            owner = self.gm.get_submodule(path) if path else self.gm
        except AttributeError:
            return False
        if type(owner) is torch.nn.Module or isinstance(owner, fx.GraphModule):
            return self._traced_in_training
        return owner.training

    @functools.cached_property
    def dialect(self) -> str:
        """``detect_dialect`` of the graph, once: a rewrite does not change it."""
        return detect_dialect(self.gm)

    @functools.cached_property
    def _flags_are_callers(self) -> bool:
        """The modules' training flags are the caller's: a ``symbolic_trace``
        GraphModule copies the traced model's. ATen graphs (``torch.export``, whose
        module is always in training mode, and what flows make of it, values carried
        or not) and dynamo's (which carry ``example_value``s) do not tell it that way:
        their batch norms and dropouts do (``graph_mode``)."""
        return not _first_vals(self.gm, 1) and not _carries(self.gm, "example_value") and self.dialect == "torch"

    @property
    def _traced_in_training(self) -> bool:
        """The root is in training mode and its flag is the caller's."""
        return self.gm.training and self._flags_are_callers

    @functools.cached_property
    def _written_state(self) -> tuple | None:
        """(ids, memory) of the state tensors the graph may write (None: unknown),
        worked out once: rewrites add no writes to existing state (E105). Memory
        (``storage_key``), as another tensor may view a written one (a buffer
        registered as ``bn.running_mean[:2]``). Not an input the graph writes in
        place, although the caller may pass a module tensor as it (``m(x,
        m.bn.running_mean)``): a KV cache written in place would stop every fold."""
        written = state_writes(self.gm)
        if written is None:
            return None
        if not written:
            return written, frozenset()
        state = [*self.gm.parameters(), *self.gm.buffers()]
        for node in self.gm.graph.find_nodes(op="get_attr"):  # plain tensor attributes too
            try:
                state.append(fetch_attr(self.gm, node.target))
            except AttributeError:
                continue
        storages = {storage_key(t) for t in state if isinstance(t, torch.Tensor) and id(t) in written}
        storages.discard(None)
        return written, frozenset(storages)

    def meta(self, operand: Any, record: bool = True) -> Any:
        """A tensor-like with .shape/.dtype/.device for the operand, or None.
        ``record=False`` never runs the graph to find out."""
        if isinstance(operand, fx.Node) and operand.op != "get_attr":
            if self._relaid and operand in self._relaid:
                return self._relaid[operand]
            val = operand.meta.get("val")
            if isinstance(val, torch.Tensor):
                return val  # export and dynamo graphs: a FakeTensor (the common case, first)
            val = tensor_meta_of(operand)
            if val is None and operand.meta.pop(NEW_NODE_KEY, False):
                self._infer(operand, record)
                val = tensor_meta_of(operand)
            if val is None and record and self._example_inputs is not None:
                self._record(operand)
                val = tensor_meta_of(operand)
            return val if hasattr(val, "shape") and hasattr(val, "dtype") else None
        if isinstance(operand, (ConstRef, fx.Node)):  # a constant (get_attr or a module's tensor)
            value = self._constant(operand)
            if not isinstance(value, torch.Tensor):
                return None
            # a user's predicate reads the facts, not the caller's tensor (nor a copy of it)
            return _facts_of(value) if _SHOWING_COPIES.depth else value
        if isinstance(operand, torch.Tensor):
            return operand
        return None

    def inference_error(self, node: fx.Node) -> str | None:
        """Why ``node`` (a new node) has no facts when its op refused its inputs'
        (shapes that do not broadcast, a matmul of mismatched shapes), or of an input of it
        the rewrite created; None when its facts are merely unknown (an input without
        facts, an op without a fake or meta kernel)."""
        seen, stack = set(), [node]
        while stack:
            n = stack.pop()
            if n in self._inference_errors:
                return self._inference_errors[n]
            seen.add(n)
            stack.extend(i for i in n.all_input_nodes if i not in seen and tensor_meta_of(i) is None)
        return None

    def _rejected_at_hints(self, node: fx.Node, inputs: list, values: list) -> str | None:
        """Why ``node``'s op refuses its inputs at the example's sizes (their symbols'
        hints), or None: under symbolic sizes a fake kernel may refuse what the op
        takes (``baddbmm`` of a bias of concrete sizes among symbolic ones), so a
        refusal counts only when the op refuses the concrete sizes too."""
        try:
            env = {n: _each(lambda _, t: _at_hint(t), None, v) for n, v in zip(inputs, values)}
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
            args, kwargs = torch.utils._pytree.tree_map_only(torch.SymInt, size_hint, (args, kwargs))
            _call(node, self._callable(node, fake=False), args, kwargs)
        except Exception as err:  # noqa: BLE001 - the op's own refusal, or no meta kernel
            return _rejection(err)
        return None

    def relay(self, fresh: dict) -> None:
        """Nodes of the graph whose layout a rewrite changed, with their facts
        inferred again (``rewrite.engine.layout``): later questions about them (a
        where clause's ``is_contiguous``) get these, not what they recorded."""
        self._relaid.update(fresh)

    def new_node(self, node: fx.Node) -> None:
        """A node a rewrite created: its facts are inferred when first asked, or by
        ``settle`` at the end of the rewrite."""
        node.meta[NEW_NODE_KEY] = True

    def settle(self, nodes: Any) -> None:
        """The end of a rewrite: created ``nodes`` still in the graph get the facts
        the graph's fake mode gives (a FakeTensor ``val`` on export graphs and on
        dynamo graphs of symbolic sizes, in creation order so inputs come first; a
        dynamo graph of static sizes has no fake mode here: its new nodes keep the
        ``TensorFacts`` inferred on meta tensors, no ``example_value``); the pending
        marks go."""
        for node in nodes:
            if node.meta.get(NEW_NODE_KEY) and not node._erased and self.fake_mode is not None:
                self.meta(node, record=False)
            node.meta.pop(NEW_NODE_KEY, None)
        # nodes of the graph whose layout a rewrite changed carry it on (a later apply
        # on the result, or a compiler reading ``val``, must not see the old strides)
        for node, fresh in self._relaid.items():
            if node._erased or not isinstance(fresh, torch.Tensor):
                continue
            for key in ("val", "example_value"):
                old = node.meta.get(key)
                if isinstance(old, torch.Tensor) and getattr(old, "fake_mode", None) is getattr(fresh, "fake_mode", 0):
                    if self._on_meta is not None:
                        self._on_meta(node, key)
                    node.meta[key] = fresh
                    break

    def rerun(self, nodes: list, given: dict | None = None) -> dict:
        """Facts of ``nodes`` (an original graph's nodes whose inputs a rewrite changed,
        in graph order) computed again from their inputs' current facts, each one's
        fresh result taking the place of what it recorded for the later ones: what
        ``val`` they would have now, without changing the recorded facts. ``given``:
        facts to read for some inputs instead of what they recorded (a value a
        replacement would put in their place). A node that cannot be inferred (an
        input without facts, an op without a fake or meta kernel) and every later one
        are left out."""
        fresh: dict = dict(given or {})
        for node in nodes:
            inputs = node.all_input_nodes
            values = []
            for n in inputs:
                v = fresh[n] if n in fresh else self._tensors_of(n, record=False)
                values.append(v if v is not None else _plain_value(n))
            if any(v is None for v in values) or node.op not in ("call_function", "call_method", "call_module"):
                return fresh
            try:
                if self.fake_mode is not None:
                    target = self._callable(node, fake=True)
                    env = {n: _each(self._fake_of, self.fake_mode, v) for n, v in zip(inputs, values)}
                    with self.fake_mode:
                        args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                        fresh[node] = _call(node, target, args, kwargs)
                else:
                    fresh[node] = self._run_off_device(node, inputs, values)
            except Exception:  # noqa: BLE001 - facts are best-effort
                return fresh
        return fresh

    def _run_off_device(self, node: fx.Node, inputs: list, values: list) -> Any:
        """``node`` run on meta tensors (a graph without a fake mode). A 2-d
        convolution's result is laid out as CPU's kernel lays it out: channels_last
        when its input or weight is (the meta kernel keeps it contiguous)."""
        env = {n: _each(lambda _, t: _on_meta(t), None, v) for n, v in zip(inputs, values)}
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
        target = self._callable(node, fake=False)
        out = _call(node, target, args, kwargs)
        operands = _conv_operands(node, target, args, kwargs)
        if operands and isinstance(out, torch.Tensor) and out.dim() == 4 and any(
                isinstance(t, torch.Tensor) and t.dim() == 4 and not t.is_contiguous()
                and t.is_contiguous(memory_format=torch.channels_last) for t in operands):
            out = out.contiguous(memory_format=torch.channels_last)
        return out

    def _tensors_of(self, node: fx.Node, record: bool) -> Any:
        """``meta`` of a node, or the list of its results' facts for a multi-output
        node (``getitem`` of a split a rewrite created reads them)."""
        m = self.meta(node, record)
        if m is None:
            val = tensor_meta_of(node)
            if isinstance(val, (list, tuple)) and val and all(hasattr(v, "shape") for v in val):
                return val
        return m

    def _callable(self, node: fx.Node, fake: bool) -> Any:
        """What the node calls, runnable on fake or meta tensors: an inserted module
        (an observer, a fake quantizer) is run as a copy whose tensors are fake (or on
        the meta device), so inferring its output never touches its real state."""
        if node.op != "call_module":
            return node.target
        module = self.gm.get_submodule(node.target)
        if keeps_shape(module):
            # returns its input (their forward is data-dependent: no fake run)
            return lambda x, *args, **kwargs: torch.empty_like(x)
        if fake:
            from torch._subclasses.fake_tensor import FakeCopyMode

            with FakeCopyMode(self.fake_mode):
                twin = copy.deepcopy(module)
        else:
            twin = copy.deepcopy(module).to("meta")
        # a module whose forward cannot run on fake values (a QAT layer's weight fake
        # quantizer is data-dependent) names a stand-in with the same result metadata
        return getattr(twin, "facts_forward", twin)

    def _infer(self, node: fx.Node, record: bool) -> None:
        """Facts of a new call from its inputs' facts: a FakeTensor ``val`` in the
        graph's fake mode, else ``TensorFacts`` from running the op on meta tensors.
        Best-effort: nothing when an input has no facts or the op no meta kernel.
        Sizes are what the graph was traced with (``as_traced``), also when a where
        clause asks."""
        with as_traced():
            self._infer_now(node, record)

    def _infer_now(self, node: fx.Node, record: bool) -> None:
        inputs = node.all_input_nodes
        try:
            metas = [self._tensors_of(n, record) for n in inputs]
        except RecursionError:
            return
        # Non-tensor inputs (a recorded ``x.shape``, an int) are used as they are.
        values = [m if m is not None else _plain_value(n) for n, m in zip(inputs, metas)]
        if any(v is None for v in values):
            return
        mode = self.fake_mode if self.fake_mode is not None else _symbolic_mode(values)
        rejected = None  # the op's own refusal of these inputs (a negative size), if it made one
        if mode is not None:
            try:
                env = {n: _each(self._fake_of, mode, v) for n, v in zip(inputs, values)}
                same = like_input(node, env)  # elementwise on dense inputs: no dispatch needed
                if same is not None and same.fake_mode is mode:
                    node.meta["val"] = fresh_like(same)
                    return
                cast = cast_of(node, env)  # a float cast of a dense input: likewise
                if cast is not None and cast[0].fake_mode is mode:
                    node.meta["val"] = fresh_cast(*cast)
                    return
                view = view_of(node, env)  # a view of a contiguous input: its memory, a new shape
                if view is not None and view[0].fake_mode is mode:
                    node.meta["val"] = fresh_view(*view)
                    return
                target = self._callable(node, fake=True)
                _QUIET.depth += 1
                try:
                    with mode:
                        args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                        node.meta["val"] = target(*args, **kwargs)
                finally:
                    _QUIET.depth -= 1
                return
            except Exception as err:  # noqa: BLE001 - e.g. inputs from another fake mode: use meta tensors
                rejected = _rejection(err)
        try:
            out = self._run_off_device(node, inputs, values)
        except Exception as err:  # noqa: BLE001 - facts are best-effort
            out = _run_on_zeros(node, inputs, values, self.gm)
            if out is None:
                rejected = rejected or _rejection(err)
                if rejected is not None and _symbolic(values):
                    rejected = self._rejected_at_hints(node, inputs, values)
                if rejected is not None:
                    self._inference_errors[node] = rejected
                return
        metas = [m for m in metas if m is not None and not isinstance(m, (list, tuple))]
        device = next((m.device for m in metas if getattr(m, "device", None) is not None), torch.device("cpu"))
        node.meta[FACTS_KEY] = torch.utils._pytree.tree_map_only(
            torch.Tensor, lambda t: TensorFacts(tuple(t.shape), t.dtype, torch.device(device), t.is_contiguous(),
                                                tuple(t.stride()), t.storage_offset()), out
        )

    def _record(self, node: fx.Node) -> None:
        """Run the example inputs through the graph once, recording TensorFacts on
        every node that has none (symbolic_trace graphs carry no shapes). Done on
        the first question about a shape, so rules that never ask pay nothing."""
        from rewrite.trust.check import laid_out_copy, preserved_state

        inputs, self._example_inputs = self._example_inputs, None  # once
        self.recorded = True
        if self.before_run is not None:
            self.before_run()
        # on copies of the inputs, restoring the module's state: recording facts has
        # no side effects (a model may write its input, or its BatchNorm statistics);
        # copies laid out as the inputs are (a sliced input's strides are a fact)
        inputs = laid_out_copy(inputs)
        try:
            with torch.no_grad(), preserved_state(self.gm, runs_only=True), torch.random.fork_rng(devices=[]):
                _record_facts(self.gm, inputs, self._on_meta)
        except Exception:  # noqa: BLE001 - facts are best-effort; rules needing them won't fire
            pass


def keeps_shape(module: Any) -> bool:
    """Whether a module returns a tensor of its input's shape, dtype and layout, known
    without running it: torch's observers and fake quantizers (which return their
    input, or a fake-quantized copy of it)."""
    from torch.ao.quantization import FakeQuantizeBase, ObserverBase

    return isinstance(module, (ObserverBase, FakeQuantizeBase))


NEW_NODE_KEY = "rewrite_new"  # set on nodes a rewrite created, until their facts are inferred


_SCALARS = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)


def _plain_value(node: fx.Node) -> Any:
    """A recorded non-tensor value of a node (a shape, an int; symbolic ones too: a
    dynamic-shape export's ``sym_size`` nodes, which reshapes read), or None."""
    value = tensor_meta_of(node)
    if isinstance(value, (*_SCALARS, torch.Size)) or (
        isinstance(value, (tuple, list)) and all(isinstance(v, _SCALARS) for v in value)
    ):
        return value
    return None


def _fake(mode: Any, v: Any) -> Any:
    if isinstance(v, FakeTensor) or not hasattr(v, "dtype"):
        return v
    if isinstance(v, torch.Tensor):
        # static shapes: fresh symbolic sizes would make every later inference
        # evaluate sympy guards (10-40x slower on export graphs)
        return mode.from_tensor(v, static_shapes=True)
    with mode:
        return torch.empty(tuple(v.shape), dtype=v.dtype)


def _each(convert: Any, mode: Any, v: Any) -> Any:
    """``convert(mode, v)``, element by element for the results of a multi-output node."""
    if isinstance(v, (list, tuple)):
        return type(v)(convert(mode, t) for t in v)
    return convert(mode, v)


def _call(node: fx.Node, target: Any, args: tuple, kwargs: dict) -> Any:
    if node.op == "call_method":
        return getattr(args[0], target)(*args[1:], **kwargs)
    return target(*args, **kwargs)


def _symbolic(values: list) -> bool:
    """Whether some value is a symbolic size or has one."""
    leaves = torch.utils._pytree.tree_leaves(values)
    return any(isinstance(v, torch.SymInt) or any(isinstance(d, torch.SymInt) for d in (getattr(v, "shape", None)
                                                                                    or ())) for v in leaves)


def _at_hint(v: Any) -> Any:
    """``v`` at the sizes its symbols stand for in the example: a meta tensor, an int."""
    if isinstance(v, torch.SymInt):
        return size_hint(v)
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        return torch.empty([size_hint(d) for d in v.shape], dtype=v.dtype, device="meta")
    return v


def _rejection(err: Exception) -> str | None:
    """``err``, raised by an op run on its inputs' facts, as the op's refusal of
    those inputs (a negative size, shapes that do not broadcast), or None when it
    says only that the facts cannot be had (no fake or meta kernel, a size that
    depends on data, another fake mode)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, \
        UnsupportedOperatorException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    unknowable = (NotImplementedError, UnsupportedOperatorException, DynamicOutputShapeException,
                  DataDependentOutputException, GuardOnDataDependentSymNode)
    if not isinstance(err, (RuntimeError, ValueError, IndexError)) or isinstance(err, unknowable):
        return None
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200] if text else ''}"


def _run_on_zeros(node: fx.Node, inputs: list, values: list, gm: Any) -> Any:
    """The op run for real on zeros of its inputs' shapes and dtypes, when an input
    is quantized (no fake or meta kernel takes one: a quantized conv's output, a
    pool or flatten after it). Only for functions and methods that write nothing,
    and torch's quantized inference modules (``torch.ao.nn.quantized``: an inserted
    int8 conv), which hold no state they update; constants are passed as they are
    (read, never written)."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if not type(module).__module__.startswith(_QUANTIZED_MODULES) or module._forward_hooks \
                or module._forward_pre_hooks:
            return None
        target = module
    elif node.op in ("call_function", "call_method") and not written_args(node, gm):
        target = node.target
    else:
        return None
    leaves = torch.utils._pytree.tree_leaves(values)
    if not any(getattr(v, "dtype", None) in _QUANTIZED for v in leaves):
        return None
    try:
        env = {n: _each(lambda _, t: _zeros_of(t), None, v) for n, v in zip(inputs, values)}
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
        with torch.no_grad():
            return _call(node, target, args, kwargs)
    except Exception:  # noqa: BLE001 - facts are best-effort
        return None


_QUANTIZED = frozenset({torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, torch.quint2x4})
_QUANTIZED_MODULES = ("torch.ao.nn.quantized.", "torch.ao.nn.intrinsic.quantized.")


def _zeros_of(v: Any) -> Any:
    """A real tensor for facts ``v``: a real tensor (a constant) itself, else zeros
    of its shape and dtype (a quantized one with scale 1 and zero point 0)."""
    if isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor) and v.device.type != "meta":
        return v
    if not (hasattr(v, "shape") and hasattr(v, "dtype")):
        return v
    if v.dtype in _QUANTIZED:
        return torch._empty_affine_quantized(tuple(v.shape), scale=1.0, zero_point=0, dtype=v.dtype)
    return torch.zeros(tuple(v.shape), dtype=v.dtype)


def _on_meta(v: Any) -> Any:
    """A meta tensor with ``v``'s shape, dtype and (when known) strides: layouts
    propagate (a channels_last weight makes a channels_last convolution output)."""
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        stride = getattr(v, "stride", None)
        if callable(stride) and getattr(v, "layout", None) == torch.strided:
            stride = tuple(stride())
        if isinstance(stride, tuple) and len(stride) == len(v.shape):
            return torch.empty_strided(tuple(v.shape), stride, dtype=v.dtype, device="meta")
        return torch.empty(tuple(v.shape), dtype=v.dtype, device="meta")
    return v


#: 2-d convolutions, by op name: CPU lays their result out channels_last from a
#: channels_last input or weight
_CONVOLUTIONS = frozenset({"conv2d", "convolution", "_convolution", "conv_transpose2d"})


def _conv_operands(node: fx.Node, target: Any, args: tuple, kwargs: dict) -> tuple:
    """(input, weight) of a convolution call (function or ``nn.Conv2d`` module), else ()."""
    if node.op == "call_module":
        weight = getattr(target, "weight", None)
        if isinstance(target, torch.nn.modules.conv._ConvNd) and args:
            return (args[0], weight)
        return ()
    if node.op == "call_function" and op_name(node.target) in _CONVOLUTIONS:
        inputs = list(args[:2])
        inputs += [kwargs[k] for k in ("input", "weight") if k in kwargs]
        return tuple(inputs)
    return ()


def _symbolic_mode(values: list) -> Any:
    """The fake mode of FakeTensors among ``values`` with symbolic sizes (dynamo's
    ``example_value``s of a dynamic graph, which meta tensors cannot hold), else None."""
    fakes = [v for v in torch.utils._pytree.tree_leaves(values) if isinstance(v, FakeTensor)]
    if not any(isinstance(d, torch.SymInt) for v in fakes for d in v.shape):
        return None
    return detect_fake_mode(fakes)


def _first_vals(gm: fx.GraphModule, n: int) -> list:
    """Tensor ``meta['val']``s of the first ``n`` call nodes that carry one (a graph
    either carries them throughout or not at all: no need to look at all of them;
    SymInt values of ``sym_size`` nodes, which export hoists first, do not count)."""
    out: list = []
    for node in gm.graph.nodes:
        if node.op.startswith("call_") and isinstance(node.meta.get("val"), torch.Tensor):
            out.append(node.meta["val"])
            if len(out) >= n:
                break
    return out


def _symbolic_example_mode(gm: fx.GraphModule) -> Any:
    """The fake mode of a dynamo graph's ``example_value``s when their sizes are
    symbolic (``dynamic=True``, or a recompile for another batch): new nodes' facts
    are then inferred in it, as their sizes cannot be made real on meta tensors.
    None for a graph of static sizes (inferred on meta tensors, as before)."""
    values = []
    for node in gm.graph.nodes:  # the inputs, which come first: where sizes are symbolic
        if node.op != "placeholder":
            break
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor):
            values.append(value)
    if not any(isinstance(n, torch.SymInt) for v in values for n in v.shape):
        return None
    return _own_mode(values)


def _own_mode(values: list) -> Any:
    """The fake mode ``values`` were made in (``detect_fake_mode`` would answer the
    active tracing context's, which a backend called by dynamo runs under: the
    graph's values and new ones would then mix modes, and no fact is inferred)."""
    modes = {id(m): m for v in values if (m := getattr(v, "fake_mode", None)) is not None}
    if len(modes) == 1:
        return next(iter(modes.values()))
    return detect_fake_mode(values) if values else None


def _carries(gm: fx.GraphModule, key: str) -> bool:
    """Whether call nodes carry ``meta[key]`` (dynamo's graphs: ``example_value``)."""
    return any(key in node.meta for node in gm.graph.nodes if node.op.startswith("call_"))


def forget_recorded_facts(gm: fx.GraphModule) -> None:
    """Drop the facts recorded from one call's example inputs (``TensorFacts`` on
    nodes that carry no ``val`` of their own: a symbolic_trace graph's, and those
    inferred from them) when the rewrite is done: they hold for those inputs only,
    and a later ``apply`` given other inputs (or none) must not take them for facts
    of the graph. Facts read from a capture's own ``val`` stay."""
    for node in gm.graph.nodes:
        meta = node.meta
        if FACTS_KEY in meta and "val" not in meta and "example_value" not in meta:
            del meta[FACTS_KEY]


def _record_facts(gm: fx.GraphModule, inputs: Any, on_meta: Any = None) -> None:
    """Run ``gm`` once on ``inputs`` and record ``TensorFacts`` of every tensor value
    on the nodes that carry none (``on_meta(node, key)`` is told first, for an undo
    journal). Through a ``GraphRunner`` (an fx Interpreter costs ~45 us a node more:
    most of recording a symbolic_trace graph's facts), or an Interpreter for a graph
    the runner does not plan."""
    from rewrite.trust.runner import GraphRunner

    # values whose sizes (or, for item(), values used as sizes) come from the
    # example's values, not its shapes, and everything computed from them: facts of
    # the example alone, which other inputs of the same shapes do not share
    by_values: set = set()

    def record(node: fx.Node, result: Any) -> None:
        meta = node.meta
        if "val" in meta or "example_value" in meta or FACTS_KEY in meta:
            return
        if sized_by_values(node) or any(n in by_values for n in node.all_input_nodes):
            by_values.add(node)
            return
        if isinstance(result, torch.Tensor):
            facts = TensorFacts.of(result)
        elif type(result) is torch.Size:  # what the pytree map below makes of it, without it
            facts = tuple(result)
        else:
            facts = torch.utils._pytree.tree_map_only(torch.Tensor, TensorFacts.of, result)
            if facts is None:
                return
        if on_meta is not None:
            on_meta(node, FACTS_KEY)
        meta[FACTS_KEY] = facts

    try:
        runner = GraphRunner(gm)
    except NotImplementedError:  # a placeholder for **kwargs
        _Recorder(gm, record).run(*inputs)
    else:
        runner.observed(record, *inputs)


_SIZED_BY_VALUES = frozenset({"nonzero", "masked_select", "unique", "unique_consecutive", "argwhere",
                               "bincount", "repeat_interleave", "item", "tolist", "masked_scatter",
                               "nanquantile", "histogramdd"})


def sized_by_values(node: fx.Node) -> bool:
    """Whether ``node``'s result has sizes its inputs' values decide (``nonzero``,
    ``x[x > 0]``, ``unique``, ``torch.where(c)``), or is a value later used as one
    (``item``): a size recorded from the example inputs is no fact about other inputs
    of their shapes."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.dynamic_output_shape in target.tags or torch.Tag.data_dependent_output in target.tags
    if node.op == "call_method":
        name = target
    elif node.op == "call_function":
        name = getattr(target, "__name__", None)
    else:
        return False
    if name in _SIZED_BY_VALUES:
        return name != "repeat_interleave" or any(isinstance(a, fx.Node) for a in node.args[1:2])
    if name == "where":  # torch.where(condition): the positions, one tensor per dim
        return len(node.args) + len(node.kwargs) == 1
    if name == "getitem":  # x[mask]: a boolean index picks as many as it holds True
        index = node.args[1] if len(node.args) > 1 else None
        for i in index if isinstance(index, (tuple, list)) else (index,):
            facts = tensor_meta_of(i) if isinstance(i, fx.Node) else None
            if getattr(facts, "dtype", None) in (torch.bool, torch.uint8):
                return True
    return False


class _Recorder(fx.Interpreter):
    """An Interpreter telling ``record(node, value)`` every node's value but the output's."""

    def __init__(self, gm: fx.GraphModule, record: Any) -> None:
        super().__init__(gm)
        self.record = record

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n.op != "output":
            self.record(n, result)
        return result


def _facts_of(t: torch.Tensor) -> "TensorFacts":
    """A constant's facts (shape, dtype, device, layout) without its values."""
    return TensorFacts(tuple(t.shape), t.dtype, t.device, t.is_contiguous(), tuple(t.stride()), t.storage_offset())


class _ShowingCopies:
    """How many calls of a user's where-clause function are running (``constant_of``
    then answers with copies)."""

    depth = 0


_SHOWING_COPIES = _ShowingCopies()


@contextlib.contextmanager
def showing_copies() -> Any:
    """While a user's predicate or query runs: the constants ``constant_of`` gives
    it are copies of the model's tensors."""
    _SHOWING_COPIES.depth += 1
    try:
        yield
    finally:
        _SHOWING_COPIES.depth -= 1


class Value:
    """A bound operand as seen by ``where`` predicates and queries."""

    __slots__ = ("operand", "facts")

    def __init__(self, operand: Any, facts: GraphFacts) -> None:
        self.operand = operand
        self.facts = facts

    def __repr__(self) -> str:
        o = self.operand
        return f"Value({o.name if isinstance(o, fx.Node) else o!r})"

    @property
    def node(self) -> fx.Node | None:
        return self.operand if isinstance(self.operand, fx.Node) else None

    @property
    def is_literal(self) -> bool:
        return not isinstance(self.operand, (fx.Node, ConstRef))

    @property
    def is_const(self) -> bool:
        return self.facts.is_const(self.operand)

    @property
    def qualname(self) -> str | None:
        """Attribute path of a constant tensor operand, else None."""
        if isinstance(self.operand, ConstRef):
            return self.operand.qualname
        if isinstance(self.operand, fx.Node) and self.operand.op == "get_attr":
            return self.operand.target
        return None

    @property
    def literal(self) -> Any:
        return None if not self.is_literal else self.operand

    @property
    def meta(self) -> Any:
        return self.facts.meta(self.operand)

    @property
    def users(self) -> int:
        return len(readers(self.operand)) if isinstance(self.operand, fx.Node) else 0
