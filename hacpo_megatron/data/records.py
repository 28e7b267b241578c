"""The one record type every prompt source produces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List


@dataclass
class PromptRecord:
    """A prompt with its verifiable answer.

    uid: stable identifier (same prompt, same uid on every run); groups of responses are keyed by it.
    messages: the chat, a list of {"role": ..., "content": ...}; usually one user message.
    ground_truth: the reference final answer, as text the reward function parses ("12", "\\frac{1}{2}").
    data_source: where the prompt comes from ("gsm8k", "synthetic:arithmetic", a file's name).
    extra_info: anything else the source carried, passed through to reward plug-ins.
    """

    uid: str
    messages: List[Dict[str, str]]
    ground_truth: str
    data_source: str
    extra_info: Dict[str, Any] = field(default_factory=dict)

    @property
    def question(self) -> str:
        """Content of the last user message."""
        return next(m["content"] for m in reversed(self.messages) if m["role"] == "user")


def user_prompt(question: str) -> List[Dict[str, str]]:
    return [{"role": "user", "content": question}]
