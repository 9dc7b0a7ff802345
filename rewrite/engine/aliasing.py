"""Alias analysis on a graph: which values share memory, and whether a rewrite
would make the caller observe a difference through that sharing.

A rewrite may change how a value is computed, never what the caller observes. When
a replacement returns an existing value (``x * 1.0 => x``) or a view of one, the
matched node's value, a fresh tensor before, now shares memory with that value.
That is harmless for an intermediate nobody writes; it is observable when

* the shared value is a graph input or a module constant, and the node's value is
  returned by the graph or written in place (the caller's output would be its own
  input; writing into one changes the other; a buffer would leave the module);
* the node's value is written in place, and something else reads the shared value
  (the write now reaches it);
* the shared value is written in place somewhere (the node's readers would see it);
* both are returned by the graph (two outputs would alias each other);
* in a graph that may be trained, the shared value is one autograd keeps for the
  backward (``rewrite.ops.saved``) and the node's value is written in place, or
  returned where the graph is known to train (``backward()`` would raise "modified
  by an inplace operation" where the original trained).

Values are grouped into *alias classes*: a storage base (a placeholder, a
``get_attr``, or an op whose result is fresh memory) and every value that may be a
view of it or the same tensor (``rewrite.ops.effects.may_alias``: views, no-op
casts and reshapes, in-place ops). Before the rewrite, the matched node is
credited only with the sharing it certainly had (``always_aliases``: views and
in-place ops), after it with every sharing it may have: the analysis errs on the
side of not rewriting.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from rewrite.ops.effects import (ALIASING_NAMES, always_aliases, call_writes, flag_on, flagged_writes, lasting_write,
                                 may_alias, may_alias_any_argument, op_name, schema_returns_alias, written_args,
                                 written_nodes)
from rewrite.engine.shapes import symbolic_strides
from rewrite.ops.saved import keeps_result
from rewrite.ops.vocabulary import nodes_by_target

__all__ = ["storage_base", "alias_class", "new_aliasing", "new_identity", "lost_aliasing", "may_view", "caller_owned",
           "graph_writes", "written_between", "memory_observed", "writes_kept_value", "newly_kept"]


def storage_base(node: Any, gm: Any, through: Any = may_alias) -> Any:
    """The value whose memory ``node`` may share: follow first arguments through
    ops for which ``through(op_node, gm)`` says the result may be (a view of) it.
    A first argument that is a list (``broadcast_tensors([a, b])``) may be any of its
    values, and a call that may return any of its inputs (``may_alias_any_argument``)
    any of those: a caller-owned base among theirs is the answer, else the first's."""
    seen: set = set()
    while isinstance(node, fx.Node) and node not in seen:
        seen.add(node)
        first = node.args[0] if node.args else None
        spread = isinstance(first, (list, tuple))  # broadcast_tensors([a, b]): a view of any of them
        if not spread and not node.args and node.kwargs and node.op.startswith("call_"):
            spread, first = True, node.all_input_nodes  # torch.reshape(input=x, shape=s): any of them
        elif not spread and node.op.startswith("call_") and through is may_alias \
                and (not isinstance(first, fx.Node) or may_alias_any_argument(node, gm)):
            # einsum("ij->ji", x), broadcast_tensors(a, b), a user's function
            spread, first = True, node.all_input_nodes
        if spread:
            if not (node.op.startswith("call_") and through(node, gm)):
                return node
            bases = [storage_base(n, gm, through) for n in first if isinstance(n, fx.Node)]
            owned = [b for b in bases if isinstance(b, fx.Node) and caller_owned(b)]
            return owned[0] if owned else (bases[0] if bases else node)
        if not (node.op.startswith("call_") and isinstance(first, fx.Node) and through(node, gm)):
            return node
        node = first
    return node


def alias_class(node: fx.Node, gm: Any, exclude: frozenset = frozenset()) -> set:
    """``node`` and every value that may share its memory downstream (users that
    may return their first argument, or any argument for calls whose code nothing
    describes, transitively), minus ``exclude``."""
    out, frontier = {node}, [node]
    while frontier:
        n = frontier.pop()
        for user in n.users:
            if user not in out and user not in exclude and (user.args or user.kwargs) and _may_return(user, n, gm):
                out.add(user)
                frontier.append(user)
    return out


def _may_return(user: fx.Node, node: fx.Node, gm: Any) -> bool:
    """``user``'s result may be (a view of) ``node``: ``node`` is its first
    argument (or in the list that is) and it may alias that, or it may return any
    of its inputs; a call given only keywords (``torch.reshape(input=x, ...)``) may
    return any of them."""
    if not user.args:
        return may_alias(user, gm)
    first = user.args[0]
    if first is node or (isinstance(first, (list, tuple)) and any(a is node for a in first)):
        return may_alias(user, gm)
    if not isinstance(first, (fx.Node, list, tuple)):  # einsum("ij->ji", x): its operands
        return may_alias(user, gm)
    return may_alias_any_argument(user, gm) and may_alias(user, gm)


def caller_owned(node: fx.Node) -> bool:
    """A graph input or a module constant: memory the caller (or module) owns."""
    return node.op in ("placeholder", "get_attr")


def _escapes(cls: set) -> bool:
    return any(user.op == "output" for n in cls for user in n.users)


def _writes_into(user: fx.Node, node: fx.Node, gm: Any) -> bool:
    return any(written is node for written in written_nodes(user, gm))


def _written(cls: set, gm: Any) -> bool:
    return any(_writes_into(user, n, gm) for n in cls for user in n.users)


def _written_after(cls: set, gm: Any, node: fx.Node) -> bool:
    """Some node after ``node`` in graph order writes into the memory of ``cls``, or
    one before it whose write may outlast it (``lasting_write``: a wrapped helper
    that keeps a reference, ``set_``)."""
    return any(_writes_into(user, n, gm) and (node < user or lasting_write(user, gm))
               for n in cls for user in n.users)


def memory_observed(node: fx.Node, gm: Any, writes: bool) -> bool:
    """Whether the caller could tell ``node``'s memory shared or not: some node
    writes into it in place (``writes``: the graph writes at all), or two graph
    outputs may share it (the values of ``alias_class``, walked once)."""
    cls = alias_class(node, gm)
    if writes and _written(cls, gm):
        return True
    return sum(1 for n in cls if any(u.op == "output" for u in n.users)) > 1


def _read_outside(cls: set, allowed: set) -> bool:
    return any(user not in cls and user not in allowed for n in cls for user in n.users)


def _at_most(size: Any, bound: Any) -> bool:
    """``size <= bound`` is known: both numbers, or (a symbolic size, a sympy
    expression over sizes, which are positive) their difference is known not to be
    positive for every size; None (unknown) is not."""
    if size is None or bound is None:
        return False
    if isinstance(size, int) and isinstance(bound, int):
        return size <= bound
    import sympy

    return bool(sympy.expand(sympy.sympify(size) - sympy.sympify(bound)).is_nonpositive)


def new_aliasing(root: fx.Node, result: fx.Node, created: Any, gm: Any, writes: bool = True,
                 classes: dict | None = None, nbytes: Any = None, grads: bool = False,
                 trained: bool = False) -> str | None:
    """Why replacing ``root`` by ``result`` would let the caller observe new memory
    sharing, or None when it would not. ``created``: the nodes the replacement built
    (they will compute ``root``'s value). ``writes=False``: no node of the graph
    writes an argument in place (``graph_writes``), so only outputs can observe the
    sharing: the class of ``result``'s memory is then walked only when ``root``'s
    value is returned (a value read by thousands of nodes is not walked once per
    rewrite of one of them). ``classes``: alias classes by storage base, kept by the
    caller while the graph does not change (emptied when it does), used when the
    replacement created nothing: refusing the same rewrite at each of a value's
    thousand readers walks that value's class once. ``nbytes(node)``: the bytes of
    a node's value (None when unknown); given, a returned value may not become a view
    of a larger intermediate (``cat([h[-1]]) => h[-1]``: the caller's output would
    keep all of ``h`` alive, and ``torch.save`` would write it). ``grads``: the graph
    may be trained: a value autograd keeps for the backward pass (``keeps_result``)
    may not become one the graph writes in place: backward would raise.
    ``trained``: it is known to be (``apply(training=True)``, a train-mode batch norm
    or dropout): nor one it returns, which the caller may write in place before
    calling backward (and another op's reading it counts: it may keep its inputs)."""
    base = storage_base(result, gm)
    created = frozenset(created)
    if not isinstance(base, fx.Node) or (base in created and not caller_owned(base)):
        return None  # fresh memory the replacement computes: nothing is shared
    before = storage_base(root, gm, always_aliases)
    if base is before:  # root already was (a view of) that memory: the same object?
        return new_identity(root, result, created, gm)
    mine = alias_class(root, gm)
    if base in mine:
        return new_identity(root, result, created, gm)
    escapes = _escapes(mine)
    written = writes and _written(mine, gm)
    what = {"placeholder": "the graph input", "get_attr": "the module constant"}.get(base.op, "the value")
    what = f"{what} {base.target if base.op == 'get_attr' else base.name!r}"
    if escapes and nbytes is not None and base is not result and not caller_owned(base):
        kept, had, own = nbytes(base), nbytes(before), nbytes(root)
        if kept is None or not (_at_most(kept, had) or _at_most(kept, own)):
            return (f"the graph would return a view of {what}, which keeps all of its memory alive "
                    f"({_bytes(kept)}, where the original returned {_bytes(had)})")
    if caller_owned(base) and (escapes or written):
        verb = "returned by the graph" if escapes else "written in place"
        return f"its result would be {what} itself, and it is {verb}: the rewrite would alias it"
    if writes and caller_owned(base) and _other_owned_written(base, gm):
        # m(t, t) and m(m.buffer) are legal calls: a write into one input, or into the
        # module's state, reaches an input that is the same tensor
        return (f"its result would be {what}, and another graph input or module tensor, which the caller may "
                f"pass as the same tensor, is written in place")
    if not writes and not escapes:
        return None  # nothing is written, and root's value is not returned
    known = None  # (escapes, written) of the class, when it is a cached one
    if classes is not None and not created:
        if base not in classes:
            full = frozenset(alias_class(base, gm))
            classes[base] = (full, _escapes(full), writes and _written(full, gm))
        full, full_escapes, full_written = classes[base]
        # the walk that stops at root's class reaches the same nodes when it never meets it
        if full.isdisjoint(mine):
            theirs, known = full, (full_escapes, full_written)
        else:
            theirs = alias_class(base, gm, exclude=frozenset(mine))
    else:
        theirs = alias_class(base, gm, exclude=frozenset(mine) | created)
    if written and _read_outside(theirs, created | mine):
        return f"its result is written in place and would share memory with {what}, which is read elsewhere"
    if grads and (written or (escapes and trained)) and not keeps_result(root, gm):
        # (root's own value kept, a write or a caller's into it broke the backward already)
        problem = _kept_for_backward(base, theirs, created | mine, what, written, gm)
        if problem is not None:
            return problem
    if writes and (known[1] if known is not None else _written(theirs, gm)) and _written_after(theirs, gm, root):
        # (a write before root, ``relu_(h)`` upstream of an eval-mode dropout of h,
        # is done before root's readers read the shared memory: they see what they saw)
        return f"its result would share memory with {what}, which is written in place"
    if escapes and (known[0] if known is not None else _escapes(theirs)):
        return f"its result and {what} are both returned by the graph: the outputs would alias each other"
    return None


def _inplace_step(node: Any, gm: Any) -> bool:
    """``node`` certainly returns the very tensor object of its first argument: an
    in-place op (``relu_``, ``add_``, a module with ``inplace=True``) of known code."""
    return (isinstance(node, fx.Node) and node.op.startswith("call_") and bool(node.args)
            and isinstance(node.args[0], fx.Node) and 0 in written_args(node, gm)
            and always_aliases(node, gm) and not may_alias_any_argument(node, gm))


def _may_be_same_object(node: fx.Node, gm: Any) -> bool:
    """``node``'s result may be the very tensor object of its input (not a new view
    of it): an in-place op, a no-op cast or ``contiguous`` (which return ``self``),
    a call whose code nothing describes. A view is a new tensor object."""
    if not may_alias(node, gm):
        return False
    return not always_aliases(node, gm) or _inplace_step(node, gm) or may_alias_any_argument(node, gm) \
        or (node.op != "call_module" and op_name(node.target) in _VIEWS_THAT_MAY_BE_ITSELF)


#: views that return their input object itself when there is nothing to do (``real``
#: of a real tensor)
_VIEWS_THAT_MAY_BE_ITSELF = frozenset({"real"})


def _same_object(node: fx.Node, gm: Any) -> set:
    """``node`` and the values that may be its very tensor object: the in-place ops
    written into it, and what may return it as it is (``contiguous()``, a no-op
    ``float()``, ``nn.Identity``, an eval-mode dropout, ``real`` of a real tensor),
    given it first or, for a call that may return any of its inputs as they are
    (``broadcast_tensors(z, h)``, code nothing describes), given it anywhere; an
    element of such a call's tuple (``broadcast_tensors(z, h)[1]``); and theirs."""
    found, todo = {node}, [node]
    sequences: set = set()  # found calls whose value may be a tuple holding the object
    while todo:
        for user in todo.pop().users:
            if user in found or not user.op.startswith("call_") or not (user.args or user.kwargs):
                continue
            first = user.args[0] if user.args else None
            given_first = isinstance(first, fx.Node) and first in found
            if given_first and first in sequences and user.target is operator.getitem:
                pass  # an element of the tuple: it may be the object
            elif given_first and (_inplace_step(user, gm) or _may_be_same_object(user, gm)):
                pass
            elif any(n in found for n in user.all_input_nodes) and may_alias_any_argument(user, gm) \
                    and may_alias(user, gm):
                if not isinstance(user.meta.get("val"), torch.Tensor):
                    sequences.add(user)
            else:
                continue
            found.add(user)
            todo.append(user)
    return found


def _may_change_metadata(node: fx.Node, gm: Any) -> bool:
    """``node``, which writes a value in place, may change that tensor object's sizes,
    strides or storage (``t_``, ``unsqueeze_``, ``resize_``, ``set_``), not only its
    data: so may code nothing describes. A data write (``add_``, ``relu_``, ``x[i] =
    v``, an ``inplace=True`` module of torch's) through a view or through its base is
    the same write into the same memory."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        return not (bool(getattr(module, "inplace", False)) and type(module).__module__.startswith("torch."))
    if may_alias_any_argument(node, gm):
        return True
    return _metadata_write(node)


def _metadata_write(node: fx.Node) -> bool:
    """``node`` calls an op that changes its first argument's sizes, strides or storage
    in place (by its own name: ``op_name`` drops the trailing underscore)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        name = target._schema.name.rpartition("::")[2]
    else:
        name = target if isinstance(target, str) else getattr(target, "__name__", "")
    return name in _METADATA_WRITES


_METADATA_WRITES = frozenset({"t_", "transpose_", "swapdims_", "swapaxes_", "unsqueeze_", "squeeze_", "resize_",
                              "resize_as_", "as_strided_", "set_", "detach_", "requires_grad_", "unflatten_"})


def new_identity(root: fx.Node, result: fx.Node, created: Any, gm: Any) -> str | None:
    """Why replacing ``root``, which already shares memory with ``result``, would
    still let the caller tell: ``x.t().t()`` and ``x.view(s)`` are new tensor objects
    over ``x``'s memory; replaced by ``x`` itself, the caller's output would *be* its
    input (``out is x``: ``out.t_()`` or ``out.unsqueeze_(0)`` would change the
    caller's tensor, a module's buffer its shape), two outputs one object, or an
    in-place metadata write (``t_``) on the value would reach the other's readers."""
    obj = storage_base(result, gm, _may_be_same_object)
    if not isinstance(obj, fx.Node) or obj in created:
        return None  # a new tensor object (a view the replacement builds)
    root_object = root
    while _inplace_step(root_object, gm):
        root_object = root_object.args[0]
    if root_object is obj:
        return None  # root was that very object (an in-place op on it)
    mine, theirs = _same_object(root, gm), _same_object(obj, gm)
    returned = _escapes(mine)
    written = _metadata_written(mine, gm)
    what = {"placeholder": "the graph input", "get_attr": "the module constant"}.get(obj.op, "the value")
    what = f"{what} {obj.target if obj.op == 'get_attr' else obj.name!r}"
    if returned and (caller_owned(obj) or _escapes(theirs)):
        return (f"it is a new tensor object over the memory of {what}, and it is returned by the graph: the "
                f"replacement would return {what} itself (an in-place metadata change of the output, t_() or "
                "unsqueeze_(), would reach it)")
    if written and (caller_owned(obj) or any(u not in mine for n in theirs for u in n.users)):
        return (f"it is a new tensor object over the memory of {what}, and it is written in place: the write "
                f"would be made on {what} itself")
    if _metadata_written(theirs, gm, after=root):
        return (f"it is a new tensor object over the memory of {what}, whose sizes or strides an in-place op "
                f"changes later (unsqueeze_(), t_()): the value's readers would see {what} changed")
    return None


def _metadata_written(same: set, gm: Any, after: Any = None) -> bool:
    """Some node writes into one of the values of ``same`` (one tensor object) by an
    op that may change its sizes, strides or storage (``_may_change_metadata``);
    with ``after``, one after that node in graph order (or one whose write may
    outlast the call: ``lasting_write``)."""
    return any(_may_change_metadata(user, gm) and (_writes_into(user, n, gm) or (
        user.op.startswith("call_") and user.args and user.args[0] is n and _metadata_write(user)))
        and (after is None or after < user or lasting_write(user, gm))
        for n in same for user in n.users)


def _kept_for_backward(base: fx.Node, theirs: Any, inside: Any, what: str, written: bool, gm: Any) -> str | None:
    """Why the memory of ``base``'s class may not take a write, or be returned, in a
    graph that may be trained: an op of the class keeps its result for the backward
    (``sigmoid``, an in-place ``relu_``), or (returned) another op reads it and may
    keep it as an input; None when neither. The caller's write into a returned
    output then reaches a tensor the backward reads."""
    keeper = next((n for n in (base, *theirs) if keeps_result(n, gm)), None)
    done = "it is written in place" if written else "a caller's in-place write into that output would reach it"
    if keeper is not None:
        return (f"its result would be {what}, which autograd keeps for the backward of {keeper.name!r}, and "
                f"{done}: backward would raise")
    if not written:
        reader = next((u for n in theirs for u in n.users if u not in theirs and u not in inside
                       and u.op != "output"), None)
        if reader is not None:
            return (f"the graph would return {what}, which {reader.name!r} reads (autograd may keep it for the "
                    f"backward): {done}, and backward would raise")
    return None


def newly_kept(root: fx.Node, result: fx.Node, gm: Any, trained: bool) -> str | None:
    """Why standing ``result``, a value autograd may keep for its backward (a
    replacement's ``softmax``, ``leaky_relu_``), for ``root``, one it did not keep,
    would break a backward pass, or None: root's value is written in place later,
    or (``trained``: the graph is known to train) returned, where the caller may
    write it. Asked where the graph may be trained."""
    if not keeps_result(result, gm) or keeps_result(root, gm):
        return None
    mine = alias_class(root, gm)
    if _written(mine, gm):
        return (f"its result {result.name!r} is one autograd keeps for the backward, and the matched value is "
                "written in place: backward would raise")
    if trained and _escapes(mine):
        return (f"its result {result.name!r} is one autograd keeps for the backward, and the graph returns it: a "
                "caller's in-place write into that output would make backward raise")
    return None


def writes_kept_value(created: Any, gm: Any) -> str | None:
    """Why a replacement's in-place write into a value it builds itself (which E105
    allows: ``relu_(tanh(x))``) would break a backward pass, or None: the value is
    one autograd keeps (``keeps_result``), or another node of the replacement reads
    it (and may keep it as an input). Asked where the graph may be trained."""
    made = frozenset(created)
    for node in created:
        for value in written_nodes(node, gm):
            if value not in made:
                continue
            if keeps_result(value, gm):
                return (f"its replacement writes in place the result of {value.name!r}, which autograd keeps for "
                        "the backward: backward would raise (the graph may be trained)")
            reader = next((u for u in value.users if u is not node and u in made), None)
            if reader is not None:
                return (f"its replacement writes in place {value.name!r}, which {reader.name!r} reads (autograd may "
                        "keep it for the backward): backward would raise (the graph may be trained)")
    return None


def lost_aliasing(root: fx.Node, result: fx.Node, created: Any, gm: Any, writes: bool = True,
                  meta: Any = None) -> str | None:
    """Why replacing ``root``, a view of other memory (``may_view``: ``h.view(-1)``,
    ``x.t()``, ``h.reshape(-1)``), by ``result``, memory of its own (a copy: ``reshape(clone(x), s)``),
    would let the caller observe the sharing lost, or None when it would not. The
    mirror image of ``new_aliasing``: a write through the view no longer reaches
    the memory it viewed (``h.view(-1).add_(1); return h``), a write into that
    memory no longer reaches the view's readers, a view of a graph input or module
    tensor written in place no longer writes the caller's tensor, and a view
    returned with the memory it viewed (or of a graph input) is no longer one.
    ``created``: the nodes the replacement built (they read that memory in root's
    place: not readers besides). ``meta``: a node's facts (``GraphFacts.meta``, which
    records them from example inputs when the graph carries none; default: its
    recorded ``val``)."""
    before = storage_base(root, gm, lambda node, module: may_view(node, module, meta))
    if before is root or not isinstance(before, fx.Node):
        return None  # root's value was memory of its own
    if storage_base(result, gm) is before:
        return None  # the replacement still views that memory
    mine = alias_class(root, gm)
    group = alias_class(before, gm)
    others = group - mine
    # what happens before root, root and the replacement alike see: only reads and
    # writes of that memory after root tell the sharing
    inside = group | frozenset(created)
    observed = caller_owned(before) or _escapes(others) or any(
        user not in inside and root < user for n in others for user in n.users)
    # an in-place root (``relu_(h)``, ``out += identity``) writes that memory itself:
    # dropped, the write matters only where the memory is read besides
    own_write = writes and bool(written_nodes(root, gm))
    if writes and (own_write or _written(mine, gm)) and observed:
        return (f"its value is a view of {_named(before)}, written in place through it: the replacement's own memory "
                f"would not pass the write on")
    if writes and any(root < user and _writes_into(user, n, gm) for n in others for user in n.users):
        return (f"its value is a view of {_named(before)}, which is written in place: the replacement's own memory "
                f"would not see the write")
    if _escapes(mine) and (caller_owned(before) or _escapes(others)):
        return (f"its value is a view of {_named(before)}, and both are the caller's (returned or given): the "
                f"replacement's own memory would no longer share theirs")
    return None


def _named(base: fx.Node) -> str:
    """How a refusal names the memory a view shares (built only when one is made)."""
    kind = {"placeholder": "the graph input", "get_attr": "the module constant"}.get(base.op, "the value")
    return f"{kind} {base.target if base.op == 'get_attr' else base.name!r}"


def may_view(node: fx.Node, gm: Any, meta: Any = None) -> bool:
    """Whether ``node``'s result may be a view of its first input, for what a rewrite
    would lose by replacing it: views and in-place ops (``always_aliases``), and the
    ops that view only at run time (``reshape``, ``flatten``, ``reshape_as``,
    ``contiguous``, a cast to the same dtype: ``ALIASING_NAMES``) unless the node's
    metadata shows a copy (a cast to another dtype or device). When it cannot
    tell, a view: a rule then does not fire where the sharing is observed."""
    if always_aliases(node, gm):
        return True
    if node.op == "call_module":  # nn.Flatten, nn.Identity, an eval-mode nn.Dropout: by the module's kind
        return may_alias(node, gm)
    if node.op not in ("call_function", "call_method"):
        return False
    # the ops known to return their input at run time: a composite op without an
    # alias annotation (``fake_quantize_per_tensor_affine``) only may (may_alias)
    if op_name(node.target) not in ALIASING_NAMES:
        # an op whose schema says its result may be its argument (``Tensor(a) -> Tensor(a)``:
        # a custom op's view, whatever its name)
        return node.op == "call_function" and schema_returns_alias(node.target)
    first = node.args[0] if node.args else None
    meta = meta or _recorded_val
    mine = meta(node)
    theirs = meta(first) if isinstance(first, fx.Node) else None
    if getattr(mine, "dtype", None) is not None and getattr(theirs, "dtype", None) is not None \
            and mine.dtype != theirs.dtype:
        return False  # a cast to another dtype: new memory
    if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor):
        if mine.device != theirs.device:
            return False
        if not symbolic_strides(mine) and not symbolic_strides(theirs):  # fixed sizes: every call
            if op_name(node.target) == "contiguous" and not theirs.is_contiguous():
                return False
            if isinstance(mine, FakeTensor) and isinstance(theirs, FakeTensor):
                return _storage(mine) is None or _storage(mine) == _storage(theirs)
    elif op_name(node.target) == "contiguous" and getattr(theirs, "contiguous", None) is False:
        return False  # recorded facts (symbolic_trace): a strided input is copied
    return True


def _recorded_val(node: fx.Node) -> Any:
    return node.meta.get("val")


def _storage(t: torch.Tensor) -> Any:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None


def _bytes(n: int | None) -> str:
    return "an unknown size" if n is None else f"{n} bytes"


def written_between(nodes: tuple, env: dict, gm: Any) -> str | None:
    """Why computing a match's value at its root (``nodes``: the root first, then
    the matched nodes) could read memory after a write the original read before:
    a node outside the match, between its first node and its root, writes memory a
    matched node or a value the match read may share (``c = conv(h); h.add_(1);
    bn(c)``: a folded conv at ``bn`` would read the written ``h``). None when no
    such write lies in between (writes before the first node or after the root
    reach the original and the rewrite alike). Graph inputs and module tensors may
    all be one tensor (``m(t, t)``, ``m(m.buffer)``): a write into one counts for
    every other. Asked only of graphs that write."""
    if len(nodes) < 2:
        return None
    covered = set(nodes)
    root, first = nodes[0], min(nodes[1:])
    if not first < root:
        return None
    read: list = list(nodes[1:])  # the matched nodes, then the values bound to the pattern's variables
    for value in env.values():
        if isinstance(value, (fx.Node, list, tuple)):
            fx.node.map_arg(value, read.append)
    bases = None
    node = first.next
    while node is not root:
        if node not in covered and node.op.startswith("call_"):
            for written in written_nodes(node, gm):
                if bases is None:
                    bases = {storage_base(n, gm) for n in read if n is not root}
                    owned = any(isinstance(b, fx.Node) and caller_owned(b) for b in bases)
                base = storage_base(written, gm)
                # the caller may pass one tensor as two inputs, or a module's own
                # tensor as an input (m(t, t), m(m.buffer)): caller-owned memory may
                # be any other caller-owned memory
                if base in bases or (owned and isinstance(base, fx.Node) and caller_owned(base)):
                    return (f"{node.name} writes {written.name} in place between the match's first node "
                            f"{first.name} and its root: the rewrite would read it after that write")
        node = node.next
    return None


def _other_owned_written(base: fx.Node, gm: Any) -> bool:
    """Some graph input or module tensor other than ``base`` (or a value sharing its
    memory) is written in place: the caller may pass one tensor for both."""
    graph = base.graph
    return any(node is not base and _written(alias_class(node, gm), gm)
               for node in (*graph.find_nodes(op="placeholder"), *graph.find_nodes(op="get_attr")))


def graph_writes(gm: Any) -> bool:
    """Whether some node of ``gm``'s graph writes an argument in place
    (``rewrite.ops.effects.written_args``), looked up by target
    (``rewrite.ops.effects.call_writes``): a call target that never writes is
    skipped but for an ``out=`` keyword, one that writes only through a flag
    (``training=True`` for ``batch_norm``) has its flag read, every other target is
    asked node by node."""
    for op, target, nodes in nodes_by_target(gm.graph):
        if op == "call_function":
            how = call_writes(target)
            if how == "never":
                # an aten overload's out= is in its schema; a Python function may take one
                if not isinstance(target, torch._ops.OpOverload) and any(
                        "out" in n._kwargs and written_args(n, gm) for n in nodes):
                    return True
                continue
            if how == "flag":
                flagged = flagged_writes(target)
                for n in nodes:  # a loop, not a generator: once per batch_norm of a graph
                    if ("out" in n._kwargs or flag_on(n, flagged)) and written_args(n, gm):
                        return True
                continue
        if any(written_args(n, gm) for n in nodes):
            return True
    return False
