"""Point a value's readers at another value, in time independent of how wide they are.

torch.fx's ``replace_all_uses_with`` rebuilds each reader's whole argument structure
(``Node._replace_input_with``: every input re-registered), so one rewrite costs the
reader's width. A graph that returns thousands of values, or concatenates them, has
one reader of them all: rewriting each value then costs the width again, and the
fixpoint goes quadratic (16k returned values rewritten: over 200 s in fx's path).

``Rewirer`` keeps, for each wide reader (more inputs than ``WIDE``), where each input
sits in its arguments, built once; a rewire then swaps the entries in place of a
full rebuild (containers are copied at C speed, the bookkeeping is O(1)): readers,
input lists and user lists end as fx would leave them, up to the order of entries.
Narrow readers, keyword arguments and argument shapes it does not know (dicts,
named tuples, deeper nesting) go through fx. The graph's replace hooks (the undo
journal of an in-place rewrite) run before every change, as in fx.
"""

from __future__ import annotations

from typing import Callable

from torch import fx
from torch.fx.immutable_collections import immutable_list

__all__ = ["Rewirer", "WIDE"]

#: readers with more inputs than this are rewired through a position index
WIDE = 32

_set_args = fx.Node._args.__set__ if hasattr(fx.Node, "_args") else None
_PLAIN = (tuple, immutable_list, list)


class _Positions:
    """Where each input of one reader sits in its ``args`` (node -> [(i,) or (i, j)]),
    and a mutable mirror of those args. Valid while the reader's ``args`` is the
    tuple it was built from (or last set to)."""

    __slots__ = ("args", "where", "mirror", "dirty")

    def __init__(self, args: tuple, where: dict) -> None:
        self.args, self.where = args, where
        # top level as a list, each container as a list: a swap writes one slot
        self.mirror = [list(a) if type(a) in _PLAIN else a for a in args]
        self.dirty = False

    def materialize(self) -> tuple:
        return tuple(type(a)(m) if type(a) in _PLAIN else m for a, m in zip(self.args, self.mirror))


def _index(node: fx.Node) -> _Positions | None:
    """The position index of ``node``'s args, or None when they hold something
    only fx should rewrite (keyword node inputs, dicts, deeper containers)."""
    if any(isinstance(v, fx.Node) or (isinstance(v, (tuple, list, dict)) and v) for v in node.kwargs.values()):
        return None
    where: dict = {}
    args = node.args
    for i, a in enumerate(args):
        if isinstance(a, fx.Node):
            where.setdefault(a, []).append((i,))
        elif type(a) in _PLAIN:
            for j, b in enumerate(a):
                if isinstance(b, fx.Node):
                    where.setdefault(b, []).append((i, j))
                elif isinstance(b, (tuple, list, dict, slice)):
                    return None
        elif isinstance(a, (tuple, list, dict, slice)):
            return None  # a named tuple, a dict, a slice of nodes
    return _Positions(args, where)


class Rewirer:
    """Rewires readers of replaced values for one graph (one rewrite run).

    The output node's arguments are written back once, by ``flush``: it is read by
    nothing in the graph and matched by no rule, so while a fixpoint runs only its
    reader bookkeeping (``users``, ``_input_nodes``, kept exact) is consulted, and
    returning 16k rewritten values costs 16k slot writes, not 16k tuple copies.
    Whoever runs rewrites calls ``flush`` before anything reads the graph's code
    or runs it (``Driver`` at the end of each schedule, facts before recording)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self._positions: dict = {}  # wide reader -> _Positions
        self._dirty: list = []  # output nodes whose args are pending

    def replace_uses(self, old: fx.Node, new: fx.Node,
                     keep: Callable[[fx.Node], bool] | None = None) -> list:
        """``old.replace_all_uses_with(new, delete_user_cb=keep)``: the readers of
        ``old`` (those ``keep`` accepts) read ``new``. Returns them."""
        hooks = getattr(self.gm, "_replace_hooks", None)
        changed = []
        for user in list(old.users):
            if keep is not None and not keep(user):
                continue
            changed.append(user)
            for hook in hooks or ():
                hook(old=old, new=new.name, user=user)
            if _set_args is None or len(user._input_nodes) <= WIDE or not self._swap(user, old, new):
                self._flush_one(user)
                user._replace_input_with(old, new)
        return changed

    def flush(self) -> None:
        """Write pending output arguments back into the graph."""
        while self._dirty:
            self._flush_one(self._dirty.pop())

    def _flush_one(self, user: fx.Node) -> None:
        entry = self._positions.get(user)
        if entry is not None and entry.dirty:
            entry.args = entry.materialize()
            _set_args(user, entry.args)
            entry.dirty = False

    def _swap(self, user: fx.Node, old: fx.Node, new: fx.Node) -> bool:
        """Rewire one wide reader through its position index; False: fx must."""
        entry = self._positions.get(user)
        if entry is None or entry.args is not user._args:
            if entry is not None and entry.dirty:
                raise RuntimeError(f"{user.name}'s arguments were changed while rewrites to them were pending")
            entry = _index(user)
            if entry is None:
                self._positions.pop(user, None)
                return False
            self._positions[user] = entry
        paths = entry.where.pop(old, None)
        if not paths:
            return False  # only in a place the index does not cover
        mirror = entry.mirror
        for path in paths:
            if len(path) == 1:
                mirror[path[0]] = new
            else:
                mirror[path[0]][path[1]] = new
        entry.where.setdefault(new, []).extend(paths)
        if user.op == "output":
            if not entry.dirty:
                entry.dirty = True
                self._dirty.append(user)
        else:
            entry.dirty = True
            self._flush_one(user)
        # bookkeeping as fx keeps it: old no longer read by user, new read by it
        user._input_nodes.pop(old, None)
        user._input_nodes.setdefault(new, None)
        old.users.pop(user, None)
        new.users.setdefault(user, None)
        return True
