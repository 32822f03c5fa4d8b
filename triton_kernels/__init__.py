"""Triton kernels of sift, installed as `sift.triton_kernels`.

Each module holds one op: a docstring with the math and shapes, the `@triton.jit` kernels,
then typed launchers. Modules import only torch and triton.
"""
