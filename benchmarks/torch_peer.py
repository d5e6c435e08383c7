"""The PyTorch half of ``benchmarks/torch_step.py``: the same networks in PyTorch eager, run by the Python that
has PyTorch (``--torch-python``), never by psgd's.  It imports torch and NumPy only.

    python benchmarks/torch_peer.py NETWORK BATCH

says its facts (one JSON line: parameters, threads, versions), then for each line ``N`` on stdin takes N training
steps (forward, backward, SGD) and says how many seconds they took, until stdin closes.  Exits 2 where torch is
missing or the network is unknown, saying so in one line.
"""

from __future__ import annotations

import json
import sys
import time

try:
    import torch
    from torch import nn
    from torch.nn import functional as F  # noqa: N812 - PyTorch's own name for it
except ImportError:
    torch = None

INPUTS = {
    "mlp-64": (8, 8),
    "mlp-256": (8, 8),
    "mlp-1024": (8, 8),
    "cnn": (1, 8, 8),
    "convnet": (8, 64),
    "gru": (16, 16),
    "transformer": (16, 64),
}


def build(key: str) -> nn.Module:
    """The network ``key`` of ``torch_step.NETWORKS``, shaped as psgd's."""
    if key.startswith("mlp-"):
        width = int(key[4:])
        return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))
    if key == "cnn":  # psgd's built-in CNN: channels (8, 16), kernel 3, hidden 64
        return nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(64, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )
    return {"convnet": ConvNet, "gru": GRUNet, "transformer": TransformerNet}[key]()


if torch is not None:

    class Residual(nn.Module):
        """x + conv(dropout(relu(conv(norm(x))))), the norm over the channels; then a max-pool by 2."""

        def __init__(self, channels: int, rate: float = 0.1):
            super().__init__()
            self.norm = nn.LayerNorm(channels)
            self.conv1 = nn.Conv1d(channels, channels, 3, padding=1)
            self.conv2 = nn.Conv1d(channels, channels, 3, padding=1)
            self.drop = nn.Dropout(rate)

        def forward(self, x):
            h = self.norm(x.transpose(1, 2)).transpose(1, 2)
            h = self.conv2(self.drop(F.relu(self.conv1(h))))
            return F.max_pool1d(x + h, 2)

    class ConvNet(nn.Module):
        """(B, 8, 64) -> a stem convolution to 32 channels -> two residual blocks -> the mean over length -> 10."""

        def __init__(self):
            super().__init__()
            self.stem = nn.Conv1d(8, 32, 5, padding=2)
            self.block0, self.block1 = Residual(32), Residual(32)
            self.head = nn.Linear(32, 10)

        def forward(self, x):
            x = self.block1(self.block0(F.relu(self.stem(x))))
            return self.head(x.mean(dim=2))

    class GRUNet(nn.Module):
        """(B, 16 steps, 16) -> ``nn.GRU`` (hidden 64, PyTorch's own loop over the steps) -> the last step -> 10."""

        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(16, 64, batch_first=True)
            self.head = nn.Linear(64, 10)

        def forward(self, x):
            return self.head(self.rnn(x)[0][:, -1])

    class TransformerNet(nn.Module):
        """(B, 16, 64) -> x + attention(norm(x)), 4 heads -> x + mlp(norm(x)), hidden 128 -> the mean -> 10."""

        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(64), nn.LayerNorm(64)
            self.attend = nn.MultiheadAttention(64, 4, batch_first=True)
            self.up, self.down = nn.Linear(64, 128), nn.Linear(128, 64)
            self.head = nn.Linear(64, 10)

        def forward(self, x):
            h = self.norm1(x)
            x = x + self.attend(h, h, h, need_weights=False)[0]
            x = x + self.down(F.relu(self.up(self.norm2(x))))
            return self.head(x.mean(dim=1))


def serve(key: str, batch: int) -> None:
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    torch.manual_seed(0)
    net = build(key).train()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn((batch,) + INPUTS[key])
    y = torch.randint(0, 10, (batch,))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        optimizer.step()

    step()
    print(
        json.dumps(
            {
                "parameters": sum(p.numel() for p in net.parameters()),
                "threads": torch.get_num_threads(),
                "version": f"torch {torch.__version__}",
            }
        ),
        flush=True,
    )
    for line in sys.stdin:
        n = int(line)
        began = time.perf_counter()
        for _ in range(n):
            step()
        print(time.perf_counter() - began, flush=True)


def main(argv: list[str]) -> int:
    if torch is None:
        print(
            f"torch_peer: no PyTorch for {sys.executable} (pip install torch numpy in its environment)", file=sys.stderr
        )
        return 2
    if len(argv) != 2 or argv[0] not in INPUTS or not argv[1].isdigit():
        print(f"torch_peer: usage: torch_peer.py NETWORK BATCH, NETWORK one of {', '.join(INPUTS)}", file=sys.stderr)
        return 2
    serve(argv[0], int(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
