"""The transformers sweep: rules/fusion.rw and rules/amp_bf16.rw on many architectures.

Every model is built from a small config with random weights (nothing is downloaded),
in eval mode, with ``attn_implementation="eager"`` where the config takes one, and
captured with ``torch.export.export(model, inputs, strict=False).module()``. Models
that fail to build or capture are listed with the reason and not counted.
The graphs are plain exports: the ``aten._assert_tensor_metadata`` checks export puts
on the input of each ``.to()`` are no readers to the engine and go with the values they
check (every rewrite keeps each value's dtype, so the ones left still hold).

Per model:

* **BN** ``before -> after`` ``rules/fusion.rw`` (default apply, check on), and
  **foldable**: batch norms (inference) whose input is a conv, conv_transpose, linear,
  mm or addmm with one user, directly or through a chain of flatten / reshape / view /
  reshape_as / unsqueeze / squeeze nodes with one user each. ``foldable left`` is the
  same count on the fused graph (the target is 0).
* **fp32 mm**: after ``rules/amp_bf16.rw`` (default apply, check on; when the check
  fails the graph is rewritten again without it to measure), the matrix-class nodes
  (conv, conv_transpose, linear, matmul, mm, bmm, addmm, baddbmm, addbmm,
  scaled_dot_product_attention, and einsum when CPU autocast lowers it: two operands
  with a summed index, ``rewrite.functions.amp.einsum_contracts``) whose output is
  float32 in one run of the graph: ops autocast would run in bfloat16. Shown as
  ``left/total``.
* **casts**: float-to-float ``to`` nodes in the AMP graph (in brackets: those in the
  captured graph, which the model writes), against two counts. **distinct**: the
  distinct (source value, dtype) pairs those casts provide, a cast's source found by
  looking through casts and a round trip needing none: casts above it are duplicates
  (one value cast to one dtype twice). **autocast min**: the casts autocast's own
  choice of dtypes needs on the captured graph (``autocast_minimum``: one run of it
  under ``torch.autocast("cpu", torch.bfloat16)`` gives each op's dtype; each value read
  in another dtype than it was computed in needs one cast per dtype; casts of constants
  fold and are not counted; float outputs are wanted in float32). ``ratio`` = casts /
  autocast min (the issue's target: <= 1.2); above it, casts sit where the rules keep
  an op in float32 that autocast runs in bfloat16, or duplicate one another.
* **check**: whether the AMP apply's equivalence check passed.

Run: ``flock /tmp/bench.lock python benchmarks/sweep.py`` (all models, about 15
minutes on 2 cores), ``--quick`` (a subset), ``--models bert,levit``.
"""

from __future__ import annotations

import argparse
import collections
import time
import traceback
from typing import Any, Callable

import torch
from torch import fx, nn

import rewrite
from rewrite.functions.amp import einsum_contracts
from rewrite.ops import bind_node

Built = tuple[nn.Module, tuple]

# ---------------------------------------------------------------- inputs


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def pixels(size: int = 64, channels: int = 3) -> tuple:
    return (torch.randn(1, channels, size, size, generator=_gen()),)


def tokens(vocab: int = 100, seq: int = 16) -> tuple:
    return (torch.randint(0, vocab, (1, seq), generator=_gen()),)


def audio(samples: int = 1600) -> tuple:
    return (torch.randn(1, samples, generator=_gen()),)


def _randomize_batchnorm(model: nn.Module) -> None:
    """Random running statistics, so folded and unfolded graphs differ if wrong."""
    g = _gen()
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
            m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)


def hf(model_cls: str, config_cls: str, inputs: Callable[[], tuple], eager: bool = True,
       part: str | None = None, **config: Any) -> Callable[[], Built]:
    """A builder: ``transformers.<model_cls>(<config_cls>(**config))`` in eval mode
    (``part``: one of its submodules, e.g. ``encoder``)."""

    def build() -> Built:
        import transformers

        torch.manual_seed(0)
        cfg = getattr(transformers, config_cls)(**config)
        if eager:
            cfg._attn_implementation = "eager"
        model = getattr(transformers, model_cls)(cfg)
        if part:
            model = getattr(model, part)
        _randomize_batchnorm(model)
        return model.eval(), inputs()

    return build


_TEXT = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
             intermediate_size=64, max_position_embeddings=64)
_LLM = dict(_TEXT, num_key_value_heads=1, use_cache=False)
_VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            image_size=32, patch_size=8)

#: name -> builder. The issue's models first, then common ones.
MODELS: dict[str, Callable[[], Built]] = {
    "xlnet": hf("XLNetModel", "XLNetConfig", tokens, vocab_size=100, d_model=32, n_layer=2, n_head=2,
                d_inner=64, use_mems_eval=False),
    "funnel": hf("FunnelModel", "FunnelConfig", tokens, vocab_size=100, d_model=32, n_head=2, d_head=16,
                 d_inner=64, block_sizes=[1, 1], num_decoder_layers=1),
    "cvt": hf("CvtModel", "CvtConfig", lambda: pixels(64), embed_dim=[16, 32, 48], num_heads=[1, 2, 2],
              depth=[1, 1, 1]),
    "levit": hf("LevitModel", "LevitConfig", lambda: pixels(64), image_size=64, hidden_sizes=[32, 48, 64],
                num_attention_heads=[1, 2, 2], depths=[1, 1, 1], key_dim=[8, 8, 8]),
    "bit": hf("BitModel", "BitConfig", lambda: pixels(64), embedding_size=16,
              hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1]),
    "hifigan": hf("SpeechT5HifiGan", "SpeechT5HifiGanConfig", lambda: (torch.randn(1, 8, 16, generator=_gen()),),
                  eager=False, model_in_dim=16, upsample_initial_channel=32, upsample_rates=[2, 2],
                  upsample_kernel_sizes=[4, 4], resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3]]),
    "dac": hf("DacModel", "DacConfig", lambda: (torch.randn(1, 1, 512, generator=_gen()),), eager=False,
              encoder_hidden_size=8, downsampling_ratios=[2, 4], decoder_hidden_size=16,
              upsampling_ratios=[4, 2], n_codebooks=2, codebook_size=16, codebook_dim=4, hidden_size=32),
    "mobilevitv2": hf("MobileViTV2Model", "MobileViTV2Config", lambda: pixels(64), image_size=64,
                      width_multiplier=0.25),
    "textnet": hf("TextNetModel", "TextNetConfig", lambda: pixels(64)),
    "swiftformer": hf("SwiftFormerModel", "SwiftFormerConfig", lambda: pixels(64), depths=[1, 1, 1, 1],
                      embed_dims=[16, 32, 48, 64]),
    "bert": hf("BertModel", "BertConfig", tokens, **_TEXT),
    "roberta": hf("RobertaModel", "RobertaConfig", tokens, **_TEXT),
    "distilbert": hf("DistilBertModel", "DistilBertConfig", tokens, vocab_size=100, dim=32, n_layers=2,
                     n_heads=2, hidden_dim=64, max_position_embeddings=64),
    "albert": hf("AlbertModel", "AlbertConfig", tokens, embedding_size=16, **_TEXT),
    "electra": hf("ElectraModel", "ElectraConfig", tokens, embedding_size=16, **_TEXT),
    "deberta_v2": hf("DebertaV2Model", "DebertaV2Config", tokens, **_TEXT),
    "gpt2": hf("GPT2Model", "GPT2Config", tokens, vocab_size=100, n_embd=32, n_layer=2, n_head=2,
               n_positions=64, use_cache=False),
    "llama": hf("LlamaModel", "LlamaConfig", tokens, **_LLM),
    "mistral": hf("MistralModel", "MistralConfig", tokens, **_LLM),
    "qwen2": hf("Qwen2Model", "Qwen2Config", tokens, **_LLM),
    "gemma": hf("GemmaModel", "GemmaConfig", tokens, head_dim=16, **_LLM),
    "phi": hf("PhiModel", "PhiConfig", tokens, **_LLM),
    "t5_encoder": hf("T5EncoderModel", "T5Config", tokens, vocab_size=100, d_model=32, d_kv=16, d_ff=64,
                     num_layers=2, num_heads=2),
    "vit": hf("ViTModel", "ViTConfig", lambda: pixels(32), **_VIT),
    "deit": hf("DeiTModel", "DeiTConfig", lambda: pixels(32), **_VIT),
    "beit": hf("BeitModel", "BeitConfig", lambda: pixels(32), **_VIT),
    "dinov2": hf("Dinov2Model", "Dinov2Config", lambda: pixels(32), **_VIT),
    "swin": hf("SwinModel", "SwinConfig", lambda: pixels(32), image_size=32, patch_size=2, embed_dim=16,
               depths=[1, 1], num_heads=[1, 2], window_size=4),
    "convnext": hf("ConvNextModel", "ConvNextConfig", lambda: pixels(64), hidden_sizes=[16, 32, 64, 128],
                   depths=[1, 1, 1, 1]),
    "convnextv2": hf("ConvNextV2Model", "ConvNextV2Config", lambda: pixels(64),
                     hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1]),
    "resnet": hf("ResNetModel", "ResNetConfig", lambda: pixels(64), embedding_size=16,
                 hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], layer_type="bottleneck"),
    "regnet": hf("RegNetModel", "RegNetConfig", lambda: pixels(64), embedding_size=16,
                 hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], groups_width=8),
    "mobilenet_v1": hf("MobileNetV1Model", "MobileNetV1Config", lambda: pixels(64), depth_multiplier=0.25),
    "mobilenet_v2": hf("MobileNetV2Model", "MobileNetV2Config", lambda: pixels(64), depth_multiplier=0.35),
    "efficientnet": hf("EfficientNetModel", "EfficientNetConfig", lambda: pixels(64), image_size=64,
                       width_coefficient=0.25, depth_coefficient=0.25),
    "poolformer": hf("PoolFormerModel", "PoolFormerConfig", lambda: pixels(64), hidden_sizes=[16, 32, 48, 64],
                     depths=[1, 1, 1, 1]),
    "segformer": hf("SegformerModel", "SegformerConfig", lambda: pixels(64), hidden_sizes=[16, 32, 48, 64],
                    depths=[1, 1, 1, 1], num_attention_heads=[1, 2, 2, 2], decoder_hidden_size=32),
    "whisper_encoder": hf("WhisperModel", "WhisperConfig", lambda: (torch.randn(1, 16, 32, generator=_gen()),),
                          part="encoder", num_mel_bins=16, d_model=32, encoder_layers=2, decoder_layers=1,
                          encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                          decoder_ffn_dim=64, max_source_positions=16, vocab_size=100),
    "wav2vec2": hf("Wav2Vec2Model", "Wav2Vec2Config", audio, **dict(_TEXT, vocab_size=32),
                   conv_dim=[16, 16], conv_stride=[5, 2], conv_kernel=[10, 3], num_conv_pos_embeddings=16,
                   num_conv_pos_embedding_groups=2),
    "hubert": hf("HubertModel", "HubertConfig", audio, **dict(_TEXT, vocab_size=32),
                 conv_dim=[16, 16], conv_stride=[5, 2], conv_kernel=[10, 3], num_conv_pos_embeddings=16,
                 num_conv_pos_embedding_groups=2),
}

QUICK = ("levit", "xlnet", "textnet", "bert", "resnet", "mobilevitv2")

# ---------------------------------------------------------------- graph facts

_VIEWS = {"flatten", "reshape", "view", "reshape_as", "unsqueeze", "squeeze"}
_FOLD_INTO = {"conv", "conv_transpose", "linear", "mm", "addmm"}
_MATRIX = {"conv", "conv_transpose", "linear", "matmul", "mm", "bmm", "addmm", "baddbmm",
           "scaled_dot_product_attention", "einsum"}
_FLOATS = {torch.float32, torch.float16, torch.bfloat16, torch.float64}


def capture(model: nn.Module, inputs: tuple) -> fx.GraphModule:
    """torch.export (strict=False), as a user captures it."""
    return torch.export.export(model, inputs, strict=False).module()


def canonical(node: fx.Node, gm: fx.GraphModule) -> tuple[str | None, dict]:
    """(canonical op, its arguments) of a node, or (None, {})."""
    bound = bind_node(node, gm)
    return (bound[0].op, bound[0].args) if bound else (None, {})


def batch_norms(gm: fx.GraphModule) -> list[fx.Node]:
    out = []
    for n in gm.graph.nodes:
        op, args = canonical(n, gm)
        if op == "batch_norm" and args.get("training") is not True:
            out.append(n)
    return out


def _reads_values(user: fx.Node, node: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether ``user`` reads ``node``'s values, not only its shape (``reshape_as(y, node)``,
    ``expand_as(y, node)``, ``aten.sym_size``)."""
    op, args = canonical(user, gm)
    if op in ("reshape_as", "expand_as") and args.get("input") is not node:
        return False
    return not (user.op == "call_function" and "sym_size" in str(user.target))


def foldable(bn: fx.Node, gm: fx.GraphModule) -> bool:
    """A conv/linear/mm/addmm of one user feeds it, directly or through single-use views
    (a use that reads only the shape, as LeViT's ``reshape_as``, does not count)."""
    src = canonical(bn, gm)[1].get("input")
    while isinstance(src, fx.Node):
        op, _ = canonical(src, gm)
        if sum(_reads_values(u, src, gm) for u in src.users) != 1:
            return False
        if op in _FOLD_INTO:
            return True
        if op not in _VIEWS:
            return False
        src = src.all_input_nodes[0] if src.all_input_nodes else None
    return False


def run_dtypes(gm: fx.GraphModule, inputs: tuple, autocast: bool = False) -> dict:
    """node -> dtype of the tensor it computes (one run; under CPU bfloat16 autocast
    when ``autocast``: the dtypes autocast chooses, op by op)."""
    seen: dict = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            if autocast and n.op == "call_function" and n.target is torch.ops.aten._assert_tensor_metadata.default:
                return None  # export's dtype checks hold for the graph as captured, not under autocast
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                seen[n] = out.dtype
            return out

    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        Recorder(gm).run(*inputs)
    return seen


def _matrix_kind(node: fx.Node, gm: fx.GraphModule) -> str | None:
    op, args = canonical(node, gm)
    if op == "einsum":
        tensors = args.get("tensors")
        n_ops = len(tensors) if isinstance(tensors, (list, tuple)) else 0
        eq = args.get("equation")
        return "einsum" if isinstance(eq, str) and (n_ops > 2 or einsum_contracts(eq)) else None
    if op in _MATRIX:
        return op
    if node.op == "call_function" and "addbmm" in str(node.target):
        return "addbmm"
    return None


def fp32_matrix_ops(gm: fx.GraphModule, seen: dict) -> tuple[collections.Counter, int]:
    """(kind -> matrix-class nodes computing float32, total matrix-class nodes)."""
    left: collections.Counter = collections.Counter()
    total = 0
    for n in gm.graph.nodes:
        kind = _matrix_kind(n, gm)
        if kind is None:
            continue
        total += 1
        if seen.get(n) == torch.float32:
            left[kind] += 1
    return left, total


def float_casts(gm: fx.GraphModule, seen: dict) -> list[fx.Node]:
    """The ``to`` nodes from one floating dtype to another."""
    out = []
    for n in gm.graph.nodes:
        op, args = canonical(n, gm)
        src = args.get("input")
        if op == "to" and isinstance(src, fx.Node) and seen.get(src) in _FLOATS and seen.get(n) in _FLOATS:
            out.append(n)
    return out


def cast_minimum(gm: fx.GraphModule, casts: list[fx.Node], seen: dict) -> int:
    """Distinct (source, dtype) pairs the casts provide, the source found through casts,
    round trips (dtype of the source itself) needing none."""
    cast_set = set(casts)
    pairs = set()
    for c in casts:
        src = c.all_input_nodes[0]
        while src in cast_set:
            src = src.all_input_nodes[0]
        if seen.get(c) != seen.get(src):
            pairs.add((src, seen.get(c)))
    return len(pairs)


def _constant_nodes(gm: fx.GraphModule) -> set:
    """Nodes computed from parameters and buffers alone (their casts fold at rewrite time)."""
    out: set = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr" or (n.op == "call_function" and n.all_input_nodes
                                  and all(i in out for i in n.all_input_nodes)):
            out.add(n)
    return out


def autocast_minimum(gm: fx.GraphModule, seen: dict) -> int:
    """The casts autocast's own choice of dtypes needs in a graph: distinct (value,
    dtype) pairs where a reader takes a value in another dtype than it was computed in.

    ``seen``: the dtypes of one run under autocast (``run_dtypes(..., autocast=True)``).
    A matrix-class op reads its float operands in bfloat16; another op with a float
    result reads them in its result's dtype (type promotion); a ``to`` the model writes
    reads its input as it is and is itself the cast; a float graph output is wanted in
    float32 (the rules' outputs keep the model's dtypes). Values computed from
    constants alone are not counted: their casts fold into new constants.
    """
    consts = _constant_nodes(gm)

    def root(v: fx.Node) -> fx.Node:
        while canonical(v, gm)[0] == "to" and v.all_input_nodes and seen.get(v.all_input_nodes[0]) in _FLOATS:
            v = v.all_input_nodes[0]
        return v

    pairs = set()

    def need(v: Any, dtype: Any) -> None:
        if isinstance(v, fx.Node) and seen.get(v) in _FLOATS and dtype in _FLOATS:
            src = root(v)
            if src not in consts and seen.get(src) != dtype:
                pairs.add((src, dtype))

    for n in gm.graph.nodes:
        if n.op == "output":
            for out in torch.utils._pytree.tree_leaves(n.args[0]):
                need(out, torch.float32)
            continue
        if n.op != "call_function" or canonical(n, gm)[0] == "to":
            if canonical(n, gm)[0] == "to":
                need(n, seen.get(n))
            continue
        if _matrix_kind(n, gm) is not None:
            wanted = torch.bfloat16
        elif seen.get(n) in _FLOATS:
            wanted = seen[n]
        else:
            continue
        for i in n.all_input_nodes:
            need(i, wanted)
    return len(pairs)


def cast_stops(gm: fx.GraphModule, casts: list[fx.Node], seen: dict) -> collections.Counter:
    """The ops that read a value cast from bfloat16 back to float32 (where cast
    sinking stopped): canonical op name, else the node's target."""
    stops: collections.Counter = collections.Counter()
    for c in casts:
        if seen.get(c) != torch.float32 or seen.get(c.all_input_nodes[0]) != torch.bfloat16:
            continue
        for u in c.users:
            if u.op == "output":
                continue
            op = canonical(u, gm)[0]
            if op != "to":
                stops[op or str(getattr(u.target, "__name__", u.target)).replace(".default", "")] += 1
    return stops


# ---------------------------------------------------------------- one model


def measure(name: str, fusion: Any, amp: Any) -> dict:
    row: dict = {"model": name}
    model, inputs = MODELS[name]()
    gm = capture(model, inputs)
    row["nodes"] = len(gm.graph.nodes)

    bns = batch_norms(gm)
    row["bn"] = len(bns)
    row["foldable"] = sum(foldable(b, gm) for b in bns)
    if bns:
        fused = fusion.apply(gm, example_inputs=inputs).graph_module
        after = batch_norms(fused)
        row["bn_after"] = len(after)
        row["foldable_left"] = sum(foldable(b, fused) for b in after)
    else:
        row["bn_after"] = row["foldable_left"] = 0

    row["autocast_min"] = autocast_minimum(gm, run_dtypes(gm, inputs, autocast=True))
    seen = run_dtypes(gm, inputs)
    row["casts_before"] = len(float_casts(gm, seen))
    start = time.perf_counter()
    try:
        out = amp.apply(gm, example_inputs=inputs).graph_module
        row["check"] = "pass"
    except Exception as e:  # noqa: BLE001 - a failed check is a result to report
        row["check"] = f"FAIL: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
        out = amp.apply(gm, example_inputs=inputs, check=False).graph_module
    row["amp_s"] = time.perf_counter() - start
    seen = run_dtypes(out, inputs)
    left, total = fp32_matrix_ops(out, seen)
    row["mm_total"], row["mm_fp32"], row["mm_fp32_kinds"] = total, sum(left.values()), dict(left)
    casts = float_casts(out, seen)
    row["casts"], row["cast_min"] = len(casts), cast_minimum(out, casts, seen)
    row["stops"] = dict(cast_stops(out, casts, seen).most_common(6))
    return row


# ---------------------------------------------------------------- report


def _ratio(row: dict) -> str:
    """casts / autocast's minimum."""
    low = row["autocast_min"]
    return f"{row['casts'] / low:.2f}" if low else ("1.00" if not row["casts"] else "inf")


def table(rows: list[dict]) -> str:
    head = ("| model | BN before -> after | foldable | foldable left | fp32 mm (left/total) | casts (model's) "
            "| distinct | autocast min | ratio | check |")
    lines = [head, "|---" * 10 + "|"]
    for r in rows:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(r["mm_fp32_kinds"].items()))
        lines.append(f"| {r['model']} | {r['bn']} -> {r['bn_after']} | {r['foldable']} | {r['foldable_left']} "
                     f"| {r['mm_fp32']}/{r['mm_total']}{f' ({kinds})' if kinds else ''} "
                     f"| {r['casts']} ({r['casts_before']}) | {r['cast_min']} | {r['autocast_min']} | {_ratio(r)} "
                     f"| {r['check']} |")
    tot = {k: sum(r[k] for r in rows) for k in ("bn", "bn_after", "foldable", "foldable_left", "mm_fp32",
                                                   "mm_total", "casts", "casts_before", "cast_min",
                                                   "autocast_min")}
    passed = sum(r["check"] == "pass" for r in rows)
    ratio = f"{tot['casts'] / tot['autocast_min']:.2f}" if tot["autocast_min"] else "-"
    within = sum(1 for r in rows if _ratio(r) != "inf" and float(_ratio(r)) <= 1.2)
    lines.append(f"| **total ({len(rows)} models)** | {tot['bn']} -> {tot['bn_after']} | {tot['foldable']} "
                 f"| {tot['foldable_left']} | {tot['mm_fp32']}/{tot['mm_total']} "
                 f"| {tot['casts']} ({tot['casts_before']}) | {tot['cast_min']} | {tot['autocast_min']} | {ratio} "
                 f"({within}/{len(rows)} <= 1.2) | {passed}/{len(rows)} pass |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated names (default: all)")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = args.models.split(",") if args.models else list(QUICK if args.quick else MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    fusion, amp = rewrite.load("rules/fusion.rw"), rewrite.load("rules/amp_bf16.rw")
    rows, failed = [], []
    start = time.perf_counter()
    for name in names:
        t0 = time.perf_counter()
        try:
            row = measure(name, fusion, amp)
        except Exception as e:  # noqa: BLE001 - listed with the reason, not counted
            failed.append((name, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"))
            print(f"{name}: FAILED {failed[-1][1]}", flush=True)
            if args.models:
                traceback.print_exc()
            continue
        rows.append(row)
        print(f"{name}: {time.perf_counter() - t0:.1f} s  {row}", flush=True)
    print()
    print(table(rows))
    if failed:
        print("\nNot counted (failed to build or capture):")
        for name, why in failed:
            print(f"- {name}: {why}")
    print(f"\n{len(rows)} models measured, {len(failed)} failed, {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
