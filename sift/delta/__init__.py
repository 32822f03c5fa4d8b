"""Sparse deltas: a sparse fine-tune as index/value pairs per weight.

A `SparseDelta` maps parameter names to `DeltaEntry`s: the weight's shape and dtype, the flat
positions `indices` ([k] int32, or int64 for weights of >= 2**31 elements; sorted, unique)
and the fp32 increments `values` ([k]). Applying adds them in place,

    w.view(-1)[indices] = dtype(fp32(w.view(-1)[indices]) + fp32(scale) * values),

so a fine-tune costs nothing at inference time, and `remove_` writes back the values the
apply overwrote (kept by `apply_`), which restores the weights bit for bit in every dtype.
No arithmetic inverse could promise that: `w + d - d` rounds, in bf16 most of all.

Deltas come from a trained `sift.SparseAdamW` (`SparseDelta.from_optimizer`: the optimizer's
exact increments, no copy of the base model needed) or from two state dicts (`from_diff`,
top-|difference| per tensor). They save to safetensors (`save` / `load`, 6 bytes per entry (4 for bf16/fp16 weights whose increments fit their dtype),
bit-exact) or as a fine-tune directory (`save_pretrained`) and combine with `merge_deltas` (sum, mean, or TIES-style sign election), `+` and `*`.

Every delta remembers a fingerprint of the base model it was made for: a hash of the names,
shapes and dtypes of all its floating-point tensors, and the values of the base at a few fixed
positions per tensor. `apply_` refuses another base, `merge_deltas` refuses deltas of different
bases, and nothing is modified before every check has passed.

The kernels (k-way merge, scatter-add with the gather of the overwritten values, restore) are
the ops `merge_sorted_deltas`, `sparse_delta_apply_` and `sparse_delta_restore_` of `sift._ops`:
C++ on CPU, Triton (apply/restore) or torch (merge) on CUDA.

Layout, one data class with plain functions around it, imports pointing down only: `entry`
(`DeltaEntry`, `DeltaError`), `fingerprint` (`BaseFingerprint`), `packing` (the file's encodings) and
`identity` (which model a delta belongs to, in words) at the bottom; `contents` (`DeltaContents`: what
the functions read of a delta); the functions `construction` (`from_optimizer`, `from_diff`),
`application` (`apply_`, `remove_`, `disabled`), `storage` (the safetensors file), `directory` (the
fine-tune directory) and `merging`; above them `sparse_delta` (`SparseDelta`, the data class, whose
methods call those functions, and `merge_deltas`); on top `loading` (`from_pretrained`: a fine-tune
directory onto its base in one call, the base loaded from the name the directory records when not
given) and `serving` (`ServedDeltas`: many deltas in one batch, one per row).
`disabled(model)` switches the deltas applied to a model off for a `with` block, exactly. The names are
re-exported here: `sift.delta.<name>` is the path to use.
"""


from sift.delta.entry import MAX_LISTED_PROBLEMS, SUPPORTED_DTYPES, DeltaEntry, DeltaError
from sift.delta.entry import _dtype_name  # noqa: F401  (the directory format and sharded fingerprints use it)
from sift.delta.fingerprint import SAMPLES_PER_TENSOR, BaseFingerprint
from sift.delta.fingerprint import _sample_positions, _structure_hash  # noqa: F401
from sift.delta.application import disabled
from sift.delta.loading import from_pretrained
from sift.delta.merging import MERGE_METHODS
from sift.delta.sparse_delta import SparseDelta, merge_deltas
from sift.delta.serving import ServedDeltas
from sift.delta.storage import FORMAT, FORMAT_VERSION
from sift.delta.storage import _checksum  # noqa: F401  (tests re-sign edited files with it)


__all__ = ["BaseFingerprint", "DeltaEntry", "DeltaError", "ServedDeltas", "SparseDelta", "disabled", "from_pretrained",
           "merge_deltas"]
