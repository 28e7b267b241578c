"""The run configuration: typed dataclasses, one per YAML section. Defaults are the paper's settings.

Every field here is a key a YAML file may set; anything else is rejected with its file and line.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Literal, Optional


@dataclass
class RunConfig:
    name: str = "hacpo"
    seed: int = 1234
    output_dir: Optional[str] = None  # default: runs/<name>
    total_steps: int = 100
    # auto: the GPUs where there are any; cpu: none, even on a GPU machine (the launcher hides them from the ranks and
    # all they start); cuda: a GPU, or a config error
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # debug modes (rollout/replay.py): train (the algorithm); rollout_only (engines and rewards, no learner: time
    # the rollout, save its answers with --save-rollouts DIR); train_only (no engine, no Ray: train on the answers
    # and rewards an earlier run saved, --load-rollouts DIR, e.g. to replay and debug a bad step)
    mode: Literal["train", "rollout_only", "train_only"] = "train"
    # After SIGTERM (a preemption, tools/compare_algorithms.py stopping a cell) the ranks finish their step and save a
    # checkpoint; the launcher's torchrun waits this long for them before it SIGKILLs them. torchrun's own default,
    # 30 s, is shorter than a real model's step: a step cut short is lost back to the last checkpoint
    stop_grace_s: int = 3600


@dataclass
class ParallelConfig:
    tensor: int = 1
    pipeline: int = 1
    data: int = 1
    # Expert parallelism of a mixture-of-experts model (docs/moe.md): each layer's experts split over EP ranks. It takes
    # no ranks of its own: megatron lays EP x expert_tensor over each pipeline stage's tensor x data ranks, which it
    # must divide, and EP must divide the experts. 1: every rank holds every expert; a dense model's agent leaves it 1
    expert: int = 1
    # Tensor parallelism inside each expert (megatron's expert_tensor_parallel_size): only 1 so far, more is refused
    # (docs/moe.md)
    expert_tensor: int = 1
    # First global rank of this agent's ranks. None: agents are laid out one after another.
    # Agents given overlapping ranks time-share those devices.
    first_rank: Optional[int] = None

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline * self.data


@dataclass
class MoEConfig:
    # Weight of the routers' load-balancing loss: megatron's aux_loss (E * sum_e f_e P_e per layer, 1 when routing is
    # even), summed over layers, each micro-batch's weighted by its share of the update's tokens (docs/moe.md). 0: no
    # such loss (the routers learn from the policy loss alone), as slime's and miles' Qwen3-30B-A3B RL scripts run;
    # the checkpoint's router_aux_loss_coef is not applied
    aux_loss_coeff: float = 0.0
    # true: the routers' weights take no gradient and never change (the experts and all else train); needs
    # aux_loss_coeff 0
    freeze_router: bool = False
    # routing replay (docs/moe.md): off (every pass routes live); r2 (the updates route the agent's own answers as the
    # step's old-log-prob pass did); r3 (the old-log-prob pass and the updates route them as the engine did when it
    # sampled them: the embedded engine only). Other agents' answers: r2's routes where the learner has its own pass
    # over them (Naive), else live
    routing_replay: Literal["off", "r2", "r3"] = "off"


@dataclass
class AgentConfig:
    name: str = ""
    # built-in preset name (hacpo_megatron/models/presets.py), a folder with config.json, or a known GGUF model
    # name ("smollm2-135m-instruct", converted once into .cache/models); empty: init_from's architecture
    model: str = ""
    # qwen3 | llama3.2 | gpt2 | smollm2 | gemma3 | a folder; None: the model/init_from folder
    tokenizer: Optional[str] = None
    # how the agent is asked (bridge/prompt_formats.py): chat (its tokenizer's chat template), plain
    # ("Question: ...\nAnswer:", answers are one line) or few_shot:<file> (worked examples, then plain): a base
    # model has no chat template. Only the answers' text crosses the bridge, so agents may be asked differently.
    prompt_format: str = "chat"
    init_from: Optional[str] = None  # Hugging Face folder or known GGUF model name; None: random init
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    engine: Literal["embedded", "vllm", "sglang"] = "embedded"
    lr: Optional[float] = None  # overrides train.lr for this agent
    # override train.sft_warmup_task / sft_warmup_stop_accuracy for this agent: agents warmed up on different
    # problems, or for longer, start RL knowing different things (configs/study/)
    sft_warmup_task: Optional[str] = None
    sft_warmup_stop_accuracy: Optional[float] = None
    # another agent's name: start from its random initialisation and warm-up seed (run.seed + that agent's index)
    # instead of this one's own. Same model, same warm-up task, a later stop: this agent's warm-up passes through the
    # other's warmed-up weights and goes on, one model at two states (configs/study/state_regime.yaml)
    same_init_as: Optional[str] = None
    # with same_init_as: warm up on the named agent's problems, on past where its warm-up stopped until the sampled
    # accuracy on the stop rule's training problems has risen by this much (checked every step; no stop accuracy of
    # this agent's own): a state further along the same trajectory and measurably stronger
    sft_warmup_gain_beyond: Optional[float] = None
    # A mixture-of-experts agent's routers (docs/moe.md); a dense model's agent leaves these keys at their defaults
    moe: MoEConfig = field(default_factory=MoEConfig)

    @property
    def tokenizer_source(self) -> str:
        """Where its tokenizer comes from (the one rule): `tokenizer`, else the weights' folder, else the model's."""
        return self.tokenizer or self.init_from or self.model


@dataclass
class AlgorithmConfig:
    name: Literal["hacpo", "naive", "gspo", "gspo_x2", "grpo"] = "hacpo"
    alpha: float = 1.0  # exponential importance sampling exponent
    delta: float = 0.2  # cross-agent clip lower bound starts at 1 - delta
    delta_step: float = 0.025  # ... and rises by delta_step per mini-batch update
    # Beyond the paper, off by default (docs/algorithm.md): lower the cross clip's bound to the q-quantile of the
    # other agents' ratios s that the learner measured in its previous step, lo = min(lo_m, that quantile), so that
    # about 1 - q of a distant family's answers can pass. HACPO with the cross clip only.
    cross_clip_fit_quantile: Optional[float] = None
    clip_low: float = 3e-4  # GSPO clip on own responses
    clip_high: float = 4e-4
    grpo_clip_low: float = 0.2
    grpo_clip_high: float = 0.28
    # HACPO ablations; None keeps what the algorithm name implies.
    capability_aware_advantage: Optional[bool] = None
    gradient_modulation: Optional[bool] = None
    cross_clip: Optional[bool] = None
    stepwise_clip: Optional[bool] = None
    # Old log-prob of another agent's response: "source" (its sum / L_j) or "learner" (the learner's own,
    # before the step's updates). None keeps what the algorithm implies: hacpo source, naive learner.
    cross_old_logprob: Optional[Literal["source", "learner"]] = None
    omega_clamp: Optional[List[float]] = field(default_factory=lambda: [0.1, 10.0])  # null: no clamp
    capability_window: int = 5  # W: steps averaged into P_k (the authors' launch scripts; the paper says none)
    advantage_eps: float = 1e-6
    kl_coef: float = 0.0  # low-var KL to the initial policy on own responses (authors: 0.001)


@dataclass
class RolloutConfig:
    samples_per_prompt: int = 8  # G
    temperature: float = 1.0
    top_p: float = 1.0
    max_prompt_length: int = 1024  # tokens (chat-rendered, every agent's tokenizer); longer prompts are skipped
    max_response_length: int = 4096  # new tokens; vLLM/SGLang context = max_prompt_length + max_response_length
    gpu_memory_utilization: float = 0.5  # vLLM's gpu_memory_utilization / SGLang's mem_fraction_static
    # vLLM on CPU: each engine's KV cache, allocated whole at start-up (vLLM's kv_cache_memory_bytes; the
    # environment's VLLM_CPU_KVCACHE_SPACE, whole GiB, wins if set). A real pair's two engines and two
    # trainers share one machine's memory: size it to what a step's answers need (docs/rollout.md)
    cpu_kv_cache_gib: float = 1.0
    # how weights reach the engines after each step's updates (rollout/transport.py): a torch.distributed group of
    # the engine rank and the engine's processes (gloo on CPU, NCCL on GPU); object_store: bytes through Ray
    # (the fallback); cuda_ipc: engine on the trainer's GPU (run once on an H200: docs/gpu.md)
    weight_transport: Literal["process_group", "object_store", "cuda_ipc"] = "process_group"
    # where the old (behaviour-policy) log-probs of an agent's own responses come from: "trainer" recomputes
    # them with the trainer's weights every step (an extra forward pass); "engine" takes the engine's own,
    # after the trainer's pass on the run's first step found them within a tenth of the clip range
    # (training/step_data.py: check_engine_logprobs), saving that pass on every later step
    old_logprobs: Literal["trainer", "engine"] = "trainer"
    # k: the engines answer steps t+1 .. t+k while the learners train step t (orchestrator/rollout_pipeline.py);
    # no answer is trained on that is more than k weight versions old. 0: the synchronous loop, the paper's algorithm.
    # k >= 1 corrects for the older weights (docs/algorithm.md, "Answers from older weights")
    max_staleness: int = 0
    # threads of each engine on a CPU machine: the embedded engine's torch threads, vLLM's CPU worker's
    # OpenMP threads (bound to the first cores the actor may use, unless VLLM_CPU_OMP_THREADS_BIND is set;
    # rollout/vllm_engine.py). The step's phases alternate, so engines and trainer ranks take turns on the
    # same cores (benchmarks/bench_threads.py)
    cpu_threads: int = 1


@dataclass
class DataConfig:
    train: str = "synthetic:arithmetic"  # a .jsonl/.json/.parquet file, synthetic:<task> or reasoning_gym:<generator>
    eval: Optional[str] = "synthetic:arithmetic"
    prompt_batch_size: int = 128  # B
    eval_every: int = 10  # steps; 0 disables
    eval_max_prompts: Optional[int] = None
    eval_samples: int = 1  # answers per held-out prompt; accuracy is their mean (avg@k)
    eval_greedy: bool = True  # greedy answers; false: sampled at rollout.temperature with a fixed seed
    shuffle: bool = True


@dataclass
class RewardConfig:
    function: str = "hacpo_megatron.rewards.math_verify.compute_score"
    timeout_s: float = 5.0  # per response, in CPU seconds of the scoring worker: load does not change a score
    num_workers: int = 2
    range: Optional[List[float]] = field(default_factory=lambda: [0.0, 1.0])  # null: any finite reward


@dataclass
class TrainConfig:
    # Prompts x G responses per update, for every algorithm (verl's and the paper's meaning): a learner
    # with S * B * G' rows makes M = S * B * G' / (mini_batch_size * G) updates (training/batch.py).
    mini_batch_size: int = 64
    micro_batch_size: int = 4  # sequences per forward/backward
    # The responses to one prompt share a row of a micro-batch: the prompt is computed once for all of them,
    # each response attends to it and to itself only (exact; models/packing.py). Applies where the attention
    # takes a mask (megatron's local layers); with Transformer Engine's, one sequence per row as with false.
    share_prompts: bool = True
    # The core attention's kernel (models/attention.py): local (megatron's unfused attention on plain rows),
    # sdpa (torch's fused SDPA: flash/cuDNN on a GPU), flex (FlexAttention: one kernel for every mask; no CPU
    # backward), auto (a GPU: SDPA where rows are plain causal, FlexAttention otherwise; a CPU: local).
    attention: Literal["auto", "flex", "sdpa", "local"] = "auto"
    # A token budget per micro-batch (verl's ppo_max_token_len_per_gpu): sequences packed end to end up to this many
    # tokens instead of micro_batch_size padded rows (no padding FLOPs; the update is the same). None: off.
    max_tokens_per_micro_batch: Optional[int] = None
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables
    params_dtype: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    # torch threads of each trainer rank on a CPU machine; None: torchrun's default (1 per rank when a
    # machine runs several). Worth more than cores / ranks when one agent's update dominates the step (a
    # real model beside a tiny one): the other ranks mostly wait for it in the step's collectives.
    cpu_threads: Optional[int] = None
    sft_warmup_steps: int = 0  # supervised warm-up before RL of random-init agents (0: none); at most this many
    # steps with sft_warmup_stop_accuracy: stop once sampled (T=1) accuracy on training problems reaches it
    sft_warmup_stop_accuracy: Optional[float] = None
    sft_warmup_batch_size: int = 16
    sft_warmup_lr: float = 5e-3
    sft_warmup_task: Optional[str] = None  # default: data.train; an agent's own sft_warmup_task wins
    sft_warmup_cache: str = ".cache/warmup"  # reused across runs, keyed by every setting that matters


@dataclass
class CheckpointConfig:
    # steps; 0: only at the end; -1: never (quick experiments, sweeps); a SIGTERM/SIGINT saves the finished
    # step whatever this says
    save_every: int = 10
    keep_last: int = 2


@dataclass
class LoggingConfig:
    # where every metric goes besides metrics.jsonl (always written), named "<agent>/<metric>"
    # (hacpo_megatron/reporting/trackers.py): tensorboard (RUN/tensorboard), wandb (offline unless WANDB_MODE says
    # otherwise: RUN/wandb, `wandb sync` later; pip install '.[wandb]'), mlflow (a SQLite store RUN/mlflow.db, or
    # mlflow_tracking_uri; pip install '.[mlflow]'). --resume continues the same tracked runs. [] for none.
    trackers: List[Literal["tensorboard", "wandb", "mlflow"]] = field(default_factory=lambda: ["tensorboard"])
    project: str = "hacpo"  # the W&B project and the MLflow experiment the run goes to (its name: run.name)
    mlflow_tracking_uri: Optional[str] = None  # e.g. http://host:5000 or sqlite:///path.db; None: RUN/mlflow.db
    plots: bool = True
    progress_bar: bool = True


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    agents: List[AgentConfig] = field(default_factory=list)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
