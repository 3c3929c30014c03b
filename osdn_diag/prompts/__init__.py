"""Prompt suites and prompt files."""

from .base import SUITES, Prompt, load_prompts, random_suite, read_jsonl
from .lm import heldout_windows, lm_heldout_pair_suite, lm_heldout_suite
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
    "heldout_windows",
    "lm_heldout_pair_suite",
    "lm_heldout_suite",
    "load_prompts",
    "mqar_batch",
    "mqar_pair_prompts",
    "mqar_prompts",
    "random_suite",
    "read_jsonl",
    "recall_accuracy",
    "recall_by_task",
]
