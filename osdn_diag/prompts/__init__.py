"""Prompt suites and prompt files."""

from .base import SUITES, Prompt, load_prompts, random_suite, read_jsonl

__all__ = ["SUITES", "Prompt", "load_prompts", "random_suite", "read_jsonl"]
