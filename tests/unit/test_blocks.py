"""The sequence and signal modules (Conv1d, GRUCell and LSTMCell run by RNN, MultiHeadAttention) in a network:
shapes as documented, PyTorch's conventions where it has them, and the network's gradients against central
differences in float64 (psgd's own model check, in full); ``get_array_module`` of a tensor of the tape."""

from __future__ import annotations

import numpy as np
import pytest

from psgd.autodiff import Tensor, nn, ops
from psgd.model import (
    RNN,
    AvgPool1d,
    Conv1d,
    GRUCell,
    LSTMCell,
    MaxPool1d,
    ModelError,
    MultiHeadAttention,
    Network,
    check_model,
    get_array_module,
)

T, FEATURES, CLASSES = 6, 4, 3


class SignalNet(Network):
    """(B, T, features): a convolution along time, a GRU and an LSTM over it, attention, a dense head."""

    def __init__(self, input_shape=(T, FEATURES), num_classes=CLASSES, dtype="float64", causal=True):
        super().__init__(dtype)
        self.conv = Conv1d(FEATURES, 4, kernel=3, dilation=2)
        self.strided = Conv1d(4, 4, kernel=2, stride=2, padding=1, groups=2)
        self.gru = RNN(GRUCell(4, 5))
        self.lstm = RNN(LSTMCell(5, 4))
        self.attend = MultiHeadAttention(4, heads=2, causal=causal)
        self.head = Conv1d(4, num_classes, kernel=1, padding="valid")

    def forward(self, x):
        h = ops.tanh(self.conv(ops.transpose(x, (0, 2, 1))))  # (B, 4, T)
        h = ops.add(h[:, :, :T], ops.tanh(self.strided(h))[:, :, :1])
        h = self.lstm(self.gru(ops.transpose(h, (0, 2, 1))))  # (B, T, 4)
        h = ops.add(h, self.attend(h))
        return ops.mean(self.head(ops.transpose(h, (0, 2, 1))), axis=-1)


@pytest.mark.parametrize("causal", [True, False])
def test_a_network_of_the_sequence_modules_passes_the_model_check_in_full(causal):
    net = SignalNet(causal=causal)
    assert [s.name for s in net.specs()][:6] == [
        "conv/W",
        "conv/b",
        "strided/W",
        "strided/b",
        "gru/cell/w_ih",
        "gru/cell/w_hh",
    ]
    checks = check_model(net, (T, FEATURES), CLASSES, "float64", budget=None)
    assert any(c.status == "ok" and "central differences in float64" in " ".join(c.lines) for c in checks), checks


def test_the_modules_shapes_and_conventions():
    x = np.random.default_rng(0).standard_normal((2, 5, 7))
    conv = Conv1d(5, 6, kernel=3)
    net = Network("float64")
    net.conv, net.gru, net.lstm = conv, RNN(GRUCell(7, 3)), RNN(LSTMCell(7, 2))
    net.attend = MultiHeadAttention(7, heads=1, causal=True)
    params = net.init(1)
    with net._binding(params, training=False):
        assert conv(x).shape == (2, 6, 7)  # 'same'
        assert net.gru(x).shape == (2, 5, 3) and net.lstm(x).shape == (2, 5, 2)  # batch first
        out = net.attend(x).data
        changed = x.copy()
        changed[:, -1] += 1.0  # causal: the last step changes nothing before it
        np.testing.assert_array_equal(net.attend(changed).data[:, :-1], out[:, :-1])
    assert params["gru/cell/w_ih"].shape == (7, 9) and params["lstm/cell/w_hh"].shape == (2, 8)
    windows = x[:, :, :6].reshape(2, 5, 3, 2)  # pooled by 2 along the last axis, the odd last position cropped
    np.testing.assert_array_equal(MaxPool1d(2)(x).data, windows.max(axis=-1))
    np.testing.assert_allclose(AvgPool1d(2)(x).data, windows.mean(axis=-1))
    with pytest.raises(ModelError, match="odd kernel"):
        Conv1d(2, 2, kernel=2)
    with pytest.raises(ModelError, match="heads must divide"):
        MultiHeadAttention(6, heads=4)


def test_the_lstm_cell_is_pytorchs_gate_for_gate():
    """c' = f c + i g, h' = o tanh(c'), the gates in the order input, forget, cell, output."""
    rng = np.random.default_rng(1)
    x, h, c = rng.standard_normal((2, 3)), rng.standard_normal((2, 4)), rng.standard_normal((2, 4))
    w_ih, w_hh, b = rng.standard_normal((3, 16)), rng.standard_normal((4, 16)), rng.standard_normal(16)
    a = x @ w_ih + h @ w_hh + b

    def sig(v):
        return 1 / (1 + np.exp(-v))

    i, f, g, o = sig(a[:, :4]), sig(a[:, 4:8]), np.tanh(a[:, 8:12]), sig(a[:, 12:])
    h2, c2 = nn.lstm_cell(x, h, c, w_ih, w_hh, b, None)
    np.testing.assert_allclose(c2.data, f * c + i * g, rtol=1e-12)
    np.testing.assert_allclose(h2.data, o * np.tanh(f * c + i * g), rtol=1e-12)


def test_the_gru_cell_is_pytorchs_gate_for_gate():
    """r and z from both products, n = tanh(xn + r hn) with hn's bias inside, h' = (1 - z) n + z h."""
    rng = np.random.default_rng(2)
    x, h = rng.standard_normal((2, 3)), rng.standard_normal((2, 4))
    w_ih, w_hh, b_ih, b_hh = (rng.standard_normal(s) for s in ((3, 12), (4, 12), 12, 12))
    gi, gh = x @ w_ih + b_ih, h @ w_hh + b_hh
    r, z = (1 / (1 + np.exp(-(gi[:, k : k + 4] + gh[:, k : k + 4]))) for k in (0, 4))
    n = np.tanh(gi[:, 8:] + r * gh[:, 8:])
    np.testing.assert_allclose(nn.gru_cell(x, h, w_ih, w_hh, b_ih, b_hh).data, (1 - z) * n + z * h, rtol=1e-12)


def test_get_array_module_takes_a_tensor_of_the_tape_as_well_as_an_array():
    assert get_array_module(Tensor(np.zeros(2))) is np
    assert get_array_module(np.zeros(2), Tensor(np.ones(1)), 3.0) is np
