"""The files ``tests/_suite_order.py`` schedules first are files of this suite, each named once."""

from __future__ import annotations

from pathlib import Path

from _suite_order import SLOWEST_FILES

ROOT = Path(__file__).resolve().parents[1]


def test_the_files_scheduled_first_exist():
    assert len(set(SLOWEST_FILES)) == len(SLOWEST_FILES)
    missing = [name for name in SLOWEST_FILES if not (ROOT / name).is_file()]
    assert not missing, f"tests/conftest.py SLOWEST_FILES names files that are gone: {missing}"
