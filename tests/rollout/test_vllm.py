"""The vLLM engine, for real, on vLLM's CPU build (`make setup-vllm`, which `make test` runs).

The checks run in a child process (vllm_checks.py): vLLM starts worker processes that re-import
the main module, and a crash of vLLM must not take pytest with it."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from hacpo_megatron.rollout.vllm_engine import cpu_thread_binding

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# under xdist, on the worker of tests/e2e/test_vllm_run.py, not beside it: its engines' files in /dev/shm would
# count as that run's leftovers
pytestmark = pytest.mark.xdist_group("dev_shm")


def run_checks(work, *mode):
    assert importlib.util.find_spec("vllm") is not None, "vLLM is not installed: `make setup-vllm` (make test does)"
    out = work / "facts.json"
    # these would override the engines' own settings (KV cache size; the workers' memory settings)
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_CPU_KVCACHE_SPACE", "MALLOC_MMAP_THRESHOLD_", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    env["TOKENIZERS_PARALLELISM"] = "false"
    command = [sys.executable, os.path.join(REPO, "tests", "rollout", "vllm_checks.py"), str(out), str(work), *mode]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    except subprocess.TimeoutExpired as hung:  # what it printed so far says where it hangs
        pytest.fail(f"vllm_checks.py hung: {(hung.stdout or b'')[-3000:]!r} {(hung.stderr or b'')[-6000:]!r}")
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def facts(module_tmp):
    return run_checks(module_tmp("vllm"))


@pytest.fixture(scope="module")
def gemma3_facts(module_tmp):
    return run_checks(module_tmp("vllm_gemma3"), "gemma3")


@pytest.mark.vllm
def test_vllm_generates_groups_with_sampling_logprobs_at_the_temperature(facts):
    assert facts["group_sizes"] == [3, 3]
    assert facts["lengths_ok"]
    assert facts["logprob_max_abs_diff"] < 1e-4  # vs a transformers forward of the same weights, logits / T
    assert facts["same_seed_same_samples"]
    assert facts["text_is_our_decoding"]  # the agent's tokenizer decodes, as in the other engines
    assert facts["samples_of_a_group_differ"]
    assert facts["truncated_reason"] == "length"


@pytest.mark.vllm
def test_vllm_stops_on_the_agents_end_tokens_and_keeps_the_end_token(facts):
    tokens, num_logprobs, reason, end_token = facts["stop_cut"]
    assert tokens == [end_token] and num_logprobs == 1 and reason == "stop"


@pytest.mark.vllm
def test_vllm_weight_update_changes_generation_and_check_mode_confirms_it(facts):
    assert not facts["check_before_update_equal"] and facts["check_before_update_mismatches"] > 0
    assert facts["check_after_update_equal"], facts["check_after_update_report"]
    assert facts["check_after_update_max_diff"] == 0.0
    assert facts["update_buckets"] > 3  # staged in several buckets, applied once
    assert not facts["partial_check_equal"] and facts["partial_check_unsent"] >= 1
    assert facts["update_without_begin_raises"]
    assert facts["generation_changed"]
    assert facts["logprob_max_abs_diff_after_update"] < 1e-4


@pytest.mark.vllm
def test_when_the_engine_core_process_dies_the_engine_says_its_process_is_lost(facts):
    """What ended the first real pair run: the kernel killed vLLM's engine core for its memory, and every
    later call raised EngineDeadError. The engine must call that a lost process (its actor then exits
    and Ray restarts it), and no other error."""
    loss = facts["engine_core_loss"]
    assert loss["killed"] == 1
    # killed under a generation (vLLM alone would wait forever), then a call after: both say so at once
    assert loss["errors"] == ["EngineDeadError", "EngineDeadError"] and all(loss["process_lost"])
    assert not loss["other_error_is_a_loss"]


@pytest.mark.vllm
def test_vllm_cpu_worker_runs_the_threads_asked_for_on_the_first_cores(facts):
    # vLLM's default would give a 2-core machine's worker one thread (a core kept for its scheduler)
    (worker,) = facts["worker_threads"]
    expected = facts["cores_here"][:2]
    assert worker["torch_threads"] == len(expected)
    assert worker["pinned_cores"] == expected  # each OpenMP thread on one of them
    assert facts["bind_variable_after_start"] is None  # the engine's process environment is left as it was


@pytest.mark.vllm
def test_vllm_workers_start_with_the_settings_that_keep_their_memory_flat(facts):
    """glibc's moving mmap threshold let a vLLM worker's heap fragment over a long run, and oneDNN's process-wide
    primitive cache grew it by a matmul per new batch shape (docs/reliability.md): the worker starts with the
    threshold fixed and that cache off; this process's environment is left as it was."""
    assert facts["worker_environment"] == [{"MALLOC_MMAP_THRESHOLD_": str(128 * 1024),
                                            "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}]
    assert facts["worker_variables_after_start"] == [None, None]


@pytest.mark.vllm
def test_new_batch_shapes_do_not_grow_the_vllm_worker(facts):
    """150 prefills, each of a row count not seen before: with oneDNN's cache at its default (1,024) the worker
    kept 98 MiB of them, with it off 3.7 (tests/rollout/vllm_checks.py run with ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024,
    then as here)."""
    assert facts["worker_growth_over_new_batch_shapes_mib"] < 20


def test_thread_binding_gives_each_worker_its_own_block_of_the_allowed_cores():
    assert cpu_thread_binding(2, 1, [0, 1]) == "0,1"
    assert cpu_thread_binding(2, 2, [7, 3, 5, 4]) == "3,4|5,7"  # sorted, one block per worker
    assert cpu_thread_binding(1, 3, [2, 6]) == "2|6|2"  # more workers than cores: they wrap around
    assert cpu_thread_binding(8, 1, [0, 1]) == "0,1"  # never more threads than cores, never a core twice


@pytest.mark.vllm
def test_vllm_runs_gemma3_with_pushed_weights_as_transformers_does_past_the_sliding_window(gemma3_facts):
    facts = gemma3_facts
    assert min(facts["prompt_lengths"]) > 2 * facts["window"]  # both layer types differ from full attention here
    assert facts["logprob_max_abs_diff"] < 1e-4  # vs transformers' Gemma3ForCausalLM, logits / T
    assert facts["check_after_update_equal"] and facts["check_after_update_max_diff"] == 0.0
    assert facts["logprob_max_abs_diff_after_update"] < 1e-4


@pytest.mark.vllm
def test_the_kv_cache_of_a_vllm_engine_on_cpu_is_the_size_the_config_gives(gemma3_facts):
    size, blocks, block_size = gemma3_facts["kv_cache"]
    assert size == 2**28  # rollout.cpu_kv_cache_gib 0.25, not vLLM's own size (a share of the machine's memory)
    # tiny Gemma 3: 2 layers of 2 KV heads x 16 dims, keys and values, fp32: 512 bytes a token
    # tiny Gemma 3 in fp32: 2 KV heads x 32 dims, keys and values, 512 bytes a token and layer; vLLM's hybrid
    # cache (sliding-window and global layers) lays a block of each layer group over the same pool
    assert blocks * block_size * 512 == size


@pytest.mark.vllm
def test_vllm_stops_a_line_format_answer_at_its_line_break(gemma3_facts):
    tokens, reason, line_break, first = gemma3_facts["stopped"]
    assert first != line_break and tokens == [line_break] and reason == "stop"
