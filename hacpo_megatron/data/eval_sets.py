"""Evaluation benchmarks read from local files (.jsonl/.json lines/.parquet) in their usual field names.

None of these can be downloaded here; users bring the files. The table below is the only place that
knows each benchmark's field names; ``reference_answers.answer_from_field`` knows the answer formats
(GSM8K's ``#### 72``, MATH's ``\\boxed{}``, OlympiadBench's list).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

from hacpo_megatron.data.reference_answers import AnswerFormatError, answer_from_field
from hacpo_megatron.data.files import DataFormatError, read_rows
from hacpo_megatron.data.records import PromptRecord, user_prompt


@dataclass(frozen=True)
class BenchmarkFields:
    question: Tuple[str, ...]  # first present field holds the question
    answer: Tuple[str, ...]  # first present field holds the final answer (preferred) or a solution with it


BENCHMARK_FIELDS: Dict[str, BenchmarkFields] = {
    "math500": BenchmarkFields(question=("problem",), answer=("answer", "solution")),
    "math": BenchmarkFields(question=("problem",), answer=("answer", "solution")),
    "gsm8k": BenchmarkFields(question=("question",), answer=("answer",)),  # "... #### 72"
    "aime2025": BenchmarkFields(question=("problem", "question"), answer=("answer",)),
    "amc23": BenchmarkFields(question=("question", "problem"), answer=("answer",)),
    "minerva": BenchmarkFields(question=("problem", "question"), answer=("answer", "solution")),
    "olympiadbench": BenchmarkFields(question=("question",), answer=("final_answer",)),  # a list
}
ID_FIELDS = ("unique_id", "id", "idx", "uid")  # a row's own identifier, when it has one


def benchmark_key(name: str) -> str:
    """'MATH-500', 'math_500' and 'math500' all name the same benchmark."""
    key = name.lower().replace("-", "").replace("_", "").replace(" ", "")
    if key not in BENCHMARK_FIELDS:
        raise ValueError(f"unknown benchmark {name!r}; known: {sorted(BENCHMARK_FIELDS)}")
    return key


def load_benchmark(name: str, path: str | Path) -> List[PromptRecord]:
    """The problems of benchmark ``name`` from ``path``, as PromptRecords with data_source = the benchmark key."""
    key = benchmark_key(name)
    fields = BENCHMARK_FIELDS[key]
    records = []
    for row_number, (location, row) in enumerate(read_rows(path)):
        try:
            question_field = _first_present(row, fields.question)
            answer_field = _first_present(row, fields.answer)
            question = row[question_field]
            if not isinstance(question, str) or not question.strip():
                raise DataFormatError(f"{question_field!r} must be non-empty text")
            ground_truth = answer_from_field(row[answer_field], answer_field)
        except (AnswerFormatError, DataFormatError) as exc:
            raise DataFormatError(f"{location}: {key}: {exc}") from None
        uid = next((str(row[f]) for f in ID_FIELDS if row.get(f) is not None), f"{key}-{row_number}")
        records.append(PromptRecord(uid, user_prompt(question), ground_truth, key, {"row": row_number}))
    if not records:
        raise DataFormatError(f"{path}: no rows")
    return records


def _first_present(row, names: Tuple[str, ...]) -> str:
    for name in names:
        if row.get(name) is not None:
            return name
    raise DataFormatError(f"missing field: expected one of {list(names)}; row has keys {sorted(row)}")
