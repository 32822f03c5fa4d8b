"""sift: fused kernels for sparse fine-tuning (SIFT, HiFi) of pretrained transformers.

- `SparseAdamW`, `clip_grad_norm_`: AdamW on a fixed sparse subset of each weight (SIFT).
- `heads`: HiFi head scoring and selection (`sift.heads.score_heads`, ...).
- `SparseDelta`, `merge_deltas`, `merge_and_save`: fine-tunes as index-sorted deltas, saved as a
  directory (`SparseDelta.save_pretrained`) or merged into a plain checkpoint; `ServedDeltas`
  serves many of them over one base in one batch, one per row.
- `from_pretrained(base_model, directory)` or `from_pretrained(directory)`: the base with a fine-tune
  directory applied, in one call (16-bit, 4-bit or 8-bit bases); `disabled(model)` switches it off exactly.
- `enable_sparse_backward`: sparse weights' gradients computed only at their chosen entries;
  `wrap_ddp` wraps a model it prepared in DDP.
- `quantized`: sparse deltas over a frozen bitsandbytes 4-bit base (`for_model` on a 4-bit model).
"""

from sift import heads, quantized
from sift._ops import sparse_weight_grad
from sift.delta import DeltaError, ServedDeltas, SparseDelta, disabled, from_pretrained, merge_deltas
from sift.optim import SparseAdamW, clip_grad_norm_
from sift.pretrained import merge_and_save
from sift.sparse_backward import enable_sparse_backward, wrap_ddp
from sift._version import __version__
from sift.targets import trainable_summary

__all__ = ["DeltaError", "ServedDeltas", "SparseAdamW", "SparseDelta", "clip_grad_norm_", "disabled",
           "enable_sparse_backward", "from_pretrained", "heads", "merge_and_save", "merge_deltas", "quantized", "sparse_weight_grad", "trainable_summary",
           "wrap_ddp", "__version__"]
