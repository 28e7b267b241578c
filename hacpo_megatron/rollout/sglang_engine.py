"""The SGLang engine: SGLang's offline `sglang.Engine`, driven through its documented Python API.

NOT RUN ON THESE MACHINES. SGLang is CUDA-only (its PyPI package has no CPU path and pins its own
torch), so this engine has never generated a token here. What is tested here is everything that
does not need SGLang: the request building and the response parsing below are pure functions, fed
in tests with response dicts in SGLang's documented format (tests/rollout/test_sglang_engine.py).
On a GPU machine, run the checks the vLLM engine passes here (tests/rollout/vllm_checks.py: log-probs
against transformers at the temperature, seeds, bucketed weight update, check mode) against it first.

The API used (sglang/srt/entrypoints/engine.py, `class Engine`):

    engine = sglang.Engine(model_path=..., dtype=..., random_seed=..., tp_size=...,
                           mem_fraction_static=..., enable_memory_saver=True)
    outputs = engine.generate(input_ids=[[...], ...], sampling_params=[{...}, ...], return_logprob=True)
        -> one dict per request: {"text": str, "output_ids": [int], "meta_info": {
               "finish_reason": {"type": "stop" | "length" | "abort", "matched": ..., ...},
               "output_token_logprobs": [(logprob, token_id, token_text_or_None), ...], ...}}
        With sampling_params["n"] = G, a batch of B prompts gives B*G dicts, prompt-major
        (tokenizer_manager expands request i into its G copies one after another).
    engine.update_weights_from_tensor(named_tensors=[(name, tensor), ...], load_format=None,
                                      flush_cache=False) -> (success, message)
    engine.flush_cache()
    engine.get_weights_by_name(name, truncate_size) -> the first rows of a weight, as lists
    engine.release_memory_occupation() / engine.resume_memory_occupation()   (memory saver on)
    engine.shutdown()

Log-probs: SGLang reports log softmax(logits / temperature) of the sampled token, before top-p/top-k
renormalisation — our convention (rollout/base.py) — unless the environment variable
SGLANG_RETURN_ORIGINAL_LOGPROB is set, which reports them before the temperature. The engine refuses
to start with that variable set.

Weights: each bucket goes through `update_weights_from_tensor`, which hands HF-named tensors to the
model's own `load_weights` (it knows SGLang's fused qkv_proj / gate_up_proj) and applies them at
once; the cache of computed prefixes is flushed once, at the end. The tensors travel by
`MultiprocessingSerializer`: on GPU that is a CUDA IPC handle, so the trainer's engine rank and the
engine must share the GPU's node (colocated, as in slime); across nodes one would use SGLang's
`update_weights_from_distributed` instead (not implemented here).
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from hacpo_megatron.rollout.base import Completion, NamedTensors, RolloutEngine, SamplingParams, WeightCheck

INSTALL_HINT = "SGLang is not installed: on a CUDA machine run `pip install .[sglang]` (it cannot run on CPU)."
TOP_K_ALL = -1  # SGLang's "no top-k": sample from the whole vocabulary, as the other engines do


# ------------------------------------------------------------------------------------------------
# Requests (pure)
# ------------------------------------------------------------------------------------------------
def sampling_params_dict(params: SamplingParams, stop_token_ids: Sequence[int], *, n: Optional[int] = None,
                         seed: Optional[int] = None) -> Dict[str, Any]:
    """One SGLang sampling-params dict (see sglang/srt/sampling/sampling_params.py)."""
    fields: Dict[str, Any] = dict(
        n=params.n if n is None else n,
        temperature=0.0 if params.greedy else params.temperature,  # 0: greedy in SGLang
        top_p=params.top_p,
        top_k=TOP_K_ALL,
        min_p=0.0,
        max_new_tokens=params.max_new_tokens,
        # the agent's own end tokens, so every engine stops on the same ones
        stop_token_ids=sorted(set(int(t) for t in stop_token_ids)),
        skip_special_tokens=True,
    )
    if seed is not None:
        fields["sampling_seed"] = seed
    return fields


def generate_request(prompts: Sequence[Sequence[int]], params: SamplingParams,
                     stop_token_ids: Sequence[int]) -> Dict[str, Any]:
    """The keyword arguments of `sglang.Engine.generate` for G samples of each prompt.

    Unseeded: one request per prompt with n = G (SGLang's parallel sampling shares the prompt's
    prefill). Seeded: G requests per prompt, each n = 1 with its own seed, because SGLang's seeded
    sampling draws from (seed, position): G copies under one seed would be G identical samples.
    Either way the outputs come back prompt-major, G per prompt.
    """
    if any(len(p) == 0 for p in prompts):
        raise ValueError("SGLang engine: empty prompt")
    if params.seed is None:
        return dict(input_ids=[list(p) for p in prompts],
                    sampling_params=[sampling_params_dict(params, stop_token_ids) for _ in prompts],
                    return_logprob=True)
    input_ids, sampling = [], []
    for prompt_index, prompt in enumerate(prompts):
        for sample_index in range(params.n):
            input_ids.append(list(prompt))
            sampling.append(sampling_params_dict(params, stop_token_ids, n=1,
                                                 seed=sample_seed(params.seed, prompt_index, sample_index, params.n)))
    return dict(input_ids=input_ids, sampling_params=sampling, return_logprob=True)


def sample_seed(seed: int, prompt_index: int, sample_index: int, n: int) -> int:
    """A distinct seed per sample, reproducible from the call's seed (fits in 63 bits)."""
    return (seed * 1_000_003 + prompt_index * n + sample_index) % (2**63 - 1)


# ------------------------------------------------------------------------------------------------
# Responses (pure)
# ------------------------------------------------------------------------------------------------
def parse_completion(output: Dict[str, Any]) -> Completion:
    """One SGLang output dict -> Completion. Raises on aborted requests and on malformed output.

    Token ids and log-probs both come from meta_info.output_token_logprobs, so they cannot fall out
    of step; `output_ids`, when present, must agree. A response that stopped on a stop token ends
    with it (SGLang keeps it in the ids and log-probs and trims it only from the text).
    """
    meta = output.get("meta_info") or {}
    reason_type, matched = _finish_reason(meta.get("finish_reason"))
    if reason_type == "abort":
        raise RuntimeError(f"SGLang aborted a request: {meta.get('finish_reason')}")
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise ValueError("SGLang output without meta_info.output_token_logprobs: was return_logprob=True passed?")
    tokens = [int(entry[1]) for entry in entries]
    logprobs = [float(entry[0]) for entry in entries]
    output_ids = output.get("output_ids")
    if output_ids is not None and [int(t) for t in output_ids] != tokens:
        raise ValueError(f"SGLang output_ids {output_ids} disagree with output_token_logprobs' ids {tokens}")
    if reason_type == "stop" and isinstance(matched, int) and (not tokens or tokens[-1] != matched):
        raise ValueError(f"SGLang stopped on token {matched} but the response does not end with it: {tokens[-5:]}")
    finish = "length" if reason_type == "length" else "stop"
    return Completion(token_ids=tokens, text=output.get("text", ""), logprobs=logprobs, finish_reason=finish)


def parse_generate_output(outputs: Any, num_prompts: int, n: int) -> List[List[Completion]]:
    """SGLang's outputs (prompt-major, n per prompt) -> n Completions per prompt."""
    if isinstance(outputs, dict):  # a batch of one comes back as a bare dict
        outputs = [outputs]
    if len(outputs) != num_prompts * n:
        raise ValueError(f"SGLang returned {len(outputs)} outputs for {num_prompts} prompts x {n} samples")
    completions = [parse_completion(o) for o in outputs]
    return [completions[i * n:(i + 1) * n] for i in range(num_prompts)]


def _finish_reason(reason: Any) -> Tuple[str, Any]:
    """(type, matched) from SGLang's finish_reason: a dict {"type": ..., "matched": ...} (or a bare string)."""
    if isinstance(reason, dict):
        return str(reason.get("type")), reason.get("matched")
    if isinstance(reason, str):
        return reason, None
    raise ValueError(f"SGLang output without a finish reason: {reason!r} (unfinished or streaming output?)")


# ------------------------------------------------------------------------------------------------
# Weights (pure)
# ------------------------------------------------------------------------------------------------
def tensor_update_kwargs(bucket: Sequence[Tuple[str, torch.Tensor]]) -> Dict[str, Any]:
    """Keyword arguments of `update_weights_from_tensor` for one bucket; the cache is flushed at the end."""
    return dict(named_tensors=[(name, tensor.detach().contiguous()) for name, tensor in bucket],
                load_format=None, flush_cache=False)


def raise_unless_success(result: Any, what: str) -> None:
    """SGLang's control calls answer (success, message) (older versions: a dict with "success")."""
    if isinstance(result, dict):
        success, message = result.get("success", False), result.get("message", "")
    elif isinstance(result, (tuple, list)) and result:
        success, message = bool(result[0]), (result[1] if len(result) > 1 else "")
    else:
        success, message = bool(result), ""
    if not success:
        raise RuntimeError(f"SGLang {what} failed: {message}")


def compare_read_back(name: str, read_back: Any, expected: torch.Tensor, atol: float) -> Tuple[Optional[float], str]:
    """Compare `get_weights_by_name`'s answer (the first rows of a weight, as lists) with the sent tensor.

    Returns (max |diff| or None, problem): problem is "" when equal within atol.
    """
    if read_back is None:
        return None, f"{name}: SGLang cannot read this weight back"
    got = torch.as_tensor(read_back, dtype=torch.float32)
    want = expected.detach().float().cpu()[: got.shape[0]] if got.dim() else expected.detach().float().cpu()
    if got.shape != want.shape:
        return None, f"{name}: read back shape {tuple(got.shape)}, sent {tuple(want.shape)}"
    diff = (got - want).abs().max().item() if got.numel() else 0.0
    return diff, (f"{name}: max |diff| {diff:.3e}" if diff > atol else "")


# ------------------------------------------------------------------------------------------------
class SGLangEngine(RolloutEngine):
    """One agent's SGLang engine in this process (SGLang starts its scheduler processes itself)."""

    def __init__(self, model_path: str, *, eos_token_ids: Sequence[int], dtype: str = "auto", seed: int = 0,
                 tensor_parallel_size: int = 1, mem_fraction_static: float = 0.5, max_model_len: int = 4096,
                 enable_memory_saver: bool = True, **engine_kwargs):
        try:
            import sglang
        except ImportError as error:
            raise ImportError(INSTALL_HINT) from error
        if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes"):
            raise RuntimeError("SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would report log-probs before the "
                               "temperature, the trainer computes them after it (see rollout/base.py)")
        if not eos_token_ids:
            raise ValueError("SGLangEngine needs the agent's end-of-sequence token ids")
        self.eos_token_ids = list(eos_token_ids)
        self.memory_saver = enable_memory_saver
        self.engine = sglang.Engine(model_path=model_path, dtype=dtype, random_seed=seed, tp_size=tensor_parallel_size,
                                    mem_fraction_static=mem_fraction_static, context_length=max_model_len,
                                    enable_memory_saver=enable_memory_saver, **engine_kwargs)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> List[List[Completion]]:
        outputs = self.engine.generate(**generate_request(prompts, params, self.eos_token_ids))
        return parse_generate_output(outputs, len(prompts), params.n)

    def update_weights(self, bucket: Sequence[Tuple[str, torch.Tensor]]) -> None:
        """Loaded at once by the model's load_weights; begin has nothing to prepare."""
        raise_unless_success(self.engine.update_weights_from_tensor(**tensor_update_kwargs(bucket)),
                             "update_weights_from_tensor")

    def finish_weight_update(self) -> None:
        self.engine.flush_cache()  # cached prefixes were computed with the old weights

    def check_weights(self, named_tensors: NamedTensors, atol: float = 0.0) -> WeightCheck:
        """Read every sent weight back by HF name (slow: SGLang's read-back is meant for tests)."""
        worst, mismatched, missing = 0.0, [], []
        for name, tensor in named_tensors:
            rows = tensor.shape[0] if tensor.dim() else 1
            diff, problem = compare_read_back(name, self.engine.get_weights_by_name(name, truncate_size=rows),
                                              tensor, atol)
            if diff is None:
                missing.append(problem)
                continue
            worst = max(worst, diff)
            if problem:
                mismatched.append(problem)
        return WeightCheck(not (mismatched or missing), worst, mismatched, missing)

    def release_memory(self) -> None:
        if self.memory_saver:
            self.engine.release_memory_occupation()

    def resume_memory(self) -> None:
        """Resume before the next weight update: the update writes into the restored weight memory."""
        if self.memory_saver:
            self.engine.resume_memory_occupation()

    def shutdown(self) -> None:
        self.engine.shutdown()
