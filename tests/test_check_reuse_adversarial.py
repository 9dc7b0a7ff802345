"""Adversarial probes of the check's reuse of the original's values
(``rewrite.trust.reuse``): a wrong rewrite must be rejected and a correct one
accepted, with reuse on exactly as with reuse off."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rewrite
from rewrite.trust import reuse


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "rules.rw"
    path.write_text(text)
    return str(path)


def _export(fn, *args, train=False, params=None):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            if params:
                for k, v in params.items():
                    setattr(self, k, v)

        def forward(self, *xs):
            return fn(self, *xs)

    torch.manual_seed(0)
    m = M().train(train)
    return torch.export.export(m, args).module()


def _outcome(tmp_path, gm, args, text):
    """True: accepted; False: rejected with EquivalenceError."""
    rules = rewrite.load(_write(tmp_path, text))
    try:
        result = rules.apply(gm, example_inputs=args)
    except rewrite.EquivalenceError:
        return False
    assert sum(result.counts.values()) > 0, result.counts  # the rule fired
    return True


def _both(tmp_path, monkeypatch, make, args, text):
    """(with reuse, without reuse); each on a fresh graph."""
    with_reuse = _outcome(tmp_path, make(), args, text)
    monkeypatch.setattr(reuse, "MAX_RECORDED_BYTES", 0)
    without = _outcome(tmp_path, make(), args, text)
    return with_reuse, without


MUL_ONE = "rule mul_one: mul(x, 1) where is_float(x) => x\n"


# ---------------------------------------------------------------- wrong rewrites must be rejected

def test_wrong_value_downstream_of_reused_values(tmp_path, monkeypatch):
    p = {"w": nn.Parameter(torch.randn(4, 4))}
    make = lambda: _export(lambda s, x: (torch.relu(x @ s.w * 1.0) - 1.0).neg().exp(), torch.randn(3, 4), params=p)
    assert _both(tmp_path, monkeypatch, make, (torch.randn(3, 4),),
                 MUL_ONE + "rule wrong_neg: neg(x) => mul(x, -0.5)\n") == (False, False)


def test_wrong_value_in_one_branch_other_branch_reused(tmp_path, monkeypatch):
    make = lambda: _export(lambda s, x: (torch.relu(x) * 1.0 + torch.sigmoid(x), torch.tanh(x) * 2.0), torch.randn(5))
    assert _both(tmp_path, monkeypatch, make, (torch.randn(5),),
                 MUL_ONE + "rule bad: sigmoid(x) => tanh(x)\n") == (False, False)


def test_negative_zero_changed_is_caught(tmp_path, monkeypatch):
    make = lambda: _export(lambda s, x: torch.atan2(x + 0.0, torch.full_like(x, -1.0)), torch.randn(3))
    x = torch.tensor([-0.0, 1.0, -2.0])
    assert _both(tmp_path, monkeypatch, make, (x,), "rule add_zero_any: add(x, 0) => x\n") == (False, False)


def _without_facts(gm):
    """``gm`` with no recorded value on any node: the engine cannot tell a
    replacement's dtype from its root's (``Replacer._unlike_root``), the check must."""
    for node in gm.graph.nodes:
        for key in ("val", "example_value", "tensor_meta"):
            node.meta.pop(key, None)
    return gm


def test_dtype_change_is_caught(tmp_path, monkeypatch):
    x = torch.arange(6).reshape(2, 3)
    make = lambda: _without_facts(_export(lambda s, x: (x * 1.0).sum(0) + 1, x))
    assert _both(tmp_path, monkeypatch, make, (x,), "rule mul_one_any: mul(x, 1) => x\n") == (False, False)


def test_stride_change_is_caught(tmp_path, monkeypatch):
    # two outputs viewing one value: copied back at their source
    # (layout._relaid_at_source) the rewrite keeps their strides; without that, the
    # check must see the change
    import rewrite.engine.layout as layout

    monkeypatch.setattr(layout, "_relaid_at_source", lambda *args: [])
    make = lambda: _export(lambda s, x: (lambda y: (y.unsqueeze(0), y[0]))(torch.relu(x.t().contiguous()) * 1.0),
                           torch.randn(3, 4))
    assert _both(tmp_path, monkeypatch, make, (torch.randn(3, 4),),
                 MUL_ONE + "rule drop_contig: contiguous(x, ...) => x\n") == (False, False)


def test_output_aliasing_another_output_is_caught(tmp_path, monkeypatch):
    def f(s, x):
        y = torch.relu(x * 3.0)
        return y, y.clone()
    rules = rewrite.load(_write(tmp_path, "rule drop_clone: clone(x, ...) => x\n"))
    for cap in (reuse.MAX_RECORDED_BYTES, 0):
        monkeypatch.setattr(reuse, "MAX_RECORDED_BYTES", cap)
        try:
            result = rules.apply(_export(f, torch.randn(4)), example_inputs=(torch.randn(4),))
        except rewrite.EquivalenceError:
            continue
        assert not result.counts  # refused before the check


# ---------------------------------------------------------------- correct rewrites must be accepted

def test_train_mode_dropout_accepted(tmp_path, monkeypatch):
    p = {"d": nn.Dropout(0.5), "l": nn.Linear(4, 4)}
    make = lambda: _export(lambda s, x: s.d(s.l(x) * 1.0).relu(), torch.randn(3, 4), train=True, params=p)
    assert _both(tmp_path, monkeypatch, make, (torch.randn(3, 4),), MUL_ONE) == (True, True)


def test_batch_norm_training_accepted(tmp_path, monkeypatch):
    p = {"bn": nn.BatchNorm1d(4)}
    # (+ 1.0 before the returned * 1.0: relu's result, which autograd keeps, is not
    # handed to the caller of a training graph)
    make = lambda: _export(lambda s, x: (s.bn(x * 1.0).relu() + 1.0) * 1.0, torch.randn(5, 4), train=True, params=p)
    assert _both(tmp_path, monkeypatch, make, (torch.randn(5, 4),), MUL_ONE) == (True, True)


def test_batch_norm_eval_accepted(tmp_path, monkeypatch):
    p = {"bn": nn.BatchNorm1d(4)}
    make = lambda: _export(lambda s, x: s.bn(x * 1.0).relu(), torch.randn(5, 4), params=p)
    assert _both(tmp_path, monkeypatch, make, (torch.randn(5, 4),), MUL_ONE) == (True, True)


def test_grad_requiring_input_and_params_accepted(tmp_path, monkeypatch):
    p = {"l": nn.Linear(4, 4)}
    x = torch.randn(2, 4, requires_grad=True)
    make = lambda: _export(lambda s, x: (s.l(x) * 1.0).relu() + x, x, params=p)
    assert _both(tmp_path, monkeypatch, make, (x,), MUL_ONE) == (True, True)


def test_multiple_and_view_outputs_accepted(tmp_path, monkeypatch):
    def f(s, x):
        y = torch.relu(x * 1.0)
        z = y + 1.0
        return y, z.t(), z.reshape(-1), z[0], x.view(-1)
    make = lambda: _export(f, torch.randn(3, 4))
    assert _both(tmp_path, monkeypatch, make, (torch.randn(3, 4),), MUL_ONE) == (True, True)


def test_integer_tensors_accepted(tmp_path, monkeypatch):
    x = torch.randint(-5, 5, (3, 4))
    make = lambda: _export(lambda s, x: ((x.float() * 1.0).relu().to(torch.int64) + x * 3, (x // 2).sum(), x > 0), x)
    assert _both(tmp_path, monkeypatch, make, (x,), MUL_ONE) == (True, True)


def test_random_ops_accepted(tmp_path, monkeypatch):
    make = lambda: _export(lambda s, x: (torch.relu(x * 1.0) + torch.rand_like(x), torch.randn_like(x) * x),
                           torch.randn(3, 4))
    assert _both(tmp_path, monkeypatch, make, (torch.randn(3, 4),), MUL_ONE) == (True, True)


def test_nan_and_negative_zero_inputs_accepted(tmp_path, monkeypatch):
    x = torch.tensor([float("nan"), -0.0, 0.0, float("inf"), -1.0])
    make = lambda: _export(lambda s, x: (1.0 / (x * 1.0)).exp() * 1.0, torch.randn(5))
    assert _both(tmp_path, monkeypatch, make, (x,), MUL_ONE) == (True, True)


_ALIASING_RESULT = {
    "type_as": lambda x, y: x.type_as(y),
    "einsum_transpose": lambda x, y: torch.einsum("ij->ji", x),
    "sum_to_size": lambda x, y: x.sum_to_size(x.shape),
    "broadcast_tensors": lambda x, y: torch.broadcast_tensors(x, y)[0],
    "meshgrid": lambda x, y: torch.meshgrid(x[0], indexing="ij")[0],
}


@pytest.mark.parametrize("op", sorted(_ALIASING_RESULT))
def test_correct_rewrite_next_to_an_aliasing_op_accepted(tmp_path, monkeypatch, op):
    """The original returns ``op(x)`` (which shares x's memory) and a view of x; the
    rule fires elsewhere (``relu(y * 1) => relu(y)``, correct). The sharing of the
    two outputs is the same in the rewrite: it must be accepted."""
    fn = _ALIASING_RESULT[op]
    args = (torch.randn(3, 3), torch.randn(3, 3))
    make = lambda: _export(lambda s, x, y: (fn(x, y), x.view(-1), torch.relu(y * 1.0)), *args)
    with_reuse, without = _both(tmp_path, monkeypatch, make, args, MUL_ONE)
    assert without is True
    assert with_reuse is True


@pytest.mark.parametrize("op", sorted(_ALIASING_RESULT))
def test_check_alone_catches_an_alias_of_the_input_returned(monkeypatch, op):
    """The check itself (the engine's static alias analysis refuses this rewrite
    before it): ``op(x) * 1 => op(x)`` makes the output share the input's memory."""
    from rewrite.trust.check import check_equivalence
    import copy
    fn = _ALIASING_RESULT[op]
    args = (torch.randn(3, 3), torch.randn(3, 3))
    results = []
    for cap in (reuse.MAX_RECORDED_BYTES, 0):
        monkeypatch.setattr(reuse, "MAX_RECORDED_BYTES", cap)
        gm = _export(lambda s, x, y: fn(x, y) * 1.0, *args)
        cand = copy.deepcopy(gm)
        mul = next(n for n in cand.graph.nodes if n.target == torch.ops.aten.mul.Tensor)
        mul.replace_all_uses_with(mul.args[0])
        cand.graph.erase_node(mul)
        cand.recompile()
        results.append(check_equivalence(gm, cand, args, tolerance="exact").ok)
    assert results[1] is False  # without reuse: rejected
    assert results[0] is False  # with reuse: must be rejected too
