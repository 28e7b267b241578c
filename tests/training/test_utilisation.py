"""Model FLOPs of an update against torch's own FLOP counter on the Hugging Face model, and the GEMM peak."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hacpo_megatron.models.architectures import read_architecture
from hacpo_megatron.training import utilisation
from hacpo_megatron.training.utilisation import attention_flops, gemm_peak_flops, training_flops
from tests.models.workers.reference import TEST_CONFIGS, hf_model


@pytest.mark.parametrize("name", ["qwen3", "llama", "qwen2"])
def test_training_flops_match_torchs_count_of_the_hf_models_forward_and_backward(name):
    """FlopCounterMode counts every matmul the HF model runs forward and backward, here with logits at the
    response positions only (`logits_to_keep`), as the trainer computes them. Its eager attention multiplies
    the whole L x L square (the causal mask is applied after), where model FLOPs count the triangle: the
    count is ours plus the other half of attention, three passes of it."""
    model = hf_model(name)
    model.config._attn_implementation = "eager"
    arch = read_architecture(TEST_CONFIGS[name])
    prompt, response = 29, 8
    with FlopCounterMode(display=False) as counter:
        logits = model(torch.randint(0, arch.vocab_size, (1, prompt + response)), logits_to_keep=response).logits
        assert logits.shape[1] == response
        logits.float().logsumexp(-1).sum().backward()
    counted = counter.get_total_flops()
    ours = training_flops(arch, [(prompt, [response])])
    assert counted == pytest.approx(ours + 3 * attention_flops(arch, prompt + response, []), rel=1e-9)
    # packed sequences attend to themselves only: attention adds per sequence, the rest per token
    assert training_flops(arch, [(prompt, [response]), (3, [2])]) == pytest.approx(
        ours + training_flops(arch, [(3, [2])]))
    assert attention_flops(arch, 2 * prompt, []) == pytest.approx(4 * attention_flops(arch, prompt, []))


def test_a_shared_prompt_counts_once():
    """Two responses in one row with their prompt: the two plain sequences less one prompt's layers and
    causal attention (each response still attends to the whole prompt)."""
    arch = read_architecture(TEST_CONFIGS["qwen3"])
    shared = training_flops(arch, [(20, [5, 7])])
    separate = training_flops(arch, [(20, [5]), (20, [7])])
    prompt_alone = training_flops(arch, [(20, [])])
    assert shared == pytest.approx(separate - prompt_alone)
    assert attention_flops(arch, 20, [5, 7]) == pytest.approx(
        attention_flops(arch, 25, []) + attention_flops(arch, 27, []) - attention_flops(arch, 20, []))


def test_gemm_peak_is_the_fastest_trial(monkeypatch):
    ticks = iter([0.0, 0.5, 1.0, 1.25, 2.0, 3.0])  # trials of 0.5 s, 0.25 s and 1.0 s
    monkeypatch.setattr(utilisation.time, "perf_counter", lambda: next(ticks))
    peak = gemm_peak_flops(torch.float32, torch.device("cpu"), size=64, trials=3)
    assert peak == pytest.approx(2 * 64**3 / 0.25)


def test_gemm_peak_of_this_cpu_is_a_plausible_rate():
    peak = gemm_peak_flops(torch.float32, torch.device("cpu"), size=256)
    assert 1e8 < peak < 1e13  # between a slow core and far more than a 2-core machine's fp32 peak


@pytest.mark.distributed  # a torchrun world: not in make test-fast
def test_ranks_time_their_gemm_peaks_one_after_another(tmp_path):
    """A peak timed while another rank computes reads low: no two ranks' timings may overlap."""
    import json

    from tests.models.torchrun import REPO, run_torchrun

    run_torchrun(REPO / "tests" / "training" / "workers" / "gemm_peak_turns_worker.py", 3, str(tmp_path / "log"))
    intervals = [json.loads((tmp_path / f"log.{rank}.json").read_text()) for rank in range(3)]
    assert [len(i) for i in intervals] == [2, 2, 2]  # every trainer of every rank timed
    for rank in range(2):  # rank r + 1 starts after rank r has finished both of its trainers
        assert intervals[rank + 1][0][0] >= intervals[rank][-1][1]
