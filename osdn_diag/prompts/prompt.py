"""One prompt: a token sequence with its task name and, for a repeated context, where the second copy
starts. Every suite (random, MQAR, held-out text) and the JSONL reader build these."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Prompt"]


@dataclass
class Prompt:
    id: int
    task: str
    input_ids: list[int]
    repeat_start: int = -1
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.input_ids)

    def manifest_entry(self) -> dict:
        return {"id": self.id, "task": self.task, "length": len(self), "repeat_start": self.repeat_start, **self.meta}
