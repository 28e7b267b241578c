"""When each rank's learners train, with and without turns (orchestrator/turns.py).

usage: torchrun --nproc_per_node 2 turns_worker.py OUT_DIR

Three agents on two ranks: rank 0 hosts agents 0 and 2 (time-sharing), rank 1 hosts agent 1. Every
"update" sleeps 0.3 s; each rank writes OUT_DIR/rank<r>.json: for take_turns false and true, the
(agent, start, end) of each update it ran, on the machine's monotonic clock (shared by its processes).
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch.distributed as dist

from hacpo_megatron.orchestrator.turns import learner_turns

HOSTED = {0: {0: "a", 2: "c"}, 1: {1: "b"}}  # rank -> {agent: trainer}, as Agents.trainers


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report = {}
    for take_turns in (False, True):
        dist.barrier()  # both ranks start together
        updates = []
        for k in learner_turns(HOSTED[rank], n=3, take_turns=take_turns):
            start = time.monotonic()
            time.sleep(0.3)
            updates.append((k, start, time.monotonic()))
        report[str(take_turns).lower()] = updates
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
