"""Outputs keep their memory layout.

A rewrite may change how an output is laid out while keeping its values: removing a
copy that made it contiguous, or computing it in channels_last (the AMP files store
convolution weights channels_last, and the layout follows the activations to the
output). The caller sees that (``out.view(-1)`` fails, ``out.is_contiguous()``
changes), so after the rules have run, an output that was contiguous (or
channels_last) and no longer is gets one copy back into that layout, right before
the graph returns it. Inside the graph the layout is free: ops compute the same
values whatever the strides, except the readers that need them (``view``, which
fails on strides it cannot reinterpret; ``stride()``, ``as_strided``): a rewrite
that forwards an existing value of another layout to such a reader (an identity
that drops a copy) is refused (``layout_change_seen``). Values a replacement
computes anew are left to the rules (the AMP files lower such a ``view`` to a
``reshape``) and to the check.

Layouts are read from the facts nodes carry (FakeTensor ``val``, or the
``contiguous`` flag of recorded ``TensorFacts``); an output whose layout is unknown
on either side is left as it is.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from rewrite.engine.aliasing import caller_owned, memory_observed, storage_base
from rewrite.engine.facts import GraphFacts, fetch_attr, tensor_meta_of
from rewrite.engine.shapes import addressing, layout_of, symbolic_dense_order, symbolic_strides
from rewrite.ops.effects import may_alias, op_name, written_nodes
from rewrite.ops.vocabulary import bind_node

__all__ = ["StrideReaders", "layout_change_seen", "output_values", "restore_output_layouts"]

_KEPT_WALK = 4096  # nodes looked at, over all outputs, for kept values a rewrite may have relaid
#: ops whose result is laid out by the op alone, whatever its inputs' layouts (a
#: convolution or a batch norm follows its input's memory format)
_OWN_LAYOUT = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "embedding", "contiguous"})


_FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last,
            "channels_last_3d": torch.channels_last_3d}


def output_values(gm: fx.GraphModule) -> list:
    """The nodes the graph returns, in output order (what ``restore_output_layouts``
    compares against after the rewrite)."""
    out = next((n for n in reversed(gm.graph.nodes) if n.op == "output"), None)
    if out is None:
        return []
    found: list = []
    fx.node.map_arg(out.args, found.append)
    return found


def _has_strided_constants(gm: fx.GraphModule, created: set) -> bool:
    """Whether a tensor the rewrite's new nodes read through get_attr is not
    contiguous (the AMP files' channels_last weights): then new values' layouts
    cannot be inferred."""
    seen: set = set()
    for node in created:
        for constant in node.all_input_nodes:
            if constant.op != "get_attr" or constant in seen:
                continue
            seen.add(constant)
            value = fetch_attr(gm, constant.target)
            if isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_contiguous():
                return True
    return False


def _new_module_reach(created: set, gm: fx.GraphModule) -> "_MadeThrough":
    """Whether a node is computed, through nodes the rewrite created, from a module
    call it inserted (a quantized conv): such a value's recorded facts are the value
    it replaced (shape and dtype), its layout is whatever the module's kernel picks.
    Observers and fake quantizers return their input as it is: they pick nothing.
    One answer per node for the whole restore (rewrites that read each other's
    results, a residual stream's adds, chain thousands of created nodes)."""
    from torch.ao.quantization import FakeQuantizeBase, ObserverBase

    def picks_layout(n: fx.Node) -> bool:
        return n.op == "call_module" and not isinstance(fetch_attr(gm, n.target), (ObserverBase, FakeQuantizeBase))

    return _MadeThrough(created, picks_layout)


class _MadeThrough:
    """Whether a node of the rewrite's ``created`` ones that a node is computed from
    (the node included, through created nodes only) satisfies ``made_by``. Each
    node's answer is kept: asked of every node of a chain, the chain is walked once."""

    def __init__(self, created: set, made_by: Any) -> None:
        self.created, self.made_by = created, made_by
        self.known: dict = {}

    def __call__(self, node: fx.Node) -> bool:
        created, known = self.created, self.known
        if node not in created:
            return False
        stack = [(node, False)]
        while stack:
            n, inputs_done = stack.pop()
            if n in known:
                continue
            if inputs_done:
                known[n] = any(known.get(i, False) for i in n.all_input_nodes)
            elif self.made_by(n):
                known[n] = True
            else:
                stack.append((n, True))
                stack.extend((i, False) for i in n.all_input_nodes if i in created and i not in known)
        return known[node]


def restore_output_layouts(gm: fx.GraphModule, facts: GraphFacts, before: list, dialect: str,
                            created: Any, replaced: Any = (), forced: Any = None) -> list:
    """Copy each output whose layout the rewrite changed back into the layout it had
    (``before``: ``output_values`` of the graph before the rewrite, same order;
    ``created``: the nodes the rewrite created; ``replaced``: (value, what its
    readers read instead) per rewrite; ``forced``: output leaf index -> the memory
    format the original's run gave it, where the equivalence check found the
    recorded layouts wrong: a fake kernel lays out a batch norm of a strided input as
    its input, the CPU kernel contiguously).
    Returns the nodes created. Runs before ``GraphFacts.settle``, while new nodes'
    facts can still be inferred."""
    after = output_values(gm)
    if len(after) != len(before):
        return []
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    created_nodes = set(created)
    copies, fixed = [], {}
    bases, shared = None, set()
    strided_constants = _has_strided_constants(gm, created_nodes)
    from_new_module = _new_module_reach(created_nodes, gm)
    picker = _layout_picker_reach(created_nodes)
    kept = _KeptValues(gm, _relaid_sources(replaced, facts, created_nodes, strided_constants, from_new_module,
                                           picker))
    for old, new in zip(before, after):
        if new in fixed:
            continue
        old_meta = tensor_meta_of(old)
        want = layout_of(old_meta)
        order = _dense_order(old_meta) if want == "strided" else None
        if want == "strided" and order is None and addressing(old_meta) is not None:
            # with gaps (a slice): kept, else made compact (contiguous), which every
            # view of the original's still reinterprets
            want, gaps = "contiguous", addressing(old_meta)
        elif want not in _FORMATS and order is None:
            continue
        else:
            gaps = None
        # a value computed from a replacement's result laid out otherwise, through ops
        # that carry their input's layout on, has its layout inferred again: a value
        # of the original graph (``y.unsqueeze(0)`` once a rule dropped the
        # ``contiguous()`` that made ``y``) or one an earlier rewrite created (an
        # observer inserted on an add that a later rule rebuilt with its operands
        # swapped): what either recorded was true before that replacement
        relaid = kept.relaid(new)
        if relaid:
            known = not strided_constants and not any(from_new_module(n) or picker(n)
                                                      for n in kept.read(relaid)) \
                and not any(_layout_not_inferable(n, gm) for n in relaid)
            if new in created_nodes:
                known = known and not from_new_module(new) \
                    and not _meta_layout_unreliable(new, created_nodes, facts, picker)
            new_meta = facts.rerun(relaid).get(new) if known else None
            if _laid_out_as(new_meta, old_meta, want, order, gaps):
                continue
            # unknown: copied (at no cost if laid out so already)
        elif new not in created_nodes:
            # a value of the original graph no new value reaches so: its recorded
            # layout is what it computes (or too far to tell: the check compares strides)
            new_meta = tensor_meta_of(new)
            if old is new or layout_of(new_meta) is None or _laid_out_as(new_meta, old_meta, want, order, gaps):
                continue
        else:
            # a new value: its layout is inferred on meta tensors, whose kernels do not
            # choose layouts as CPU kernels do (a channels_last weight gives a
            # channels_last convolution on CPU, a contiguous one on meta)
            inferred = facts.meta(new, record=False)
            if not strided_constants and _laid_out_as(inferred, old_meta, want, None, gaps) \
                    and not from_new_module(new) and not _meta_layout_unreliable(new, created_nodes, facts, picker):
                continue
            # unknown (a quantized kernel's output, channels_last on CPU): the copy
            # costs nothing when the value is laid out so already
        if bases is None:
            bases = Counter(storage_base(v, gm) for v in set(after))
        base = storage_base(new, gm)
        if caller_owned(base):
            continue  # a copy would end the memory it shares with an input
        if bases[base] > 1:  # a copy would end the memory it shares with another output
            shared.add(base)
            continue
        with gm.graph.inserting_before(out_node):
            made = _relaid(gm.graph, new, want, order, dialect)
        _note_copies(made, new, facts)
        fixed[new] = made[-1]
        copies.extend(made)
    for new, copy in fixed.items():
        out_node.replace_input_with(new, copy)  # through the replace hooks: an undo journal sees it
    for base in shared:
        copies.extend(_relaid_at_source(gm, facts, base, dict(zip(after, before)), replaced, kept.sources,
                                        created_nodes, dialect))
    if forced:
        copies.extend(_forced_layouts(gm, facts, forced, dialect))
    return copies


def _relaid_at_source(gm: fx.GraphModule, facts: GraphFacts, base: fx.Node, was: dict, replaced: Any,
                      sources: set, created: set, dialect: str) -> list:
    """Outputs that share memory (``return out, out.transpose(1, 2)``) and whose
    layout a replacement changed cannot be copied one by one, which would end their
    sharing: the replacement's result they all view is copied instead, into the
    layout of the original value it replaced (``out``'s matmul, once sdpa, which lays
    its result out as its query, computes it), and each output, a view of it, is
    laid out as it was: through the original graph's own views, or, where a rule
    rebuilt a view (transformer.rw's ``transpose(2, 3)`` as ``transpose(-2, -1)``), as
    its facts, inferred again from the copy's, show (else the copy is taken back).
    Nothing when the outputs do not all view one such result, or the original layout
    is not one a copy makes. ``was``: each output -> the original's. Returns the
    nodes created."""
    origin = {result: root for root, result in replaced}
    sharing = [v for v in was if storage_base(v, gm) is base]
    for result in sources:
        paths = {v: _view_path(v, result, gm) for v in sharing} if not result._erased else {}
        if not paths or storage_base(result, gm) is not base or any(p is None for p in paths.values()):
            continue
        root = origin.get(result)
        while root in created and root in origin:  # a result a later rule replaced again
            root = origin[root]
        if root is None or root in created:
            return []
        old_meta = tensor_meta_of(root)
        want = layout_of(old_meta)
        order = _dense_order(old_meta) if want == "strided" else None
        if want not in _FORMATS and order is None:
            return []
        # before the node after it: inserting_after(result) would put each new node
        # right after result, so a copy of several nodes (permute, contiguous, permute)
        # would read nodes defined after it
        with gm.graph.inserting_before(result.next):
            made = _relaid(gm.graph, result, want, order, dialect)
        _note_copies(made, result, facts)
        keep = set(made)
        result.replace_all_uses_with(made[-1], delete_user_cb=lambda user: user not in keep)
        if all(_laid_out_as_was(facts, made[-1], old_meta, path, was[v]) for v, path in paths.items()
               if any(n in created for n in path)):
            return made
        made[-1].replace_all_uses_with(result)  # a rebuilt view lays it out otherwise, or nobody can tell
        for node in reversed(made):
            gm.graph.erase_node(node)
        return []
    return []


def _view_path(value: fx.Node, result: fx.Node, gm: fx.GraphModule) -> list | None:
    """The nodes from ``result`` (excluded) to ``value``, inputs first, when
    ``value`` is ``result`` or a view of it, each node a view of its first argument;
    else None."""
    path: list = []
    while value is not result:
        first = value.args[0] if value.args else None
        if len(path) > _KEPT_WALK or not isinstance(first, fx.Node) or not value.op.startswith("call_") \
                or not may_alias(value, gm):
            return None
        path.append(value)
        value = first
    return path[::-1]


def _laid_out_as_was(facts: GraphFacts, copy: fx.Node, copy_meta: Any, path: list, old: fx.Node) -> bool:
    """Whether the last node of ``path`` (views of ``copy``, laid out as
    ``copy_meta``) is, inferred again, laid out as the original's output ``old``."""
    if not path:
        return True
    fresh = facts.rerun(path, given={copy: copy_meta}).get(path[-1])
    old_meta = tensor_meta_of(old)
    want = layout_of(old_meta)
    return fresh is not None and want is not None and _laid_out_as(fresh, old_meta, want, None) \
        and addressing(fresh) == addressing(old_meta)


def _note_copies(made: list, value: fx.Node, facts: GraphFacts) -> None:
    """New nodes copying ``value``: its source position, and facts to infer (their
    val comes with the other new nodes', ``GraphFacts.settle``)."""
    for node in made:
        for key in ("stack_trace", "nn_module_stack"):
            if key in value.meta:
                node.meta[key] = value.meta[key]
        facts.new_node(node)


def _forced_layouts(gm: fx.GraphModule, facts: GraphFacts, forced: dict, dialect: str) -> list:
    """Each output leaf of ``forced`` copied into its memory format (at no cost
    when laid out so already), unless the copy would end memory it shares with
    another output or an input."""
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    leaves = pytree.tree_leaves(out_node.args[0]) if out_node.args else []
    after = output_values(gm)
    bases = Counter(storage_base(v, gm) for v in set(after))
    copies, fixed = [], {}
    for index, want in sorted(forced.items()):
        new = leaves[index] if index < len(leaves) else None
        if not isinstance(new, fx.Node) or new in fixed or want not in _FORMATS:
            continue
        base = storage_base(new, gm)
        if bases[base] > 1 or caller_owned(base):
            continue
        with gm.graph.inserting_before(out_node):
            made = _relaid(gm.graph, new, want, None, dialect)
        for node in made:
            facts.new_node(node)
        fixed[new] = made[-1]
        copies.extend(made)
    for new, copy in fixed.items():
        out_node.replace_input_with(new, copy)
    return copies


def _laid_out_as(meta: Any, old_meta: Any, want: str, order: tuple | None, gaps: tuple | None = None) -> bool:
    """``meta`` is laid out as ``want`` (``old_meta``'s layout), in ``old_meta``'s
    strides for a permuted dense layout (``order``); or, for a layout with gaps,
    in those strides (``gaps``)."""
    if gaps is not None and meta is not None and addressing(meta) == gaps:
        return True
    return layout_of(meta) == want and (order is None or addressing(meta) == addressing(old_meta))


def _relaid_sources(replaced: Any, facts: GraphFacts, created: set, strided_constants: bool,
                    from_new_module: Any, picker: Any) -> set:
    """The values readers read instead of a replaced value laid out otherwise (or not
    known to be laid out alike: a new value computed from a strided constant, an
    inserted module or an op whose CPU kernel picks its layout (``picker``: sdpa lays
    its output out as its query, its fake and meta kernels contiguously): what may
    change the layout of kept values."""
    sources: set = set()
    for root, result in replaced:
        if result._erased or result in sources:
            continue
        if result in created:
            if strided_constants or from_new_module(result) or picker(result):
                sources.add(result)
                continue
        before, after = tensor_meta_of(root), facts.meta(result, record=False)
        if before.__class__ is after.__class__ and getattr(before, "stride", None) is not None:
            try:
                if before.stride() == after.stride() and before.shape == after.shape:
                    continue  # the common case, quickly: laid out alike
            except (TypeError, RuntimeError, NotImplementedError):  # recorded facts, symbolic strides
                pass
        if layout_of(before) is None:
            continue  # nothing recorded to keep
        if layout_of(after) != layout_of(before) or addressing(after) != addressing(before):
            sources.add(result)
    return sources


class _KeptValues:
    """Which values of the original graph a rewrite's new nodes reach through ops
    that carry their input's layout on (views, elementwise ops, clones, casts,
    convolutions and norms: not ``_OWN_LAYOUT``), worked out once over all outputs,
    ``_KEPT_WALK`` nodes at most."""

    def __init__(self, gm: fx.GraphModule, sources: set) -> None:
        self.gm, self.sources = gm, sources
        self.reached: dict = {}  # node -> whether new nodes reach it so
        self.budget = _KEPT_WALK

    def relaid(self, node: fx.Node) -> list | bool | None:
        """False: ``node`` keeps the layout it had (no new node reaches it so); else
        the nodes from the new ones to ``node`` (in graph order, ``node`` last) to infer
        again; None: too far to tell."""
        if not self.sources:
            return False
        stack = [(node, False)]
        while stack:
            n, inputs_done = stack.pop()
            if n in self.reached:
                continue
            if inputs_done:
                self.reached[n] = any(i in self.sources or self.reached.get(i, False) for i in n.all_input_nodes)
                continue
            if n.op in ("placeholder", "get_attr") or _lays_out_own(n, self.gm):
                self.reached[n] = False
                continue
            self.budget -= 1
            if self.budget < 0:
                return None
            stack.append((n, True))
            stack.extend((i, False) for i in n.all_input_nodes if i not in self.reached and i not in self.sources)
        if not self.reached[node]:
            return False
        order: list = []
        seen: set = set()
        stack = [(node, False)]
        while stack:  # the reached nodes upstream of ``node``, inputs first
            n, inputs_done = stack.pop()
            if inputs_done:
                order.append(n)
            elif n not in seen:
                seen.add(n)
                stack.append((n, True))
                stack.extend((i, False) for i in n.all_input_nodes if self.reached.get(i, False) and i not in seen)
        return order

    def read(self, nodes: list) -> list:
        """The sources ``nodes`` read."""
        return [i for n in nodes for i in n.all_input_nodes if i in self.sources]


def _relaid(graph: fx.Graph, value: fx.Node, want: str, order: tuple | None, dialect: str) -> list:
    """Nodes computing ``value`` laid out as ``want`` (a memory format), or, for a
    permuted dense layout (``order``: dims from outermost to innermost), as
    ``value.permute(order).contiguous().permute(inverse)``. ``contiguous()`` copies
    only when the value is not laid out so already."""
    def call(name: str, *args: Any, **kwargs: Any) -> fx.Node:
        if dialect == "aten":
            return graph.call_function(getattr(torch.ops.aten, name).default, args, kwargs)
        return graph.call_method(name, args, kwargs)

    if order is None:
        return [call("contiguous", value, memory_format=_FORMATS[want])]
    inverse = [0] * len(order)
    for position, dim in enumerate(order):
        inverse[dim] = position
    permuted = call("permute", value, list(order))
    dense = call("contiguous", permuted)
    return [permuted, dense, call("permute", dense, inverse)]


def _dense_order(meta: Any) -> tuple | None:
    """For a value laid out densely in some order of its dimensions (a transposed or
    permuted view of a contiguous tensor: ``x.flatten(2).transpose(1, 2)``), that
    order, outermost first; None for other layouts (slices, broadcasts) or unknown
    strides (symbolic ones only where they are that order's at every size:
    ``symbolic_dense_order``)."""
    strides = addressing(meta)
    if strides is None:
        symbolic = isinstance(meta, torch.Tensor) and meta.layout == torch.strided and symbolic_strides(meta)
        return symbolic_dense_order(meta) if symbolic else None
    shape = [int(n) for n in meta.shape]
    order = sorted(range(len(shape)), key=lambda d: (-(strides[d] or 0), d))
    expected = 1
    for dim in reversed(order):
        if shape[dim] > 1:
            if strides[dim] != expected:
                return None
            expected *= shape[dim]
    return tuple(order)


#: Readers whose result depends on their first argument's strides, not only on its
#: values: a view cannot reinterpret every layout; the others report or use them.
STRIDE_READERS = frozenset({
    "view", "_unsafe_view", "view_as", "unflatten", "view_as_real", "view_as_complex", "as_strided",
    "stride", "is_contiguous", "is_non_overlapping_and_dense", "dim_order", "data_ptr", "storage_offset",
    "untyped_storage", "storage",
})
#: readers of strides that compute the same values on any layout they accept (and
#: raise on one they cannot reinterpret): inferred again on the new layout
_VIEWS = frozenset({"view", "_unsafe_view", "view_as", "unflatten", "view_as_real", "view_as_complex"})
#: ops whose result is a view of their input or a copy, depending on its layout: a
#: new layout may end (or start) the sharing, which writes in place and outputs see
_MAY_COPY = frozenset({"reshape", "flatten", "reshape_as", "ravel", "contiguous"})


#: ops whose CPU kernel lays its result out otherwise than the meta kernel facts are
#: inferred with on graphs without a fake mode (attention follows q's layout on CPU)
_CPU_PICKS_LAYOUT = frozenset({"scaled_dot_product_attention"})


def _meta_layout_unreliable(node: fx.Node, created: set, facts: GraphFacts, picker: Any = None) -> bool:
    """``node``'s inferred layout comes from meta kernels (no fake mode) through a new
    op whose CPU kernel picks another (``_CPU_PICKS_LAYOUT``). ``picker``: a
    ``_layout_picker_reach(created)`` kept over many questions."""
    if facts.fake_mode is not None:
        return False
    return picker(node) if picker is not None else _through_layout_picker(node, created)


def _picks_cpu_layout(n: fx.Node) -> bool:
    return n.op in ("call_function", "call_method") and op_name(n.target) in _CPU_PICKS_LAYOUT


def _layout_picker_reach(created: set) -> _MadeThrough:
    """Whether a node is computed, through new nodes, by an op of ``_CPU_PICKS_LAYOUT``
    (one answer per node)."""
    return _MadeThrough(created, _picks_cpu_layout)


def _through_layout_picker(node: fx.Node, created: set) -> bool:
    """``node`` is computed, through new nodes, by an op of ``_CPU_PICKS_LAYOUT``."""
    return _MadeThrough(created, _picks_cpu_layout)(node)


def _carries_layout(node: fx.Node, gm: fx.GraphModule) -> bool:
    """A call whose result's layout may follow its inputs' (clones, elementwise ops,
    views, convolutions, module calls): any call but ``_OWN_LAYOUT`` ones (an
    ``nn.Linear`` is ``linear`` here too)."""
    if node.op == "call_module":
        return not _lays_out_own(node, gm)
    return node.op in ("call_function", "call_method") and op_name(node.target) not in _OWN_LAYOUT


def _lays_out_own(node: fx.Node, gm: fx.GraphModule) -> bool:
    """``node`` computes an ``_OWN_LAYOUT`` op (by the vocabulary's binding, so a
    module call counts as the op it is)."""
    return any(b.op in _OWN_LAYOUT for b in bind_node(node, gm))


def _reads_strides(node: fx.Node) -> fx.Node | None:
    """The value whose strides ``node`` depends on (a ``STRIDE_READERS`` call's
    first argument), or None."""
    if node.op in ("call_function", "call_method") and node.args and isinstance(node.args[0], fx.Node) \
            and op_name(node.target) in STRIDE_READERS:
        return node.args[0]
    return None


class StrideReaders:
    """Which values of a graph a reader of strides may see the layout of: read
    directly (``t.view(-1)``, ``t.add_(1)``: a write in place needs a layout
    without overlap; an opaque call, which ``written_nodes`` counts as writing
    every argument) or through ops that carry it on
    (``t.clone().view(-1)``, ``t.relu().view(-1)``; not through ``_OWN_LAYOUT``
    ones such as ``matmul``). Worked out on the first question (one walk up from
    every reader), then kept up to date with each replacement (``replaced``): a
    superset, since edges rewrites remove are not subtracted. ``writes()``: whether
    the graph writes in place at all (writers are looked for only then)."""

    def __init__(self, gm: fx.GraphModule, writes: Any) -> None:
        self.gm, self.writes = gm, writes
        self._seen: dict | None = None  # value -> a reader that may see its layout

    def reader_of(self, value: fx.Node) -> fx.Node | None:
        """A reader of strides that may see ``value``'s layout, or None."""
        if self._seen is None:
            self._seen = {}
            for node in self.gm.graph.nodes:
                self._note(node)
        return self._seen.get(value)

    def sees(self, user: fx.Node, value: fx.Node) -> bool:
        """``user`` depends on ``value``'s layout itself, whatever its values: a
        reader of strides other than a view (which is inferred again), or a write."""
        if _reads_strides(user) is value and op_name(user.target) not in _VIEWS:
            return True
        return self.writes() and value in written_nodes(user, self.gm)

    def replaced(self, result: fx.Node, created: Any) -> None:
        """``result`` (and the ``created`` nodes computing it) took a replaced value's
        readers: what those readers may see they may see now."""
        if self._seen is None:
            return
        created = list(created)
        for node in created:
            self._note(node)
        for node in reversed([*created, result]):  # readers before what they read
            reader = next((r for u in node.users if (r := self._reader_through(u, node)) is not None), None)
            if reader is not None:
                self._spread(node, reader)

    def _reader_through(self, user: fx.Node, value: fx.Node) -> fx.Node | None:
        if _reads_strides(user) is value or (self.writes() and value in written_nodes(user, self.gm)):
            return user
        return self._seen.get(user) if _carries_layout(user, self.gm) else None

    def _note(self, node: fx.Node) -> None:
        read = _reads_strides(node)
        if read is not None:
            self._spread(read, node)
        if self.writes():
            for value in written_nodes(node, self.gm):
                self._spread(value, node)

    def _spread(self, value: fx.Node, reader: fx.Node) -> None:
        seen, stack = self._seen, [value]
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen[node] = reader
            if _carries_layout(node, self.gm):
                stack.extend(node.all_input_nodes)


_FOLLOW_BUDGET = 256  # ops inferred again, per replacement, following a layout change


def _placement(meta: Any) -> tuple | None:
    """(shape, strides, storage offset) of a tensor or of recorded facts, or None
    when not known."""
    if isinstance(meta, torch.Tensor):
        try:
            return tuple(meta.shape), tuple(meta.stride()), meta.storage_offset()
        except (RuntimeError, NotImplementedError):  # symbolic strides, no storage
            return None
    stride, offset = getattr(meta, "stride", None), getattr(meta, "storage_offset", None)
    if stride is None or offset is None or callable(stride):
        return None
    return tuple(meta.shape), tuple(stride), offset


def _same_strides(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are known to have the same shape, strides and storage offset."""
    if a.__class__ is b.__class__ and isinstance(a, torch.Tensor):  # two FakeTensors: the common case, quickly
        try:
            return a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
        except (RuntimeError, NotImplementedError):  # symbolic strides, no storage
            return False
    placed = _placement(a)
    return placed is not None and placed == _placement(b)


def _sharing_seen(node: fx.Node, gm: fx.GraphModule, writes: bool) -> bool:
    """Whether the caller may see ``node`` (a ``_MAY_COPY`` op) start or stop sharing
    its input's memory: the memory is the caller's own (an input, a parameter),
    something writes into it in place, or two outputs share it (the caller's write
    to one shows in the other)."""
    base = storage_base(node, gm)
    return caller_owned(base) or memory_observed(base, gm, writes)


#: ops whose CPU kernel lays a strided (channels_last, transposed) input's result out
#: otherwise than their meta/fake kernel, which facts are inferred with: a change of
#: layout cannot be followed through them
_CPU_LAYOUT_DIFFERS = frozenset({"roll", "group_norm", "native_group_norm", "pixel_shuffle", "pixel_unshuffle",
                                 "channel_shuffle", "native_channel_shuffle"})


def _layout_not_inferable(node: fx.Node, gm: fx.GraphModule) -> bool:
    """``node`` is an op of ``_CPU_LAYOUT_DIFFERS`` (a module call: by what it binds)."""
    if node.op == "call_module":
        return any(b.op in _CPU_LAYOUT_DIFFERS for b in bind_node(node, gm))
    return node.op in ("call_function", "call_method") and op_name(node.target) in _CPU_LAYOUT_DIFFERS


_SCAN_BUDGET = 4096  # nodes passed in graph order, per replacement, following a layout change


def _follow_change(root: fx.Node, after: Any, facts: GraphFacts, readers: StrideReaders) -> tuple:
    """Follows a change of ``root``'s layout (its readers reading a value laid out as
    ``after``) down the ops that carry it on, in graph order (each op inferred once,
    from all of its changed inputs), until it dies out (a ``reshape`` that copies
    either way, an op that lays its result out itself). Returns (why a reader would
    see the change, or None; the fresh facts of the nodes whose layout changed).
    Seen: a reader of strides other than a view, a ``view`` that cannot
    reinterpret the new layout (one that can computes the same values and carries
    the layout on), a write in place, a ``reshape``-like op whose sharing of memory
    the caller may observe. Unknown facts (``after`` None) follow nothing: any
    reader that may see the layout sees it. An op that cannot be inferred, or a
    change still alive after ``_FOLLOW_BUDGET`` ops inferred (``_SCAN_BUDGET``
    passed), counts as seen."""
    def seen_by(reader: fx.Node) -> tuple:
        return (f"{reader.name} depends on the memory layout of {root.name}, which the replacement is "
                f"not known to keep"), {}

    if after is None:
        reader = readers.reader_of(root)
        return (None, {}) if reader is None else seen_by(reader)
    changed = {root: after}
    frontier = {u for u in root.users if u.op != "output"}
    inferred = scanned = 0
    node = root.next
    while frontier:
        scanned += 1
        if node.op == "root" or scanned > _SCAN_BUDGET or inferred > _FOLLOW_BUDGET:
            return (f"the change of {root.name}'s memory layout reaches further than the "
                    f"{_FOLLOW_BUDGET} ops it is followed through"), {}
        user, node = node, node.next
        if user not in frontier:
            continue
        frontier.discard(user)
        inputs = [i for i in user.all_input_nodes if i in changed]
        if any(readers.sees(user, i) for i in inputs):
            return seen_by(user)
        name = op_name(user.target) if user.op != "call_module" else ""
        if name in _MAY_COPY and _sharing_seen(user, readers.gm, readers.writes()):
            return seen_by(user)
        if not (name in _VIEWS and _reads_strides(user) in changed) and not _carries_layout(user, readers.gm):
            continue
        if _layout_not_inferable(user, readers.gm):
            reader = readers.reader_of(user)
            if reader is not None or any(u.op == "output" for u in user.users):
                return seen_by(reader or user)
            continue  # no reader sees it: the layout it gets stays unknown (and unread)
        inferred += 1
        fresh = facts.rerun([user], given=changed).get(user)
        if fresh is None:
            return seen_by(user)
        if _same_strides(fresh, facts.meta(user, record=False)):
            continue  # the change dies out here
        changed[user] = fresh
        frontier.update(u for u in user.users if u.op != "output")
    del changed[root]
    return None, changed


def layout_change_seen(root: fx.Node, result: fx.Node, facts: GraphFacts, readers: StrideReaders,
                       created: Any = (), relaid: dict | None = None) -> str | None:
    """Why replacing ``root`` by ``result`` may change what a reader that depends on
    strides sees, or None: both values are known to be laid out alike, or the
    change is known to die out before a reader sees it (``_follow_change``: an
    identity rule that drops the copy in front of ``t.view(-1)``, or of
    ``t.clone().view(-1)``, makes the view fail, or read other elements). When the
    change is allowed, ``relaid`` gets the fresh facts of the nodes it relays, for
    ``GraphFacts.relay`` once the replacement is made: a later rule's
    ``is_contiguous`` reads the new layout."""
    if created:  # a new value: left to the rules (AMP lowers such a view to a reshape), but
        # for an op laying its result out as its input (attention as q, often transposed)
        created = set(created)
        if not _through_layout_picker(result, created):
            return None
    elif not root.users:
        return None
    before, after = facts.meta(root), facts.meta(result)
    if created and _meta_layout_unreliable(result, created, facts):
        after = None
    if before is not None and after is not None and _same_strides(before, after):
        return None
    why, fresh = _follow_change(root, after if before is not None else None, facts, readers)
    if why is None and relaid is not None:
        relaid.update(fresh)
    return why
