"""Built-in math tasks with exact integer answers, for runs with no downloaded data.

Addressed as ``synthetic:<task>``, with optional difficulty settings:
``synthetic:arithmetic?max_operand=50&num_operands=3``.

Tasks (all answers are integers, a few characters long; the questions of word_problem are sentences):
  arithmetic        "What is 7 + 5?" -> 12. Operands 0..max_operand (default 20), num_operands (default 2),
                    operators + and -. Short enough for tiny models (answers of 1-3 tokens).
  arithmetic_mixed  "What is 3 * 4 + 5?" -> 17. Like arithmetic with * too and usual precedence; default
                    3 operands of 0..9. The slightly harder task.
  linear_equation   "Solve for x: 3x + 2 = 14" -> 4. x in -max_operand..max_operand (default 10).
  largest           "What is the largest of 7, 2 and 5?" -> 7. num_operands (default 3) numbers of
                    0..max_operand (default 9). The default run's task: every problem is solved by the same
                    skill (find the largest), so what an agent learns on training problems carries over to
                    held-out ones; the arithmetic tables with single digits are too small for that (their
                    held-out problems are table entries never seen in training).
  word_problem      "Ines has 5 pencils and gets 8 more. How many pencils does Ines have now?" -> 13. Word problems
                    of `steps` (default 2) arithmetic steps in five forms (one step: three), numbers 2..max_operand
                    (default 12). The real-model task (configs/real/smollm2.yaml): SmolLM2-135M-Instruct answers
                    one-step problems in a sentence or two ("... so he has 5 + 8 = 13 pencils.") and gets ~37 %
                    of them right greedily, two-step ones ~3 %.

Parts of a task. Every task also takes settings that keep only some of its problems, so that agents can be
warmed up on different parts of the training problems (configs/study/):
  part, parts       ``?parts=2&part=1``: one of `parts` near-equal parts, by a hash of the question (another
                    hash than the split's), so every part holds every kind of problem;
  min_answer, max_answer   ``?max_answer=7``: only problems whose answer lies in that range (any integers).

Splits. Every problem belongs to the held-out ("eval") or the training ("train") split by a hash (SHA-256)
of its question text, EVAL_SHARE of them held out. So the splits are disjoint by construction and the
same on every machine and run, whatever the settings (a harder setting is simply a different set of
questions). Each split is a list of distinct problems drawn from a fixed seed; small problem spaces
(arithmetic with operands 0..20 has 882 questions) yield all of their problems of that split.

The supervised warm-up target of a problem is ``target_text(record)``: the bare answer ("12"), which
``compute_score`` scores 1.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple
from urllib.parse import parse_qsl

from hacpo_megatron.data.records import PromptRecord, user_prompt

SPEC_PREFIX = "synthetic:"
EVAL_SHARE = 0.2  # fraction of each task's question space held out for evaluation
SPLIT_SIZES = {"train": 4096, "eval": 256}  # at most; small problem spaces give fewer
SPLIT_SEEDS = {"train": 1, "eval": 2}
EXHAUSTED_AFTER_DRAWS = 5000  # this many draws in a row with no new problem: a small space is used up

Problem = Tuple[str, int]  # (question, answer)


def _arithmetic(rng: random.Random, max_operand: int = 20, num_operands: int = 2) -> Problem:
    return _expression_problem(rng, max_operand, num_operands, operators="+-")


def _arithmetic_mixed(rng: random.Random, max_operand: int = 9, num_operands: int = 3) -> Problem:
    return _expression_problem(rng, max_operand, num_operands, operators="+-*")


def _expression_problem(rng: random.Random, max_operand: int, num_operands: int, operators: str) -> Problem:
    terms = [str(rng.randint(0, max_operand))]
    for _ in range(num_operands - 1):
        terms += [rng.choice(operators), str(rng.randint(0, max_operand))]
    expression = " ".join(terms)
    # eval of our own digits-and-operators string: exact integer arithmetic with the usual precedence
    return f"What is {expression}?", eval(expression, {"__builtins__": {}})


def _largest(rng: random.Random, max_operand: int = 9, num_operands: int = 3) -> Problem:
    numbers = [rng.randint(0, max_operand) for _ in range(num_operands)]
    listed = ", ".join(map(str, numbers[:-1])) + f" and {numbers[-1]}"
    return f"What is the largest of {listed}?", max(numbers)


def _linear_equation(rng: random.Random, max_operand: int = 10) -> Problem:
    x = rng.randint(-max_operand, max_operand)
    a = rng.randint(2, 9)
    b = rng.randint(-max_operand, max_operand)
    sign = "+" if b >= 0 else "-"
    return f"Solve for x: {a}x {sign} {abs(b)} = {a * x + b}", x


NAMES = ("Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jamal", "Kira", "Liam")
ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "stamps", "shells")


def _word_problem(rng: random.Random, max_operand: int = 12, steps: int = 2) -> Problem:
    """A word problem of one or two arithmetic steps (`steps`); every value along the way is >= 0."""
    name, friend = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    a, b, c = (rng.randint(2, max_operand) for _ in range(3))
    if steps == 1:
        form = rng.randrange(3)
        if form == 0:
            return f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", a + b
        if form == 1:
            total = a + b
            return (f"{name} has {total} {item} and gives {b} of them to {friend}. "
                    f"How many {item} does {name} have left?", a)
        return f"{name} buys {a} bags of {item} with {b} {item} in each bag. How many {item} does {name} have?", a * b
    form = rng.randrange(5)
    if form == 0:
        c = rng.randint(1, a + b)
        return (f"{name} has {a} {item}. {name} gets {b} more {item} and then gives {c} {item} to {friend}. "
                f"How many {item} does {name} have now?", a + b - c)
    if form == 1:
        c = rng.randint(1, a * b)
        return (f"{name} buys {a} bags of {item} with {b} {item} in each bag, and then gives away {c} {item}. "
                f"How many {item} does {name} have left?", a * b - c)
    if form == 2:
        return (f"A box holds {a} {item}. {name} fills {b} boxes and has {c} {item} more that do not fit. "
                f"How many {item} does {name} have in all?", a * b + c)
    if form == 3:
        total = a + b + c + rng.randint(0, max_operand)
        return (f"{name} had {total} dollars, spent {a} dollars on a book and {b} dollars on lunch. "
                f"How many dollars does {name} have left?", total - a - b)
    return (f"{name} reads {a} pages a day for {b} days and then {c} pages on the last day. "
            f"How many pages did {name} read in all?", a * b + c)


ANSWER_BOUNDS = ("min_answer", "max_answer")  # any integers; every other setting is >= 1
SELECTION_KEYS = ("part", "parts") + ANSWER_BOUNDS  # settings every task takes (module docstring)


@dataclass(frozen=True)
class SyntheticTask:
    name: str
    make_problem: Callable[..., Problem]
    settings: Dict[str, int]
    min_answer: Optional[int] = None
    max_answer: Optional[int] = None
    part: int = 1
    parts: int = 1

    def problem(self, rng: random.Random) -> Problem:
        return self.make_problem(rng, **self.settings)

    def keeps(self, question: str, answer: int) -> bool:
        return ((self.min_answer is None or answer >= self.min_answer)
                and (self.max_answer is None or answer <= self.max_answer)
                and int(_hash_fraction("part:" + question) * self.parts) == self.part - 1)


TASKS: Dict[str, Callable[..., Problem]] = {
    "arithmetic": _arithmetic,
    "arithmetic_mixed": _arithmetic_mixed,
    "linear_equation": _linear_equation,
    "largest": _largest,
    "word_problem": _word_problem,
}


def parse_task_spec(spec: str) -> SyntheticTask:
    """``"synthetic:arithmetic?max_operand=50"`` (or without the prefix) -> SyntheticTask."""
    name, _, query = spec.removeprefix(SPEC_PREFIX).partition("?")
    if name not in TASKS:
        raise ValueError(f"{spec!r}: unknown synthetic task {name!r}; known: {sorted(TASKS)}")
    make_problem = TASKS[name]
    allowed = make_problem.__code__.co_varnames[1 : make_problem.__code__.co_argcount]
    settings, selection = {}, {}
    for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if key not in allowed + SELECTION_KEYS:
            raise ValueError(f"{spec!r}: task {name!r} has no setting {key!r}; "
                             f"settings: {list(allowed + SELECTION_KEYS)}")
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"{spec!r}: setting {key!r} must be an integer, got {value!r}") from None
        if number < 1 and key not in ANSWER_BOUNDS:
            raise ValueError(f"{spec!r}: setting {key!r} must be >= 1, got {value!r}")
        (selection if key in SELECTION_KEYS else settings)[key] = number
    if selection.get("min_answer", -math.inf) > selection.get("max_answer", math.inf):
        raise ValueError(f"{spec!r}: min_answer must be <= max_answer")
    if selection.get("part", 1) > selection.get("parts", 1):
        raise ValueError(f"{spec!r}: part must be one of 1..parts")
    return SyntheticTask(name, make_problem, settings, **selection)


def _hash_fraction(text: str) -> float:
    """A number in [0, 1): a fixed function of the text, identical on every machine."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2**64


def split_of(question: str) -> str:
    """'eval' or 'train': a fixed function of the question text, identical on every machine."""
    return "eval" if _hash_fraction(question) < EVAL_SHARE else "train"


def load_synthetic(spec: str, split: str = "train", size: int | None = None) -> List[PromptRecord]:
    """Distinct problems of one split of a synthetic task, always the same ones in the same order."""
    if split not in SPLIT_SIZES:
        raise ValueError(f"{spec!r}: split must be one of {sorted(SPLIT_SIZES)}, got {split!r}")
    task = parse_task_spec(spec)
    wanted = size if size is not None else SPLIT_SIZES[split]
    rng = random.Random(f"{task.name}:{split}:{SPLIT_SEEDS[split]}")  # str seeds are hashed stably
    problems: Dict[str, int] = {}  # question -> answer, in drawing order
    draws_without_new = 0
    while len(problems) < wanted and draws_without_new < EXHAUSTED_AFTER_DRAWS:
        question, answer = task.problem(rng)
        if split_of(question) == split and question not in problems and task.keeps(question, answer):
            problems[question] = answer
            draws_without_new = 0
        else:
            draws_without_new += 1
    if not problems:
        raise ValueError(f"{spec!r}: no {split} problem is in this part of the task")
    source = SPEC_PREFIX + spec.removeprefix(SPEC_PREFIX)
    return [
        PromptRecord(f"{source}/{split}/{i}", user_prompt(question), str(answer), source, {"split": split})
        for i, (question, answer) in enumerate(problems.items())
    ]


def target_text(record: PromptRecord) -> str:
    """Supervised warm-up target: the bare integer answer, e.g. "12" (compute_score gives it 1)."""
    return record.ground_truth
