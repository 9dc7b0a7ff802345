"""rewrite.analysis.show and rewrite show: every node drawn, the rewrite highlighted."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.fx as fx

import rewrite
from rewrite.analysis import analyze
from rewrite.capture import capture_with_inputs
from rewrite.cli import main
from rewrite.examples.cnn import demo_cnn_with_inputs, resnet_tiny_with_inputs

pytest.importorskip("graphviz")
show = pytest.importorskip("rewrite.analysis.show")
try:
    show.layout_program()
except show.ShowError as err:  # the show extra is not installed
    pytest.skip(str(err), allow_module_level=True)

_MODEL = "rewrite.examples.cnn:demo_cnn_with_inputs"
_FOLDS = {"conv_bn", "conv_transpose_bn", "linear_bn"}


def _fused(level: str = "fx"):
    model, inputs = demo_cnn_with_inputs()
    gm, args = capture_with_inputs(model, inputs, level)
    result = rewrite.load("rules/fusion.rw").apply(gm, example_inputs=args)
    assert result.counts["conv_bn"] == 4 and result.counts["conv_transpose_bn"] == 1
    return gm, result, args


def _svg_node_ids(svg: str) -> set:
    return set(re.findall(r'<g id="node:([^"]+)" class="node"', svg))


def test_svg_has_every_node_and_tooltips(tmp_path):
    model, inputs = resnet_tiny_with_inputs()
    gm = fx.symbolic_trace(model)
    path = show.render(gm, tmp_path / "g.svg", inputs)
    svg = path.read_text()
    assert svg.lstrip().startswith("<?xml") and "</svg>" in svg
    assert _svg_node_ids(svg) == {n.name for n in gm.graph.nodes}
    assert 'id="module:/layer1.0"' in svg  # nodes are boxed by module
    a = analyze(gm, inputs)
    conv = a["conv1"]
    assert f"FLOPs {conv.flops:,}" in svg  # the tooltip carries the node's figures


@pytest.mark.parametrize("level", ["fx", "export"])
def test_svg_diff_highlights_the_rewrite(tmp_path, level):
    gm, result, args = _fused(level)
    svg = show.render(result.graph_module, tmp_path / "d.svg", args, before=gm).read_text()
    ids = _svg_node_ids(svg)
    assert ids == {f"before/{n.name}" for n in gm.graph.nodes} | {f"after/{n.name}" for n in result.graph_module.graph.nodes}
    created = {n.name: n.meta["rewrite_rule"][0] for n in result.graph_module.graph.nodes
               if n.meta.get("rewrite_rule")}
    removed = {n.name for n in gm.graph.nodes} - {n.name for n in result.graph_module.graph.nodes}
    assert created and removed
    assert _FOLDS <= set(created.values()) <= set(result.counts)  # removals (dropout) create nothing
    for name, rule in created.items():  # green, labelled by the rule, hover gives its position in fusion.rw
        block = _node_block(svg, f"after/{name}")
        assert show._NEW in block and f"[{rule}]" in block and re.search(r"fusion\.rw:\d+:\d+", block)
    for name in removed:
        assert show._REMOVED in _node_block(svg, f"before/{name}")
    kept = next(n.name for n in result.graph_module.graph.nodes if n.op == "placeholder")
    assert show._NEW not in _node_block(svg, f"after/{kept}")


def _node_block(svg: str, node_id: str) -> str:
    start = svg.index(f'<g id="node:{node_id}" class="node"')
    return svg[start:svg.index("</g>", start)]


def test_html_is_self_contained_and_has_every_node(tmp_path):
    gm, result, args = _fused()
    page = show.render(result.graph_module, tmp_path / "d.html", args, before=gm).read_text()
    assert page.startswith("<!DOCTYPE html>")
    data = json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.S)
                      .group(1).replace("<\\/", "</"))
    names = {(d["side"], d["name"]) for d in data["nodes"]}
    assert names == {("before", n.name) for n in gm.graph.nodes} | {("after", n.name)
                                                                    for n in result.graph_module.graph.nodes}
    new = [d for d in data["nodes"] if d["status"] == "new"]
    assert _FOLDS <= {d["rule"] for d in new} <= set(result.counts)
    assert _svg_node_ids(page) == {d["id"] for d in data["nodes"]}
    # nothing from the network: no external scripts, styles, fonts or images
    assert not re.search(r'(src|href)\s*=\s*["\']https?:', page) and "@import" not in page and "<link" not in page
    for feature in ("wheel", "search", "collapsed", "viewBox"):
        assert feature in page


def test_render_refuses_bad_paths(tmp_path):
    gm = fx.symbolic_trace(demo_cnn_with_inputs()[0])
    with pytest.raises(ValueError, match=r"\*\.svg or \*\.html"):
        show.render(gm, tmp_path / "g.png")
    with pytest.raises(ValueError, match="does not exist"):
        show.render(gm, tmp_path / "missing" / "g.svg")


def test_cli_show(tmp_path, capsys):
    out = tmp_path / "g.html"
    assert main(["show", "--model", _MODEL, "--rules", "rules/fusion.rw", "-o", str(out)]) == 0
    assert "conv_bn" in capsys.readouterr().out and out.exists()
    assert "[conv_bn]" in out.read_text()
    svg = tmp_path / "g.svg"
    assert main(["show", "--model", _MODEL, "--capture", "export", "-o", str(svg)]) == 0
    assert "</svg>" in svg.read_text()


def test_cli_show_bad_usage(tmp_path, capsys):
    assert main(["show", "--model", _MODEL, "-o", str(tmp_path / "g.pdf")]) == 2
    assert "*.svg or *.html" in capsys.readouterr().err
    assert main(["show", "--model", "nowhere:f", "-o", str(tmp_path / "g.svg")]) == 2
    assert main(["show", "--model", _MODEL, "--rules", "no_such.rw", "-o", str(tmp_path / "g.svg")]) != 0


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.lin(x))


class _NamedBlocks(torch.nn.Module):
    """Blocks named by a (downloaded) config: any name without a dot is legal."""

    def __init__(self, names):
        super().__init__()
        self.names = names
        for name in names:
            self.add_module(name, _Block())

    def forward(self, x):
        for name in self.names:
            x = getattr(self, name)(x)
        return x


_HOSTILE = ["<<TABLE HREF='javascript:alert(1)'><TR><TD>b</TD></TR></TABLE>>", "blk\x1b[2J\x1b]0;t\x07",
            "<!--<script>"]


def test_model_names_are_text_in_every_output(tmp_path):
    """Probe AD F1, F4, F7: a module name reached Graphviz as an HTML-like label (a
    clickable javascript: link in the SVG and the page), its control characters the
    terminal and the SVG (no longer XML), and ``<!--<script>`` in the page's data
    block made the viewer script part of it."""
    import xml.dom.minidom

    gm = fx.symbolic_trace(_NamedBlocks(_HOSTILE).eval())
    x = torch.randn(2, 4)
    svg = show.render(gm, tmp_path / "g.svg", (x,)).read_text()
    page = show.render(gm, tmp_path / "g.html", (x,)).read_text()
    for text in (svg, page):
        assert not re.search(r'xlink:href="javascript:', text) and "\x1b" not in text and "\x07" not in text
    xml.dom.minidom.parseString(svg.encode())  # well-formed
    data = re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.S).group(1)
    assert "<" not in data
    names = {n.get("module") for n in json.loads(data)["nodes"]}
    assert any(m and m.startswith("<!--<script>") for m in names)
    table = analyze(gm, (x,)).table(by="module")
    assert "\x1b" not in table and "\\x1b" in table


# probe AL F2: drawn against a graph an earlier apply made, nodes of that apply were
# "new" on both sides, and one this rewrite removed was green instead of red.
def test_a_second_rewrite_marks_only_its_own_nodes(tmp_path):
    class M(torch.nn.Module):
        def forward(self, x):
            return (x.sin() * 2.0).cos() + x.exp() / 2.0

    x = torch.randn(4, 4)
    first = rewrite.parse("rule m2: mul(x, 2.0) => add(x, x)\nrule d2: div(x, 2.0) => mul(x, 0.5)\n")
    g1 = first.apply(fx.symbolic_trace(M()), (x,)).graph_module
    made_by_m2 = next(n.name for n in g1.graph.nodes if n.meta.get("rewrite_rule", ("",))[0] == "m2")
    made_by_d2 = next(n.name for n in g1.graph.nodes if n.meta.get("rewrite_rule", ("",))[0] == "d2")
    g2 = rewrite.parse("rule a2: add(x, x) => mul(x, 2.0)\n").apply(g1, (x,)).graph_module
    page = show.render(g2, tmp_path / "d.html", (x,), before=g1).read_text()
    data = json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.S)
                      .group(1).replace("<\\/", "</"))
    status = {(d["side"], d["name"]): (d["status"], d["rule"]) for d in data["nodes"]}
    assert status[("before", made_by_m2)][0] == "removed"
    assert status[("before", made_by_d2)][0] == status[("after", made_by_d2)][0] == ""
    assert [rule for (side, _), (s, rule) in status.items() if s == "new"] == ["a2"]
