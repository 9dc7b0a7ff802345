"""The command line: exit codes, diagnostics without tracebacks, apply's report."""

import subprocess
import sys

import pytest
import torch

from rewrite.cli import main


def test_check_shipped_rules_is_clean(capsys):
    import glob

    assert main(["check", *sorted(glob.glob("rules/*.rw"))]) == 0
    assert "fusion.rw: ok" in capsys.readouterr().out


def test_check_reports_position_and_exits_1(tmp_path, capsys):
    bad = tmp_path / "bad.rw"
    bad.write_text("# a comment\nrule r: rleu(x) => x\n")
    assert main(["check", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:2:9: error: unknown op 'rleu' [E102]" in err
    assert "did you mean 'relu'?" in err
    assert "Traceback" not in err


def test_python_dash_m_is_the_same_command(tmp_path):
    bad = tmp_path / "bad.rw"
    bad.write_text("rule r: relu(x) => \n")
    proc = subprocess.run([sys.executable, "-m", "rewrite", "check", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 1
    assert f"{bad}:1:19: error: expected a replacement after '=>'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_usage_exits_2():
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2


def test_apply_prints_counts_changes_and_verdict(tmp_path, capsys):
    out = tmp_path / "fused.pt"
    code = main(["apply", "rules/fusion.rw", "--model", "rewrite.examples.cnn:demo_cnn_with_inputs",
                 "--save", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    assert "conv_bn" in text and "equivalence: equivalent" in text
    assert "batch_norm" in text  # the before/after table
    assert out.exists()


def test_apply_through_export_and_dynamo(capsys):
    for capture in ("export", "dynamo"):
        assert main(["apply", "rules/fusion.rw", "--model", "rewrite.examples.cnn:demo_cnn_with_inputs",
                     "--capture", capture]) == 0
        assert "conv_bn" in capsys.readouterr().out


def test_apply_bad_model_spec_is_a_usage_error(capsys):
    assert main(["apply", "rules/fusion.rw", "--model", "no_such_module_xyz:f"]) == 2
    assert "cannot load" in capsys.readouterr().err


def test_explain_lists_rules_with_positions_and_stats(capsys):
    assert main(["explain", "rules/fusion.rw", "--model", "rewrite.examples.cnn:demo_cnn_with_inputs"]) == 0
    text = capsys.readouterr().out
    assert "fusion.rw:" in text and "rule conv_bn" in text
    assert "applied 4" in text


def test_quantize_subcommand_reports_counts_and_accuracy(tmp_path, capsys):
    out = tmp_path / "int8.pt"
    code = main(["quantize", "--model", "rewrite.examples.cnn:demo_cnn_with_inputs",
                 "--calibration", "2", "--held-out", "1", "--save", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    assert "observe:" in text and "convert:" in text and "lower:" in text
    assert "output SQNR" in text
    assert out.exists() and out.stat().st_size > 0


def test_quantize_subcommand_bad_model_is_a_clean_error(capsys):
    # as for apply: a one-line message, exit status 2
    assert main(["quantize", "--model", "rewrite.examples.cnn:no_such_factory"]) == 2
    assert "cannot load 'rewrite.examples.cnn:no_such_factory'" in capsys.readouterr().err


def test_apply_export_saves_a_pt2_that_torch_export_loads(tmp_path, capsys):
    import torch

    from rewrite.examples.cnn import demo_cnn_with_inputs

    out = tmp_path / "fused.pt2"
    assert main(["apply", "rules/fusion.rw", "--model", "rewrite.examples.cnn:demo_cnn_with_inputs",
                 "--capture", "export", "--save", str(out)]) == 0
    assert "ExportedProgram" in capsys.readouterr().out
    program = torch.export.load(str(out))
    norms = [n for n in program.graph.nodes if "batch_norm" in str(n.target)]
    assert len(norms) == 1  # saved after the rewrite: 6 of the 7 batch norms were folded
    model, inputs = demo_cnn_with_inputs()
    torch.testing.assert_close(program.module()(*inputs), model.eval()(*inputs), rtol=1e-4, atol=1e-5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fused.pt2"]  # no temporary left behind


@pytest.mark.parametrize("capture, name", [("export", "out.pt"), ("fx", "out.pt2"), ("dynamo", "out.pt")])
def test_save_path_that_does_not_fit_the_capture_is_refused_up_front(tmp_path, capsys, capture, name):
    out = tmp_path / name
    code = main(["apply", "rules/fusion.rw", "--model", "rewrite.examples.cnn:demo_cnn_with_inputs",
                 "--capture", capture, "--save", str(out)])
    assert code == 2  # a usage error, like the others
    assert "--save" in capsys.readouterr().err
    assert not out.exists()


def test_failed_save_leaves_no_partial_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    import torch

    from rewrite.capture import save
    from rewrite.examples.cnn import demo_cnn_with_inputs

    model, inputs = demo_cnn_with_inputs()
    gm = torch.fx.symbolic_trace(model)
    out = tmp_path / "model.pt"
    out.write_bytes(b"old")

    def broken(obj, f):
        with open(f, "wb") as fh:
            fh.write(b"half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        save(gm, out, "fx")
    assert out.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


FACTORY = """
import torch

def build():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)), (torch.randn(1, 3, 8, 8),)
"""


@pytest.mark.parametrize("launcher", ["console_script", "python_m"])
def test_model_spec_is_found_in_the_current_directory(tmp_path, launcher):
    import os
    import shutil

    (tmp_path / "mymodel_for_cli.py").write_text(FACTORY)
    rules = os.path.abspath("rules/fusion.rw")
    if launcher == "console_script":
        exe = shutil.which("rewrite", path=os.path.dirname(sys.executable))
        if exe is None:
            pytest.skip("the rewrite console script is not installed in this environment")
        cmd = [exe]
    else:
        cmd = [sys.executable, "-m", "rewrite"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(cmd + ["apply", rules, "--model", "mymodel_for_cli:build"], cwd=tmp_path,
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "conv_bn" in proc.stdout


@pytest.mark.parametrize("spec, message", [
    ("no_colon", "module:callable"),
    ("rewrite.examples.cnn:no_such_factory", "cannot load"),
    ("rewrite.examples.cnn:ResNet", "raised TypeError"),
    ("rewrite.examples.cnn:randomize_batchnorm", "raised TypeError"),
    ("rewrite.examples.cnn:torch", "is not callable"),
    ("rewrite.examples.cnn:demo_cnn", "must return (model, example_inputs)"),
])
def test_bad_model_spec_is_a_one_line_error(spec, message, capsys):
    code = main(["apply", "rules/fusion.rw", "--model", spec])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("flag", ["--rule", "--node"])
def test_explain_names_a_missing_rule_or_node_as_a_user_error(flag, capsys):
    code = main(["explain", "rules/fusion.rw", "--model", "rewrite.examples.cnn:demo_cnn_with_inputs",
                 flag, "nosuch"])
    err = capsys.readouterr().err
    assert code == 2 and "rewrite: error:" in err and "nosuch" in err and "internal error" not in err


def test_apply_save_into_a_missing_folder_fails_before_any_work(tmp_path, capsys):
    target = tmp_path / "missing" / "out.pt"
    code = main(["apply", "rules/fusion.rw", "--model", "rewrite.examples.cnn:demo_cnn_with_inputs",
                 "--save", str(target)])
    err = capsys.readouterr().err
    assert code != 0 and "does not exist" in err and "internal error" not in err


@pytest.mark.parametrize("extra,message", [
    (["--ruleset", "nope"], "no rule or ruleset named 'nope'"),
    (["--trials", "0"], "0 is not a positive int"),
    (["--rtol", "nan"], "nan is not a finite, non-negative number"),
])
def test_apply_reports_bad_arguments_as_usage_errors(extra, message, capsys):
    model = ["--model", "rewrite.examples.cnn:demo_cnn_with_inputs"]
    try:
        code = main(["apply", "rules/cleanup.rw", *model, *extra])
    except SystemExit as exit_:  # argparse's own usage error
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and message in err
    assert "internal error" not in err and "Traceback" not in err


class _NotTraceable(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # control flow on a value: symbolic_trace cannot follow it
            return x * 2
        return x


def not_traceable_with_inputs():
    return _NotTraceable(), (torch.randn(2, 3),)


@pytest.mark.parametrize("command", [["stats"], ["apply", "rules/cleanup.rw"], ["explain", "rules/cleanup.rw"]])
def test_a_model_that_cannot_be_captured_is_a_clear_error(command, capsys):
    code = main([*command, "--model", "tests.test_cli:not_traceable_with_inputs", "--capture", "fx"])
    err = capsys.readouterr().err
    assert code == 2
    assert "cannot be captured at --capture fx" in err and "try --capture" in err
    assert "internal error" not in err and "Traceback" not in err
