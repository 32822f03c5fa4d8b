"""The Python snippets of README.md and docs/*.md run as written, so they cannot drift from the code
(a chat model they name on the Hub loads as a tiny random stand-in: offline, in seconds)."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)
# Code for several processes (a torchrun recipe, FSDP2 sharding, a DDP wrap) cannot run in one test
# process: it is compiled, not run. Any other snippet runs.
SEVERAL_PROCESSES = re.compile(r"torchrun|init_process_group|fully_shard\(|DistributedDataParallel\(")
# The README's TRL quickstart names a real chat model; the test gives it a Llama of two layers (tied
# embeddings, as SmolLM2's) and a character tokenizer with a chat template, seeded so every load is the same.
CHAT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _tiny_chat_tokenizer():
    import tokenizers
    import transformers

    vocab = {t: i for i, t in enumerate(["<pad>", "<|im_end|>", "<unk>", "\n", *map(chr, range(32, 127))])}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>",
                                                     eos_token="<|im_end|>", unk_token="<unk>")
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] + '\\n' + m['content'] + eos_token }}{% endfor %}"
                               "{% if add_generation_prompt %}{{ 'assistant\\n' }}{% endif %}")
    return tokenizer


def _tiny_chat_model():
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=len(_tiny_chat_tokenizer()), hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=True, pad_token_id=0, eos_token_id=1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
    model.config.name_or_path = CHAT_MODEL
    return model


@pytest.fixture
def hub_stand_ins(monkeypatch):
    """`from_pretrained(CHAT_MODEL)` builds the tiny stand-in; any other name or folder loads as usual."""
    transformers = pytest.importorskip("transformers")
    for auto, build in ((transformers.AutoModelForCausalLM, _tiny_chat_model),
                        (transformers.AutoTokenizer, _tiny_chat_tokenizer)):
        def from_pretrained(name, *args, _real=auto.from_pretrained, _build=build, **kwargs):
            if name != CHAT_MODEL:
                return _real(name, *args, **kwargs)
            assert not args and not kwargs, f"the stand-in for {name} takes no loading options"
            return _build()

        monkeypatch.setattr(auto, "from_pretrained", from_pretrained)


def _snippets(page: pathlib.Path) -> list[str]:
    return FENCE.findall(page.read_text())


SNIPPETS = [(page, i, code) for page in PAGES for i, code in enumerate(_snippets(page))]
IDS = [f"{page.relative_to(ROOT)}-{i}" for page, i, _ in SNIPPETS]


def test_readme_has_snippets_and_the_two_commands():
    text = README.read_text()
    assert len(_snippets(README)) >= 2
    assert "pip install -e . && python -m sift.bench" in text
    assert "pip install -e '.[test]' && pytest" in text


def test_readme_is_short():
    size = len(README.read_bytes())
    assert size <= 15_000, f"README.md is {size} bytes; move material to docs/"


def test_every_docs_page_is_linked_and_every_link_resolves():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to missing {target}"
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)\)", README.read_text()))
    missing = [str(p.relative_to(ROOT)) for p in PAGES[1:] if str(p.relative_to(ROOT)) not in linked]
    assert not missing, f"README.md does not link {missing}"


def test_every_page_fence_is_closed():
    """A ```python fence left open would hide a snippet from the tests."""
    for page in PAGES:
        assert page.read_text().count("```") % 2 == 0, f"{page.relative_to(ROOT)} has an unclosed fence"


@pytest.mark.parametrize(("page", "index", "code"), SNIPPETS, ids=IDS)
def test_snippet_runs(page, index, code, tmp_path, monkeypatch, request):
    compiled = compile(code, f"{page}:snippet-{index}", "exec")
    if SEVERAL_PROCESSES.search(code):
        pytest.skip("code for several processes (torchrun, FSDP2, DDP): compiled, not run")
    if CHAT_MODEL in code:
        request.getfixturevalue("hub_stand_ins")
    monkeypatch.chdir(tmp_path)  # whatever a snippet writes next to it stays out of the checkout
    exec(compiled, {"__name__": f"snippet_{index}"})
