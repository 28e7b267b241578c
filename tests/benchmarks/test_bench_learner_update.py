"""benchmarks/bench_learner_update.py without a model: each comparison's two modes do the same work, so the
benchmark times two ways of doing it, and a mode's switch is undone when its block ends."""
import torch

from hacpo_megatron.models import logprobs
from tests.benchmarks.scripts import load_benchmark

bench = load_benchmark("bench_learner_update")


def test_composed_and_fused_give_the_same_logprobs_and_gradients():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 50, generator=g) * 3
    targets = torch.randint(0, 50, (9,), generator=g)
    weights = torch.randn(9, generator=g)
    results = {}
    for mode, switch in bench.COMPARISONS["logprob"].items():
        x = logits.clone().requires_grad_()
        with switch():
            out = logprobs.TargetLogProb.apply(x, targets, 0.7)
        (out * weights).sum().backward()
        results[mode] = (out.detach(), x.grad)
    for a, b in zip(results["composed"], results["fused"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_switches_install_the_old_implementation_and_restore_the_new():
    fused = logprobs.TargetLogProb.apply
    with bench.COMPARISONS["logprob"]["composed"]():
        assert logprobs.TargetLogProb.apply is bench.composed_target_logprob
    assert logprobs.TargetLogProb.apply == fused
