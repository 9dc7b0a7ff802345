"""Regressions from session 28's probes: each test failed before its fix."""
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import fx

import rewrite

RULES = Path(__file__).resolve().parents[1] / "rules"
AMP_BF16 = rewrite.load(RULES / "amp_bf16.rw")


class _Sub(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.b = nn.Parameter(torch.zeros(8))

    def forward(self, x):
        return F.linear(x, self.w, self.b)


class _FunctionalWeights(nn.Module):
    """Weights read functionally: on the root, and in a submodule symbolic_trace inlines."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.b = nn.Parameter(torch.zeros(8))
        self.sub = _Sub()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(self.sub(F.linear(x, self.w, self.b)))


def _new_tensors(result, gm) -> set:
    before = {id(t) for t in [*gm.parameters(), *gm.buffers()]}
    after = result.graph_module
    return {name for name, t in [*after.named_parameters(), *after.named_buffers()] if id(t) not in before}


def test_a_train_mode_models_functional_weights_are_not_folded():
    """const(w) is false for a parameter a train-mode symbolic_trace model reads
    functionally: cast once into a new constant, it would get no gradient."""
    model = _FunctionalWeights().train()
    gm = fx.symbolic_trace(model)
    x = torch.randn(4, 8)
    result = AMP_BF16.apply(gm, example_inputs=(x,))
    assert sum(n for rule, n in result.counts.items() if rule.startswith("linear")) == 3  # cast as it runs
    assert _new_tensors(result, gm) == set()
    result.graph_module(x).float().sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_an_eval_mode_models_functional_weights_are_folded():
    model = _FunctionalWeights().eval()
    gm = fx.symbolic_trace(model)
    x = torch.randn(4, 8)
    result = AMP_BF16.apply(gm, example_inputs=(x,))
    assert _new_tensors(result, gm)  # the weights cast once
    torch.testing.assert_close(result.graph_module(x).float(), gm(x), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("train", [True, False])
def test_an_export_graph_folds_as_its_batch_norms_say(train):
    """torch.export's module is in training mode whatever the model's: its flag
    says nothing. Since session 39 a graph whose ops do not tell either may train: no
    fold unless the caller says inference, or ``rewrite.capture`` captured an
    eval-mode model (tests/test_training_mode.py)."""
    from rewrite.capture import capture

    model = _FunctionalWeights().train(train)
    x = torch.randn(4, 8)
    gm = torch.export.export(model, (x,)).module()
    assert not _new_tensors(AMP_BF16.apply(gm, example_inputs=(x,)), gm)
    assert _new_tensors(AMP_BF16.apply(gm, example_inputs=(x,), training=False), gm)
    captured = capture(model, (x,), "export")
    assert bool(_new_tensors(AMP_BF16.apply(captured, example_inputs=(x,)), captured)) is not train


class _ItemOutput(nn.Module):
    def forward(self, x, y):
        return (x / y).sum().item()


def _item_inputs(dtype=torch.float32):
    return (torch.randn(4, 5, dtype=dtype), torch.rand(4, 5, dtype=dtype) + 0.5)


@pytest.mark.parametrize("tolerance", ["exact", "approx"])
def test_a_python_float_output_compares_with_the_rules_tolerance(tolerance):
    """``loss.item()`` rounds as its tensor: a rewrite that only rounds differently passes."""
    rules = rewrite.parse(f'rule r(tolerance="{tolerance}"): div(x, y) => mul(x, reciprocal(y))\n')
    gm = fx.symbolic_trace(_ItemOutput())
    result = rules.apply(gm, example_inputs=_item_inputs())
    assert result.counts["r"] == 1


def test_a_wrong_python_float_output_is_still_caught():
    rules = rewrite.parse("rule r: div(x, y) => mul(x, y)\n")
    with pytest.raises(rewrite.EquivalenceError):
        rules.apply(fx.symbolic_trace(_ItemOutput()), example_inputs=_item_inputs())


def test_a_float64_python_float_is_held_to_float64():
    """A float64 model's ``.item()`` is not a float32 value: computing it in float32
    instead is caught, as it would be on the tensor."""
    rules = rewrite.parse("rule r: div(x, y) where dtype(x) == torch.float64\n"
                          "    => to(div(to(x, torch.float32), to(y, torch.float32)), torch.float64)\n")
    with pytest.raises(rewrite.EquivalenceError):
        rules.apply(fx.symbolic_trace(_ItemOutput()), example_inputs=_item_inputs(torch.float64))


class _RepVGG(nn.Module):
    """conv3x3(x) + conv1x1(x) + bn(x): conv_add_conv, then conv_add_bn on its result."""

    def __init__(self):
        super().__init__()
        self.c3 = nn.Conv2d(4, 4, 3, padding=1)
        self.c1 = nn.Conv2d(4, 4, 1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.c3(x) + self.c1(x) + self.bn(x)


def test_a_fold_of_a_fold_keeps_its_weights_parameters():
    """A constant folded from a parameter is a parameter (requires_grad as the
    source's) however many folds it went through: one fold kept it, two made a buffer."""
    torch.manual_seed(0)
    gm = fx.symbolic_trace(_RepVGG().eval())
    x = torch.randn(2, 4, 6, 6)
    result = rewrite.load(RULES / "fusion.rw").apply(gm, example_inputs=(x,))
    assert result.counts["conv_add_conv"] == 1 and result.counts["conv_add_bn"] == 1
    out = result.graph_module
    assert out(x).requires_grad == gm(x).requires_grad is True
    assert sorted(n for n, _ in out.named_buffers()) == []
    assert len(list(out.parameters())) == 2
    torch.testing.assert_close(out(x), gm(x), atol=1e-5, rtol=1e-5)


class _IntScale(nn.Module):
    def forward(self, x, n):
        return x * n


def test_a_one_valued_integer_input_varies_in_the_check():
    """``mul(x, n) => add(x, x)`` holds for n == 2 only: an example ``torch.tensor(2)``
    must not hide it (random trials drew n from [2, 2])."""
    rules = rewrite.parse("rule double: mul(x, n) where rank(n) == 0 => add(x, x)\n")
    gm = fx.symbolic_trace(_IntScale())
    with pytest.raises(rewrite.EquivalenceError):
        rules.apply(gm, example_inputs=(torch.randn(4, 5), torch.tensor(2)))


class _LastRow(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(3, 4))

    def forward(self, i):
        return torch.relu(torch.relu(self.table[i]))


def test_a_one_valued_index_the_original_cannot_widen_is_drawn_as_given():
    """Index 2 of a 3-row table: a trial drawing 3 makes the original fail; the trial
    is drawn again with the index as the example has it (not an error)."""
    gm = fx.symbolic_trace(_LastRow())
    rules = rewrite.parse("rule relu_relu: relu(relu(_) as r) => r\n")
    result = rules.apply(gm, example_inputs=(torch.tensor([2, 2]),))
    assert result.counts == {"relu_relu": 1}
    assert result.equivalence.ok and result.equivalence.trials == 3
    torch.testing.assert_close(result.graph_module(torch.tensor([2, 2])), gm(torch.tensor([2, 2])))


class _StepCounter(nn.Module):
    """A write symbolic_trace runs once on the real buffer and leaves out of the graph."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)
        self.register_buffer("step", torch.zeros(()))

    def forward(self, x):
        self.step.add_(1)
        return torch.relu(torch.relu(self.c(x)))


@pytest.mark.parametrize("how", ["apply", "prepare"])
def test_a_trace_that_writes_the_callers_buffer_is_refused_and_put_back(how):
    from rewrite.flows import quant as rq

    model = _StepCounter().eval()
    version = model.step._version
    x = torch.randn(1, 3, 6, 6)
    with pytest.raises((TypeError, ValueError), match="'step' in place"):
        if how == "apply":
            rewrite.parse("rule rr: relu(relu(_) as r) => r\n").apply(model, (x,))
        else:
            rq.prepare(model, (x,), capture="fx")
    assert model.step.item() == 0 and model.step._version == version


def test_a_saved_model_gets_the_permissions_of_any_new_file(tmp_path):
    import os

    from rewrite.capture import save

    gm = fx.symbolic_trace(_IntScale())
    mask = os.umask(0o022)
    try:
        path = save(gm, tmp_path / "m.pt")
    finally:
        os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o644


def test_save_refuses_a_folder_an_unknown_level_and_a_missing_example_before_any_work(tmp_path):
    from rewrite.capture import save

    gm = fx.symbolic_trace(_IntScale())
    (tmp_path / "taken.pt").mkdir()
    with pytest.raises(ValueError, match="is a folder"):
        save(gm, tmp_path / "taken.pt")
    with pytest.raises(ValueError, match="unknown capture level"):
        save(gm, tmp_path / "m.pt", level="bogus")
    with pytest.raises(ValueError, match="example_inputs"):
        save(gm, tmp_path / "m.pt2", level="export")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken.pt"]


@pytest.mark.parametrize("argv, message", [
    (["--ruleset", "nope"], "--ruleset nope: no rule or ruleset named 'nope'"),
    (["--save", "q.pt2"], "name the file *.pt"),
    (["--pt2", "q.onnx"], "name the file *.pt2"),
])
def test_quantize_refuses_bad_options_before_any_work(argv, message, capsys):
    from rewrite.cli import main

    code = main(["quantize", "--model", "rewrite.examples.cnn:no_such_factory", *argv])
    assert code == 2 and message in capsys.readouterr().err


def test_the_quantization_steps_say_what_they_take():
    from rewrite.flows import quant as rq

    model, x = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval(), torch.randn(1, 3, 8, 8)
    observed = rq.prepare(model, (x,))
    with pytest.raises(TypeError, match=r"not one tensor: pass \[x\]"):
        rq.calibrate(observed, x)
    with pytest.raises(TypeError, match="the observed GraphModule that prepare"):
        rq.convert(model)
    rq.calibrate(observed, [x])
    int8 = rq.convert(observed)
    with pytest.raises(ValueError, match="no held-out batches"):
        rq.accuracy_report(observed, int8, [])


@pytest.mark.parametrize("command", ["check", "fmt"])
def test_a_folder_given_as_a_rule_file_is_named_a_folder(command, tmp_path, capsys):
    from rewrite.cli import main

    folder = tmp_path / "rules.rw"
    folder.mkdir()
    assert main([command, str(folder)]) == 1
    err = capsys.readouterr().err
    assert f"{folder}:1:1: error: cannot read rule file" in err
    assert "is a folder" in err and "did you mean" not in err


def test_a_calibration_batch_export_did_not_capture_is_a_quantization_error():
    from rewrite.flows import quant as rq

    model, x = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval(), torch.randn(1, 3, 8, 8)
    observed = rq.prepare(model, (x,), capture="export")
    with pytest.raises(rq.QuantizationError, match="does not fit the shapes torch.export captured"):
        rq.calibrate(observed, [torch.randn(2, 3, 8, 8)])


def test_the_quantized_files_are_checked_before_any_work_and_written_whole(tmp_path):
    import os

    from rewrite.flows import quant as rq

    model, x = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval(), torch.randn(1, 3, 8, 8)
    observed = rq.prepare(model, (x,))
    rq.calibrate(observed, [x])
    int8, qdq = rq.convert(observed), rq.convert(observed, form="qdq")
    for call, wrong in ((lambda p: rq.save(int8, p), "m.pt2"), (lambda p: rq.export(qdq, (x,), p), "m.onnx"),
                        (lambda p: rq.export_onnx(qdq, (x,), p), "m.pt")):
        with pytest.raises(ValueError, match="name the file"):
            call(tmp_path / wrong)
    mask = os.umask(0o022)
    try:
        rq.save(int8, tmp_path / "m.pt")
        rq.export(qdq, (x,), tmp_path / "m.pt2")
    finally:
        os.umask(mask)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt", "m.pt2"]  # no partial files left
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in tmp_path.iterdir())
    torch.testing.assert_close(torch.export.load(str(tmp_path / "m.pt2")).module()(x), qdq(x))
