"""Prompt suites and prompt files."""

from .base import SUITES, Prompt, load_prompts, random_suite, read_jsonl
from .mqar import (
    MQARSpec,
    mqar_batch,
    mqar_pair_prompts,
    mqar_prompts,
    recall_accuracy,
    recall_by_task,
)

__all__ = [
    "SUITES",
    "MQARSpec",
    "Prompt",
    "load_prompts",
    "mqar_batch",
    "mqar_pair_prompts",
    "mqar_prompts",
    "random_suite",
    "read_jsonl",
    "recall_accuracy",
    "recall_by_task",
]
