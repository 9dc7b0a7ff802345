"""Custom ops (``torch.library``) in rules: matched and emitted at every capture level,
their schema as signature, verified like any op; mutating, side-effectful and random
ops refused with a diagnostic that says why (``rewrite.ops.custom``)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import rewrite
from rewrite.language import RuleError
from rewrite.ops import lookup_op, op_refusal
from rewrite.trust.verify import verify_rules


@torch.library.custom_op("rwtest::myrelu", mutates_args=())
def myrelu(x: torch.Tensor) -> torch.Tensor:
    return x.relu()


@myrelu.register_fake
def _myrelu_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("rwtest::scale", mutates_args=())
def scale(x: torch.Tensor, alpha: float = 2.0) -> torch.Tensor:
    return x * alpha


@scale.register_fake
def _scale_fake(x: torch.Tensor, alpha: float = 2.0) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("rwtest::bump", mutates_args=("x",))
def bump(x: torch.Tensor) -> None:
    x.add_(1)


# ops defined from a schema string: out= variants, random draws, no result, two overloads
_LIB = torch.library.Library("rwtest2", "DEF")
_LIB.define("twice(Tensor x) -> Tensor")
_LIB.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")
_LIB.define("twice.out(Tensor x, *, Tensor(a!) out) -> Tensor(a!)")
_LIB.define("noisy(Tensor x) -> Tensor", tags=(torch.Tag.nondeterministic_seeded,))
_LIB.define("log_it(Tensor x) -> ()")
_LIB.define("pair(Tensor x) -> Tensor")
_LIB.define("pair.scaled(Tensor x, float s) -> Tensor")
_LIB.define("side(Tensor x) -> Tensor")
fx.node.has_side_effect(torch.ops.rwtest2.side.default)


class Model(torch.nn.Module):
    """Every way user code calls the op: the packet, the overload, the custom_op function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.ops.rwtest.myrelu(x - 0.5)
        b = torch.ops.rwtest.myrelu.default(a * 3)
        return myrelu(b - 1) + 1


def _targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _is_myrelu(target) -> bool:
    return target in (torch.ops.rwtest.myrelu, torch.ops.rwtest.myrelu.default)


TO_RELU = "rule unwrap: rwtest.myrelu(x) => relu(x)"
TO_CUSTOM = "rule wrap: relu(x) => torch.ops.rwtest.myrelu.default(x)"


# ---------------------------------------------------------------- names


@pytest.mark.parametrize("name", ["rwtest.myrelu", "rwtest.myrelu.default", "torch.ops.rwtest.myrelu",
                                  "torch.ops.rwtest.myrelu.default"])
def test_every_spelling_resolves_to_the_schema(name):
    opdef = lookup_op(name)
    assert opdef is not None and opdef.qualified
    assert opdef.param_names == ("x",) and opdef.params[0].tensor
    targets = {f.target for f in opdef.forms}
    assert targets == {torch.ops.rwtest.myrelu, torch.ops.rwtest.myrelu.default}


def test_schema_drives_the_signature_and_the_checks():
    opdef = lookup_op("rwtest.scale")
    assert opdef.param_names == ("x", "alpha") and opdef.param("alpha").default == 2.0
    rewrite.parse("rule r: rwtest.scale(x, alpha=a) => mul(x, a)")
    with pytest.raises(RuleError) as info:
        rewrite.parse("rule r: rwtest.myrelu(x, y) => add(x, y)")
    assert [d.code for d in info.value.diagnostics] == ["E201"]
    with pytest.raises(RuleError) as info:
        rewrite.parse("rule r: rwtest.scale(x, beta=1.0) => x")
    assert {d.code for d in info.value.diagnostics} == {"E202"}


def _refused(text: str) -> str:
    with pytest.raises(RuleError) as info:
        rewrite.parse(text, "custom.rw")
    (d,) = info.value.diagnostics
    assert d.code in ("E101", "E102") and d.span.path == "custom.rw"
    return f"{d.message} / {d.help}"


@pytest.mark.parametrize("name, why", [
    ("rwtest.bump", "writes its argument 'x' in place"),
    ("torch.ops.rwtest2.twice.out", "out= argument"),
    ("rwtest2.noisy", "random"),
    ("rwtest2.log_it", "returns nothing"),
    ("rwtest2.side", "side-effectful"),
    ("c10d.send", "torch's own namespace"),
    ("debugprims.load_tensor", "torch's own namespace"),
    ("torch.ops.prims.add", "torch's own namespace"),
])
@pytest.mark.parametrize("place", ["rule r: {}(x) => x", "rule r: relu(x) => {}(x)",
                                   "family f = relu | {}\nrule r: f(x) => x"])
def test_unsafe_ops_are_refused_saying_why(name, why, place):
    assert lookup_op(name) is None
    message = _refused(place.format(name))
    assert "refused" in message and why in message, message


def test_unknown_library_says_to_register_it_first():
    message = _refused("rule r: nolib.myrelu(x) => x")
    assert message.startswith("unknown op 'nolib.myrelu'") and "import the module" in message
    assert "nolib" not in dir(torch.ops)  # looked up in the registry, nothing created
    message = _refused("rule r: rwtest.myrleu(x) => x")
    assert "rwtest.myrelu" in message  # the library's ops are listed
    assert op_refusal("relu") is None and op_refusal("rwtest.myrelu") is None


def test_a_packet_with_several_overloads_binds_only_its_overloads():
    opdef = lookup_op("rwtest2.pair")
    assert {f.target for f in opdef.forms} == {torch.ops.rwtest2.pair.default}
    scaled = lookup_op("rwtest2.pair.scaled")
    assert scaled.param_names == ("x", "s")


# ---------------------------------------------------------------- every capture level


def _check_unwrapped(gm: fx.GraphModule, result, x: torch.Tensor) -> None:
    assert result.counts == {"unwrap": 3}
    targets = _targets(result.graph_module)
    assert not any(_is_myrelu(t) for t in targets)
    assert sum(t in (torch.relu, torch.ops.aten.relu.default) for t in targets) == 3
    out = result.graph_module(x)
    torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, Model()(x))


def test_matched_in_symbolic_trace_graphs():
    x = torch.randn(4, 5)
    gm = fx.symbolic_trace(Model())
    assert sum(_is_myrelu(t) for t in _targets(gm)) == 3  # packet, overload, overload
    assert torch.ops.rwtest.myrelu in _targets(gm)
    _check_unwrapped(gm, rewrite.parse(TO_RELU).apply(gm, example_inputs=(x,)), x)
    assert sum(_is_myrelu(t) for t in _targets(gm)) == 3  # the input graph is never mutated


def test_matched_in_export_graphs():
    x = torch.randn(4, 5)
    gm = torch.export.export(Model(), (x,)).graph_module
    assert _targets(gm).count(torch.ops.rwtest.myrelu.default) == 3
    _check_unwrapped(gm, rewrite.parse(TO_RELU).apply(gm, example_inputs=(x,)), x)


def test_matched_in_dynamo_graphs():
    x = torch.randn(4, 5)
    results = []
    torch._dynamo.reset()
    compiled = torch.compile(Model(), backend=rewrite.backend(rewrite.parse(TO_RELU), on_result=results.append))
    torch.testing.assert_close(compiled(x), Model()(x))
    torch._dynamo.reset()
    assert [r.counts for r in results] == [{"unwrap": 3}]
    assert not any(_is_myrelu(t) for t in _targets(results[0].graph_module))


@pytest.mark.parametrize("level", ["fx", "export"])
def test_emitted_as_the_overload(level):
    class Relus(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x) * torch.relu(x - 1)

    x = torch.randn(3, 4)
    gm = fx.symbolic_trace(Relus()) if level == "fx" else torch.export.export(Relus(), (x,)).graph_module
    result = rewrite.parse(TO_CUSTOM).apply(gm, example_inputs=(x,))
    assert result.counts == {"wrap": 2}
    assert _targets(result.graph_module).count(torch.ops.rwtest.myrelu.default) == 2
    out = result.graph_module(x)
    torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, Relus()(x))
    # and back: the emitted overload binds again
    back = rewrite.parse(TO_RELU).apply(result.graph_module, example_inputs=(x,))
    assert back.counts == {"unwrap": 2}


def test_literal_arguments_from_the_schema_match_and_emit():
    class Scaled(torch.nn.Module):
        def forward(self, x):
            return scale(x, 3.0) + scale(x)

    x = torch.randn(3)
    gm = torch.export.export(Scaled(), (x,)).graph_module
    rules = rewrite.parse("rule r: rwtest.scale(x, alpha=a) => mul(x, a)")
    result = rules.apply(gm, example_inputs=(x,))
    assert result.counts == {"r": 2}
    assert not any(t == torch.ops.rwtest.scale.default for t in _targets(result.graph_module))
    torch.testing.assert_close(result.graph_module(x)[0], Scaled()(x))


# ---------------------------------------------------------------- verification


def test_rules_over_custom_ops_verify():
    rules = rewrite.parse(f"""
{TO_RELU}
{TO_CUSTOM}
rule twice: rwtest2.twice(x) => mul(x, 2)
rule scaled: rwtest.scale(x) where is_float(x) => add(x, x)
""")
    report = verify_rules(rules, max_examples=15, seed=0)
    assert {v.rule: v.status for v in report.verdicts} == dict.fromkeys(
        ["unwrap", "wrap", "twice", "scaled"], "ok"), report.table()
    wrong = rewrite.parse("rule wrong: rwtest.myrelu(x) => abs(x)")
    assert [v.status for v in verify_rules(wrong, max_examples=30, seed=0).verdicts] == ["counterexample"]


def test_a_counterexample_names_a_custom_op_by_its_library():
    """The counterexample's graphs name a library's op as the rule does
    (``rwtest2.twice``): every OpOverload was printed ``aten.<name>`` (probe CE F1),
    an op that does not exist."""
    report = verify_rules(rewrite.parse("rule wrong: rwtest2.twice(x) => add(x, 1)"), max_examples=10, seed=0)
    assert [v.status for v in report.verdicts] == ["counterexample"]
    text = str(report)
    assert "= rwtest2.twice.default(%x)" in text, text
    assert "aten.twice" not in text


def test_cli_check_verify(tmp_path, capsys):
    from rewrite.cli import main

    path = tmp_path / "custom.rw"
    path.write_text(TO_RELU + "\n")
    assert main(["check", "--verify", "--seed", "0", "--max-examples", "10", str(path)]) == 0


def test_effects_read_a_packet_calls_schema():
    """``torch.ops.ns.f(x)`` in a symbolic_trace graph: aliasing and writes come from
    the schemas of the overloads the call may dispatch to (never ``out=``)."""
    from rewrite.ops.effects import may_alias, written_args

    lib = torch.library.Library("rwtest3", "DEF")
    lib.define("view_it(Tensor(a) x) -> Tensor(a)")
    lib.impl("view_it", lambda x: x.view(-1), "CompositeExplicitAutograd")

    class Calls(torch.nn.Module):
        def forward(self, x):
            return torch.ops.rwtest3.view_it(x) + torch.ops.aten.relu(x) + torch.ops.aten.relu_(x.clone())

    gm = fx.symbolic_trace(Calls())
    facts = {n.target: (may_alias(n, gm), written_args(n, gm)) for n in gm.graph.nodes
             if isinstance(n.target, torch._ops.OpOverloadPacket)}
    assert facts == {torch.ops.rwtest3.view_it: (True, ()), torch.ops.aten.relu: (False, ()),
                     torch.ops.aten.relu_: (True, (0,))}


def test_cli_import_registers_a_library_before_the_rule_files_load(tmp_path):
    """In a fresh process the library exists only if ``rewrite --import MODULE`` imports it."""
    import subprocess
    import sys

    (tmp_path / "cli_ops_lib.py").write_text(
        "import torch\n"
        "@torch.library.custom_op('rwcli::myrelu', mutates_args=())\n"
        "def myrelu(x: torch.Tensor) -> torch.Tensor:\n"
        "    return x.relu()\n"
        "@myrelu.register_fake\n"
        "def _(x):\n"
        "    return torch.empty_like(x)\n")
    (tmp_path / "r.rw").write_text("rule unwrap: rwcli.myrelu(x) => relu(x)\n")

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "rewrite", *args], cwd=tmp_path, capture_output=True,
                              text=True, env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)})

    without = cli("check", "r.rw")
    assert without.returncode == 1 and "rewrite --import MODULE" in without.stderr
    with_lib = cli("--import", "cli_ops_lib", "check", "--verify", "--max-examples", "5", "r.rw")
    assert with_lib.returncode == 0, with_lib.stderr
    assert "1 ok" in with_lib.stdout
    missing = cli("--import", "no_such_module_here", "check", "r.rw")
    assert missing.returncode == 2 and "No module named" in missing.stderr
