"""Training/evaluation prompt files in verl's schema or a plain question/answer form -> PromptRecords.

verl's schema (one row per prompt)::

    {"data_source": "gsm8k",
     "prompt": [{"role": "user", "content": "..."}],
     "reward_model": {"ground_truth": "72", ...},
     "extra_info": {...}}                                  # optional

Plain form: ``question`` (or ``problem``) and ``answer`` (or ``solution``; a GSM8K answer with
``#### 72`` or a MATH solution with ``\\boxed{72}`` gives the final answer); optional ``data_source``,
``extra_info``, ``uid``. A row that fits neither fails loudly with its file and line: rows are never dropped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

from hacpo_megatron.data.reference_answers import AnswerFormatError, answer_from_field
from hacpo_megatron.data.files import DataFormatError, read_rows
from hacpo_megatron.data.records import PromptRecord, user_prompt

QUESTION_FIELDS = ("question", "problem")
ANSWER_FIELDS = ("answer", "solution")  # in order of preference


def load_prompt_file(path: str | Path) -> List[PromptRecord]:
    """All rows of a .jsonl/.parquet file as PromptRecords (uids default to "<file stem>-<row number>")."""
    path = Path(path)
    records = []
    for row_number, (location, row) in enumerate(read_rows(path)):
        try:
            records.append(record_from_row(row, default_uid=f"{path.stem}-{row_number}", default_source=path.stem))
        except (AnswerFormatError, DataFormatError) as exc:
            raise DataFormatError(f"{location}: {exc}") from None
    if not records:
        raise DataFormatError(f"{path}: no rows")
    return records


def record_from_row(row: Dict[str, Any], *, default_uid: str, default_source: str) -> PromptRecord:
    if "prompt" in row:
        messages, ground_truth = _verl_prompt_and_answer(row)
    else:
        messages, ground_truth = _plain_prompt_and_answer(row)
    extra_info = row.get("extra_info") or {}
    if not isinstance(extra_info, dict):
        raise DataFormatError(f"'extra_info' must be an object, got {type(extra_info).__name__}")
    data_source = row.get("data_source") or default_source
    uid = row.get("uid", extra_info.get("uid", default_uid))
    return PromptRecord(str(uid), messages, ground_truth, str(data_source), dict(extra_info))


def _verl_prompt_and_answer(row: Dict[str, Any]):
    messages = _chat_messages(row["prompt"])
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        plain = [name for name in ANSWER_FIELDS if name in row]
        hint = f" (for a plain row with {plain[0]!r}, name its prompt 'question')" if plain else ""
        raise DataFormatError(
            f"verl row needs 'reward_model': {{'ground_truth': ...}}; row has keys {sorted(row)}{hint}"
        )
    return messages, answer_from_field(reward_model["ground_truth"], "reward_model.ground_truth")


def _chat_messages(prompt: Any) -> List[Dict[str, str]]:
    if isinstance(prompt, str):
        prompt = user_prompt(prompt)
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise DataFormatError("'prompt' must be a non-empty list of {'role', 'content'} messages")
    messages = []
    for i, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(
            message.get("content"), str
        ):
            raise DataFormatError(f"'prompt'[{i}] must be {{'role': str, 'content': str}}, got {message!r:.100}")
        messages.append({"role": message["role"], "content": message["content"]})
    if not any(m["role"] == "user" for m in messages):
        raise DataFormatError("'prompt' has no user message")
    return messages


def _plain_prompt_and_answer(row: Dict[str, Any]):
    question_field = _first_present(row, QUESTION_FIELDS, "question")
    answer_field = _first_present(row, ANSWER_FIELDS, "answer")
    question = row[question_field]
    if not isinstance(question, str) or not question.strip():
        raise DataFormatError(f"{question_field!r} must be non-empty text")
    return user_prompt(question), answer_from_field(row[answer_field], answer_field)


def _first_present(row: Dict[str, Any], fields, what: str) -> str:
    for name in fields:
        if row.get(name) is not None:
            return name
    raise DataFormatError(
        f"no {what}: expected verl's 'prompt' or one of {list(fields)}; row has keys {sorted(row)}"
    )
