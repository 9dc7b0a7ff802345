"""Regressions found in session 44: how a program runs a rule that never settles by
itself (E409's exemption across imports, once-only sweeps run twice), and whatever
the session's probes turned up."""

import subprocess
import sys

import pytest
import torch

import rewrite

GROW = "rule grow: relu(x) => relu(relu(x))\n"


class _Relu(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) + 1


def _apply(rules):
    x = torch.randn(5)
    model = _Relu()
    result = rules.apply(torch.fx.symbolic_trace(model), example_inputs=(x,))
    torch.testing.assert_close(result.graph_module(x), model(x))
    return result


def _relus(result):
    return sum(1 for n in result.graph_module.graph.nodes if n.target is torch.relu)


@pytest.mark.parametrize("schedule", ["seq(once(grow), once(grow))", "seq(grow_once, grow_once)"])
def test_two_one_sweep_runs_of_a_growing_rule_are_finite(schedule):
    """Each ``once(...)`` is one sweep: the second recreates what the first made,
    which is no cycle (it raised NonTerminationError "undoes itself")."""
    rules = rewrite.parse(GROW + f"ruleset grow_once = once(grow)\nruleset main = {schedule}\n")
    result = _apply(rules)
    assert result.counts == {"grow": 3}  # one relu, then the two it became
    assert _relus(result) == 4


def test_a_rule_set_with_a_once_only_rule_added_to_itself_runs_twice():
    once = rewrite.parse(GROW + "ruleset main = once(grow)\n", "GA.rw")
    assert _apply(once).counts == {"grow": 1}
    assert _apply(once + once).counts == {"grow": 3}


def test_rules_undoing_each_other_in_a_fixpoint_are_still_a_cycle():
    rules = rewrite.parse("rule a: neg(x) => mul(x, -1)\nrule b: mul(x, -1) => neg(x)\n"
                          "ruleset main = fixpoint(a, b)\n")

    class Neg(torch.nn.Module):
        def forward(self, x):
            return torch.neg(x) + 1

    x = torch.randn(3)
    with pytest.raises(rewrite.NonTerminationError, match="undo each other"):
        rules.apply(torch.fx.symbolic_trace(Neg()), example_inputs=(x,))


def test_a_cycle_through_once_sweeps_inside_a_fixpoint_is_still_caught():
    rules = rewrite.parse("rule a: neg(x) => mul(x, -1)\nrule b: mul(x, -1) => neg(x)\n"
                          "ruleset main = fixpoint(once(a), once(b))\n")

    class Neg(torch.nn.Module):
        def forward(self, x):
            return torch.neg(x) + 1

    with pytest.raises(rewrite.NonTerminationError):
        rules.apply(torch.fx.symbolic_trace(Neg()), example_inputs=(torch.randn(3),))


def test_steps_run_one_after_the_other_may_undo_each_other_finitely():
    """``seq`` of fixpoints that turn neg into mul and back, five steps: finite,
    though the later steps recreate nodes the earlier ones replaced."""
    steps = ", ".join(["fixpoint(a)", "fixpoint(b)"] * 2 + ["fixpoint(a)"])
    rules = rewrite.parse("rule a: neg(x) => mul(x, -1)\nrule b: mul(x, -1) => neg(x)\n"
                          f"ruleset main = seq({steps})\n")

    class Neg(torch.nn.Module):
        def forward(self, x):
            return torch.neg(x) + 1

    x = torch.randn(3)
    result = rules.apply(torch.fx.symbolic_trace(Neg()), example_inputs=(x,))
    assert result.counts == {"a": 3, "b": 2}
    assert any(n.target is torch.mul for n in result.graph_module.graph.nodes)
    torch.testing.assert_close(result.graph_module(x), -x + 1)


def _files(tmp_path, **files):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def test_an_importer_that_repeats_a_once_only_rule_gets_E409_pointing_at_its_schedule(tmp_path):
    """E409's exemption is decided over the whole program: the file defining the
    rule runs it in once(...), but an importer running it to a fixpoint loops."""
    _files(tmp_path, **{"lib.rw": GROW + "ruleset grow_once = once(grow)\n",
                        "uses.rw": 'import "lib.rw"\nruleset main = seq(grow_once, grow)\n'})
    assert _apply(rewrite.load(str(tmp_path / "lib.rw"))).counts == {"grow": 1}  # alone it is fine
    with pytest.raises(rewrite.RuleError) as err:
        rewrite.load(str(tmp_path / "uses.rw"))
    text = str(err.value)
    assert "E409" in text and "lib.rw:1:" in text
    assert "uses.rw:2:" in text and "run to a fixpoint here" in text
    out = subprocess.run([sys.executable, "-m", "rewrite", "check", str(tmp_path / "uses.rw")],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "E409" in out.stdout + out.stderr


def test_a_rule_an_importer_runs_only_once_is_not_E409(tmp_path):
    _files(tmp_path, **{"plain.rw": GROW, "runs_once.rw": 'import "plain.rw"\nruleset main = once(grow)\n'})
    with pytest.raises(rewrite.RuleError, match="E409"):
        rewrite.load(str(tmp_path / "plain.rw"))  # alone, the default schedule would loop
    assert _apply(rewrite.load(str(tmp_path / "runs_once.rw"))).counts == {"grow": 1}


def test_two_files_declaring_main_loaded_together_are_told_to_add_rule_sets(tmp_path):
    _files(tmp_path, **{"A.rw": "rule a: neg(neg(x)) => x\nruleset main = fixpoint(a)\n",
                        "B.rw": "rule b: relu(relu(x)) => relu(x)\nruleset main = fixpoint(b)\n"})
    with pytest.raises(rewrite.RuleError, match=r"E401[\s\S]*rewrite.load\(a\) \+ rewrite.load\(b\)"):
        rewrite.load(str(tmp_path / "A.rw"), str(tmp_path / "B.rw"))
    both = rewrite.load(str(tmp_path / "A.rw")) + rewrite.load(str(tmp_path / "B.rw"))
    assert set(both.rules) == {"a", "b"}


class _EmptyPlusCount(torch.nn.Module):
    def forward(self, x):
        y = torch.relu(x)
        return y, y.shape[0] + 1


class _EmptyPlusScalar(torch.nn.Module):
    def forward(self, x):
        y = torch.relu(x)
        return y, x.sum() * 0 + 1


@pytest.mark.parametrize("model", [_EmptyPlusCount, _EmptyPlusScalar])
def test_an_int_or_0d_tensor_beside_an_empty_batch_is_not_a_comparison(model):
    """Probe BC F5: a wrong rule passes a batch-0 check; the report must say that
    nothing was compared even when an int or a 0-d tensor sits beside the batch."""
    wrong = rewrite.parse("rule r: relu(x) => neg(x)\n")
    result = wrong.apply(torch.fx.symbolic_trace(model()), example_inputs=(torch.randn(0, 3),))
    assert result.counts == {"r": 1}
    assert result.equivalence.empty and "nothing was compared" in str(result.equivalence)
    with pytest.raises(rewrite.EquivalenceError):  # with a batch, the same rule is caught
        wrong.apply(torch.fx.symbolic_trace(model()), example_inputs=(torch.randn(2, 3),))


def test_a_0d_output_alone_is_still_a_comparison():
    class Total(torch.nn.Module):
        def forward(self, x):
            return torch.relu(torch.relu(x)).sum()

    good = rewrite.parse("rule r: relu(relu(x)) => relu(x)\n")
    result = good.apply(torch.fx.symbolic_trace(Total()), example_inputs=(torch.randn(4),))
    assert result.counts == {"r": 1} and not result.equivalence.empty


@pytest.mark.parametrize("rule", [
    "rule r: silu(x) where is_float(x) => torch.where(torch.gt(x, 4.0), x, silu(x))",
    "rule r: sigmoid(x) where is_float(x) => torch.where(torch.gt(x, 5.0), torch.ones_like(x), sigmoid(x))",
    "rule r: tanh(x) where is_float(x) => clamp(tanh(x), -0.9999, 0.9999)",
])
def test_verify_meets_an_exact_rule_past_the_values_it_usually_draws(rule):
    """Probe BG F1: an exact rule wrong only past 4 (and right again at the largest
    values and infinities) passed verify, whose exact instances stayed in [-4, 4]."""
    verdict = rewrite.parse(rule + "\n").verify(max_examples=10, seed=0).verdicts[0]
    assert verdict.status == "counterexample", verdict


@pytest.mark.parametrize("rule", [
    "rule r: relu(relu(x)) => relu(x)",
    "rule r: neg(neg(x)) => x",
    "rule r: mul(x, 2) where is_float(x) => add(x, x)",
    "rule r: abs(neg(x)) where is_float(x) => abs(x)",
])
def test_exact_rules_right_at_every_magnitude_still_verify(rule):
    verdict = rewrite.parse(rule + "\n").verify(max_examples=10, seed=0).verdicts[0]
    assert verdict.status == "ok", verdict


class _RnnClassifier(torch.nn.Module):
    """A text classifier being fine-tuned: CPU autocast cannot run its LSTM in float16."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.lstm = torch.nn.LSTM(16, 16, batch_first=True, num_layers=2, bidirectional=True)
        self.gru = torch.nn.GRU(32, 16, batch_first=True)
        self.fc = torch.nn.Linear(16, 4)
        self.bn = torch.nn.BatchNorm1d(4)

    def forward(self, ids):
        x, _ = self.lstm(self.emb(ids))
        x, h = self.gru(x)
        return self.bn(self.fc(x[:, -1])), h


def test_the_autocast_allowance_runs_what_autocast_refuses_in_float32():
    """Probe BF F1: where torch.autocast cannot run the model in float16 (oneDNN's
    LSTM), the AMP check had no allowance at all; now the refused call runs in
    float32 and the rest as autocast runs it."""
    from rewrite.trust.precision import narrowed_run

    torch.manual_seed(1)
    model = _RnnClassifier().eval()
    ids = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with pytest.raises(RuntimeError):
            with torch.autocast("cpu", torch.float16):
                model(ids)
        narrowed = narrowed_run(model, (ids,), 0, torch.float16)
        ref = model(ids)
    assert narrowed is not None
    assert narrowed[0].dtype == torch.float16  # the head linear ran in float16, as autocast runs it
    torch.testing.assert_close(narrowed[0].float(), ref[0], atol=0.05, rtol=0.05)
    assert not torch.equal(narrowed[0].float(), ref[0])


def test_amp_fp16_passes_its_check_on_an_rnn_classifier_autocast_cannot_run():
    torch.manual_seed(1)
    model = _RnnClassifier().train()
    ids = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(1))
    gm = torch.export.export(model, (ids,), strict=False).module()
    result = rewrite.load("rules/amp_fp16.rw").apply(gm, example_inputs=(ids,))
    assert result.counts.get("linear_fp16_bias") == 1
    assert result.equivalence.ok


class _WriteThenIdentity(torch.nn.Module):
    """``relu_`` writes h before the rewritten node reads it: sharing h is unseen."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        h.relu_()
        c = h * 1
        return c + 1


class _IdentityThenWrite(torch.nn.Module):
    """A write after the rewritten node: forwarding h would let c see it."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        c = h * 1
        h.add_(1)
        return c + h


class _IdentityThenViewWrite(_IdentityThenWrite):
    def forward(self, x):
        h = self.fc(x)
        h.relu_()
        c = h * 1
        h[0].add_(1)
        return c + h


class _WriteThenBothReturned(_WriteThenIdentity):
    def forward(self, x):
        h = self.fc(x)
        h.relu_()
        c = h * 1
        return c, h


MUL_ONE = "rule mul_one: mul(x, 1) => x\n"


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_write_before_the_rewritten_node_does_not_block_forwarding(capture):
    """Probe BF F2: an eval-mode dropout after ``ReLU(inplace=True)`` (a VGG head)
    was kept, the int8 model's last linear with it: its input is written in place,
    but before the dropout reads it."""
    model, x = _WriteThenIdentity().eval(), torch.randn(2, 4)
    gm = torch.fx.symbolic_trace(model) if capture == "fx" else \
        torch.export.export(model, (x,), strict=False).module()
    result = rewrite.parse(MUL_ONE).apply(gm, example_inputs=(x,))
    assert result.counts == {"mul_one": 1}
    torch.testing.assert_close(result.graph_module(x), model(x))


@pytest.mark.parametrize("model", [_IdentityThenWrite, _IdentityThenViewWrite, _WriteThenBothReturned])
@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_write_after_the_rewritten_node_or_a_returned_alias_still_blocks_it(model, capture):
    model, x = model().eval(), torch.randn(2, 4)
    gm = torch.fx.symbolic_trace(model) if capture == "fx" else \
        torch.export.export(model, (x,), strict=False).module()
    result = rewrite.parse(MUL_ONE).apply(gm, example_inputs=(x,), check=False)
    refused = result.stats["mul_one"].first_error
    assert not result.counts and ("memory" in refused or "alias" in refused)
    got, want = result.graph_module(x), model(x)
    torch.testing.assert_close(got, want)
    if isinstance(got, tuple):
        assert got[0].data_ptr() != got[1].data_ptr()  # the outputs must not become one tensor


def test_qat_converts_a_vgg_head_with_an_inplace_relu_before_dropout():
    import rewrite.qat as rqat
    import rewrite.quant as rq

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(4),
                                torch.nn.Flatten(), torch.nn.Linear(128, 32), torch.nn.ReLU(inplace=True),
                                torch.nn.Dropout(), torch.nn.Linear(32, 10)).eval()
    x = torch.randn(2, 3, 16, 16)
    qat = rqat.prepare_qat(model, (x,), calibration=[(x,)])
    qat.eval()
    int8 = rqat.convert(qat)
    assert "2 of 2 linears; none left in float" in str(rq.coverage(int8))
    assert not any(isinstance(m, torch.nn.Dropout) for m in int8.modules())


class _EmbeddingBagClassifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.eb = torch.nn.EmbeddingBag(50, 16, mode="mean")
        self.fc = torch.nn.Linear(16, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.fc2 = torch.nn.Linear(8, 2)

    def forward(self, ids, offsets):
        return self.fc2(torch.relu(self.bn(self.fc(self.eb(ids, offsets)))))


def test_ptq_takes_the_checks_fixed_inputs_for_a_model_that_needs_valid_offsets():
    """Probe BF F3: prepare's check drew offsets the model refuses, and its hint named
    apply's fixed_inputs/input_ranges, which prepare and quantize did not take."""
    import rewrite.quant as rq

    torch.manual_seed(0)
    model = _EmbeddingBagClassifier().eval()
    ids, offsets = torch.randint(0, 50, (10,)), torch.tensor([0, 3, 7])
    with pytest.raises(RuntimeError, match="fixed_inputs"):
        rq.prepare(model, (ids, offsets))
    observed = rq.prepare(model, (ids, offsets), fixed_inputs=[1])
    assert observed.meta  # observed and checked
    int8 = rq.quantize(model, [(ids, offsets)], fixed_inputs=[1])
    assert "2 of 2 linears; none left in float" in str(rq.coverage(int8))
    torch.testing.assert_close(int8(ids, offsets), model(ids, offsets), atol=0.1, rtol=0.1)


class _HalfNorms(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.gn = torch.nn.GroupNorm(2, 8)
        self.ln = torch.nn.LayerNorm(8)
        self.ln_nobias = torch.nn.LayerNorm(8, bias=False)

    def forward(self, x):
        z = self.ln(self.gn(self.conv(x)).permute(0, 2, 3, 1))
        return torch.softmax(z, -1), self.ln_nobias(z)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_amp_fp16_runs_a_half_models_norms_in_float32(capture):
    """Probe BF F4: on a model.half() the norms' own weights are float16, which the
    layer_norm/group_norm rules refused: they never fired."""
    torch.manual_seed(0)
    model, x = _HalfNorms().eval().half(), torch.randn(2, 3, 8, 8).half()
    gm = torch.fx.symbolic_trace(model) if capture == "fx" else \
        torch.export.export(model, (x,), strict=False).module()
    result = rewrite.load("rules/amp_fp16.rw").apply(gm, example_inputs=(x,))
    assert result.counts.get("layer_norm_fp32_half_affine") == 1
    assert result.counts.get("layer_norm_fp32_half_weight") == 1
    assert result.counts.get("group_norm_fp32_half_affine") == 1
    got, want = result.graph_module(x), model(x)
    assert all(g.dtype == torch.float16 for g in got)
    exact = _HalfNorms().eval()
    exact.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    truth = exact(x.float())
    for g, w, t in zip(got, want, truth):  # closer to the float32 model than the half one is
        assert (g.float() - t).abs().max() <= (w.float() - t).abs().max() + 1e-3


class _GatedAct(torch.nn.Module):
    """sigmoid / 1.0, then an in-place ReLU: forwarding sigmoid's result makes the
    ReLU write what sigmoid's backward reads."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.act = torch.nn.ReLU(inplace=True)
        self.t = 1.0

    def forward(self, x):
        return self.act(torch.sigmoid(self.lin(x)) / self.t)


class _Residual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scale = 1.0

    def forward(self, x):
        h = torch.tanh(self.lin(x)) * self.scale
        h += x
        return h


class _ExpOut(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.exp(self.lin(x)) * 1.0


class _SharedOut(torch.nn.Module):
    """h is read by a matmul (which keeps it for its backward) and returned as h * 1."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        h = self.lin(x)
        return h * 1.0, h @ self.w


def _backward(module, x, caller_writes):
    out = module(x)
    outs = out if isinstance(out, tuple) else (out,)
    if caller_writes:
        outs[0].div_(2.0)  # the caller writes an output in place, then trains
    sum(o.sum() for o in outs).backward()


def _trains_alike(original, rewritten, x):
    """Whatever backward the original survives (with the caller writing its first
    output in place, or not), the rewrite survives too."""
    for caller_writes in (True, False):
        try:
            _backward(original, x, caller_writes)
        except RuntimeError:
            continue
        _backward(rewritten, x, caller_writes)  # raised "modified by an inplace operation"


@pytest.mark.parametrize("model", [_GatedAct, _Residual, _ExpOut, _SharedOut])
@pytest.mark.parametrize("capture", ["module", "fx", "export"])
def test_cleanup_keeps_what_autograd_keeps_in_a_trained_graph(model, capture):
    """Probe BI F1: cleanup's mul_one/div_one forwarded sigmoid's (tanh's, exp's)
    result into an in-place write, or returned it where the caller writes it: the
    forward values were the same, the check passed, and backward raised."""
    torch.manual_seed(0)
    model, x = model().train(), torch.randn(2, 4)
    gm = model if capture == "module" else torch.fx.symbolic_trace(model) if capture == "fx" else \
        torch.export.export(model, (x,), strict=False).module()
    result = rewrite.load("rules/cleanup.rw").apply(gm, example_inputs=(x,), training=True)
    _trains_alike(model, result.graph_module, x)
    torch.testing.assert_close(result.graph_module(x), model(x))


@pytest.mark.parametrize("model", [_GatedAct, _ExpOut])
def test_cleanup_still_forwards_in_an_inference_graph(model):
    torch.manual_seed(0)
    model, x = model().eval(), torch.randn(2, 4)
    result = rewrite.load("rules/cleanup.rw").apply(model, example_inputs=(x,), training=False)
    assert sum(result.counts.values()) == 1  # div_one or mul_one
    with torch.no_grad():
        torch.testing.assert_close(result.graph_module(x), model(x))


IN_PLACE_RULES = """
rule relu_inplace: relu(tanh(x)) => aten.relu_(aten.tanh(x))
rule sig_inplace: mul(sigmoid(x), 2) => aten.mul_.Scalar(aten.sigmoid(x), 2)
ruleset main = once(relu_inplace, sig_inplace)
"""


class _Acts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return torch.relu(torch.tanh(h)) + torch.sigmoid(h) * 2


def test_a_replacement_writing_what_autograd_keeps_does_not_fire_in_a_trained_graph():
    """Probe BI F2: E105 lets a replacement write a value it builds; where autograd
    keeps that value (tanh's, sigmoid's result) the trained model's backward raised."""
    torch.manual_seed(0)
    model, x = _Acts().train(), torch.randn(2, 4)
    rules = rewrite.parse(IN_PLACE_RULES)
    trained = rules.apply(model, example_inputs=(x,), training=True)
    assert not trained.counts
    assert "autograd keeps" in trained.stats["relu_inplace"].first_error
    trained.graph_module(x).sum().backward()
    inference = rules.apply(model.eval(), example_inputs=(x,), training=False)
    assert inference.counts == {"relu_inplace": 1, "sig_inplace": 1}
    with torch.no_grad():
        torch.testing.assert_close(inference.graph_module(x), model(x))
    verdicts = {v.rule: v for v in rules.verify(max_examples=5, seed=0).verdicts}
    assert "autograd keeps" in verdicts["relu_inplace"].counterexample.message


F = torch.nn.functional
_A = torch.ops.aten
_W = torch.randn(4, 4)

#: an op per name of ``RESULT_NOT_KEPT`` (on a (2, 4, 4) tensor)
_NOT_KEPT = {
    "view": lambda x: x.view(8, 4), "reshape": lambda x: x.reshape(8, 4),
    "_unsafe_view": lambda x: _A._unsafe_view(x.clone(), [8, 4]), "flatten": lambda x: x.flatten(),
    "unflatten": lambda x: x.unflatten(2, (2, 2)), "permute": lambda x: x.permute(2, 0, 1),
    "transpose": lambda x: x.transpose(1, 2), "t": lambda x: x[0].t(), "expand": lambda x: x[:1].expand(3, 4, 4),
    "expand_as": lambda x: x[:1].expand_as(x), "squeeze": lambda x: x[:1].squeeze(0),
    "unsqueeze": lambda x: x.unsqueeze(0), "select": lambda x: x.select(0, 1),
    "slice": lambda x: _A.slice.Tensor(x, 1, 0, 2), "narrow": lambda x: x.narrow(1, 0, 2),
    "as_strided": lambda x: x.as_strided((4,), (1,)), "view_as": lambda x: x.view_as(x),
    "reshape_as": lambda x: x.reshape_as(x), "contiguous": lambda x: x.transpose(1, 2).contiguous(),
    "clone": torch.clone, "alias": lambda x: _A.alias(x), "to": lambda x: x.to(torch.float64),
    "_to_copy": lambda x: _A._to_copy(x, dtype=torch.float64), "type_as": lambda x: x.type_as(_W.double()),
    "float": lambda x: x.double().float(), "half": lambda x: x.half(), "double": lambda x: x.double(),
    "bfloat16": lambda x: x.bfloat16(), "repeat": lambda x: x.repeat(2, 1, 1), "tile": lambda x: x.tile(2),
    "roll": lambda x: x.roll(1, 2), "flip": lambda x: x.flip(2), "pad": lambda x: F.pad(x, (1, 1)),
    "constant_pad_nd": lambda x: torch.constant_pad_nd(x, (1, 1)), "cat": lambda x: torch.cat([x, x]),
    "stack": lambda x: torch.stack([x, x]), "linear": lambda x: F.linear(x, _W), "matmul": lambda x: x @ x,
    "mm": lambda x: x[0].mm(x[1]), "bmm": lambda x: x.bmm(x), "addmm": lambda x: torch.addmm(x[0], x[0], x[1]),
    "baddbmm": lambda x: torch.baddbmm(x, x, x), "einsum": lambda x: torch.einsum("bij,bjk->bik", x, x),
    "conv1d": lambda x: F.conv1d(x, torch.randn(3, 4, 2)),
    "conv2d": lambda x: F.conv2d(x[None], torch.randn(3, 2, 2, 2)),
    "conv3d": lambda x: F.conv3d(x[None, None], torch.randn(3, 1, 2, 2, 2)),
    "convolution": lambda x: _A.convolution(x, torch.randn(3, 4, 2), None, [1], [0], [1], False, [0], 1),
    "conv_transpose1d": lambda x: F.conv_transpose1d(x, torch.randn(4, 3, 2)),
    "conv_transpose2d": lambda x: F.conv_transpose2d(x[None], torch.randn(2, 3, 2, 2)),
    "conv_transpose3d": lambda x: F.conv_transpose3d(x[None, None], torch.randn(1, 3, 2, 2, 2)),
    "embedding": lambda x: F.embedding(torch.tensor([0, 2]), x[0]), "add": lambda x: x + x, "sub": lambda x: x - 1,
    "rsub": lambda x: torch.rsub(x, 1), "mul": lambda x: x * x, "div": lambda x: x / (x + 3),
    "truediv": lambda x: x / 2, "neg": torch.neg, "abs": torch.abs, "where": lambda x: torch.where(x > 1, x, -x),
    "clamp": lambda x: x.clamp(0.6, 1.2), "clamp_min": lambda x: x.clamp_min(0.7),
    "clamp_max": lambda x: x.clamp_max(0.7), "maximum": lambda x: torch.maximum(x, x * 0.9),
    "minimum": lambda x: torch.minimum(x, x * 0.9), "hardtanh": F.hardtanh, "relu6": F.relu6,
    "leaky_relu": F.leaky_relu, "elu": F.elu, "selu": F.selu, "celu": F.celu, "gelu": F.gelu, "silu": F.silu,
    "mish": F.mish, "softplus": F.softplus, "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid,
    "log": torch.log, "log1p": torch.log1p, "log2": torch.log2, "sin": torch.sin, "cos": torch.cos, "erf": torch.erf,
    "square": torch.square, "sign": torch.sign, "threshold": lambda x: F.threshold(x, 0.8, 0.0),
    "layer_norm": lambda x: F.layer_norm(x, (4,)), "batch_norm": lambda x: F.batch_norm(x, None, None, training=True),
    "group_norm": lambda x: F.group_norm(x, 2), "instance_norm": lambda x: F.instance_norm(x),
    "sum": lambda x: x.sum(-1), "mean": lambda x: x.mean(-1), "var": lambda x: x.var(-1),
    "avg_pool1d": lambda x: F.avg_pool1d(x, 2), "avg_pool2d": lambda x: F.avg_pool2d(x[None], 2),
    "adaptive_avg_pool1d": lambda x: F.adaptive_avg_pool1d(x, 2),
    "adaptive_avg_pool2d": lambda x: F.adaptive_avg_pool2d(x[None], 2), "max_pool1d": lambda x: F.max_pool1d(x, 2),
    "max_pool2d": lambda x: F.max_pool2d(x[None], 2), "interpolate": lambda x: F.interpolate(x, scale_factor=2.0),
    "dropout": lambda x: F.dropout(x, 0.5, True),
}

#: ops that keep their result (and are not in RESULT_NOT_KEPT), among them probe BJ's
_KEPT = {
    "sigmoid": torch.sigmoid, "tanh": torch.tanh, "exp": torch.exp, "relu": torch.relu, "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt, "reciprocal": torch.reciprocal, "softmax": lambda x: torch.softmax(x, -1),
    "log_softmax": lambda x: torch.log_softmax(x, -1), "amax": lambda x: x.amax(-1), "prod": lambda x: x.prod(-1),
    "logsumexp": lambda x: torch.logsumexp(x, -1), "special_expit": torch.special.expit,
    "special_expm1": torch.special.expm1, "inverse": lambda x: torch.linalg.inv(x + 4 * torch.eye(4)),
    "cdist": lambda x: torch.cdist(x, x + 1), "logcumsumexp": lambda x: torch.logcumsumexp(x, -1),
    "hypot": lambda x: torch.hypot(x, x + 1), "median": lambda x: x.median(),
    "split": lambda x: x.split(2, 1)[0], "chunk": lambda x: x.chunk(2, 1)[1],
}


def _keeps_its_result(fn):
    leaf = (torch.rand(2, 4, 4) + 0.5).requires_grad_()
    x = leaf * 1  # not a leaf: views of it may be written
    y = fn(x)
    try:
        with torch.no_grad():
            y.add_(0)  # a write: bumps the version autograd saved
    except RuntimeError as err:  # an expanded view takes no write: nothing to keep safe
        assert "more than one element" in str(err)
        return False
    try:
        (y.double().sum() if y.dtype != torch.float64 else y.sum()).backward()
    except RuntimeError as err:
        assert "inplace" in str(err)
        return True
    return False


def test_every_op_said_not_to_keep_its_result_does_not():
    from rewrite.ops.saved import RESULT_NOT_KEPT

    assert set(_NOT_KEPT) == set(RESULT_NOT_KEPT)  # each one checked against torch here
    kept = [name for name, fn in _NOT_KEPT.items() if _keeps_its_result(fn)]
    assert not kept


@pytest.mark.parametrize("name", sorted(_KEPT))
def test_ops_that_keep_their_result_are_taken_to(name):
    """Probe BJ F1: a list of ops that keep their result missed dozens (in-place
    activations, torch.special, linalg, an LSTM): the list is of those that do not."""
    from rewrite.ops.saved import keeps_result

    fn = _KEPT[name]
    assert _keeps_its_result(fn)

    class Call(torch.nn.Module):
        def forward(self, x):
            return fn(x)

    gm = torch.fx.symbolic_trace(Call())
    last = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")][-1]
    assert keeps_result(last, gm)


@pytest.mark.parametrize("act", [torch.nn.LeakyReLU(0.1, inplace=True), torch.nn.ELU(inplace=True),
                                 torch.nn.SELU(inplace=True), torch.nn.ReLU(inplace=True)])
def test_cleanup_keeps_an_in_place_activations_result_in_a_trained_graph(act):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.act = act
            self.t = 1.0

        def forward(self, x):
            h = self.act(self.lin(x)) / self.t
            h.add_(x)
            return h

    torch.manual_seed(0)
    model, x = Block().train(), torch.randn(2, 4)
    result = rewrite.load("rules/cleanup.rw").apply(model, example_inputs=(x,), training=True)
    _trains_alike(model, result.graph_module, x)


_REGISTRY = {}
_CALLS = torch.zeros(())  # a module-level counter a wrapped helper writes


@torch.fx.wrap
def _count_call(x):
    _REGISTRY["model"].calls.add_(1)
    _CALLS.add_(1)
    _REGISTRY.setdefault("log", []).append(1)
    return x


class _Counted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        x = _count_call(x)
        return -(-self.lin(x)) + 1


@pytest.mark.parametrize("capture", ["module", "fx"])
def test_apply_puts_back_what_a_wrapped_helper_writes_outside_its_arguments(capture):
    """Probe BI F3: a ``torch.fx.wrap``'d helper reaching a model buffer through a
    registry and a module-level tensor: apply's runs (the check's, the one that
    records facts) left them written, as a hook's are not."""
    model = _Counted()
    _REGISTRY.clear()
    _REGISTRY["model"] = model
    _CALLS.zero_()
    x = torch.randn(2, 3)
    target = model if capture == "module" else torch.fx.symbolic_trace(model)
    result = rewrite.parse("rule neg_neg: neg(neg(x)) => x\n").apply(target, example_inputs=(x,))
    assert result.counts == {"neg_neg": 1}
    assert model.calls.item() == 0 and _CALLS.item() == 0
    assert "log" not in _REGISTRY  # a list it appends to is put back too
    result.graph_module(x)  # the rewritten model still counts its calls
    assert model.calls.item() == 1 and _CALLS.item() == 1


class _IndexWriteUnderAutocast(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.fc2 = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        h[:, [0, 1, 2, 3]] = h[:, :4] * 1.3 + x[:, :4] * 0.0  # a float32 value into float16 h under autocast
        return self.fc2(h)


def test_the_autocast_allowance_is_no_estimate_when_a_refused_call_writes_a_widened_copy():
    """Probe BH F4: the float32 retry of ``h[:, i] = v`` wrote a copy of h, so the
    "autocast run" was another computation, and 3x its distance let an 18% error
    pass. Such a run gives no estimate (as before the retry existed)."""
    from rewrite.capture import capture_with_inputs

    torch.manual_seed(0)
    model, x = _IndexWriteUnderAutocast().eval(), torch.randn(4, 8)
    wrong = ("rule bad(tolerance='approx'): linear(x, w, b) where dtype(x) == torch.float32 => "
             "to(mul(linear(to(x, torch.float16), to(w, torch.float16), to(b, torch.float16)), 1.1), torch.float32)\n")
    gm, inputs = capture_with_inputs(model, (x,), "dynamo")
    with pytest.raises(rewrite.EquivalenceError):
        rewrite.parse(wrong).apply(gm, example_inputs=tuple(inputs))


_STASH = []


@torch.fx.wrap
def _stash(h):
    _STASH.append(h)
    return h.sum()


@torch.fx.wrap
def _bump(x):
    _STASH[-1].add_(1.0)
    return x


class _StashThenBump(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        s = _stash(h)
        c = h * 1
        x = _bump(x)
        return c + s + x


def test_a_write_before_the_root_by_code_that_may_keep_a_reference_still_blocks_forwarding():
    """Probe BH F1: a wrapped helper "writes every argument"; before the root it may
    keep a reference and write later through a path the graph does not show."""
    _STASH.clear()
    model, x = _StashThenBump().eval(), torch.randn(2, 4)
    result = rewrite.parse(MUL_ONE).apply(torch.fx.symbolic_trace(model), example_inputs=(x,), check=False)
    assert not result.counts and "written in place" in result.stats["mul_one"].first_error
    torch.testing.assert_close(result.graph_module(x), model(x))


def test_e409_notes_the_importers_fixpoint_around_a_once_only_rule_set(tmp_path):
    """Probe BH F3: ``fixpoint(grow_once)`` in an importer repeats grow; the note
    pointed nowhere (it named grow's own once(...) in the library)."""
    _files(tmp_path, **{"lib.rw": GROW + "ruleset grow_once = once(grow)\n",
                        "rep.rw": 'import "lib.rw"\nruleset again = fixpoint(grow_once)\n'})
    with pytest.raises(rewrite.RuleError) as err:
        rewrite.load(str(tmp_path / "rep.rw"))
    assert "rep.rw:2:17: run to a fixpoint here" in str(err.value)


def test_a_long_seq_of_finite_sweeps_is_not_stopped_by_the_default_bound():
    """Probe BH F5: the default bound on rewrites counted the whole run: 48
    alternating sweeps over 200 negs stopped as "did not settle"."""
    class Negs(torch.nn.Module):
        def forward(self, x):
            for _ in range(200):
                x = torch.neg(x)
            return x

    steps = ", ".join(["once(a)", "once(b)"] * 24)
    rules = rewrite.parse("rule a: neg(x) => mul(x, -1)\nrule b: mul(x, -1) => neg(x)\n"
                          f"ruleset main = seq({steps})\n")
    x = torch.randn(3)
    result = rules.apply(torch.fx.symbolic_trace(Negs()), example_inputs=(x,), check=False)
    assert result.counts == {"a": 4800, "b": 4800}
    torch.testing.assert_close(result.graph_module(x), x)
    with pytest.raises(rewrite.NonTerminationError, match="max_rewrites=100"):  # the caller's bound: the whole run
        rules.apply(torch.fx.symbolic_trace(Negs()), example_inputs=(x,), check=False, max_rewrites=100)


class _Stats:
    def __init__(self):
        self.t = torch.zeros(())
        self.hist = []


class _CountingLeaf(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.zeros(()))
        self.plain = torch.zeros(())
        self.d = {"n": torch.zeros(())}
        self.helper = _Stats()

    def forward(self, x):
        self.buf.add_(1)
        self.plain.add_(1)
        self.d["n"].add_(1)
        self.helper.t.add_(1)
        self.helper.hist.append(1)
        return x


class _WithLeaf(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c = _CountingLeaf()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        return -(-self.lin(self.c(x))) + 1


def test_apply_puts_back_what_a_users_leaf_module_writes_outside_its_buffers():
    """Probe BJ F2: a leaf module kept one call writes a plain tensor attribute, a
    tensor in a dict, and a helper object's tensor and list: apply's runs left them."""
    class Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, _CountingLeaf) or super().is_leaf_module(m, qualname)

    model, x = _WithLeaf(), torch.randn(2, 3)
    gm = torch.fx.GraphModule(model, Tracer().trace(model))
    result = rewrite.parse("rule neg_neg: neg(neg(x)) => x\n").apply(gm, example_inputs=(x,))
    assert result.counts == {"neg_neg": 1}
    c = model.c
    assert (c.buf.item(), c.plain.item(), c.d["n"].item(), c.helper.t.item(), c.helper.hist) == (0, 0, 0, 0, [])


class _ScaleLeaf(torch.nn.Module):
    """A harmless leaf module holding a large object graph."""

    def __init__(self, held):
        super().__init__()
        self.scale = 1.5
        self.held = held

    def forward(self, x):
        return x * self.scale


class _ConvBnLeaf(torch.nn.Module):
    def __init__(self, held):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.leaf = _ScaleLeaf(held)

    def forward(self, x):
        return self.leaf(self.bn(self.conv(x)))


@pytest.mark.parametrize("held", [lambda: [(i, str(i)) for i in range(30000)],
                                  lambda: torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2000)),
                                  lambda: (i for i in range(3))])
def test_a_leaf_module_holding_a_large_object_graph_does_not_stop_every_fold(held):
    """Probe BK F3: walking what a user's leaf module holds gave up (over 20000
    objects, a generator) and every tensor of the model counted as written."""
    class Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, _ScaleLeaf) or super().is_leaf_module(m, qualname)

    torch.manual_seed(0)
    model, x = _ConvBnLeaf(held()).eval(), torch.randn(1, 3, 8, 8)
    gm = torch.fx.GraphModule(model, Tracer().trace(model))
    result = rewrite.load("rules/fusion.rw").apply(gm, example_inputs=(x,))
    assert result.counts == {"conv_bn": 1}
    torch.testing.assert_close(result.graph_module(x), model(x), atol=1e-5, rtol=1e-5)


class _LeakyThenAdd(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = torch.nn.functional.leaky_relu(self.lin(x), 0.1)
        y += x
        return y


def test_a_replacement_whose_value_autograd_keeps_does_not_stand_for_one_written_later():
    """Probe BK F2: ``leaky_relu(x) => leaky_relu_(clone(x))``: the in-place op keeps
    its result, the original's did not; the model's ``y += x`` then broke backward."""
    rules = rewrite.parse("rule r: leaky_relu(x, 0.1) => aten.leaky_relu_(aten.clone(x), 0.1)\n"
                          "ruleset main = once(r)\n")
    torch.manual_seed(0)
    model, x = _LeakyThenAdd().train(), torch.randn(2, 4)
    gm = torch.export.export(model, (x,), strict=False).module()
    result = rules.apply(gm, example_inputs=(x,), training=True)
    assert not result.counts and "autograd keeps" in result.stats["r"].first_error
    _trains_alike(model, result.graph_module, x)


@pytest.mark.parametrize("pool", [torch.nn.MaxPool1d(2, return_indices=True),
                                  torch.nn.MaxPool2d(2, return_indices=True)])
def test_a_max_pool_returning_indices_is_taken_to_keep_them(pool):
    """Probe BK F1: the backward reads the indices a max pool returns."""
    from rewrite.ops.saved import keeps_result

    class Pool(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pool = pool

        def forward(self, x):
            return self.pool(x)[1]

    gm = torch.fx.symbolic_trace(Pool())
    node = next(n for n in gm.graph.nodes if n.op == "call_module")
    assert keeps_result(node, gm)


@pytest.mark.parametrize("fn", [
    lambda x: _A.native_batch_norm(x, None, None, None, None, True, 0.1, 1e-5)[0],
    lambda x: _A.native_layer_norm(x, [4], None, None, 1e-5)[0],
    lambda x: _A.native_group_norm(x, None, None, 2, 4, 4, 2, 1e-5)[0],
    lambda x: _A.max_pool2d_with_indices(x, [2, 2])[0],
])
def test_a_norms_or_pools_first_result_is_not_kept_and_is_taken_not_to_be(fn):
    """A training graph's batch norm returned through ``/ 1`` (export spells it
    ``aten.batch_norm``, writing its statistics: not an in-place call of its input)."""
    from rewrite.ops.saved import keeps_result

    assert not _keeps_its_result(fn)

    class Call(torch.nn.Module):
        def forward(self, x):
            return fn(x)

    gm = torch.fx.symbolic_trace(Call())
    last = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")][-1]
    assert not keeps_result(last, gm)
