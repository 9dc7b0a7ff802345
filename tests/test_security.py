"""Safe rule files: a rule file can only name ops of the vocabulary, allowlisted torch
ops and registered functions. Every attempt to reach other Python (builtins, os,
subprocess, pickle, torch.load, dunder attributes, private registry functions) in a
pattern, a where clause, a replacement, a family, an option or a schedule is rejected
at load time with a positioned ``RuleError``, and nothing runs while loading.
"""

from __future__ import annotations

import builtins
import importlib
import os
import pickle
import subprocess

import pytest
import torch
import torch.fx as fx

import rewrite
from rewrite.functions.registry import lookup_function
from rewrite.language import RuleError
from rewrite.ops import lookup_op

NAMES = [
    "os.system", "__import__", "eval", "exec", "compile", "open", "getattr", "globals", "x.__class__",
    "builtins.open", "builtins.eval", "torch.__class__", "subprocess.run", "subprocess.Popen",
    "nn.Module.__subclasses__", "torch.nn.Module.__subclasses__", "torch.load", "torch.save",
    "torch.hub.load", "torch.jit.load", "torch.ops.load_library", "torch.classes.load_library",
    "torch.utils.cpp_extension.load", "pickle.loads", "importlib.import_module",
    "rewrite.functions.registry._register", "rewrite.register_predicate", "F.__builtins__",
    "Tensor.__reduce_ex__", "aten.__dict__", "torch._C._get_tracing_state", "operator.attrgetter",
    "operator.methodcaller", "nn.Sequential", "torch.nn.modules.module.Module", "F.torch.load",
    "torch.from_file", "torch.frombuffer", "Tensor.tolist", "Tensor.numpy", "Tensor.storage",
    # torch.library namespaces: torch's own (file readers, collectives, profiling), unregistered ones
    "debugprims.load_tensor", "torch.ops.debugprims.load_tensor", "c10d.send", "torch.ops.c10d.barrier",
    "profiler._record_function_enter", "torch.ops.higher_order.cond", "os.path.join", "mylib_not_loaded.f",
    "torch.ops.aten.from_file",
]

PLACES = {
    "pattern": ("rule r: {name}(x) => x", {"E102", "E104", "E010", "E001"}),
    "where": ("rule r: relu(x) where {name}(x) => x", {"E103", "E104", "E010", "E001"}),
    "replacement": ("rule r: relu(x) => {name}(x)", {"E102", "E104", "E010", "E001"}),
    "nested replacement": ("rule r: relu(x) => add(x, {name}(x))", {"E102", "E104", "E010", "E001"}),
    "value": ("rule r: mul(x, y) where y == {name} => x", {"E010", "E001", "E301"}),
    "family": ("family f = {name}\nrule r: f(x) => x", {"E101", "E104", "E001"}),
    "option": ("rule r(priority={name}(x)): relu(x) => x", {"E406", "E001"}),
}

ATTACKS = [
    'rule r: relu(x) => __import__("os").system("touch pwned")',
    'rule r: relu(x) where eval("__import__(\'os\').system(\'touch pwned\')") => x',
    "rule r: relu(x) => x.__class__.__bases__[0].__subclasses__()",
    'rule r: relu(x) => to(x, "\\x00__import__(\'os\').system(\'touch pwned\')")(x)',
    "rule r: relu(x) where x.__class__ == 1 => x",
    "rule r: relu(x) where (lambda: 1)() => x",
    "rule r: relu(x) => torch.load(\"model.pt\")",
    "rule r: relu(x) => cast(x, torch.load)",
    "rule r: relu(x) => x\nruleset s = os.system(r)",
    "rule r: relu(x) => x\nruleset s = __import__(r)",
    "rule r(tolerance=__import__): relu(x) => x",
    "import \"x\"; os.system(\"touch pwned\")",
    "rule r: relu(x) => minmax_observer(x, cls=os.system)",
    "rule r: relu(x) => minmax_observer(x, __class__=1)",
    "rule r: relu(x) where is_observer(x.__class__) => x",
]

WATCHED = [
    (os, "system"), (os, "popen"), (os, "execv"), (os, "execve"),
    (subprocess, "Popen"), (subprocess, "run"), (subprocess, "call"), (subprocess, "check_output"),
    (pickle, "loads"), (pickle, "load"), (torch, "load"), (torch, "save"), (torch.hub, "load"),
    (torch.jit, "load"), (builtins, "eval"), (builtins, "exec"), (builtins, "open"),
]


@pytest.fixture
def nothing_runs(monkeypatch):
    """Replace the entry points of arbitrary code with recorders; after the test none was
    called. ``importlib.import_module`` may only import the library's own modules (the
    registry imports its built-in functions lazily)."""
    rewrite.parse("rule warm: relu(x) where const(x) and rank(x) == 4 => neg(x)")
    calls: list = []

    def recorder(name):
        def record(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} was called while loading a rule file")
        return record

    for owner, attr in WATCHED:
        monkeypatch.setattr(owner, attr, recorder(f"{getattr(owner, '__name__', owner)}.{attr}"))
    real_import = importlib.import_module

    def import_module(name, package=None):
        if not name.startswith("rewrite."):
            calls.append(f"importlib.import_module({name!r})")
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", import_module)
    yield calls
    assert calls == [], calls


def _rejected(text: str, codes: set | None = None) -> RuleError:
    with pytest.raises(RuleError) as info:
        rewrite.parse(text, "attack.rw")
    err = info.value
    for d in err.diagnostics:
        assert d.span is not None and d.span.path == "attack.rw" and d.span.line >= 1 and d.span.col >= 1, d
        assert d.code.startswith("E"), d
    if codes is not None:
        assert {d.code for d in err.diagnostics} & codes, [str(d) for d in err.diagnostics]
    return err


@pytest.mark.parametrize("place", sorted(PLACES))
@pytest.mark.parametrize("name", NAMES)
def test_names_outside_the_vocabulary_are_rejected_at_load_time(name, place, nothing_runs):
    template, codes = PLACES[place]
    text = template.format(name=name)
    err = _rejected(text, codes)
    column = text.index(name) + 1  # the caret points at the name (the option's is on the option)
    assert any(d.span.line == 1 and d.span.col <= column < max(d.span.end_col, d.span.col + 1)
               for d in err.diagnostics), (text, [str(d) for d in err.diagnostics])


@pytest.mark.parametrize("text", ATTACKS)
def test_attacks_are_rejected_and_run_nothing(text, nothing_runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _rejected(text)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("name", NAMES)
def test_resolution_refuses_the_name(name):
    assert lookup_op(name) is None
    assert lookup_function(name) is None


def test_registered_names_resolve_only_through_the_registry():
    assert lookup_function("conv_bn_weight").kind == "constant"
    assert lookup_op("conv_bn_weight") is None
    assert lookup_function("_register") is None and lookup_function("register_predicate") is None


def test_string_literals_are_data(nothing_runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = "__import__('os').system('touch pwned')"
    rules = rewrite.parse(f'rule r: gelu(x, approximate="{code}") => relu(x)\n'
                          f'rule s: relu(x) => gelu(x, "\\x00{code}")')
    assert len(rules) == 2  # strings that look like code stay strings
    assert rules.rules["s"].replacement.args["approximate"].value == "\x00" + code
    with pytest.raises(rewrite.RuleError, match="E206"):  # and a string is never a dtype
        rewrite.parse(f'rule s: relu(x) => to(x, "\\x00{code}")')
    assert not (tmp_path / "pwned").exists()


# ---------------------------------------------------------------- a hole


FROM_FILE_RULE = (
    'rule r: relu(x) => add(clamp(x, 0.0), mul(aten.sum.default(aten.fill_.Scalar('
    'aten.from_file.default("{path}", True, 5, dtype=torch.uint8), 88)), 0))'
)


def test_custom_op_names_are_looked_up_never_imported(nothing_runs):
    """A library namespace is looked up in the dispatcher's registry: naming one that
    is not registered imports nothing and leaves no trace on ``torch.ops``; a
    registered op that writes its argument is refused, saying why."""
    from rewrite.ops import op_refusal

    for text in ("rule r: mylib_not_loaded.f(x) => x", "rule r: torch.ops.mylib_not_loaded.f.default(x) => x"):
        err = _rejected(text, {"E102"})
        assert "import the module" in err.diagnostics[0].help
    assert "mylib_not_loaded" not in dir(torch.ops)
    lib = torch.library.Library("rwsecurity", "DEF")
    lib.define("scribble(Tensor(a!) x) -> Tensor(a!)")
    err = _rejected("rule r: relu(x) => rwsecurity.scribble(x)", {"E102"})
    assert "refused" in err.diagnostics[0].message and "writes its argument 'x'" in err.diagnostics[0].message
    assert lookup_op("rwsecurity.scribble") is None and op_refusal("rwsecurity.scribble") is not None


def test_aten_from_file_is_not_an_op():
    assert lookup_op("aten.from_file") is None  # the packet is refused (its first argument is no tensor)
    assert lookup_op("aten.from_file.default") is None
    assert lookup_op("torch.ops.aten.from_file.default") is None


def test_a_rule_file_cannot_make_the_rewritten_model_write_files(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"hello world")
    try:
        rules = rewrite.parse(FROM_FILE_RULE.format(path=victim))
    except RuleError:
        return  # the fix: refused at load time
    try:
        rules.apply(fx.symbolic_trace(torch.nn.ReLU()), (torch.randn(3),))
    finally:
        assert victim.read_bytes() == b"hello world"


def test_imports_read_only_rule_files(tmp_path):
    bad = tmp_path / "a.rw"
    bad.write_text('import "/proc/self/environ"\nrule r: neg(neg(x)) => x\n')
    with pytest.raises(rewrite.RuleError) as info:
        rewrite.load(str(bad))
    assert "not a .rw rule file" in str(info.value) and "E402" in str(info.value)


def test_imports_check_the_resolved_path_and_odd_names(tmp_path):
    """A symlink named *.rw that points at another file is not read (nor quoted); a
    NUL byte or a too-long name is a positioned E402, never an OSError/ValueError."""
    import os

    from rewrite.language import RuleError, load_program

    secret = tmp_path / "secret.txt"
    secret.write_text("TOP SECRET first line\n")
    os.symlink(secret, tmp_path / "link.rw")
    main = tmp_path / "main.rw"
    main.write_text('import "link.rw"\nimport "a\\x00b.rw"\nimport "' + "a" * 5000 + '.rw"\n'
                    "rule r: relu(x) => x\n")
    with pytest.raises(RuleError) as info:
        load_program([str(main)])
    text = str(info.value)
    assert "TOP SECRET" not in text
    assert [d.code for d in info.value.diagnostics] == ["E402", "E402", "E402"]
    assert [d.span.line for d in info.value.diagnostics] == [1, 2, 3]
