"""One learner's HACPO updates two ways, same weights, same rows: what one implementation choice costs.

    torchrun --nproc_per_node 1 benchmarks/bench_learner_update.py --compare logprob
             [--model tiny-qwen3] [--threads 2] [--own-length 3] [--cross-length 66] [--micro-batch-size 8]
             [--rounds 3]

The defaults are the real-model run's tiny Qwen3 learner (docs/real_model.md): 8 prompts of ~75 tokens, its
own 8 bare-number answers and SmolLM2's 8 sentences (~66 Qwen3 tokens) per prompt, M = 2 HACPO updates, a
151,936-word output layer. `--model .cache/models/smollm2-135m-instruct --own-length 70 --cross-length 3`
is SmolLM2's learner (49,152 words, 30 layers). Rows and update grid come from bench_shared_prompts.py
(random ids).

    --compare logprob     "composed": log softmax(logits / T)[target] as the code did before TargetLogProb
                          (select, divide, log_softmax, gather: each writes a [tokens, vocabulary] tensor
                          forward and backward); "fused": models/logprobs.py's TargetLogProb

(`--compare attention`, megatron's masked attention over whole shared-prompt rows against dense blocks, went with
issue 42: no row builds a dense mask now; `bench_megatron.py --attention` compares train.attention's kernels.)

Rounds alternate between the two; the first round is a warm-up, the fastest later round of each is kept.
Reported: seconds of the step's updates, their ratio, and how far the two trainers' weights are apart after
the same updates (float reassociation only).
"""
from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_shared_prompts  # noqa: E402
from hacpo_megatron.algorithms.registry import algorithm_spec  # noqa: E402
from hacpo_megatron.config.schema import AgentConfig, AlgorithmConfig, Config, ParallelConfig, TrainConfig  # noqa: E402
from hacpo_megatron.models import logprobs  # noqa: E402
from hacpo_megatron.models.build import build_agent_model  # noqa: E402
from hacpo_megatron.models.presets import load_hf_config_dict  # noqa: E402
from hacpo_megatron.parallel.groups import create_agent_groups, init_distributed  # noqa: E402
from hacpo_megatron.training.batch import mini_batches  # noqa: E402
from hacpo_megatron.training.trainer import AgentTrainer  # noqa: E402


def composed_target_logprob(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """The code before TargetLogProb, op for op (the select stood for `response_logits[:, 0]`)."""
    scaled = logits.unsqueeze(1)[:, 0].float() / temperature
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets[:, None])[:, 0]


@contextmanager
def replaced(owner, name: str, value):
    """`owner.name` is `value` inside the block (a benchmark-only switch between implementations)."""
    missing = object()
    own = owner.__dict__.get(name, missing)  # an inherited attribute goes back to being inherited
    setattr(owner, name, value)
    try:
        yield
    finally:
        if own is missing:
            delattr(owner, name)
        else:
            setattr(owner, name, own)


@contextmanager
def as_is():
    yield


COMPARISONS = {  # the older implementation first
    "logprob": {"composed": lambda: replaced(logprobs.TargetLogProb, "apply", composed_target_logprob),
                "fused": as_is},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", choices=sorted(COMPARISONS), required=True)
    parser.add_argument("--model", default="tiny-qwen3", help="a preset name or a Hugging Face folder")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--own-length", type=int, default=3)
    parser.add_argument("--cross-length", type=int, default=66)
    parser.add_argument("--micro-batch-size", type=int, default=8, help="train.micro_batch_size")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    modes = COMPARISONS[args.compare]
    steps = argparse.Namespace(prompts=8, samples=8, prompt_length=75, own_length=args.own_length,
                               cross_length=args.cross_length)
    torch.set_num_threads(args.threads)
    init_distributed()
    hf_config = load_hf_config_dict(args.model)
    [parallel] = create_agent_groups([AgentConfig(name="a", model=args.model, parallel=ParallelConfig(first_rank=0))])
    trainers = {mode: AgentTrainer(build_agent_model(hf_config, parallel, seed=1),
                                   algorithm_spec(AlgorithmConfig(name="hacpo")),
                                   Config(train=TrainConfig(lr=1e-6, micro_batch_size=args.micro_batch_size,
                                                            share_prompts=True)))
                for mode in modes}
    batch = bench_shared_prompts.step_sequences(steps, hf_config["vocab_size"])
    own = [(prompt, answer) for prompt, answers, _ in batch for answer in answers]
    schedule = bench_shared_prompts.update_schedule(steps)
    best = {}
    for round_index in range(args.rounds):
        for mode, trainer in trainers.items():
            with modes[mode]():
                rows = bench_shared_prompts.learner_rows(batch, trainer.sequence_logprobs(own))
                start = time.perf_counter()
                trainer.train_step(mini_batches(rows, schedule))
                seconds = time.perf_counter() - start
            print(f"round {round_index + 1}, {mode}: updates {seconds:.2f} s", flush=True)
            if round_index > 0 or args.rounds == 1:
                best[mode] = min(best.get(mode, float("inf")), seconds)
    old, new = modes
    params = [trainers[mode].ddp_model.module.parameters() for mode in modes]
    apart = max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(*params))
    answer_tokens = sum(len(a) for _, own_, cross in batch for a in own_ + cross)
    print(f"\n{args.model} (vocabulary {hf_config['vocab_size']:,}), {args.threads} threads, 8 prompts x (8 own + 8 "
          f"other) answers, micro-batches of {args.micro_batch_size}, {answer_tokens} answer tokens, M = 2 updates; "
          f"fastest of rounds 2-{args.rounds}; weights "
          f"after {args.rounds} steps apart by at most {apart:.1e}")
    print(f"| updates, {old} (s) | updates, {new} (s) | {new} / {old} |\n| --- | --- | --- |\n"
          f"| {best[old]:.2f} | {best[new]:.2f} | {best[new] / best[old]:.2f} |")


if __name__ == "__main__":
    main()
