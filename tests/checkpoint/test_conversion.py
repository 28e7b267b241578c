"""HF <-> Megatron conversion (issue 4) and per-agent checkpoints with atomic `latest`.

One 2-process torchrun launch (workers/checkpoint_worker.py) does all distributed work; the tests
here read its report and the folders it wrote. Bad input is checked in-process: every such error
comes before any distributed work.
"""
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from hacpo_megatron.checkpoint.hf_io import HFFolderError, HFWeights, WEIGHTS_INDEX_FILE
from hacpo_megatron.checkpoint.format import CheckpointError, read_checkpoint_metadata
from tests.checkpoint.hf_folders import ARCH_CONFIGS, LAYOUTS, make_hf_folder
from tests.checkpoint.workers.checkpoint_worker import SMALL_DISK, load_tool
from tests.conftest import require_root
from tests.models.torchrun import REPO, TORCHRUN, run_torchrun

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "checkpoint_worker.py"
ARCHS = list(ARCH_CONFIGS)
to_megatron = load_tool("convert_hf_to_megatron")


@pytest.fixture(scope="module")
def run(module_tmp):
    inputs, out = module_tmp("hf"), module_tmp("out")
    for arch in ARCHS:
        make_hf_folder(inputs / arch, arch)
    small_disk = out / SMALL_DISK  # a real full disk for the worker's last save: a 128 MiB tmpfs, which needs root;
    mounted = os.geteuid() == 0  # without it no folder, and the worker leaves that save out
    if mounted:
        small_disk.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128m", "tmpfs", str(small_disk)], check=True)
    try:
        run_torchrun(WORKER, 2, str(inputs), str(out), *ARCHS, timeout=300)
    finally:
        if mounted:
            subprocess.run(["umount", str(small_disk)], check=True)
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return {"inputs": inputs, "out": out, "reports": reports}


# ------------------------------------------------------------------------------------------------
# HF -> Megatron -> logits, any layout
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers_at_every_layout_and_after_resharding(run, arch):
    diffs = run["reports"][0][arch]["logit_diffs"]
    assert set(diffs) == {"tp1->tp1", "tp2->tp2", "pp2->pp2", "tp2->tp1", "tp2->pp2"}
    assert all(d <= 1e-4 for d in diffs.values()), diffs
    assert run["reports"][1][arch]["logit_diffs"] == diffs  # every rank gets the number


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", ["tp1", "pp2"])
def test_tp2_checkpoint_loaded_elsewhere_gives_identical_logprobs(run, arch, layout):
    report = run["reports"][0][arch]
    assert report[f"logprobs_tp2->{layout}_equal"], report[f"logprobs_tp2->{layout}_max_diff"]


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_folder_is_self_describing(run, arch):
    for layout, (tp, pp) in LAYOUTS.items():
        folder = run["out"] / arch / layout
        metadata = read_checkpoint_metadata(folder)
        assert (metadata.tensor_parallel, metadata.pipeline_parallel) == (tp, pp)
        assert metadata.vocab_size == ARCH_CONFIGS[arch]["vocab_size"]
        assert metadata.padded_vocab_size % (128 * tp) == 0 and metadata.padded_vocab_size >= metadata.vocab_size
        assert metadata.hf_architecture == ARCH_CONFIGS[arch]["architectures"][0] and not metadata.has_optimizer
        assert json.loads((folder / "hf_config.json").read_text())["vocab_size"] == metadata.vocab_size
        assert (folder / "tokenizer" / "tokenizer.json").is_file()
        assert not (run["out"] / arch / f"{layout}.partial").exists()
    assert read_checkpoint_metadata(run["out"] / "qwen3_untied" / "tp2").padded_vocab_size == 1280  # 1152 at TP=1


# ------------------------------------------------------------------------------------------------
# Megatron -> HF
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("saved", ["tp2", "pp2"])
def test_round_trip_reproduces_every_tensor_exactly(run, arch, saved):
    original = HFWeights(run["inputs"] / arch)
    exported = HFWeights(run["out"] / arch / f"hf_from_{saved}")
    assert set(exported) == set(original)  # tied: no lm_head on either side
    for name in original:
        assert exported[name].dtype == original[name].dtype
        assert torch.equal(exported[name], original[name]), name
    assert (run["out"] / arch / f"hf_from_{saved}" / WEIGHTS_INDEX_FILE).is_file()  # sharded, with an index
    assert len(set(json.loads((run["out"] / arch / f"hf_from_{saved}" / WEIGHTS_INDEX_FILE).read_text())
                   ["weight_map"].values())) > 1


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_untied"])
def test_transformers_loads_the_export_and_its_tokenizer(run, arch):
    import transformers

    folder = run["out"] / arch / "hf_from_tp2"
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    reference = transformers.AutoModelForCausalLM.from_pretrained(run["inputs"] / arch)
    tokens = torch.tensor([[1, 5, 999, 42]])
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, reference(tokens).logits)
    assert model.config.tie_word_embeddings == ARCH_CONFIGS[arch]["tie_word_embeddings"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == 151669 and tokenizer.decode(tokenizer("2 + 2 = 4")["input_ids"]) == "2 + 2 = 4"


# ------------------------------------------------------------------------------------------------
# Training-style checkpoints: optimizer state, crash mid-save, latest, pruning, run export
# ------------------------------------------------------------------------------------------------
def test_interrupted_save_leaves_latest_on_the_previous_complete_step(run):
    for report in run["reports"]:
        assert report["crash_raised"]
        assert report["after_crash"] == {"latest": "step_00000001", "alpha_written_in_tmp": True,
                                         "entries": ["latest", "step_00000001", "step_00000002.tmp"]}


def test_resume_restores_weights_and_optimizer_state(run):
    for report in run["reports"]:
        assert report["resume"]["step_dir"] == "step_00000001"
        assert report["resume"]["trainer_state"] == {"step": 1, "note": "after one update"}
    assert run["reports"][0]["resume"]["restored"] == {"alpha": True, "beta": True}
    assert run["reports"][1]["resume"]["restored"] == {"alpha": True, "beta": True, "gamma": True}


def test_next_save_cleans_up_and_prunes(run):
    assert run["reports"][0]["after_save_2"] == {"latest": "step_00000002", "entries": ["latest", "step_00000002"]}
    metadata = read_checkpoint_metadata(run["out"] / "run" / "step_00000002" / "alpha")
    assert metadata.has_optimizer and metadata.step == 2 and metadata.tensor_parallel == 2
    assert not read_checkpoint_metadata(run["out"] / "run" / "step_00000002" / "gamma").has_optimizer


def test_a_save_onto_a_full_disk_fails_on_every_rank_with_one_message_and_latest_kept(run):
    require_root("mounts a 128 MiB tmpfs to fill a real disk under a save")
    messages = {report["full_disk"]["outcome"] for report in run["reports"]}
    assert len(messages) == 1  # both ranks raised CheckpointSaveError, with the same words
    (message,) = messages
    assert message.startswith("saving ") and "step_00000002.tmp" in message and "No space left on device" in message
    assert "step_00000002.tmp was removed" in message and "GiB free on" in message
    assert message.endswith("`latest` still names step_00000001 (free space, then --resume continues from it)")
    for report in run["reports"]:
        assert report["full_disk"]["latest"] == "step_00000001"
        assert report["full_disk"]["entries"] == ["latest", "step_00000001"]  # no partial folder
        assert report["full_disk"]["after_freeing"] == "step_00000002"


def test_run_folder_exports_every_agent_of_latest(run):
    import transformers

    assert sorted(os.listdir(run["out"] / "run_hf")) == ["alpha", "beta", "gamma"]
    for agent in ("alpha", "beta", "gamma"):
        transformers.AutoModelForCausalLM.from_pretrained(run["out"] / "run_hf" / agent)
    transformers.AutoTokenizer.from_pretrained(run["out"] / "run_hf" / "alpha")


def test_compare_cli_exits_nonzero_above_the_tolerance(run):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    command = [str(TORCHRUN), "--standalone", "--nproc_per_node", "2", str(REPO / "tools" / "compare_hf_megatron.py"),
               "--hf-path", str(run["inputs"] / "qwen2"), "--megatron-path", str(run["out"] / "qwen2" / "tp1"),
               "--tp", "2", "--tolerance", "1e-12"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "max |logit difference| = " in result.stdout and "EXCEEDED" in result.stdout


# ------------------------------------------------------------------------------------------------
# Bad input: clear errors before any work
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_folder(module_tmp):
    return make_hf_folder(module_tmp("bad") / "qwen2", "qwen2")


def copy_folder(source: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(source, target)
    return target


def convert(hf_path, save, **kwargs):
    return to_megatron.convert_hf_to_megatron(str(hf_path), str(save), **kwargs)


def test_unknown_architecture(hf_folder, tmp_path):
    folder = copy_folder(hf_folder, tmp_path / "gpt2")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, architectures=["GPT2LMHeadModel"], model_type="gpt2")))
    supported = "Qwen3ForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM"
    with pytest.raises(ValueError, match=f"unsupported architecture.*{supported}"):
        convert(folder, tmp_path / "out")


def test_missing_weight_file(hf_folder, tmp_path):
    folder = copy_folder(hf_folder, tmp_path / "missing")
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(HFFolderError, match=f"{shard.name} .*is missing"):
        convert(folder, tmp_path / "out")


def test_truncated_weight_file(hf_folder, tmp_path):
    folder = copy_folder(hf_folder, tmp_path / "truncated")
    path = sorted(folder.glob("model-*.safetensors"))[-1]
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(HFFolderError, match=f"{path.name}: truncated"):
        convert(folder, tmp_path / "out")


def test_tensor_missing_from_the_weights(hf_folder, tmp_path):
    folder = copy_folder(hf_folder, tmp_path / "incomplete")
    index = json.loads((folder / WEIGHTS_INDEX_FILE).read_text())
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (folder / WEIGHTS_INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(HFFolderError, match="lack 1 tensor.*model.layers.1.mlp.up_proj.weight"):
        convert(folder, tmp_path / "out")


def test_tp_that_does_not_divide_the_heads(hf_folder, tmp_path):
    with pytest.raises(ValueError, match="TP=3 must divide the attention heads"):
        convert(hf_folder, tmp_path / "out", tensor_parallel=3)


def test_target_not_empty(hf_folder, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "something").write_text("x")
    with pytest.raises(FileExistsError, match="not an empty folder"):
        convert(hf_folder, tmp_path / "out")


def test_cli_reports_bad_input_without_a_traceback(hf_folder, tmp_path, capsys):
    """The command's main() in this process (a process of it costs seconds of imports): it ends with
    sys.exit(message), which a process prints to stderr, exiting with code 1. The command run as a process, one
    line on stderr and nothing else: test_single_process_tools.py's bad-input tests."""
    with pytest.raises(SystemExit) as stop:  # any other exception: a traceback
        to_megatron.main(["--hf-path", str(hf_folder), "--save", str(tmp_path / "out"), "--tp", "3"])
    message = stop.value.code
    assert isinstance(message, str) and message and "Traceback" not in message + capsys.readouterr().err
    assert "error: TP=3 must divide" in message


def test_broken_checkpoint_folders_name_folder_and_file(run, tmp_path):
    source = run["out"] / "qwen2" / "tp1"
    missing = copy_folder(source, tmp_path / "missing")
    (missing / "hf_config.json").unlink()
    with pytest.raises(CheckpointError, match=f"{missing}: .*hf_config.json is missing"):
        read_checkpoint_metadata(missing)
    wrong = copy_folder(source, tmp_path / "wrong")
    metadata = json.loads((wrong / "metadata.json").read_text())
    (wrong / "metadata.json").write_text(json.dumps(dict(metadata, format_version=99)))
    with pytest.raises(CheckpointError, match="metadata.json: format_version 99"):
        read_checkpoint_metadata(wrong)
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        read_checkpoint_metadata(tmp_path / "nowhere")
