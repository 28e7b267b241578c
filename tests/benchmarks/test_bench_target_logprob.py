"""benchmarks/bench_target_logprob.py without a model: its two modes compute the same log-probs and gradients,
so the benchmark times two ways of doing the same work."""
import torch

from tests.benchmarks.scripts import load_benchmark

bench = load_benchmark("bench_target_logprob")


def test_composed_and_fused_give_the_same_logprobs_and_gradients():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 50, generator=g) * 3
    targets = torch.randint(0, 50, (9,), generator=g)
    weights = torch.randn(9, generator=g)
    results = {}
    for mode, function in bench.MODES.items():
        x = logits.clone().requires_grad_()
        out = function(x, targets, 0.7)
        (out * weights).sum().backward()
        results[mode] = (out.detach(), x.grad)
    for a, b in zip(results["composed"], results["fused"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
