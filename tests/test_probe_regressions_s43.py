"""Regressions found in session 43: saving to file objects, and whatever the
session's probes (user-written rules, results leaving the library) turned up."""

import io

import pytest
import torch

import rewrite
import rewrite.capture


def _conv_bn():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).eval(), torch.randn(1, 3, 8, 8)


def test_capture_save_writes_a_pickled_result_into_a_bytes_buffer():
    """``rewrite.capture.save`` takes a binary file object, as ``torch.save`` and the
    quantization savers do; the buffer holds the rewritten module."""
    model, x = _conv_bn()
    result = rewrite.load("rules/fusion.rw").apply(torch.fx.symbolic_trace(model), example_inputs=(x,))
    assert result.counts.get("conv_bn") == 1
    buffer = io.BytesIO()
    assert rewrite.capture.save(result.graph_module, buffer) is buffer
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in loaded.modules())
    torch.testing.assert_close(loaded(x), model(x), atol=1e-5, rtol=1e-5)


def test_capture_save_writes_an_exported_result_into_a_bytes_buffer():
    model, x = _conv_bn()
    gm = torch.export.export(model, (x,), strict=False).module()
    result = rewrite.load("rules/fusion.rw").apply(gm, example_inputs=(x,))
    buffer = io.BytesIO()
    rewrite.capture.save(result.graph_module, buffer, level="export", example_inputs=(x,))
    buffer.seek(0)
    program = torch.export.load(buffer)
    assert "batch_norm" not in str(program.graph)
    torch.testing.assert_close(program.module()(x), model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("target", [io.StringIO(), 123, None])
def test_capture_save_refuses_what_is_neither_a_path_nor_a_binary_file(target):
    model, x = _conv_bn()
    gm = torch.fx.symbolic_trace(model)
    with pytest.raises(ValueError, match="binary file object"):
        rewrite.capture.save(gm, target)


def test_capture_save_refuses_a_dynamo_level_for_a_buffer_too():
    model, _ = _conv_bn()
    buffer = io.BytesIO()
    with pytest.raises(ValueError, match="dynamo"):
        rewrite.capture.save(torch.fx.symbolic_trace(model), buffer, level="dynamo")
    assert buffer.getvalue() == b""


class _Block(torch.nn.Module):
    def __init__(self, fc):
        super().__init__()
        self.fc = fc

    def forward(self, x):
        return self.fc(x).relu()


class _SharedLinear(torch.nn.Module):
    """One Linear reached as blocks.0.fc, blocks.1.fc and fc, called once under each."""

    def __init__(self):
        super().__init__()
        fc = torch.nn.Linear(4, 4)
        self.blocks = torch.nn.ModuleList([_Block(fc), _Block(fc)])
        self.fc = fc

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.fc(x)


@pytest.mark.parametrize("level", ["fx", "export"])
def test_a_shared_module_is_credited_where_it_is_called(level):
    """fx names a shared module by its first name at every call; the capture names
    it under the module that called it where the first name is not under that module
    (the call inside blocks.1), as torch.export does."""
    from rewrite.analysis import analyze

    model, x = _SharedLinear(), torch.randn(2, 4)
    gm = rewrite.capture.capture(model, (x,), level) if level == "export" else rewrite.capture.symbolic_trace(model)
    analysis = analyze(gm, (x,))
    linears = [n.module for n in analysis.nodes if n.flops]
    # the model's own self.fc(x): fx sees the module object only, and it is also
    # blocks.0.fc (its first name): which name the forward used is unknown there
    assert linears == ["blocks.0.fc", "blocks.1.fc", "fc" if level == "export" else "blocks.0.fc"]
    flops = {g.key: g.flops for g in analysis.by_module(depth=2)}
    assert flops["blocks.1"] == flops["blocks.0"] // (1 if level == "export" else 2) > 0
    torch.testing.assert_close(gm(x), model(x))


def test_naming_call_sites_leaves_targets_and_unshared_modules_alone():
    model = _SharedLinear()
    gm = rewrite.capture.symbolic_trace(model)
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["blocks.0.fc"] * 3
    relus = [n for n in gm.graph.nodes if n.target == "relu"]
    assert [list(n.meta["nn_module_stack"].values())[-1][0] for n in relus] == ["blocks.0", "blocks.1"]


def _ruleset_chain(n, top_down):
    order = range(n - 1, 0, -1) if top_down else range(1, n)
    chain = "".join(f"ruleset s{i} = seq(s{i - 1})\n" for i in order)
    first = "ruleset s0 = fixpoint(r)\n"
    return "rule r: neg(neg(x)) => x\n" + (chain + first if top_down else first + chain)


def _neg_neg():
    class M(torch.nn.Module):
        def forward(self, x):
            return -(-x) + 1

    return torch.fx.symbolic_trace(M()), torch.randn(3)


@pytest.mark.parametrize("top_down", [True, False])
def test_a_chain_of_rule_sets_too_deep_to_run_is_an_E001_at_load(top_down):
    """A chain of rule sets each naming the one before loaded (declared bottom up)
    and then exhausted the recursion limit in apply; declared top down it was an E001
    or not depending on the recursion limit. Now a chain nesting schedules more than
    MAX_NESTING levels is an E001 at the first rule set past the limit, and one at the
    limit applies, even called from deep in the caller's stack."""
    from rewrite.language.limits import MAX_NESTING

    with pytest.raises(rewrite.RuleError, match=rf"chain\.rw:\d+:9: error: rule set 's{MAX_NESTING}' nests schedules "
                                                r"too deeply \(more than 100 levels.*\[E001\]") as err:
        rewrite.parse(_ruleset_chain(1000, top_down), "chain.rw")
    assert str(err.value).count("error:") == 1
    rules = rewrite.parse(_ruleset_chain(MAX_NESTING, top_down), "chain.rw")
    gm, x = _neg_neg()

    def from_depth(d):
        return from_depth(d - 1) if d else rules[f"s{MAX_NESTING - 1}"].apply(gm, example_inputs=(x,))

    result = from_depth(300)
    assert result.counts == {"r": 1}
    torch.testing.assert_close(result.graph_module(x), x + 1)


class _ConvPoolConv(torch.nn.Module):
    def __init__(self, pool):
        super().__init__()
        self.c1, self.pool, self.c2 = torch.nn.Conv2d(3, 8, 3, padding=1), pool, torch.nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return self.c2(self.pool(torch.relu(self.c1(x))))


@pytest.mark.parametrize("pool, rule, exact", [
    (torch.nn.MaxPool2d(2), "requantize_max_pool2d", True),
    (torch.nn.AvgPool2d(2), "requantize_avg_pool2d", False),
    (torch.nn.AdaptiveAvgPool2d(4), "requantize_adaptive_avg_pool2d", False),
])
def test_the_qdq_form_parts_from_the_reference_only_behind_an_average_pool(pool, rule, exact):
    """probe AZ F1: the README said the QDQ form matches the reference above 60 dB;
    behind an average pool between quantized convs it rounds the pool's output to the
    grid (as the int8 kernels do) and the reference does not. The README now says so;
    ``convert`` records the figure and holds it to ``min_qdq_sqnr``."""
    import rewrite.quant as rq

    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 16)
    observed = rq.prepare(_ConvPoolConv(pool).eval(), (x,))
    rq.calibrate(observed, [[torch.randn(4, 3, 16, 16)] for _ in range(3)])
    qdq = rq.convert(observed, form="qdq")
    _, reference = rq.convert(observed, reference=True)
    info = qdq.meta["rewrite.quant"]
    assert info["convert_counts"][rule] == 1
    with torch.no_grad():
        measured = rq.sqnr(reference(x), qdq(x))
    assert measured == pytest.approx(info["reference_sqnr"])
    if exact:
        assert measured > 60
    else:
        assert 25 < measured < 60


_SWAP = """
rule swap: add(x, y) => add(y, x)
rule neg_neg: neg(neg(x)) => x
ruleset swap_once = once(swap)
"""


def _add_of_neg_neg():
    class M(torch.nn.Module):
        def forward(self, a, b):
            return -(-a) + b

    a, b = torch.randn(3), torch.randn(3)
    return torch.export.export(M(), (a, b), strict=False).module(), (a, b)


def test_a_rule_run_once_by_its_rule_set_runs_once_in_the_default_schedule():
    """probe AY F1: following E409's help (``ruleset swap_once = once(swap)``) gave a
    file whose default schedule still ran ``swap`` to a fixpoint: apply raised
    NonTerminationError and verify called the right rule a counterexample."""
    rules = rewrite.parse(_SWAP, "swap.rw")
    assert repr(rules.schedule) == "seq(fixpoint(neg_neg), once(swap))"
    gm, (a, b) = _add_of_neg_neg()
    result = rules.apply(gm, example_inputs=(a, b))
    assert result.counts == {"neg_neg": 1, "swap": 1}
    torch.testing.assert_close(result.graph_module(a, b), a + b)
    assert rules["swap"].apply(gm, example_inputs=(a, b)).counts == {"swap": 1}
    report = rules.verify(max_examples=10)
    assert report.ok and report["swap"].status == report["neg_neg"].status == "ok"


def test_a_main_rule_set_stays_the_default_and_other_rules_keep_their_fixpoint():
    rules = rewrite.parse(_SWAP + "ruleset main = fixpoint(neg_neg)\n", "swap.rw")
    assert repr(rules.schedule) == "fixpoint(neg_neg)"
    assert repr(rules["neg_neg"].schedule) == "fixpoint(neg_neg)"
    assert repr(rules["swap"].schedule) == "once(swap)"  # main never runs it: as swap_once does
    plain = rewrite.parse("rule neg_neg: neg(neg(x)) => x\nruleset s = seq(once(neg_neg), fixpoint(neg_neg))\n")
    assert repr(plain.schedule) == "fixpoint(neg_neg)"  # also run to a fixpoint: not once-only


def test_a_registered_predicate_sees_matches_only():
    """probe AY F2: the prefilter evaluated root where-conjuncts before the matcher
    compared an argument the node omits (``clamp(a, min=0)`` has no max) with the
    pattern's literal, so the user's predicate ran on a node the rule never matched."""
    seen = []

    @rewrite.register_predicate()
    def s43_audited(root):
        seen.append(root.node.name)
        return True

    class M(torch.nn.Module):
        def forward(self, a):
            return torch.clamp(a, min=0) * 2 + torch.clamp(a, 0, 1)

    a = torch.randn(2, 3)
    gm = torch.export.export(M(), (a,), strict=False).module()
    rules = rewrite.parse("rule c: clamp(x, 0, 1) as root where s43_audited(root) => hardtanh(x, 0.0, 1.0)")
    result = rules.apply(gm, example_inputs=(a,))
    assert result.counts == {"c": 1}
    clamps = [n.name for n in gm.graph.nodes if "clamp" in str(n.target)]
    assert seen and set(seen) == {clamps[1]}  # the clamp(a, 0, 1), never clamp(a, min=0)
    torch.testing.assert_close(result.graph_module(a), M()(a))


@pytest.mark.parametrize("constant, kind", [("contiguous_format", "memory format"), ("strided", "layout"),
                                            ("per_tensor_affine", "quantization scheme")])
def test_a_torch_constant_that_is_not_a_dtype_is_named_for_what_it_is(constant, kind):
    """probe AY F3: ``torch.contiguous_format`` was an "unknown dtype" with a hint
    about dtype spellings."""
    with pytest.raises(rewrite.RuleError) as err:
        rewrite.parse(f"rule r: clone(x, memory_format=torch.{constant}) => x\n", "f.rw")
    text = str(err.value)
    assert f"f.rw:1:32: error: 'torch.{constant}' is a {kind}, which rules cannot write" in text
    assert "[E010]" in text and "unknown dtype" not in text


class _SliceAssign(torch.nn.Module):
    def forward(self, x, y):
        x = x.clone()
        x[:, 0] = y
        x[1:3] = 0.5
        return x * 2


def test_a_slice_assignment_counts_the_bytes_it_reads_and_writes_at_every_level():
    """probe AX (low): dynamo's ``operator.setitem`` returns nothing, so ``t[i] = v``
    was charged all of ``t`` read and nothing written; export's ``copy_`` into the
    slice counted the slice. Both count the assigned part now, and totals agree."""
    from rewrite.analysis import analyze

    x, y = torch.randn(64, 32), torch.randn(64)
    dynamo = analyze(rewrite.capture.capture(_SliceAssign(), (x, y), "dynamo"), (x, y))
    export = analyze(torch.export.export(_SliceAssign(), (x, y)).module(), (x, y))
    first, second = [n for n in dynamo.nodes if n.op == "setitem"]
    assert (first.bytes_read, first.bytes_written, first.alias) == (64 * 4 * 2, 64 * 4, "inplace")
    assert (second.bytes_read, second.bytes_written) == (2 * 32 * 4, 2 * 32 * 4)  # a scalar: nothing else read
    # export writes the 0.5 into a 0-d constant first (4 bytes, a node of its own)
    assert dynamo.totals.bytes_written == export.totals.bytes_written - 4
    assert dynamo.totals.bytes_read == export.totals.bytes_read - 8


class _ThisForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.d = torch.nn.ModuleDict({"it's": torch.nn.Linear(4, 4), 'q"x': torch.nn.Linear(4, 4)})
        self.l = torch.nn.ModuleList([torch.nn.Linear(4, 4)])

    def forward(this, x):  # noqa: N805 - what the probe wrote: a forward not calling itself self
        return this.l[0](this.d["it's"](x) + this.d['q"x'](x))


def test_dynamo_module_paths_with_quoted_keys_and_a_forward_not_calling_itself_self():
    """probe AX (low): dynamo names the root after the forward's first parameter
    (``L['this']``) and writes a key holding a quote in the other quotes; both were
    left in the path (``L.this.d._modules["it's"]``)."""
    from rewrite.analysis import analyze

    x = torch.randn(2, 4)
    gm, inputs = rewrite.capture.capture_with_inputs(_ThisForward(), (x,), "dynamo")
    analysis = analyze(gm, inputs)
    assert [n.module for n in analysis.nodes if n.flops] == ["d.it's", 'd.q"x', "l.0"]
    assert {g.key for g in analysis.by_module(depth=1)} == {"d", "l", "(top)"}


class _TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])

    def forward(self, x):
        return self.layers[1](self.layers[0](x).relu())


@pytest.mark.parametrize("level", ["fx", "export", "dynamo"])
def test_module_name_matches_reads_dynamo_paths_too(level):
    """Session 43: under dynamo the predicate read ``L['self'].layers.1``, so a rule
    keeping layers.1 out (``not module_name_matches(y, "layers.1")``) fired on it too."""
    rules = rewrite.parse('rule unfuse: linear(x, w, b) as y where not module_name_matches(y, "layers.1")\n'
                          '    => add(matmul(x, t(w)), b)\n')
    x = torch.randn(2, 4)
    model = _TwoLayers()
    gm, inputs = rewrite.capture.capture_with_inputs(model, (x,), level)
    result = rules.apply(gm, example_inputs=inputs)
    assert result.counts == {"unfuse": 1}
    out = result.graph_module(*inputs)
    torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, model(x))  # (dynamo returns a tuple)


def test_analyze_inside_a_users_own_compile_backend_counts_parameters_as_parameters():
    """probe AX (low): a graph measured inside the caller's own torch.compile backend
    counted its lifted parameters as inputs (only rewrite's capture kept their source)."""
    from rewrite.analysis import analyze

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    x = torch.randn(2, 64)
    seen = []

    def backend(gm, inputs):
        seen.append(analyze(gm, inputs))
        return gm.forward

    torch._dynamo.reset()
    try:
        torch.compile(model, backend=backend)(x)
    finally:
        torch._dynamo.reset()
    (analysis,) = seen
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert analysis.totals.param_bytes == params
    assert analysis.input_bytes == x.numel() * x.element_size()


def test_an_expanded_operand_is_charged_the_bytes_it_holds():
    """probe AX (low): ``x + y.expand_as(x)`` charged the add 64x the bytes of ``y``,
    while ``x + y`` (the same broadcast) charged ``y``'s own."""
    from rewrite.analysis import analyze

    class Implicit(torch.nn.Module):
        def forward(self, x, y):
            return x + y

    class Explicit(torch.nn.Module):
        def forward(self, x, y):
            return x + y.expand_as(x)

    x, y = torch.randn(64, 32), torch.randn(32)
    implicit, explicit = (analyze(torch.export.export(m(), (x, y)).module(), (x, y)) for m in (Implicit, Explicit))
    assert implicit["add"].bytes_read == explicit["add"].bytes_read == (64 * 32 + 32) * 4
    assert implicit.totals.bytes_read == explicit.totals.bytes_read


def test_a_rule_run_once_that_settles_keeps_its_place_in_the_default_fixpoint():
    """probe BA F1: the default schedule moved every once-only rule after the
    fixpoint, so ``fold`` no longer saw ``lower``'s output. Only a rule that never
    settles by itself (E409, accepted for its once) runs apart now."""
    text = ("rule lower: sub(x, y) => add(x, neg(y))\nrule fold: neg(neg(x)) => x\n"
            "ruleset pipeline = seq(once(lower), fixpoint(fold))\n")
    rules = rewrite.parse(text)
    assert repr(rules.schedule) == "fixpoint(lower, fold)"

    class M(torch.nn.Module):
        def forward(self, a, b):
            return a - (-b)

    a, b = torch.randn(3), torch.randn(3)
    result = rules.apply(torch.fx.symbolic_trace(M()), example_inputs=(a, b))
    assert result.counts == {"lower": 1, "fold": 1}
    torch.testing.assert_close(result.graph_module(a, b), a + b)


def test_a_long_cycle_of_rule_sets_is_one_E404_and_no_E001():
    """probe BA F6: a cycle of 150 rule sets also got "nests schedules too deeply"."""
    text = "rule r: neg(neg(x)) => x\n" + "".join(f"ruleset s{i} = seq(s{(i + 1) % 150}, r)\n" for i in range(150))
    with pytest.raises(rewrite.RuleError) as err:
        rewrite.parse(text, "t.rw")
    assert "[E404]" in str(err.value) and "[E001]" not in str(err.value)
    assert str(err.value).count("error:") == 1


class _DirectGrandchild(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _Block(torch.nn.Linear(4, 4))
        self.fc = self.block.fc

    def forward(self, x):
        return self.block.fc(x)


def test_a_call_fx_cannot_place_keeps_fxs_name():
    """probe BA F2: the model calling ``self.block.fc`` (also held as ``self.fc``)
    was credited to ``fc``; fx cannot tell which name the forward used, and its first
    name stays. Many levels of doubly held children stay linear (BA F4)."""
    from rewrite.analysis import analyze

    x = torch.randn(2, 4)
    gm = rewrite.capture.symbolic_trace(_DirectGrandchild())
    assert [n.module for n in analyze(gm, (x,)).nodes if n.flops] == ["block.fc"]

    class Twice(torch.nn.Module):
        def __init__(self, child):
            super().__init__()
            self.a, self.b = child, child

        def forward(self, x):
            return self.b(x)  # the same object as a: fx's first name (a) stays, at every level

    model = torch.nn.Linear(2, 2)
    for _ in range(24):  # 2^24 paths under named_modules(remove_duplicate=False)
        model = Twice(model)
    gm = rewrite.capture.symbolic_trace(model)
    (linear,) = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert linear.target == ".".join(["a"] * 24)
    assert list(linear.meta["nn_module_stack"].values())[-1][0] == ".".join(["a"] * 24)


class _ConvBN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.b = torch.nn.Conv2d(3, 4, 3, padding=1, bias=False), torch.nn.BatchNorm2d(4)

    def forward(self, x):
        return self.b(self.c(x))


@pytest.mark.parametrize("gamma, folds", [(1e-4, False), (0.5, True)])
def test_a_float16_fold_whose_weights_would_underflow_is_refused(gamma, folds):
    """probe BB F2: a float16 conv + BN with a tiny gamma folded into weights among
    float16's subnormals (40 of 108 exactly 0, the output 34% off); with check=False
    the wrong model was returned. The fold is refused now; a normal one still folds."""
    torch.manual_seed(0)
    model = _ConvBN().eval()
    with torch.no_grad():
        model.c.weight.uniform_(-1e-3, 1e-3)
        model.b.weight.fill_(gamma)
        model.b.bias.zero_()
    model = model.half()
    x = torch.randn(2, 3, 6, 6).half() * 1000
    gm = torch.export.export(model, (x,)).module()
    result = rewrite.load("rules/fusion.rw").apply(gm, example_inputs=(x,), check=False)
    assert bool(result.counts) == folds
    expected = model(x).double()
    error = (result.graph_module(x).double() - expected).abs().max()
    assert error <= 0.01 * expected.abs().max()


class _Float16Branch(torch.nn.Module):
    def __init__(self, side):
        super().__init__()
        self.a, self.c, self.side = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).half(), side

    def forward(self, x):
        return self.a(x).double(), (self.c(x.half()) if self.side else x * 2)


@pytest.mark.parametrize("level", ["fx", "export"])
@pytest.mark.parametrize("side", [False, True])
def test_amp_on_a_model_already_computing_float16_elsewhere_passes_its_check(level, side):
    """probe BB F1: the check judged an output AMP lowered to float16 at float64's
    tolerance as soon as the original computed float16 anywhere (a side branch the
    output never reads): the run as a whole computed nothing new. Per output now."""
    torch.manual_seed(0)
    model, x = _Float16Branch(side).eval(), torch.randn(3, 8)
    gm = torch.fx.symbolic_trace(model) if level == "fx" else torch.export.export(model, (x,)).module()
    result = rewrite.load("rules/amp_fp16.rw").apply(gm, example_inputs=(x,))
    assert any(name.startswith("linear_fp16") for name in result.counts)
    out = result.graph_module(x)
    assert out[0].dtype == torch.float64
    torch.testing.assert_close(out[0], model(x)[0], atol=1e-2, rtol=1e-2)


class _Chunky(io.RawIOBase):
    """A raw stream taking at most 4096 bytes per write, as raw streams may."""

    def __init__(self):
        self.data = bytearray()

    def writable(self):
        return True

    def write(self, b):
        taken = bytes(b[:4096])
        self.data += taken
        return len(taken)


def test_capture_save_into_odd_file_objects(tmp_path):
    """probe BA F7: a stream taking part of each write got a truncated file, gzip's
    files (an int mode) were refused, a read-only or closed file failed after the
    work with another error than the documented ValueError."""
    import gzip

    model, x = _conv_bn()
    gm = torch.fx.symbolic_trace(model)
    chunky = _Chunky()
    rewrite.capture.save(gm, chunky)
    buffer = io.BytesIO()
    rewrite.capture.save(gm, buffer)
    assert len(chunky.data) == len(buffer.getvalue()) > 4096
    with gzip.open(tmp_path / "m.pt.gz", "wb") as f:
        rewrite.capture.save(gm, f)
    with gzip.open(tmp_path / "m.pt.gz", "rb") as f:
        torch.testing.assert_close(torch.load(io.BytesIO(f.read()), weights_only=False)(x), model(x))
    (tmp_path / "r.pt").write_bytes(b"")
    with open(tmp_path / "r.pt", "rb") as f, pytest.raises(ValueError, match="not open for writing"):
        rewrite.capture.save(gm, f)
    closed = io.BytesIO()
    closed.close()
    with pytest.raises(ValueError, match="closed"):
        rewrite.capture.save(gm, closed)


@pytest.mark.parametrize("name", ["legacy_contiguous_format", "_mkldnn", "int4", "uint3", "bits8"])
def test_other_torch_constants_are_not_unknown_dtypes(name):
    """probe BA F8: these got "unknown dtype" (and int4 a "did you mean torch.int64")."""
    with pytest.raises(rewrite.RuleError) as err:
        rewrite.parse(f"rule r: relu(x) where dtype(x) == torch.{name} => x\n", "f.rw")
    assert "which rules cannot write" in str(err.value) and "did you mean" not in str(err.value)


def test_adding_rule_sets_keeps_each_sides_rule_sets_and_stays_flat():
    """probe BA F9: ``A + B`` where both declare ``cleanup`` ran B's in A's place
    (only b fired); 1201 sets added in a row nested seq(seq(...)) past the
    recursion limit in apply."""
    a = rewrite.parse("rule a: neg(neg(x)) => x\nruleset cleanup = fixpoint(a)\nruleset main = seq(cleanup)\n", "A.rw")
    b = rewrite.parse("rule b: relu(relu(x)) => relu(x)\nruleset cleanup = fixpoint(b)\nruleset main = seq(cleanup)\n",
                      "B.rw")

    class M(torch.nn.Module):
        def forward(self, x):
            return torch.relu(torch.relu(-(-x)))

    x = torch.randn(5)
    gm = torch.fx.symbolic_trace(M())
    both = a + b
    assert both.apply(gm, example_inputs=(x,)).counts == {"a": 1, "b": 1}
    assert (b + a).apply(gm, example_inputs=(x,)).counts == {"a": 1, "b": 1}
    many = a
    for _ in range(1200):
        many = many + a
    assert len(many.schedule.items) == 1201
    assert many.apply(gm, example_inputs=(x,)).counts == {"a": 1}


def test_a_check_on_empty_outputs_says_it_compared_nothing():
    """probe BB note: with a batch of 0 every trial compares nothing, and a wrong
    rule passes as well; the report says so."""
    model, _ = _conv_bn()
    wrong = rewrite.parse("rule r: relu(x) => neg(x)\n")

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            return torch.relu(self.inner(x))

    empty, some = torch.randn(0, 3, 8, 8), torch.randn(2, 3, 8, 8)
    result = wrong.apply(torch.fx.symbolic_trace(M()), example_inputs=(empty,))
    assert result.equivalence.ok and result.equivalence.empty
    assert "nothing was compared" in str(result.equivalence)
    with pytest.raises(rewrite.EquivalenceError):
        wrong.apply(torch.fx.symbolic_trace(M()), example_inputs=(some,))
    ok = rewrite.load("rules/fusion.rw").apply(torch.fx.symbolic_trace(model), example_inputs=(some,))
    assert not ok.equivalence.empty and "nothing was compared" not in str(ok.equivalence)


def test_adding_rule_sets_whose_names_clash_in_every_way_keeps_every_meaning():
    """probe BC F2: a set written alike on both sides but naming a clashing set, three
    sets with one name, and a rule set named like the other side's rule all lost a
    side's rules."""
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.relu(torch.relu(-(-torch.abs(torch.abs(x)))))

    x = torch.randn(5)

    def counts(rules):
        return rules.apply(torch.fx.symbolic_trace(M()), example_inputs=(x,)).counts

    a = rewrite.parse("rule a: neg(neg(x)) => x\nruleset inner = fixpoint(a)\nruleset outer = seq(inner)\n"
                      "ruleset main = seq(outer)\n", "A.rw")
    b = rewrite.parse("rule b: relu(relu(x)) => relu(x)\nruleset inner = fixpoint(b)\nruleset outer = seq(inner)\n"
                      "ruleset main = seq(outer)\n", "B.rw")
    assert counts(a + b) == {"a": 1, "b": 1}

    def one(rule, pattern):
        return rewrite.parse(f"rule {rule}: {pattern}\nruleset cleanup = fixpoint({rule})\nruleset main = seq(cleanup)\n")

    three = one("a", "neg(neg(x)) => x") + one("b", "relu(relu(x)) => relu(x)") + one("c", "abs(abs(x)) => abs(x)")
    assert counts(three) == {"a": 1, "b": 1, "c": 1}
    rule_named_cleanup = rewrite.parse("rule cleanup: relu(relu(x)) => relu(x)\n", "C.rw")
    assert counts(one("a", "neg(neg(x)) => x") + rule_named_cleanup) == {"a": 1, "cleanup": 1}
    assert counts(rule_named_cleanup + one("a", "neg(neg(x)) => x")) == {"a": 1, "cleanup": 1}


def test_a_module_path_starting_with_self_keeps_it():
    """probe BC F1: ``self_attn.q_proj`` lost its ``self`` (``_attn.q_proj``), so
    ``module_name_matches(y, "self_attn*")`` stopped matching."""
    from rewrite.capture import normalize_module_path

    assert normalize_module_path("self_attn.q_proj") == "self_attn.q_proj"
    assert normalize_module_path("L['self'].self_attn") == "self_attn"
    assert normalize_module_path("attention.self.query") == "attention.self.query"
    assert normalize_module_path("self.query") == "self.query"  # probe BD F5: a child named self
    assert normalize_module_path("L['self'].self.query") == "self.query"


def test_a_float16_transposed_conv_fold_whose_weights_would_underflow_is_refused():
    """probe BC F3: a transposed convolution keeps its output channels along dim 1."""

    class TB(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.b = torch.nn.ConvTranspose2d(3, 4, 3, padding=1, bias=False), torch.nn.BatchNorm2d(4)

        def forward(self, x):
            return self.b(self.c(x))

    torch.manual_seed(0)
    model = TB().eval()
    with torch.no_grad():
        model.c.weight.uniform_(-1e-3, 1e-3)
        model.b.weight.copy_(torch.tensor([1e-4, 1.0, 1.0, 1.0]))
    model = model.half()
    x = torch.randn(2, 3, 6, 6).half() * 1000
    gm = torch.export.export(model, (x,)).module()
    result = rewrite.load("rules/fusion.rw").apply(gm, example_inputs=(x,), check=False)
    assert not result.counts


def test_a_rule_that_never_settles_is_exempt_from_E409_only_if_nothing_repeats_it():
    """probe BC F6: a ``once(grow)`` anywhere exempted ``grow`` although ``main`` ran
    it to a fixpoint, which looped until apply's NonTerminationError."""
    grow = "rule grow: relu(x) => relu(relu(x))\n"
    with pytest.raises(rewrite.RuleError, match=r"f\.rw:1:23: error: rule 'grow' never settles.*\[E409\]"):
        rewrite.parse(grow + "ruleset s = once(grow)\nruleset main = fixpoint(grow)\n", "f.rw")
    with pytest.raises(rewrite.RuleError, match="E409"):
        rewrite.parse(grow + "ruleset s = fixpoint(seq(once(grow)))\n", "f.rw")
    assert rewrite.parse(grow + "ruleset s = once(grow)\nruleset main = seq(once(grow))\n", "f.rw")


def test_a_float16_fold_over_a_dead_input_channel_still_folds():
    """probe BD F1: measuring the rounding along dim 1 refused a conv + BN fold
    because one input channel's weights were tiny in the model itself; the error is
    measured in the weight's own terms now, and the fold is as precise as before."""
    torch.manual_seed(0)
    model = _ConvBN().eval()
    with torch.no_grad():
        model.c.weight.uniform_(-0.1, 0.1)
        model.c.weight[:, 0] = 1e-6
        model.b.weight.uniform_(0.5, 2.0)
    model = model.half()
    x = torch.randn(2, 3, 6, 6).half()
    gm = torch.export.export(model, (x,)).module()
    result = rewrite.load("rules/fusion.rw").apply(gm, example_inputs=(x,))
    assert result.counts == {"conv_bn": 1}
    exact = _ConvBN().eval()
    exact.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    exact = exact.double()
    reference = exact(x.double())
    assert (result.graph_module(x).double() - reference).abs().max() <= 2 * (model(x).double() - reference).abs().max()


class _Sigmoid(torch.nn.Module):
    def forward(self, x):
        y = torch.relu(x)
        y = torch.sigmoid(y)  # the culprit's line
        return y + 1


@pytest.mark.parametrize("level", ["model", "export", "dynamo"])
def test_the_culprit_names_the_models_source_line(level):
    """probe BE F2: dynamo's report printed its ^^^^ marker line, a plain module
    (captured by rewrite.capture.symbolic_trace) only "from call_function sigmoid"."""
    x = torch.randn(3, 4)
    model = {"model": lambda: _Sigmoid(), "export": lambda: torch.export.export(_Sigmoid(), (x,)).module(),
             "dynamo": lambda: rewrite.capture.capture(_Sigmoid(), (x,), "dynamo")}[level]()
    with pytest.raises(rewrite.EquivalenceError) as err:
        rewrite.parse("rule broken: sigmoid(x) => tanh(x)").apply(model, example_inputs=(x,))
    culprit = str(err.value.culprit)
    assert "test_probe_regressions_s43.py" in culprit and "y = torch.sigmoid(y)  # the culprit's line" in culprit
    assert "^" not in culprit.split(": NOT equivalent")[0]


@pytest.mark.parametrize("call", ["torch.add(x, 1, out=x)", "torch.sin(x, out=x)", "torch.cumsum(x, 0, out=x)"])
def test_an_out_argument_is_an_E105(call):
    """probe BE F4: the docs list out= under E105; it was an E202 saying torch.add
    has no parameter 'out' (it has)."""
    with pytest.raises(rewrite.RuleError) as err:
        rewrite.parse(f"rule r: neg(x) => {call}\n", "o.rw")
    assert "[E105]" in str(err.value) and "has no parameter" not in str(err.value)
