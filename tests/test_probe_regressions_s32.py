"""Regressions found by session 32's probes (N: fooling the check, P: side effects
of the public API on the caller's world), each failing before its fix."""

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import rewrite
import rewrite.quant as rq
from rewrite.analysis import analyze


class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.fc(self.drop(x))


def _rng_kept(call):
    before = torch.get_rng_state()
    call()
    return torch.equal(before, torch.get_rng_state())


def test_analyze_leaves_the_callers_random_stream_alone():
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    train = fx.symbolic_trace(DropoutNet().train())
    assert _rng_kept(lambda: analyze(train, (x,)))  # a dropout that draws
    exported = torch.export.export(DropoutNet().eval(), (x,), strict=False).module()
    assert _rng_kept(lambda: analyze(exported))  # inputs made from the graph's metadata


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_prepare_and_quantize_leave_the_callers_random_stream_alone(capture):
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    model = DropoutNet().train()
    gm = fx.symbolic_trace(model) if capture == "fx" else torch.export.export(model, (x,), strict=False).module()
    assert _rng_kept(lambda: rq.prepare(gm, (x,), fuse=False, check=False))
    assert _rng_kept(lambda: rq.quantize(gm, [(x,)]))


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_max_rewrites_must_be_a_positive_int(bad):
    gm = fx.symbolic_trace(DropoutNet().eval())
    rules = rewrite.parse("rule relu_twice: relu(relu(x)) => relu(x)\n")
    with pytest.raises(ValueError, match="max_rewrites must be a positive int"):
        rules.apply(gm, (torch.randn(2, 4),), max_rewrites=bad)
    assert rules.apply(gm, (torch.randn(2, 4),), max_rewrites=1).counts == {}


def test_a_change_rule_in_once_is_replayed_under_its_own_schedule_for_the_check():
    """The check compares the rewrite with the model after the intentional changes
    alone: replayed under the rule set's schedule (a change rule that matches its own
    replacement runs in once(...); in a fixpoint it never settled)."""
    rules = rewrite.parse("""
rule bump(change=True): relu(x) => relu(add(x, 1.0))
rule mul_one: mul(x, 1) where is_float(x) => x
ruleset main = seq(once(bump), once(mul_one))
""")["main"]

    class M(nn.Module):
        def forward(self, x):
            return torch.relu(x) * 1.0

    gm, x = fx.symbolic_trace(M()), torch.randn(4)
    result = rules.apply(gm, (x,))
    assert result.counts == {"bump": 1, "mul_one": 1} and result.equivalence.ok
    torch.testing.assert_close(result.graph_module(x), torch.relu(x + 1.0))
    wrong = rewrite.parse("""
rule bump(change=True): relu(x) => relu(add(x, 1.0))
rule bad: mul(x, 1) where is_float(x) => neg(x)
ruleset main = seq(once(bump), once(bad))
""")["main"]
    with pytest.raises(rewrite.EquivalenceError, match="bad"):
        wrong.apply(gm, (x,))


# ---------------------------------------------------------------- probe O: rule files that hang or leak


def test_nested_families_compile_each_argument_once():
    """family act = relu | gelu | silu | sigmoid; act(act(...)) 30 deep compiled each
    argument once per alternative: 4^30 patterns. Now every alternative shares them."""
    depth = 30
    pattern = "x"
    for _ in range(depth):
        pattern = f"act({pattern})"
    rules = rewrite.parse(f"family act = relu | gelu | silu | sigmoid\nrule r: {pattern} => clamp(x, 0.0)\n")
    root = rules.rules["r"].pattern
    inputs = {id(dict(alt.args)["input"]) for alt in root.alts}
    shared = len(root.alts) == 4 and len(inputs) == 1  # one argument pattern for every alternative
    assert shared  # (a bare bool: pytest would print the pattern, 4^30 nodes written out)


def test_a_match_with_exponentially_many_bindings_gives_up_and_says_so():
    from rewrite.engine import match as match_module

    n = 16  # a 4-level tree of adds: 2^15 commutative orders, none binding v0 twice
    names = ["v0"] + [f"_v{i}" for i in range(1, n - 1)] + ["v0"]
    while len(names) > 1:
        names = [f"add({names[i]}, {names[i + 1]})" for i in range(0, len(names), 2)]
    rules = rewrite.parse(f"rule r: {names[0]} => mul(v0, 2.0)\n")

    class Tree(nn.Module):
        def forward(self, x):
            leaves = [x[i] for i in range(n)]
            while len(leaves) > 1:
                leaves = [leaves[i] + leaves[i + 1] for i in range(0, len(leaves), 2)]
            return leaves[0]

    gm = fx.symbolic_trace(Tree())
    budget = match_module.MATCH_BUDGET
    match_module.MATCH_BUDGET = 500
    try:
        result = rules.apply(gm, (torch.randn(n, 3),), check=False)
    finally:
        match_module.MATCH_BUDGET = budget
    assert result.counts == {}
    assert "tried over 500 ways to bind the pattern" in result.stats["r"].first_error


@pytest.mark.parametrize("body, message", [
    ("operator.pow(10, 100000000000)", "may compute a number without bound"),
    ("operator.lshift(1, 100000000000)", "may compute a number without bound"),
    ("operator.pow(operator.pow(10, 60), 60)", "may compute a number without bound"),
    ("operator.getitem(operator.mul('aaaa', 1000000000000), 0)", "repeats a literal sequence"),
])
def test_python_arithmetic_without_a_bound_is_a_load_error(body, message):
    with pytest.raises(rewrite.RuleError, match=message) as err:
        rewrite.parse(f"rule r: relu(x) => add(x, {body})\n")
    assert "[E207]" in str(err.value) and "<string>:1:" in str(err.value)


def test_bounded_python_arithmetic_still_loads():
    rewrite.parse("rule r: relu(x) => add(x, operator.pow(2, 10))\n")
    rewrite.parse("rule r: mul(x, x) where is_float(x) => operator.pow(x, 2)\n")


@pytest.mark.parametrize("spelling", ["Tensor.conj_physical", "torch.conj_physical"])
def test_a_write_into_what_conj_physical_returns_is_refused(spelling):
    """conj_physical of a real tensor returns the tensor itself: writing into it
    writes the caller's input."""
    with pytest.raises(rewrite.RuleError, match="E105"):
        rewrite.parse(f"rule r: sigmoid(add(x, y)) => sigmoid(aten.add_({spelling}(y), x))\n")


@pytest.mark.parametrize("op", ["c10d_functional.all_reduce", "fsdp.all_gather_copy_in", "onnx.Add"])
def test_torchs_collective_and_export_namespaces_are_refused(op):
    import torch._dynamo  # noqa: F401 - registers c10d_functional, fsdp...

    with pytest.raises(rewrite.RuleError, match="torch's own namespace"):
        rewrite.parse(f"rule r: relu(x) => {op}(x)\n")


def test_a_rewrite_that_draws_other_random_numbers_is_rejected():
    class Doubled(nn.Module):
        def forward(self, x):
            return torch.relu(x) * 2

    gm, x = fx.symbolic_trace(Doubled()), torch.randn(4, 4)
    rules = rewrite.parse("rule r: relu(x) => clamp(add(x, mul(aten.rand_like(x), 0.0)), 0.0)\n")
    assert rules.apply(gm, (x,), check=False).counts == {"r": 1}  # every value the same...
    with pytest.raises(rewrite.EquivalenceError, match="draws other random numbers"):
        rules.apply(gm, (x,))  # ...but the caller's next torch.rand would differ


def test_a_rule_file_that_is_not_a_regular_file_or_too_large_is_refused(tmp_path):
    import os

    fifo = tmp_path / "pipe.rw"
    os.mkfifo(fifo)  # reading it would block for ever
    with pytest.raises(rewrite.RuleError, match="not a regular file") as err:
        rewrite.load(str(fifo))
    assert "[E402]" in str(err.value)
    big = tmp_path / "big.rw"
    with open(big, "wb") as fh:
        fh.truncate(2 * 2**20)  # sparse: nothing is written
    with pytest.raises(rewrite.RuleError, match="a rule file is at most 1 MiB"):
        rewrite.load(str(big))
    importer = tmp_path / "main.rw"
    importer.write_text('import "big.rw"\n')
    with pytest.raises(rewrite.RuleError, match=r"cannot import '.*big.rw'.*at most 1 MiB"):
        rewrite.load(str(importer))


@pytest.mark.parametrize("end", ["\r", "\u2028", "\u2029"])
def test_every_line_break_ends_a_line(end):
    """A lone CR (or a Unicode line separator) ends a line, as editors show it: a rule
    after a comment is a rule, and a comment after a rule is not part of it."""
    after_comment = rewrite.parse(f"# a comment{end}rule r: relu(relu(x)) => relu(x){end}")
    assert list(after_comment.rules) == ["r"]
    before_comment = rewrite.parse(f"rule r: relu(relu(x)) => relu(x){end}# disabled? no: a comment")
    assert list(before_comment.rules) == ["r"]
    with pytest.raises(rewrite.RuleError, match=":2:"):  # the second line, as an editor numbers it
        rewrite.parse(f"# a comment{end}rule r: relu(relu(x) => relu(x)")


def test_apply_takes_fixed_inputs_and_input_ranges_for_the_check():
    """A model whose input must be structured (cholesky of a positive definite matrix)
    fails on random trials; apply now takes what check_equivalence takes (probe N F10)."""
    class Chol(nn.Module):
        def forward(self, a, scale):
            return torch.relu(torch.relu(torch.linalg.cholesky(a))) * scale

    gm = fx.symbolic_trace(Chol())
    b = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    args = (b @ b.T + 4 * torch.eye(4), torch.tensor(2.0))
    rules = rewrite.parse("rule relu_twice: relu(relu(x)) => relu(x)\n")
    with pytest.raises(RuntimeError, match="pass fixed_inputs"):
        rules.apply(gm, args)
    result = rules.apply(gm, args, fixed_inputs=[0], input_ranges={1: (1.0, 3.0)})
    assert result.counts == {"relu_twice": 1} and result.equivalence.ok and result.equivalence.trials == 3
    with pytest.raises(ValueError, match="input_ranges maps an input"):
        rules.apply(gm, args, input_ranges={1: 3.0})
    with pytest.raises(ValueError, match="fixed_inputs is a list"):
        rules.apply(gm, args, fixed_inputs=0)


def test_parametrized_imports_that_double_at_every_level_stop_at_a_bound(tmp_path):
    """Each file imports the next twice with a new binding: 2^depth instances. The
    load stops at MAX_LOADED_FILES with an E402 at the import (probe O F02)."""
    depth = 12
    (tmp_path / "root.rw").write_text('import "l0.rw" with p = 0\nrule top: relu(relu(x)) => relu(x)\n')
    for i in range(depth):
        imports = (f'import "l{i + 1}.rw" with p = [p, 0]\nimport "l{i + 1}.rw" with p = [p, 1]\n'
                   if i + 1 < depth else "")
        (tmp_path / f"l{i}.rw").write_text(f"param p\n{imports}rule r{i}: mul(x, {i}) => x\n")
    with pytest.raises(rewrite.RuleError, match="one load reads at most 1000 rule files") as err:
        rewrite.load(str(tmp_path / "root.rw"))
    assert "[E402]" in str(err.value)


def test_verify_runs_a_rule_as_its_schedule_does():
    """A rule that matches its own replacement runs in once(...) (E409's advice):
    verify ran it to a fixpoint and reported non-termination instead of comparing
    values (probe N F06)."""
    right = rewrite.parse("""
rule r2: gelu(x) where dtype(x) == torch.float32 => mul(gelu(x), 1.0)
ruleset main = once(r2)
""")
    assert right["main"].verify(max_examples=5, seed=0).ok
    wrong = rewrite.parse("""
rule r: gelu(x, ...) => aten.gelu(x, approximate="tanh")
ruleset main = once(r)
""")
    report = wrong["main"].verify(max_examples=5, seed=0)
    assert not report.ok and "non-termination" not in str(report)
    repeated = rewrite.parse("rule r2: gelu(x) where dtype(x) == torch.float32 => mul(gelu(x), 1.0)\n"
                             "ruleset main = fixpoint(seq(once(r2)))\n")
    assert repeated.only("r2").schedule.kind == "fixpoint"  # once inside a fixpoint repeats
    assert right.only("r2").schedule.kind == "once"


@pytest.mark.parametrize("kwargs, message", [
    ({"max_examples": 0}, "max_examples must be a positive int"),
    ({"max_examples": -1}, "max_examples must be a positive int"),
    ({"seed": "a"}, "seed must be an int"),
    ({"names": ["nope"]}, "no rule named 'nope'"),
])
def test_verify_refuses_arguments_that_would_verify_nothing(kwargs, message):
    rules = rewrite.parse("rule relu_twice: relu(relu(x)) => relu(x)\n")
    with pytest.raises(ValueError, match=message):
        rules.verify(**kwargs)
    assert rules.verify(max_examples=2, names="relu_twice").ok


def test_example_factories_leave_the_callers_random_stream_alone():
    from rewrite.examples import demo_cnn_with_inputs, resnet_tiny

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    first, _ = demo_cnn_with_inputs()
    resnet_tiny()
    assert torch.equal(torch.rand(3), expected)
    second, _ = demo_cnn_with_inputs()  # still the same weights every time
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
