"""The response tokens' log-probs through one fused function against the composed ops, in a learner's update.

    torchrun --nproc_per_node 1 benchmarks/bench_target_logprob.py [--model tiny-qwen3] [--threads 2]
             [--own-length 3] [--cross-length 66] [--rounds 3]

The defaults are the real-model run's tiny Qwen3 learner (docs/real_model.md): 8 prompts of ~75 tokens, its
own 8 bare-number answers and SmolLM2's 8 sentences (~66 Qwen3 tokens) per prompt, M = 2 HACPO updates, a
151,936-word output layer. `--model .cache/models/smollm2-135m-instruct --own-length 70 --cross-length 3`
is SmolLM2's learner (49,152 words). Rows and update grid come from bench_shared_prompts.py (random ids).

Two trainers from the same weights: "composed" computes log softmax(logits / T)[target] as the code did
before (a select of the logits, divide, log_softmax, gather; every one writes a [tokens, vocabulary] tensor
forward and backward), "fused" with models/logprobs.py's TargetLogProb (one buffer, its gradient made in
place). Rounds alternate between them; the first round is a warm-up, the fastest later round of each is
kept. Reported: seconds of the step's updates, their ratio, and how far the trainers' weights are apart
after the same updates (float reassociation only).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_shared_prompts  # noqa: E402
from hacpo_megatron.algorithms.registry import algorithm_spec  # noqa: E402
from hacpo_megatron.config.schema import AgentConfig, AlgorithmConfig, ParallelConfig  # noqa: E402
from hacpo_megatron.models import logprobs  # noqa: E402
from hacpo_megatron.models.build import build_agent_model  # noqa: E402
from hacpo_megatron.models.presets import load_hf_config_dict  # noqa: E402
from hacpo_megatron.parallel.groups import create_agent_groups, init_distributed  # noqa: E402
from hacpo_megatron.training.batch import mini_batches  # noqa: E402
from hacpo_megatron.training.trainer import AgentTrainer, TrainHyperparams  # noqa: E402


def composed_target_logprob(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """The code before TargetLogProb, op for op (the select stood for `response_logits[:, 0]`)."""
    scaled = logits.unsqueeze(1)[:, 0].float() / temperature
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets[:, None])[:, 0]


MODES = {"composed": composed_target_logprob, "fused": logprobs.TargetLogProb.apply}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-qwen3", help="a preset name or a Hugging Face folder")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--own-length", type=int, default=3)
    parser.add_argument("--cross-length", type=int, default=66)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    steps = argparse.Namespace(prompts=8, samples=8, prompt_length=75, own_length=args.own_length,
                               cross_length=args.cross_length)
    torch.set_num_threads(args.threads)
    init_distributed()
    hf_config = load_hf_config_dict(args.model)
    [parallel] = create_agent_groups([AgentConfig(name="a", model=args.model, parallel=ParallelConfig(first_rank=0))])
    trainers = {mode: AgentTrainer(build_agent_model(hf_config, parallel, seed=1),
                                   algorithm_spec(AlgorithmConfig(name="hacpo")),
                                   TrainHyperparams(lr=1e-6, micro_batch_size=8, share_prompts=True))
                for mode in MODES}
    batch = bench_shared_prompts.step_sequences(steps, hf_config["vocab_size"])
    own = [(prompt, answer) for prompt, answers, _ in batch for answer in answers]
    schedule = bench_shared_prompts.update_schedule(steps)
    best = {}
    for round_index in range(args.rounds):
        for mode, trainer in trainers.items():
            logprobs.TargetLogProb.apply = MODES[mode]  # what token_logprobs_from_logits calls at TP = 1
            rows = bench_shared_prompts.learner_rows(batch, trainer.sequence_logprobs(own))
            start = time.perf_counter()
            trainer.train_step(mini_batches(rows, schedule))
            seconds = time.perf_counter() - start
            print(f"round {round_index + 1}, {mode}: updates {seconds:.2f} s", flush=True)
            if round_index > 0 or args.rounds == 1:
                best[mode] = min(best.get(mode, float("inf")), seconds)
    logprobs.TargetLogProb.apply = MODES["fused"]
    composed, fused = (trainers[mode].ddp_model.module.parameters() for mode in MODES)
    apart = max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(composed, fused))
    answer_tokens = sum(len(a) for _, own_, cross in batch for a in own_ + cross)
    print(f"\n{args.model} (vocabulary {hf_config['vocab_size']:,}), {args.threads} threads, 8 prompts x (8 own + 8 "
          f"other) answers, {answer_tokens} answer tokens, M = 2 updates; fastest of rounds 2-{args.rounds}; weights "
          f"after {args.rounds} steps apart by at most {apart:.1e}")
    print(f"| updates, composed (s) | updates, fused (s) | fused / composed |\n| --- | --- | --- |\n"
          f"| {best['composed']:.2f} | {best['fused']:.2f} | {best['fused'] / best['composed']:.2f} |")


if __name__ == "__main__":
    main()
