"""Triton kernels of sift, installed as `sift.triton_kernels`.

Each module holds one op: a docstring with the math and shapes, the `@triton.jit` kernels,
then typed launchers. Modules import only torch, triton, `_launch` (launches torch.compile
can record), `_rounding` (the roundings the contracts spell out: fp32 -> bf16, and products
rounded before they are added) and `_checks` (argument checks, which `sift._ops`'s
references share; it imports neither torch nor triton).
"""
