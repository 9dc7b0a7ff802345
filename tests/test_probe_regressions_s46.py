"""Regressions found in session 46: a wrong rule that verify called ok (it met only
the one attribute value its where clause let through, where the rule changes
nothing), and the quantization flows on models they were not tuned for."""

import copy

import pytest
import torch
import torch.nn as nn

import rewrite
from rewrite.trust.verify import verify_rules


@pytest.mark.parametrize("clause", [
    "value(e) < 0.0001",
    "value(e) < 0.0001 and value(e) > 0.000000001",
    "e <= 0.00001 and e != 0.00001",
])
def test_an_eps_rule_meets_eps_the_clause_lets_through(clause):
    """``layer_norm(x, s, w, b, e) where value(e) < 1e-4 => layer_norm(..., 1e-5)``
    is wrong for BERT's eps of 1e-12 on readings of about 1e-3 (60% off). Verify drew
    eps from the table's (1e-5, 1e-3) only; the clause left 1e-5, where the rule
    changes nothing, and every such "instance" counted: ok. It now draws numbers
    about the clause's bound, and an instance that changes nothing does not count."""
    rules = rewrite.parse(f"rule ln_eps: layer_norm(x, s, w, b, e) where {clause} => layer_norm(x, s, w, b, 1e-5)")
    (verdict,) = verify_rules(rules, max_examples=20, seed=0).verdicts
    assert verdict.status == "counterexample", verdict


def test_the_same_rule_right_for_its_bound_still_verifies():
    """The draws about a bound do not fail a right rule: an eps at or below 1e-5
    written as exactly 1e-5 only where it already is, and a sound spelling rule."""
    rules = rewrite.parse(
        "rule ok_eps: layer_norm(x, s, w, b, e) where value(e) >= 0.00001 and value(e) <= 0.00001 "
        "=> layer_norm(x, s, w, b, e)\n"
        "rule sm: softmax(x, d) where d == -1 and rank(x) == 2 => softmax(x, 1)\n")
    verdicts = {v.rule: v for v in verify_rules(rules, max_examples=10, seed=0).verdicts}
    assert verdicts["ok_eps"].status == "skipped"  # it never changes anything
    assert verdicts["sm"].status == "ok", verdicts["sm"]


def test_a_rule_that_only_rebuilds_what_it_matched_is_unverified():
    """An instance on which the replacement is the very call it matched exercises
    nothing: verify draws another, and a rule that never changes anything is
    skipped (unverified), not ok."""
    rules = rewrite.parse("rule sm: softmax(x, d) where d == -1 => softmax(x, -1)")
    report = verify_rules(rules, max_examples=10, seed=0)
    (verdict,) = report.verdicts
    assert verdict.status == "skipped" and "no instance exercised the rewrite" in verdict.reason
    assert not report.ok


class _FrozenBackbone(nn.Module):
    """A fine-tuning pattern: the conv and batch norm run under no_grad."""

    def __init__(self):
        super().__init__()
        self.c, self.bn, self.l = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            y = self.bn(self.c(x))
        return self.l(y.mean((2, 3)))


def test_qat_refuses_an_fx_capture_that_drops_a_no_grad_block():
    """symbolic_trace drops ``with torch.no_grad()``; prepare_qat (check=False by
    default) made the frozen conv and batch norm a trainable QAT layer, where PTQ's
    prepare refused the same capture. It refuses too now; export keeps the block."""
    from rewrite.flows.qat import prepare_qat
    from rewrite.ruleset import CaptureError

    torch.manual_seed(0)
    m, x = _FrozenBackbone().eval(), torch.randn(2, 3, 6, 6)
    before = copy.deepcopy(m.state_dict())
    with pytest.raises(CaptureError, match="no_grad"):
        prepare_qat(m, (x,), calibration=[(x,)], capture="fx")
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    qat = prepare_qat(m, (x,), calibration=[(x,)], capture="export")
    qat(x).sum().backward()
    trained = {n for n, p in qat.named_parameters() if p.grad is not None}
    assert trained and all("l" in n.split(".")[0] or "linear" in n for n in trained), trained


def test_coverage_names_a_layer_inside_a_no_grad_block():
    """An export capture keeps a no_grad block as a higher-order op the rules do not
    enter: its conv stayed float and coverage said "none left in float"."""
    import rewrite.quant as rq

    torch.manual_seed(0)
    m, x = _FrozenBackbone().eval(), torch.randn(2, 3, 6, 6)
    q = rq.quantize(m, [(torch.randn_like(x),) for _ in range(2)], (x,), capture="export")
    cov = rq.coverage(q)
    assert dict(cov.lowered) == {"linear": 1}
    (layer,) = cov.left_float
    assert layer.op == "conv" and layer.layer == "c" and "higher-order op" in layer.reason
    assert "0 of 1 conv" in str(cov)


class _Counter(nn.Module):
    """A step counter the forward advances in place."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        self.n.add_(1)
        return self.c(x) * self.n


def test_ptq_calibration_leaves_the_models_own_state_where_it_was():
    """Three calibration batches advanced the int8 model's counter to 3: its first
    call computed 4x what the caller's model computes on its first call."""
    import rewrite.quant as rq

    torch.manual_seed(0)
    m, x = _Counter().eval(), torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        ref = copy.deepcopy(m)(x)
    for form in ("int8", "qdq"):
        q = rq.quantize(m, [(torch.randn_like(x),) for _ in range(3)], (x,), capture="export", form=form)
        assert m.n.item() == 0.0
        with torch.no_grad():
            got = q(x)
        assert rq.sqnr(ref, got) > 25, form
    observed = rq.prepare(m, (x,), capture="export")
    rq.calibrate(observed, [(x,), (x,)])
    assert observed.n.item() == 0.0  # the observers saw both batches; the counter is as it was
    assert any(getattr(mod, "min_val", torch.tensor(float("inf"))).numel() and
               torch.isfinite(getattr(mod, "min_val", torch.tensor(float("inf")))).all()
               for mod in observed.modules() if hasattr(mod, "min_val"))


def test_qat_calibration_leaves_the_models_own_state_where_it_was():
    from rewrite.flows.qat import prepare_qat

    torch.manual_seed(0)
    m, x = _Counter().eval(), torch.randn(2, 3, 6, 6)
    qat = prepare_qat(m, (x,), calibration=[(x,), (x,), (x,)], capture="export")
    counters = [b for name, b in qat.named_buffers() if name.split(".")[-1] == "n"]
    assert counters and all(c.item() == 0.0 for c in counters)
    assert m.n.item() == 0.0


def _outputs(n):
    class M(torch.nn.Module):
        def forward(self, x):
            return tuple(torch.sigmoid(x + i) * 1 for i in range(n))

    return torch.fx.symbolic_trace(M())


def test_skip_rule_rolls_a_rule_wrong_at_many_places_back_everywhere():
    """A wrong rule firing at 17 places made skip-rule give up after 16 rollbacks
    (EquivalenceError), one bisection each; the right rule's 17 applications stay."""
    import warnings

    rules = rewrite.parse("rule m1: mul(x, 1) where is_float(x) => x\nrule bad: sigmoid(x) => x\n", "cap.rw")
    x = torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = rules.apply(_outputs(17), (x,), on_mismatch="skip-rule")
    assert result.counts == {"m1": 17}
    assert [r.rule for r in result.rejected] == ["bad"] * 3 and result.rejected[-1].everywhere
    assert "at every node" in str(result.rejected[-1])
    gm = result.graph_module
    assert sum(n.target is torch.sigmoid for n in gm.graph.nodes) == 17
    assert all(torch.equal(a, b) for a, b in zip(gm(x), _outputs(17)(x)))


def test_a_rule_wrong_at_two_places_keeps_its_right_applications():
    import warnings

    rules = rewrite.parse("rule bad: add(x, c) where is_number(c) and value(c) >= 15 => x\n", "two.rw")
    x = torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = rules.apply(_outputs(17), (x,), on_mismatch="skip-rule")
    assert [r.rule for r in result.rejected] == ["bad", "bad"] and not any(r.everywhere for r in result.rejected)


def test_skip_rule_says_what_it_rolled_back_when_it_gives_up():
    """Seventeen wrong rules, one place each: after 16 rollbacks the error says so."""
    import warnings

    body = "\n".join(f"rule bad{i}: add(x, {i}) => x" for i in range(1, 18))
    rules = rewrite.parse(body + "\n", "many.rw")
    x = torch.randn(3, 4)
    with warnings.catch_warnings(), pytest.raises(rewrite.EquivalenceError) as info:
        warnings.simplefilter("ignore")
        rules.apply(_outputs(18), (x,), on_mismatch="skip-rule")
    assert len(info.value.rolled_back) == 16
    assert 'skip-rule" rolled back 16 applications' in str(info.value)


def test_rules_rewriting_two_places_into_one_term_are_no_cycle():
    """``x * 2 => x + x`` and ``(x + x) * 1 => x * 2`` settle after five rewrites; the
    loop detector saw ``mul(x, 2)`` recreated twice (at two places) and called it a
    cycle. A real cycle still stops with its rules named."""
    from rewrite.engine.driver import NonTerminationError

    class M(torch.nn.Module):
        def forward(self, x):
            return x * 2, (x + x) * 1, (x + x) * 1

    x = torch.randn(3, 4)
    rules = rewrite.parse("rule p: mul(x, 2) where is_float(x) => add(x, x)\n"
                          "rule r: mul(add(x, x), 1) where is_float(x) => mul(x, 2)\n")
    result = rules.apply(torch.fx.symbolic_trace(M()), (x,))
    assert result.counts == {"p": 3, "r": 2}
    assert all(torch.equal(a, b) for a, b in zip(result.graph_module(x), M()(x)))
    looping = rewrite.parse("rule p: mul(x, 2) where is_float(x) => add(x, x)\n"
                            "rule q: add(x, x) where is_float(x) => mul(x, 2)\n")
    with pytest.raises(NonTerminationError, match="'p', 'q'"):
        looping.apply(torch.fx.symbolic_trace(M()), (x,))


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return (torch.relu(x) * 1) * (self.w * 1)


def test_explain_says_when_the_schedule_never_runs_a_rule():
    """``main`` runs wfold only: explain said "m1 matches" where apply never fires it."""
    rules = rewrite.parse("rule m1: mul(x, 1) where is_float(x) => x\n"
                          "rule wfold: mul(w, 1) where const(w) => w\n"
                          "ruleset main = fixpoint(wfold)\n", "e.rw")
    x = torch.randn(3, 4)
    gm = torch.fx.symbolic_trace(_Scaled().eval())
    assert rules.apply(gm, (x,)).counts == {"wfold": 1}
    matched = [e for e in rules.explain(gm, rule="m1", example_inputs=(x,)) if e.matched]
    assert matched and all("never runs rule 'm1'" in str(e) for e in matched)
    assert all("never runs" not in str(e) for e in rules.explain(gm, rule="wfold", example_inputs=(x,)))


def test_explain_says_a_parameter_is_no_constant_because_the_graph_may_train():
    """On an export graph ``const(w)`` is false for a parameter (the module may train);
    explain said "false" with no word why, and took no ``training=``."""
    import warnings

    rules = rewrite.parse("rule wfold: mul(w, 1) where const(w) => w\n", "e.rw")
    x = torch.randn(3, 4)
    gm = torch.export.export(_Scaled(), (x,)).module()
    node = next(n.name for n in gm.graph.nodes if n.op == "call_function" and n.args[0].op == "get_attr")
    (e,) = rules.explain(gm, rule="wfold", node=node, example_inputs=(x,))
    assert not e.matched and "may be trained" in e.actual and "training=False" in e.actual
    (e,) = rules.explain(gm, rule="wfold", node=node, example_inputs=(x,), training=False)
    assert e.matched
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert rules.apply(gm, (x,), training=False).counts == {"wfold": 1}


@pytest.mark.parametrize("shape, clause, fires", [
    ((8, 8), "shape(x) != 8", True),        # a shape is no int (``shape(x) == 8`` held for (8, 8))
    ((8,), "shape(x) != 8", True),
    ((8,), "shape(x) == [8]", True),
    ((8, 8), "shape(x) == [8, 8]", True),
    ((8, 8), "shape(x)[0] == 8", True),
])
def test_a_computed_shape_compares_as_python_does(shape, clause, fires):
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x)

    rules = rewrite.parse(f"rule r: relu(x) where {clause} => clone(relu(x))\nruleset main = once(r)")
    assert bool(rules.apply(torch.fx.symbolic_trace(M()), (torch.randn(*shape),)).counts) == fires


def test_a_shape_equal_to_an_int_is_reported_and_a_stride_variable_still_expands():
    with pytest.raises(rewrite.RuleError) as info:
        rewrite.parse("rule r: relu(x) where shape(x) == 8 => x")
    assert info.value.diagnostics[0].code == "E306"

    class C(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(3, 3, 3, stride=1)

        def forward(self, x):
            return self.c(x)

    rules = rewrite.parse("rule r: conv(x, w, b, s) where s == 1 => clone(conv(x, w, b, s))\nruleset main = once(r)")
    assert rules.apply(torch.fx.symbolic_trace(C()), (torch.randn(1, 3, 8, 8),)).counts == {"r": 1}


@pytest.mark.parametrize("clause", [
    "value(s) > 0.5 and value(s) < 2.0",  # an open interval: only 1.0 (where the rule is right) was drawn in it
    "value(s) in (1.0, 1.5)",
    "value(s) == 1.5 or value(s) == 1.0",
    "value(s) >= 1.0 and not value(s) > 1.5",
])
def test_a_bound_under_in_or_not_is_drawn_about_too(clause):
    """``leaky_relu(x, 1.0)`` is ``x``; a rule firing for slopes up to 1.5 is wrong
    at 1.5, which the table does not hold: bounds inside ``in``, ``or`` and ``not``
    were not drawn about, and these verified ok."""
    rules = rewrite.parse(f"rule r: leaky_relu(x, s) where {clause} => x")
    (verdict,) = verify_rules(rules, max_examples=20, seed=0).verdicts
    assert verdict.status == "counterexample", verdict


def test_a_cycle_through_a_rebuilt_reader_is_still_caught():
    """``exp(mul(x, 2)) => exp(add(x, x))`` with ``add(x, x) => mul(x, 2)``: the
    recreated ``add`` is read by a new ``exp`` each turn; keying it by its readers'
    names let the cycle run to the rewrite bound (66 s on 10k nodes)."""
    from rewrite.engine.driver import NonTerminationError

    class M(torch.nn.Module):
        def forward(self, x):
            return torch.exp(x * 2) + 1

    x = torch.randn(4, 5)
    gm = torch.export.export(M(), (x,)).module()
    rules = rewrite.parse("rule a: exp(mul(x, 2)) => exp(add(x, x))\nrule b: add(x, x) => mul(x, 2)\n")
    with pytest.raises(NonTerminationError, match="undo each other: near node") as info:
        rules.apply(gm, example_inputs=(x,))
    assert set(info.value.rules) == {"a", "b"}


def test_a_multi_output_rule_that_matches_its_own_output_is_e409():
    """``aten.max.dim(x, d, k) as (_, _) => aten.max.dim(neg(x), d, k)`` loaded and then
    ran to the rewrite bound; the single-output ``exp(x) => exp(neg(x))`` was E409."""
    with pytest.raises(rewrite.RuleError) as info:
        rewrite.parse("rule a: aten.max.dim(x, d, k) as (_, _) => aten.max.dim(neg(x), d, k)")
    assert info.value.diagnostics[0].code == "E409"
    rewrite.parse("rule a: aten.max.dim(x, d, k) as (_, _) => aten.max.dim(neg(x), d, k)\n"
                  "ruleset main = once(a)")  # run once, it settles


def test_a_model_built_under_inference_mode_that_writes_its_state_gets_a_clear_error():
    """A train-mode batch norm made under ``torch.inference_mode()``: the check read
    the version counter of its inference-tensor statistics and raised torch's raw
    "Inference tensors do not track version counter"."""
    with torch.inference_mode():
        m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        x = torch.randn(2, 3, 8, 8)
        with pytest.raises(ValueError, match="inference tensor.*check=False"):
            rewrite.load(rewrite.rules_dir() / "fusion.rw").apply(m, example_inputs=(x,))
        result = rewrite.load(rewrite.rules_dir() / "fusion.rw").apply(m, example_inputs=(x,), check=False)
        assert result.counts == {}  # a train-mode batch norm is not folded
        frozen = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    # a model made under inference mode that writes nothing is checked as any other (it was refused)
    result = rewrite.load(rewrite.rules_dir() / "fusion.rw").apply(frozen, example_inputs=(x,))
    assert result.counts == {"conv_bn": 1}


def test_a_trace_that_loses_a_write_through_a_view_is_refused():
    """symbolic_trace turns ``v += 1`` on a view of the input into an out-of-place add:
    the caller's input is no longer written. apply refuses the capture (probe BV)."""
    from rewrite.ruleset import CaptureError

    class M(nn.Module):
        def forward(self, x):
            v = x[:, :2]
            v += 1
            return x[:, 2:] * 1.0

    x = torch.randn(3, 4)
    given = x.clone()
    with pytest.raises(CaptureError, match="writes into this input"):
        rewrite.load(rewrite.rules_dir() / "cleanup.rw").apply(M(), example_inputs=(x,))
    assert torch.equal(x, given)


def test_a_cycle_that_rebuilds_the_roots_input_is_caught_early():
    """``sigmoid(neg(x)) => sigmoid(mul(x, -1))`` and back makes a new inner node each
    turn: no signature by input names repeats, and the run went to the default bound
    (61,061 rewrites, ~10 s on 3k nodes). What a rule-made input computes is compared
    now, and the cycle stops within a few turns per place."""
    from rewrite.engine.driver import NonTerminationError

    class M(torch.nn.Module):
        def forward(self, x):
            return torch.stack([torch.sigmoid(-x[i]) for i in range(50)])

    x = torch.randn(50, 5)
    rules = rewrite.parse("rule a: sigmoid(neg(x)) => sigmoid(mul(x, -1))\n"
                          "rule b: sigmoid(mul(x, -1)) => sigmoid(neg(x))\n")
    with pytest.raises(NonTerminationError, match="rules 'a', 'b' undo each other: near node"):
        rules.apply(torch.fx.symbolic_trace(M()), (x,), check=False)
