"""rules/transformer.rw on transformers models built with eager attention: what it finds
and replaces, what the rewritten graph costs, and one chain that builds on it.

Models (random weights, ``attn_implementation="eager"``, ``torch.export`` capture,
batch 1, 1 thread by default):

* BERT-base (``BertConfig()``: 12 layers, hidden 768), 128 and 512 tokens;
* a small Llama (8 layers, hidden 512, 8 heads, 2 of them key/value heads: grouped-query
  attention), 128 and 512 tokens;
* ViT-base (``ViTConfig()``: 12 layers, hidden 768, 16x16 patches) on 176x176 and
  352x352 images: 122 and 485 tokens;
* GPT-2 small (``GPT2Config()``: 12 layers, ``gelu_new``), 128 and 512 tokens.

Counts: rewrites per kind against what the architecture has (one attention per
layer; Llama's 2 RMSNorms per layer plus the final one; GPT-2's one tanh-GELU per
layer), and the written-out ops left (softmax, rsqrt, tanh). Times (round-robin, one
call of each variant in turn, ``--runs`` rounds, median):

* ``eager graph``: the captured eager model, not rewritten;
* ``rules``: the same graph after ``rules/transformer.rw``;
* ``hf sdpa``: transformers' own ``attn_implementation="sdpa"`` model, captured the
  same way: the peer that writes sdpa by hand.

Chain (``--chain``, 128 tokens): ``transformer.rw`` then ``rules/amp_bf16.rw`` on the
same graph, then saved as ``.pt2`` (``rewrite.capture.save``) and loaded back with
``torch.export.load``, what a runtime receives: the canonical
``scaled_dot_product_attention`` is one op the AMP rules run in bfloat16 (counted
from the nodes' dtypes, in the rewritten graph and in the loaded program), timed
against the eager model under ``torch.autocast("cpu", torch.bfloat16)`` (the peer),
AMP alone on the written-out graph, and the fp32 rewrite.

The graphs are plain exports: the ``aten._assert_tensor_metadata`` checks export puts
on the input of each ``.to()`` (the softmax, RMSNorm's product) do not block the rules
(``rewrite.engine.facts.METADATA_CHECKS``).

Run: ``flock /tmp/bench.lock python benchmarks/transformer.py --runs 5 --chain``.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
import time
from typing import Any, Callable

import torch

import rewrite
import rewrite.capture
from rewrite.ops import bind_node


def _tokens(vocab: int, seq: int) -> tuple:
    return (torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0)),)


def bert(seq: int, impl: str) -> tuple:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(attn_implementation=impl)
    return BertModel(config).eval(), _tokens(config.vocab_size, seq), {"attention": 12}


def llama(seq: int, impl: str) -> tuple:
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=32000, max_position_embeddings=1024,
                         use_cache=False, attn_implementation=impl)
    return LlamaModel(config).eval(), _tokens(config.vocab_size, seq), {"attention": 8, "rms_norm": 17}


def vit(seq: int, impl: str) -> tuple:
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(0)
    size = {128: 176, 512: 352}[seq]
    config = ViTConfig(image_size=size, attn_implementation=impl)
    pixels = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(0))
    return ViTModel(config).eval(), (pixels,), {"attention": 12}


def gpt2(seq: int, impl: str) -> tuple:
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    config = GPT2Config(use_cache=False, attn_implementation=impl)
    return GPT2Model(config).eval(), _tokens(config.vocab_size, seq), {"attention": 12, "gelu_tanh": 12}


MODELS: dict = {"bert-base": bert, "llama-small": llama, "vit-base": vit, "gpt2": gpt2}
#: rule-name prefix -> kind in the counts table
KINDS = {"attention_": "attention", "rms_norm": "rms_norm", "layer_norm": "layer_norm", "gelu_tanh": "gelu_tanh"}


def capture(model: torch.nn.Module, args: tuple) -> torch.fx.GraphModule:
    return torch.export.export(model, args, strict=False).module()


def ops(gm: torch.fx.GraphModule) -> collections.Counter:
    return collections.Counter(b[0].op for n in gm.graph.nodes for b in [bind_node(n, gm)] if b)


def kinds(counts: dict) -> collections.Counter:
    out: collections.Counter = collections.Counter()
    for name, n in counts.items():
        for prefix, kind in KINDS.items():
            if name.startswith(prefix) and "dropout" not in name:
                out[kind] += n
    return out


def first(out: Any) -> torch.Tensor:
    while not isinstance(out, torch.Tensor):
        out = out[0] if isinstance(out, (tuple, list)) else next(iter(out.values()))
    return out


def round_robin(fns: dict, runs: int) -> dict:
    times: dict = {k: [] for k in fns}
    with torch.no_grad():
        for f in fns.values():  # warm-up
            f()
        for _ in range(runs):
            for k, f in fns.items():
                t = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_model(name: str, seq: int, runs: int, rules: Any) -> None:
    build = MODELS[name]
    model, args, expected = build(seq, "eager")
    gm = capture(model, args)
    t = time.perf_counter()
    result = rules.apply(gm, example_inputs=args, trials=1)
    rewrite_s = time.perf_counter() - t
    after = ops(result.graph_module)
    found = kinds(result.counts)
    hf_model, hf_args, _ = build(seq, "sdpa")
    hf = capture(hf_model, hf_args)
    with torch.no_grad():
        err = (first(result.graph_module(*args)) - first(gm(*args))).abs().max().item()
    fns: dict = {"eager graph": lambda: gm(*args), "rules": lambda: result.graph_module(*args),
                 "hf sdpa": lambda: hf(*hf_args)}
    med = round_robin(fns, runs)
    counted = ", ".join(f"{k} {found[k]}/{v}" for k, v in expected.items())
    left = f"softmax {after['softmax']}, rsqrt {after['rsqrt']}, tanh {after['tanh']}"
    tokens = first(result.graph_module(*args)).shape[1]
    print(f"| {name} | {tokens} | {counted} | {left} | {rewrite_s:.1f} | {med['eager graph'] * 1e3:.0f} | "
          f"{med['rules'] * 1e3:.0f} | {med['hf sdpa'] * 1e3:.0f} | {med['eager graph'] / med['rules']:.3f} | "
          f"{med['hf sdpa'] / med['rules']:.3f} | {err:.1e} |", flush=True)


def sdpa_dtypes(gm: torch.fx.GraphModule) -> collections.Counter:
    out: collections.Counter = collections.Counter()
    for n in gm.graph.nodes:
        b = bind_node(n, gm)
        if b and b[0].op == "scaled_dot_product_attention":
            out[str(getattr(n.args[0].meta.get("val"), "dtype", "?")).replace("torch.", "")] += 1
    return out


def bench_chain(name: str, runs: int, rules: Any, amp: Any) -> None:
    model, args, expected = MODELS[name](128, "eager")
    gm = capture(model, args)
    t = time.perf_counter()
    canonical = rules.apply(gm, example_inputs=args, trials=1).graph_module
    lowered = amp.apply(canonical, example_inputs=args, trials=1).graph_module
    chain_s = time.perf_counter() - t
    direct = amp.apply(gm, example_inputs=args, trials=1).graph_module  # AMP without transformer.rw
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        rewrite.capture.save(lowered, f"{tmp}/model.pt2", level="export", example_inputs=args)
        loaded = torch.export.load(f"{tmp}/model.pt2").module()
        save_s = time.perf_counter() - t

    def autocast() -> Any:
        with torch.autocast("cpu", torch.bfloat16):
            return model(*args)

    med = round_robin({"autocast": autocast, "fp32 rules": lambda: canonical(*args),
                       "rules+amp": lambda: lowered(*args), "amp only": lambda: direct(*args),
                       "pt2": lambda: loaded(*args)}, runs)
    with torch.no_grad():
        ref = first(model(*args)).float()
        err = ((first(lowered(*args)).float() - ref).abs().max() / ref.abs().max()).item()
    f32_matmuls = sum(1 for n in lowered.graph.nodes for b in [bind_node(n, lowered)]
                      if b and b[0].op in ("matmul", "bmm", "linear", "mm", "addmm")
                      and getattr(n.meta.get("val"), "dtype", None) == torch.float32)
    print(f"| {name} | sdpa {dict(sdpa_dtypes(lowered))} of {expected['attention']} | {f32_matmuls} | "
          f"{dict(sdpa_dtypes(loaded))} | {chain_s:.1f} | {save_s:.1f} | {med['autocast'] * 1e3:.0f} | "
          f"{med['fp32 rules'] * 1e3:.0f} | {med['amp only'] * 1e3:.0f} | {med['rules+amp'] * 1e3:.0f} | "
          f"{med['pt2'] * 1e3:.0f} | {med['autocast'] / med['rules+amp']:.2f} | "
          f"{med['amp only'] / med['rules+amp']:.2f} | {err:.1e} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--tokens", default="128,512")
    parser.add_argument("--chain", action="store_true", help="also run transformer.rw -> amp_bf16.rw")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    rules = rewrite.load("rules/transformer.rw")["transformer"]
    print(f"torch {torch.__version__}, {opts.threads} thread(s), median of {opts.runs} runs, round-robin\n")
    print("| model | tokens | replaced/in the model | written-out left | rewrite s | eager graph ms | rules ms "
          "| hf sdpa ms | eager/rules | hf sdpa/rules | max abs err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in opts.models.split(","):
        for seq in (int(s) for s in opts.tokens.split(",") if s):
            bench_model(name, seq, opts.runs, rules)
    if opts.chain:
        amp = rewrite.load("rules/amp_bf16.rw")
        print("\nchain at 128 tokens: transformer.rw -> amp_bf16.rw\n")
        print("| model | sdpa nodes by input dtype | float32 matmul-class left | sdpa in the loaded .pt2 "
              "| rewrite s | save+load s | autocast ms | fp32 rules ms | amp only ms | rules+amp ms | .pt2 ms "
              "| autocast/(rules+amp) | amp only/(rules+amp) | max rel err vs fp32 |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for name in ("bert-base", "llama-small"):
            bench_chain(name, opts.runs, rules, amp)


if __name__ == "__main__":
    main()
