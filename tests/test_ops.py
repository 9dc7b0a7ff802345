"""The op vocabulary against real captured graphs.

One small network is captured four ways (``symbolic_trace``, dynamo, ``torch.export``
training IR, core ATen after ``run_decompositions``); each test asserts that the
nodes a rule would match bind to the canonical op with the same normalized
arguments at every level. Emission is checked by building each op in both dialects,
running it, and binding the emitted node back.
"""

from __future__ import annotations

import operator
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from rewrite.ops import ConstRef, bind_node, detect_dialect, forms_for_key, lookup_op, node_key, op_names
from rewrite.ops.base import REQUIRED
from rewrite.ops.forms import EmitError, same_arg, same_value
from rewrite.ops.vocabulary import OPS, mutates_input

LEVELS = ("symbolic", "dynamo", "export", "core")
pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions:UserWarning")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.flat = nn.Flatten()
        self.fc = nn.Linear(16, 6)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> tuple:     # x: (2, 3, 4, 4)
        y = self.relu(self.bn(self.conv(x)))          # (2, 4, 4, 4)
        y = F.max_pool2d(y, 2)                        # (2, 4, 2, 2)
        z = self.drop(self.fc(self.flat(y)))          # (2, 6)
        z = (z + 1.5) * z
        z = F.softmax(z, dim=-1)
        v = z.view(3, 4).permute(1, 0).reshape(2, 6).transpose(0, 1)  # (6, 2)
        c = torch.cat([v, v], dim=1).to(torch.float64)                 # (6, 4)
        return c, c[0]


def _dynamo(model: nn.Module, args: tuple) -> fx.GraphModule:
    graphs = []

    def backend(gm: fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(*args)
    torch._dynamo.reset()
    return graphs[0]


def capture(model: nn.Module, args: tuple, levels: tuple = LEVELS) -> dict:
    model.eval()
    out = {}
    if "symbolic" in levels:
        out["symbolic"] = fx.symbolic_trace(model)
    if "dynamo" in levels:
        out["dynamo"] = _dynamo(model, args)
    if "export" in levels or "core" in levels:
        ep = torch.export.export(model, args)
        out["export"] = ep.module()
        if "core" in levels:
            out["core"] = ep.run_decompositions().module()
    return out


@pytest.fixture(scope="module")
def graphs() -> dict:
    torch.manual_seed(0)
    return capture(Net(), (torch.randn(2, 3, 4, 4),))


def bindings(gm: fx.GraphModule, op: str) -> list:
    """(node, Bound) for every node of ``gm`` that binds to ``op``, in graph order."""
    return [(n, b) for n in gm.graph.nodes for b in bind_node(n, gm) if b.op == op]


def only(gm: fx.GraphModule, op: str) -> dict:
    found = bindings(gm, op)
    assert len(found) == 1, f"expected one {op}, got {[str(n) for n, _ in found]}"
    return found[0][1].args


def ints(value: object, n: int) -> tuple:
    """A per-dimension int argument as a tuple: 1, (1, 1) and [1, 1] all mean (1, 1)."""
    return (value,) * n if isinstance(value, int) else tuple(value)


def const_name(value: object) -> str:
    """Where a constant operand comes from, spelled the same at every level."""
    if isinstance(value, ConstRef):
        return value.qualname
    if value.op == "get_attr":
        return value.target
    return value.name  # dynamo lifts parameters to placeholders: l_self_modules_conv_parameters_weight_


# ---- binding at every capture level ---------------------------------------------


@pytest.mark.parametrize("level", LEVELS)
def test_conv(graphs: dict, level: str) -> None:
    args = only(graphs[level], "conv")
    assert args["input"].op == "placeholder"
    assert "conv" in const_name(args["weight"]) and "weight" in const_name(args["weight"])
    assert "bias" in const_name(args["bias"])
    assert ints(args["stride"], 2) == (1, 1) and ints(args["padding"], 2) == (1, 1)
    assert ints(args["dilation"], 2) == (1, 1) and args["groups"] == 1


@pytest.mark.parametrize("level", LEVELS)
def test_batch_norm(graphs: dict, level: str) -> None:
    gm = graphs[level]
    (node, bound), = bindings(gm, "batch_norm")
    args = bound.args
    assert args["training"] is False and args["momentum"] == 0.1 and args["eps"] == 1e-5
    assert "running_mean" in const_name(args["running_mean"]) and "running_var" in const_name(args["running_var"])
    assert "bn" in const_name(args["weight"]) and "bias" in const_name(args["bias"])
    assert bind_node(args["input"], gm)[0].op == "conv"
    if level == "core":  # getitem(_native_batch_norm_legit_no_training(...), 0): both readings
        assert node.target is operator.getitem and sorted(b.op for b in bind_node(node, gm)) == ["batch_norm", "getitem"]
        assert bound.interior == (node.args[0],)


@pytest.mark.parametrize("level", LEVELS)
def test_relu(graphs: dict, level: str) -> None:
    (node, bound), = bindings(graphs[level], "relu")
    assert "batch_norm" in [b.op for b in bind_node(bound.args["input"], graphs[level])]


@pytest.mark.parametrize("level", ("symbolic", "dynamo", "export"))
def test_linear(graphs: dict, level: str) -> None:
    args = only(graphs[level], "linear")
    assert "fc" in const_name(args["weight"]) and "fc" in const_name(args["bias"])
    assert bind_node(args["input"], graphs[level])[0].op == "flatten"


def test_linear_is_addmm_in_core_aten(graphs: dict) -> None:
    gm = graphs["core"]
    assert not bindings(gm, "linear")
    args = only(gm, "addmm")
    assert const_name(args["input"]) == "fc.bias" and args["beta"] == 1 and args["alpha"] == 1
    permute = bind_node(args["mat2"], gm)[0]
    assert permute.op == "permute" and ints(permute.args["dims"], 2) == (1, 0)


@pytest.mark.parametrize("level", ("symbolic", "dynamo", "export"))
def test_flatten(graphs: dict, level: str) -> None:
    args = only(graphs[level], "flatten")
    assert args["start_dim"] == 1 and args["end_dim"] == -1


@pytest.mark.parametrize("level", LEVELS)
def test_max_pool2d(graphs: dict, level: str) -> None:
    args = only(graphs[level], "max_pool2d")
    assert ints(args["kernel_size"], 2) == (2, 2)
    assert args["stride"] is None or ints(args["stride"], 2) == (2, 2)
    assert args["padding"] in (0, [0, 0], (0, 0)) and args["ceil_mode"] is False


@pytest.mark.parametrize("level", ("symbolic", "dynamo", "export"))
def test_dropout(graphs: dict, level: str) -> None:
    args = only(graphs[level], "dropout")
    assert args["p"] == 0.25 and args["training"] is False


def test_dropout_in_core_aten_is_clone(graphs: dict) -> None:
    assert not bindings(graphs["core"], "dropout")
    assert bindings(graphs["core"], "clone")


@pytest.mark.parametrize("level", LEVELS)
def test_add_and_mul(graphs: dict, level: str) -> None:
    gm = graphs[level]
    add = only(gm, "add")
    assert add["other"] == 1.5 and add["alpha"] == 1
    mul = only(gm, "mul")
    assert mul["input"] is next(n for n, _ in bindings(gm, "add"))
    assert mul["other"] is add["input"]
    assert OPS["add"].commutative and OPS["mul"].commutative and not OPS["sub"].commutative


@pytest.mark.parametrize("level", LEVELS)
def test_softmax(graphs: dict, level: str) -> None:
    args = only(graphs[level], "softmax")
    assert args["dim"] == -1 and args["dtype"] is None


@pytest.mark.parametrize("level", LEVELS)
def test_shape_ops(graphs: dict, level: str) -> None:
    gm = graphs[level]
    shapes = [tuple(b.args["shape"]) for _, b in bindings(gm, "view")]
    dims = [tuple(b.args["dims"]) for _, b in bindings(gm, "permute")]
    if level == "core":  # reshape becomes view; transpose (and linear's weight.T) become permute
        assert {(3, 4), (2, 6)} <= set(shapes) and dims.count((1, 0)) == 3
        return
    assert shapes == [(3, 4)] and dims == [(1, 0)]
    assert tuple(only(gm, "reshape")["shape"]) == (2, 6)
    transpose = only(gm, "transpose")
    assert (transpose["dim0"], transpose["dim1"]) == (0, 1)


@pytest.mark.parametrize("level", LEVELS)
def test_cat_and_to(graphs: dict, level: str) -> None:
    gm = graphs[level]
    cat = only(gm, "cat")
    assert cat["dim"] == 1 and len(cat["tensors"]) == 2 and cat["tensors"][0] is cat["tensors"][1]
    to = only(gm, "to")
    assert to["dtype"] is torch.float64
    assert to["input"] is next(n for n, _ in bindings(gm, "cat"))


@pytest.mark.parametrize("level", LEVELS)
def test_getitem(graphs: dict, level: str) -> None:
    items = [b.args for _, b in bindings(graphs[level], "getitem")]
    if level in ("symbolic", "dynamo"):
        assert [a["index"] for a in items] == [0]  # c[0]
    else:  # export spells c[0] as aten.select; core ATen's tuple outputs are getitems
        assert all(a["index"] == 0 for a in items) and len(items) == (2 if level == "core" else 0)


@pytest.mark.parametrize("level", LEVELS)
def test_every_op_node_binds(graphs: dict, level: str) -> None:
    """Apart from export's guard module, metadata asserts, select and the tuple-valued
    ops that getitem forms consume, every call in the graph is known."""
    gm = graphs[level]
    unbound = [n for n in gm.graph.nodes if n.op.startswith("call") and not bind_node(n, gm)]
    aten = torch.ops.aten
    allowed = {"_guards_fn", aten.select.int, aten._assert_tensor_metadata.default,
               aten._native_batch_norm_legit_no_training.default, aten.max_pool2d_with_indices.default}
    assert all(n.target in allowed for n in unbound), [str(n.target) for n in unbound]


@pytest.mark.parametrize("level", LEVELS)
def test_non_calls_bind_to_nothing(graphs: dict, level: str) -> None:
    gm = graphs[level]
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            assert bind_node(node, gm) == ()


def test_detect_dialect(graphs: dict) -> None:
    assert {lvl: detect_dialect(gm) for lvl, gm in graphs.items()} == {
        "symbolic": "torch", "dynamo": "torch", "export": "aten", "core": "aten"}


def test_forms_for_key(graphs: dict) -> None:
    gm = graphs["export"]
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.conv2d.default)
    assert [opdef.name for opdef, _ in forms_for_key(node_key(node, gm))] == ["conv"]
    assert forms_for_key(("call_function", print)) == ()


# ---- spellings that must bind alike ---------------------------------------------


class Spellings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3, 3, 3))
        self.sm = nn.Softmax(dim=-1)
        self.mean = nn.Parameter(torch.zeros(3), requires_grad=False)
        self.var = nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple:
        return (
            F.conv2d(x, self.w, None, 1, 1), F.conv2d(x, self.w, padding=1),
            torch.conv2d(x, weight=self.w, stride=1, padding=1),
            F.dropout(x, 0.2, False), F.dropout(x, p=0.2, training=False), torch.dropout(x, 0.2, False),
            x.view(2, -1), x.view((2, -1)), x.view([2, -1]),
            x.permute(0, 2, 1, 3), x.permute([0, 2, 1, 3]), torch.permute(x, (0, 2, 1, 3)),
            F.softmax(x, -1), F.softmax(x, dim=-1), x.softmax(-1), torch.softmax(x, -1), self.sm(x),
            F.batch_norm(x, self.mean, self.var, eps=1e-3), torch.batch_norm(x, None, None, self.mean, self.var,
                                                                             False, 0.1, 1e-3, True),
            x + 2, torch.add(x, 2), x.add(2), x.add(other=2),
            F.relu(x), F.relu(x, inplace=False), torch.relu(x), x.relu(),
            x.to(torch.float16), x.to(dtype=torch.float16), x.half(), x.type(torch.float16),
            x.to("cpu"), x.view(torch.int32),
        )


@pytest.fixture(scope="module")
def spellings() -> fx.GraphModule:
    return fx.symbolic_trace(Spellings())


def _groups(gm: fx.GraphModule) -> dict:
    out: dict = {}
    for node in gm.graph.nodes:
        for b in bind_node(node, gm):
            out.setdefault(b.op, []).append(b.args)
    return out


def test_positional_and_keyword_spellings_bind_equal(spellings: fx.GraphModule) -> None:
    groups = _groups(spellings)
    expected_counts = {"conv": 3, "dropout": 3, "view": 3, "permute": 3, "softmax": 5,
                       "batch_norm": 2, "add": 4, "relu": 4, "to": 4}
    for op, count in expected_counts.items():
        found = groups[op]
        assert len(found) == count, op
        first = found[0]
        for args in found[1:]:
            assert all(same_value(args[k], first[k]) for k in first), (op, first, args)
    assert tuple(groups["view"][0]["shape"]) == (2, -1)
    assert groups["batch_norm"][0]["eps"] == 1e-3 and groups["batch_norm"][0]["training"] is False
    assert groups["softmax"][-1]["dim"] == -1  # nn.Softmax(dim=-1)


def test_not_this_op(spellings: fx.GraphModule) -> None:
    """x.to("cpu") is a move, x.view(torch.int32) a bit cast: neither binds."""
    nodes = {(n.target, n.args[1]): n for n in spellings.graph.nodes
             if n.op == "call_method" and n.target in ("to", "view") and len(n.args) == 2}
    assert bind_node(nodes[("to", "cpu")], spellings) == ()
    assert bind_node(nodes[("view", torch.int32)], spellings) == ()


def test_module_forms_follow_module_state() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 3, 3, padding_mode="reflect", padding=1), nn.BatchNorm2d(3, affine=False),
        nn.BatchNorm2d(3, track_running_stats=False), nn.ReLU(inplace=True), nn.Dropout(0.1),
        nn.ReLU6(), nn.Identity())
    gm = fx.symbolic_trace(model.train())
    got = {n.target: bind_node(n, gm) for n in gm.graph.nodes if n.op == "call_module"}
    assert got["0"] == ()  # reflect padding is not a plain conv
    bn = got["1"][0].args
    assert bn["weight"] is None and bn["training"] is True and bn["running_mean"] == ConstRef("1.running_mean")
    no_stats = got["2"][0].args
    assert no_stats["running_mean"] is None and no_stats["training"] is True
    assert got["3"][0].op == "relu" and mutates_input(next(n for n in gm.graph.nodes if n.target == "3"), gm)
    assert got["4"][0].args == {"input": next(n for n in gm.graph.nodes if n.target == "3"), "p": 0.1,
                                "training": True}
    assert sorted(b.op for b in got["5"]) == ["hardtanh", "relu6"]
    assert got["6"][0].op == "identity"
    gm_eval = fx.symbolic_trace(model.eval())
    assert bind_node(next(n for n in gm_eval.graph.nodes if n.target == "1"), gm_eval)[0].args["training"] is False


def test_inplace_twins() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x.relu_()
            y = y.add_(1)
            return F.relu(y, inplace=True)

    gm = fx.symbolic_trace(M())
    calls = [n for n in gm.graph.nodes if n.op.startswith("call")]
    assert [bind_node(n, gm)[0].op for n in calls] == ["relu", "add", "relu"]
    assert all(mutates_input(n, gm) for n in calls)
    ep = torch.export.export(nn.Sequential(nn.ReLU(inplace=True)), (torch.randn(2),)).module()
    relu_ = next(n for n in ep.graph.nodes if n.target is torch.ops.aten.relu_.default)
    assert bind_node(relu_, ep)[0].op == "relu" and mutates_input(relu_, ep)
    plain = fx.symbolic_trace(nn.Sequential(nn.ReLU()))
    assert not any(mutates_input(n, plain) for n in plain.graph.nodes)


# ---- lookup ---------------------------------------------------------------------


def test_canonical_names() -> None:
    names = op_names()
    assert names == sorted(names)
    for name in ("conv", "conv_transpose", "linear", "batch_norm", "layer_norm", "group_norm", "relu",
                 "gelu", "add", "sub", "mul", "div", "matmul", "dropout", "softmax", "to", "view",
                 "reshape", "permute", "cat", "getitem", "scaled_dot_product_attention"):
        assert name in names and lookup_op(name) is OPS[name]
    assert lookup_op("conv").param_names == ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


@pytest.mark.parametrize("name, op, qualnames", [
    ("aten.conv2d", "conv", {"aten.conv2d.default", "aten.conv2d.padding"}),
    ("aten.conv2d.default", "conv", {"aten.conv2d.default"}),
    ("torch.ops.aten.conv2d.default", "conv", {"aten.conv2d.default"}),
    ("F.relu", "relu", {"F.relu"}),
    ("torch.nn.functional.relu", "relu", {"F.relu"}),
    ("torch.relu", "relu", {"torch.relu"}),
    ("F.conv2d", "conv", {"torch.conv2d"}),  # the same builtin
    ("nn.Conv2d", "conv", {"nn.Conv2d"}),
    ("torch.nn.Conv2d", "conv", {"nn.Conv2d"}),
    ("Tensor.clamp", "clamp", {"Tensor.clamp"}),
    ("torch.Tensor.view", "view", {"Tensor.view"}),
    ("operator.add", "add", {"operator.add"}),
    ("aten.hardtanh.default", "hardtanh", {"aten.hardtanh.default"}),
    ("F.hardtanh", "hardtanh", {"F.hardtanh"}),  # not relu6, which also reads it (with bounds 0, 6)
    ("nn.ReLU6", "relu6", {"nn.ReLU6"}),
    ("aten.clone", "clone", {"aten.clone.default"}),
    ("torch._C._nn.linear", "linear", {"F.linear"}),
])
def test_qualified_vocabulary_names(name: str, op: str, qualnames: set) -> None:
    opdef = lookup_op(name)
    assert opdef.name == op and opdef.params == OPS[op].params
    assert {f.qualname for f in opdef.forms} == qualnames


def test_only_canonical_ops_are_their_own_lookup() -> None:
    """``lookup_op(op.name) is op`` tells a canonical op from a pinned or generic one."""
    for name in ("conv", "relu", "to"):
        assert lookup_op(lookup_op(name).name) is lookup_op(name)
    for name in ("aten.conv2d", "F.relu", "aten.hardsigmoid", "Tensor.clamp_min"):
        assert lookup_op(lookup_op(name).name) is not lookup_op(name)


def test_qualified_name_matches_only_its_spelling(graphs: dict) -> None:
    pinned = lookup_op("aten.conv2d")

    def matches(gm: fx.GraphModule) -> bool:
        return any(f.key == node_key(n, gm) and f.bind(n, gm, pinned) for n in gm.graph.nodes for f in pinned.forms)

    assert matches(graphs["export"])
    assert not matches(graphs["symbolic"]) and not matches(graphs["core"])


def test_qualified_name_emits_its_target() -> None:
    x = fx.Graph().placeholder("x")
    assert lookup_op("Tensor.relu_").emit["torch"]({"input": x}, lambda v: None)[0] is torch.Tensor.relu_
    assert lookup_op("operator.add").emit["aten"]({"input": x, "other": 1}, lambda v: None)[:2] == (operator.add, (x, 1))
    assert lookup_op("F.relu").emit["aten"]({"input": x}, lambda v: None)[0] is F.relu
    # a module spelling cannot be emitted as a call: it falls back to the op's emitter
    assert lookup_op("nn.ReLU").emit["aten"]({"input": x}, lambda v: None)[0] is torch.ops.aten.relu.default


@pytest.mark.parametrize("name", ["aten.hardsigmoid", "aten.hardsigmoid.default", "Tensor.clamp_min",
                                  "torch.clamp_min", "F.elu", "aten.convolution"])
def test_generic_ops_from_schema(name: str) -> None:
    opdef = lookup_op(name)
    assert opdef is not None and opdef.name == name.replace("torch.ops.", "")
    assert opdef.forms and set(opdef.emit) == {"torch", "aten"}
    assert opdef.param_names[0] == "input"


def test_generic_op_binds_and_emits() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.clamp_min(0.5) + F.elu(x, alpha=0.5)

    gm = fx.symbolic_trace(M())
    clamp_min, elu = lookup_op("Tensor.clamp_min"), lookup_op("F.elu")
    assert clamp_min.param_names == ("input", "min") and "inplace" not in elu.param_names
    node = next(n for n in gm.graph.nodes if n.target == "clamp_min")
    form = next(f for f in clamp_min.forms if f.key == node_key(node, gm))
    assert form.bind(node, gm, clamp_min).args == {"input": node.args[0], "min": 0.5}
    node = next(n for n in gm.graph.nodes if n.target is F.elu)
    assert elu.forms[0].bind(node, gm, elu).args["alpha"] == 0.5
    assert {f.qualname for f in lookup_op("aten.clamp_min").forms} == {
        "aten.clamp_min.default", "aten.clamp_min.Tensor"}  # not .out
    conv = lookup_op("aten.convolution")
    assert "transposed" in conv.param_names and conv.name == "aten.convolution"


@pytest.mark.parametrize("name", [
    "os.system", "__import__", "builtins.eval", "torch.__class__", "nn.Module.__subclasses__", "eval",
    "torch.load", "torch.save", "torch._C._nn.__dict__", "F.torch", "Tensor.register_hook", "operator.attrgetter",
    "subprocess.run", "nn.Module", "torch.ops.aten.__getattr__", "aten.no_such_op_anywhere", "conv3",
    "aten.conv2d.nonexistent", "torch.nn.modules.conv.os.system", "F._canonical_mask", "", "torch..relu",
    "Tensor.__add__", "operator.__add__",
])
def test_lookup_rejects(name: str) -> None:
    assert lookup_op(name) is None


# ---- emission ---------------------------------------------------------------------


def _t(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def _quantized(x: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(x, 0.1, 0, torch.quint8)


# op -> (canonical args with tensors, reference). Tensors become placeholders.
SAMPLES = {
    "conv": ({"input": _t(2, 3, 5, 5), "weight": _t(4, 3, 3, 3), "bias": _t(4), "padding": 1},
             lambda a: F.conv2d(a["input"], a["weight"], a["bias"], padding=1)),
    "conv_transpose": ({"input": _t(2, 3, 4, 4), "weight": _t(3, 2, 3, 3), "stride": 2},
                       lambda a: F.conv_transpose2d(a["input"], a["weight"], stride=2)),
    "linear": ({"input": _t(2, 5), "weight": _t(3, 5), "bias": _t(3)},
               lambda a: F.linear(a["input"], a["weight"], a["bias"])),
    "batch_norm": ({"input": _t(2, 3, 4, 4), "running_mean": _t(3), "running_var": _t(3).abs() + 0.5,
                    "weight": _t(3), "bias": _t(3), "eps": 1e-3},
                   lambda a: F.batch_norm(a["input"], a["running_mean"], a["running_var"], a["weight"],
                                          a["bias"], eps=1e-3)),
    "layer_norm": ({"input": _t(2, 3, 4), "normalized_shape": (4,), "weight": _t(4), "bias": _t(4)},
                   lambda a: F.layer_norm(a["input"], (4,), a["weight"], a["bias"])),
    "group_norm": ({"input": _t(2, 4, 3, 3), "num_groups": 2, "weight": _t(4), "bias": _t(4)},
                   lambda a: F.group_norm(a["input"], 2, a["weight"], a["bias"])),
    "relu": ({"input": _t(5)}, lambda a: a["input"].relu()),
    "gelu": ({"input": _t(5), "approximate": "tanh"}, lambda a: F.gelu(a["input"], approximate="tanh")),
    "silu": ({"input": _t(5)}, lambda a: F.silu(a["input"])),
    "sigmoid": ({"input": _t(5)}, lambda a: a["input"].sigmoid()),
    "tanh": ({"input": _t(5)}, lambda a: a["input"].tanh()),
    "hardswish": ({"input": _t(5)}, lambda a: F.hardswish(a["input"])),
    "hardtanh": ({"input": _t(5), "min_val": -0.5, "max_val": 0.5}, lambda a: a["input"].clamp(-0.5, 0.5)),
    "relu6": ({"input": _t(5) * 8}, lambda a: a["input"].clamp(0, 6)),
    "dropout": ({"input": _t(5), "p": 0.3, "training": False}, lambda a: a["input"]),
    "identity": ({"input": _t(5)}, lambda a: a["input"]),
    "max_pool2d": ({"input": _t(1, 2, 4, 4), "kernel_size": 2}, lambda a: F.max_pool2d(a["input"], 2)),
    "avg_pool2d": ({"input": _t(1, 2, 4, 4), "kernel_size": 2, "stride": 1},
                   lambda a: F.avg_pool2d(a["input"], 2, 1)),
    "adaptive_avg_pool2d": ({"input": _t(1, 2, 4, 4), "output_size": (1, 1)},
                            lambda a: a["input"].mean((2, 3), keepdim=True)),
    "embedding": ({"input": torch.tensor([[0, 2], [3, 1]]), "weight": _t(4, 3), "padding_idx": -1},
                  lambda a: a["weight"][a["input"]]),
    "scaled_dot_product_attention": (
        {"query": _t(1, 2, 4, 8), "key": _t(1, 2, 4, 8), "value": _t(1, 2, 4, 8), "is_causal": True},
        lambda a: F.scaled_dot_product_attention(a["query"], a["key"], a["value"], is_causal=True)),
    "add": ({"input": _t(3), "other": _t(3), "alpha": 2}, lambda a: a["input"] + 2 * a["other"]),
    "sub": ({"input": 1.5, "other": _t(3), "alpha": 2}, lambda a: 1.5 - 2 * a["other"]),
    "mul": ({"input": _t(3), "other": 3}, lambda a: a["input"] * 3),
    "div": ({"input": _t(3) * 10, "other": _t(3), "rounding_mode": "floor"},
            lambda a: torch.div(a["input"], a["other"], rounding_mode="floor")),
    "neg": ({"input": _t(3)}, lambda a: -a["input"]),
    "abs": ({"input": _t(3)}, lambda a: a["input"].abs()),
    "exp": ({"input": _t(3)}, lambda a: a["input"].exp()),
    "erf": ({"input": _t(3)}, lambda a: a["input"].erf()),
    "interpolate": ({"input": _t(1, 2, 3, 3), "size": None, "scale_factor": [2.0, 2.0], "mode": "bilinear",
                     "align_corners": False},
                    lambda a: F.interpolate(a["input"], scale_factor=2.0, mode="bilinear", align_corners=False)),
    "rms_norm": ({"input": _t(2, 3, 4), "normalized_shape": (4,), "weight": _t(4), "eps": 1e-6},
                 lambda a: F.rms_norm(a["input"], [4], a["weight"], 1e-6)),
    "log": ({"input": _t(3).abs() + 0.5}, lambda a: a["input"].log()),
    "sqrt": ({"input": _t(3).abs()}, lambda a: a["input"].sqrt()),
    "rsqrt": ({"input": _t(3).abs() + 1}, lambda a: 1 / a["input"].sqrt()),
    "reciprocal": ({"input": _t(3).abs() + 1}, lambda a: 1 / a["input"]),
    "pow": ({"input": _t(3).abs(), "exponent": 3.0}, lambda a: a["input"] ** 3),
    "clamp": ({"input": _t(5), "min": -0.5}, lambda a: a["input"].clamp(min=-0.5)),
    "matmul": ({"input": _t(2, 3, 4), "other": _t(4, 5)}, lambda a: a["input"] @ a["other"]),
    "mm": ({"input": _t(3, 4), "mat2": _t(4, 5)}, lambda a: a["input"] @ a["mat2"]),
    "bmm": ({"input": _t(2, 3, 4), "mat2": _t(2, 4, 5)}, lambda a: a["input"] @ a["mat2"]),
    "addmm": ({"input": _t(5), "mat1": _t(3, 4), "mat2": _t(4, 5), "beta": 0.5},
              lambda a: 0.5 * a["input"] + a["mat1"] @ a["mat2"]),
    "baddbmm": ({"input": _t(2, 3, 5), "batch1": _t(2, 3, 4), "batch2": _t(2, 4, 5), "alpha": 2},
                lambda a: a["input"] + 2 * (a["batch1"] @ a["batch2"])),
    "mean": ({"input": _t(2, 3, 4), "dim": (1,), "keepdim": True}, lambda a: a["input"].mean(1, keepdim=True)),
    "var": ({"input": _t(2, 3, 4), "dim": (1,), "correction": 0, "keepdim": True},
            lambda a: a["input"].var(1, keepdim=True, unbiased=False)),
    "std": ({"input": _t(2, 3, 4), "dim": (-1,), "correction": 1, "keepdim": False},
            lambda a: a["input"].std(-1)),
    "softmax": ({"input": _t(2, 5), "dim": -1}, lambda a: a["input"].softmax(-1)),
    "sum": ({"input": _t(2, 3, 4), "dim": (0, 2), "keepdim": True}, lambda a: a["input"].sum((0, 2), keepdim=True)),
    "stack": ({"tensors": [_t(2, 3), _t(2, 3)], "dim": 1}, lambda a: torch.stack(a["tensors"], 1)),
    "select": ({"input": _t(2, 3, 4), "dim": 1, "index": 2}, lambda a: a["input"][:, 2]),
    "prelu": ({"input": _t(2, 3, 4), "weight": _t(3)},
              lambda a: torch.where(a["input"] > 0, a["input"], a["weight"][:, None] * a["input"])),
    "reshape": ({"input": _t(2, 6), "shape": (3, -1)}, lambda a: a["input"].reshape(3, 4)),
    "view": ({"input": _t(2, 6), "shape": (3, -1)}, lambda a: a["input"].view(3, 4)),
    "flatten": ({"input": _t(2, 3, 4), "start_dim": 1}, lambda a: a["input"].reshape(2, 12)),
    "permute": ({"input": _t(2, 3, 4), "dims": (2, 0, 1)}, lambda a: a["input"].permute(2, 0, 1)),
    "transpose": ({"input": _t(2, 3, 4), "dim0": 0, "dim1": 2}, lambda a: a["input"].transpose(0, 2)),
    "t": ({"input": _t(2, 3)}, lambda a: a["input"].t()),
    "numpy_T": ({"input": _t(2, 3)}, lambda a: a["input"].T),
    "unsqueeze": ({"input": _t(2, 3), "dim": 1}, lambda a: a["input"][:, None]),
    "squeeze": ({"input": _t(2, 1, 3), "dim": 1}, lambda a: a["input"][:, 0]),
    "expand": ({"input": _t(3, 1), "size": (3, 4)}, lambda a: a["input"].repeat(1, 4)),
    "contiguous": ({"input": _t(3, 4)}, lambda a: a["input"]),
    "clone": ({"input": _t(3, 4)}, lambda a: a["input"]),
    "cat": ({"tensors": [_t(2, 3), _t(1, 3)], "dim": 0}, lambda a: torch.cat(a["tensors"])),
    "to": ({"input": _t(3), "dtype": torch.float64}, lambda a: a["input"].double()),
    "getitem": ({"input": _t(3, 4), "index": 1}, lambda a: a["input"][1]),
    "quantize_per_tensor": ({"input": _t(4), "scale": 0.1, "zero_point": 0, "dtype": torch.quint8},
                            lambda a: torch.quantize_per_tensor(a["input"], 0.1, 0, torch.quint8)),
    "dequantize": ({"input": _quantized(_t(4))}, lambda a: a["input"].dequantize()),
    "leaky_relu": ({"input": _t(5), "negative_slope": 0.2}, lambda a: F.leaky_relu(a["input"], 0.2)),
    "glu": ({"input": _t(3, 4), "dim": 1}, lambda a: a["input"][:, :2] * a["input"][:, 2:].sigmoid()),
    "sin": ({"input": _t(3)}, lambda a: a["input"].sin()),
    "cos": ({"input": _t(3)}, lambda a: a["input"].cos()),
    "masked_fill": ({"input": _t(3, 4), "mask": _t(3, 4) > 0, "value": -1.0},
                    lambda a: torch.where(a["mask"], -1.0, a["input"])),
    "einsum": ({"equation": "ij,kj->ik", "tensors": [_t(2, 3), _t(4, 3)]},
               lambda a: a["tensors"][0] @ a["tensors"][1].T),
    "amax": ({"input": _t(2, 3, 4), "dim": (0, 2), "keepdim": True},
             lambda a: a["input"].max(2, keepdim=True).values.max(0, keepdim=True).values),
    "max": ({"input": _t(2, 3), "dim": 1}, lambda a: tuple(torch.sort(a["input"], 1, descending=True))[0][:, 0]),
    "topk": ({"input": _t(2, 5), "k": 2}, lambda a: torch.sort(a["input"], -1, descending=True).values[:, :2]),
    "linalg_vector_norm": ({"input": _t(2, 3), "dim": -1}, lambda a: (a["input"] ** 2).sum(-1).sqrt()),
    "reshape_as": ({"input": _t(2, 6), "other": _t(3, 4)}, lambda a: a["input"].reshape(3, 4)),
    "expand_as": ({"input": _t(3, 1), "other": _t(3, 4)}, lambda a: a["input"].repeat(1, 4)),
    "type_as": ({"input": _t(3), "other": _t(2).double()}, lambda a: a["input"].double()),
    "split": ({"input": _t(5, 2), "split_size": [2, 3]}, lambda a: a["input"][:2]),
    "chunk": ({"input": _t(4, 2), "chunks": 2, "dim": 0}, lambda a: a["input"][:2]),
    "slice": ({"input": _t(3, 5), "dim": 1, "start": 1, "end": 4}, lambda a: a["input"][:, 1:4]),
    "pad": ({"input": _t(2, 3), "pad": [1, 2]}, lambda a: torch.cat([torch.zeros(2, 1), a["input"], torch.zeros(2, 2)], 1)),
}
#: multi-output ops: the sample's reference is their first result
MULTI_OUTPUT = {"split", "chunk", "max", "topk"}


def emit_graph(op: str, dialect: str, sample: dict) -> tuple:
    """A graph holding one emitted ``op`` whose tensor operands are placeholders."""
    graph = fx.Graph()
    example, args = {}, {}
    for name, value in sample.items():
        if isinstance(value, torch.Tensor):
            node = graph.placeholder(name)
            example[node] = value
            args[name] = node
        elif isinstance(value, list):
            args[name] = [graph.placeholder(f"{name}_{i}") for i in range(len(value))]
            example.update(zip(args[name], value))
        else:
            args[name] = value
    target, call_args, call_kwargs = lookup_op(op).emit[dialect](args, example.get)
    node = graph.call_function(target, call_args, call_kwargs)
    graph.output(node)
    gm = fx.GraphModule(nn.Module(), graph)
    inputs = [example[n] for n in graph.nodes if n.op == "placeholder"]
    return gm, node, args, inputs


def test_every_op_has_a_sample() -> None:
    assert set(SAMPLES) == set(OPS)


@pytest.mark.parametrize("dialect", ["torch", "aten"])
@pytest.mark.parametrize("op", sorted(SAMPLES))
def test_emit_runs_and_binds_back(op: str, dialect: str) -> None:
    sample, reference = SAMPLES[op]
    gm, node, args, inputs = emit_graph(op, dialect, sample)
    if dialect == "aten":
        assert isinstance(node.target, torch._ops.OpOverload) or node.target is operator.getitem
    else:
        # x.T has no torch function to call (symbolic_trace records getattr(x, "T")): its aten op
        assert not isinstance(node.target, torch._ops.OpOverload) or op in ("identity", "slice", "numpy_T")
    got = gm(*inputs)
    if op in MULTI_OUTPUT:
        assert isinstance(got, (tuple, list)) and len(got) >= 2, got  # aten returns a list
        got = got[0]
    want = reference(sample)
    if got.is_quantized:
        got, want = got.dequantize(), want.dequantize()
    torch.testing.assert_close(got, want.to(got.dtype), check_dtype=True)
    rebound = [b for b in bind_node(node, gm) if b.op == op]
    assert rebound, f"{op}: emitted {node.target} does not bind back"
    full = OPS[op].normalize_call((), args)
    if op == "embedding":  # emission resolves a negative padding index
        full["padding_idx"] = rebound[0].args["padding_idx"]
    assert all(same_arg(rebound[0].args[k], v) for k, v in full.items()), (rebound[0].args, full)


@pytest.mark.parametrize("rank, conv", [(1, F.conv1d), (2, F.conv2d), (3, F.conv3d)])
@pytest.mark.parametrize("dialect", ["torch", "aten"])
def test_conv_rank_from_weight(rank: int, conv: object, dialect: str) -> None:
    x, w = torch.randn(1, 3, *[4] * rank), torch.randn(2, 3, *[3] * rank)
    gm, node, _, inputs = emit_graph("conv", dialect, {"input": x, "weight": w, "padding": 1})
    assert node.target is (getattr(torch, f"conv{rank}d") if dialect == "torch"
                           else getattr(torch.ops.aten, f"conv{rank}d").default)
    torch.testing.assert_close(gm(*inputs), conv(x, w, padding=1))
    # without metadata the rank is unknown: the rank-generic convolution
    graph = fx.Graph()
    px, pw = graph.placeholder("x"), graph.placeholder("w")
    target, args, kwargs = OPS["conv"].emit[dialect]({"input": px, "weight": pw, "padding": 1}, lambda v: None)
    assert target in (torch.convolution, torch.ops.aten.convolution.default)
    graph.output(graph.call_function(target, args, kwargs))
    torch.testing.assert_close(fx.GraphModule(nn.Module(), graph)(x, w), conv(x, w, padding=1))


def test_conv_string_padding_uses_padding_overload() -> None:
    x, w = torch.randn(1, 3, 5, 5), torch.randn(4, 3, 3, 3)
    gm, node, _, inputs = emit_graph("conv", "aten", {"input": x, "weight": w, "padding": "same"})
    assert node.target is torch.ops.aten.conv2d.padding
    torch.testing.assert_close(gm(*inputs), F.conv2d(x, w, padding="same"))


def test_emission_drops_trailing_defaults() -> None:
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    facts = {w: torch.randn(4, 3, 3, 3)}.get
    target, args, kwargs = OPS["conv"].emit["aten"](
        {"input": x, "weight": w, "bias": None, "stride": 1, "padding": (1, 1), "dilation": [1, 1], "groups": 1},
        facts)
    assert (target, args, kwargs) == (torch.ops.aten.conv2d.default, (x, w, None, [1, 1], (1, 1)), {})
    target, args, kwargs = OPS["batch_norm"].emit["aten"]({"input": x, "running_mean": w, "running_var": w}, facts)
    assert target is torch.ops.aten.batch_norm.default and len(args) == 9  # cudnn_enabled is required


def test_emission_refuses_what_the_target_cannot_say() -> None:
    x = fx.Graph().placeholder("x")
    with pytest.raises(EmitError):
        lookup_op("Tensor.float").emit["torch"]({"input": x, "dtype": torch.float16}, lambda v: None)
    with pytest.raises(EmitError):
        OPS["embedding"].emit["aten"]({"input": x, "weight": x, "max_norm": 1.0}, lambda v: None)
    with pytest.raises(EmitError):
        OPS["conv"].emit["torch"]({"input": x}, lambda v: None)  # weight is required


# ---- the table itself -------------------------------------------------------------


def test_every_op_is_complete() -> None:
    for opdef in OPS.values():
        assert set(opdef.emit) == {"torch", "aten"} and opdef.forms and opdef.doc, opdef.name
        # one form per target and argument list (torch.var takes three)
        keys = {(f.key, getattr(f, "inner_target", None), getattr(f, "signature", None)) for f in opdef.forms}
        assert len(keys) == len(opdef.forms), opdef.name


def test_target_defaults_agree_with_canonical_defaults() -> None:
    """An argument left out must mean the same whichever spelling left it out."""
    for opdef in OPS.values():
        for form in opdef.forms:
            for tname, default in getattr(form, "defaults", {}).items():
                param = opdef.param(form.rename.get(tname, tname))
                if tname in form.guards or tname in form.ignore or param is None or param.default is REQUIRED:
                    continue
                conv = form.convert.get(param.name)
                default = conv[0](default) if conv else default
                if isinstance(default, list) and default:
                    default = default[0] if all(same_value(d, default[0]) for d in default) else default
                same = same_value(default, param.default) or (default == "valid" and param.default == 0)
                assert same, (opdef.name, form.qualname, tname, default, param.default)


# ---- sum, stack, select, prelu at every capture that keeps them -----------------


class Reductions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act = nn.PReLU(3)

    def forward(self, x: torch.Tensor) -> tuple:      # x: (2, 3, 4)
        s = x.sum(dim=(0, 2), keepdim=True) + torch.sum(x)
        t = torch.stack([x, x], dim=1)
        u = x.select(1, 2)
        return s, t, u, self.act(x)


@pytest.mark.parametrize("level", ("symbolic", "dynamo", "export"))
def test_sum_stack_select_prelu_bind(level: str) -> None:
    gm = capture(Reductions(), (torch.randn(2, 3, 4),), (level,))[level]
    sums = sorted((b.args["dim"] is None, b.args["keepdim"]) for _, b in bindings(gm, "sum"))
    assert sums == [(False, True), (True, False)]
    (_, reduced), = [(n, b) for n, b in bindings(gm, "sum") if b.args["dim"] is not None]
    assert tuple(reduced.args["dim"]) == (0, 2)
    stack = only(gm, "stack")
    assert len(stack["tensors"]) == 2 and stack["dim"] == 1
    select = only(gm, "select")
    assert (select["dim"], select["index"]) == (1, 2)
    prelu = only(gm, "prelu")
    assert const_name(prelu["weight"]).replace("l_self_modules_", "").startswith(("act", "p_act"))


def test_rules_over_the_new_ops_fire_and_keep_outputs() -> None:
    import rewrite

    rules = rewrite.parse("""
    rule select_of_stack: select(stack([a, _], d), d, 0) => a
    rule sum_keepdim_squeeze: squeeze(sum(x, [dd], True), dd) => sum(x, [dd])
    """)

    class M(nn.Module):
        def forward(self, x, y):
            return torch.stack([x, y], 1).select(1, 0) + torch.sum(x, [1], True).squeeze(1)[:, None]

    x, y = torch.randn(2, 3), torch.randn(2, 3)
    for gm in (fx.symbolic_trace(M()), torch.export.export(M(), (x, y)).module()):
        result = rules.apply(gm, example_inputs=(x, y))
        assert result.counts == {"select_of_stack": 1, "sum_keepdim_squeeze": 1}
        assert not bindings(result.graph_module, "stack")
        torch.testing.assert_close(result.graph_module(x, y), M()(x, y))


def test_prelu_kernel_is_not_prelu() -> None:
    """aten._prelu_kernel broadcasts its weight elementwise (make_fx writes
    _prelu_kernel(x, w.view(1, C, 1, 1))); prelu takes a per-channel 1-d weight."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.rand(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.aten._prelu_kernel.default(x, self.w.view(1, 4, 1, 1))

    gm = fx.symbolic_trace(M())
    assert not bindings(gm, "prelu")


# ---- issue 13's vocabulary at every capture level ---------------------------------


class Vocabulary13(nn.Module):
    """Each new op spelled as user code writes it (function, method, module)."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.LeakyReLU(0.1)
        self.gate = nn.GLU(-1)

    def forward(self, x: torch.Tensor) -> tuple:
        y = F.leaky_relu(x, 0.2) + self.act(x) + x.sin() + torch.cos(x)
        y = y.masked_fill(x > 0, -1.0) + torch.einsum("bij,bkj->bik", x, x).sum()
        g = self.gate(x) + F.glu(x, -1)
        a, b = torch.split(x, 2, -1)
        c, d = x.chunk(2, -1)
        e, f = x.split([1, 3], -1)
        m = x.amax(-1) + torch.max(x, -1)[0] + x.topk(2)[0].sum(-1) + torch.linalg.vector_norm(x, 2, -1)
        s = x[:, 1:3]
        z = (g + a * c + b.reshape_as(d)).sum() + e.expand_as(f).type_as(f).sum()
        return y.sum() + z + m.sum() + s.sum() + F.pad(x, (1, 1)).sum()


_NEW_OPS = {"leaky_relu": 2, "sin": 1, "cos": 1, "masked_fill": 1, "einsum": 1, "glu": 2, "split": 2,
            "chunk": 1, "amax": 1, "max": 1, "topk": 1, "linalg_vector_norm": 1, "reshape_as": 1,
            "expand_as": 1, "type_as": 1, "pad": 1}


@pytest.mark.parametrize("level", ["symbolic", "dynamo", "export"])
def test_issue13_ops_bind_at_every_level(level: str) -> None:
    gm = capture(Vocabulary13(), (torch.randn(2, 3, 4),), (level,))[level]
    found = {op: len(bindings(gm, op)) for op in _NEW_OPS}
    assert found == _NEW_OPS, found
    assert len(bindings(gm, "slice")) == (level == "export")  # x[:, 1:3] is getitem before export
    split_sizes = sorted(str(b.args["split_size"]) for _, b in bindings(gm, "split"))
    assert split_sizes == ["2", "[1, 3]"]


def test_issue13_ops_in_core_aten() -> None:
    """What run_decompositions keeps: split_with_sizes (split and chunk), slice,
    constant_pad_nd (pad), amax, max.dim, topk, the activations."""
    gm = capture(Vocabulary13(), (torch.randn(2, 3, 4),), ("core",))["core"]
    found = {op: len(bindings(gm, op)) for op in ("split", "slice", "pad", "amax", "max", "topk", "leaky_relu",
                                                  "sin", "cos", "linalg_vector_norm")}
    assert all(found.values()), found
    assert all(b.args["mode"] == "constant" for _, b in bindings(gm, "pad"))


def test_torch_constant_pad_nd_is_pad() -> None:
    """``torch.constant_pad_nd`` called by a model (symbolic_trace keeps the torch
    function) is pad(mode="constant"), its value defaulting as F.pad's does."""
    class Pads(nn.Module):
        def forward(self, x):
            return torch.constant_pad_nd(x, (1, 1)) + torch.constant_pad_nd(x, (0, 2), 0.5)

    gm = fx.symbolic_trace(Pads())
    found = [b[0] for n in gm.graph.nodes for b in [bind_node(n, gm)] if b and b[0].op == "pad"]
    assert len(found) == 2
    assert [b.args["mode"] for b in found] == ["constant", "constant"]
    assert found[0].args["value"] is None and found[1].args["value"] == 0.5


def test_issue13_rules_fire_and_verify() -> None:
    import rewrite
    from rewrite.trust.verify import verify_rules

    rules = rewrite.parse('''
rule lrelu_one: leaky_relu(x, 1.0) => clone(x)
rule max_values: getitem(max(x, d, k), 0) => amax(x, d, k)
rule cast_reshape_as: reshape_as(to(x, t), y) => to(reshape_as(x, y), t)
rule einsum_mm(tolerance="approx"): einsum("ij,jk->ik", [a, b]) where is_float(a) => mm(a, b)
rule pad_zero: pad(x, [0, 0], "constant", _) => clone(x)
''')
    report = verify_rules(rules, max_examples=15, seed=0)
    assert {v.status for v in report.verdicts} == {"ok"}, report.table()
    # leaky_relu(-inf, 0) is nan (-inf * 0), relu(-inf) is 0: verification finds it
    wrong = rewrite.parse("rule bad: leaky_relu(x, 0.0) => relu(x)")
    assert [v.status for v in verify_rules(wrong, max_examples=30, seed=0).verdicts] == ["counterexample"]

    class Net13(nn.Module):
        def forward(self, x):
            return torch.max(x, 1)[0] + F.leaky_relu(x, 1.0).sum(1) + torch.einsum("ij,jk->ik", x, x.T).sum(1)

    x = torch.randn(3, 3)
    for level in ("symbolic", "export"):
        gm = capture(Net13(), (x,), (level,))[level]
        result = rules.apply(gm, example_inputs=(x,))
        assert result.counts == {"lrelu_one": 1, "max_values": 1, "einsum_mm": 1}, (level, result.counts)
        out = result.graph_module(x)
        torch.testing.assert_close(out[0] if isinstance(out, (tuple, list)) else out, Net13()(x))


# -- the planned binding path (forms.py ``binding_plan``) against the general one

def test_planned_binding_is_the_general_binding():
    """Every form of the vocabulary binds every positional call (0 to one more
    argument than its signature; sentinel and literal values) the same way through
    its plan as through the general path: same canonical args in the same order,
    or None from both. Most forms have a plan; those that do not are compared too
    (trivially)."""
    from rewrite.ops.forms import binding_plan, normalize_general

    planned = 0
    for opdef in OPS.values():
        for form in opdef.forms:
            if not hasattr(form, "varargs"):
                continue  # not an extended form: no plan
            planned += binding_plan(form, opdef) is not None
            sentinels = [object() for _ in range(len(form.signature) + 1)]
            for values in (sentinels, [1] * len(sentinels), [None] * len(sentinels), [(2, 3)] * len(sentinels)):
                for n in range(len(form.signature) + 2):
                    args = tuple(values[:n])
                    general = normalize_general(form, args, {}, opdef)
                    fast = form._normalize(args, {}, opdef)  # the plan where the form has one
                    assert (None if general is None else list(general.items())) == \
                           (None if fast is None else list(fast.items())), (opdef.name, form, n)
    assert planned > 300


_LITERALS = st.one_of(
    st.integers(-3, 3), st.floats(-2, 2), st.just(float("nan")), st.booleans(), st.none(), st.sampled_from(["a", "b"]),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
    st.sampled_from([torch.contiguous_format, torch.channels_last, torch.preserve_format]),
    st.sampled_from([torch.strided, torch.sparse_coo]), st.sampled_from([torch.device("cpu"), torch.device("meta")]),
)


def _same_literal(a, b) -> bool:
    """same_value's contract for two scalars, spelled out: a bool is never a number,
    ints and floats compare by value, anything else only within its own type."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


@settings(max_examples=300, deadline=None)
@given(_LITERALS, _LITERALS)
def test_same_value_on_scalars_keeps_its_contract(a, b):
    """The scalar fast path of same_value (no isinstance) says what the long way
    says: True == 1 is not a match, 1 == 1.0 is, None is not a memory format."""
    assert same_value(a, b) == _same_literal(a, b)
    assert same_value([a, b], (a, b)) == (_same_literal(a, a) and _same_literal(b, b))
