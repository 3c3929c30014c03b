"""Reading back what a view page embeds: its data block (strips decoded) and its figures."""

from __future__ import annotations

import base64
import json
import re

import numpy as np


def _block(html: str, id_: str):
    m = re.search(rf'<script type="application/json" id="{id_}">(.*?)</script>', html, re.S)
    assert m, id_
    return json.loads(m.group(1).replace("<\\/", "</"))


def page_data(html: str) -> dict:
    data = _block(html, "osdn-view-data")
    for run in data["runs"]:
        for strip in run["strips"]:
            n = len(run["layers"]) + 1
            strip["v"] = {f: np.frombuffer(base64.b64decode(b), dtype="<f4").reshape(n, strip["length"])
                          for f, b in strip["values"].items()}
    return data


def page_figures(html: str) -> dict:
    return _block(html, "osdn-view-figures")
