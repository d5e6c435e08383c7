"""Fused steps: one CUDA kernel each on CuPy, the same arithmetic as NumPy ufuncs on the CPU; matrix products
through cuBLAS called directly, so that a step can be captured as a CUDA graph.

A training step on a GPU is bound by how fast the CPU launches kernels when the model is small (each CuPy call
costs 10-60 µs of Python and driver; the matrix products of a 1024-wide MLP take less).  So the elementwise
tails of a step are one kernel each here: a dense layer's bias with its ReLU, the ReLU's gradient, softmax
cross-entropy with its gradient, and each optimizer's whole update.

Each function takes NumPy or CuPy arrays.  On NumPy it runs the ufuncs in the order the kernel does its
arithmetic; on CuPy the kernel is compiled without contracting a multiply and an add into one instruction
(``--fmad=false``), so that each operation is rounded as the ufunc rounds it: an update on the GPU and on
the CPU give the same bits for the same inputs.  Kernels are made on first use, for float32 and float64;
another dtype takes the ufunc path on the device too.

:func:`matmul` is ``a @ b`` of matrices or stacks of them; on a GPU it calls cuBLAS's gemm itself (through
``ctypes``, on the library CuPy has loaded), because CuPy refuses every cuBLAS call while a stream is being
captured into a graph (:mod:`psgd.compute.graphs`).  Each thread has a handle and a workspace of its own; the handle is
told the current stream before each product, as CuPy does, and float32 products use TF32 only where
``CUPY_TF32=1`` asks for it, as CuPy's own do.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import numpy as np

from psgd.compute import backend

#: compile options of every kernel here: IEEE rounding of each operation, as NumPy's ufuncs round
OPTIONS = ("--fmad=false",)
FUSED_DTYPES = ("float32", "float64")

_made: dict[str, Any] = {}  # kernel name -> CuPy kernel (ElementwiseKernel, or RawKernel per dtype)


def _fused(a: Any) -> Any:
    """The CuPy module when ``a`` is a device array of a dtype with kernels here, else None."""
    if type(a) is np.ndarray:  # a host array, known without asking the backend
        return None
    if not backend.is_device_array(a) or a.dtype.name not in FUSED_DTYPES:
        return None
    return backend.get_array_module(a)


def _elementwise(cp: Any, name: str, params_in: str, params_out: str, body: str) -> Any:
    kernel = _made.get(name)
    if kernel is None:
        kernel = _made[name] = cp.ElementwiseKernel(params_in, params_out, body, f"psgd_{name}", options=OPTIONS)
    return kernel


# ---------------------------------------------------------------- layers

_RELU = "h = h * (T)(h > (T)0);"  # x * (x > 0): NaN stays NaN, as a mask product keeps it


def relu(x: Any) -> Any:
    """``x * (x > 0)``, a new array."""
    cp = _fused(x)
    if cp is None:
        return x * (x > 0)
    return _elementwise(cp, "relu", "T x", "T h", "h = x; " + _RELU)(x)


def bias_relu_(h: Any, b: Any) -> Any:
    """``h = (h + b) * ((h + b) > 0)`` in place, ``b`` broadcast over rows; returns ``h``."""
    cp = _fused(h)
    if cp is None or b.dtype != h.dtype:
        h += b
        h *= h > 0
        return h
    return _elementwise(cp, "bias_relu", "T b", "T h", "h = h + b; " + _RELU)(b, h)


def relu_grad(dout: Any, out: Any) -> Any:
    """``dout * (out > 0)``, a new array, ``out`` being the ReLU's output (positive where its input was)."""
    cp = _fused(dout)
    if cp is None or out.dtype != dout.dtype:
        return dout * (out > 0)
    return _elementwise(cp, "relu_grad", "T d, T out", "T dx", "dx = d * (T)(out > (T)0);")(dout, out)


# ---------------------------------------------------------------- softmax cross-entropy

_XENT = r"""
extern "C" __global__ void psgd_xent_DTYPE(const DTYPE* z, const long long* y, DTYPE* grad, DTYPE* rowloss,
                                          long long rows, long long k) {
    long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const DTYPE* zr = z + r * k;
    DTYPE* gr = grad + r * k;
    DTYPE m = zr[0];
    for (long long j = 1; j < k; ++j) m = (zr[j] > m || zr[j] != zr[j]) ? zr[j] : m;  /* NaN wins, as in max */
    DTYPE total = 0;
    for (long long j = 0; j < k; ++j) total += EXP(zr[j] - m);
    long long t = y[r];
    DTYPE picked = (t >= 0 && t < k) ? zr[t] - m : (DTYPE)0;  /* a label out of range picks nothing */
    rowloss[r] = (LOG(total) - picked) / (DTYPE)rows;
    for (long long j = 0; j < k; ++j) gr[j] = (EXP(zr[j] - m) / total - (DTYPE)(j == t)) / (DTYPE)rows;
}
"""


def softmax_xent(logits: Any, y: Any) -> tuple[Any, Any] | None:
    """(mean loss as a 0-d array, its gradient) of softmax cross-entropy as two kernels (one per row, one
    sum), or None where there is no kernel for these arrays (the caller computes it with ufuncs)."""
    cp = _fused(logits)
    if cp is None or logits.ndim != 2 or not logits.flags.c_contiguous:
        return None
    dtype = "float" if logits.dtype.name == "float32" else "double"
    name = f"xent_{dtype}"
    kernel = _made.get(name)
    if kernel is None:
        single = dtype == "float"
        source = _XENT.replace("DTYPE", dtype).replace("EXP", "expf" if single else "exp")
        kernel = _made[name] = cp.RawKernel(
            source.replace("LOG", "logf" if single else "log"), f"psgd_xent_{dtype}", options=OPTIONS
        )
    rows, k = logits.shape
    labels = cp.asarray(y).astype(cp.int64, copy=False)
    grad = cp.empty_like(logits)
    rowloss = cp.empty(rows, dtype=logits.dtype)
    threads = 128
    kernel(((rows + threads - 1) // threads,), (threads,), (logits, labels, grad, rowloss, np.int64(rows), np.int64(k)))
    return rowloss.sum(), grad


# ---------------------------------------------------------------- optimizer updates


def sgd_(param: Any, grad: Any, lr: Any, keep: Any | None) -> None:
    """``p = p * keep`` (weight decay: ``keep`` is ``1 - lr * wd``; None for none), then ``p -= lr * g``, in place.

    Here and in the other updates, a value that changes from step to step (``lr``, ``keep``; Adam's ``rate`` and
    ``unbias2``) may be a number or, on a GPU, a 0-d device array of the parameter's dtype that the kernel reads
    when it runs: a step captured as a graph (:mod:`psgd.compute.graphs`) writes the next step's values there."""
    cp = _fused(param)
    if cp is None:
        xp = backend.get_array_module(param)
        if keep is not None:
            xp.multiply(param, keep, out=param)
        param -= xp.multiply(grad, lr)
        return
    _elementwise(cp, "sgd", "T g, T keep, T lr, int32 decays", "T p", "T q = decays ? p * keep : p; p = q - g * lr;")(
        grad, 1.0 if keep is None else keep, lr, int(keep is not None), param
    )


_MOMENTUM = """
T w = v * mu;
w = w + (scaled ? g * s : g);
if (decays) w = w + p * wds;
v = w;
T step;
if (nesterov) {
    if (decays) p = p * keep;
    step = w * look;
    step = step + g;
    step = step * lr;
} else {
    step = w * lr;
}
p = p - step;
"""


def momentum_(
    param: Any,
    v: Any,
    grad: Any,
    *,
    lr: Any,
    keep: Any,
    mu: float,
    s: float,
    weight_decay: float,
    nesterov: bool,
    lookahead: float,
) -> None:
    """``v = mu v + s g (+ wd s p)``; then ``p -= lr v``, or with ``nesterov`` ``p = p keep`` (``keep`` is
    ``1 - lr wd``) and ``p -= lr (g + lookahead v)``: :class:`psgd.optim.rules.Momentum`'s update, in place."""
    cp = _fused(param)
    if cp is None:
        xp = backend.get_array_module(param)
        tmp = xp.empty_like(param)
        v *= mu
        if s == 1.0:
            v += grad
        else:
            xp.multiply(grad, s, out=tmp)
            v += tmp
        if weight_decay:
            xp.multiply(param, weight_decay * s, out=tmp)
            v += tmp
        if nesterov:
            if weight_decay:
                xp.multiply(param, keep, out=param)
            xp.multiply(v, lookahead, out=tmp)
            tmp += grad
            tmp *= lr
        else:
            xp.multiply(v, lr, out=tmp)
        param -= tmp
        return
    kernel = _elementwise(
        cp,
        "momentum",
        "T g, T mu, T s, T wds, T keep, T look, T lr, int32 scaled, int32 decays, int32 nesterov",
        "T p, T v",
        _MOMENTUM,
    )
    kernel(
        grad,
        mu,
        s,
        weight_decay * s,
        keep,
        lookahead,
        lr,
        int(s != 1.0),
        int(bool(weight_decay)),
        int(nesterov),
        param,
        v,
    )


_ADAM = """
if (decoupled) p = p * keep;
T gg = coupled ? p * wd : g;
if (coupled) gg = gg + g;
T mm = m - gg;
mm = mm * b1;
m = mm + gg;
T sq = gg * gg;
sq = sq * rest2;
T vv = v * b2;
vv = vv + sq;
v = vv;
T den = sqrt(vv);
den = den * unbias2;
den = den + eps;
T step = m / den;
step = step * rate;
p = p - step;
"""


def adam_(
    param: Any,
    m: Any,
    v: Any,
    grad: Any,
    *,
    keep: Any,
    rate: Any,
    unbias2: Any,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
) -> None:
    """:class:`psgd.optim.rules.Adam`'s update in place: ``b1``, ``b2`` this update's decays, ``rate`` the learning
    rate over ``1 - b1^t`` and ``unbias2`` ``1 / sqrt(1 - b2^t)`` (the bias corrections), ``keep`` ``1 - lr wd``;
    weight decay through the gradient, or ``decoupled`` (AdamW)."""
    cp = _fused(param)
    if cp is None:
        xp = backend.get_array_module(param)
        if weight_decay and decoupled:  # AdamW: p -= lr * wd * p, on the weights before this step
            xp.multiply(param, keep, out=param)
        if weight_decay and not decoupled:  # L2: g + wd * p, in the one temporary
            g = tmp = xp.multiply(param, weight_decay)
            g += grad
        else:
            g, tmp = grad, xp.empty_like(param)
        m -= g  # m = b1 * m + (1 - b1) * g, as b1 * (m - g) + g: no temporary
        m *= b1
        m += g
        xp.multiply(g, g, out=tmp)  # v = b2 * v + (1 - b2) * g^2  (g is not needed after this)
        tmp *= 1.0 - b2
        v *= b2
        v += tmp
        xp.sqrt(v, out=tmp)  # sqrt(v_hat) + eps
        tmp *= unbias2
        tmp += eps
        xp.divide(m, tmp, out=tmp)
        tmp *= rate  # m_hat = m / (1 - b1^t)
        param -= tmp
        return
    kernel = _elementwise(
        cp,
        "adam",
        "T g, T keep, T wd, T b1, T rest2, T b2, T unbias2, T eps, T rate, int32 decoupled, int32 coupled",
        "T p, T m, T v",
        _ADAM,
    )
    decays = bool(weight_decay)
    kernel(
        grad,
        keep,
        weight_decay,
        b1,
        1.0 - b2,
        b2,
        unbias2,
        eps,
        rate,
        int(decays and decoupled),
        int(decays and not decoupled),
        param,
        m,
        v,
    )


# ---------------------------------------------------------------- matrix products

WORKSPACE_BYTES = 32 << 20  # cuBLAS's own default workspace on Hopper; one per thread's handle
_OP_N, _OP_T, _TF32_MATH = 0, 1, 3
_ONE = {"float32": ctypes.c_float(1.0), "float64": ctypes.c_double(1.0)}
_ZERO = {"float32": ctypes.c_float(0.0), "float64": ctypes.c_double(0.0)}
_GEMM = {"float32": "cublasSgemm_v2", "float64": "cublasDgemm_v2"}
_GEMM_BATCHED = {"float32": "cublasSgemmStridedBatched", "float64": "cublasDgemmStridedBatched"}
_blas: dict[str, Any] = {}  # "lib": the cuBLAS CuPy loaded (ctypes), or "error": why it could not be found
_threads = threading.local()  # .handles: device id -> (handle, workspace)


def _cublas(cp: Any) -> Any:
    """CuPy's cuBLAS through ctypes (the library already in this process), its functions typed once."""
    if "lib" in _blas or "error" in _blas:
        return _blas.get("lib")
    cp.cuda.device.get_cublas_handle()  # CuPy loads its cuBLAS
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "/libcublas.so" in line}
    if not paths:
        _blas["error"] = "CuPy's cuBLAS library is not mapped in this process"
        return None
    lib = ctypes.CDLL(sorted(paths)[0])
    p, i = ctypes.c_void_p, ctypes.c_int
    for name in _GEMM.values():
        getattr(lib, name).argtypes = [p, i, i, i, i, i, p, p, i, p, i, p, p, i]
    q = ctypes.c_longlong
    for name in _GEMM_BATCHED.values():
        getattr(lib, name).argtypes = [p, i, i, i, i, i, p, p, i, q, p, i, q, p, p, i, q, i]
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(p)]
    lib.cublasSetStream_v2.argtypes = [p, p]
    lib.cublasSetWorkspace_v2.argtypes = [p, p, ctypes.c_size_t]
    lib.cublasSetMathMode.argtypes = [p, i]
    _blas["lib"] = lib
    return lib


def _checked(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLAS {what} returned status {status}")


def _handle(cp: Any, lib: Any) -> tuple[int, Any]:
    """This thread's cuBLAS handle on the current device, and its workspace (a CuPy array kept with it)."""
    handles = getattr(_threads, "handles", None)
    if handles is None:
        handles = _threads.handles = {}
    device = cp.cuda.runtime.getDevice()
    made = handles.get(device)
    if made is None:
        handle = ctypes.c_void_p()
        _checked(lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
        if os.environ.get("CUPY_TF32", "0") not in ("", "0"):
            _checked(lib.cublasSetMathMode(handle, _TF32_MATH), "cublasSetMathMode")
        made = handles[device] = (handle.value, cp.empty(WORKSPACE_BYTES, dtype=cp.uint8))
    return made


def _operand(cp: Any, a: Any) -> tuple[Any, int, int, int]:
    """``(a, cuBLAS op, leading dimension, stride between matrices)`` giving each of ``a``'s matrices transposed in
    cuBLAS's column-major terms (``a`` a matrix or a stack of them); a copy of ``a`` where its matrices are strided."""
    rows, cols = a.shape[-2:]
    item = a.itemsize
    step = a.strides[0] // item if a.ndim == 3 else 0
    if step >= 0:  # (a stack read backwards is copied)
        if a.strides[-1] == item and (rows == 1 or a.strides[-2] == cols * item):
            return a, _OP_N, max(cols, 1), step
        if a.strides[-2] == item and (cols == 1 or a.strides[-1] == rows * item):
            return a, _OP_T, max(rows, 1), step
    a = cp.ascontiguousarray(a)
    return a, _OP_N, max(cols, 1), rows * cols if a.ndim == 3 else 0


def matmul(a: Any, b: Any) -> Any:
    """``a @ b`` of two matrices, or where one or both are stacks of matrices (3-D, the same number where both
    are), a new C-ordered array; on a GPU one cuBLAS gemm (strided and batched for stacks) called here (see above)."""
    cp = _fused(a)
    if (
        cp is None
        or not (2 <= a.ndim <= 3 and 2 <= b.ndim <= 3)
        or b.dtype != a.dtype
        or 0 in a.shape + b.shape
        or (a.ndim == b.ndim == 3 and a.shape[0] != b.shape[0])
    ):
        return a @ b
    lib = _cublas(cp)
    if lib is None:
        return a @ b
    (m, k), n = a.shape[-2:], b.shape[-1]
    if b.shape[-2] != k:
        raise ValueError(f"matmul: shapes {a.shape} and {b.shape} do not fit")
    batch = a.shape[0] if a.ndim == 3 else b.shape[0] if b.ndim == 3 else 0
    a, a_op, a_ld, a_step = _operand(cp, a)
    b, b_op, b_ld, b_step = _operand(cp, b)
    out = cp.empty(((batch,) if batch else ()) + (m, n), dtype=a.dtype)
    handle, workspace = _handle(cp, lib)
    _checked(lib.cublasSetStream_v2(handle, cp.cuda.get_current_stream().ptr), "cublasSetStream")
    _checked(lib.cublasSetWorkspace_v2(handle, workspace.data.ptr, WORKSPACE_BYTES), "cublasSetWorkspace")
    # row-major out = a @ b is column-major out.T = b.T @ a.T
    dtype = a.dtype.name
    one, zero = ctypes.addressof(_ONE[dtype]), ctypes.addressof(_ZERO[dtype])
    if not batch:
        _checked(
            getattr(lib, _GEMM[dtype])(
                handle, b_op, a_op, n, m, k, one, b.data.ptr, b_ld, a.data.ptr, a_ld, zero, out.data.ptr, n
            ),
            _GEMM[dtype],
        )
        return out
    name = _GEMM_BATCHED[dtype]
    _checked(
        getattr(lib, name)(
            handle,
            b_op,
            a_op,
            n,
            m,
            k,
            one,
            b.data.ptr,
            b_ld,
            b_step,
            a.data.ptr,
            a_ld,
            a_step,
            zero,
            out.data.ptr,
            n,
            m * n,
            batch,
        ),
        name,
    )
    return out
