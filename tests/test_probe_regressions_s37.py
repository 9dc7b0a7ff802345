"""Regressions from session 37's adversarial probes and open items. Each test
failed before its fix."""
import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import rewrite

# rules whose replacement is a copy where the matched value may be a view at run time
COPYING_AT_RUN_TIME = """
rule reshape_copy: reshape(x, s) => clone(reshape(x, s))
rule flatten_copy: flatten(x, a, b) => clone(flatten(x, a, b))
rule reshape_as_copy: reshape_as(x, o) => clone(reshape_as(x, o))
rule contiguous_copy: contiguous(x) => clone(x)
ruleset copies = once(reshape_copy, flatten_copy, reshape_as_copy, contiguous_copy)
"""


class _ThroughReshape(nn.Module):
    def forward(self, x):
        h = x * 2.0
        h.reshape(-1).add_(1.0)
        return h


class _ThroughFlatten(nn.Module):
    def forward(self, x):
        h = x * 2.0
        h.flatten(0, 1).mul_(3.0)
        return h + 1


class _ThroughReshapeAs(nn.Module):
    def forward(self, x):
        h = x * 2.0
        h.reshape_as(h).sub_(1.0)
        return h


class _ThroughContiguous(nn.Module):
    def forward(self, x):
        h = x * 2.0
        h.contiguous().add_(1.0)
        return h


class _IntoBaseAfterReshape(nn.Module):  # a write into the memory reaches the reshape's readers
    def forward(self, x):
        h = x * 2.0
        v = h.reshape(-1)
        h.add_(1.0)
        return v * 3


class _InputThroughReshape(nn.Module):  # the caller's tensor, written through a run-time view
    def forward(self, x):
        x.reshape(-1).add_(1.0)
        return x.sum()


class _ReshapeReturnedWithBase(nn.Module):
    def forward(self, x):
        h = x * 2.0
        return h, h.reshape(-1)


class _ReshapeReadOnly(nn.Module):  # nothing observes the sharing: the rules fire
    def forward(self, x):
        h = x * 2.0
        return h.reshape(-1) + 1, h.flatten(0, 1) * 2, h.contiguous() - 1


def _capture(model, capture, x):
    if capture == "fx":
        return fx.symbolic_trace(model)
    return torch.export.export(model, (x.clone(),)).module()


def _leaves(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("model", [_ThroughReshape, _ThroughFlatten, _ThroughReshapeAs, _ThroughContiguous,
                                   _IntoBaseAfterReshape, _InputThroughReshape, _ReshapeReturnedWithBase])
def test_a_run_time_view_whose_sharing_is_observed_is_not_made_a_copy(model, capture):
    """Probe Z4 F4: ``reshape``, ``flatten``, ``reshape_as`` and ``contiguous`` view
    their input at run time (a contiguous one); replaced by a copy, a write through
    them no longer reached the memory they viewed, even unchecked."""
    x = torch.randn(3, 4)
    gm = _capture(model(), capture, x)
    result = rewrite.parse(COPYING_AT_RUN_TIME)["copies"].apply(gm, example_inputs=(x.clone(),), check=False)
    xa, xb = x.clone(), x.clone()
    want, got = model()(xa), result.graph_module(xb)
    for a, b in zip(_leaves(want), _leaves(got)):
        assert torch.equal(a, b)
    assert torch.equal(xa, xb)
    if isinstance(want, tuple):
        shares = {t.untyped_storage().data_ptr() for t in want}
        assert len({t.untyped_storage().data_ptr() for t in got}) == len(shares)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_run_time_view_nobody_observes_is_still_rewritten(capture):
    x = torch.randn(3, 4)
    gm = _capture(_ReshapeReadOnly(), capture, x)
    result = rewrite.parse(COPYING_AT_RUN_TIME)["copies"].apply(gm, example_inputs=(x.clone(),))
    # export leaves out a contiguous() of a contiguous tensor
    assert sum(result.counts.values()) == (3 if capture == "fx" else 2), result.counts
    for a, b in zip(_ReshapeReadOnly()(x), result.graph_module(x)):
        assert torch.equal(a, b)


def test_a_cast_to_another_dtype_is_a_copy_not_a_view():
    """The metadata shows ``to(h, float64)`` is new memory: a write into ``h``
    after it does not make its replacement unsound, and the rule fires."""
    class M(nn.Module):
        def forward(self, x):
            h = x * 2.0
            d = h.to(torch.float64)
            h.add_(1.0)
            return d * 3, h

    rules = rewrite.parse("rule to_copy: to(x, t) where dtype(x) != t => clone(to(x, t))\n"
                          "ruleset once_only = once(to_copy)")["once_only"]
    x = torch.randn(3, 4)
    gm = torch.export.export(M(), (x.clone(),)).module()
    result = rules.apply(gm, example_inputs=(x.clone(),))
    assert result.counts == {"to_copy": 1}
    for a, b in zip(M()(x.clone()), result.graph_module(x.clone())):
        assert torch.equal(a, b)


class _PermutedReshape(nn.Module):
    """``reshape`` of a permuted value copies for a batch of 2 or more and views
    (strided) for a batch of 1; ``cat([r])`` lays ``r`` out contiguously."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        r = self.lin(x).permute(0, 2, 1).reshape(-1, 3)
        return torch.cat([r]).view(-1), torch.cat([r])


def test_a_layout_the_example_size_chose_is_not_a_fact_for_every_size():
    """Probe AA F1: exported with a dynamic batch (``Dim(min=1)``) from a batch of 2,
    cleanup's ``cat_single`` trusted the reshape's contiguous copy; at batch 1 the
    rewritten model raised on its ``view(-1)`` and returned strided outputs."""
    torch.manual_seed(0)
    model = _PermutedReshape().eval()
    x = torch.randn(2, 3, 4)
    batch = torch.export.Dim("B", min=1, max=64)
    gm = torch.export.export(model, (x,), dynamic_shapes=({0: batch},)).module()
    result = rewrite.load("rules/cleanup.rw").apply(gm, example_inputs=(x,))
    assert "cat_single" not in result.counts
    for size in (1, 2, 5):
        xb = torch.randn(size, 3, 4)
        want, got = gm(xb), result.graph_module(xb)
        for a, b in zip(want, got):
            assert torch.equal(a, b) and a.stride() == b.stride()


def test_a_static_reshape_still_lets_cat_single_fire():
    torch.manual_seed(0)
    model = _PermutedReshape().eval()
    x = torch.randn(2, 3, 4)
    result = rewrite.load("rules/cleanup.rw").apply(torch.export.export(model, (x,)).module(), example_inputs=(x,))
    assert result.counts.get("cat_single", 0) >= 1, result.counts
    for a, b in zip(model(x), result.graph_module(x)):
        assert torch.equal(a, b) and a.stride() == b.stride()


class _Masked(nn.Module):
    def forward(self, x):
        return -(-(x[x > 0] * 2))


@pytest.mark.parametrize("check", [True, False])
def test_a_size_known_only_from_data_does_not_crash_apply(check):
    """Probe AA F2: restoring an output's layout compared an unbacked size with 2
    outside any guard: ``GuardOnDataDependentSymNode`` out of ``apply``."""
    x = torch.randn(3, 4)
    gm = torch.export.export(_Masked(), (x,)).module()
    result = rewrite.load("rules/cleanup.rw").apply(gm, example_inputs=(x,), check=check)
    assert result.counts == {"neg_neg": 1}
    assert torch.equal(result.graph_module(x), _Masked()(x))


def test_the_backend_on_an_unbacked_batch():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x).t() * 1.0

    torch._dynamo.reset()
    torch.manual_seed(0)
    m = M().eval()
    x = torch.randn(3, 4)
    torch._dynamo.decorators.mark_unbacked(x, 0)
    with torch.no_grad():
        got = torch.compile(m, backend=rewrite.backend(rewrite.load("rules/cleanup.rw")))(x)
        assert torch.equal(got, m(x))
    torch._dynamo.reset()


@pytest.mark.parametrize("clause, hint", [
    ('produced_by(x, "cnov")', "did you mean 'conv'?"),
    ('not feeds(x, "rleu", "hardtanh")', "did you mean 'relu'?"),
    ('produced_by(x, "aten.conv2d")', "the op is called 'conv' here"),
    ('produced_by(x, 3)', "write the op's name in quotes"),
])
def test_an_op_name_no_op_has_is_refused_at_load(clause, hint):
    """Probe AB F1: a misspelt op name given to feeds/produced_by loaded cleanly and
    the rule never fired (under ``not``, its guard always held)."""
    with pytest.raises(rewrite.RuleError) as err:
        rewrite.parse(f"rule r: neg(x) where {clause} => x")
    text = str(err.value)
    assert "[E208]" in text and hint in text and "<string>:1:" in text


def test_op_names_the_engine_gives_load_and_match():
    rules = rewrite.parse('rule r: neg(neg(x)) where produced_by(x, "conv", "linear") => x')

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 1)

        def forward(self, x):
            return -(-self.conv(x))

    x = torch.randn(1, 2, 3, 3)
    result = rules.apply(fx.symbolic_trace(M()), example_inputs=(x,))
    assert result.counts == {"r": 1}


class _FeatureAndTokens(nn.Module):  # a feature map and its pixels as rows
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        f = self.conv(x)
        return f, f.permute(0, 2, 3, 1).reshape(-1, 8)


@pytest.mark.parametrize("dims", [(0,), (2, 3), (0, 2, 3)])
def test_a_layout_over_three_symbolic_sizes_is_known(dims):
    """Probe AA F3: with batch, height and width symbolic, the input's layout was
    undecidable (``numel() < 2``, ``is_contiguous`` ask whether sizes are 1), so
    amp_bf16's exit rule did not give the conv's output its contiguous layout back:
    its own check failed, and unchecked the two outputs shared memory."""
    torch.manual_seed(0)
    model = _FeatureAndTokens().eval()
    x = torch.randn(2, 3, 8, 8)
    dynamic = {d: torch.export.Dim(f"d{d}", min=1, max=64) for d in dims}
    gm = torch.export.export(model, (x,), dynamic_shapes=(dynamic,)).module()
    rules = rewrite.load("rules/amp_bf16.rw")
    assert rules.apply(gm, example_inputs=(x,), training=False).counts.get("exit_contiguous_bf16") == 1
    unchecked = rules.apply(gm, example_inputs=(x,), check=False, training=False).graph_module
    other = tuple(n if d in dims else x.shape[d] for d, n in enumerate((1, 3, 5, 7)))
    for xb in (x, torch.randn(other)):
        want, got = gm(xb), unchecked(xb)
        assert got[0].stride() == want[0].stride()
        shares = [o[0].untyped_storage().data_ptr() == o[1].untyped_storage().data_ptr() for o in (want, got)]
        assert shares[0] == shares[1]
        for a, b in zip(want, got):
            assert torch.allclose(a, b, atol=0.1, rtol=0.05)


class _FusedFakeQuant(nn.Module):
    """torch.ao's default QAT fake quantizer, which traces to a call of
    ``torch.fused_moving_avg_obs_fake_quant`` that updates its observer state."""

    def __init__(self):
        super().__init__()
        from torch.ao.quantization import FusedMovingAvgObsFakeQuantize

        self.fc = nn.Linear(8, 8)
        self.fq = FusedMovingAvgObsFakeQuantize()

    def forward(self, x):
        return torch.relu(torch.relu(self.fq(self.fc(x))))


def test_a_torch_function_whose_schema_writes_is_known_to_write():
    """Probe AB F2/F3: a torch function spelt without a trailing underscore was taken
    to write nothing, whatever its aten schema says: cleanup failed its own check on
    a QAT model (the observer state was not put back between runs), and E105 let a
    replacement call it on pattern variables."""
    torch.manual_seed(0)
    model = _FusedFakeQuant().train()
    gm = fx.symbolic_trace(model)
    result = rewrite.load("rules/cleanup.rw").apply(gm, example_inputs=(torch.randn(4, 8),))
    assert result.counts == {"relu_relu": 1}
    fq = next(n for n in gm.graph.nodes if n.target is torch.fused_moving_avg_obs_fake_quant)
    from rewrite.ops.effects import written_args
    assert tuple(written_args(fq, gm)) == (3, 4, 5, 6)
    with pytest.raises(rewrite.RuleError, match="E105"):
        rewrite.parse("rule r: add(x, y) => torch.fused_moving_avg_obs_fake_quant(x, y, y, y, y, y, y, 0.5, 0, 255, -1)")


class _PatchTokens(nn.Module):  # ViT's patch embedding: a dense permuted output
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 4, stride=4)

    def forward(self, x):
        return self.conv(x).flatten(2).transpose(1, 2)


@pytest.mark.parametrize("rules", ["amp_bf16", "amp_fp16"])
def test_a_permuted_output_keeps_its_strides_under_a_symbolic_batch(rules):
    """Probe AA F4: with a dynamic batch the output's strides are symbolic, and the
    layout restore only knew concrete ones: unchecked, the output changed strides."""
    torch.manual_seed(0)
    model = _PatchTokens().eval()
    x = torch.randn(2, 3, 16, 16)
    gm = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("B", min=1, max=16)},)).module()
    result = rewrite.load(f"rules/{rules}.rw").apply(gm, example_inputs=(x,), check=False)
    assert any(name.startswith("conv_") for name in result.counts)
    for size in (1, 2, 3):
        xb = torch.randn(size, 3, 16, 16)
        want, got = gm(xb), result.graph_module(xb)
        assert got.stride() == want.stride() and torch.allclose(got, want, atol=0.1, rtol=0.05)


class _AttentionTransposed(nn.Module):  # returns a transposed view of the attention
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 4).permute(2, 0, 3, 1, 4)
        out = torch.softmax(q @ k.transpose(-2, -1) * 0.5, dim=-1) @ v
        return out.transpose(1, 2)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_view_of_sdpa_keeps_the_layout_the_written_out_attention_gave(capture):
    """Probe AA F5: sdpa lays its output out as its query on CPU, its meta and fake
    kernels contiguously; a kept transpose of it was taken to keep its strides, so
    unchecked the output's strides changed (symbolic_trace, dynamo)."""
    torch.manual_seed(0)
    model = _AttentionTransposed().eval()
    x = torch.randn(2, 5, 16)
    gm = _capture(model, capture, x)
    result = rewrite.load("rules/transformer.rw").apply(gm, example_inputs=(x,), check=False)
    assert result.counts.get("attention_scale") == 1
    want, got = model(x), result.graph_module(x)
    assert got.stride() == want.stride() and torch.allclose(got, want, atol=1e-5)


def test_the_backend_keeps_the_attention_views_layout():
    torch.manual_seed(0)
    model = _AttentionTransposed().eval()
    x = torch.randn(2, 5, 16)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, backend=rewrite.backend(rewrite.load("rules/transformer.rw"), check=False))(x)
        assert got.stride() == model(x).stride() and torch.allclose(got, model(x), atol=1e-5)
    torch._dynamo.reset()


def test_an_import_path_cannot_write_terminal_escapes_or_lines(tmp_path):
    """Probe AB F4: an import path (string escapes are legal) reached the diagnostics
    as it was: raw escape sequences and a forged ``evil.rw: ok`` line."""
    evil = tmp_path / "evil.rw"
    evil.write_text('import "\\x1b[2J\\x07x\\nevil.rw: ok (0 rules)\\n.rw"\n')
    with pytest.raises(rewrite.RuleError) as err:
        rewrite.load(str(evil))
    text = str(err.value)
    assert "E402" in text and "\x1b" not in text and "\x07" not in text
    assert not any(line.startswith("evil.rw: ok") for line in text.splitlines())


def test_a_registered_name_no_rule_file_could_use_is_refused():
    """Probe AB F5: ``register_constant(name="relu")`` took the op's place in every
    replacement; names such as ``where`` or ``a.b`` were accepted and never callable."""
    for name in ("relu", "where", "a.b", "", "1x", "class"):
        with pytest.raises(ValueError, match="cannot register"):
            rewrite.register_constant(name=name)(lambda x: x)
    rules = rewrite.parse("rule r: relu(neg(neg(x))) => relu(x)")

    class M(nn.Module):
        def forward(self, x):
            return torch.relu(-(-x))

    assert rules.apply(fx.symbolic_trace(M()), example_inputs=(torch.randn(3),)).counts == {"r": 1}


def test_replacing_a_registered_function_warns():
    from rewrite.functions import registry

    before = registry.lookup_function("single_use")
    try:
        with pytest.warns(UserWarning, match="replaces the predicate"):
            rewrite.register_predicate(name="single_use")(lambda x: True)
    finally:
        registry._REGISTRY["single_use"] = before


def test_python_api_mistakes_get_clear_errors():
    """Probe AB F6: ``apply(inplace="no")`` rewrote the caller's module (any truthy
    value meant in place); ``only("typo")`` failed later with a bare KeyError."""
    rules = rewrite.load("rules/cleanup.rw")
    gm = fx.symbolic_trace(_ReshapeReadOnly())
    for flag in ("inplace", "check"):
        with pytest.raises(TypeError, match=f"{flag} must be True or False"):
            rules.apply(gm, example_inputs=(torch.randn(3, 4),), **{flag: "no"})
    with pytest.raises(KeyError, match="no rule named 'relu_rleu'"):
        rules.only("relu_rleu")
    with pytest.raises(TypeError):
        rules.only(3)
    with pytest.raises(TypeError):
        rules + 3
    with pytest.raises(TypeError, match="explain needs"):
        rules.explain(42)


def test_the_check_tries_the_smallest_sizes_a_dynamic_export_accepts(monkeypatch):
    """Probe AA: every trial took the example's sizes, so a rewrite right only there
    passed the check (cat_single on a reshape that copies at batch 2 and views at
    batch 1). With the is_contiguous guard taken away, the check alone catches it."""
    import rewrite.functions.builtins as builtins

    monkeypatch.setattr(builtins, "_copy_by_size", lambda node: False)
    torch.manual_seed(0)
    model = _PermutedReshape().eval()
    x = torch.randn(2, 3, 4)
    gm = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("B", min=1, max=64)},)).module()
    with pytest.raises(rewrite.EquivalenceError, match="cat_single"):
        rewrite.load("rules/cleanup.rw").apply(gm, example_inputs=(x,))


def test_sizes_the_program_refuses_are_a_skipped_trial():
    class M(nn.Module):  # row 1 exists only from a batch of 2
        def forward(self, x):
            return -(-x) * x[1]

    x = torch.randn(4, 3)
    gm = torch.export.export(M(), (x,), dynamic_shapes=({0: torch.export.Dim("B", min=2, max=64)},)).module()
    result = rewrite.load("rules/cleanup.rw").apply(gm, example_inputs=(x,))
    assert result.counts == {"neg_neg": 1}
    assert result.equivalence.ok and result.equivalence.skipped == 1


@pytest.mark.parametrize("replacement, param", [
    ("add(x, mul(operator.getitem(torch.linspace(0, 1, 1500000000), 0), 0.0))", "steps"),
    ("add(x, Tensor.new_zeros(x, [4611686018427387904]))", "size"),
    ("Tensor.repeat(x, [1000000, 1000000])", "repeats"),
])
def test_a_literal_size_without_bound_is_refused_at_load(replacement, param):
    """Probe AB F7: sizes written as literals were unbounded: a one-line rule made the
    check and verify allocate gigabytes (OOM at 23 GB)."""
    with pytest.raises(rewrite.RuleError) as err:
        rewrite.parse(f"rule r: neg(neg(x)) => {replacement}")
    assert "[E207]" in str(err.value) and f"argument '{param}'" in str(err.value)


def test_small_literal_sizes_load():
    rewrite.parse("rule r: neg(neg(x)) => Tensor.repeat(x, [2, 3])\nrule s: neg(neg(x)) => reshape(x, [-1])")


class _UpdatesStats(nn.Module):  # an unannotated write: the schema says nothing
    def __init__(self):
        super().__init__()
        self.register_buffer("rm", torch.zeros(3))
        self.register_buffer("rv", torch.ones(3))

    def forward(self, x):
        mean, var = torch.batch_norm_update_stats(x, self.rm, self.rv, 0.1)
        return torch.neg(torch.neg(x - mean))


@pytest.mark.parametrize("model_type", [_FusedFakeQuant, _UpdatesStats])
@pytest.mark.parametrize("traced", [True, False])
@pytest.mark.parametrize("check", [True, False])
def test_apply_leaves_state_the_graph_writes_as_it_was(model_type, traced, check):
    """Probe AB F12: the graph's writes of a QAT fake quantizer's observer state
    (``torch.fused_moving_avg_obs_fake_quant``) and of ``batch_norm_update_stats``'s
    running statistics were unknown, so apply's own runs wrote the caller's model."""
    torch.manual_seed(0)
    model = model_type().train()
    x = torch.randn(4, 8) if model_type is _FusedFakeQuant else torch.randn(4, 3)
    given = fx.symbolic_trace(model) if traced else model
    before = {k: v.clone() for k, v in given.state_dict().items()}
    rules = rewrite.parse("rule r: neg(neg(x)) => x\nrule rr: relu(relu(x)) => relu(x)")
    try:
        rules.apply(given, example_inputs=(x,), check=check)
    except rewrite.CaptureError:
        pass  # nothing to rewrite in the traced module: what matters is what apply left behind
    after = given.state_dict()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []


def test_families_nested_by_doubling_load():
    """Probe AB F8: each family was expanded once per way down to it (2^n for
    ``family f{i} = f{i-1} | f{i-1}``): a 500-byte file took seconds, a longer one
    never loaded. Expanded once each, 40 levels load at once (no timing asserted:
    without the fix this would not finish)."""
    lines = ["family f0 = relu | gelu"] + [f"family f{i} = f{i - 1} | f{i - 1}" for i in range(1, 40)]
    rules = rewrite.parse("\n".join(lines) + "\nrule r: neg(neg(f39(_) as y)) => y")
    assert "r" in rules.rules


def test_rule_sets_nested_by_doubling_run_as_one_fixpoint():
    """Probe AB F9: ``ruleset s{i} = fixpoint(s{i-1}, s{i-1})`` is ``fixpoint(r)``, but
    every walk of the schedule (scheduled_rules, only, apply, verify) took 2^n steps."""
    text = ("rule r: neg(neg(x)) => x\nruleset s0 = fixpoint(r)\n"
            + "".join(f"ruleset s{i} = fixpoint(s{i - 1}, s{i - 1})\n" for i in range(1, 40))
            + "ruleset main = fixpoint(s39)\n")
    rules = rewrite.parse(text)["main"]
    assert rules.scheduled_rules() == ("r",)
    assert rules.only("r").scheduled_rules() == ("r",)

    class M(nn.Module):
        def forward(self, x):
            return -(-x) * 2

    assert rules.apply(fx.symbolic_trace(M()), example_inputs=(torch.randn(3),)).counts == {"r": 1}


@pytest.mark.parametrize("module", ["rewrite.quant", "rewrite.qat", "rewrite.functions.quant",
                                    "rewrite.functions.builtins", "rewrite.flows.quant", "rewrite.cli"])
def test_each_entry_point_imports_first_in_a_fresh_process(module):
    """Probe AC F2: a registration asking for the built-ins while they loaded made
    ``import rewrite.quant`` a circular ImportError in a fresh process."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("module, rule", [
    ("nn.Flatten(0, 1)", "flatten"), ("nn.Identity()", "identity"), ("nn.Dropout(0.5)", "dropout")])
def test_a_module_that_returns_a_view_is_a_view(module, rule):
    """Probe AC F1: under symbolic_trace, ``nn.Flatten``, ``nn.Identity`` and an
    eval-mode ``nn.Dropout`` return (a view of) their input; a rule copying them
    where a write goes through dropped the write, unchecked."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = eval(module)

        def forward(self, x):
            h = x * 2.0
            self.m(h).add_(1.0)
            return h

    rules = rewrite.parse(f"rule r: {rule}(x) => clone(x)\nruleset once_only = once(r)")["once_only"]
    model = M().eval()
    x = torch.randn(3, 4)
    result = rules.apply(fx.symbolic_trace(model), example_inputs=(x,), check=False)
    assert torch.equal(result.graph_module(x.clone()), model(x.clone()))


def test_feeds_with_no_op_name_is_refused():
    with pytest.raises(rewrite.RuleError, match="E208"):
        rewrite.parse("rule r: relu(y) where produced_by(y) => clamp(y, min=0.0)")


def test_the_cli_escapes_a_file_name(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "ok\x1b[2Jname\nforged.rw: ok.rw"
    path.write_text("rule r: neg(neg(x)) => x\n")
    done = subprocess.run([sys.executable, "-m", "rewrite", "check", str(path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "\x1b" not in done.stdout and len(done.stdout.splitlines()) == 1


@pytest.mark.parametrize("rule", ["split(x, 2, 0) => x", "chunk(x, 2, 0) => x", "split(x, 2, 0) => neg(x)",
                                  "topk(x, 2) => x"])
def test_a_multi_output_root_replaced_by_one_tensor_is_E305(rule):
    """Probe AB F11: the readers' getitem(split, i) became x[i], unchecked."""
    with pytest.raises(rewrite.RuleError, match=r"returns several values.*\[E305\]"):
        rewrite.parse(f"rule r: {rule}")


def test_a_multi_output_root_replaced_by_a_multi_output_op_loads():
    rewrite.parse("rule r: split(x, 2, 0) => chunk(x, 2, 0)")
