"""Regressions found in session 48 by adversarial probes (each test's docstring
says what failed before)."""

import copy

import pytest
import torch
import torch.nn as nn

import rewrite


class _ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        return torch.relu(self.bn(self.c(x)))


@pytest.fixture
def inductor_freezing():
    import torch._inductor.config as inductor_config

    before = inductor_config.freezing
    inductor_config.freezing = True
    torch._dynamo.reset()
    try:
        yield
    finally:
        inductor_config.freezing = before
        torch._dynamo.reset()


def test_backend_sees_parameter_writes_under_inductor_freezing(inductor_freezing):
    """With ``torch._inductor.config.freezing = True`` dynamo hands the backend the
    parameters inside the graph (``get_attr``), not as inputs: the backend folded
    them once and kept the first weights after ``load_state_dict``, an in-place
    write and ``p.data = ...`` (errors of 2 to 21, no warning; probe CD F1)."""
    model = _ConvBN().eval()
    reference = copy.deepcopy(model)
    results = []
    compiled = torch.compile(model, backend=rewrite.backend(rewrite.load("rules/fusion.rw"),
                                                            on_result=results.append))
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), reference(x))
        assert results[0].counts and sum(results[0].counts.values()) >= 1  # the batch norm folded
        state = _ConvBN().state_dict()
        model.load_state_dict(state)
        reference.load_state_dict(state)
        torch.testing.assert_close(compiled(x), reference(x))
        model.c.weight.mul_(2)
        reference.c.weight.mul_(2)
        torch.testing.assert_close(compiled(x), reference(x))
        new = torch.randn_like(model.c.weight)
        model.c.weight.data = new
        reference.c.weight.data = new.clone()
        torch.testing.assert_close(compiled(x), reference(x))
    assert len(results) == 4  # rewritten again for each change, not fallen back
