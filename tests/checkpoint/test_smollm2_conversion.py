"""HF <-> Megatron conversion on a real pretrained model: SmolLM2-135M-Instruct (issue 11).

The model (Llama, 30 layers, 9 / 3 KV heads, tied embeddings, vocabulary 49,152) is the conversion of its GGUF
file that test_gguf.py checks (tests/checkpoint/conftest.py: converted once for both files). The commands run as
a user runs them: the conversions as plain `python` (the tools start their TP x PP processes themselves), the
comparisons under torchrun. Two conversions cover both layouts, TP=3 (which divides 9 and 3 heads, not a power of
two) and PP=2 (15 layers a stage); each is compared with transformers and exported back once (the export at TP=1,
PP=1).
The module-scoped fixtures print each command's wall time (`pytest -s`); docs/conversion.md has the figures.
"""
import time

import pytest
import torch

from hacpo_megatron.checkpoint.hf_io import HFWeights
from hacpo_megatron.checkpoint.format import read_checkpoint_metadata
from tests.checkpoint.test_single_process_tools import logit_difference, run_tool, tool
from tests.models.torchrun import run_torchrun

# under xdist, with test_gguf.py on one worker: both use the package's converted SmolLM2 (tests/checkpoint/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.real_weights,
              pytest.mark.xdist_group("smollm2_hf")]
LAYOUTS = {"tp3": ("--tp", 3), "pp2": ("--pp", 2)}  # folder name: flags of every tool for it
TP_PP = {"tp3": (3, 1), "pp2": (1, 2)}
TIMEOUT = 600  # s; one tool call takes 20-100 s on the 2-core machine, depending on what else runs
PROMPTS = ["What is 17 + 25?", "Name the capital of France in one word.", "Write a haiku about the sea."]


def timed_tool(name: str, *args) -> tuple:
    """`python tools/<name>.py args` (no torchrun, no process left behind); (exit code, stdout, stderr)."""
    start = time.monotonic()
    code, stdout, stderr, _ = run_tool(tool(name), *args, timeout=TIMEOUT)
    print(f"\n{name} {' '.join(map(str, args))}: {time.monotonic() - start:.1f} s")
    assert code == 0, stderr[-5000:]
    return code, stdout, stderr


@pytest.fixture(scope="module")
def hf_folder(smollm2_hf):
    return smollm2_hf  # converted from its GGUF file once for test_gguf.py and this file (conftest.py)


@pytest.fixture(scope="module")
def megatron(hf_folder, module_tmp):
    """HF -> Megatron at TP=3 and at PP=2, each one plain `python` command: {layout: (folder, stdout)}."""
    root = module_tmp("smollm2_megatron")
    return {layout: (root / layout, timed_tool("convert_hf_to_megatron", "--hf-path", hf_folder,
                                               "--save", root / layout, *flags)[1])
            for layout, flags in LAYOUTS.items()}


@pytest.fixture(scope="module")
def exported(megatron, module_tmp):
    """Megatron -> HF for each of the two checkpoints, as plain as a user writes it: {layout: folder}."""
    root = module_tmp("smollm2_hf")
    folders = {}
    for layout, (checkpoint, _) in megatron.items():
        _, stdout, _ = timed_tool("convert_megatron_to_hf", "--load", checkpoint, "--save", root / layout)
        assert stdout.strip() == f"exported {layout} to {root / layout}"
        folders[layout] = root / layout
    return folders


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hf_to_megatron_at_tp3_and_pp2_from_plain_python(megatron, layout):
    folder, stdout = megatron[layout]
    tp, pp = TP_PP[layout]
    assert stdout.strip() == f"saved Megatron checkpoint (TP={tp}, PP={pp}) to {folder}"
    metadata = read_checkpoint_metadata(folder)
    assert (metadata.tensor_parallel, metadata.pipeline_parallel) == (tp, pp)
    assert metadata.vocab_size == metadata.padded_vocab_size == 49152  # 49152 = 128 * 3 * 128: no padding
    assert metadata.hf_architecture == "LlamaForCausalLM" and metadata.params_dtype == "float32"
    assert (folder / "tokenizer" / "tokenizer.json").is_file() and (folder / "generation_config.json").is_file()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compare_under_torchrun_within_1e_4_of_transformers(hf_folder, megatron, layout):
    folder, _ = megatron[layout]
    flags, (tp, pp) = LAYOUTS[layout], TP_PP[layout]
    start = time.monotonic()
    result = run_torchrun(tool("compare_hf_megatron"), tp * pp, "--hf-path", str(hf_folder),
                          "--megatron-path", str(folder), *map(str, flags), timeout=TIMEOUT)  # exit 0 or raises
    difference = logit_difference(result.stdout)
    print(f"\ncompare_hf_megatron {' '.join(map(str, flags))} under torchrun: {time.monotonic() - start:.1f} s, "
          f"max |logit difference| = {difference:.3e}")
    assert difference <= 1e-4
    assert result.stdout.strip().endswith(f"(TP={tp}, PP={pp}, float32); tolerance 1.0e-04: OK")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_reproduces_every_tensor_bit_for_bit(hf_folder, exported, layout):
    original, result = HFWeights(hf_folder), HFWeights(exported[layout])
    assert "lm_head.weight" not in original and len(original) == 272  # tied: the source has no lm_head either
    assert set(result) == set(original)
    for name in original:
        assert result[name].dtype == original[name].dtype and torch.equal(result[name], original[name]), name
    assert sorted(p.name for p in exported[layout].glob("*.safetensors")) == ["model.safetensors"]  # as the source


def test_export_of_the_pp2_checkpoint_gives_transformers_logits_within_1e_5(hf_folder, exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(exported["pp2"]))
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           tokenize=False) for prompt in PROMPTS]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert batch["input_ids"].shape[0] == len(PROMPTS) and batch["attention_mask"].sum() > 3 * 20
    original = AutoModelForCausalLM.from_pretrained(str(hf_folder), dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(str(exported["pp2"]), dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied on load
    with torch.no_grad():
        expected, got = original(**batch).logits, model(**batch).logits
    difference = (expected - got).abs().max().item()
    print(f"\nexport of pp2 vs the source in transformers: max |logit difference| = {difference:.3e}")
    assert got.shape == (len(PROMPTS), batch["input_ids"].shape[1], 49152)
    assert difference <= 1e-5
