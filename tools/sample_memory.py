"""Sample the resident memory of every process of a run, every few seconds, into a CSV: which process held
what when the machine's memory ran short (Ray's memory monitor ends actors at 95 %; the kernel's OOM killer
after that).

    python tools/sample_memory.py --out memory.csv [--every 2] [--match hacpo_megatron,ray::,VLLM,raylet,gcs_server]

Runs until stopped (SIGINT/SIGTERM). Each sample writes one row per matching process (time, pid, kind, torchrun
RANK, resident bytes) and one of kind `machine` (the machine's used bytes: total less available). A process's kind
is the first --match substring of its command line: Ray's actors show as `ray::EngineActor`, `ray::RewardActor`,
vLLM's processes as `VLLM::EngineCore`, `VLLM::Worker`, the ranks by their entry script.
"""
from __future__ import annotations

import argparse
import csv
import signal
import time

import psutil

# The first of these in a process's command line is its kind: the launcher before it execs torchrun (its command
# line names the entry too, so it comes first), then the ranks: the package's program, the same with faults
# planted (tools/faults.py), the example
KINDS = ("VLLM::EngineCore", "VLLM::Worker", "ray::EngineActor", "ray::RewardActor", "ray::", "raylet", "gcs_server",
         "torch.distributed.run", "torchrun", "hacpo_megatron.launch",
         "hacpo_megatron.entry", "tools/faults.py", "examples/hacpo_pretrain_style.py")


def describe(process: psutil.Process, kinds) -> tuple:
    """(kind, rank): the first of `kinds` in the command line ("" if none), and a torchrun rank's RANK."""
    try:
        line = " ".join(process.cmdline()) or process.name()
        kind = next((kind for kind in kinds if kind in line), "")
        rank = process.environ().get("RANK", "") if kind and "torchrun" not in kind else ""
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "", ""
    return kind, rank


def sample(kinds) -> list:
    """One row for the machine (kind "machine": used bytes) and one per matching process."""
    now, memory = round(time.time(), 1), psutil.virtual_memory()
    rows = [{"time": now, "pid": 0, "kind": "machine", "rank": "", "rss_bytes": memory.total - memory.available}]
    for process in psutil.process_iter():
        kind, rank = describe(process, kinds)
        if kind:
            try:
                rows.append({"time": now, "pid": process.pid, "kind": kind, "rank": rank,
                             "rss_bytes": process.memory_info().rss})
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--every", type=float, default=2.0, help="seconds between samples")
    parser.add_argument("--match", default=",".join(KINDS),
                        help="comma-separated command-line substrings, first match wins")
    args = parser.parse_args()
    kinds = tuple(k for k in args.match.split(",") if k)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["time", "pid", "kind", "rank", "rss_bytes"])
        writer.writeheader()
        try:
            while not stop:
                writer.writerows(sample(kinds))
                f.flush()
                time.sleep(args.every)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
