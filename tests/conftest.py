"""Suite-wide test configuration: Triton's interpreter on machines without a GPU, and the hypothesis
profiles.

Triton decides when a kernel is defined (at import) whether it will be compiled or interpreted, so
``TRITON_INTERPRET=1`` must be in the environment before anything imports triton or fla. This file is
loaded before any test module, so it sets the variable here — only on a machine without CUDA, so
that a GPU run of the suite keeps compiled Triton.

``python -m pytest`` (what CI runs) uses the ``ci`` profile: 200 examples per property, no deadline
(the reference recurrences loop over time in Python, so example times vary with the drawn shape).
Set ``HYPOTHESIS_PROFILE=dev`` for a quick local run (25 examples), ``thorough`` for a long hunt
(2000 examples, e.g. after touching a tolerance), or pass hypothesis' own
``--hypothesis-profile`` option, which takes precedence over both.
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile(
    "ci",
    max_examples=200,
    deadline=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev",
    max_examples=25,
    deadline=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough",
    max_examples=2000,
    deadline=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
