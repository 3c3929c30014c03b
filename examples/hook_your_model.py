"""Hook your own fla model and dump its residual ratios — the diagnostic in ~20 lines of Python.

    python examples/hook_your_model.py MODEL [--out ratios.parquet] [--length 256]

MODEL is a local Hugging Face directory of an fla (or OSDN) model, ``builtin:NAME`` or
``random:PRESET``. Every delta-rule write of every layer and head is replayed in fp32 from what the
kernel received; the per-token table (one row per prompt, layer, head, position) goes to a parquet
file and the geometric-mean residual ratio per layer is printed.
"""

from __future__ import annotations

import argparse

import pyarrow.parquet as pq
import torch

import osdn_diag
from osdn_diag.models import load_model
from osdn_diag.runtime import prepare


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--out", default="ratios.parquet")
    p.add_argument("--length", type=int, default=256, help="tokens of the random prompt")
    a = p.parse_args()

    device = prepare()  # CUDA if present; else the CPU, with Triton's interpreter for fla's small ops
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_model(a.model, device=device, dtype=dtype).model
    vocab = model.config.vocab_size
    input_ids = torch.randint(0, vocab, (2, a.length), generator=torch.Generator().manual_seed(0)).to(device)

    with osdn_diag.capture(model) as cap, torch.inference_mode():  # the model is restored on exit
        model(input_ids=input_ids)
    res = osdn_diag.replay(cap)

    pq.write_table(res.table, a.out)  # or res.to_pandas() for a DataFrame
    print(f"{res.table.num_rows:,} writes -> {a.out}; q_geo = {res.summary['q_geo']:.4f}")
    for layer, s in res.summary["by_layer"].items():
        print(f"  layer {int(layer):2d}: q_geo {s['q_geo']:.4f}  q_arith {s['q_arith']:.4f}")


if __name__ == "__main__":
    main()
