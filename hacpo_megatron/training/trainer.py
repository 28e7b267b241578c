"""The training step of one agent: M mini-batch updates of its policy loss on its share of the batch.

    trainer = AgentTrainer(agent, spec, cfg, lr=agent_cfg.lr)  # Megatron DDP + Adam + LR schedule
    old = trainer.sequence_logprobs(own_sequences)            # step 5: old log-probs of own responses
    metrics = trainer.train_step(mini_batches(rows, schedule))  # step 6: m = 0 .. M-1 updates

Gradient accumulation: each micro-batch's loss is its rows' sum divided by the mini-batch's GLOBAL
row count (`num_global_seqs`; GRPO: token count), so the micro-batch losses of all data-parallel
ranks add up to the mini-batch mean. Megatron must therefore neither average over micro-batches
nor over data-parallel ranks: `calculate_per_token_loss=True` makes the schedule keep each loss as
returned and makes DDP sum gradients; our finalize step passes no token count, so nothing rescales.

The KL penalty to the reference model (kl_coef > 0) covers the learner's own rows only, wherever they
sit in a micro-batch, and is their mean: each micro-batch adds the sum over its own rows divided by
the mini-batch's global own-row count.

Rows whose advantage is 0 (a group all right or all wrong) carry no gradient: an update leaves them out
of its forward and backward passes (batch.rows_with_gradient) but keeps them in the global row count,
so the update is the same. Its ratio and clip statistics are over the rows it computed;
`num_skipped_zero_advantage` counts the others.

A mixture-of-experts agent (agents[k].moe, docs/moe.md): its routers' load-balancing loss is the model's own
(models/moe_router.py), each micro-batch's weighted by its share of the update's router tokens (every replica's,
padding excluded), times `moe.aux_loss_coeff`; it covers the rows the update computes (zero-advantage rows are not).
`moe.freeze_router` keeps the routers' weights out of DDP and the optimizer. The router's figures (ROUTER_METRICS)
join the update's metrics, reduced over replicas like the others.
"""
from __future__ import annotations

import dataclasses
import math
import time
from functools import partial
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from hacpo_megatron.algorithms import (
    POLICY_METRICS, RATIO_HISTOGRAM, ROW_COUNTS, AlgorithmSpec, LossParams, PolicyBatch, fitted_cross_clip_lower_bound,
    low_var_kl_penalty,
)
from hacpo_megatron.algorithms.losses import LOG_RATIO_EDGES
from hacpo_megatron.config import Config, MoEConfig
from hacpo_megatron.environment import return_freed_memory
from hacpo_megatron import megatron_cpu
from hacpo_megatron.models.build import AgentModel
from hacpo_megatron.models.moe_replay import RouteReplay
from hacpo_megatron.models.moe_router import ROUTER_METRICS, RouterLoad, freeze_routers, router_metrics
from hacpo_megatron.models.logprobs import (
    SequenceLogProbs,
    compute_sequence_logprobs,
    in_step_with_expert_peers,
    make_forward_step,
    run_schedule,
)
from hacpo_megatron.models.packing import PackedBatch, pack_sequences, token_budget_groups
from hacpo_megatron.parallel.groups import collective_device, world_collectives_within
from hacpo_megatron.training.batch import SequenceRow, data_parallel_shard, micro_batches, rows_with_gradient
from hacpo_megatron.training.utilisation import gemm_peak_flops, training_flops


def time_gemm_peaks_in_turn(trainers: Sequence["AgentTrainer"]) -> None:
    """Every rank times its trainers' GEMM peaks while the others wait (collective over the world).

    Ranks of a CPU run share the cores: a peak timed while another rank computes reads low, and the MFU
    against it high (over 100 % was seen when the peaks were timed at the first update, agents' updates
    running side by side). Timed alone, the peak is what the rank's threads get from the machine.
    """
    for rank in range(dist.get_world_size()):
        if rank == dist.get_rank():
            for trainer in trainers:
                _ = trainer.gemm_peak  # the property times the peak on first use and caches it
        dist.barrier()


def _finalize_grads(model_chunks, num_tokens, *, pg_collection, force_all_reduce=False):
    """Megatron's finalize step (DP all-reduce, TP layernorm/embedding sums) without token rescaling."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model_chunks, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)


def use_fused_torch_adam(optimizer) -> int:
    """Switch torch's Adam inside megatron's optimizer to its fused kernel; how many optimizers were switched.

    Without Transformer Engine or Apex, megatron-core 0.19 builds torch.optim.AdamW with torch's defaults (on a GPU
    the multi-tensor `foreach` implementation: a few kernels per parameter group and step); `fused` is one kernel for
    the whole update, what TE's and Apex's FusedAdam give megatron elsewhere. Before the first step only (the
    states are created on the parameters' device then, as the fused kernel wants its step counters).
    """
    switched = 0
    for member in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(member, "optimizer", member)
        if type(inner) in (torch.optim.Adam, torch.optim.AdamW) and not inner.state:
            for group in [inner.defaults, *inner.param_groups]:
                group.update(fused=True, foreach=False)
            switched += 1
    return switched


class AgentTrainer:
    """Optimisation state and updates of one agent, on every rank of that agent."""

    def __init__(self, agent: AgentModel, spec: AlgorithmSpec, cfg: Config, *, lr: Optional[float] = None,
                 moe: Optional[MoEConfig] = None):
        """Reads the run's config once: `train:` (optimizer, LR schedule, micro-batches), `algorithm:` (the loss,
        the KL penalty, the fitted bound), `rollout.temperature` and `run.total_steps`. `lr`: the agent's own
        (agents[k].lr), else train.lr. `moe`: the agent's router settings (agents[k].moe; None: the defaults)."""
        megatron_cpu.apply()
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.spec, self.parallel = spec, agent.parallel
        self.train, self.algorithm, self.temperature = cfg.train, cfg.algorithm, cfg.rollout.temperature
        self.loss_params = LossParams.from_config(cfg.algorithm, spec)
        t, lr = cfg.train, lr or cfg.train.lr
        self.policy_loss = spec.loss  # what it needs (token-level old log-probs, its cross bound) it says itself
        config = agent.config
        config.calculate_per_token_loss = True  # see the module docstring: keep losses, sum gradients
        config.finalize_model_grads_func = partial(_finalize_grads, pg_collection=agent.parallel.pg_collection)
        moe = moe or MoEConfig()
        self.router_load = self._set_up_routers(agent, moe)  # before DDP: a frozen router stays out
        # agents[k].moe.routing_replay (models/moe_replay.py): this model's own routes, none for "off"
        self.routing_replay = moe.routing_replay
        self.route_replay = RouteReplay(agent.model) if self.router_load is not None and moe.routing_replay != "off" \
            else None
        on_gpu = torch.cuda.is_available()
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=on_gpu,
        )
        self.ddp_model = DistributedDataParallel(
            config=config, ddp_config=ddp_config, module=agent.model, pg_collection=agent.parallel.pg_collection,
        )
        self.agent = dataclasses.replace(agent, model=self.ddp_model)  # same model, DDP-wrapped
        with world_collectives_within(agent.parallel):
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam", lr=lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
                    adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
                    clip_grad=t.grad_clip, bf16=config.bf16, params_dtype=config.params_dtype,
                    use_distributed_optimizer=on_gpu,
                ),
                [self.ddp_model],
                use_gloo_process_groups=False,
                pg_collection=agent.parallel.pg_collection,
            )
        if on_gpu:
            use_fused_torch_adam(self.optimizer)
        decay_steps = max(cfg.run.total_steps, t.lr_warmup_steps + 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if t.lr_warmup_steps else lr, max_lr=lr, min_lr=t.min_lr,
            lr_warmup_steps=t.lr_warmup_steps, lr_decay_steps=decay_steps, lr_decay_style=t.lr_schedule,
            start_wd=t.weight_decay, end_wd=t.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant",
        )
        self.steps_done = 0
        # algorithm.cross_clip_fit_quantile (beyond the paper, docs/algorithm.md): the q-quantile of the other
        # agents' ratios s this learner measured in its previous step, which lowers the cross clip's bound;
        # None before a first step with such rows (the paper's bound alone). Saved in checkpoints.
        self.cross_clip_fitted: Optional[float] = None
        self._step_ratio_histogram: Optional[torch.Tensor] = None
        self._gemm_peak: Optional[float] = None
        # Shared-prompt and packed rows need the project's core attention and per-row RoPE positions: megatron's
        # local layers. With Transformer Engine's, every sequence gets a row of its own (models/logprobs.py).
        self.share_prompts = t.share_prompts and agent.takes_attention_mask
        if t.max_tokens_per_micro_batch is not None and not agent.takes_attention_mask:
            raise ValueError("train.max_tokens_per_micro_batch packs sequences into shared rows, which Transformer "
                             "Engine's layers here do not take; leave it null with them")

    @staticmethod
    def _set_up_routers(agent: AgentModel, moe: MoEConfig) -> Optional[RouterLoad]:
        """The model's RouterLoad (None for a dense model), its routers frozen where `moe.freeze_router` says."""
        if agent.arch.moe is None:
            if moe != MoEConfig():
                raise ValueError(f"{agent.parallel.name}: agents[].moe applies to a mixture-of-experts model's "
                                 "routers; this model has none")
            return None
        if agent.config.moe_aux_loss_coeff:  # the model's own RouterLoad computes that loss (models/moe_router.py)
            raise ValueError("megatron's own load-balancing loss must be off (moe_aux_loss_coeff 0): the trainer adds "
                             "it per model, weighted by agents[].moe.aux_loss_coeff")
        if moe.freeze_router:
            if moe.aux_loss_coeff > 0:
                raise ValueError("moe.freeze_router keeps the routers fixed, which moe.aux_loss_coeff > 0 would train")
            freeze_routers(agent.model)
        return RouterLoad(agent.model, aux_loss_coeff=moe.aux_loss_coeff)

    @property
    def gemm_peak(self) -> float:
        """The agent's GEMM peak, FLOP/s (every rank alike): what "perf/mfu" is a fraction of. Timed on first
        use; a run times it before its first step with every rank in turn (`time_gemm_peaks_in_turn`)."""
        if self._gemm_peak is None:
            on_gpu = torch.cuda.is_available()
            device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
            self._gemm_peak = gemm_peak_flops(self.agent.config.params_dtype, device) * self.parallel.world_size
        return self._gemm_peak

    # ------------------------------------------------------------------------------ log-probs
    def sequence_logprobs(self, sequences, *, max_sequences_per_micro_batch: Optional[int] = None) -> SequenceLogProbs:
        """Log-probs at the sampling temperature under the current weights (old log-probs, step 5).

        With routing replay (r2, r3): sequences whose routes the model's RouteReplay holds (the engine's, r3) are
        routed as those say, the others live; every sequence's routes as this pass took them are kept, and replayed
        in the step's updates (`begin_step_routes` forgets them)."""
        result = compute_sequence_logprobs(
            self.agent, sequences, temperature=self.temperature,
            max_sequences_per_micro_batch=max_sequences_per_micro_batch or self.train.micro_batch_size,
            max_tokens_per_micro_batch=self.train.max_tokens_per_micro_batch, share_prompts=self.share_prompts,
            route_replay=self.route_replay,
        )
        if self.route_replay is not None:
            self.route_replay.keep(sequences, result.routes)
        return result

    def begin_step_routes(self, sequences=(), routes=()) -> None:
        """A new step: forget the last step's routes; keep `routes` of `sequences` (r3: the engine's routes of the
        agent's own answers, [prompt + response tokens, layers, k], None where the engine gave none)."""
        if self.route_replay is None:
            return
        self.route_replay.clear()
        if self.routing_replay == "r3":
            self.route_replay.keep(sequences, routes)

    # ------------------------------------------------------------------------------ training
    def train_step(self, mini_batches: Sequence[Sequence[SequenceRow]]) -> List[Dict[str, float]]:
        """One update per mini-batch (m = 0 .. M-1, see batch.UpdateSchedule); one metrics dict each.

        Collective over the agent's ranks; every rank passes the same rows (each data-parallel
        replica takes its own share). The LR schedule advances once per call (one RL step).
        """
        self._step_ratio_histogram = None
        metrics = [self._update(list(mini_batch), update_index) for update_index, mini_batch in enumerate(mini_batches)]
        self.scheduler.step(increment=1)
        self.steps_done += 1
        if self.route_replay is not None:  # this step's routes served their updates
            self.route_replay.clear()
        if self._step_ratio_histogram is not None:  # the same counts on every rank of the agent (_reduce_metrics)
            fitted = fitted_cross_clip_lower_bound(self._step_ratio_histogram, self.algorithm.cross_clip_fit_quantile)
            self.cross_clip_fitted = fitted if fitted is not None else self.cross_clip_fitted
        # The updates' activations are freed now, but glibc keeps the pages of its small blocks for reuse; the
        # engines reload their weights next, on the same machine's memory: give them back (docs/real_model.md)
        return_freed_memory(freeze=True)  # the rank's long-lived objects left out of later collections
        return metrics

    def _update(self, mini_batch: List[SequenceRow], update_index: int) -> Dict[str, float]:
        if not mini_batch:  # every row of this block was a dropped bridged answer: nothing to learn from
            return dict(_NO_UPDATE, **({k: math.nan for k in ROUTER_METRICS} if self.router_load else {}),
                        update_index=float(update_index), lr=float(self.optimizer.param_groups[0]["lr"]))
        global_seqs = len(mini_batch)
        global_own_seqs = sum(not r.is_cross for r in mini_batch)
        global_tokens = sum(len(r.response_ids) for r in mini_batch)
        peak = self.gemm_peak  # measured before the update's clock starts
        start = time.perf_counter()
        computed = rows_with_gradient(mini_batch, kl_coef=self.algorithm.kl_coef)  # zero-advantage rows: no gradient
        shard = data_parallel_shard(computed, self.parallel.dp_rank, self.parallel.dp_size)
        chunks, packed = self._micro_batches(shard)
        if self.route_replay is not None:  # each row's routes by its tokens, wherever the packing put it
            for mb, chunk in zip(packed, chunks):
                mb.routes = self.route_replay.layout(mb, [(r.prompt_ids, r.response_ids) for r in chunk])
        lower = self.policy_loss.cross_clip_lower(update_index, self.loss_params, self.cross_clip_fitted)
        loss_fn = partial(self._micro_batch_loss, chunks=dict(zip(map(id, packed), chunks)), cross_clip_lower=lower,
                          global_seqs=global_seqs, global_own_seqs=global_own_seqs, global_tokens=global_tokens)

        self.ddp_model.train()
        self.ddp_model.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.router_load is not None and computed:
            self.router_load.begin_update(self._router_tokens(computed, packed))
        # A replica whose share is empty still joins the gradient all-reduce with zero gradients. At EP > 1 the EP
        # ranks (replicas) exchange tokens in every MoE layer: each runs as many micro-batches as the most any runs,
        # filler ones after its own (models/logprobs.py), which add zero gradients and no metrics.
        in_step = in_step_with_expert_peers(self.agent, packed)
        results = run_schedule(self.agent, in_step, make_forward_step(self.agent, temperature=self.temperature,
                                                                      loss_fn=loss_fn, route_replay=self.route_replay),
                               forward_only=False) \
            if in_step else self._finalize_without_data()
        success, grad_norm, _ = self.optimizer.step()
        out = self._reduce_metrics(results)  # its copy to the host also waits for a GPU's queued work
        histogram = out.pop(RATIO_HISTOGRAM, None)
        if histogram is not None:
            self._step_ratio_histogram = (histogram if self._step_ratio_histogram is None
                                          else self._step_ratio_histogram + histogram)
        flops_per_s = out.pop("model_flops") / (time.perf_counter() - start)  # every replica's rows
        # rows as the loss sees them: only a loss with cross rows tells them apart (Naive's GSPO takes them as own)
        num_cross = global_seqs - global_own_seqs if self.policy_loss.cross_rows else 0
        out.update(num_own=float(global_seqs - num_cross), num_cross=float(num_cross),
                   num_skipped_zero_advantage=float(global_seqs - len(computed)), **_packing_metrics(packed))
        if lower is not None:
            out["cross_clip_lower_bound"] = lower
        out.update(update_index=float(update_index), grad_norm=float(grad_norm) if grad_norm is not None else math.nan,
                   lr=float(self.optimizer.param_groups[0]["lr"]), update_skipped=float(not success),
                   **{"perf/model_flops_per_s": flops_per_s, "perf/gemm_peak_flops_per_s": peak,
                      "perf/mfu": flops_per_s / peak})
        return out

    def _micro_batches(self, rows: List[SequenceRow]):
        """This replica's rows as micro-batches: (rows of each, PackedBatch of each). By `micro_batch_size` rows,
        or with `max_tokens_per_micro_batch` packed end to end up to that many tokens; the loss is the same either
        way (each micro-batch adds its rows' share of the mini-batch's global mean)."""
        budget = self.train.max_tokens_per_micro_batch
        if budget is None:
            chunks = micro_batches(rows, self.train.micro_batch_size)
        else:
            groups = token_budget_groups([(r.prompt_ids, r.response_ids) for r in rows], budget,
                                         share_prompts=self.share_prompts)
            chunks = [[rows[i] for i in group] for group in groups]
        packed = [pack_sequences([(r.prompt_ids, r.response_ids) for r in chunk], range(len(chunk)),
                                 share_prompts=self.share_prompts, row_tokens=budget) for chunk in chunks]
        return chunks, packed

    def _router_tokens(self, computed: List[SequenceRow], packed: Sequence[PackedBatch]) -> int:
        """The tokens the routers see in this update on every data-parallel replica, padding excluded: the T each
        micro-batch's load-balancing loss is weighted by its share of (models/moe_router.py). The other replicas'
        micro-batches are packed here as they pack them (no collective)."""
        dp_rank, dp_size = self.parallel.dp_rank, self.parallel.dp_size
        return sum(_real_tokens(mb)
                   for r in range(dp_size)
                   for mb in (packed if r == dp_rank
                              else self._micro_batches(data_parallel_shard(computed, r, dp_size))[1]))

    def _finalize_without_data(self) -> list:
        self.agent.config.finalize_model_grads_func([self.ddp_model], None)
        return []

    def _micro_batch_loss(self, token_logprobs: torch.Tensor, packed: PackedBatch, *, chunks,
                          cross_clip_lower: Optional[float], global_seqs: int, global_own_seqs: int,
                          global_tokens: int):
        """The policy loss of one micro-batch as its share of the mini-batch mean (+ optional KL)."""
        chunk: List[SequenceRow] = chunks[id(packed)]
        rows = [chunk[i] for i in packed.indices.tolist()]  # in the packed order (shared prompts group them)
        device = token_logprobs.device
        width = int(packed.response_lengths.max())
        logp = packed.response_logprobs(token_logprobs, width)
        mask = torch.arange(width, device=device)[None, :] < packed.response_lengths.to(device)[:, None]
        is_cross = torch.tensor([r.is_cross for r in rows], dtype=torch.bool, device=device)
        batch = PolicyBatch(
            logp, mask, is_cross=is_cross, cross_clip_lower=cross_clip_lower,
            advantages=torch.tensor([r.advantage for r in rows], dtype=torch.float32, device=device),
            old_seq_logp=torch.tensor([r.old_seq_logp for r in rows], dtype=torch.float32, device=device),
            old_token_logp=(_padded([r.old_token_logp for r in rows], width, device)
                            if self.policy_loss.per_token_old_logp else None),
            num_global_seqs=global_seqs, num_global_tokens=global_tokens)
        loss, metrics = self.policy_loss(batch, self.loss_params)
        histogram = metrics.pop(RATIO_HISTOGRAM, None)  # counts of the other agents' ratios, where the loss has them
        own = ~is_cross
        if self.algorithm.kl_coef > 0 and bool(own.any()):
            ref = _padded([r.ref_token_logp for r, is_own in zip(rows, own.tolist()) if is_own], width, device)
            kl = low_var_kl_penalty(logp[own], ref, mask[own], num_global_seqs=global_own_seqs)
            loss = loss + self.algorithm.kl_coef * kl
            metrics["kl"] = float(kl.detach()) * global_own_seqs  # a sum over own rows; _reduce_metrics divides
        weighted = {k: torch.tensor(v * _weight(k, metrics, float(len(rows)))) for k, v in metrics.items()
                    if not math.isnan(v) and k != "cross_clip_lower_bound"}  # _update reports the bound
        if self._fits_cross_clip:  # this micro-batch's share of the counts the next step's bound is fitted to
            weighted[RATIO_HISTOGRAM] = histogram.cpu()
        weighted["loss"] = loss.detach().float().cpu()
        weighted["model_flops"] = torch.tensor(training_flops(self.agent.arch, packed.layout), dtype=torch.float64)
        return loss, torch.ones((), dtype=torch.int), weighted

    def _reduce_metrics(self, results: list) -> Dict[str, float]:
        """Sum the micro-batch metrics over micro-batches and data-parallel replicas; same on every rank."""
        keys = ("loss", "kl", "model_flops") + ROW_COUNTS + tuple(POLICY_METRICS)
        bins = len(LOG_RATIO_EDGES) if self._fits_cross_clip else 0
        load = self.router_load
        # the scalars, the ratio histogram, the router's sums (MoE; zeros where this replica routed nothing)
        router = (load.end_update() if load is not None else torch.zeros(0, dtype=torch.float64))
        totals = torch.zeros(len(keys) + bins, dtype=torch.float64)
        for result in results:
            for i, key in enumerate(keys):
                if key in result:
                    totals[i] += float(result[key])
            if bins and RATIO_HISTOGRAM in result:
                totals[len(keys):] += result[RATIO_HISTOGRAM]
        buffer = torch.cat([totals, router]).to(collective_device())
        if self.parallel.dp_size > 1 and (self.parallel.is_last_stage or load is not None):
            dist.all_reduce(buffer, group=self.parallel.dp_group)
        # Only the last stage computed a loss (the other stages' totals are zeros), and each stage routed its own MoE
        # layers (zeros at the others' layers): the sum over the pipeline is every rank's report.
        if self.parallel.pp_size > 1:
            dist.all_reduce(buffer, group=self.parallel.pp_group)
        totals, router = buffer.cpu().split([len(keys) + bins, len(router)])
        histogram = totals[len(keys):] if bins else None
        t = dict(zip(keys, totals[:len(keys)].tolist()))
        out = {"loss": t["loss"], "num_own": t["num_own"], "num_cross": t["num_cross"], "model_flops": t["model_flops"]}
        if load is not None:
            out.update(router_metrics(router, load.num_layers, load.num_experts))
        for key, count in POLICY_METRICS.items():  # row-weighted sums back to means over their rows
            out[key] = t[key] / t[count] if t[count] else math.nan
        if self.algorithm.kl_coef > 0:
            out["kl"] = t["kl"] / t["num_own"] if t["num_own"] else math.nan
        if histogram is not None and t["num_cross"]:
            out[RATIO_HISTOGRAM] = histogram
        return out

    @property
    def _fits_cross_clip(self) -> bool:
        return self.policy_loss.fits_cross_clip(self.loss_params, self.algorithm.cross_clip_fit_quantile)


def _real_tokens(micro_batch: PackedBatch) -> int:
    """Tokens of a micro-batch's sequences (prompts and responses; a shared prompt once), padding excluded."""
    return int((micro_batch.token_layout.document >= 0).sum())


def _packing_metrics(packed: Sequence[PackedBatch]) -> Dict[str, float]:
    """Tokens of this replica's largest micro-batch (rows x width, what one forward holds) and the share of
    padding in all of them: the cost of micro-batching by rows, which a token budget removes."""
    computed = [mb.tokens.numel() for mb in packed]
    real = sum(_real_tokens(mb) for mb in packed)
    return {"micro_batch_tokens_max": float(max(computed, default=0)),
            "padding_frac": 1.0 - real / sum(computed) if computed else 0.0}


def _weight(key: str, metrics: Dict[str, float], n: float) -> float:
    """Policy metrics are means over own or cross rows (POLICY_METRICS); weight them by their row counts to sum
    them (n, the micro-batch's rows, where a loss counts every row as own). Counts and `kl` are already sums."""
    count = POLICY_METRICS.get(key)
    if count is None:
        return 1.0
    return metrics.get(count, n if count == "num_own" else 0.0)


_NO_UPDATE = {"loss": math.nan, "num_own": 0.0, "num_cross": 0.0, "grad_norm": math.nan, "update_skipped": 1.0,
              **{key: math.nan for key in POLICY_METRICS}}


def _padded(values: Sequence[Optional[Sequence[float]]], width: int, device) -> torch.Tensor:
    out = torch.zeros(len(values), width, dtype=torch.float32, device=device)
    for i, v in enumerate(values):
        if v is None:
            raise ValueError("per-token old/reference log-probs are missing for a row that needs them")
        out[i, : len(v)] = torch.tensor(v, dtype=torch.float32, device=device)
    return out
