"""A synthetic in-memory run of any size (no model): random ratios, losses, β and d, a token text per
position, and a summary computed from them as the replay's is (q_geo over finite rows, ten position
bins, per layer and per head) — what the view reads."""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def _cell(q: np.ndarray) -> dict:
    n = int(q.size)
    return {"q_geo": float(np.exp(np.log(np.maximum(q, 1e-30)).mean())) if n else None,
            "q_arith": float(q.mean()) if n else None, "n": n, "n_zero": int((q == 0).sum())}


def synthetic_results(prompts: int, length: int, layers: int, heads: int, seed: int = 0):
    from osdn_diag.replay import Results

    rng = np.random.default_rng(seed)
    shape = (prompts, layers, heads, length)
    grid = [a.ravel() for a in np.meshgrid(*(np.arange(s) for s in shape), indexing="ij")]
    prompt, layer, head, pos = grid
    n = prompt.size
    q = rng.uniform(0.01, 1.0, n).astype(np.float32)
    beta = rng.uniform(0.05, 0.95, n).astype(np.float32)
    lb = rng.uniform(0.1, 2.0, n).astype(np.float32)
    task = np.where(prompt % 2 == 0, "single", "twice")
    table = pa.table({
        "prompt": prompt.astype(np.int32), "task": pa.array(task).dictionary_encode().cast(pa.string()),
        "layer": layer.astype(np.int16), "head": head.astype(np.int16), "pos": pos.astype(np.int32),
        "rel_pos": (pos / length).astype(np.float32), "repeat_start": np.full(n, -1, np.int32),
        "beta": beta, "key_sqnorm": np.ones(n, np.float32), "write_gain": beta * rng.uniform(0.5, 2.0, n).astype(np.float32),
        "loss_before": lb, "loss_after": lb * q, "residual_ratio": q, "finite": np.ones(n, bool),
    })
    bins = np.minimum(10 * pos // length, 9)
    summary = {**_cell(q), "by_layer": {f"{i:03d}": _cell(q[layer == i]) for i in range(layers)},
               "by_head": {f"{i:03d}.{h:03d}": _cell(q[(layer == i) & (head == h)])
                           for i in range(layers) for h in range(heads)},
               "position_bins": {"edges": [b / 10 for b in range(11)],
                                 **{k: [_cell(q[bins == b])[k] for b in range(10)] for k in ("q_geo", "q_arith", "n")},
                                 "by_task": {t: {k: [_cell(q[(bins == b) & (task == t)])[k] for b in range(10)]
                                                 for k in ("q_geo", "q_arith", "n")} for t in ("single", "twice")}},
               "fidelity": {"measured": False, "max_rel_error": None}}
    tok_prompt, tok_pos = (a.ravel() for a in np.meshgrid(np.arange(prompts), np.arange(length), indexing="ij"))
    ids = rng.integers(0, 5000, tok_prompt.size).astype(np.int32)
    tokens = pa.table({"prompt": tok_prompt.astype(np.int32), "pos": tok_pos.astype(np.int32), "token_id": ids,
                       "text": pa.array([f" w{i}" for i in ids], pa.string())})
    return Results(table=table, summary=summary, tokens=tokens)
