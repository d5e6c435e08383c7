"""Losses: each returns ``(loss, doutputs)``, the loss averaged over the batch as a 0-d array.

Written against ``xp`` (NumPy or CuPy); labels are moved to the outputs' array
module.  Nothing here waits for the GPU: the loss stays on the device until
the caller reads it (``float(loss)``) after the step's backward pass is queued,
and labels are not range-checked (that would stall the GPU too).
"""

from __future__ import annotations

from typing import Any

from psgd import kernels
from psgd.xp import get_array_module


def softmax_cross_entropy(logits: Any, y: Any) -> tuple[float, Any]:
    """Mean over the batch of ``-log softmax(logits)[y]``; ``y`` holds integer class labels.

    Uses a shifted log-sum-exp, so large logits do not overflow.  The gradient
    is ``(softmax(logits) - onehot(y)) / B``.
    """
    xp = get_array_module(logits)
    y = xp.asarray(y)
    batch = logits.shape[0]
    if logits.ndim != 2 or y.shape != (batch,):
        raise ValueError(f"softmax_cross_entropy: need logits (B, K) and labels (B,), got {logits.shape} and {y.shape}")
    fused = kernels.softmax_xent(logits, y)  # on a GPU: one kernel a row, then the sum
    if fused is not None:
        return fused
    z = logits - logits.max(axis=1, keepdims=True)
    e = xp.exp(z)
    total = e.sum(axis=1, keepdims=True)
    # a one-hot mask rather than fancy indexing: a few elementwise kernels, no gather or scatter
    hot = xp.arange(logits.shape[1]) == y[:, None]
    loss = (xp.log(total).sum() - (z * hot).sum()) / batch  # mean of log(sum exp z) - z[y]
    return loss, (e / total - hot) / batch


def one_hot(y: Any, num_classes: int, dtype: Any) -> Any:
    """(B,) integer labels -> (B, num_classes) one-hot rows in ``dtype``."""
    xp = get_array_module(y)
    return (xp.arange(num_classes) == y[:, None]).astype(dtype)


def mean_squared_error(outputs: Any, targets: Any, num_classes: int | None = None) -> tuple[float, Any]:
    """Mean over the batch of ``sum_k (outputs - targets)**2``; gradient ``2 (outputs - targets) / B``.

    Integer ``targets`` of shape (B,) are class labels and become one-hot rows
    of width ``num_classes`` (default: the outputs' width); otherwise
    ``targets`` must have the outputs' shape.
    """
    xp = get_array_module(outputs)
    targets = xp.asarray(targets)
    batch = outputs.shape[0]
    if targets.ndim == 1 and targets.dtype.kind in "iu":
        targets = one_hot(targets, num_classes or outputs.shape[-1], outputs.dtype)
    if targets.shape != outputs.shape:
        raise ValueError(f"mean_squared_error: outputs {outputs.shape} and targets {targets.shape} differ")
    diff = outputs - targets.astype(outputs.dtype, copy=False)
    return (diff * diff).sum() / batch, diff * (2.0 / batch)
