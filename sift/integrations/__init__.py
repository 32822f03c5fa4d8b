"""Integrations with training frameworks.

- `sift.integrations.hf.SparseTrainer`: a transformers `Trainer` that builds a SparseAdamW.
- Plain loops and DDP need nothing special: see the README.
"""
