# resnet.py: a small residual CNN with batch norm, for psgd's digits: only its forward pass
from psgd.autodiff import ops
from psgd.model import BatchNorm, Conv2d, Dropout, Linear, Module, Network


class Residual(Module):
    """relu(x + bn(conv(relu(bn(conv(x)))))): a residual block that keeps the channels and the size."""

    def __init__(self, channels):
        super().__init__()
        self.conv1, self.bn1 = Conv2d(channels, channels, bias=False), BatchNorm(channels)
        self.conv2, self.bn2 = Conv2d(channels, channels, bias=False), BatchNorm(channels)

    def forward(self, x):
        h = ops.relu(self.bn1(self.conv1(x)))
        return ops.relu(x + self.bn2(self.conv2(h)))


class ResNet(Network):
    """A stem convolution, residual blocks, the average over the image, dropout, then the class scores."""

    def __init__(self, input_shape, num_classes, dtype="float32", channels=16, blocks=2, dropout=0.1):
        super().__init__(dtype)
        self.stem, self.bn = Conv2d(1, channels, bias=False), BatchNorm(channels)
        for i in range(int(blocks)):
            setattr(self, f"block{i}", Residual(channels))
        self.blocks = int(blocks)
        self.drop, self.head = Dropout(dropout), Linear(channels, num_classes, init="glorot_uniform")

    def forward(self, x):
        x = ops.relu(self.bn(self.stem(x.reshape(len(x), 1, *x.shape[1:]))))  # (batch, channels, 8, 8)
        for i in range(self.blocks):
            x = getattr(self, f"block{i}")(x)
        return self.head(self.drop(x.mean(axis=(2, 3))))
