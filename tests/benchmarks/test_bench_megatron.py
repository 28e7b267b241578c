"""benchmarks/bench_megatron.py end to end on a tiny shape: every backend runs both passes and megatron's log-probs
equal transformers' (fp32 on the CPU). What it times is not asserted (a benchmark's business); that it runs is: a
change of the loss signature once broke its transformers update unseen until a GPU lease tried it."""
import json
import subprocess
import sys

from tests.benchmarks.scripts import REPO


def test_both_passes_of_every_backend_run_and_agree_with_transformers(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_megatron.py"), "--models", "tiny", "--vocab-sizes", "512",
         "--sequences", "8", "--prompt-length", "6", "--response-length", "5", "--micro-batch", "4",
         "--repeats", "1", "--warmup", "0", "--attention", "auto", "local", "--rows", "shared", "plain",
         "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    measured = {(row["backend"], row["kind"]) for row in report["results"]}
    backends = {"megatron", "megatron[local]", "megatron[plain]", "megatron[local,plain]", "hf-full-logits",
                "hf-response-logits"}
    assert measured == {(backend, kind) for backend in backends for kind in ("logprob", "train")}
    assert all(row["ms"] > 0 and row["tokens_per_s"] > 0 for row in report["results"])
    (model,) = report["models"]
    assert model["max_abs_logprob_diff_megatron_vs_hf"] < 1e-4  # the same weights, fp32
