"""megatron_cpu, HF config -> megatron config, vocabulary padding: no torchrun needed."""
import subprocess
import sys
import textwrap

import pytest
import torch

from hacpo_megatron.models.architectures import read_architecture, transformer_config
from hacpo_megatron.models.build import padded_vocab_size
from hacpo_megatron.models.presets import PRESETS


def test_apply_is_idempotent_and_megatron_imports_and_configures_after_it():
    script = textwrap.dedent("""
        import torch
        from hacpo_megatron import megatron_cpu
        megatron_cpu.apply()
        first = megatron_cpu.applied_patches()
        megatron_cpu.apply()
        assert megatron_cpu.applied_patches() == first, "second apply() changed something"
        if torch.cuda.is_available():
            assert first == [] or all(p.startswith("triton-stub") for p in first)
        else:
            assert "torch.cuda.current_device->cpu" in first and "rng-tracker->cpu" in first
        from megatron.core.models.gpt import GPTModel  # noqa: F401 (pulls schedules -> paged_stash)
        from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: F401
        from megatron.core import tensor_parallel
        tensor_parallel.model_parallel_cuda_manual_seed(3, tp_rank=1, ep_rank=0, etp_rank=1, force_reset_rng=True)
        tracker = tensor_parallel.get_cuda_rng_tracker()
        # the tracker forks the CUDA generator on a GPU, the CPU one (megatron_cpu) on CPU
        device, rng_state = (("cuda", torch.cuda.get_rng_state) if torch.cuda.is_available()
                             else ("cpu", torch.get_rng_state))
        before = rng_state()
        with tracker.fork():
            a = torch.rand(3, device=device)
        with tracker.fork():
            b = torch.rand(3, device=device)
        assert torch.equal(rng_state(), before), "fork() must restore the outer state"
        assert not torch.equal(a, b), "the forked stream must advance"
        print("OK")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-4000:]


@pytest.mark.parametrize("name,family,tied,qkv_bias,qk_norm", [
    ("tiny-qwen3", "qwen3", True, False, True),
    ("tiny-qwen2", "qwen2", False, True, False),
    ("tiny-llama", "llama", True, False, False),
    ("qwen3-8b-base", "qwen3", False, False, True),
])
def test_read_architecture(name, family, tied, qkv_bias, qk_norm):
    arch = read_architecture(PRESETS[name])
    got = (arch.family, arch.tie_word_embeddings, arch.qkv_bias, arch.qk_layernorm)
    assert got == (family, tied, qkv_bias, qk_norm)
    assert arch.num_query_groups < arch.num_attention_heads  # GQA


def test_rope_settings_read_from_classic_and_transformers5_fields():
    classic = read_architecture(PRESETS["llama3.2-1b-instruct"])
    assert classic.rope_theta == 500000.0 and classic.rope_scaling.factor == 32.0
    v5 = dict(PRESETS["llama3.2-1b-instruct"])
    scaling = v5.pop("rope_scaling")
    v5["rope_parameters"] = dict(scaling, rope_theta=v5.pop("rope_theta"))
    assert read_architecture(v5) == classic
    qwen = dict(PRESETS["tiny-qwen3"])
    qwen["rope_parameters"] = {"rope_type": "default", "rope_theta": qwen.pop("rope_theta")}
    assert read_architecture(qwen).rope_theta == 1e6 and read_architecture(qwen).rope_scaling is None


def test_unsupported_architecture_lists_the_supported_ones():
    with pytest.raises(ValueError, match="Qwen3ForCausalLM.*Qwen2ForCausalLM.*LlamaForCausalLM"):
        read_architecture({"architectures": ["MistralForCausalLM"], "model_type": "mistral"})
    yarn = dict(PRESETS["tiny-qwen3"], rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="rope_type"):
        read_architecture(yarn)


def test_transformer_config_on_cpu():
    arch = read_architecture(PRESETS["tiny-qwen3"])
    config = transformer_config(arch, tensor_parallel=2, pipeline_parallel=2)
    assert config.pipeline_model_parallel_size == 2 and config.tensor_model_parallel_size == 2
    assert config.num_query_groups == 2 and config.kv_channels == 32 and config.qk_layernorm
    assert config.gated_linear_unit and not config.add_bias_linear and config.normalization == "RMSNorm"
    if not torch.cuda.is_available():
        assert config.params_dtype == torch.float32 and config.use_cpu_initialization
        assert not (config.bias_activation_fusion or config.masked_softmax_fusion or config.bias_dropout_fusion)


@pytest.mark.parametrize("vocab,tp,expected", [(1000, 1, 1024), (1000, 2, 1024), (1000, 4, 1024),
                                               (151936, 1, 151936), (151669, 2, 151808), (128256, 8, 129024)])
def test_padded_vocab_size(vocab, tp, expected):
    assert padded_vocab_size(vocab, tp) == expected

