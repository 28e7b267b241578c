"""Exercises VLLMEngine for real on vLLM's CPU build (run by test_vllm.py in a child process).

Usage: python vllm_checks.py OUT_JSON WORKDIR [gemma3]. Writes the measured facts; test_vllm.py asserts on them.
One engine start per run (vLLM on CPU takes ~25 s to start): a tiny Qwen3 by default; with `gemma3`, a tiny
random Gemma 3 (both layer types, a window shorter than the sequences) with Gemma's tokenizer in a line format.
"""
import json
import os
import shutil
import sys

import torch


def build_model_folder(path, seed):
    from transformers import AutoConfig, AutoModelForCausalLM

    from hacpo_megatron.bridge.tokenizers import load_tokenizer

    # head_dim 64: vLLM's CPU attention does not support 16
    config = AutoConfig.for_model("qwen3", vocab_size=151936, hidden_size=128, intermediate_size=256,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                  max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    load_tokenizer("qwen3").save_pretrained(path)
    return model.eval()


def teacher_forced(model, prompt, tokens, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, -1)
    return [logp[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(tokens)]


def lose_engine_core(engine, prompts):
    """Kill vLLM's engine core process (as the kernel does when memory runs out) while a generation is
    under way, then generate again: what each call raises, and whether the engine says its own process
    is gone (the engine actor's cue to exit). vLLM alone leaves the first call waiting forever
    (`vllm_engine.watch_engine_core`)."""
    import threading
    import time

    import psutil

    from hacpo_megatron.rollout.base import SamplingParams

    cores = [p for p in psutil.Process().children(recursive=True)
             if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())]

    def kill_while_generating():
        time.sleep(1.0)
        for process in cores:
            process.kill()

    long_answers = SamplingParams(n=4, max_new_tokens=200, seed=0)
    threading.Thread(target=kill_while_generating, daemon=True).start()
    errors = []
    for _ in range(2):  # the generation under way when the core dies, then one started after
        try:
            while True:  # each batch takes ~1 s: keep generating until the kill lands
                engine.generate(prompts * 2, long_answers)
        except Exception as error:  # noqa: BLE001 - what vLLM raises is the fact under test
            errors.append(error)
    return {"killed": len(cores), "errors": [type(e).__name__ for e in errors],
            "process_lost": [engine.process_lost(e) for e in errors],
            "other_error_is_a_loss": engine.process_lost(ValueError("a bad prompt"))}


def worker_growth_over_new_batch_shapes(engine):
    """MiB vLLM's worker gains over 150 prefills of one prompt each, every one a row count (prompt length) the
    worker has not run before: what a process-wide cache of oneDNN matmuls (one per layer shape and row count)
    keeps. The first 50 lengths before: code paged in, the allocator settled."""
    import psutil

    from hacpo_megatron.rollout.base import SamplingParams

    workers = [p for p in psutil.Process().children(recursive=True) if "Worker" in " ".join(p.cmdline())]
    one_token = SamplingParams(n=1, max_new_tokens=1, seed=0)

    def prefill(lengths):
        for length in lengths:
            engine.generate([[100 + i for i in range(length)]], one_token)
        return sum(p.memory_info().rss for p in workers)

    before = prefill(range(1, 51))
    return (prefill(range(51, 201)) - before) / 2**20


def main(out_path, workdir):
    from hacpo_megatron.bridge.tokenizers import load_tokenizer
    from hacpo_megatron.rollout import make_engine
    from hacpo_megatron.rollout.base import SamplingParams, send_weights_in_buckets
    from hacpo_megatron.rollout.vllm_engine import WORKER_ENVIRONMENT, VLLMEngine

    model_a = build_model_folder(f"{workdir}/a", seed=0)
    model_b = build_model_folder(f"{workdir}/b", seed=1)
    # as the engine actor starts it: config.json only, random ("dummy") weights, our tokenizer decodes
    os.makedirs(f"{workdir}/config_only")
    shutil.copy(f"{workdir}/a/config.json", f"{workdir}/config_only/config.json")
    tokenizer = load_tokenizer("qwen3")
    engine = make_engine("vllm", model_path=f"{workdir}/config_only", eos_token_ids=[151645], seed=0,
                         max_model_len=256, load_format="dummy", tokenizer=tokenizer, cpu_threads=2)
    assert isinstance(engine, VLLMEngine)
    prompts = [[9707, 11, 1879, 0], [785, 3974, 315, 9625, 374, 220, 17]]
    facts = {}
    facts["worker_threads"] = engine.worker_threads()
    facts["cores_here"] = sorted(os.sched_getaffinity(0))
    facts["bind_variable_after_start"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    facts["worker_environment"] = engine.worker_environment(sorted(WORKER_ENVIRONMENT))
    facts["worker_variables_after_start"] = [os.environ.get(name) for name in sorted(WORKER_ENVIRONMENT)]
    # a trainer sends a tied embedding once, without lm_head.weight (as HF checkpoints store it): the
    # engine's head must still follow the embedding
    send_weights_in_buckets(engine, [(n, t) for n, t in model_a.state_dict().items() if n != "lm_head.weight"])

    params = SamplingParams(n=3, temperature=0.8, max_new_tokens=6, seed=11)
    out = engine.generate(prompts, params)
    facts["group_sizes"] = [len(g) for g in out]
    facts["lengths_ok"] = all(1 <= len(c.token_ids) <= 6 and len(c.logprobs) == len(c.token_ids)
                              for g in out for c in g)
    facts["finish_reasons"] = sorted({c.finish_reason for g in out for c in g})
    facts["logprob_max_abs_diff"] = max(
        abs(a - b)
        for p, g in zip(prompts, out) for c in g
        for a, b in zip(c.logprobs, teacher_forced(model_a, p, c.token_ids, 0.8))
    )
    facts["text_is_our_decoding"] = all(c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
                                        for g in out for c in g)
    facts["samples_of_a_group_differ"] = all(len({tuple(c.token_ids) for c in g}) > 1 for g in out)
    facts["same_seed_same_samples"] = [[c.token_ids for c in g] for g in engine.generate(prompts, params)] == \
        [[c.token_ids for c in g] for g in out]

    weights_b = list(model_b.state_dict().items())
    before = engine.check_weights(weights_b)
    facts["check_before_update_equal"] = before.equal
    facts["check_before_update_mismatches"] = len(before.mismatched)
    # small buckets: the staged update must assemble fused layers (qkv, gate_up) across buckets
    facts["update_buckets"] = send_weights_in_buckets(engine, weights_b, bucket_bytes=256 * 1024)
    after = engine.check_weights(iter(weights_b))  # a generator, as weight_sync streams it
    facts["check_after_update_equal"] = after.equal
    facts["check_after_update_max_diff"] = after.max_abs_diff
    facts["check_after_update_report"] = after.mismatched[:5] + after.missing[:5] + after.unsent[:5]
    partial = engine.check_weights(weights_b[1:])  # a weight not sent must be reported
    facts["partial_check_equal"], facts["partial_check_unsent"] = partial.equal, len(partial.unsent)
    try:
        engine.update_weights(weights_b[:1])
        facts["update_without_begin_raises"] = False
    except RuntimeError:
        facts["update_without_begin_raises"] = True
    out_b = engine.generate(prompts, params)
    facts["generation_changed"] = [[c.token_ids for c in g] for g in out_b] != [[c.token_ids for c in g] for g in out]
    facts["logprob_max_abs_diff_after_update"] = max(
        abs(a - b)
        for p, g in zip(prompts, out_b) for c in g
        for a, b in zip(c.logprobs, teacher_forced(model_b, p, c.token_ids, 0.8))
    )
    truncated = engine.generate(prompts[:1], SamplingParams(n=1, max_new_tokens=2, seed=0))[0][0]
    facts["truncated_reason"] = truncated.finish_reason
    # an agent's end token cuts the response and stays in it: make the first sampled token an end token
    engine.eos_token_ids = [truncated.token_ids[0]]
    stopped = engine.generate(prompts[:1], SamplingParams(n=1, max_new_tokens=2, seed=0))[0][0]
    facts["stop_cut"] = [stopped.token_ids, len(stopped.logprobs), stopped.finish_reason, truncated.token_ids[0]]
    facts["worker_growth_over_new_batch_shapes_mib"] = worker_growth_over_new_batch_shapes(engine)
    facts["engine_core_loss"] = lose_engine_core(engine, prompts)
    engine.shutdown()
    with open(out_path, "w") as f:
        json.dump(facts, f, indent=1)


def gemma3_main(out_path, workdir):
    """Gemma 3 in vLLM as the engine actor starts it (config.json only, weights pushed): its log-probs equal
    transformers' on sequences longer than the sliding window, before and after a weight update, and it stops at a
    line break in a line prompt format."""
    from hacpo_megatron.bridge.tokenizers import eos_token_ids, load_tokenizer
    from hacpo_megatron.models.presets import PRESETS
    from hacpo_megatron.rollout import make_engine
    from hacpo_megatron.rollout.base import SamplingParams, send_weights_in_buckets
    from hacpo_megatron.rollout.embedded import hf_model_from_config

    config = dict(PRESETS["tiny-gemma3"])
    model_a, model_b = hf_model_from_config(config, seed=0), hf_model_from_config(config, seed=1)
    os.makedirs(f"{workdir}/config_only")
    with open(f"{workdir}/config_only/config.json", "w") as f:
        json.dump(config, f)
    tokenizer = load_tokenizer("gemma3", "plain")
    ends = sorted(eos_token_ids(tokenizer))
    engine = make_engine("vllm", model_path=f"{workdir}/config_only", eos_token_ids=ends, seed=0, max_model_len=256,
                         load_format="dummy", tokenizer=tokenizer, cpu_threads=2, cpu_kv_cache_gib=0.25)
    cache = engine.llm.llm_engine.vllm_config.cache_config  # the engine core's blocks, reported back at start-up
    prompts = [tokenizer(f"Question: What is {a} + {b}? Count slowly and carefully.\nAnswer:")["input_ids"]
               for a, b in ((3, 4), (12, 9))]
    window = config["sliding_window"]
    params = SamplingParams(n=2, temperature=0.8, max_new_tokens=12, seed=5)
    facts = {"prompt_lengths": [len(p) for p in prompts], "window": window,
             "kv_cache": [cache.kv_cache_memory_bytes, cache.num_gpu_blocks, cache.block_size]}
    send_weights_in_buckets(engine, [(n, t) for n, t in model_a.state_dict().items() if n != "lm_head.weight"])
    out = engine.generate(prompts, params)
    facts["logprob_max_abs_diff"] = max(abs(x - y) for p, g in zip(prompts, out) for c in g
                                        for x, y in zip(c.logprobs, teacher_forced(model_a, p, c.token_ids, 0.8)))
    facts["lengths"] = [len(c.token_ids) for g in out for c in g]
    send_weights_in_buckets(engine, list(model_b.state_dict().items()))
    after = engine.check_weights(list(model_b.state_dict().items()))
    facts["check_after_update_equal"], facts["check_after_update_max_diff"] = after.equal, after.max_abs_diff
    out_b = engine.generate(prompts, params)
    facts["logprob_max_abs_diff_after_update"] = max(
        abs(x - y) for p, g in zip(prompts, out_b) for c in g
        for x, y in zip(c.logprobs, teacher_forced(model_b, p, c.token_ids, 0.8)))
    # a line break ends the answer. Greedy decoding of a prompt without one picks some token t first; the lm head is
    # the tied embedding, so giving the line break twice t's row doubles t's (positive, the largest) logit for it
    line_break = tokenizer.encode("\n", add_special_tokens=False)[0]
    one_line = [tokenizer("Question: What is 3 + 4? Answer:")["input_ids"]]
    greedy = SamplingParams(n=1, greedy=True, max_new_tokens=12, seed=0)
    first = engine.generate(one_line, greedy)[0][0].token_ids[0]
    # the whole model: CPU reloads it
    weights = {n: t for n, t in model_b.state_dict().items() if n != "lm_head.weight"}
    embed = weights["model.embed_tokens.weight"].clone()
    embed[line_break] = 2 * embed[first]
    send_weights_in_buckets(engine, list(dict(weights, **{"model.embed_tokens.weight": embed}).items()))
    stopped = engine.generate(one_line, greedy)[0][0]
    facts["stopped"] = [stopped.token_ids, stopped.finish_reason, line_break, first]
    engine.shutdown()
    with open(out_path, "w") as f:
        json.dump(facts, f, indent=1)


if __name__ == "__main__":
    import faulthandler

    faulthandler.dump_traceback_later(600, exit=True)  # a hang shows where, well before test_vllm's timeout
    if sys.argv[3:] == ["gemma3"]:
        gemma3_main(sys.argv[1], sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2])
