"""Hand-written CNNs for tests, benchmarks and the README demo.

The ResNets reproduce torchvision's module layout exactly (``conv1``, ``bn1``,
``layer1.0.downsample.0`` ...) so that graphs, state-dict keys and fusion counts
can be compared with what users see on real torchvision models, without
depending on torchvision (it is not installed here).

Every factory returns a model in eval mode whose BatchNorm layers carry
non-trivial statistics (random running mean/var, weight and bias): with the
default statistics (mean 0, var 1, weight 1, bias 0) BN is almost the identity
and a wrong fold would go unnoticed.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence, Tuple, Type, Union

import torch
from torch import nn
import torch.nn.functional as F


def own_random_stream(build: Callable) -> Callable:
    """Run a model factory on a fork of torch's random stream: it seeds the stream to
    make the same weights every time, and the caller's stream is left as it was."""
    @functools.wraps(build)
    def built(*args: Any, **kwargs: Any) -> Any:
        with torch.random.fork_rng(devices=[]):
            return build(*args, **kwargs)

    return built

__all__ = [
    "BasicBlock",
    "Bottleneck",
    "ResNet",
    "DemoCNN",
    "randomize_batchnorm",
    "resnet18",
    "resnet50",
    "resnet_tiny",
    "resnet18_with_inputs",
    "resnet50_with_inputs",
    "resnet_tiny_with_inputs",
    "demo_cnn",
    "demo_cnn_with_inputs",
]

_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def randomize_batchnorm(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every BatchNorm random, well-conditioned statistics and affine params.

    Variances are kept in [0.5, 1.5] and weights around 1 so that folded and
    unfolded graphs stay numerically comparable through 50 layers.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, _BN):
                n = m.num_features
                if m.running_mean is not None:
                    m.running_mean.copy_(torch.randn(n, generator=gen) * 0.1)
                    m.running_var.copy_(torch.rand(n, generator=gen) + 0.5)
                if m.affine:
                    m.weight.copy_(torch.rand(n, generator=gen) * 0.5 + 0.75)
                    m.bias.copy_(torch.randn(n, generator=gen) * 0.1)
    return model


def _conv3x3(cin: int, cout: int, stride: int = 1, groups: int = 1, dilation: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=dilation,
                     groups=groups, bias=False, dilation=dilation)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """torchvision.models.resnet.BasicBlock (ResNet-18/34)."""

    expansion: int = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: Optional[nn.Module] = None, groups: int = 1,
                 base_width: int = 64, dilation: int = 1) -> None:
        super().__init__()
        self.conv1 = _conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class Bottleneck(nn.Module):
    """torchvision.models.resnet.Bottleneck (ResNet-50 v1.5: stride on conv2)."""

    expansion: int = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: Optional[nn.Module] = None, groups: int = 1,
                 base_width: int = 64, dilation: int = 1) -> None:
        super().__init__()
        width = int(planes * (base_width / 64.0)) * groups
        self.conv1 = _conv1x1(inplanes, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width, stride, groups, dilation)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv1x1(width, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        out = self.relu(out)
        out = self.conv3(out)
        out = self.bn3(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class ResNet(nn.Module):
    """torchvision.models.resnet.ResNet, with configurable stage widths.

    ``widths`` defaults to torchvision's (64, 128, 256, 512); the stem width is
    ``widths[0]``. Smaller widths give the same graph structure at a fraction
    of the cost, which is what the fast tests want.
    """

    def __init__(self, block: Type[Union[BasicBlock, Bottleneck]], layers: Sequence[int],
                 num_classes: int = 1000, widths: Sequence[int] = (64, 128, 256, 512)) -> None:
        super().__init__()
        self.inplanes = widths[0]
        self.dilation = 1
        self.groups = 1
        self.base_width = 64
        self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, widths[0], layers[0])
        self.layer2 = self._make_layer(block, widths[1], layers[1], stride=2)
        self.layer3 = self._make_layer(block, widths[2], layers[2], stride=2)
        self.layer4 = self._make_layer(block, widths[3], layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[3] * block.expansion, num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _make_layer(self, block, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                _conv1x1(self.inplanes, planes * block.expansion, stride),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers = [block(self.inplanes, planes, stride, downsample, self.groups,
                        self.base_width, self.dilation)]
        self.inplanes = planes * block.expansion
        for _ in range(1, blocks):
            layers.append(block(self.inplanes, planes, groups=self.groups,
                                base_width=self.base_width, dilation=self.dilation))
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        x = self.maxpool(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.fc(x)
        return x


def _finish(model: nn.Module, seed: int) -> nn.Module:
    randomize_batchnorm(model, seed)
    return model.eval()


@own_random_stream
def resnet50(seed: int = 0, num_classes: int = 1000) -> ResNet:
    """ResNet-50 (Bottleneck, [3, 4, 6, 3]): 53 conv+bn pairs, eval mode, random BN stats."""
    torch.manual_seed(seed)
    return _finish(ResNet(Bottleneck, [3, 4, 6, 3], num_classes=num_classes), seed)


@own_random_stream
def resnet18(seed: int = 0, num_classes: int = 1000) -> ResNet:
    """ResNet-18 (BasicBlock, [2, 2, 2, 2]): 20 conv+bn pairs."""
    torch.manual_seed(seed)
    return _finish(ResNet(BasicBlock, [2, 2, 2, 2], num_classes=num_classes), seed)


@own_random_stream
def resnet_tiny(seed: int = 0, num_classes: int = 10) -> ResNet:
    """Bottleneck ResNet with one block per stage and widths (8, 16, 32, 64).

    Same structure as ResNet-50 (each stage's first block has a downsample),
    so 1 + 4 * 4 = 17 conv+bn pairs, but runs in milliseconds.
    """
    torch.manual_seed(seed)
    return _finish(ResNet(Bottleneck, [1, 1, 1, 1], num_classes=num_classes,
                          widths=(8, 16, 32, 64)), seed)


def _image(batch: int, size: int, seed: int, channels: int = 3) -> torch.Tensor:
    return torch.randn(batch, channels, size, size, generator=torch.Generator().manual_seed(seed))


def resnet50_with_inputs(batch: int = 1, size: int = 224, seed: int = 0) -> Tuple[nn.Module, Tuple[torch.Tensor]]:
    """``(resnet50(), (x,))`` with x of shape (batch, 3, size, size)."""
    return resnet50(seed), (_image(batch, size, seed),)


def resnet18_with_inputs(batch: int = 1, size: int = 224, seed: int = 0) -> Tuple[nn.Module, Tuple[torch.Tensor]]:
    """``(resnet18(), (x,))`` with x of shape (batch, 3, size, size)."""
    return resnet18(seed), (_image(batch, size, seed),)


def resnet_tiny_with_inputs(batch: int = 2, size: int = 32, seed: int = 0) -> Tuple[nn.Module, Tuple[torch.Tensor]]:
    """``(resnet_tiny(), (x,))`` with x of shape (batch, 3, size, size)."""
    return resnet_tiny(seed), (_image(batch, size, seed),)


class DemoCNN(nn.Module):
    """A small network touching every case the fusion rules should handle.

    Foldable (``FOLDABLE`` = 6 pairs):
      * ``conv2d -> bn`` with conv bias (``conv_a``/``bn_a``)
      * ``conv2d -> bn`` without conv bias (``conv_b``/``bn_b``)
      * ``conv1d -> bn1d`` (``conv1d``/``bn1d``)
      * ``conv3d -> bn3d`` (``conv3d``/``bn3d``)
      * ``conv_transpose2d -> bn`` (``deconv``/``bn_deconv``)
      * ``linear -> BatchNorm1d`` (``fc1``/``bn_fc``)
    Not foldable (must be left alone; ``UNFOLDABLE`` = 1):
      * ``bn_shared`` follows ``conv_c`` whose output has a second user (the
        residual add), so folding would change the other user's value.
    Removable in eval mode: ``nn.Dropout`` (``drop``) and ``nn.Identity`` (``ident``).
    """

    FOLDABLE = 6
    UNFOLDABLE = 1

    def __init__(self) -> None:
        super().__init__()
        self.conv_a = nn.Conv2d(3, 8, 3, padding=1, bias=True)
        self.bn_a = nn.BatchNorm2d(8)
        self.conv_b = nn.Conv2d(8, 8, 3, padding=1, stride=2, bias=False)
        self.bn_b = nn.BatchNorm2d(8)
        self.conv_c = nn.Conv2d(8, 8, 1, bias=False)
        self.bn_shared = nn.BatchNorm2d(8)
        self.deconv = nn.ConvTranspose2d(8, 4, 2, stride=2, bias=True)
        self.bn_deconv = nn.BatchNorm2d(4)
        self.ident = nn.Identity()
        self.conv1d = nn.Conv1d(4, 6, 3, padding=1)
        self.bn1d = nn.BatchNorm1d(6)
        self.conv3d = nn.Conv3d(1, 2, 3, padding=1, bias=False)
        self.bn3d = nn.BatchNorm3d(2)
        self.drop = nn.Dropout(0.25)
        self.fc1 = nn.Linear(6 * 4 + 2 * 4, 16)
        self.bn_fc = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # 2d path: (N, 3, 8, 8)
        y = F.relu(self.bn_a(self.conv_a(x)))
        y = F.relu(self.bn_b(self.conv_b(y)))            # (N, 8, 4, 4)
        c = self.conv_c(y)
        y = self.bn_shared(c) + c                        # conv output used twice
        y = self.ident(self.bn_deconv(self.deconv(y)))   # (N, 4, 8, 8)
        # 1d path: treat rows as a sequence
        s = y.mean(dim=3)                                # (N, 4, 8)
        s = F.relu(self.bn1d(self.conv1d(s)))            # (N, 6, 8)
        s = F.adaptive_avg_pool1d(s, 4).flatten(1)       # (N, 24)
        # 3d path: treat channels as depth
        v = y[:, :1].unsqueeze(1)                        # (N, 1, 1, 8, 8)
        v = self.bn3d(self.conv3d(v))                    # (N, 2, 1, 8, 8)
        v = F.adaptive_avg_pool3d(v, (1, 2, 2)).flatten(1)  # (N, 8)
        h = self.drop(torch.cat([s, v], dim=1))          # (N, 32)
        h = F.relu(self.bn_fc(self.fc1(h)))
        return self.fc2(h)


@own_random_stream
def demo_cnn(seed: int = 0) -> DemoCNN:
    """The demo network, eval mode, random BN statistics."""
    torch.manual_seed(seed)
    return _finish(DemoCNN(), seed)


def demo_cnn_with_inputs(batch: int = 2, seed: int = 0) -> Tuple[nn.Module, Tuple[torch.Tensor]]:
    """``(demo_cnn(), (x,))`` with x of shape (batch, 3, 8, 8): the CLI's ``module:callable`` form."""
    return demo_cnn(seed), (_image(batch, 8, seed),)
