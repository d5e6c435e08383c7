"""Reverse-mode automatic differentiation over the job's array module (NumPy on a CPU, CuPy on a GPU): a network's
forward pass written with these operations, and its gradients derived from it.

- :mod:`psgd.autodiff.tensor`: :class:`Tensor`, the tape, :func:`backward` and :func:`no_grad`.
- :mod:`psgd.autodiff.ops`: arithmetic with broadcasting, matmul, reductions, shapes, indexing, elementwise
  functions.
- :mod:`psgd.autodiff.nn`: dense layers, softmax and the losses, convolution, pooling, normalization, dropout,
  embedding lookups.

It knows nothing of models, shards, links or jobs; models use it (psgd.model).
"""

from psgd.autodiff import nn, ops  # (ops gives Tensor its operators)
from psgd.autodiff.tensor import Tensor, backward, no_grad, recording

__all__ = ["Tensor", "backward", "no_grad", "recording", "ops", "nn"]
