"""The stronger tiny states the gain rule makes, seeds 1-10 (docs/study.md, "The tiny state setting").

configs/study/state_regime.yaml's qwen3-b runs qwen3-a's warm-up on past qwen3-a's stop until its sampled accuracy
on the stop rule's 128 training problems has risen by 0.1 (agents[].sft_warmup_gain_beyond). This warms up both
agents of every seed as a cell would (or reads them from the warm-up cache) and prints, per seed, where each stops.

    PYTHONPATH=. python studies/tiny_state/states/gain_states.py > studies/tiny_state/states/gain_states.txt
"""
import json
import os

import torch

from hacpo_megatron.config import load_config
from hacpo_megatron.models.presets import load_hf_config_dict
from hacpo_megatron.training import warmup
from hacpo_megatron.training.agents import init_seed

torch.set_num_threads(1)  # the warm-up cache's thread count: the same weights

print("| seed | weaker stops at step | weaker, probe | stronger: steps past | stronger, probe |"
      " stronger, 256 training problems | stronger, its task's held-out |")
print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for seed in range(1, 11):
    cfg = load_config("configs/study/state_regime.yaml", [f"run.seed={seed}"])
    weaker, stronger = cfg.agents
    for k, agent in enumerate(cfg.agents):
        warmup.agent_warmup(cfg, agent, load_hf_config_dict(agent.model), init_seed(cfg, k))
    cache = cfg.train.sft_warmup_cache
    infos = [json.load(open(os.path.join(cache, key, warmup.INFO_FILE))) for key in os.listdir(cache)
             if os.path.isfile(os.path.join(cache, key, warmup.INFO_FILE))]
    [info] = [i for i in infos if i["seed"] == init_seed(cfg, 1) and i.get("stop_gain")
              and i["task"] == warmup.agent_warmup_plan(cfg, stronger)[0]
              and i["stop_gain"][1] == stronger.sft_warmup_gain_beyond]
    start = info["stop_gain"][0]
    print(f"| {seed} | {start} | {info['gain_from_accuracy']:.3f} | {info['steps_run'] - start} |"
          f" {info['gain_reached_accuracy']:.3f} | {info['metrics']['train']['p_exact']:.3f} |"
          f" {info['metrics']['eval']['p_exact']:.3f} |")
