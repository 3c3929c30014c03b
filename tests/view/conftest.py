"""One small real run shared by the view's tests: the built-in OSDN-APF language model on one held-out
window of 32 tokens, single and twice (two prompts, two tasks), on the CPU — a tokenizer (token text),
a stored capture with d, comparator.parquet."""

from __future__ import annotations

import pytest

from osdn_diag.cli import main


@pytest.fixture(scope="session")
def lm_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("view") / "lm-osdn-apf"
    assert main(["run", "builtin:lm-osdn-apf", "--prompts", "lm-heldout-pair", "--num-prompts", "1",
                 "--length", "32", "--out", str(out), "-q"]) == 0
    return out
