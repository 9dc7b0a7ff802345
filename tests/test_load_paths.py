"""rewrite.load finds the shipped rule files by name from any working directory."""

import pytest

import rewrite


@pytest.mark.parametrize("name", [
    "fusion.rw", "rules/fusion.rw", "quant/observe.rw", "rules/quant/observe.rw", "rules/quant/lower.rw",
])
def test_shipped_files_resolve_from_another_directory(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rules = rewrite.load(name)
    shipped = rewrite.rules_dir().joinpath(*name.removeprefix("rules/").split("/"))
    assert len(rules) > 0
    assert list(rules.rules) == list(rewrite.load(str(shipped)).rules)


def test_a_local_file_wins_over_a_shipped_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fusion.rw").write_text("rule mine: relu(relu(x)) => relu(x)\n")
    assert list(rewrite.load("fusion.rw").rules) == ["mine"]


def test_a_missing_file_is_a_clean_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(rewrite.RuleError) as info:
        rewrite.load("quant/nonexistent.rw")
    assert "quant/nonexistent.rw" in str(info.value)


def test_paths_and_text_of_the_wrong_type_are_clear_type_errors():
    with pytest.raises(TypeError, match="rule file paths"):
        rewrite.load(b"rules/cleanup.rw")
    with pytest.raises(TypeError, match="decode the bytes"):
        rewrite.parse(b"rule r: neg(neg(x)) => x")
    with pytest.raises(TypeError, match="not NoneType"):
        rewrite.parse(None)

