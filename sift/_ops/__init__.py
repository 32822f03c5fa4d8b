"""The one contract between the API and the kernels.

Every op has: a name, a plain-torch fp32-upcast reference (the fallback on any device and
the oracle in tests), and zero or more faster implementations registered per backend:

    "torch"   the reference itself; always available.
    "cpp"     `torch.ops.sift.*` from the C++ extension (CPU tensors).
    "triton"  `sift.triton_kernels` (CUDA tensors; CPU tensors only under TRITON_INTERPRET=1).

`resolve(op, device)` is the only place a backend is chosen. Order when nothing is forced:
CUDA -> triton, torch; CPU -> cpp, torch. `SIFT_BACKEND=torch|cpp|triton` (or the
`backend=` argument of `resolve`) forces one; a forced backend that cannot run raises, an
automatically chosen one that fails to load falls back with one log line.

Each op is also `torch.ops.sift.<name>`, defined once in its module (`define_schema`): its schema and
fake kernel (so calls trace under torch.compile), its CPU kernel registered by the C++
extension, its CUDA kernel the registry's entry. Where Triton serves an op, a torch.compile
graph holds the op's Triton launches rather than an opaque call (`traced`). The step ops take
their operands as one structure (`ExactState` / `LeanState`, `AdamWHyper` in
`sift.triton_kernels._step_args`) and validate them with one function (`check_step`),
whichever backend runs.

Layout: `registry` (the registry, `resolve`, `call`, `define_schema`), `step` (what the step
ops share), then one module per op family: `sparse_adamw`, `sparse_adamw_lean`, `delta`,
`singular_values`, `weight_grad`, `mixed_delta` (one batch served with many sparse deltas).
Importing this package defines every op; their names are
re-exported here, so `sift._ops.<name>` is the one path callers use.
"""

# The op families define their ops (and torch.ops.sift schemas) on import, in this order.
from sift._ops.registry import (BACKENDS, Op, backend_unavailable_reason, call, define, define_ordered,
                                define_schema, forced_backend, log, ops, register, resolve)
from sift._ops.step import _step_on_device  # noqa: F401  (tests call a step op's CUDA entry)
from sift._ops.sparse_adamw import sparse_adamw_ref
from sift._ops.delta import (merge_sorted_deltas_ref, originals_like, sparse_delta_apply_ref,
                             sparse_delta_restore_ref)
from sift._ops.singular_values import _gram_eigvalsh  # noqa: F401  (the benchmark times it alone)
from sift._ops.singular_values import CPP_SINGULAR_VALUES_MAX_K, singular_values_gram_eigvalsh, singular_values_ref
from sift._ops.sparse_adamw_lean import (LEAN_WINDOW, LEAN_WINDOW_BITS, checked_lean_indices, decode_lean_indices,
                                         encode_lean_indices, lean_num_windows, lean_random_bits, lean_round_bf16,
                                         lean_unit, sparse_adamw_lean_ref)
from sift._ops.mixed_delta import (MIXED_DELTA_MATMUL_DTYPES, DeltaBank, PackedDeltaBank,
                                   check_mixed_delta_matmul_args, check_mixed_delta_matmul_packed_args,
                                   delta_bank_switch_, delta_bank_switch_packed_ref, delta_bank_switch_ref,
                                   mixed_delta_matmul_, mixed_delta_matmul_packed_ref, mixed_delta_matmul_ref)
from sift._ops.weight_grad import (SPARSE_WEIGHT_GRAD_DTYPES, check_sparse_weight_grad_args,
                                   register_weight_grad_route, sparse_weight_grad, sparse_weight_grad_ref)

__all__ = ["BACKENDS", "CPP_SINGULAR_VALUES_MAX_K", "LEAN_WINDOW", "LEAN_WINDOW_BITS", "MIXED_DELTA_MATMUL_DTYPES",
           "SPARSE_WEIGHT_GRAD_DTYPES", "DeltaBank", "Op", "PackedDeltaBank", "backend_unavailable_reason", "call",
           "check_mixed_delta_matmul_args", "check_mixed_delta_matmul_packed_args", "check_sparse_weight_grad_args", "checked_lean_indices",
           "decode_lean_indices", "define", "define_ordered", "define_schema", "delta_bank_switch_",
           "delta_bank_switch_packed_ref", "delta_bank_switch_ref", "encode_lean_indices", "forced_backend",
           "lean_num_windows", "lean_random_bits", "lean_round_bf16", "lean_unit", "log", "merge_sorted_deltas_ref",
           "mixed_delta_matmul_", "mixed_delta_matmul_packed_ref", "mixed_delta_matmul_ref",
           "ops", "originals_like", "register", "register_weight_grad_route", "resolve", "singular_values_gram_eigvalsh",
           "singular_values_ref", "sparse_adamw_lean_ref", "sparse_adamw_ref", "sparse_delta_apply_ref", "sparse_delta_restore_ref",
           "sparse_weight_grad", "sparse_weight_grad_ref"]
