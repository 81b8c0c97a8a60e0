"""Tensor-parallel building blocks. Only this package knows about TP and kernels."""
