"""HiFi head importance: find the most informative, most correlated attention heads and
fine-tune only their Q/K/V weights.

A HiFi fine-tune in four calls (see `score_heads`, `select_heads`, `trainable_indices`):

    scores = sift.heads.score_heads(model, dict(tokenizer(texts, padding=True, return_tensors="pt")))
    chosen = sift.heads.select_heads(scores, k=3, strategy="layer-wise")
    indices = sift.heads.trainable_indices(model, chosen)
    # SparseAdamW over those parameters, optimizer.set_indices(param, indices[name]) for each

`singular_values` is the batched kernel behind information richness (Triton on CUDA, C++
with 8 matrices per SIMD instruction on CPU, fp64 Gram + eigvalsh as the plain-torch path).
"""

from sift.heads.capture import SUPPORTED_MODEL_TYPES, HeadLayout, attention_layout, capture_head_outputs
from sift.heads.scores import (
    HeadScores,
    head_correlation,
    information_richness,
    pagerank,
    score_heads,
    singular_values,
    transition_matrix,
)
from sift.heads.select import CRITERIA, STRATEGIES, select_heads, trainable_indices

__all__ = [
    "CRITERIA",
    "STRATEGIES",
    "SUPPORTED_MODEL_TYPES",
    "HeadLayout",
    "HeadScores",
    "attention_layout",
    "capture_head_outputs",
    "head_correlation",
    "information_richness",
    "pagerank",
    "score_heads",
    "select_heads",
    "singular_values",
    "trainable_indices",
    "transition_matrix",
]
