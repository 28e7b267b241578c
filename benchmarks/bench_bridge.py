"""Throughput of the tokenizer bridge, and how many tokens Qwen3 and Llama 3.2 spend on the same math answer.

    .venv/bin/python benchmarks/bench_bridge.py [--answers 400] [--repeats 3] [--seed 0] [--text-file F]

The answers are synthetic MATH-style solutions (prose, LaTeX, numbers, a final \\boxed{}), about 100 to 900
tokens each; the paper reports that Qwen and Llama tokenizers differ by ~4% on MATH solutions (~700 tokens).
The length ratio depends on how many digits a text has (Qwen3 spends one token per digit, Llama 3.2 one per
group of up to three), so it is also measured on the blank-line-separated paragraphs of --text-file if given
(e.g. real solutions of the MATH training set).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from hacpo_megatron.bridge import bridge_responses, load_tokenizer

OPENINGS = [
    "Let's solve this step by step.",
    "We start by simplifying the expression.",
    "First, note that the problem asks for the sum of all solutions.",
    "To find the answer, we set up an equation.",
]
STEPS = [
    "Expanding, we get $({a}x + {b})^2 = {a2}x^2 + {ab2}x + {b2}$.",
    "Since $\\frac{{{a}}}{{{b}}} + \\frac{{{c}}}{{{d}}} = \\frac{{{ad_bc}}}{{{bd}}}$, the fractions combine.",
    "The discriminant is $\\Delta = b^2 - 4ac = {b2} - {fourac} = {disc}$.",
    "Multiplying both sides by ${c}$ gives ${a}y = {ac}$, so $y = {ac_over_a}$.",
    "By the Pythagorean theorem, $\\sqrt{{{a}^2 + {b}^2}} = \\sqrt{{{a2_b2}}}$.",
    "There are $\\binom{{{big}}}{{2}} = {pairs}$ ways to choose two of the {big} points.",
    "Therefore the area of the triangle is $\\frac{{1}}{{2}} \\cdot {a} \\cdot {b} = {half_ab}$ square units.",
    "Substituting $x = {c}$ into $f(x) = x^2 - {a}x + {b}$, we find $f({c}) = {fx}$.",
    "Note that ${big} = {a} \\cdot {q} + {r}$, so the remainder is ${r}$.",
    "Hence the probability is $\\frac{{{c}}}{{{d}}}$, which cannot be simplified further.",
]
# Real solutions explain as much as they compute: prose steps keep the digit share near MATH's.
REASONING = [
    "This is a quadratic in $x$, so we can try to factor it before using the quadratic formula.",
    "We can check our work by substituting this value back into the original equation.",
    "Recall that the interior angles of a polygon with $n$ sides sum to $180(n-2)$ degrees.",
    "Because the function is increasing on this interval, its minimum occurs at the left endpoint.",
    "Notice that each term cancels with the next one, so the sum telescopes.",
    "Let $a$ and $b$ be the roots; by Vieta's formulas, $a + b = -p$ and $ab = q$.",
    "We want the number of integers that are divisible by neither of the two primes.",
    "Drawing a diagram helps: the altitude from the vertex splits the base into two equal parts.",
]
CLOSINGS = ["The answer is $\\boxed{{{answer}}}$.", "Thus, the final answer is $\\boxed{{{answer}}}$.",
            "So we conclude that $x = \\boxed{{{answer}}}$."]


def synthetic_math_answer(rng: random.Random) -> str:
    """One worked solution: an opening, 3 to 40 steps (calculation or reasoning), a boxed answer."""
    lines = [rng.choice(OPENINGS)]
    for _ in range(rng.randint(3, 45)):
        a, b, c, d = (rng.randint(1, 99) for _ in range(4))
        big = rng.randint(100, 9999)
        values = dict(
            a=a, b=b, c=c, d=d, big=big, a2=a * a, ab2=2 * a * b, b2=b * b, ad_bc=a * d + b * c, bd=b * d,
            fourac=4 * a * c, disc=b * b - 4 * a * c, ac=a * c, ac_over_a=c, a2_b2=a * a + b * b,
            pairs=big * (big - 1) // 2, half_ab=a * b / 2, fx=c * c - a * c + b, q=big // a, r=big % a,
        )
        lines.append(rng.choice(STEPS).format(**values) if rng.random() < 0.5 else rng.choice(REASONING))
    lines.append(rng.choice(CLOSINGS).format(answer=rng.randint(-500, 5000)))
    return "\n\n".join(lines) if rng.random() < 0.5 else " ".join(lines)


def bridge_throughput(source_name: str, learner_name: str, answers: list[str], repeats: int) -> dict:
    source, learner = load_tokenizer(source_name), load_tokenizer(learner_name)
    prompts = [[{"role": "user", "content": f"Problem {i // 8}: find x."}] for i in range(len(answers))]  # G = 8
    # What the source's engine returns: content tokens, EOS, as an agent that finished its answer.
    responses = [ids + [source.eos_token_id] for ids in source(answers, add_special_tokens=False)["input_ids"]]
    kwargs = dict(prompts_messages=prompts, source_logprob_sums=[-1.0] * len(answers),
                  finish_reasons=["stop"] * len(answers))
    bridge_responses(source, learner, responses[:8], **{k: v[:8] for k, v in kwargs.items()})  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        bridged = bridge_responses(source, learner, responses, **kwargs)
        seconds.append(time.perf_counter() - start)
    best = min(seconds)
    source_tokens = sum(b.source_length for b in bridged)
    learner_tokens = sum(b.learner_length for b in bridged)
    return dict(pair=f"{source_name} -> {learner_name}", responses=len(answers), source_tokens=source_tokens,
                learner_tokens=learner_tokens, best_s=best, median_s=statistics.median(seconds),
                source_tokens_per_s=source_tokens / best, responses_per_s=len(answers) / best)


def length_ratio(answers: list[str]) -> dict:
    """Qwen3 tokens over Llama 3.2 tokens, over the whole sample and per answer; and the sample's digit share."""
    qwen, llama = load_tokenizer("qwen3"), load_tokenizer("llama3.2")
    qwen_lengths = [len(ids) for ids in qwen(answers, add_special_tokens=False)["input_ids"]]
    llama_lengths = [len(ids) for ids in llama(answers, add_special_tokens=False)["input_ids"]]
    per_answer = [qwen_n / llama_n for qwen_n, llama_n in zip(qwen_lengths, llama_lengths)]
    return dict(qwen_mean_tokens=statistics.mean(qwen_lengths), llama_mean_tokens=statistics.mean(llama_lengths),
                total_ratio=sum(qwen_lengths) / sum(llama_lengths), per_answer_median=statistics.median(per_answer),
                per_answer_min=min(per_answer), per_answer_max=max(per_answer),
                digit_share=sum(ch.isdigit() for a in answers for ch in a) / sum(len(a) for a in answers))


def print_length_ratio(label: str, answers: list[str]) -> None:
    ratio = length_ratio(answers)
    print(f"token lengths on {len(answers)} {label}: Qwen3 {ratio['qwen_mean_tokens']:.0f}, "
          f"Llama 3.2 {ratio['llama_mean_tokens']:.0f} tokens on average; Qwen3/Llama = {ratio['total_ratio']:.3f} "
          f"overall (per text: median {ratio['per_answer_median']:.3f}, "
          f"range {ratio['per_answer_min']:.3f}-{ratio['per_answer_max']:.3f}); "
          f"{ratio['digit_share']:.1%} of characters are digits")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--text-file", help="also measure the length ratio on this file's paragraphs")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    answers = [synthetic_math_answer(rng) for _ in range(args.answers)]
    for source_name, learner_name in [("qwen3", "llama3.2"), ("llama3.2", "qwen3"), ("qwen3", "qwen3")]:
        r = bridge_throughput(source_name, learner_name, answers, args.repeats)
        print(f"{r['pair']:>20}: {r['responses']} responses, {r['source_tokens']} -> {r['learner_tokens']} tokens, "
              f"best {r['best_s'] * 1e3:.1f} ms (median {r['median_s'] * 1e3:.1f} ms): "
              f"{r['source_tokens_per_s'] / 1e6:.2f} M source tokens/s, {r['responses_per_s']:.0f} responses/s")
    print_length_ratio("synthetic math-style answers", answers)
    if args.text_file:
        with open(args.text_file, encoding="utf-8") as file:
            paragraphs = [p.strip() for p in file.read().split("\n\n") if len(p.strip()) >= 200]
        print_length_ratio(f"paragraphs of {args.text_file}", paragraphs)


if __name__ == "__main__":
    main()
