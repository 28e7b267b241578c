"""tools/soak.py on a short real run (the tests' small default config) with a leak injected on purpose: every
process kind of the run is sampled, and the verdict names the rank that keeps every step's rollouts alive."""
import csv
import subprocess
import sys

import pytest
import yaml

from tests.e2e.test_hacpo_run import REPO, small_config

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_soak_samples_every_process_kind_and_finds_an_injected_leak(tmp_path, cache):
    config = tmp_path / "small.yaml"
    small = small_config(tmp_path, cache, data={"eval_every": 0}, checkpoint={"save_every": 2})
    config.write_text(yaml.safe_dump(small))
    out = tmp_path / "soak"
    done = subprocess.run([sys.executable, str(REPO / "tools" / "soak.py"), "--config", str(config), "--steps", "12",
                           "--out", str(out), "--every", "0.25", "--fault", "leak_mib_per_step=128"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-4000:]
    with open(out / "samples.csv", newline="") as f:
        samples = list(csv.DictReader(f))
    kinds = {row["kind"] for row in samples}
    assert {"torch.distributed.run", "tools/faults.py", "ray::EngineActor", "ray::RewardActor",
            "raylet", "gcs_server", "machine", "run_folder_checkpoints", "run_folder_logs"} <= kinds, kinds
    assert any(kind.startswith("ray::RewardActor/child") for kind in kinds)  # its scoring worker processes
    ranks = {row["rank"] for row in samples if row["kind"] == "tools/faults.py"}
    assert ranks == {"0", "1"}
    assert {int(row["step"]) for row in samples} >= set(range(1, 12))
    verdict = (out / "verdict.md").read_text()
    growing = verdict.split("growing**: ")[1].splitlines()[0]
    assert "tools/faults.py rss_bytes" in growing, verdict
    # the leak is 128 MiB a step, 12,800 MiB per 100 steps; the ranks' own use moves by ~100 MiB within a step
    line = next(row for row in verdict.splitlines() if row.startswith("| tools/faults.py | rss_bytes"))
    slope = float(line.split("|")[4].split()[0])
    assert 6000 < slope < 25000, line
    for name in ("rss_bytes.png", "fds.png", "threads.png", "storage.png"):
        assert (out / name).stat().st_size > 10_000
