# rowgru.py: a 1-D convolution and a GRU that read psgd's digits one row at a time: only its forward pass
from psgd.autodiff import ops
from psgd.model import RNN, Conv1d, GRUCell, Linear, Network


class RowGRU(Network):
    """Each 8x8 digit as a signal of 8 steps (its rows) of 8 values (its columns): a convolution along the steps,
    a GRU over them, then the class scores from the GRU's last state."""

    def __init__(self, input_shape, num_classes, dtype="float32", channels=16, hidden=32):
        super().__init__(dtype)
        steps, width = input_shape  # (8, 8) for the digits
        self.conv = Conv1d(width, int(channels), kernel=3)  # 'same': as many steps out as in
        self.rnn = RNN(GRUCell(int(channels), int(hidden)))
        self.head = Linear(int(hidden), num_classes, init="glorot_uniform")

    def forward(self, x):
        h = ops.relu(self.conv(ops.transpose(x, (0, 2, 1))))  # Conv1d takes (batch, channels, steps)
        states = self.rnn(ops.transpose(h, (0, 2, 1)))  # RNN takes (batch, steps, features): (batch, 8, hidden)
        return self.head(states[:, -1])  # what the GRU holds after the last row
