"""Qwen3-MoE through the conversion tools at expert-parallel layouts (issue 52, item 5), as a user runs them: one plain
`python` command each, the tool starting its own processes (TP x PP x the data-parallel replicas --ep needs).

A random Qwen3-MoE folder (tests/models/test_moe.py's, 8 experts) converted at EP 1, EP 2 and TP 2 x EP 2; exported at
EP 2 and at EP 1, every tensor equal to the original's; compared against transformers at EP 2 with TP 2 and with PP 2,
and at EP 1 from a checkpoint saved at EP 2. What runs in one process (the layout arithmetic, the checks, the bad
--ep messages): tests/checkpoint/test_moe_tools.py. An --ep that does not divide the experts is refused there, each
tool's main() in this process (`test_a_bad_ep_is_one_line_before_any_process_starts[ep_3-...]`: the exit message, no
process started, no output folder); that a tool's refusal as a process is that one line on stderr and nothing else:
test_single_process_tools.py (a process here only added the ~10 s of its imports).
"""
import re

import pytest
import torch

from hacpo_megatron.checkpoint.format import read_checkpoint_metadata
from hacpo_megatron.checkpoint.hf_io import HFWeights
from tests.checkpoint.test_single_process_tools import run_tool, tool
from tests.models.test_moe import EXPERTS, random_hf_model, tiny_config

pytestmark = pytest.mark.distributed  # the tools start 2 or 4 processes
TOLERANCE = 1e-4  # max |logit difference| in float32, as for the dense models
CONVERSIONS = {"ep1": (), "ep2": ("--ep", 2), "tp2_ep2": ("--tp", 2, "--ep", 2)}


@pytest.fixture(scope="module")
def converted(module_tmp):
    """The HF folder (sharded, small shards) and its conversions; {name: (exit code, stdout, stderr, pids)}."""
    root = module_tmp("moe_conversion")
    hf = root / "hf"
    random_hf_model(tiny_config(), seed=3).save_pretrained(hf, max_shard_size="200KB")
    runs = {name: run_tool(tool("convert_hf_to_megatron"), "--hf-path", hf, "--save", root / name, *flags)
            for name, flags in CONVERSIONS.items()}
    return {"root": root, "hf": hf, "runs": runs}


@pytest.mark.parametrize("name, layout, processes", [
    ("ep1", "TP=1, PP=1", 0), ("ep2", "TP=1, PP=1, EP=2", 2), ("tp2_ep2", "TP=2, PP=1, EP=2", 2)])
def test_a_qwen3_moe_folder_converts_at_ep_1_and_2(converted, name, layout, processes):
    code, stdout, stderr, pids = converted["runs"][name]
    assert code == 0, stderr[-5000:]
    folder = converted["root"] / name
    assert stdout.strip() == f"saved Megatron checkpoint ({layout}) to {folder}"
    metadata = read_checkpoint_metadata(folder)
    ep = 2 if "ep2" in name else 1
    assert (metadata.tensor_parallel, metadata.pipeline_parallel, metadata.expert_parallel) == (
        2 if name.startswith("tp2") else 1, 1, ep)
    assert metadata.hf_architecture == "Qwen3MoeForCausalLM"
    assert len(pids) >= processes  # the workers it started (EP 2 at TP 1: two data-parallel replicas)


def assert_exact(original_folder, exported_folder):
    original, exported = HFWeights(original_folder), HFWeights(exported_folder)
    assert set(exported) == set(original)
    assert len([n for n in original if ".mlp.experts." in n]) == 2 * EXPERTS * 3  # every expert, each projection
    for name in original:
        assert exported[name].dtype == original[name].dtype and torch.equal(exported[name], original[name]), name


@pytest.mark.parametrize("saved, flags, printed", [
    ("ep2", ("--ep", 2), "round trip at EP 2: each EP rank sends its own experts"),
    ("ep2", (), "saved at EP 2, loaded at EP 1"),
    ("tp2_ep2", ("--ep", 2), "saved at TP 2 x EP 2, loaded at TP 1 x EP 2 (two replicas)"),
    ("ep1", ("--ep", 2), "saved at EP 1, loaded at EP 2"),
], ids=["ep2_at_ep2", "ep2_at_ep1", "tp2_ep2_at_ep2", "ep1_at_ep2"])
def test_megatron_to_hf_gives_every_tensor_back_exactly(converted, tmp_path, saved, flags, printed):
    assert converted["runs"][saved][0] == 0, converted["runs"][saved][2][-5000:]
    code, stdout, stderr, _ = run_tool(tool("convert_megatron_to_hf"), "--load", converted["root"] / saved,
                                       "--save", tmp_path / "hf", "--max-shard-size", "300KB", *flags)
    assert code == 0, f"{printed}\n{stderr[-5000:]}"
    assert stdout.strip() == f"exported {saved} to {tmp_path / 'hf'}"
    assert_exact(converted["hf"], tmp_path / "hf")


def logit_difference(stdout: str) -> float:
    return float(re.search(r"max \|logit difference\| = (\S+) ", stdout).group(1))


@pytest.mark.parametrize("saved, flags, layout", [
    ("ep2", ("--ep", 2, "--tp", 2), "TP=2, PP=1, EP=2"),
    ("ep2", ("--ep", 2, "--pp", 2), "TP=1, PP=2, EP=2"),
    ("tp2_ep2", (), "TP=1, PP=1"),
], ids=["ep2_at_tp2_ep2", "ep2_at_pp2_ep2", "tp2_ep2_at_ep1"])
def test_logits_match_transformers_at_expert_parallel_layouts(converted, saved, flags, layout):
    """The alltoall dispatcher at EP 2 (tokens to the experts' rank and back) with the attention split over TP 2,
    and over two pipeline stages (4 processes: PP 2 x two replicas); and a checkpoint saved at EP 2 at EP 1."""
    assert converted["runs"][saved][0] == 0, converted["runs"][saved][2][-5000:]
    code, stdout, stderr, _ = run_tool(tool("compare_hf_megatron"), "--hf-path", converted["hf"],
                                       "--megatron-path", converted["root"] / saved, *flags)
    assert code == 0, stderr[-5000:]
    assert logit_difference(stdout) <= TOLERANCE
    assert stdout.strip().endswith(f"({layout}, float32); tolerance 1.0e-04: OK"), stdout

