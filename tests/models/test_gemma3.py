"""Gemma 3 as a model family (hacpo_megatron/models/gemma3.py) against transformers' Gemma3ForCausalLM.

The distributed checks share one 2-process torchrun launch (tests/models/workers/gemma3_worker.py): a tiny random
Gemma 3 at TP=1, TP=2 and PP=2, through megatron's attention and through the blocked shared-prompt attention,
on sequences longer than its sliding window, plus the conversion tools' round trip. The rest runs in-process:
the blocked attention's window in float64, the (1 + w) norm, the config reading, the one-KV-head layout error.
"""
import math
from pathlib import Path

import pytest
import torch

from hacpo_megatron.models.architectures import read_architecture, transformer_config
from hacpo_megatron.models.presets import PRESETS
from tests.models.torchrun import run_torchrun

WORKER = Path(__file__).parent / "workers" / "gemma3_worker.py"
LAYOUTS = ["tp1", "tp2", "pp2"]
# Gemma 3 270M's config.json as the GGUF import writes it (its architecture only)
GEMMA3_270M = dict(PRESETS["tiny-gemma3"], hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                   sliding_window=512, max_position_embeddings=32768,
                   layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)])


def max_diff(a, b):
    return (a - b).abs().max().item()


# ------------------------------------------------------------------------------------------------
# One torchrun world: logits, log-probs, gradients, export, conversion (tiny random Gemma 3)
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma(module_tmp):
    from tests.models.workers.gemma3_worker import CONFIG

    hf_dir, out = module_tmp("gemma3_hf"), module_tmp("gemma3_out")
    make_hf_folder(hf_dir, CONFIG)
    run_torchrun(WORKER, 2, str(hf_dir), str(out), timeout=300)
    return {"ranks": [torch.load(out / f"rank{r}.pt", weights_only=False, map_location="cpu") for r in range(2)],
            "hf_dir": hf_dir, "out": out}


def make_hf_folder(folder: Path, config: dict) -> None:
    """A random Gemma 3 in float32 whose norm weights are not all zero (HF initialises them to 0, i.e. a factor
    of 1): a norm mapped to the wrong place, or computed as x * w instead of x * (1 + w), changes the output."""
    import transformers

    from hacpo_megatron.models.architectures import normalized_hf_config

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(normalized_hf_config(config), dtype=torch.float32)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(folder)


def result(gemma, layout, key):
    """A layout's result from whichever rank has it (the logits live on the last stage's first TP rank)."""
    values = [rank[layout][key] for rank in gemma["ranks"] if layout in rank and rank[layout][key] is not None]
    return values[0]


def test_the_sequences_are_longer_than_the_window():
    from tests.models.workers.gemma3_worker import SEQUENCES, SHARED_SEQUENCES, WINDOW, logit_tokens

    assert all(len(p) + len(r) > WINDOW for p, r in SEQUENCES)
    assert max(len(p) + len(r) for p, r in SHARED_SEQUENCES) > 2 * WINDOW and logit_tokens().shape[1] > 2 * WINDOW


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_through_megatron_attention_equal_transformers(gemma, layout):
    reference = gemma["ranks"][0]["hf_logits"]
    logits = result(gemma, layout, "logits")
    assert logits.shape == reference.shape and reference.abs().max() > 1.0
    assert max_diff(logits, reference) <= 1e-4


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", ["one_per_sequence", "shared_prompts"])
def test_logprobs_equal_transformers(gemma, layout, rows):
    """One row per sequence: megatron's attention with its sliding-window mask. Shared-prompt rows: the blocked
    attention, which must drop the keys outside each layer's window by positions in the response's own sequence
    and rotate with the RoPE base of each layer's type; a response seeing too much or too little moves its
    log-probs by far more than 1e-5."""
    prefix = "shared_" if rows == "shared_prompts" else ""
    reference = gemma["ranks"][0][f"hf_{prefix}logprobs"]
    members = [rank for rank in gemma["ranks"] if layout in rank]
    assert len(members) == (1 if layout == "tp1" else 2)
    for rank in members:  # every rank of the agent gets them
        logprobs = rank[layout][f"{prefix}logprobs"]
        assert logprobs.lengths.tolist() == [len(r) for r in reference]
        for i, expected in enumerate(reference):
            assert max_diff(logprobs.token_logprobs[i, : len(expected)], expected) <= 1e-5, i


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", ["one_per_sequence", "shared_prompts"])
def test_gradients_equal_transformers(gemma, layout, rows):
    prefix = "shared_" if rows == "shared_prompts" else ""
    grads, reference = gemma["ranks"][0][layout][f"{prefix}grads"], gemma["ranks"][0][f"hf_{prefix}grads"]
    assert set(grads) == set(reference)  # tied: one embedding, no lm_head
    for name in reference:
        # float32 sums: the tied embedding's gradient reaches |17| (embeddings are scaled by sqrt(hidden) = 8)
        tolerance = 2e-5 + 1e-5 * reference[name].abs().max().item()
        assert max_diff(grads[name], reference[name]) <= tolerance, name


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kernel", ["local", "sdpa", "flex"])
@pytest.mark.parametrize("rows", ["logprobs", "packed_logprobs", "shared_logprobs", "shared_packed_logprobs"])
def test_every_attention_kernel_honours_the_sliding_window(gemma, layout, kernel, rows):
    """train.attention's kernels on sliding-window layers, on one sequence a row, shared prompts and rows packed to a
    token budget (every document longer than the window): transformers' log-probs of each sequence alone."""
    reference = gemma["ranks"][0]["hf_shared_logprobs" if rows.startswith("shared") else "hf_logprobs"]
    logprobs = gemma["ranks"][0][layout]["kernels"][kernel][rows]
    assert logprobs.lengths.tolist() == [len(r) for r in reference]
    for i, expected in enumerate(reference):
        assert max_diff(logprobs.token_logprobs[i, : len(expected)], expected) <= 1e-5, i


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kernel", ["local", "sdpa"])
def test_packed_shared_rows_give_transformers_gradients_on_sliding_window_layers(gemma, layout, kernel):
    grads = gemma["ranks"][0][layout]["kernels"][kernel]["shared_packed_grads"]
    reference = gemma["ranks"][0]["hf_shared_grads"]
    assert set(grads) == set(reference)
    for name in reference:
        tolerance = 2e-5 + 1e-5 * reference[name].abs().max().item()  # as test_gradients_equal_transformers
        assert max_diff(grads[name], reference[name]) <= tolerance, name


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_returns_the_loaded_weights_exactly(gemma, layout):
    hf_state, exported = gemma["ranks"][0]["hf_state"], gemma["ranks"][0][layout]["exported"]
    assert set(exported) == set(hf_state) - {"lm_head.weight"}
    assert {n for n in exported if "feedforward_layernorm" in n or "post_attention_layernorm" in n}  # sandwich
    for name, tensor in exported.items():
        assert torch.equal(tensor, hf_state[name]), name


@pytest.mark.distributed
def test_conversion_tools_round_trip_exactly_and_compare_resharded(gemma):
    from hacpo_megatron.checkpoint.hf_io import HFWeights

    conversion = gemma["ranks"][0]["conversion"]
    assert conversion["compare_tp2_checkpoint_at_pp2"] <= 1e-4
    assert gemma["ranks"][1]["conversion"] == dict(conversion, seconds=gemma["ranks"][1]["conversion"]["seconds"])
    original, exported = HFWeights(gemma["hf_dir"]), HFWeights(gemma["out"] / "hf_from_tp2")
    assert set(exported) == set(original)
    for name in original:
        assert exported[name].dtype == original[name].dtype and torch.equal(exported[name], original[name]), name


# ------------------------------------------------------------------------------------------------
# In-process
# ------------------------------------------------------------------------------------------------
def _dense_reference(query, key, value, positions, rows_segments, scale, window):
    """Textbook masked attention over whole rows in float64: a query sees a key of the prompt or of its own
    response at a position <= its own and > its own - `window` (HF's sliding-window rule)."""
    heads, groups = query.shape[2], key.shape[2]
    key, value = (x.repeat_interleave(heads // groups, dim=2) for x in (key, value))
    scores = torch.einsum("qbhd,kbhd->bhqk", query, key) * scale
    q_pos, k_pos = positions[:, None, :, None], positions[:, None, None, :]  # [rows, 1, S, 1] / [rows, 1, 1, S]
    q_seg, k_seg = rows_segments[:, None, :, None], rows_segments[:, None, None, :]
    visible = (k_pos <= q_pos) & (k_pos > q_pos - window) & ((k_seg == 0) | (k_seg == q_seg)) & (k_seg >= 0)
    probs = torch.softmax(scores.masked_fill(~visible, -math.inf), dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,kbhd->qbhd", probs, value).reshape(*query.shape[:2], -1)


@pytest.mark.parametrize("window", [3, 6, 100])
def test_blocked_attention_honours_the_sliding_window(window):
    """attend_in_blocks with a window (megatron's left extent: window - 1) against dense masked attention, values
    and gradients, for rows of shared prompts whose responses reach past the window."""
    from hacpo_megatron.models.attention import attend_in_blocks, attention_blocks
    from hacpo_megatron.models.packing import pack_sequences

    sequences = [([1] * 5, [2] * 7), ([1] * 5, [3] * 2), ([1] * 5, [4] * 9), ([5] * 8, [6] * 4), ([5] * 8, [7])]
    packed = pack_sequences(sequences, range(len(sequences)), share_prompts=True)
    rows, width = packed.tokens.shape
    segments = torch.full((rows, width), -1)
    for r, (prompt_length, lengths) in enumerate(packed.layout):
        segments[r, :prompt_length] = 0
        start = prompt_length
        for a, length in enumerate(lengths):
            segments[r, start:start + length] = a + 1
            start += length
    torch.manual_seed(0)
    query = torch.randn(width, rows, 4, 8, dtype=torch.float64, requires_grad=True)
    key = torch.randn(width, rows, 2, 8, dtype=torch.float64, requires_grad=True)
    value = torch.randn(width, rows, 2, 8, dtype=torch.float64, requires_grad=True)

    blocked = attend_in_blocks(query, key, value, attention_blocks(packed.documents, rows), 0.3, window=window - 1)
    reference = _dense_reference(query, key, value, packed.position_ids, segments, 0.3, window)
    real = (segments >= 0).T
    assert torch.allclose(blocked[real], reference[real], atol=1e-12, rtol=0)
    weights = torch.randn_like(reference) * real[..., None]
    grads = torch.autograd.grad((blocked * weights).sum(), (query, key, value))
    expected = torch.autograd.grad((reference * weights).sum(), (query, key, value))
    for got, want in zip(grads, expected):
        assert torch.allclose(got, want, atol=1e-12, rtol=0)
    if window < 9:  # the window really cut something: without it the result differs
        unwindowed = attend_in_blocks(query, key, value, attention_blocks(packed.documents, rows), 0.3)
        assert not torch.allclose(unwindowed[real], reference[real], atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma3_rmsnorm_equals_transformers(dtype):
    """x * (1 + w) computed in float32 and cast back, bit for bit with HF's module (bf16 input too)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm as HFNorm

    from hacpo_megatron.models.gemma3 import Gemma3RMSNorm

    torch.manual_seed(0)
    ours, theirs = Gemma3RMSNorm(hidden_size=64, eps=1e-6), HFNorm(64, eps=1e-6)
    weight = torch.randn(64)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    ours.to(dtype), theirs.to(dtype)
    x = (3 * torch.randn(5, 7, 64)).to(dtype)
    assert torch.equal(ours(x), theirs(x)) and ours(x).dtype == dtype


def test_read_architecture_of_gemma3():
    tiny, real = read_architecture(PRESETS["tiny-gemma3"]), read_architecture(GEMMA3_270M)
    assert (real.family, real.num_layers, real.hidden_size, real.num_attention_heads, real.num_query_groups,
            real.head_dim, real.vocab_size, real.sliding_window) == ("gemma3", 18, 640, 4, 1, 256, 262144, 512)
    assert (real.rope_theta, real.sliding_rope_theta, real.softmax_scale) == (1e6, 1e4, 1 / 16)
    assert real.sliding_layers == [0 if (i + 1) % 6 == 0 else 1 for i in range(18)]  # 5 sliding : 1 full
    assert real.tie_word_embeddings and real.qk_layernorm and real.activation == "gelu_pytorch_tanh"
    assert tiny.sliding_layers == [1, 0, 1, 1] and tiny.softmax_scale == 24 ** -0.5 != tiny.head_dim ** -0.5
    for change, message in [(dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
                            (dict(hidden_activation="gelu"), "hidden_activation"),
                            (dict(rope_parameters=dict(PRESETS["tiny-gemma3"]["rope_parameters"], full_attention=dict(
                                rope_type="linear", factor=8.0, rope_theta=1e6))), "rope_type 'linear'")]:
        with pytest.raises(ValueError, match=message):
            read_architecture(dict(PRESETS["tiny-gemma3"], **change))


def test_transformer_config_of_gemma3():
    from hacpo_megatron.models.gemma3 import gelu_tanh

    arch = read_architecture(PRESETS["tiny-gemma3"])
    config = transformer_config(arch, tensor_parallel=2, pipeline_parallel=2)
    assert config.window_size == (7, 0) and config.window_attn_skip_freq == [1, 0, 1, 1]
    assert config.softmax_scale == 24 ** -0.5 and config.activation_func is gelu_tanh and config.gated_linear_unit
    assert not config.bias_activation_fusion and config.qk_layernorm and config.layernorm_zero_centered_gamma
    x = torch.randn(100)
    assert torch.equal(gelu_tanh(x), torch.nn.functional.gelu(x, approximate="tanh"))


# ------------------------------------------------------------------------------------------------
# One key/value head: TP=2 is a named error wherever a layout is chosen
# ------------------------------------------------------------------------------------------------
KV_MESSAGE = r"key/value heads \(1\).*; a key/value head cannot be split over TP ranks: use TP=1"


def test_tp2_with_one_kv_head_is_a_named_config_error(tmp_path):
    """An agent whose model folder is Gemma 3 270M's (config.json only: nothing is converted or loaded)."""
    import json

    from hacpo_megatron.config import ConfigError, load_config

    (tmp_path / "gemma").mkdir()
    (tmp_path / "gemma" / "config.json").write_text(json.dumps(GEMMA3_270M))
    path = tmp_path / "c.yaml"
    path.write_text(f"run:\n  name: t\nagents:\n  - name: g\n    model: {tmp_path / 'gemma'}\n    parallel:\n"
                    "      tensor: 2\n  - name: q\n    model: tiny-qwen3\nalgorithm:\n  alpha: 1.0\ndata:\n"
                    "  prompt_batch_size: 8\ntrain:\n  mini_batch_size: 4\n")
    with pytest.raises(ConfigError, match=r"agents\.0\.parallel\.tensor: TP=2 must divide the attention heads \(4\) "
                                          r"and " + KV_MESSAGE):
        load_config(str(path))
    path.write_text(path.read_text().replace("tensor: 2", "pipeline: 2"))
    assert load_config(str(path)).agents[0].parallel.pipeline == 2  # PP=2 is fine: 18 layers


def test_tp2_with_one_kv_head_is_refused_by_the_tools_and_the_builder():
    from hacpo_megatron.checkpoint.tool_layout import ToolLayout, check_tool_layout
    from hacpo_megatron.models.build import check_layout

    arch = read_architecture(GEMMA3_270M)
    with pytest.raises(ValueError, match="TP=2 must divide the attention heads.*" + KV_MESSAGE):
        check_tool_layout(arch, ToolLayout(2, 1))
    check_tool_layout(arch, ToolLayout(1, 2))

    class TwoRanks:  # what check_layout reads of an AgentParallel
        name, tp_size, pp_size, dp_size, ep_size, etp_size = "g", 2, 1, 1, 1, 2

    with pytest.raises(ValueError, match="g: TP=2 must divide the attention heads.*" + KV_MESSAGE):
        check_layout(arch, TwoRanks())
    # the message only speaks of key/value heads when they are the reason
    with pytest.raises(ValueError) as error:
        check_tool_layout(read_architecture(dict(PRESETS["tiny-gemma3"], hidden_size=96, num_attention_heads=6,
                                                 num_key_value_heads=6)), ToolLayout(4, 1))
    assert "cannot be split" not in str(error.value)
