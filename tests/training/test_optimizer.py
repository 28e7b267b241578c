"""The optimizer megatron builds, as the trainer sets it up (training/trainer.py)."""
import torch


def test_fused_torch_adam_takes_the_same_steps_as_torchs_default():
    """use_fused_torch_adam (on a GPU, where megatron-core falls back to torch's AdamW without TE or Apex): after the
    switch the optimizer runs torch's fused kernel (CPU has one too) and takes the steps the default one takes."""
    from hacpo_megatron.training.trainer import use_fused_torch_adam

    torch.manual_seed(0)
    start = torch.randn(64, 32)
    params = [torch.nn.Parameter(start.clone()) for _ in range(2)]
    default = torch.optim.AdamW([params[0]], lr=1e-2, weight_decay=0.01)
    fused = torch.optim.AdamW([params[1]], lr=1e-2, weight_decay=0.01)

    class Wrapped:  # megatron's optimizers hold torch's as .optimizer
        optimizer = fused

    assert use_fused_torch_adam(Wrapped()) == 1 and fused.param_groups[0]["fused"] is True
    for _step in range(3):
        grad = torch.randn(64, 32)
        for p, opt in zip(params, (default, fused)):
            p.grad = grad.clone()
            opt.step()
    assert torch.allclose(params[0], params[1], atol=1e-6) and not torch.equal(params[1], start)
    assert use_fused_torch_adam(Wrapped()) == 0  # it has state now: left as it is
