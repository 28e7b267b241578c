"""1,000 hostile responses to the ground truth "42", each tagged with whether it may legitimately score 1."""

import random
import unicodedata
from dataclasses import dataclass

from hacpo_megatron.rewards.answers import MAX_ANSWER_NESTING, MAX_RESPONSE_CHARS

TRUTH = "42"


@dataclass
class Case:
    kind: str
    response: object
    may_score: bool = False  # True only for responses whose final answer really is 42


def adversarial_cases(seed: int = 0) -> list:
    rng = random.Random(seed)
    cases = []
    cases += [_huge(rng) for _ in range(100)]
    cases += [_deeply_nested(rng) for _ in range(100)]
    cases += [_shallow_nested(rng) for _ in range(40)]
    cases += [_malformed(rng) for _ in range(150)]
    cases += [Case("slow", s) for s in SLOW_ANSWERS]
    cases += [_nul_bytes(rng) for _ in range(100)]
    cases += [_random_unicode(rng) for _ in range(300)]
    cases += [_not_text(rng) for _ in range(30)]
    cases += [_normal(rng) for _ in range(1000 - len(cases))]
    rng.shuffle(cases)
    return cases


# Each costs math-verify seconds (measured: over 5 s); only the time limits stop them.
SLOW_ANSWERS = [
    "\\boxed{9^{9^{9^9}}}",
    "\\boxed{10^{10^{10}}}",
    "\\boxed{9^{9^9}}",
    "\\boxed{99999999999!}",
    "\\boxed{(10^{1000000})!}",
    "the answer is 7^{7^{7^7}}",
    "\\boxed{2^{3^{4^{5}}}}",
    "\\boxed{12345678987654321^{98765432123456789}}",
    "\\boxed{1000000000!}",
    "\\boxed{(9^{9})!}",
    "\\boxed{8^{8^{8^8}} - 8^{8^{8^8}} + 42}",
    "\\boxed{10^{10^{10}} + 1}",
]


def _huge(rng):
    n = rng.randint(MAX_RESPONSE_CHARS + 1, 10 * MAX_RESPONSE_CHARS)
    return Case("huge", rng.choice("x{\\1 ") * n + "\\boxed{42}")


def _deeply_nested(rng):
    # half short enough to be refused for nesting, half for length; all under MAX_RESPONSE_CHARS
    depth = rng.randint(MAX_ANSWER_NESTING + 1, rng.choice([40, 1500]))
    opener, closer = rng.choice([("\\frac{1}{", "}"), ("{", "}"), ("(", ")"), ("\\sqrt{", "}"), ("[", "]")])
    return Case("deep", "\\boxed{" + opener * depth + "42" + closer * depth + "}")


def _shallow_nested(rng):
    depth = rng.randint(1, 4)
    # 1/(1/(...42)) is 42 at even depth: a legitimately correct, oddly written answer
    return Case("shallow", "\\boxed{" + "\\frac{1}{" * depth + "42" + "}" * depth + "}", may_score=depth % 2 == 0)


MALFORMED_PIECES = ["\\boxed{", "\\frac{", "}}", "{{", "\\left(", "\\right]", "\\sqrt[", "$$", "$", "^", "_", "\\",
                    "\\begin{matrix}", "&", "\\\\", "\\end{array}", "\\int", "\\sum_{", "=", "1", "4", "2", "x", " ",
                    "\\text{", "\\mathrm{", "%", "#", "\\boxed{}", "\\boxed{\\boxed{"]


def _malformed(rng):
    text = "".join(rng.choice(MALFORMED_PIECES) for _ in range(rng.randint(1, 40)))
    # Random pieces may spell a well-formed final 42 ("\boxed{42}", "...= 42"): don't let them; the
    # suffix makes the final answer malformed whatever came before.
    return Case("malformed", text + rng.choice(["\\boxed{4", "\\boxed{\\frac{4}{", "\\boxed{}", "}{\\boxed{"]))


def _nul_bytes(rng):
    if rng.random() < 0.5:
        return Case("nul", "\x00" * rng.randint(1, 50) + "so \\boxed{42}" + "\x00" * rng.randint(0, 5),
                    may_score=True)
    return Case("nul", "".join(rng.choice(["\x00", "4", "\\boxed{", "}", "\x00\x00"]) for _ in range(30))
                + "\\boxed{\x00}")


def _random_unicode(rng):
    chars = []
    while len(chars) < rng.randint(1, 400):
        char = chr(rng.randint(1, 0x10FFFF))
        # no digits of any script, so no final answer can spell 42
        if not unicodedata.category(char).startswith("N"):
            chars.append(char)
    return Case("unicode", "".join(chars))


def _not_text(rng):
    return Case("not_text", rng.choice([None, 42, 4.2, b"\\boxed{42}", ["\\boxed{42}"], {"answer": 42}]))


def _normal(rng):
    correct = rng.random() < 0.5
    value = 42 if correct else rng.choice([41, 43, 24, -42, 420])
    template = rng.choice(["Adding up, \\boxed{{{v}}}.", "So the answer is {v}.", "{v}",
                           "\\boxed{{\\frac{{{d}}}{{{q}}}}}"])
    if "frac" in template:
        q = rng.randint(1, 9)
        return Case("normal", template.format(d=value * q, q=q), may_score=correct)
    return Case("normal", template.format(v=value), may_score=correct)
