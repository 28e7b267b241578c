"""train.params_dtype: bf16 on CPU: megatron's mixed precision (bf16 weights and activations, fp32 main
weights in the optimizer) runs here as on GPU, and learns like fp32 (one torchrun rank)."""
import json

import numpy as np
import pytest

from tests.models.torchrun import REPO, run_torchrun

pytestmark = pytest.mark.distributed  # a torchrun world: not in make test-fast

WORKER = REPO / "tests" / "training" / "workers" / "bf16_worker.py"


@pytest.fixture(scope="module")
def report(module_tmp):
    out = module_tmp("bf16") / "report.json"
    run_torchrun(WORKER, 1, str(out), timeout=300)
    return json.loads(out.read_text())


def test_bf16_weights_with_fp32_main_weights(report):
    assert report["fp32"]["param_dtypes"] == ["torch.float32"] == report["fp32"]["main_param_dtypes"]
    assert report["bf16"]["param_dtypes"] == ["torch.bfloat16"]
    assert report["bf16"]["main_param_dtypes"] == ["torch.float32"]
    # after the updates every bf16 weight is its fp32 main weight rounded, and the main weights carry more
    assert report["bf16"]["params_are_rounded_main"]
    assert report["bf16"]["main_holds_more_than_bf16"]


def test_bf16_log_probs_agree_with_fp32_to_bf16_precision(report):
    fp32, bf16 = np.array(report["fp32"]["token_logp"]), np.array(report["bf16"]["token_logp"])
    gap = np.abs(fp32 - bf16)
    assert 0 < gap.max() < 0.15 and gap.mean() < 0.03, (gap.max(), gap.mean())


def test_bf16_learns_like_fp32(report):
    fp32, bf16 = report["fp32"]["surrogate"], report["bf16"]["surrogate"]
    assert fp32[-1] < fp32[0] and bf16[-1] < bf16[0]  # the surrogate -mean(A * mean log pi) goes down
    assert np.allclose(fp32, bf16, atol=0.1 * abs(fp32[0] - fp32[-1]) + 0.02), (fp32, bf16)
