"""The suite's file order (``tests/conftest.py``): the longest files first, so that two workers end together."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import conftest

ROOT = Path(__file__).resolve().parents[1]


def test_the_slow_files_exist():
    """A renamed or deleted file would silently fall back to the end of the queue."""
    for path in conftest.SLOW_FILES_FIRST:
        assert (ROOT / path).is_file(), path


def test_slow_files_are_dealt_first_in_their_order_and_the_rest_keep_theirs():
    first, second = conftest.SLOW_FILES_FIRST[:2]
    ids = ["tests/a.py::t1", f"{second}::x", "tests/b.py::t2", f"{first}::y[1]", "tests/a.py::t3", f"{first}::y[0]"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == [f"{first}::y[1]", f"{first}::y[0]", f"{second}::x",
                                         "tests/a.py::t1", "tests/b.py::t2", "tests/a.py::t3"]
