"""The CPU kernels: C++ in ``csrc/``, built once per instruction set (``build``), called through ``ops``
and ``fused``; ``capability`` says what this processor runs, ``plan`` / ``packing`` which GEMM kernel
serves how many rows."""
