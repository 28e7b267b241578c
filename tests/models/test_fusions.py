"""The fused elementwise kernels a GPU run switches on (models/architectures.py: transformer_config), against the
torch ops a CPU run uses in their place. On a CPU torch.compile builds the same fused function with inductor's CPU
backend; the GPU run (tools/gpu_check.sh tests) compares the Triton kernels."""
import pytest
import torch
import torch.nn.functional as F

from hacpo_megatron import megatron_cpu
from hacpo_megatron.models.architectures import read_architecture, transformer_config
from hacpo_megatron.models.presets import PRESETS

megatron_cpu.apply()


def test_megatrons_compiled_swiglu_is_silu_gate_times_up_with_its_gradient():
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    torch.manual_seed(0)
    x = torch.randn(6, 3, 32, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(6, 3, 16, dtype=torch.float64)
    fused = bias_swiglu_impl(x, None)
    (fused * weights).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    gate, up = x_ref.chunk(2, -1)
    reference = F.silu(gate) * up
    (reference * weights).sum().backward()
    assert torch.allclose(fused, reference, atol=1e-12) and torch.allclose(x.grad, x_ref.grad, atol=1e-12)


@pytest.mark.parametrize("preset,fused_activation", [("tiny-qwen3", True), ("tiny-gemma3", False)])
def test_a_gpu_config_switches_on_megatrons_compiled_fusions_and_a_cpu_config_does_not(monkeypatch, preset,
                                                                                       fused_activation):
    """SwiGLU families fuse the activation on a GPU; Gemma 3's GeGLU (gelu_tanh, which megatron's fused kernels do
    not know) keeps the torch ops; bias-dropout-add fuses for both. A CPU config fuses nothing."""
    arch = read_architecture(PRESETS[preset])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU machine, even where a GPU is present
    cpu = transformer_config(arch)
    assert not cpu.bias_activation_fusion and not cpu.bias_dropout_fusion
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = transformer_config(arch, params_dtype=torch.float32)
    assert gpu.bias_activation_fusion is fused_activation and gpu.bias_dropout_fusion
    assert not gpu.masked_softmax_fusion  # a TE/apex CUDA kernel: not here
