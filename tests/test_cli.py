"""The command line: exit codes, diagnostics without tracebacks, apply's report."""

import subprocess
import sys

import pytest

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


def test_apply_bad_model_spec_is_a_usage_error():
    with pytest.raises(SystemExit) as info:
        main(["apply", "rules/fusion.rw", "--model", "no_such_module_xyz:f"])
    assert "cannot load" in str(info.value.code)


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


def test_quantize_subcommand_bad_model_is_a_clean_error():
    with pytest.raises(SystemExit) as info:  # as for apply: a message, exit status 1
        main(["quantize", "--model", "rewrite.examples.cnn:no_such_factory"])
    assert "cannot load 'rewrite.examples.cnn:no_such_factory'" in str(info.value.code)
