"""One weight set, three layouts (TP=1, TP=2, PP=2), three architectures, checked against HF; with one
sequence per row and with responses sharing their prompt's row.

A single 2-process torchrun launch (tests/models/workers/layouts_worker.py) computes everything.
"""
from pathlib import Path

import pytest
import torch

from tests.models.torchrun import run_torchrun
from tests.models.workers.reference import SEQUENCES, SHARED_PROMPT_SEQUENCES, TEST_CONFIGS

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "layouts_worker.py"
ARCHS = list(TEST_CONFIGS)
LAYOUTS = ["tp1", "tp2", "pp2"]


@pytest.fixture(scope="module")
def results(module_tmp):
    out = module_tmp("layouts")
    run_torchrun(WORKER, 2, str(out), timeout=240)
    return [torch.load(out / f"rank{r}.pt", weights_only=False, map_location="cpu") for r in range(2)]


def max_diff(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("arch", ARCHS)
def test_single_stage_logits_equal_hf(results, arch):
    assert results[0][arch]["logits_max_diff"] <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logprobs_equal_hf_and_tp1(results, arch, layout):
    entry = results[0][arch]
    logprobs = entry[layout]["logprobs"]
    assert logprobs.lengths.tolist() == [len(r) for _, r in SEQUENCES]
    for i, reference in enumerate(entry["hf_logprobs"]):
        assert max_diff(logprobs.token_logprobs[i, : len(reference)], reference) <= 1e-5
        assert abs(logprobs.sums[i].item() - reference.sum().item()) <= 1e-4
        assert not logprobs.response_mask[i, len(reference):].any()
        assert (logprobs.token_logprobs[i, len(reference):] == 0).all()
    assert max_diff(logprobs.token_logprobs, entry["tp1"]["logprobs"].token_logprobs) <= 1e-5


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_every_rank_of_the_agent_gets_the_logprobs(results, arch, layout):
    mine, other = results[0][arch][layout]["logprobs"], results[1][arch][layout]["logprobs"]
    assert torch.equal(mine.token_logprobs, other.token_logprobs)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_returns_the_loaded_hf_weights_exactly(results, arch, layout):
    entry = results[0][arch]
    exported, hf_state = entry[layout]["exported"], entry["hf_state"]
    expected = set(hf_state) - ({"lm_head.weight"} if TEST_CONFIGS[arch]["tie_word_embeddings"] else set())
    assert set(exported) == expected
    for name, tensor in exported.items():
        assert torch.equal(tensor, hf_state[name]), name


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_gradients_equal_tp1(results, arch, layout):
    grads, reference = results[0][arch][layout]["grads"], results[0][arch]["tp1"]["grads"]
    assert set(grads) == set(reference)
    for name in reference:
        assert max_diff(grads[name], reference[name]) <= 1e-5, name


@pytest.mark.parametrize("arch", ARCHS)
def test_tp1_gradients_equal_hf(results, arch):
    grads, hf_grads = results[0][arch]["tp1"]["grads"], results[0][arch]["hf_grads"]
    assert set(grads) == set(hf_grads)
    for name in hf_grads:
        assert max_diff(grads[name], hf_grads[name]) <= 2e-5, name


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_shared_prompt_rows_give_each_response_its_own_logprobs(results, arch, layout):
    """Responses packed behind one copy of their prompt (own mask, positions and RoPE per response) get the
    log-probs HF gives each sequence alone: a response seeing another's tokens, or a position off by the
    tokens before it in the row, moves them by far more than 1e-5."""
    entry = results[0][arch]
    logprobs = entry[layout]["shared_logprobs"]
    assert logprobs.lengths.tolist() == [len(r) for _, r in SHARED_PROMPT_SEQUENCES]
    for i, reference in enumerate(entry["hf_shared_logprobs"]):
        assert max_diff(logprobs.token_logprobs[i, : len(reference)], reference) <= 1e-5, i
        assert (logprobs.token_logprobs[i, len(reference):] == 0).all()
    if layout != "tp1":
        assert torch.equal(logprobs.token_logprobs, results[1][arch][layout]["shared_logprobs"].token_logprobs)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_shared_prompt_rows_give_the_gradients_of_separate_sequences(results, arch, layout):
    grads, hf_grads = results[0][arch][layout]["shared_grads"], results[0][arch]["hf_shared_grads"]
    assert set(grads) == set(hf_grads)
    for name in hf_grads:
        assert max_diff(grads[name], hf_grads[name]) <= 2e-5, name


KERNELS = ["local", "sdpa", "flex"]
ROWS = {"logprobs": "hf_logprobs", "packed_logprobs": "hf_logprobs", "shared_logprobs": "hf_shared_logprobs",
        "shared_packed_logprobs": "hf_shared_logprobs"}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", list(ROWS))
def test_every_attention_kernel_gives_each_sequence_its_hf_logprobs(results, arch, layout, kernel, rows):
    """train.attention's kernels on one sequence a row, shared-prompt rows, and sequences packed end to end to a
    token budget (several documents a row, with and without shared prompts): each response's log-probs are HF's
    for the sequence alone, and megatron's local attention's (plain rows) or blocked attention's to 1e-5."""
    entry = results[0][arch]
    kernels = entry[layout]["kernels"]
    logprobs, reference = kernels[kernel][rows], entry[ROWS[rows]]
    assert logprobs.lengths.tolist() == [len(r) for r in reference]
    for i, expected in enumerate(reference):
        assert max_diff(logprobs.token_logprobs[i, : len(expected)], expected) <= 1e-5, i
    assert max_diff(logprobs.token_logprobs, kernels["local"][rows].token_logprobs) <= 1e-5


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kernel", ["local", "sdpa"])
def test_packed_shared_rows_give_the_gradients_of_separate_sequences(results, arch, layout, kernel):
    """Shared prompts packed two documents a row: the gradients HF gives the sequences one by one (FlexAttention
    has no CPU backward; the GPU run checks it)."""
    grads = results[0][arch][layout]["kernels"][kernel]["shared_packed_grads"]
    hf_grads = results[0][arch]["hf_shared_grads"]
    assert set(grads) == set(hf_grads)
    for name in hf_grads:
        assert max_diff(grads[name], hf_grads[name]) <= 2e-5, name
