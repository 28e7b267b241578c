"""usage: torchrun --nproc_per_node 3 gemm_peak_turns_worker.py OUT_PREFIX

Every rank calls time_gemm_peaks_in_turn with two trainers whose peak takes 0.2 s to time and records when
it did; each rank writes its intervals to OUT_PREFIX.<rank>.json."""
import json
import sys
import time

import torch.distributed as dist

from hacpo_megatron.training.trainer import time_gemm_peaks_in_turn


class TimedPeak:
    def __init__(self, log):
        self.log = log

    @property
    def gemm_peak(self) -> float:
        start = time.monotonic()
        time.sleep(0.2)
        self.log.append((start, time.monotonic()))
        return 1.0


def main(prefix: str) -> None:
    dist.init_process_group("gloo")
    log = []
    time_gemm_peaks_in_turn([TimedPeak(log), TimedPeak(log)])
    with open(f"{prefix}.{dist.get_rank()}.json", "w") as f:
        json.dump(log, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
