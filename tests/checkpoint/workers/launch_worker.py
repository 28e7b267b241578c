"""A tool in miniature for hacpo_megatron/checkpoint/local_world.py: a collective function in 2 processes.

usage: python launch_worker.py MODE PID_DIR

Each rank writes its pid to PID_DIR/rank<R>.pid, then
  ok:    all-reduces its rank + 1 and returns what the world looked like (rank 0's result is printed as JSON);
  raise: rank 0 starts a child process (`sleep`, pid in PID_DIR/grandchild.pid) and waits in a barrier that
         rank 1 never reaches: rank 1 raises ValueError (bad input) -> one line on stderr, exit code 2;
  die:   rank 1 is killed by SIGKILL while rank 0 waits in the barrier -> WorkerError, exit code 2;
  die_late: the same, seen by the parent in the order a loaded machine can show it: rank 0's connection error
         (what rank 1's death makes gloo raise in its peers) first, rank 1's death 0.5 s later -> the same.
Without the launcher stopping rank 0, the last two would hang for gloo's 30-minute timeout.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from hacpo_megatron.checkpoint.local_world import WorkerError, finish, is_first_rank, run_collective  # noqa: E402
from hacpo_megatron.parallel.groups import init_distributed  # noqa: E402


def collective(mode: str, pid_dir: str) -> dict:
    init_distributed()
    rank = dist.get_rank()
    (Path(pid_dir) / f"rank{rank}.pid").write_text(str(os.getpid()))
    if mode == "raise" and rank == 0:
        child = subprocess.Popen(["sleep", "600"])
        (Path(pid_dir) / "grandchild.pid").write_text(str(child.pid))
    dist.barrier()
    if mode == "raise" and rank == 1:
        raise ValueError("rank 1 found bad input in data.jsonl")
    if mode == "die" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "die_late":
        if rank == 0:
            raise RuntimeError("[gloo/transport/tcp/pair.cc] Read error: Connection reset by peer")
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode != "ok":
        dist.barrier()  # rank 1 never comes
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    return {"sum": total.item(), "world_size": dist.get_world_size(), "threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "pid": os.getpid()}


def main() -> None:
    mode, pid_dir = sys.argv[1], sys.argv[2]
    try:
        result = run_collective(collective, mode, pid_dir, world_size=2)
    except (ValueError, WorkerError) as error:
        print(f"launch_worker: error: {error}", file=sys.stderr)
        sys.exit(2)
    if is_first_rank():
        print(json.dumps(dict(result, parent_pid=os.getpid())))
    finish()


if __name__ == "__main__":
    main()
