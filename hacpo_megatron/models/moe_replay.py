"""Routing replay of one MoE model (agents[].moe.routing_replay, docs/moe.md): the experts each token is sent to,
recorded or given, and imposed on the model's routers in later passes. The state belongs to one model.

    replay = RouteReplay(model)                  # this model's routers take their top-k from it
    replay.keep(sequences, routes)               # routes of whole sequences (engine's, or a pass's), by their tokens
    packed.routes = replay.layout(packed, seqs)  # a micro-batch's tokens' routes (-1: route live)
    with replay.applied(packed, record=True):    # in its forward pass: the routers take those experts; the
        model(...)                               # experts used are left in packed.recorded_routes
    replay.unpack(packed, seqs)                  # those routes back per sequence (its prompt, then its response)

A route is a token's top-k expert indices in every MoE layer: a sequence's routes are [prompt + response tokens,
layers, k] (int16; -1 where there is none). At pipeline parallelism > 1 a stage's RouteReplay holds and imposes its
own layers' routes: a pass records those, and routes of the whole model (an engine's) are cut to them when kept.
Replaying fixes only the indices: the router still computes its logits and the routing weights of the fixed experts
from them (megatron's RouterReplay gathers the scores at the given indices; slime and verl replay the same way), so
the weights keep their gradient.

Why not megatron's RouterReplay (`moe_enable_routing_replay`): its instances are one process-wide list
(`RouterReplay.global_router_replay_instances`) set and read by static methods, so two MoE models on one rank (several
agents share a rank here) would share and overwrite each other's routes (verl #7805 fixed exactly that). Each router
here gets its own small object in megatron's `router.router_replay` slot (the hook megatron's top-k already calls),
pointing at its model's RouteReplay; nothing is registered anywhere else.

Routes are kept by sequence (its prompt's and response's token ids), never by micro-batch position: a pass and an
update pack, deduplicate shared prompts and cut micro-batches differently, and data-parallel replicas take other
shares. Routing is dropless and causal, so a sequence's trainer routes depend on its tokens alone; identical
sequences share one entry (the last kept). A shared prompt's tokens, computed once in a shared-prompt row, take the
routes of the first sequence of that row.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from hacpo_megatron.models.moe_router import model_layer_indices, routers

Key = Tuple[Tuple[int, ...], Tuple[int, ...]]
REPLAY_MODES = ("off", "r2", "r3")


def sequence_key(prompt: Sequence[int], response: Sequence[int]) -> Key:
    return tuple(int(t) for t in prompt), tuple(int(t) for t in response)


class _LayerReplay:
    """What megatron's top-k calls in one router (`router.router_replay.get_replay_topk`), asking its model's
    RouteReplay. Outside `RouteReplay.applied` it computes megatron's own top-k."""

    def __init__(self, owner: "RouteReplay", layer: int):
        self.owner, self.layer = owner, layer
        self.layer_number = None  # megatron's router writes it

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        return self.owner._topk(self.layer, scores, topk, num_groups, group_topk, default_compute_topk)


class RouteReplay:
    """The routes of one model's sequences, and the hooks that impose them on that model's routers."""

    def __init__(self, model):
        self.routers = routers(model)
        if not self.routers:
            raise ValueError("routing replay needs a mixture-of-experts model")
        config = self.routers[0].config
        if config.moe_router_fusion or config.moe_router_num_groups:
            raise ValueError("routing replay here takes megatron's unfused top-k without expert groups")
        for router in self.routers:
            if router.router_replay is not None:
                raise ValueError("megatron's process-wide RouterReplay is on (moe_enable_routing_replay): leave it "
                                 "off, the model's own RouteReplay takes its place")
        self.num_layers, self.top_k = len(self.routers), int(config.moe_router_topk)  # this pipeline stage's layers
        self.model_layers, self.layers = int(config.num_layers), model_layer_indices(self.routers)
        self._store: Dict[Key, torch.Tensor] = {}
        self._target: Optional[torch.Tensor] = None  # [router tokens, layers, k] long; -1: live
        self._recorded: Optional[List[Optional[torch.Tensor]]] = None
        for layer, router in enumerate(self.routers):
            router.router_replay = _LayerReplay(self, layer)

    # ------------------------------------------------------------------ the store
    def clear(self) -> None:
        """Forget every sequence's routes (a new step)."""
        self._store.clear()

    def __len__(self) -> int:
        return len(self._store)

    def keep(self, sequences: Sequence[Tuple[Sequence[int], Sequence[int]]],
             routes: Sequence[Optional[torch.Tensor]]) -> None:
        """Keep each sequence's routes ([prompt + response tokens, layers, k]: this stage's MoE layers, or the whole
        model's, of which this stage keeps its own); None: nothing kept for it."""
        if len(sequences) != len(routes):
            raise ValueError(f"{len(routes)} routes for {len(sequences)} sequences")
        for (prompt, response), route in zip(sequences, routes):
            if route is None:
                continue
            if route.dim() == 3 and route.shape[1] == self.model_layers != self.num_layers:
                route = route[:, self.layers]  # the whole model's routes: this stage's layers
            shape = (len(prompt) + len(response), self.num_layers, self.top_k)
            if tuple(route.shape) != shape:
                raise ValueError(f"routes of shape {tuple(route.shape)} for a sequence needing {shape} "
                                 "(tokens, MoE layers, top-k)")
            self._store[sequence_key(prompt, response)] = route.to(torch.int16).cpu()

    def routes_of(self, prompt: Sequence[int], response: Sequence[int]) -> Optional[torch.Tensor]:
        return self._store.get(sequence_key(prompt, response))

    # ------------------------------------------------------------------ micro-batches
    def layout(self, packed, sequences: Sequence[Tuple[Sequence[int], Sequence[int]]]) -> Optional[torch.Tensor]:
        """The routes of a micro-batch's tokens, [rows, S, layers, k] long (-1: padding, or a sequence without
        routes: routed live); None when no sequence of it has routes. `sequences`: the list `packed.indices`
        index."""
        rows, width = packed.tokens.shape
        out = torch.full((rows, width, self.num_layers, self.top_k), -1, dtype=torch.long)
        found = False
        for document, members in _documents_and_members(packed):
            P = document.prompt_length
            first = self.routes_of(*sequences[members[0]])
            if first is not None:
                out[document.row, document.start:document.start + P] = first[:P].long()
                found = True
            offset = document.start + P
            for i, length in zip(members, document.response_lengths):
                route = self.routes_of(*sequences[i])
                if route is not None:
                    out[document.row, offset:offset + length] = route[P:P + length].long()
                    found = True
                offset += length
        return out if found else None

    def unpack(self, packed, sequences) -> List[Tuple[int, torch.Tensor]]:
        """(index into `sequences`, its routes [prompt + response tokens, layers, k]) of each sequence of a
        micro-batch whose pass recorded its routes (`applied(record=True)`)."""
        recorded = packed.recorded_routes
        if recorded is None:
            raise ValueError("this micro-batch's routes were not recorded")
        out = []
        for document, members in _documents_and_members(packed):
            P = document.prompt_length
            prompt = recorded[document.row, document.start:document.start + P]
            offset = document.start + P
            for i, length in zip(members, document.response_lengths):
                out.append((i, torch.cat([prompt, recorded[document.row, offset:offset + length]]).to(torch.int16)))
                offset += length
        return out

    @contextmanager
    def applied(self, packed, *, record: bool = False) -> Iterator[None]:
        """Inside: the forward pass of `packed` routes its tokens as `packed.routes` says (live where -1 or where it
        is None); with `record`, the experts every token went to are left in `packed.recorded_routes`
        [rows, S, layers, k]. Megatron's routers see the tokens sequence-first: token (row b, position s) is their
        token s * rows + b."""
        rows, width = packed.tokens.shape
        routes = getattr(packed, "routes", None)
        if routes is not None:
            if tuple(routes.shape) != (rows, width, self.num_layers, self.top_k):
                raise ValueError(f"routes of shape {tuple(routes.shape)} for a micro-batch of {rows} x {width} tokens")
            self._target = routes.transpose(0, 1).reshape(width * rows, self.num_layers, self.top_k)
        self._recorded = [None] * self.num_layers if record else None
        try:
            yield
            if record:
                if any(r is None for r in self._recorded):
                    raise RuntimeError("a router of the model did not route this micro-batch")
                stacked = torch.stack([r.cpu() for r in self._recorded], dim=1)  # [S * rows, layers, k]
                packed.recorded_routes = stacked.view(width, rows, self.num_layers, self.top_k).transpose(0, 1)
        finally:
            self._target, self._recorded = None, None

    def _topk(self, layer, scores, topk, num_groups, group_topk, default_compute_topk):
        values, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self._target is not None:
            target = self._target[:, layer].to(indices.device)
            if target.shape[0] != indices.shape[0]:
                raise RuntimeError(f"routes for {target.shape[0]} tokens, the router has {indices.shape[0]}")
            indices = torch.where(target >= 0, target, indices)
            values = scores.gather(1, indices)  # the routing weights of the fixed experts, from this pass's scores
        if self._recorded is not None:
            self._recorded[layer] = indices.detach().to(torch.int16)
        return values, indices


def _documents_and_members(packed):
    """Each document of a PackedBatch with the caller's indices of its sequences (in `packed.indices` order)."""
    indices = packed.indices.tolist()
    at = 0
    for document in packed.documents:
        n = len(document.response_lengths)
        yield document, indices[at:at + n]
        at += n


def top_k_sets_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[tokens, layers] True where two routes' top-k sets differ (the order inside a top-k does not count)."""
    return (a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1)
