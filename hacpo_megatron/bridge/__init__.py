"""Tokenizer bridge for shared rollouts: agent j's response, retokenized for learner k (see retokenize.py)."""
from hacpo_megatron.bridge.retokenize import (
    BridgedResponse,
    bridge_response,
    bridge_responses,
    decode_response,
    render_prompt,
    render_prompts,
    trim_response,
)
from hacpo_megatron.bridge.tokenizers import (
    BUILTIN_TOKENIZERS,
    eos_token_ids,
    load_tokenizer,
    pad_token_id,
    same_vocabulary,
    vocabulary_fingerprint,
)

__all__ = [
    "BUILTIN_TOKENIZERS",
    "BridgedResponse",
    "bridge_response",
    "bridge_responses",
    "decode_response",
    "eos_token_ids",
    "load_tokenizer",
    "pad_token_id",
    "render_prompt",
    "render_prompts",
    "same_vocabulary",
    "trim_response",
    "vocabulary_fingerprint",
]
