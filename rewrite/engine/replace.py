"""Build a match's replacement in the graph and retire the matched nodes.

New nodes are emitted in the dialect of the graph being rewritten (torch functions
for symbolic_trace and dynamo graphs, aten overloads for torch.export graphs), right
before the match's root. New constants computed at rewrite time become attributes of
the GraphModule with stable, readable names derived from the tensors they come from
(``layer1.0.conv1.weight`` + ``conv_bn_weight`` -> ``layer1_0_conv1_weight_conv_bn_weight``).
New nodes carry the root's ``stack_trace`` and ``nn_module_stack`` and get a
``meta['val']`` computed on meta tensors, so later rules can ask for shapes and dtypes.

A replacement that fails while being built (a rewrite-time function raising) leaves
the graph as it was: nodes created so far are erased before the error propagates.
"""

from __future__ import annotations

import builtins
import functools
import math
import operator
import re
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch._subclasses.fake_tensor import FakeTensor

from rewrite.engine.compile import RConst, RLit, RModule, ROp, RResults, RSeq, RVar
from rewrite.engine.facts import FACTS_KEY, GraphFacts, is_metadata_check, keeps_shape, tensor_meta_of
from rewrite.engine.match import Match
from rewrite.engine.outputs import getitem_users, result_count
from rewrite.ops import bind_node
from rewrite.ops.base import ConstRef, by_identity
from rewrite.engine.aliasing import (graph_writes, lost_aliasing, new_aliasing, newly_kept, writes_kept_value,
                                     written_between)
from rewrite.engine.regions import Regions
from rewrite.engine.layout import StrideReaders, layout_change_seen
from rewrite.engine.rewire import Rewirer
from rewrite.engine.shapes import addressing, sizes_differ
from rewrite.ops.effects import always_aliases, note_built_module, schema_returns_alias, written_args
from rewrite.ops.forms import same_value
from rewrite.ops.reach import storage_key

__all__ = ["Replacer", "ReplacementError", "Unchanged", "RULE_KEY", "SOURCES_KEY", "UNLIKE_ROOT", "uses_root"]

_CARRIED_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "from_node")

#: how a refusal of a replacement unlike its root begins (``Replacer._unlike_root``):
#: verification reads it as a counterexample, not as a rule that did not fire
UNLIKE_ROOT = "the replacement is not the root's value: "

#: node meta key: ``(rule name, rule file position)`` of the rule that created the node.
RULE_KEY = "rewrite_rule"
#: binary ops whose operands may be swapped without changing a value
_COMMUTATIVE = frozenset({torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor, torch.add, torch.mul,
                          operator.add, operator.mul})
#: node meta key of an inserted module's call: ``{argument: attribute path}`` for each
#: argument the module was built from a constant of the model (its own copy of that
#: tensor): a flow can tie copies of one parameter back together (``prepare_qat``).
SOURCES_KEY = "rewrite_module_sources"


def uses_root(match: Match) -> bool:
    """Whether the replacement reads the matched root's own value (an insertion)."""
    return any(match.env.get(v) is match.root for v in match.rule.replacement_vars)


def _own(value: Any) -> Any:
    """``value`` with every tensor in it replaced by a copy (parameters stay
    parameters, with their ``requires_grad``)."""

    def copy(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.nn.Parameter):
            return torch.nn.Parameter(t.detach().clone(), requires_grad=t.requires_grad)
        return t.detach().clone()

    return torch.utils._pytree.tree_map_only(torch.Tensor, copy, value)


def _library_function(fn: Any) -> bool:
    """A rewrite-time function this package registers (``rewrite.functions``): read
    to never write its arguments, so it is given the model's tensors themselves."""
    return (getattr(fn, "__module__", None) or "").startswith("rewrite.functions.")


class ReplacementError(Exception):
    """A replacement could not be built (its rewrite-time function failed)."""


class Unchanged(ReplacementError):
    """The replacement is the very call it replaces (same op, target and arguments):
    no rewrite, and no failure either. Without it a rule that writes an op's other
    spelling, which the matcher takes for the same op, would replace its own output
    again and again."""


#: values fx writes into a graph's code as they are (a tensor becomes a constant): Python's
#: own scalars exactly (``numpy.float64`` is a float fx writes as ``np.float64(1.0)``)
_PLAIN = frozenset({bool, int, float, complex, str, type(None), slice})
_CODE_LITERALS = (torch.dtype, torch.device, torch.memory_format, torch.layout, torch.qscheme, torch.Size)


def _same_call(a: fx.Node, b: fx.Node) -> bool:
    return a.op == b.op and a.target is b.target and _identical(a.args, b.args) and _identical(a.kwargs, b.kwargs)


def _identical(a: Any, b: Any) -> bool:
    """The same argument, spelled the same: nodes by identity, literals of the same
    type (``2`` is not ``2.0``: ``mul(x, 2.0)`` makes a float of an int tensor)."""
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return a is b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return isinstance(a, list) == isinstance(b, list) and len(a) == len(b) and \
            all(_identical(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_identical(v, b[k]) for k, v in a.items())
    return type(a) is type(b) and same_value(a, b)


#: Python integer arithmetic a replacement may build whose result grows without bound
#: (E207 bounds literal exponents; a pattern variable takes whatever the model holds)
_GROWING_INTS = {operator.pow: "power", operator.ipow: "power", operator.lshift: "shift",
                 operator.ilshift: "shift"}
#: the most bits such a result may have (computing it, once per call of the result)
MAX_INTEGER_BITS = 1 << 16


def _refuse_huge_integer(target: Any, args: tuple) -> None:
    """``ReplacementError`` when ``target`` is integer power or shift of two Python
    ints (a pattern variable bound to a model's literal, ``x * 10_000_000``) whose
    result would have more than ``MAX_INTEGER_BITS`` bits: inferring its facts and
    every call of the rewritten model would compute it (minutes, gigabytes)."""
    kind = _GROWING_INTS.get(target)
    if kind is None or len(args) < 2:
        return
    base, exponent = args[0], args[1]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (base, exponent)) or exponent <= 0:
        return
    bits = exponent * max(abs(base).bit_length() - 1, 0) if kind == "power" else exponent + abs(base).bit_length()
    if bits > MAX_INTEGER_BITS:
        raise ReplacementError(f"the replacement's integer {kind} ({base}, {exponent}) would have about {bits} "
                               f"bits, over {MAX_INTEGER_BITS}")


class Replacer:
    """Applies matches to one GraphModule in one dialect."""

    def __init__(self, gm: fx.GraphModule, facts: GraphFacts, dialect: str, bindings: Any = None) -> None:
        """``bindings(node)``: a node's bindings (``bind_node``), as the matcher keeps
        them for the nodes it just matched."""
        self.gm = gm
        self.graph = gm.graph
        self.facts = facts
        self.dialect = dialect
        self._bindings = bindings or (lambda node: bind_node(node, gm))
        self._created: list = []
        #: (replaced value, what its readers read instead), per rewrite: where the
        #: readers' layouts may have changed (rewrite.engine.layout)
        self.replaced: list = []
        self._covered: tuple = ()
        self._new_attrs: list = []
        self._made_storages: set = set()  # storages of the constants owned without a copy (_fresh_result)
        #: targets of get_attr and call_module nodes rewrites erased, and get_attr
        #: nodes they left without readers: what may now be unreferenced
        self.released_targets: set = set()
        self.released_nodes: list = []
        self._writes: bool | None = None  # whether some node writes in place (None: not asked yet)
        self._classes: dict = {}  # alias classes while the graph is unchanged (new_aliasing)
        self._rewirer = Rewirer(gm)  # readers of replaced values, wide ones without fx's rebuild
        self._readers = StrideReaders(gm, self._graph_writes)  # values whose layout a view may see (layout_change_seen)
        self._regions = Regions(gm.graph)  # grad-mode and autocast regions (dynamo's no_grad blocks)
        self._target_names: dict = {}  # id(target) -> (target, the node name fx derives from it)

    def _graph_writes(self) -> bool:
        """Whether some node of the graph writes an argument in place: asked once,
        then kept up to date with the nodes rewrites create (erased writers are not
        subtracted: a stale True only costs the full alias walk)."""
        if self._writes is None:
            self._writes = graph_writes(self.gm)
        elif not self._writes and any(written_args(n, self.gm) for n in self._created):
            self._writes = True
        return self._writes

    @functools.cached_property
    def _taken_names(self) -> set:
        """Attribute paths in use (computed on the first new constant or module)."""
        gm = self.gm
        names = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
        names |= {name for name, _ in gm.named_buffers(remove_duplicate=False)}
        names |= {name for name, _ in gm.named_modules(remove_duplicate=False)}
        return names

    # -- public

    def flush(self) -> None:
        """Write pending output arguments back (``rewrite.engine.rewire``): before
        the graph is run, printed, compiled or handed on."""
        self._rewirer.flush()

    def apply(self, match: Match) -> tuple:
        """Rewrite one match. Returns (new nodes, nodes whose users changed).

        A replacement that uses the root's own value (``conv(...) as c =>
        minmax_observer(c)``) is an *insertion*: it is built after the root, and the
        root's other users read its result; the root itself stays."""
        root = match.root
        self._created, self._new_attrs = [], []
        self._covered = match.nodes
        problem = self._regions.spanned(match.nodes, root, None)
        if problem is None and len(match.nodes) > 1 and self._graph_writes():
            problem = written_between(match.nodes, match.env, self.gm)
        if problem is not None:
            raise ReplacementError(f"rule {match.rule.name!r} at {root.name}: {problem}")
        if isinstance(match.rule.replacement, RResults):
            return self._apply_results(match)
        inserting = uses_root(match)
        try:
            with self.graph.inserting_before(root.next if inserting else root):
                result = self._build(match.rule.replacement, match.env, root)
        except Exception as err:
            self._undo()
            raise ReplacementError(f"rule {match.rule.name!r} at {root.name}: {err}") from err
        if not isinstance(result, fx.Node):
            self._undo()
            raise ReplacementError(f"rule {match.rule.name!r} did not produce a graph value")
        if result is not root and result in self._created and _same_call(result, root):
            self._undo()  # a rule that spells an op as the graph already does (mean(x, [1]) => mean(x, 1))
            raise Unchanged(f"rule {match.rule.name!r} at {root.name}: the replacement is the call it replaces")
        problem = self._kept_value_written()
        if problem is not None:
            self._undo()
            raise ReplacementError(f"rule {match.rule.name!r} at {root.name}: {problem}")
        if isinstance(result, fx.Node) and result.op == "call_module" and result in self._created:
            # an inserted module that stands for the root computes the root's value:
            # it has the root's shape and dtype (not its input's: a quantized conv)
            for key in ("val", FACTS_KEY):
                if key in root.meta:
                    result.meta[key] = root.meta[key]
        results = match.rule.pattern.results
        if results is not None and result is not root and result_count(result, self.facts) != len(results):
            self._undo()  # one call standing for all the results must have as many
            raise ReplacementError(f"rule {match.rule.name!r} at {root.name}: the replacement's number of "
                                   f"results is not known to be {len(results)}")
        if result is not root:
            problem = self._unlike_root(root, result) or self._narrowed_where_autocast_is_off(root)
            if problem is not None:
                self._undo()
                raise ReplacementError(f"rule {match.rule.name!r} at {root.name}: {problem}")
        if result is not root and result in self._created:
            try:
                self._first_operand_laid_out_as(root, result)
            except GuardOnDataDependentSymNode:  # sizes that depend on data: the operands stay as built
                pass
        relaid: dict = {}  # facts of the nodes whose layout the replacement changes
        if result is not root:
            problem = new_aliasing(root, result, self._created, self.gm, self._graph_writes(), self._classes,
                                   self._nbytes, self.facts.differentiated, self.facts.trained) \
                or self._lost_aliasing(root, result)
            if problem is None and result not in self._created:  # a value forwarded as it is
                problem = layout_change_seen(root, result, self.facts, self._readers, relaid=relaid) \
                    or self._regions.spanned((), root, result)
            elif problem is None:  # a new value: laid out as its root, if a reader depends on strides
                problem = layout_change_seen(root, result, self.facts, self._readers, self._created, relaid)
                if problem is None and self.facts.differentiated:
                    problem = newly_kept(root, result, self.gm, self.facts.trained)
            if problem is not None:
                self._undo()
                raise ReplacementError(f"rule {match.rule.name!r} at {root.name}: {problem}")
            self.facts.relay(relaid)
        if result is root:
            return (), ()
        self._classes.clear()  # the graph changes from here on
        for node in self._created:  # provenance, for rewrite.analysis and rewrite show
            node.meta[RULE_KEY] = (match.rule.name, match.rule.location)
        self.replaced.append((root, result))
        if inserting:
            created = set(self._created)
            users = [u for u in root.users if u not in created]
            self._rewirer.replace_uses(root, result, keep=lambda user: user not in created)
            self._readers.replaced(result, self._created)
            return tuple(self._created), tuple(users)
        self._rewirer.replace_uses(root, result)
        self._readers.replaced(result, self._created)
        touched = self._retire(match)
        return tuple(self._created), touched

    def _apply_results(self, match: Match) -> tuple:
        """A multi-output root replaced result by result: each ``getitem(root, i)``
        that is read is rewired to the replacement's ``i``-th value (the matcher
        made sure every read result has one), then the root and its getitems go."""
        root, items = match.root, match.rule.replacement.items
        relaid: dict = {}  # facts of the nodes whose layout the replacement changes
        read = {i: gs for i, gs in (getitem_users(root) or {}).items() if any(g.users for g in gs)}
        try:
            with self.graph.inserting_before(root):
                values = {i: self._build(items[i], match.env, root) for i in sorted(read)}
        except Exception as err:
            self._undo()
            raise ReplacementError(f"rule {match.rule.name!r} at {root.name}: {err}") from err
        for i, value in values.items():
            problem = None if isinstance(value, fx.Node) else f"value {i} is not a graph value"
            if problem is None and value not in self._created:
                problem = self._regions.spanned((), root, value)
            for getitem in read[i]:
                problem = problem or self._unlike_root(getitem, value)
                problem = problem or new_aliasing(getitem, value, self._created, self.gm, self._graph_writes(),
                                                  self._classes, self._nbytes, self.facts.differentiated,
                                                  self.facts.trained)
                if problem is None and (always_aliases(root, self.gm) or schema_returns_alias(root.target)):
                    # the pieces of a split, or of an op whose schema says they may be views: views
                    problem = lost_aliasing(getitem, value, self._created, self.gm, self._graph_writes(),
                                            self.facts.meta)
                if problem is None and value not in self._created:  # a value forwarded as it is
                    problem = layout_change_seen(getitem, value, self.facts, self._readers, relaid=relaid)
            if problem is not None:
                self._undo()
                raise ReplacementError(f"rule {match.rule.name!r} at {root.name}: {problem}")
        self._classes.clear()  # the graph changes from here on
        self.facts.relay(relaid)
        for node in self._created:
            node.meta[RULE_KEY] = (match.rule.name, match.rule.location)
        self.replaced.extend((getitem, value) for i, value in values.items() for getitem in read[i])
        for i, value in values.items():
            for getitem in read[i]:
                self._rewirer.replace_uses(getitem, value)
            self._readers.replaced(value, self._created)
        touched = self._retire(match)
        return tuple(self._created), touched

    def _kept_value_written(self) -> str | None:
        """``writes_kept_value`` of what was built, where the graph may be trained
        (only a replacement that writes in place is asked)."""
        if not any(written_args(node, self.gm) for node in self._created):
            return None
        return writes_kept_value(self._created, self.gm) if self.facts.differentiated else None

    def _lost_aliasing(self, root: fx.Node, result: fx.Node) -> str | None:
        """``lost_aliasing`` of a root that views other memory; one result of an op
        with several (``getitem(max(x, d), 0)``) is memory of its own unless the op
        is a view (``split``)."""
        if root.op == "call_function" and root.target is operator.getitem and isinstance(root.args[0], fx.Node) \
                and not always_aliases(root.args[0], self.gm) and result_count(root.args[0], self.facts):
            return None
        return lost_aliasing(root, result, self._created, self.gm, self._graph_writes(), self.facts.meta)

    # -- building

    def _build(self, r: Any, env: dict, root: fx.Node) -> Any:
        if isinstance(r, RVar):
            return self._as_graph_value(env[r.name])
        if isinstance(r, RLit):
            return r.value
        if isinstance(r, RSeq):
            return r.kind(self._build(i, env, root) for i in r.items)
        if isinstance(r, ROp):
            args = {name: self._build(v, env, root) for name, v in r.args.items()}
            emitter = r.opdef.emit.get(self.dialect) or r.opdef.emit.get("torch")
            target, call_args, call_kwargs = emitter(args, self._facts_of)
            _refuse_huge_integer(target, call_args)
            return self._node("call_function", target, call_args, call_kwargs, self._origin(r.opdef.name, root))
        if isinstance(r, RConst):
            args, kwargs = self._arguments(r, env)
            return self._constant_value(r.spec.fn(*args, **kwargs), r, env, (args, kwargs))
        if isinstance(r, RModule):
            inputs = tuple(self._build(i, env, root) for i in r.inputs)
            # tensors the module is built from are its own copies: the rewritten
            # model shares the input's parameters, and a module may train or
            # update what it holds (copy-on-write)
            config = {k: _own(self._evaluate(v, env)) for k, v in r.config.items()}
            module = r.spec.fn(**config)
            note_built_module(module, by_library=(getattr(r.spec.fn, "__module__", None) or "").startswith("rewrite."))
            name = self._fresh_name(f"{r.spec.name}_{root.name}")
            self.gm.add_submodule(name, module)
            self._new_attrs.append(name)
            node = self._node("call_module", name, inputs, {}, root)
            sources = {k: self._qualname(env, v) for k, v in r.config.items()}
            node.meta[SOURCES_KEY] = {k: q for k, q in sources.items() if q is not None}
            if inputs and isinstance(inputs[0], fx.Node) and keeps_shape(module):
                # an observer or a fake quantizer returns a tensor like its input; any
                # other module (a QAT conv) has its facts inferred by running it
                for key in ("val", FACTS_KEY):
                    if key in inputs[0].meta:
                        node.meta[key] = inputs[0].meta[key]
            return node
        raise TypeError(f"unknown replacement {r!r}")  # pragma: no cover

    def _as_graph_value(self, operand: Any) -> Any:
        if isinstance(operand, ConstRef):
            node = self.graph.get_attr(operand.qualname)
            self._created.append(node)
            return node
        return operand

    def _evaluate(self, r: Any, env: dict) -> Any:
        """Concrete value of a rewrite-time expression: constants are fetched from the
        module, nested functions called; no graph nodes are created."""
        if isinstance(r, RVar):
            return self.facts.constant_of(env[r.name])
        if isinstance(r, RLit):
            return r.value
        if isinstance(r, RSeq):
            return r.kind(self._evaluate(i, env) for i in r.items)
        if isinstance(r, RConst):
            args, kwargs = self._arguments(r, env)
            return r.spec.fn(*args, **kwargs)
        raise ValueError(f"{r!r} is not a rewrite-time constant")

    def _constant_value(self, value: Any, r: RConst, env: dict, arguments: Any) -> Any:
        """What a rewrite-time function returned, as the graph reads it: a tensor (also
        one in a list or tuple: the graph's code names no tensor inline) becomes a new
        constant; a number or a dtype stays a literal."""
        if isinstance(value, torch.Tensor):
            if value.is_meta or isinstance(value, FakeTensor):
                # the model would compute with memory nothing wrote (check=False: unseen)
                raise ValueError(f"{r.spec.name}() returned a {'meta' if value.is_meta else 'fake'} tensor, which "
                                 "holds no values: a constant holds what the model computes with")
            return self._new_constant(value, r, env, fresh=self._fresh_result(value, r, arguments))
        if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
            return type(value)(self._constant_value(v, r, env, arguments) for v in value)
        if not (type(value) in _PLAIN or isinstance(value, _CODE_LITERALS)) and value is not Ellipsis:
            # the graph's generated code would name it by its repr (a numpy array: NameError)
            raise ValueError(f"{r.spec.name}() returned a {type(value).__name__}, which the graph's code cannot "
                             "hold: return a tensor, a number, a string, a dtype or a list of them")
        return value

    def _arguments(self, r: RConst, env: dict) -> tuple[list, dict]:
        args = [self._evaluate(a, env) for a in r.args]
        kwargs = {k: self._evaluate(v, env) for k, v in r.kwargs.items()}
        if not _library_function(r.spec.fn):
            # a user's function gets copies: the model's own tensors (its weights)
            # are the caller's, and the function may write what it is given
            args, kwargs = _own(args), _own(kwargs)
        return args, kwargs

    def _fresh_result(self, value: torch.Tensor, r: RConst, arguments: Any) -> bool:
        """Whether ``value`` is memory no one else holds, which the new constant can
        own without a copy (a ResNet-50's folded weights: a third of the fold's time):
        made by one of this package's functions (a user's may keep what it returns)
        and sharing no storage with what it was given (``cast`` returns its argument
        when the dtype is already right, ``mat_weight`` a view) nor with a constant
        this rewrite made (each folded tensor is handed out once:
        ``rewrite.functions.builtins._memo_last``)."""
        mine = storage_key(value)  # None: no memory to share (empty, quantized, a subclass): copied
        if not _library_function(r.spec.fn) or mine is None or mine in self._made_storages:
            return False
        if any(storage_key(t) == mine for t in torch.utils._pytree.tree_leaves(arguments)
               if isinstance(t, torch.Tensor)):
            return False
        self._made_storages.add(mine)
        return True

    def _new_constant(self, tensor: torch.Tensor, r: RConst, env: dict, fresh: bool = False) -> fx.Node:
        source = next((self._qualname(env, a) for a in r.args if self._qualname(env, a)), None)
        base = f"{source}_{r.spec.name}" if source else r.spec.name
        name = self._fresh_name(re.sub(r"\W", "_", base.replace(".", "_")))
        requires_grad = from_parameter = False
        if source is not None:
            try:
                value = self.facts.constant_of(ConstRef(source))
            except AttributeError:
                value = None
            requires_grad = bool(getattr(value, "requires_grad", False))
            # a parameter of the input's, or one an earlier fold of this rewrite made
            # (a RepVGG block: conv_add_conv, then conv_add_bn on its weight)
            from_parameter = source in self.facts.param_names or isinstance(value, torch.nn.Parameter)
        tensor = tensor.detach() if fresh else tensor.detach().clone()
        # only floating-point and complex tensors can require grad (int8 weights cannot)
        requires_grad = requires_grad and (tensor.is_floating_point() or tensor.is_complex())
        if from_parameter:
            registered = torch.nn.Parameter(tensor, requires_grad=requires_grad)
            self.gm.register_parameter(name, registered)
        else:
            registered = tensor
            self.gm.register_buffer(name, tensor)
        self._new_attrs.append(name)
        node = self.graph.get_attr(name)  # facts come from the tensor itself
        self._created.append(node)  # before anything else can fail: _undo erases it
        # export/dynamo/Inductor graphs: every value carries a val (a quantized tensor has
        # no fake form, "quantized nyi in meta tensors": rewrite.quant's int8 weights)
        if self.facts.fake_mode is not None and not tensor.is_quantized:
            node.meta["val"] = self.facts.fake_of_constant(tensor, registered)
        return node

    @staticmethod
    def _qualname(env: dict, r: Any) -> str | None:
        if not isinstance(r, RVar):
            return None
        o = env.get(r.name)
        if isinstance(o, ConstRef):
            return o.qualname
        if isinstance(o, fx.Node) and o.op == "get_attr":
            return o.target
        return None

    def _fresh_name(self, base: str) -> str:
        name, i = base, 1
        while name in self._taken_names or hasattr(self.gm, name):
            name, i = f"{base}_{i}", i + 1
        self._taken_names.add(name)
        return name

    def _node(self, op: str, target: Any, args: tuple, kwargs: dict, root: fx.Node) -> fx.Node:
        if target is operator.pow and op == "call_function" and _negative_number(args[0] if args else None):
            target = builtins.pow  # fx prints operator.pow(-2, 2) as ``-2 ** 2``, which is -(2 ** 2)
        # the name fx would derive from the target (a regex per node), once per target
        name = by_identity(self._target_names, target, self.graph._target_to_str)
        node = self.graph.create_node(op, target, tuple(args), dict(kwargs), name=name)
        for key in _CARRIED_META:
            if key in root.meta:
                node.meta[key] = root.meta[key]
        if op in ("call_function", "call_module"):
            self.facts.new_node(node)
        self._created.append(node)
        return node

    def _origin(self, op: str, root: fx.Node) -> fx.Node:
        """The matched node a new ``op`` node stands for, whose source metadata
        (stack trace, module stack) it takes: the first covered node, root first,
        that binds as ``op`` (the conv of a conv+BN fold), else the root."""
        for node in self._covered:
            if any(b.op == op for b in self._bindings(node)):
                return node
        return root

    def _unlike_root(self, root: fx.Node, result: fx.Node) -> str | None:
        """Why ``result`` (new, or a value of the graph forwarded) cannot stand for
        ``root``: its shape, dtype or device is not known to be the root's (a rule whose
        replacement makes another shape, ``new_ones(x, [4])`` for ``neg(neg(x))``, or
        forwards an int64 ``h`` for ``h * 1.0``), or it cannot run at all (shapes
        that do not broadcast), which with ``check=False`` nothing else would catch.
        Asked only where the root's facts are already known (export and dynamo graphs,
        a graph whose facts were recorded): its result's are then inferred now rather
        than at the end of the rewrite. None when nothing is known to differ."""
        want = tensor_meta_of(root)
        if isinstance(want, (list, tuple)):  # a multi-output root replaced by one multi-output call
            got = self.facts.meta(result, record=False)
            got = tensor_meta_of(result) if got is None else got
            if not isinstance(got, (list, tuple)):
                return self._refused_inference(result)
            if len(got) != len(want):
                return f"{UNLIKE_ROOT}it has {len(got)} results, the root {len(want)}"
            return next((p for w, g in zip(want, got) if (p := _unlike(w, g)) is not None), None)
        if not isinstance(getattr(want, "dtype", None), torch.dtype) or getattr(want, "shape", None) is None:
            return None
        got = self.facts.meta(result, record=False)
        if got is None:
            return self._refused_inference(result)
        return _unlike(want, got)

    def _narrowed_where_autocast_is_off(self, root: fx.Node) -> str | None:
        """Why a replacement may not stand: it newly computes in a half precision inside
        a block the model runs with ``torch.autocast(..., enabled=False)``, which keeps
        that part in float32 on purpose (an AMP rule set would lower it, where
        ``torch.autocast`` does not). None elsewhere, and where the root itself is half."""
        if not self._regions.autocast_disabled(root):
            return None
        want = tensor_meta_of(root)
        if getattr(want, "dtype", None) in _HALF:
            return None
        for node in self._created:
            got = self.facts.meta(node, record=False) if not node._erased else None
            if getattr(got, "dtype", None) in _HALF:
                return (f"it computes in {got.dtype} inside a block the model runs with autocast disabled "
                        "(torch.autocast(..., enabled=False) keeps it in float32)")
        return None

    def _refused_inference(self, result: fx.Node) -> str | None:
        failed = self.facts.inference_error(result)
        return None if failed is None else f"{UNLIKE_ROOT}it cannot be computed on the root's inputs: {failed}"

    def _first_operand_laid_out_as(self, root: fx.Node, result: fx.Node) -> None:
        """A new ``a + b`` or ``a * b`` of operands laid out differently is laid out as
        its first one (TensorIterator); a pattern matched commutatively (``add(x, y)``
        binding ``x`` to the root's second operand) builds it with the operands
        swapped. Put the operand laid out as the root first: the same values, and the
        root's layout (a reader downstream may ``view`` it)."""
        if result.op != "call_function" or result.target not in _COMMUTATIVE or len(result.args) != 2 \
                or result.kwargs:
            return
        a, b = result.args
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
            return
        metas = [self.facts.meta(root, record=False)]
        if getattr(metas[0], "shape", None) is None:
            return  # nothing recorded to keep (operands' facts are not inferred for it)
        metas += [self.facts.meta(n, record=False) for n in (a, b)]
        if any(getattr(m, "shape", None) is None for m in metas):
            return
        want, first, second = (addressing(m) for m in metas)  # None for symbolic sizes or strides
        if want is None or any(tuple(m.shape) != tuple(metas[0].shape) for m in metas):
            return
        if first != want and second == want:
            result.args = (b, a)
            for key in ("val", FACTS_KEY):  # inferred with the operands as they were
                result.meta.pop(key, None)

    def _nbytes(self, node: fx.Node) -> Any:
        """The bytes of ``node``'s value from its facts: a number, a sympy expression
        over a symbolic shape's sizes (read from the SymInts, not asked: asking
        would guard the graph on them), or None when unknown."""
        meta = self.facts.meta(node)
        shape, dtype = getattr(meta, "shape", None), getattr(meta, "dtype", None)
        if shape is None or not isinstance(dtype, torch.dtype):
            return None
        sizes = []
        for n in shape:
            if type(n) is int:
                sizes.append(n)
            elif isinstance(n, torch.SymInt):
                sizes.append(n.node.expr)
            else:
                return None
        return math.prod(sizes) * dtype.itemsize

    def _facts_of(self, value: Any) -> Any:
        # Known facts only: new nodes of a graph nobody asked shapes about need none.
        return self.facts.meta(value, record=False) if isinstance(value, (fx.Node, ConstRef)) else None

    # -- retiring and undo

    def _retire(self, match: Match) -> tuple:
        """Erase matched nodes left without users; return nodes whose use counts
        changed (the producers of what was erased), for the worklist."""
        touched = []
        pending = list(match.nodes)  # pattern order: users first; a node read twice (a name the
        while pending:  # pattern writes again) may meet a reader still to be erased: retry those
            left = []
            for node in pending:
                if node._erased:  # fx keeps node.graph set on erased nodes
                    continue
                for user in list(node.users):
                    if user.target is operator.getitem and not user.users:
                        self.graph.erase_node(user)
                if all(is_metadata_check(u) for u in node.users):  # nothing reads it: its checks go too
                    for user in list(node.users):
                        self.graph.erase_node(user)
                if node.users:
                    left.append(node)
                else:
                    for n in node.all_input_nodes:
                        touched.append(n)
                        if n.op == "get_attr":
                            self.released_nodes.append(n)
                    if node.op in ("get_attr", "call_module"):
                        self.released_targets.add(node.target)
                    self.graph.erase_node(node)
            if len(left) == len(pending):
                break
            pending = left
        return tuple(n for n in touched if not n._erased)

    def _undo(self) -> None:
        if self._created:
            self._classes.clear()
        for node in reversed(self._created):
            if not node.users:
                self.graph.erase_node(node)
        for name in self._new_attrs:
            delattr(self.gm, name)
        self._created, self._new_attrs = [], []


def _unlike(want: Any, got: Any) -> str | None:
    """How a value's facts ``got`` are known to differ from ``want``'s, or None. While
    a dynamo graph traced under ``torch.autocast`` is rewritten (``rewrite.backend``
    keeps the caller's autocast on), a float32 against a half precision is no
    difference: the graph records its ops' narrowed dtypes, which a new op's facts,
    inferred outside autocast, do not show (the check compares what they compute)."""
    if got is want:  # a value of the graph forwarded for itself (the common case: asked per replacement)
        return None
    want_dtype, got_dtype = getattr(want, "dtype", None), getattr(got, "dtype", None)
    want_shape, got_shape = getattr(want, "shape", None), getattr(got, "shape", None)
    if not (isinstance(want_dtype, torch.dtype) and isinstance(got_dtype, torch.dtype)) \
            or want_shape is None or got_shape is None:
        return None
    if got_dtype != want_dtype and not ({got_dtype, want_dtype} <= _AUTOCAST_PAIRS and _autocast_on()):
        return f"{UNLIKE_ROOT}its dtype {got_dtype} is not the root's {want_dtype}"
    want_device, got_device = getattr(want, "device", None), getattr(got, "device", None)
    if got_device is not None and want_device is not None and got_device != want_device:
        return f"{UNLIKE_ROOT}its device {got_device} is not the root's {want_device}"
    want_layout, got_layout = getattr(want, "layout", None), getattr(got, "layout", None)
    if got_layout is not None and want_layout is not None and got_layout != want_layout:
        return f"{UNLIKE_ROOT}its layout {got_layout} is not the root's {want_layout}"
    if not (getattr(want, "_has_symbolic_sizes_strides", True) or getattr(got, "_has_symbolic_sizes_strides", True)):
        differ = got_shape != want_shape  # plain sizes (the common case): compared at once
    else:
        differ = len(got_shape) != len(want_shape) or any(
            (a != b) if (a.__class__ is int and b.__class__ is int) else sizes_differ(a, b)
            for a, b in zip(got_shape, want_shape))
    if differ:
        return f"{UNLIKE_ROOT}its shape {list(got_shape)} is not the root's {list(want_shape)}"
    return None


def _autocast_on() -> bool:
    return any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))


#: the half precisions a block with autocast disabled is kept out of
_HALF = frozenset({torch.bfloat16, torch.float16})

#: dtypes autocast turns into each other (``_unlike``)
_AUTOCAST_PAIRS = frozenset({torch.float32, torch.bfloat16, torch.float16})


def _negative_number(value: Any) -> bool:
    """A literal number fx's generated code would print with a leading minus sign
    (``-2``, ``-0.0``, ``-inf``): as the base of ``**`` it would bind after the power."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.copysign(1, value) < 0
