"""sift: fused kernels for sparse fine-tuning (SIFT, HiFi) of pretrained transformers."""

from sift import heads
from sift.optim import SparseAdamW, clip_grad_norm_
from sift.delta import SparseDelta, merge_deltas

__version__ = "0.1.0"

__all__ = ["SparseAdamW", "clip_grad_norm_", "__version__"]
