"""The embedded engine: Hugging Face transformers generating in the trainer's own process.

Needs nothing beyond the base install, so it is the default where no GPU engine is installed and
the engine of the CPU runs. Its decode loop is its own (the model's forward with a KV cache): it
computes each drawn token's log-prob from the step's logits, with the temperature applied as the
trainer applies it, and draws tokens with one random number per row (`draw`; transformers' `generate`
calls `torch.multinomial`, which cost most of a CPU rollout over a 152k-token vocabulary).
"""
from __future__ import annotations

import copy

from typing import Dict, List, Sequence, Tuple

import torch

from hacpo_megatron.checkpoint.hf_experts import per_expert_tensors
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


def draw(probs: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """One token per row of `probs` [rows, vocab] (rows need not be normalised), by inverting its CDF.

    Exact sampling from one uniform number per row, in two levels: the row's mass per block of
    `block` tokens picks a block, the CDF inside that block picks the token. `torch.multinomial`
    (what transformers' `generate` calls) draws as many random numbers as the vocabulary has entries
    and took ~0.35 s of a 128-row step over Qwen3's 151,936 tokens on one core; a full-row cumsum
    ~0.04 s; this ~0.01 s. A token of probability 0 is never drawn: its CDF step is empty and
    `right=True` skips it.
    """
    rows, vocab = probs.shape
    padded = torch.nn.functional.pad(probs, (0, -vocab % block)).view(rows, -1, block)
    block_cdf = padded.sum(dim=-1).cumsum(dim=-1)  # [rows, blocks]
    u = torch.rand(rows, 1, device=probs.device, dtype=probs.dtype) * block_cdf[:, -1:]
    chosen = torch.searchsorted(block_cdf, u, right=True).clamp_max(block_cdf.shape[1] - 1)
    # what is left of u inside the chosen block, then the same search among its tokens
    u = u - torch.where(chosen > 0, block_cdf.gather(1, (chosen - 1).clamp_min(0)), torch.zeros_like(u))
    inner_cdf = padded.gather(1, chosen[:, :, None].expand(-1, -1, block)).squeeze(1).cumsum(dim=-1)
    index = chosen.squeeze(1) * block + torch.searchsorted(inner_cdf, u, right=True).squeeze(1)
    past_the_end = (index >= vocab) | (probs.gather(1, index.clamp_max(vocab - 1)[:, None]).squeeze(1) <= 0)
    if bool(past_the_end.any()):  # float rounding at a block's end only: take the likeliest token then
        index = torch.where(past_the_end, probs.argmax(dim=-1), index)
    return index


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs` (rows need not be normalised) restricted to the smallest set of likeliest tokens
    whose share of the row's mass reaches top_p (at least one token); not renormalised."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the strictly likelier tokens
    kept = before < top_p * probs.sum(dim=-1, keepdim=True)
    return probs * torch.zeros_like(probs).scatter(-1, order, kept.to(probs.dtype))


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


def moe_routers(model) -> List[torch.nn.Module]:
    """A transformers model's MoE routers in layer order (Qwen3-MoE's `mlp.gate`, whose forward returns its logits,
    routing weights and top-k expert indices); [] for a dense model."""
    return [module for name, module in model.named_modules()
            if name.endswith("mlp.gate") and hasattr(module, "top_k") and hasattr(module, "num_experts")]


class _RouteRecorder:
    """Forward hooks on a transformers model's routers for one batch's decode: the top-k indices each forward routed
    with, per layer. The prefill's tokens are [rows, width] (left-padded prompts), each decode step's [rows, 1]: the
    token drawn at the step before, so an answer's last token, never fed, has no route."""

    def __init__(self, routers: Sequence[torch.nn.Module], rows: int):
        self.routers, self.rows, self.calls, self._current, self._handles = list(routers), rows, [], {}, []

    def __enter__(self) -> "_RouteRecorder":
        for layer, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(
                lambda _m, _i, output, layer=layer: self._seen(layer, output[2])))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _seen(self, layer: int, indices: torch.Tensor) -> None:
        if layer == 0 and self._current:
            raise RuntimeError("a forward pass routed its first layer twice")
        self._current[layer] = indices.detach().to(device="cpu", dtype=torch.int16)
        if layer == len(self.routers) - 1:  # one forward pass complete: [tokens, layers, k]
            self.calls.append(torch.stack([self._current[i] for i in range(len(self.routers))], dim=1))
            self._current = {}

    def routes(self, row: int, prompt_length: int, answer_length: int) -> torch.Tensor:
        """Row `row`'s routes: [prompt + answer tokens, layers, k], -1 for answer tokens never fed."""
        prefill, steps = self.calls[0], self.calls[1:]
        width = prefill.shape[0] // self.rows  # transformers' router flattens [rows, width] row by row
        prompt = prefill.view(self.rows, width, *prefill.shape[1:])[row, width - prompt_length:]
        answer = torch.full((answer_length, *prefill.shape[1:]), -1, dtype=torch.int16)
        fed = [step[row] for step in steps[:answer_length]]  # decode step j fed answer token j
        if fed:
            answer[:len(fed)] = torch.stack(fed)
        return torch.cat([prompt, answer])


class EmbeddedEngine(RolloutEngine):
    """Generation with a transformers model held in this process (CPU or one GPU)."""

    def __init__(self, model, tokenizer, *, eos_token_ids: Sequence[int], pad_token_id: int,
                 max_batch_sequences: int = 64, record_routes: bool = False):
        """`record_routes` (a mixture-of-experts model; agents[].moe.routing_replay r3): every completion carries the
        experts each of its prompt's and answer's tokens went to (`Completion.routes`), read from the model's routers
        as they route (transformers' Qwen3-MoE router returns its top-k indices)."""
        if not eos_token_ids:
            raise ValueError("EmbeddedEngine needs at least one end-of-sequence token id")
        self.model = model.eval()
        self.routers = moe_routers(model) if record_routes else []
        if record_routes and not self.routers:
            raise ValueError("EmbeddedEngine(record_routes=True): the model has no mixture-of-experts routers")
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
        with _RouteRecorder(self.routers, rows=len(prompts)) as recorder:
            tokens, token_logprobs = self._decode(ids.to(self.device), attention.to(self.device), params)
        eos = set(self.eos_token_ids)
        result = []
        for row in range(tokens.shape[0]):
            kept, lps, reason = _cut_at_end(tokens[row].tolist(), token_logprobs[row].tolist(), eos)
            text = self.tokenizer.decode(kept, skip_special_tokens=True)
            routes = recorder.routes(row, len(prompts[row]), len(kept)) if self.routers else None
            result.append(Completion(token_ids=kept, text=text, logprobs=lps, finish_reason=reason, routes=routes))
        return result

    def _decode(self, ids: torch.Tensor, attention: torch.Tensor,
                params: SamplingParams) -> Tuple[torch.Tensor, torch.Tensor]:
        """Sample up to max_new_tokens per row with the model's KV cache: (tokens, their log-probs),
        both [rows, steps]. Rows that ended keep being fed (their tokens are cut off afterwards);
        decoding stops when every row has ended.

        Log-probs are log softmax(logits / T) of the drawn token, before top-p (rollout/base.py).
        """
        from transformers import DynamicCache

        cache = DynamicCache()
        positions = (attention.cumsum(dim=-1) - 1).clamp_min(0)  # left padding: a row's first token is position 0
        # logits of the last position only: the output layer over a 152k vocabulary is most of a small model
        logits = self.model(input_ids=ids, attention_mask=attention, position_ids=positions, past_key_values=cache,
                            use_cache=True, logits_to_keep=1).logits[:, -1]
        eos = torch.tensor(self.eos_token_ids, device=ids.device)
        ended = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        next_position = positions[:, -1:]
        tokens, logprobs = [], []
        for step in range(params.max_new_tokens):
            # log softmax as the trainer computes it (models/logprobs.py: torch's float32 kernel), so that the
            # engine/trainer gap measures the weights, not two roundings of a 152k-term sum
            logp = torch.log_softmax(logits.float() / params.temperature, dim=-1)
            token = logp.argmax(dim=-1) if params.greedy else draw(nucleus(logp.exp(), params.top_p))
            logprob = logp.gather(-1, token[:, None])
            tokens.append(token)
            logprobs.append(logprob.squeeze(1))
            ended |= torch.isin(token, eos)
            if bool(ended.all()) or step + 1 == params.max_new_tokens:
                break
            attention = torch.cat([attention, attention.new_ones(attention.shape[0], 1)], dim=1)
            next_position = next_position + 1
            logits = self.model(input_ids=token[:, None], attention_mask=attention, position_ids=next_position,
                                past_key_values=cache, use_cache=True).logits[:, -1]
        return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1)

    # ------------------------------------------------------------------ weights
    def _named_weights(self) -> Dict[str, torch.Tensor]:
        # state_dict lists tied weights under both names (embed_tokens and lm_head), as HF checkpoints do; a mixture
        # of experts (Qwen3-MoE) holds its experts fused, which are listed as one view per expert and projection, by
        # the checkpoint names the trainer sends
        return per_expert_tensors(self.model.state_dict())

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
