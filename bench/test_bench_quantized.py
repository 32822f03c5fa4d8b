"""One SIFT 1% training step over a frozen NF4 base, on the small Llama of `python -m sift.bench quantized`
(`sift.bench.quantized`, part 2: hidden 1024, 4 layers, seq 128, batch 4 with `--bench-full`; its
quick sizes otherwise): forward, backward, `optimizer.step()`, `zero_grad`, after the selecting step."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("bitsandbytes")

from sift.bench import quantized  # noqa: E402


def test_sift_step_nf4(measure, quick):
    sizes = quantized.QUICK_STEP_MODEL if quick else quantized.STEP_MODEL
    method = quantized.Method(quantized.build_quantized(sizes), "sift", 0.01)
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, sizes["vocab_size"], (sizes["batch"], sizes["seq"]), generator=gen)
    method.step(batch)  # the selecting step (one dense dW per layer) is not what is timed
    workload = (f"Llama hidden {sizes['hidden_size']}, {sizes['num_hidden_layers']} layers, NF4, "
                f"seq {sizes['seq']}, batch {sizes['batch']}")
    measure(lambda: method.step(batch), group=f"4-bit training step {workload}", workload=workload,
            implementation="sift 1% exact", trainable_entries=method.entries)
