"""The embedded engine: Hugging Face transformers generating in the trainer's own process.

Needs nothing beyond the base install, so it is the default where no GPU engine is installed and
the engine of the CPU runs. It samples with `model.generate` (KV cache) and computes the per-token
log-probs itself from the step logits, with the temperature applied as the trainer applies it.
"""
from __future__ import annotations

import copy

from typing import Dict, List, Sequence, Tuple

import torch

from hacpo_megatron.rollout.base import (
    Completion, NamedTensors, RolloutEngine, SamplingParams, WeightCheck, compare_state,
)


def hf_model_from_config(hf_config: Dict, *, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A randomly initialised transformers model from a config dict (presets or a config.json)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    # a deep copy: transformers writes into nested dicts (rope_scaling) of what it is given
    fields = {k: copy.deepcopy(v) for k, v in hf_config.items() if k not in ("architectures", "model_type")}
    config = AutoConfig.for_model(hf_config["model_type"], **fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def _decoding(params: SamplingParams) -> dict:
    if params.greedy:
        return dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    # transformers samples from the top 50 by default; top_k=0 keeps the full distribution
    return dict(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0)


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {row} is empty")
        ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
        attention[row, width - len(prompt):] = 1
    return ids, attention


def _cut_at_end(tokens: List[int], logprobs: List[float], eos_ids: set) -> Tuple[List[int], List[float], str]:
    """Keep tokens up to and including the first end-of-sequence token."""
    for position, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: position + 1], logprobs[: position + 1], "stop"
    return tokens, logprobs, "length"


def _sampled_token_logprobs(step_logits: Sequence[torch.Tensor], tokens: torch.Tensor,
                            temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of each sampled token, [batch, steps], one step at a time.

    Step by step, because the full [batch, steps, vocab] tensor is large: 128 sequences x 64 steps of
    Qwen3's 151,936-token vocabulary are 5 GB in fp32, and stacking plus log_softmax held four copies.
    """
    columns = [torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, tokens[:, step, None])
               for step, logits in enumerate(step_logits)]
    return torch.cat(columns, dim=1)


class EmbeddedEngine(RolloutEngine):
    """Generation with a transformers model held in this process (CPU or one GPU)."""

    def __init__(self, model, tokenizer, *, eos_token_ids: Sequence[int], pad_token_id: int,
                 max_batch_sequences: int = 64):
        if not eos_token_ids:
            raise ValueError("EmbeddedEngine needs at least one end-of-sequence token id")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.max_batch_sequences = max_batch_sequences

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> List[List[Completion]]:
        flat = [list(p) for p in prompts for _ in range(params.n)]  # G copies of each prompt, in order
        completions: List[Completion] = []
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            if params.seed is not None:
                torch.manual_seed(params.seed)
            for start in range(0, len(flat), self.max_batch_sequences):
                completions.extend(self._generate_batch(flat[start:start + self.max_batch_sequences], params))
        return [completions[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

    def _generate_batch(self, prompts: List[List[int]], params: SamplingParams) -> List[Completion]:
        ids, attention = _left_pad(prompts, self.pad_token_id)
        ids, attention = ids.to(self.device), attention.to(self.device)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=attention,
            **_decoding(params),
            max_new_tokens=params.max_new_tokens,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        new_tokens = out.sequences[:, ids.shape[1]:]  # [batch, steps]
        token_logprobs = _sampled_token_logprobs(out.logits, new_tokens, params.temperature)
        eos = set(self.eos_token_ids)
        result = []
        for row in range(new_tokens.shape[0]):
            tokens, lps, reason = _cut_at_end(new_tokens[row].tolist(), token_logprobs[row].tolist(), eos)
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            result.append(Completion(token_ids=tokens, text=text, logprobs=lps, finish_reason=reason))
        return result

    # ------------------------------------------------------------------ weights
    def _named_weights(self) -> Dict[str, torch.Tensor]:
        # state_dict lists tied weights under both names (embed_tokens and lm_head), as HF checkpoints do
        return dict(self.model.state_dict())

    @torch.no_grad()
    def update_weights(self, bucket: Sequence[Tuple[str, torch.Tensor]]) -> None:
        """Copy each tensor into the model at once: begin/finish have nothing to do here."""
        own = self._named_weights()
        for name, tensor in bucket:
            if name not in own:
                raise KeyError(f"EmbeddedEngine.update_weights: the model has no weight named {name!r}")
            target = own[name]
            if target.shape != tensor.shape:
                raise ValueError(f"EmbeddedEngine.update_weights: {name} has shape {tuple(target.shape)}, "
                                 f"got {tuple(tensor.shape)}")
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))

    def check_weights(self, named_tensors: NamedTensors, atol: float = 0.0) -> WeightCheck:
        return compare_state(self._named_weights(), named_tensors, atol=atol)

    def release_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
