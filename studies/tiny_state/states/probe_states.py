"""How far past the weaker tiny state should the stronger one be? (docs/study.md, "The tiny state setting")

Replays the weaker state's warm-up (configs/study/state_regime.yaml's qwen3-a, seed 1) step by step and, for the
states 1-10 steps past where it stops, measures on all training problems the weaker state's cross ratio on the
stronger's right answers, (pi_weaker / pi_stronger) ** (1 / L) over the L answer tokens, each answer weighted by the
stronger's probability of sampling it at T = 1: the share inside HACPO's cross clip [0.83, 1] at step 1 is what the
gate asks to be >= 50 %. Teacher-forced, so free of sampling noise; the gate itself is read in the HACPO cell.

    PYTHONPATH=. python studies/tiny_state/states/probe_states.py > studies/tiny_state/states/probe.txt
"""
import torch

from hacpo_megatron.bridge.tokenizers import load_tokenizer, pad_token_id
from hacpo_megatron.config import load_config
from hacpo_megatron.data import load_prompts
from hacpo_megatron.models.presets import load_hf_config_dict
from hacpo_megatron.rollout.embedded import hf_model_from_config
from hacpo_megatron.training import warmup
from hacpo_megatron.training.agents import init_seed

CLIP_LOW = 0.83  # the cross clip's lower bound at step 1 (the HACPO cell's cross_clip_lower_bound)
LAST = 10  # steps past the weaker state's stop

torch.set_num_threads(1)  # the warm-up cache's thread count: the same weights
cfg = load_config("configs/study/state_regime.yaml", ["run.seed=1"])
weaker = cfg.agents[0]
hf_config = load_hf_config_dict(weaker.model)
task, stop_accuracy = warmup.agent_warmup_plan(cfg, weaker)
t = cfg.train
settings = dict(steps=t.sft_warmup_steps, batch_size=t.sft_warmup_batch_size, lr=t.sft_warmup_lr,
                seed=init_seed(cfg, 0))

# 1. where the weaker state's warm-up stops (by its own rule)
_, info = warmup.train_warmup_model(hf_config, weaker.tokenizer_source, task, stop_accuracy=stop_accuracy,
                                    measure=False, **settings)
stop = info["steps_run"]

# 2. the same warm-up, every step's weights up to LAST steps past that (the checks do not change the trajectory)
snapshots = {}
warmup.STOP_CHECK_EVERY = 1


def snapshot(model, examples, pad_id, **kwargs):
    snapshots[len(snapshots) + 1] = {k: v.clone() for k, v in model.state_dict().items()}
    return {"p_exact": float(len(snapshots) >= stop + LAST)}


warmup.answer_metrics = snapshot
warmup.train_warmup_model(hf_config, weaker.tokenizer_source, task, stop_accuracy=1.0, measure=False, **settings)

# 3. the weaker state's ratio on the stronger's right answers, on every training problem of the RL data
tokenizer = load_tokenizer(weaker.tokenizer_source)
examples = warmup.build_examples(tokenizer, load_prompts(cfg.data.train, split="train"))
pad = pad_token_id(tokenizer)


def answer_logprobs(state):
    model = hf_model_from_config(hf_config, seed=0)
    model.load_state_dict(state, strict=False)
    model.eval()
    logprobs, lengths = [], []
    with torch.no_grad():
        for start in range(0, len(examples), 64):
            chunk = examples[start:start + 64]
            ids, attention, rows, cols, targets = warmup.collate(chunk, pad)
            token_lp = torch.log_softmax(warmup.answer_logits(model, ids, attention, rows, cols).float(), -1)
            token_lp = token_lp.gather(-1, targets[:, None])[:, 0]
            logprobs.append(torch.zeros(len(chunk)).index_add_(0, rows, token_lp))
            lengths.append(torch.zeros(len(chunk)).index_add_(0, rows, torch.ones_like(token_lp)))
    return torch.cat(logprobs), torch.cat(lengths)


weak_lp, length = answer_logprobs(snapshots[stop])
print(f"weaker state: warm-up stops at step {stop}; {len(examples)} training problems ({cfg.data.train})")
print("| steps past | weaker p(right) | stronger p(right) | mean ratio, right answers | inside [0.83, 1] | below |")
print("| ---: | ---: | ---: | ---: | ---: | ---: |")
for past in range(1, LAST + 1):
    strong_lp, _ = answer_logprobs(snapshots[stop + past])
    ratio, weight = ((weak_lp - strong_lp) / length).exp(), strong_lp.exp()

    mean, inside, below = (float((weight * v.float()).sum() / weight.sum())
                           for v in (ratio, (ratio >= CLIP_LOW) & (ratio <= 1), ratio < CLIP_LOW))
    print(f"| {past} | {weak_lp.exp().mean():.3f} | {weight.mean():.3f} | {mean:.3f} | {inside:.2f} | {below:.2f} |")
