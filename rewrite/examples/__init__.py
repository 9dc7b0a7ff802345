"""Example models and capture helpers shared by tests, benchmarks and the README demo.

Everything here builds from code or configs with random weights: nothing is
downloaded. ``rewrite.examples.hf`` imports ``transformers`` lazily, so
importing this package does not require it.
"""

from rewrite.capture import LEVELS, capture, capture_with_inputs
from rewrite.examples.cnn import (
    DemoCNN,
    ResNet,
    demo_cnn,
    demo_cnn_with_inputs,
    randomize_batchnorm,
    resnet18,
    resnet18_with_inputs,
    resnet50,
    resnet50_with_inputs,
    resnet_tiny,
    resnet_tiny_with_inputs,
)

__all__ = [
    "LEVELS", "capture", "capture_with_inputs", "DemoCNN", "ResNet", "demo_cnn", "demo_cnn_with_inputs",
    "randomize_batchnorm", "resnet18", "resnet18_with_inputs", "resnet50",
    "resnet50_with_inputs", "resnet_tiny", "resnet_tiny_with_inputs",
]
