"""Launch a worker script under torchrun (gloo, CPU) from a test and read back what it wrote."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def run_torchrun(script: Path, nproc: int, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)  # keep the caller's
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, PYTHONWARNINGS="ignore")
    command = [str(TORCHRUN), "--standalone", "--nproc_per_node", str(nproc), str(script), *args]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed ({result.returncode}):\n"
                             f"{result.stdout[-5000:]}\n{result.stderr[-8000:]}")
    return result
