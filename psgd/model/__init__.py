"""Models: the protocol, the built-in networks and loading a user model by name.

A network is written as its forward pass (:class:`Network`, :mod:`psgd.model.module`): psgd derives its gradients.
``build_model("mlp", (784,), 10, hidden=(256,))`` builds a built-in network;
``build_model("mypkg.nets:ResNetish", ...)`` imports ``mypkg.nets`` and builds
its ``ResNetish`` class.  Every failure is a one-line :class:`ModelError`.
``check_model(model, input_shape, num_classes, dtype)`` checks a built model
before training (see :mod:`psgd.model.check`).
"""

from __future__ import annotations

from psgd.autodiff.tensor import array_module as get_array_module
from psgd.model.base import (
    INITIALIZERS,
    BaseModel,
    Model,
    VarSpec,
    VarSpecError,
    hands_over_gradients,
    init_variable,
    model_tables,
)
from psgd.model.blocks import (
    RNN,
    AvgPool1d,
    AvgPool2d,
    BatchNorm,
    Conv1d,
    Conv2d,
    Dropout,
    Flatten,
    Function,
    GRUCell,
    LayerNorm,
    Linear,
    LSTMCell,
    MaxPool1d,
    MaxPool2d,
    MultiHeadAttention,
    ReLU,
)
from psgd.model.check import Check, check_model, run_checks
from psgd.model.errors import ModelError
from psgd.model.module import Module, Network, Parameter, Sequential, State, Table
from psgd.model.nets import CNN, MLP, SoftmaxRegression
from psgd.model.registry import MODELS, build_model, load_model_class

__all__ = [
    "VarSpec",
    "Model",
    "BaseModel",
    "init_variable",
    "ModelError",
    "VarSpecError",
    "INITIALIZERS",
    "build_model",
    "MODELS",
    "load_model_class",
    "SoftmaxRegression",
    "MLP",
    "CNN",
    "check_model",
    "run_checks",
    "Check",
    "hands_over_gradients",
    "model_tables",
    "Network",
    "Module",
    "Parameter",
    "State",
    "Table",
    "Sequential",
    "Function",
    "Linear",
    "Conv1d",
    "Conv2d",
    "GRUCell",
    "LSTMCell",
    "RNN",
    "MultiHeadAttention",
    "LayerNorm",
    "BatchNorm",
    "Dropout",
    "ReLU",
    "Flatten",
    "MaxPool1d",
    "AvgPool1d",
    "MaxPool2d",
    "AvgPool2d",
    "get_array_module",
]
