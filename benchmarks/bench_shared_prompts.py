"""Shared-prompt rows against one row per sequence: a HACPO learner's training update and log-prob pass, in one run.

    torchrun --nproc_per_node 1 benchmarks/bench_shared_prompts.py [--model smollm2-135m-instruct] [--threads 2]
             [--prompts 8] [--samples 8] [--prompt-length 75] [--own-length 50] [--cross-length 3]
             [--micro-batch 8] [--rounds 2]

The real-model run's learner (docs/real_model.md), one step's rows: B prompts, each with G own answers and
G answers of another agent retokenized (SmolLM2 beside the tiny Qwen3: ~75-token chat prompts, own answers
of ~50 tokens, the other agent's bare numbers of ~3), random token ids, lengths drawn around those means.
The same pretrained weights go into two trainers through the project's own path (build_agent_model +
AgentTrainer, HACPO, M = 2 updates of B prompts x G answers, as the run's `train.mini_batch_size: 8` makes
them), one with `train.share_prompts: false` (every sequence a row of its own: its prompt computed once per
answer) and one with `true` (a micro-batch's answers to one prompt share one row: the prompt computed
once). Rounds alternate between the two, so the machine's load hits both alike; the fastest round of each
is kept. Reported: seconds of the old-log-prob pass over the own
answers and of the step's updates, the updates' model FLOPs rate and MFU as the trainer records them
(`perf/*`, a GEMM peak timed in the run), and how far the two trainers' weights are apart after the same
updates (the same math: float reassociation only).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hacpo_megatron.algorithms.registry import algorithm_spec  # noqa: E402
from hacpo_megatron.checkpoint.gguf_sources import resolve_model_source  # noqa: E402
from hacpo_megatron.checkpoint.hf_io import HFWeights  # noqa: E402
from hacpo_megatron.checkpoint.hf_mapping import load_hf_state_dict_into_model  # noqa: E402
from hacpo_megatron.config.schema import AgentConfig, AlgorithmConfig, Config, ParallelConfig, TrainConfig  # noqa: E402
from hacpo_megatron.models.build import build_agent_model  # noqa: E402
from hacpo_megatron.models.presets import load_hf_config_dict  # noqa: E402
from hacpo_megatron.parallel.groups import create_agent_groups, init_distributed  # noqa: E402
from hacpo_megatron.training.batch import SequenceRow, UpdateSchedule, mini_batches  # noqa: E402
from hacpo_megatron.training.trainer import AgentTrainer  # noqa: E402

MODES = {"one row per sequence": False, "shared prompts": True}


def step_sequences(args, vocab: int, seed: int = 0):
    """(prompt, own answers, other agent's answers) per prompt: lengths uniform within +-40 % of the means."""
    g = torch.Generator().manual_seed(seed)

    def ids(mean: int) -> list:
        length = int(torch.randint(max(1, round(0.6 * mean)), round(1.4 * mean) + 1, (), generator=g))
        return torch.randint(3, vocab, (length,), generator=g).tolist()

    return [(ids(args.prompt_length), [ids(args.own_length) for _ in range(args.samples)],
             [ids(args.cross_length) for _ in range(args.samples)]) for _ in range(args.prompts)]


def learner_rows(batch, own_logprobs) -> list:
    """A HACPO learner's rows: own answers with their old log-probs, the other agent's a little less likely
    under their source (inside the cross clip), advantages of both signs."""
    rows, k = [], 0
    for b, (prompt, own, cross) in enumerate(batch):
        for i, (answer, other) in enumerate(zip(own, cross)):
            sign = 1.0 if (b + i) % 2 else -1.0
            old = float(own_logprobs.sums[k] / own_logprobs.lengths[k])
            rows.append(SequenceRow(prompt_ids=prompt, response_ids=answer, advantage=sign, old_seq_logp=old,
                                    is_cross=False, source=0, prompt_index=b, sample_index=i))
            rows.append(SequenceRow(prompt_ids=prompt, response_ids=other, advantage=-sign, old_seq_logp=-9.0,
                                    is_cross=True, source=1, prompt_index=b, sample_index=i))
            k += 1
    return rows


def update_schedule(args) -> UpdateSchedule:
    """The run's: mini-batches of all B prompts x G answers, so a learner of two sources makes M = 2 updates."""
    return UpdateSchedule(num_prompts=args.prompts, samples_per_prompt=args.samples, sources=(0, 1),
                          rows_per_update=args.prompts * args.samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=75)
    parser.add_argument("--own-length", type=int, default=50)
    parser.add_argument("--cross-length", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    init_distributed()
    folder = str(resolve_model_source(args.model))
    hf_config = load_hf_config_dict(folder)
    [parallel] = create_agent_groups([AgentConfig(name="a", model=folder, parallel=ParallelConfig(first_rank=0))])
    trainers = {}
    for mode, share in MODES.items():
        agent = build_agent_model(hf_config, parallel, seed=1)
        load_hf_state_dict_into_model(agent.model, HFWeights(folder), hf_config, parallel)
        trainers[mode] = AgentTrainer(agent, algorithm_spec(AlgorithmConfig(name="hacpo")),
                                      Config(train=TrainConfig(lr=1e-6, micro_batch_size=args.micro_batch,
                                                                               share_prompts=share)))
    batch = step_sequences(args, hf_config["vocab_size"])
    own = [(prompt, answer) for prompt, answers, _ in batch for answer in answers]
    schedule = update_schedule(args)
    best = {mode: {"logprob": float("inf"), "train": float("inf")} for mode in MODES}
    for round_index in range(args.rounds):
        for mode, trainer in trainers.items():
            start = time.perf_counter()
            own_logprobs = trainer.sequence_logprobs(own)
            logprob_seconds = time.perf_counter() - start
            rows = learner_rows(batch, own_logprobs)
            start = time.perf_counter()
            metrics = trainer.train_step(mini_batches(rows, schedule))
            train_seconds = time.perf_counter() - start
            print(f"round {round_index + 1}, {mode}: log-prob {logprob_seconds:.2f} s, updates {train_seconds:.2f} s",
                  flush=True)
            if train_seconds < best[mode]["train"]:
                best[mode].update(train=train_seconds,
                                  flops=sum(m["perf/model_flops_per_s"] for m in metrics) / len(metrics),
                                  mfu=sum(m["perf/mfu"] for m in metrics) / len(metrics))
            best[mode]["logprob"] = min(best[mode]["logprob"], logprob_seconds)
    plain, shared = (trainers[mode].ddp_model.module.parameters() for mode in MODES)
    apart = max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(plain, shared))
    prompt_tokens = sum(len(p) for p, _, _ in batch)
    answer_tokens = sum(len(a) for _, own_, cross in batch for a in own_ + cross)
    print(f"\n{args.model}, {args.threads} threads, {args.prompts} prompts x ({args.samples} own + "
          f"{args.samples} other) answers: {prompt_tokens} prompt tokens (x {2 * args.samples} without sharing), "
          f"{answer_tokens} answer tokens; "
          f"micro-batches of {args.micro_batch}; best of {args.rounds} interleaved rounds; weights after "
          f"{args.rounds} steps apart by at most {apart:.1e}")
    print("| | " + " | ".join(MODES) + " | shared / plain time |")
    print("| --- |" + " --- |" * (len(MODES) + 1))
    a, b = (best[mode] for mode in MODES)
    print(f"| old-log-prob pass (own answers), s | {a['logprob']:.2f} | {b['logprob']:.2f} | "
          f"{b['logprob'] / a['logprob']:.2f} |")
    print(f"| training updates (M = 2), s | {a['train']:.2f} | {b['train']:.2f} | {b['train'] / a['train']:.2f} |")
    print(f"| model GFLOP/s of the updates | {a['flops'] / 1e9:.0f} | {b['flops'] / 1e9:.0f} | - |")
    print(f"| MFU of the updates | {100 * a['mfu']:.0f} % | {100 * b['mfu']:.0f} % | - |")


if __name__ == "__main__":
    main()
