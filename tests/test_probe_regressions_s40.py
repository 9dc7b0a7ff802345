"""Session 40's probes and the open items of session 39's (AJ: regressions in the
autocast-block fixes): each test is the behaviour a repro showed failing."""

import threading
import time
import warnings

import torch
import torch.nn as nn

import rewrite
from rewrite.capture import AUTOCAST_OFF_LOST


class _OtherDeviceBlock(nn.Module):
    """Written for a GPU: its autocast block (disabled, or disabled by torch for
    lack of CUDA) says nothing of how the CPU computes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x)
        with torch.autocast("cuda", enabled=False):
            return self.b(h)


def _amp() -> rewrite.RuleSet:
    return rewrite.load(rewrite.rules_dir() / "amp_bf16.rw")


# AJ F2: an autocast block for another device switched the CPU AMP rules off inside it
# (symbolic_trace) or everywhere (the backend), though torch.autocast("cpu") lowers it.
def test_an_autocast_block_for_another_device_leaves_the_cpu_rules_on():
    model, x = _OtherDeviceBlock().eval(), torch.randn(4, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: CUDA is not available, autocast disabled
        result = _amp().apply(model, (x,))
        assert result.counts.get("linear_bf16") == 2
        assert not result.graph_module.meta.get(AUTOCAST_OFF_LOST)
        results = []
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(model, backend=rewrite.backend(_amp(), on_result=results.append))(x)
    assert sum(r.counts.get("linear_bf16", 0) for r in results) == 2


class _Slow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        time.sleep(0.2)  # a long trace, while another thread runs its own blocks
        return self.b(torch.relu(self.a(x)))


# AJ F3: the trace counted another thread's autocast(enabled=False) blocks as the model's.
def test_another_threads_autocast_block_is_not_the_traced_models():
    stop = threading.Event()

    def serving() -> None:
        while not stop.is_set():
            with torch.autocast("cpu", enabled=False):
                time.sleep(0.002)

    thread = threading.Thread(target=serving)
    thread.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no "enabled=False" warning either
            warnings.filterwarnings("ignore", category=rewrite.TrainingModeWarning)
            result = _amp().apply(_Slow().eval(), (torch.randn(4, 16),))
    finally:
        stop.set()
        thread.join()
    assert result.counts.get("linear_bf16") == 2 and not result.graph_module.meta.get(AUTOCAST_OFF_LOST)
