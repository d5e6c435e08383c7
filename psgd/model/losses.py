"""Losses for a hand-written ``loss_and_grads`` (the advanced path): each returns ``(loss, doutputs)``, the loss
averaged over the batch as a 0-d array and its gradient with respect to the outputs.

They are :mod:`psgd.autodiff.nn`'s losses, differentiated once: one arithmetic for both paths.  Written against
``xp`` (NumPy or CuPy); nothing here waits for the GPU: the loss stays on the device until the caller reads it
(``float(loss)``) after the step's backward pass is queued, and labels are not range-checked (that would stall
the GPU too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from psgd.autodiff import Tensor, backward, nn

__all__ = ["softmax_cross_entropy", "mean_squared_error"]


def _with_gradient(loss_of: Callable[[Tensor], Tensor], outputs: Any) -> tuple[Any, Any]:
    leaf = Tensor(outputs, requires_grad=True)
    loss = loss_of(leaf)
    backward(loss)
    return loss.data, leaf.grad


def softmax_cross_entropy(logits: Any, y: Any) -> tuple[Any, Any]:
    """Mean over the batch of ``-log softmax(logits)[y]``; ``y`` holds integer class labels (or a distribution
    over the classes per example).  A shifted log-sum-exp: large logits do not overflow.  The gradient is
    ``(softmax(logits) - onehot(y)) / B``."""
    return _with_gradient(lambda z: nn.cross_entropy(z, y), logits)


def mean_squared_error(outputs: Any, targets: Any, num_classes: int | None = None) -> tuple[Any, Any]:
    """Mean over the batch of ``sum_k (outputs - targets)**2``; gradient ``2 (outputs - targets) / B``.  Integer
    ``targets`` of shape (B,) are class labels, made one-hot rows of ``num_classes`` (default: the outputs'
    width); otherwise ``targets`` must have the outputs' shape."""
    return _with_gradient(lambda o: nn.mse(o, targets, num_classes), outputs)
