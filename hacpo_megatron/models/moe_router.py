"""The load-balancing loss and the load statistics of one MoE model's routers, kept by the model's own object.

    load = RouterLoad(model, aux_loss_coeff=0.001)   # hooks on this model's routers
    load.begin_update(tokens)                        # the update's router tokens, every replica's (padding excluded)
    ... the update's forward and backward passes ...
    totals = load.end_update()                       # float64 sums: add them over data-parallel replicas
    metrics = router_metrics(totals, load.num_layers, load.num_experts)

megatron's own load-balancing loss is off in every model here (`moe_config_settings`: `moe_aux_loss_coeff` 0). Its
routers read `calculate_per_token_loss` once, when built, so a flag set on the config afterwards (as the trainer
sets it) leaves their loss unscaled; they scale its gradient by a process-wide class attribute
(`MoEAuxLossAutoScaler.main_loss_backward_scale`) and log it in a process-wide tracker (`get_moe_metrics_tracker`),
in which several MoE agents on one rank would add up their figures (and a model with more layers than the first
one to log would index past the tracker's tensor). A `RouterLoad` computes the same loss from forward hooks on its
own model's routers and keeps its own sums, so every agent's loss and figures are its own.

The loss is megatron's `aux_loss`, per layer l and micro-batch b, over the tokens the router computes there
(padding excluded, prompts included; a prompt that several responses share counts once):

    aux_{b,l} = E / (k T_b^2) * sum_e c_e S_e      (1 when the routing is even)

with E experts, k per token, T_b tokens, c_e the tokens routed to expert e and S_e the sum of their softmax
probabilities of e (over all E experts). An update's loss is the token-weighted mean over its micro-batches, those
of every data-parallel replica, summed over the layers:

    L = sum_l sum_b (T_b / T) aux_{b,l},     T = sum_b T_b

and `aux_loss_coeff` times its gradient joins the policy loss's. This is what megatron's routers compute with
`calculate_per_token_loss` (the loss times the micro-batch's tokens, every gradient divided by the total). Its
weight does not depend on how rows are cut into micro-batches; its value does a little (c and S are a micro-batch's,
as in megatron), and not at all when every micro-batch routes alike. The gradient reaches the router's weights and,
through the hidden states the router reads, the layers below (as megatron's does).
"""
from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional

import torch

from hacpo_megatron import megatron_cpu

# The router's figures of an update, in its metrics (trainer) and metrics.jsonl: the load-balancing loss L above
# (its value whatever aux_loss_coeff is), and each expert's share of a layer's token assignments times E (1: an even
# share; the largest and smallest over layers and experts), and the coefficient of variation of the tokens per expert
# (a layer's standard deviation over its mean, averaged over layers). Routing is dropless: no token is dropped.
ROUTER_METRICS = ("moe/aux_loss", "moe/expert_load_max", "moe/expert_load_min", "moe/expert_load_cv")


def routers(model: Any) -> List[Any]:
    """The model's routers (megatron's TopKRouter), in layer order; [] for a dense model."""
    megatron_cpu.apply()
    from megatron.core.transformer.moe.router import TopKRouter

    return [module for module in model.modules() if isinstance(module, TopKRouter)]


def model_layer_indices(found: List[Any]) -> List[int]:
    """Each router's MoE layer in the whole model (0-based; every layer of a supported model is MoE): at pipeline
    parallelism > 1 a stage holds some of the layers, and megatron numbers them over the whole model."""
    numbers = [router.layer_number for router in found]
    if any(number is None for number in numbers):
        return list(range(len(found)))  # a model whose layers were never numbered: one stage
    return [int(number) - 1 for number in numbers]


def freeze_routers(model: Any) -> int:
    """The routers' weights take no gradient (so the optimizer, built afterwards, leaves them out); how many routers
    were frozen. Tokens are routed as before; the experts and every other weight still train."""
    found = routers(model)
    for router in found:
        for param in router.parameters(recurse=False):
            param.requires_grad_(False)
    return len(found)


class _AddedLoss(torch.autograd.Function):
    """Identity on `output`; in the backward pass `loss` gets gradient 1, so its gradient joins the model's
    (megatron's MoEAuxLossAutoScaler, with the loss's weight already in `loss` instead of a process-wide scale)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(loss)


class RouterLoad:
    """Forward hooks on one model's routers: the load-balancing loss of an update (module docstring) and its sums.

    Only between `begin_update` and `end_update`, and only in passes that train (the model in training mode, gradients
    on): the log-prob passes add nothing and count nothing. `aux_loss_coeff` 0: nothing is added to the gradient, the
    figures are counted all the same.
    """

    def __init__(self, model: Any, *, aux_loss_coeff: float = 0.0):
        if aux_loss_coeff < 0:
            raise ValueError(f"aux_loss_coeff must be >= 0, got {aux_loss_coeff}")
        self.routers = routers(model)
        if not self.routers:
            raise ValueError("the model has no mixture-of-experts routers")
        config = self.routers[0].config
        self.num_experts, self.top_k = int(config.num_moe_experts), int(config.moe_router_topk)
        # the sums are laid out over every MoE layer of the model: a pipeline stage fills its own layers' and the
        # trainer adds the stages' (zeros elsewhere); at pipeline parallelism 1 this stage is the model
        self.num_layers = int(config.num_layers)
        self.layers = model_layer_indices(self.routers)
        self.aux_loss_coeff = float(aux_loss_coeff)
        self._update_tokens: Optional[int] = None  # T of the update being recorded; None: not recording
        self._sums: Optional[torch.Tensor] = None
        self._handles = [router.register_forward_hook(functools.partial(self._after_routing, layer))
                         for layer, router in zip(self.layers, self.routers)]

    def begin_update(self, tokens: int) -> None:
        """Record an update whose micro-batches hold `tokens` router tokens in all (every data-parallel replica's,
        padding excluded): the T each micro-batch's share T_b / T is taken of."""
        if tokens < 1:
            raise ValueError(f"an update's router tokens must be >= 1, got {tokens}")
        self._update_tokens, self._sums = int(tokens), None

    def end_update(self) -> torch.Tensor:
        """This rank's sums since `begin_update` (float64, on the CPU; zeros where no micro-batch ran, and at the
        layers of other pipeline stages): per layer and expert the tokens routed to it, per layer sum_b T_b aux_{b,l},
        per layer sum_b T_b. Added over data-parallel replicas and pipeline stages they are the update's
        (`router_metrics`)."""
        sums = self._sums.cpu() if self._sums is not None else torch.zeros(sum_size(self.num_layers, self.num_experts),
                                                                              dtype=torch.float64)
        self._update_tokens, self._sums = None, None
        return sums

    def remove(self) -> None:
        """Take the hooks off the routers."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _after_routing(self, layer: int, router: Any, args: tuple, output: Any) -> Any:
        if self._update_tokens is None or not (router.training and torch.is_grad_enabled()):
            return None
        hidden, padding = args[0], (args[1] if len(args) > 1 else None)  # MoELayer.route(hidden, padding_mask)
        probs, routing_map = output
        E, k = self.num_experts, self.top_k
        tokens = routing_map.shape[0]
        valid = (torch.ones(tokens, dtype=torch.bool, device=routing_map.device) if padding is None
                 else ~padding.reshape(-1).bool())  # [seq, batch] flattened like the router's tokens
        with torch.set_grad_enabled(self.aux_loss_coeff > 0):
            logits = router.gating(hidden).view(-1, E)  # the router's own logits, computed again (a small GEMM)
            scores = torch.softmax(logits.float(), dim=-1)
            counts = (routing_map.bool() & valid[:, None]).sum(dim=0).to(scores.dtype)
            micro_tokens = valid.sum().to(scores.dtype)
            # all padding (a filler micro-batch of expert parallelism, models/logprobs.py): counts 0, loss 0, no 0 / 0
            per_token = micro_tokens.clamp(min=1)
            aux = E / (k * per_token * per_token) * (counts * (scores * valid[:, None]).sum(dim=0)).sum()
        if self._sums is None:
            self._sums = torch.zeros(sum_size(self.num_layers, E), dtype=torch.float64, device=routing_map.device)
        L = self.num_layers
        self._sums[layer * E:(layer + 1) * E] += counts.detach().double()
        self._sums[L * E + layer] += (micro_tokens * aux).detach().double()
        self._sums[L * E + L + layer] += micro_tokens.double()
        if self.aux_loss_coeff == 0:
            return None
        # this micro-batch's share of the update's loss, times the coefficient: its gradient is the one applied
        return _AddedLoss.apply(probs, aux * (self.aux_loss_coeff * micro_tokens / self._update_tokens)), routing_map


def sum_size(num_layers: int, num_experts: int) -> int:
    """Length of `RouterLoad.end_update`'s sums."""
    return num_layers * num_experts + 2 * num_layers


def router_metrics(sums: torch.Tensor, num_layers: int, num_experts: int) -> Dict[str, float]:
    """ROUTER_METRICS from an update's sums (`RouterLoad.end_update`, added over data-parallel replicas and pipeline
    stages); NaN where no token was routed."""
    L, E = num_layers, num_experts
    sums = sums.double().cpu()
    counts, aux, tokens = sums[:L * E].view(L, E), sums[L * E:L * E + L], sums[L * E + L:]
    if not bool((tokens > 0).all()):
        return {key: float("nan") for key in ROUTER_METRICS}
    share = counts / counts.sum(dim=1, keepdim=True) * E
    variation = counts.std(dim=1, unbiased=False) / counts.mean(dim=1)
    return {"moe/aux_loss": float((aux / tokens).sum()), "moe/expert_load_max": float(share.max()),
            "moe/expert_load_min": float(share.min()), "moe/expert_load_cv": float(variation.mean())}
