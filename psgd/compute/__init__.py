"""What runs a step's arithmetic: the array module of the job's device (``xp``: NumPy on a CPU, CuPy on a GPU),
the fused kernels and matrix products (``kernels``), a step captured as a CUDA graph (``graphs``) and the CPU
threads each process gives its BLAS (``threads``)."""
