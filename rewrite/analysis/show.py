"""Draw a captured graph as a DAG: SVG through Graphviz, or a self-contained HTML viewer.

    from rewrite.analysis.show import render
    render(gm, "graph.svg", (x,))                        # one graph
    render(result.graph_module, "diff.html", (x,), before=gm)   # a rewrite's before/after

Nodes are grouped in boxes by module (``nn_module_stack``: one box per repeated block such as
``layer1.0`` or ``encoder.layer.6``, else two levels deep) and carry a
tooltip with their op, shape, dtype, FLOPs and bytes (``rewrite.analysis.analyze``).
With ``before``, both graphs are drawn side by side: nodes the rewrite removed are red
in "before", nodes it created are green in "after" and labelled with the rule that
created them; the tooltip gives the rule file position.

The DOT text is built with the ``graphviz`` package and laid out by a ``dot``
program: Graphviz's own when one is on PATH, else ``graphviz-pure`` (the ``show``
extra installs it: ``pip install torch-rewrite[show]``). The HTML page embeds the
laid-out SVG, the node data and a small script (pan/zoom, search by name, collapse by
module); it loads nothing from the network.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch.fx as fx

from rewrite.analysis.measure import GraphAnalysis, NodeStats, analyze
from rewrite.capture import missing_folder
from rewrite.language.diagnostics import printable

__all__ = ["render", "to_dot", "to_svg", "to_html", "layout_program", "output_problem", "ShowError"]

_MODULE_DEPTH = 2
_NEW, _REMOVED = "#c7f0c2", "#f6c4c4"
_FILL = {"placeholder": "#e8eefc", "output": "#e8eefc", "get_attr": "#f3f3f3"}


class ShowError(RuntimeError):
    """The picture cannot be made (no layout program, a layout failure); the message says why."""


def output_problem(path: Any) -> str | None:
    """Why ``path`` cannot be written by ``render`` (None when it can)."""
    suffix = Path(path).suffix
    if suffix not in (".svg", ".html"):
        return f"the output must be *.svg or *.html, not {Path(path).name!r}"
    return missing_folder(path)


def layout_program() -> str:
    """The Graphviz layout program to run: ``dot`` from PATH, else ``graphviz-pure``
    (also looked up next to the running Python, for an unactivated virtualenv)."""
    for name in ("dot", "graphviz-pure"):
        found = shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))
        if found:
            return found
    raise ShowError("no Graphviz layout program: install the show extra (pip install 'torch-rewrite[show]', "
                    "which brings graphviz-pure) or Graphviz's dot")


# ---------------------------------------------------------------- DOT


def _module_of(stats: NodeStats) -> str:
    parts = stats.module.split(".") if stats.module else []
    if stats.kind == "call_module":  # the node is the module itself: draw it in its parent
        parts = parts[:-1]
    # one box per repeated block: up to the first index (layer1.0, encoder.layer.6), else two levels
    index = next((i for i, p in enumerate(parts[:4]) if p.isdigit()), None)
    return ".".join(parts[:index + 1] if index is not None else parts[:_MODULE_DEPTH])


def _shape(stats: NodeStats) -> str:
    s = stats.shape
    if s and isinstance(s[0], tuple):
        return " ".join("x".join(map(str, t)) for t in s)
    return "x".join(map(str, s)) if s else ""


def _text(value: str) -> Any:
    """A name of the model's (a module, a rule, a file) as Graphviz text: control
    characters escaped (no XML allows them: the SVG would not parse) and never read
    as an HTML-like label (``<TABLE HREF='javascript:...'>``, which Graphviz lays
    out as markup and links)."""
    import graphviz

    return graphviz.nohtml("\n".join(printable(line) for line in str(value).split("\n")))


def _tooltip(stats: NodeStats) -> str:
    lines = [f"{stats.name}: {stats.op} ({stats.kind})"]
    if stats.shape:
        lines.append(f"shape {_shape(stats)} {stats.dtype}")
    if stats.module:
        lines.append(f"module {stats.module}")
    if stats.kind.startswith("call_"):
        lines.append(f"FLOPs {stats.flops:,}  elementwise {stats.elementwise:,}")
        lines.append(f"read {stats.bytes_read:,} B  written {stats.bytes_written:,} B  params {stats.param_bytes:,} B")
    if stats.rule:
        lines.append(f"created by rule {stats.rule} ({stats.rule_at})")
    return _text("\n".join(lines))


def _node_items(gm: fx.GraphModule, analysis: GraphAnalysis, prefix: str, removed: set,
                before: set | None = None) -> list:
    """(id, stats, status, input ids) per node; status: "new", "removed" or "".
    ``before``: the names of the graph this one is drawn against (a node an earlier
    apply made, in both, is not this rewrite's: not new); on the before side, a
    node is only removed or kept."""
    by_name = {s.name: s for s in analysis.nodes}
    items = []
    for node in gm.graph.nodes:
        stats = by_name[node.name]
        if node.name in removed:
            status = "removed"
        elif stats.rule and prefix != "before/" and (before is None or node.name not in before):
            status = "new"
        else:
            status = ""
        items.append((f"{prefix}{node.name}", stats, status, [f"{prefix}{a.name}" for a in node.all_input_nodes]))
    return items


def _sides(gm: fx.GraphModule, analysis: GraphAnalysis, before: tuple | None) -> list:
    """(title, ``_node_items``) per graph drawn: the one given, or before and after."""
    if before is None:
        return [("", _node_items(gm, analysis, "", set()))]
    bgm, banalysis = before
    after_names = {n.name for n in gm.graph.nodes}
    before_names = {n.name for n in bgm.graph.nodes}
    return [("before", _node_items(bgm, banalysis, "before/", before_names - after_names)),
            ("after", _node_items(gm, analysis, "after/", set(), before_names))]


def to_dot(gm: fx.GraphModule, analysis: GraphAnalysis, *, before: tuple | None = None) -> Any:
    """The ``graphviz.Digraph`` of ``gm`` (and of ``before = (graph, analysis)``, side by side)."""
    import graphviz

    dot = graphviz.Digraph("graph", graph_attr={"rankdir": "TB", "fontname": "Helvetica", "fontsize": "10",
                                                "newrank": "true", "nodesep": "0.15", "ranksep": "0.25"},
                           node_attr={"shape": "box", "style": "rounded,filled", "fillcolor": "white",
                                      "fontname": "Helvetica", "fontsize": "9", "height": "0.3", "margin": "0.05,0.02"},
                           edge_attr={"arrowsize": "0.5", "color": "#666666"})
    for title, items in _sides(gm, analysis, before):
        target = dot
        if title:
            with dot.subgraph(name=f"cluster_{title}", graph_attr={"label": title, "fontsize": "14",
                                                                  "id": f"side:{title}"}) as side:
                _add_items(side, items, title)
        else:
            _add_items(target, items, title)
    return dot


def _add_items(g: Any, items: list, side: str) -> None:
    by_module: dict = {}
    for item in items:
        by_module.setdefault(_module_of(item[1]), []).append(item)
    for module, members in by_module.items():
        if module:
            with g.subgraph(name=_text(f"cluster_{side}/{module}"),
                            graph_attr={"label": _text(module), "style": "rounded", "color": "#aaaaaa",
                                        "fontcolor": "#555555", "id": _text(f"module:{side}/{module}")}) as sub:
                for item in members:
                    _add_node(sub, item)
        else:
            for item in members:
                _add_node(g, item)
    for node_id, _, _, inputs in items:
        for src in inputs:
            g.edge(src, node_id, id=f"edge:{src}->{node_id}")


def _add_node(g: Any, item: tuple) -> None:
    node_id, stats, status, _ = item
    label = f"{stats.name}\n{stats.op}"
    shape = _shape(stats)
    if shape:
        label += f"  {shape}"
    attrs = {"id": f"node:{node_id}", "tooltip": _tooltip(stats), "fillcolor": _FILL.get(stats.kind, "white")}
    if stats.kind == "get_attr":
        attrs.update(fontsize="7", height="0.2")
    if status == "new":
        label += f"\n[{stats.rule}]"
        attrs.update(fillcolor=_NEW, color="#2e7d32", penwidth="2")
    elif status == "removed":
        attrs.update(fillcolor=_REMOVED, color="#c62828", penwidth="2")
    g.node(node_id, label=_text(label), **attrs)


def _layout(dot: Any) -> str:
    program = layout_program()
    try:
        done = subprocess.run([program, "-Tsvg"], input=dot.source.encode(), capture_output=True, timeout=600)
    except subprocess.TimeoutExpired as err:
        raise ShowError(f"{program} took longer than {err.timeout} s to lay the graph out") from None
    if done.returncode != 0:
        raise ShowError(f"{program} failed: {done.stderr.decode(errors='replace').strip()[:500]}")
    return done.stdout.decode()


# ---------------------------------------------------------------- outputs


def to_svg(gm: fx.GraphModule, analysis: GraphAnalysis, *, before: tuple | None = None) -> str:
    """The laid-out SVG text."""
    return _layout(to_dot(gm, analysis, before=before))


def _node_data(title: str, items: list) -> list:
    return [{"id": node_id, "name": s.name, "op": s.op, "module": _module_of(s), "path": s.module,
             "shape": _shape(s), "dtype": s.dtype, "flops": s.flops, "rule": s.rule, "rule_at": s.rule_at,
             "status": status, "side": title}
            for node_id, s, status, _ in items]


def to_html(gm: fx.GraphModule, analysis: GraphAnalysis, *, before: tuple | None = None, title: str = "") -> str:
    """A self-contained HTML page: the SVG, the node data, and the viewer script."""
    svg = to_svg(gm, analysis, before=before)
    svg = svg[svg.index("<svg"):]  # drop the XML prologue and doctype
    data = [row for title, items in _sides(gm, analysis, before) for row in _node_data(title, items)]
    page = (Path(__file__).with_name("viewer.html")).read_text(encoding="utf-8")
    # no "<" at all inside the script element: "</script>" would end it, "<!--<script>" make
    # the tokenizer run past its end (JSON reads \u003c as "<")
    payload = json.dumps({"nodes": data, "totals": analysis.totals.to_dict()}).replace("<", "\\u003c")
    # one pass over the template: a name or title holding a placeholder is never expanded
    fills = {"__TITLE__": html.escape(title or "rewrite show"), "__DATA__": payload, "__SVG__": svg}
    return _PLACEHOLDER.sub(lambda m: fills[m.group(0)], page)


_PLACEHOLDER = re.compile("__TITLE__|__DATA__|__SVG__")


def render(gm: Any, path: Any, example_inputs: Sequence[Any] | None = None, *, before: Any = None,
           show_progress: bool = False) -> Path:
    """Write ``gm`` as ``path`` (``*.svg`` or ``*.html``); with ``before`` (the graph
    before a rewrite), draw both with the rewrite highlighted.

    Args:
        gm: a GraphModule (or ExportedProgram).
        path: the output file; its suffix chooses the format.
        example_inputs: inputs to run the graphs with (shapes, FLOPs); default from
            placeholder metadata.
        before: the original graph of a rewrite (``result.graph_module`` is ``gm``).

    Returns:
        the path written.

    Raises:
        ValueError: the path is not ``*.svg``/``*.html`` or its folder is missing.
        ShowError: no layout program, or the layout failed.
    """
    problem = output_problem(path)
    if problem:
        raise ValueError(problem)
    gm = gm.module() if hasattr(gm, "graph_module") and not isinstance(gm, fx.GraphModule) else gm
    analysis = analyze(gm, example_inputs, show_progress=show_progress)
    pair = None
    if before is not None:
        before = before.module() if not isinstance(before, fx.GraphModule) else before
        pair = (before, analyze(before, example_inputs, show_progress=show_progress))
    path = Path(path)
    start = time.perf_counter()
    text = to_svg(gm, analysis, before=pair) if path.suffix == ".svg" else to_html(gm, analysis, before=pair,
                                                                                   title=path.stem)
    if show_progress and sys.stderr.isatty():
        print(f"laid out in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    path.write_text(text, encoding="utf-8")
    return path
