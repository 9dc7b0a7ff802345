"""``transformers`` models built from small configs with random weights.

These are the "models from outside" of the design: architectures this project
did not write, built offline (``Model(config)`` downloads nothing). Each
builder returns ``(model, example_inputs)`` in eval mode, the CLI's
``module:callable`` convention. ``transformers`` is imported inside the
functions so that ``rewrite.examples`` works without it.

Capture (torch 2.13, transformers 5.x), recorded in ``CAPTURE_LEVELS``:
every model captures with ``torch.export.export(model, args, strict=False)``
(level ``export``) and with ``torch.compile`` (level ``dynamo``); all but
GPT2Model survive ``ep.run_decompositions()`` (level ``export_core``: for
GPT-2 it fails inside torch with "Cannot view a tensor with shape [2, 8, 32]
and strides (32, 64, 1) as a tensor with shape (16, 32)" while retracing the
attention's ``Conv1D``). None of them captures with
``torch.fx.symbolic_trace``: their forwards branch on tensor shapes, iterate
over proxies or assign into proxies, and transformers 5 removed its own
``transformers.utils.fx`` tracer.

Convolutional models get random BatchNorm statistics (see
``rewrite.examples.cnn.randomize_batchnorm``) so that folding is really tested.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import torch
from torch import nn

from rewrite.examples.cnn import own_random_stream, randomize_batchnorm

__all__ = [
    "CAPTURE_LEVELS",
    "MODELS",
    "hf_resnet",
    "hf_convnext",
    "hf_mobilenet_v2",
    "hf_bert",
    "hf_gpt2",
    "bert_base",
]

_ALL_BUT_FX = ("export", "export_core", "dynamo")

#: builder name -> capture levels (see ``rewrite.capture``) that work for it.
CAPTURE_LEVELS: Dict[str, Tuple[str, ...]] = {
    "hf_resnet": _ALL_BUT_FX,
    "hf_convnext": _ALL_BUT_FX,
    "hf_mobilenet_v2": _ALL_BUT_FX,
    "hf_bert": _ALL_BUT_FX,
    "hf_gpt2": ("export", "dynamo"),
    "bert_base": _ALL_BUT_FX,
}

Built = Tuple[nn.Module, Tuple[Any, ...]]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _finish(model: nn.Module, seed: int) -> nn.Module:
    randomize_batchnorm(model, seed)
    return model.eval()


def _pixels(batch: int, size: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=_gen(seed))


def _tokens(batch: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=_gen(seed))


@own_random_stream
def hf_resnet(batch: int = 1, size: int = 64, seed: int = 0) -> Built:
    """``ResNetModel`` (bottleneck, one block per stage, widths 16..128): 16 conv+BN pairs
    (the first stage keeps its width, so it has no shortcut conv)."""
    from transformers import ResNetConfig, ResNetModel

    torch.manual_seed(seed)
    config = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128],
                          depths=[1, 1, 1, 1], layer_type="bottleneck")
    return _finish(ResNetModel(config), seed), (_pixels(batch, size, seed),)


@own_random_stream
def hf_convnext(batch: int = 1, size: int = 64, seed: int = 0) -> Built:
    """``ConvNextModel`` (widths 16..128, one block per stage): LayerNorm only, no BN."""
    from transformers import ConvNextConfig, ConvNextModel

    torch.manual_seed(seed)
    config = ConvNextConfig(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1])
    return _finish(ConvNextModel(config), seed), (_pixels(batch, size, seed),)


@own_random_stream
def hf_mobilenet_v2(batch: int = 1, size: int = 64, seed: int = 0) -> Built:
    """``MobileNetV2Model`` at depth multiplier 0.35: depthwise convs, every BN after a conv."""
    from transformers import MobileNetV2Config, MobileNetV2Model

    torch.manual_seed(seed)
    config = MobileNetV2Config(depth_multiplier=0.35, image_size=size)
    return _finish(MobileNetV2Model(config), seed), (_pixels(batch, size, seed),)


@own_random_stream
def _bert(config_kwargs: Dict[str, Any], batch: int, seq: int, seed: int) -> Built:
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(**config_kwargs)
    model = BertModel(config).eval()
    ids = _tokens(batch, seq, config.vocab_size, seed)
    return model, (ids,)


def hf_bert(batch: int = 2, seq: int = 8, seed: int = 0) -> Built:
    """``BertModel``, 2 layers, hidden 32, vocab 100; input: token ids (batch, seq)."""
    return _bert(dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, vocab_size=100, max_position_embeddings=64),
                 batch, seq, seed)


def bert_base(batch: int = 1, seq: int = 128, seed: int = 0) -> Built:
    """``BertModel`` with the bert-base-uncased config (12 layers, hidden 768), random weights."""
    return _bert(dict(), batch, seq, seed)


@own_random_stream
def hf_gpt2(batch: int = 2, seq: int = 8, seed: int = 0) -> Built:
    """``GPT2Model`` (``use_cache=False``), 2 layers, n_embd 32, vocab 100; input: token ids."""
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(seed)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64,
                        use_cache=False, bos_token_id=0, eos_token_id=0)
    model = GPT2Model(config).eval()
    return model, (_tokens(batch, seq, config.vocab_size, seed),)


@own_random_stream
def hf_vit(batch: int = 1, size: int = 32, seed: int = 0) -> Built:
    """``ViTModel``, 2 layers, hidden 32, 8x8 patches; input: pixels (batch, 3, size, size)."""
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(seed)
    config = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                       image_size=size, patch_size=8)
    return ViTModel(config).eval(), (_pixels(batch, size, seed),)


#: name -> builder, for parametrized tests and the CLI.
MODELS: Dict[str, Callable[..., Built]] = {
    "hf_resnet": hf_resnet,
    "hf_convnext": hf_convnext,
    "hf_mobilenet_v2": hf_mobilenet_v2,
    "hf_bert": hf_bert,
    "hf_gpt2": hf_gpt2,
    "hf_vit": hf_vit,
}
