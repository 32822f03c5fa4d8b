"""`sift.optim`: `SparseAdamW`, AdamW restricted to a fixed sparse set of entries per weight (SIFT).

SIFT (Song et al., "Sparse is Enough in Fine-tuning Pre-trained Large Language Models",
Sec. 4) updates only the top-x% gradient components of each weight, chosen on the first
batch(es) and then kept fixed, so Adam moments exist for those entries only. Per sparse
weight with k chosen entries the optimizer keeps

    indices     [k] int32 (int64 for >= 2**31 elements), sorted flat positions
    exp_avg     [k] fp32
    exp_avg_sq  [k] fp32
    delta       [k] fp32, the exact total increment since selection
    base        [k] in the weight dtype: values at selection time
    step        0-d fp32 tensor on the weight's device

i.e. 20 bytes per trainable entry for fp32 weights and 18 for bf16/fp16 ones. Weights are
written as round(base + delta) and never read by the step, so no bf16/fp16 update is lost to
rounding however small it is against the weight's ulp, and base + delta (what
`SparseDelta.from_optimizer` exports) is the tuned weight bit for bit in every dtype.

`set_indices` can change the set mid-training. Entries it drops with a nonzero `delta` keep
their increment in a retired record, disjoint from `indices` and absent while empty:

    retired_indices  [r] sorted flat positions, same dtype as `indices`
    retired_delta    [r] fp32, the increment each one had when dropped
    retired_base     [r] their `base`

An entry re-added later takes its `delta` (and `base`) back from the record and leaves it, so
`delta` stays the total increment since the first selection (what `SparseDelta.from_optimizer`
exports). The fused step never reads the record: it costs memory (with int32 indices, 12 bytes
per retired entry, 10 for bf16/fp16), not time.

`SparseAdamW(state="lean")` keeps at most 8 bytes per entry instead (6 for fp32 weights, 7
for bf16/fp16, plus the tables below):

    indices_low     [k] int16, the low 16 bits of the sorted flat positions
    window_offsets  [ceil(numel / 65536) + 1] int32: entries of each 65536-element window (CSR)
    exp_avg         [k] bf16, stored by stochastic rounding (random bits hashed from index and step)
    exp_avg_sq      [k] bf16, likewise
    residual        [k] int8, bf16/fp16 weights only: the exact weight is
                    w + residual * ulp(w) / 256, so updates down to about ulp / 256 accumulate
    step            0-d fp32 tensor

The positions are exact. The moments are bf16: unbiased (stochastic rounding; rounding to
nearest stalls the second moment), about 0.4% noise each. The weight is its own master: fp32
weights are exact up to the bf16 moments; bf16/fp16 weights lose what lies below ulp / 256.
There is no `delta` (so `SparseDelta.from_optimizer` refuses a lean optimizer: use
`SparseDelta.from_diff`) and no retired record: entries `set_indices` drops simply leave.

Groups with `density=1.0` are plain dense AdamW (torch's math), for a classifier head or
LayerNorms. The fused step runs through `sift._ops` (Triton on CUDA, C++ on CPU, the torch
reference anywhere).

The class is `torch.optim.Optimizer` plus named parts, each owned by one module (docs/modes.md,
"How a mode is put together"): `entries` (`state`: the layouts above, `set_indices`, `indices_of`),
`grads` (`hooks`: `compact_grads`, `update_in_backward`, process groups), `selector` (`selection`:
the rules that choose the entries), `amp` (GradScaler's scale and inf flag, the ranks' one
agreement), `steps` (the fused kernels and dense AdamW) and `memory` (the presets' first-step
decision); `core` builds them and runs `step()`, `checkpoint` validates `state_dict` and makes
copies, `clip` is `clip_grad_norm_`.
"""

from sift.optim.clip import clip_grad_norm_
from sift.optim.core import SparseAdamW
from sift.optim.state import increments

__all__ = ["SparseAdamW", "clip_grad_norm_", "increments"]
