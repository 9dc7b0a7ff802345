"""Open rewrite show's HTML viewer in a real headless browser (Chromium).

    python benchmarks/show_browser.py [--model resnet50|bert_base] [--out DIR]

Renders the before/after diff of rules/fusion.rw on the model, loads the page in
Chromium (``apt-get install chromium-headless-shell`` or ``chromium``) with a search
in the URL (``#search=NAME``), and checks in the DOM the page's script produced that
it ran, that every node of the data is drawn, and that the search found the node and
focused it. Saves a screenshot next to the page. Exit 1 on a failed check, 2 when no
Chromium is installed. Not a test: the pytest suite needs no browser.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import rewrite
from rewrite.analysis.show import render
from rewrite.capture import capture_with_inputs

_BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")


def _browser() -> str | None:
    return next((shutil.which(b) for b in _BROWSERS if shutil.which(b)), None)


def _model(name: str):
    if name == "resnet50":
        from rewrite.examples.cnn import resnet50_with_inputs
        return resnet50_with_inputs(), "fx", "layer3_4_conv2"
    from rewrite.examples.hf import bert_base
    return bert_base(), "export", "linear_40"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("resnet50", "bert_base"), default="resnet50")
    p.add_argument("--out", default=None, help="folder for the page and the screenshot (default: a temp dir)")
    args = p.parse_args()
    browser = _browser()
    if browser is None:
        print("no Chromium found (apt-get install chromium-headless-shell)", file=sys.stderr)
        return 2
    (model, inputs), level, wanted = _model(args.model)
    gm, call_inputs = capture_with_inputs(model, inputs, level)
    result = rewrite.load("rules/fusion.rw", "rules/cleanup.rw").apply(gm, example_inputs=call_inputs, check=False)
    created = {n.meta["rewrite_rule"][0] for n in result.graph_module.graph.nodes if n.meta.get("rewrite_rule")}
    out = Path(args.out or tempfile.mkdtemp(prefix="show_browser_"))
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    page = render(result.graph_module, out / f"{args.model}.html", call_inputs, before=gm)
    render_s = time.perf_counter() - start
    nodes = len(gm.graph.nodes) + len(result.graph_module.graph.nodes)
    url = f"{page.resolve().as_uri()}#search={wanted}"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=10000",
             "--window-size=1400,900"]
    start = time.perf_counter()
    dom = subprocess.run([browser, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=300).stdout
    load_s = time.perf_counter() - start
    subprocess.run([browser, *flags, f"--screenshot={out / (args.model + '.png')}", url],
                   capture_output=True, timeout=300)
    folded = subprocess.run([browser, *flags, "--dump-dom", f"{page.resolve().as_uri()}#collapse"],
                            capture_output=True, text=True, timeout=300).stdout
    in_modules = re.findall(r'data-hidden="(\d+)"', folded)
    checks = {
        "the script ran": 'data-ready="1"' in dom,
        "every node drawn": re.search(r'data-nodes="(\d+)"', dom) is not None
        and int(re.search(r'data-nodes="(\d+)"', dom).group(1)) == nodes,
        "search found the node": re.search(r'data-hits="([1-9]\d*)"', dom) is not None,
        "search focused it": re.search(rf'id="node:(before|after)/{wanted}" class="node[^"]*current', dom) is not None,
        "rewrite highlighted": all(f"[{rule}]" in dom for rule in created),
        "folding every module hides their nodes": bool(in_modules) and 0 < int(in_modules[0]) < nodes
        and folded.count('class="node hidden"') == int(in_modules[0]) and 'cluster collapsed' in folded,
    }
    print(f"{args.model}: rules fired {dict(result.counts)}; {nodes} nodes (before + after); render {render_s:.1f} s; "
          f"page {page.stat().st_size / 2**20:.1f} MiB; Chromium load+script {load_s:.1f} s")
    for name, ok in checks.items():
        print(f"  {'ok ' if ok else 'FAIL'} {name}")
    print(f"  page {page}\n  screenshot {out / (args.model + '.png')}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
