"""Batches of prompts in a seeded per-epoch shuffle, resumable exactly from (epoch, position)."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import numpy as np

from hacpo_megatron.data.records import PromptRecord


class PromptSampler:
    """Yields batches of ``batch_size`` prompts: epoch e visits every prompt once, in an order fixed by (seed, e).

    A batch that reaches the end of an epoch is completed from the start of the next one, so every batch
    is full and no prompt is skipped. The state is just (epoch, position in that epoch's order).
    """

    def __init__(self, dataset: Sequence[PromptRecord], batch_size: int, seed: int, shuffle: bool = True):
        if not dataset:
            raise ValueError("PromptSampler: the dataset is empty")
        if batch_size < 1:
            raise ValueError(f"PromptSampler: batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def next_batch(self) -> List[PromptRecord]:
        batch = []
        while len(batch) < self.batch_size:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(self.batch_size - len(batch), len(self._order) - self.position)
            batch += [self.dataset[i] for i in self._order[self.position : self.position + take]]
            self.position += take
        return batch

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> Dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_prompts": len(self.dataset),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue exactly where ``state`` left off; refuses a state taken over another dataset or seed."""
        for key, current in (("seed", self.seed), ("shuffle", self.shuffle), ("num_prompts", len(self.dataset))):
            if state.get(key) != current:
                raise ValueError(
                    f"PromptSampler.load_state_dict: saved {key}={state.get(key)!r} but this sampler has "
                    f"{key}={current!r}; resuming would give different prompts"
                )
        if not 0 <= state["position"] <= len(self.dataset):
            raise ValueError(f"PromptSampler.load_state_dict: position {state['position']} out of range")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._epoch_order(self.epoch)
