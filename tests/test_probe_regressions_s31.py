"""Regressions found by session 31's adversarial probes (shipped rule sets and flows
on models the project had not seen). Each failed before its fix."""

import warnings

import pytest
import torch
import torch.nn as nn

import rewrite
import rewrite.quant as rq


class _ConvDropout(nn.Module):
    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.conv, self.norm, self.drop = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Dropout(0.5)
        self.use_norm = norm

    def forward(self, x):
        y = self.conv(x)
        return self.drop(self.norm(y) if self.use_norm else y)


@pytest.mark.parametrize("norm", [False, True], ids=["conv_dropout", "conv_bn_dropout"])
def test_amp_bf16_backend_in_train_mode_with_symbolic_sizes_keeps_the_dropout_masks(norm):
    # the recompile for batch 4 gives dynamo's symbolic sizes: new nodes' facts are then
    # inferred in the graph's own fake mode (not the tracing context's), and the size of
    # the memory a returned view keeps alive is compared symbolically, so the AMP exit
    # rule gives the conv its layout back before the train-mode dropout
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _ConvDropout(norm).train()
    results = []
    compiled = torch.compile(model, backend=rewrite.backend("rules/amp_bf16.rw", on_result=results.append))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch in (2, 4):
            x = torch.randn(batch, 3, 16, 16)
            torch.manual_seed(1)
            want = model(x)
            torch.manual_seed(1)
            got = compiled(x)
            assert ((got == 0) == (want == 0)).all()  # the same dropout masks
    assert len(results) == 2 and all(r.counts.get("exit_contiguous_bf16") == 1 for r in results), \
        [dict(r.counts) for r in results]
    torch._dynamo.reset()


class _ProductsWithWeights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.w = nn.Parameter(torch.randn(16, 16) / 4)
        self.experts = nn.Parameter(torch.randn(4, 16, 16) / 4)

    def forward(self, x):
        h = self.fc(x)
        a = torch.mm(h, self.w.t())
        b = torch.einsum("bi,oi->bo", h, self.w)
        c = torch.bmm(h.unsqueeze(0).expand(4, -1, -1), self.experts).sum(0)
        return a + b + c


def test_coverage_names_every_product_with_a_constant_weight_left_in_float():
    torch.manual_seed(0)
    model, x = _ProductsWithWeights().eval(), torch.randn(8, 16)
    int8 = rq.quantize(model, [(torch.randn(8, 16),) for _ in range(2)], (x,), capture="export", ruleset="linear")
    cov = rq.coverage(int8)
    assert cov.count("linear") == (1, 4), str(cov)
    assert sorted(f.layer for f in cov.left_float) == ["bmm", "einsum", "mm"], str(cov)


def test_gpt2_exported_with_dynamic_sizes_gets_sdpa():
    # the layout walk re-infers the reshape after attention, which reads the export's
    # sym_size nodes: symbolic ints are facts too (it refused before: unknown)
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64,
                                     use_cache=False, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GPT2Model(config).eval()
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    batch, seq = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("seq", min=2, max=32)
    gm = torch.export.export(model, (ids,), dynamic_shapes=({0: batch, 1: seq},), strict=False).module()
    result = rewrite.load("rules/transformer.rw")["transformer"].apply(gm, (ids,))  # checked
    assert result.counts.get("attention_scale_mask") == 2, dict(result.counts)
    other = torch.randint(0, 100, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(result.graph_module(other)[0], gm(other)[0], rtol=1e-4, atol=1e-5)
