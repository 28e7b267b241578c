"""The engine factory: kinds, clear errors for missing packages, the embedded engine from a model folder."""
import importlib.util

import pytest
import torch

from hacpo_megatron.rollout import ENGINE_KINDS, make_engine
from hacpo_megatron.rollout.base import SamplingParams
from hacpo_megatron.rollout.embedded import EmbeddedEngine, hf_model_from_config
from tests.rollout.test_embedded import TINY


def test_unknown_kind_lists_the_known_ones():
    with pytest.raises(ValueError, match="embedded, vllm, sglang"):
        make_engine("tgi", model_path="/nonexistent", eos_token_ids=[0])
    assert ENGINE_KINDS == ("embedded", "vllm", "sglang")


@pytest.mark.parametrize("kind, extra", [("vllm", r"\.\[vllm\]"), ("vllm", r"make setup-vllm"),
                                         ("sglang", r"\.\[sglang\]")])
def test_a_missing_engine_package_names_what_to_install(kind, extra, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == kind else real_find_spec(name, *a))
    with pytest.raises(ImportError, match=extra):
        make_engine(kind, model_path="/nonexistent", eos_token_ids=[0])


def test_embedded_engine_from_a_folder_with_weights_serves_them(tmp_path, tokenizer):
    model = hf_model_from_config(TINY, seed=3)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = make_engine("embedded", model_path=str(tmp_path), eos_token_ids=[tokenizer.eos_token_id],
                         pad_token_id=tokenizer.eos_token_id)
    assert isinstance(engine, EmbeddedEngine)
    assert engine.check_weights(model.state_dict().items()).equal
    out = engine.generate([[464, 3139]], SamplingParams(n=2, max_new_tokens=3, seed=0))
    assert [len(g) for g in out] == [2]


def test_embedded_engine_from_a_config_only_folder_starts_random(tmp_path, tokenizer):
    hf_model_from_config(TINY, seed=3).config.save_pretrained(tmp_path)
    engine = make_engine("embedded", model_path=str(tmp_path), eos_token_ids=[tokenizer.eos_token_id],
                         pad_token_id=tokenizer.eos_token_id, tokenizer=tokenizer, seed=5)
    expected = hf_model_from_config(TINY, seed=5).state_dict()
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in expected.items())
