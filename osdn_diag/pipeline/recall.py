"""Recall on prompts that carry answers (MQAR, held-out text): per prompt from the logits, and the
manifest's recall table per task."""

from __future__ import annotations

import math

import torch



def _recall_hits(batch, logits: torch.Tensor | None) -> dict[int, tuple[int, int, int, float]]:
    """``{prompt id: (correct answers, queries, queries excluded, nll)}`` for the recall prompts of a
    batch (those whose ``meta`` names ``answer_positions`` and ``answers``): the argmax at each query
    position against the answer that follows it, and ``nll``, the summed negative log-likelihood of
    the answers, ``Σ −log softmax(logits[p])[answer]`` in nats (a log-softmax of the answer positions'
    logits only, in fp32, summed in fp64). A query whose logits hold NaN/Inf has no argmax worth the
    name (NaN counts as the largest value) and no likelihood: it is excluded, neither right nor wrong
    and not in ``nll``, and ``queries`` counts only the others."""
    out = {}
    for row, p in enumerate(batch):
        pos, ans = p.meta.get("answer_positions"), p.meta.get("answers")
        if logits is None or not pos:
            continue
        at = logits[row, torch.as_tensor(pos, device=logits.device)]
        answers = torch.as_tensor(ans, device=logits.device)
        finite_dev = torch.isfinite(at).all(-1)
        finite = finite_dev.cpu()
        hit = (at.argmax(-1).cpu() == answers.cpu()) & finite
        n_ok = int(finite.sum())
        ok = at[finite_dev].float()
        nll = -ok.log_softmax(-1).gather(-1, answers[finite_dev, None]).squeeze(-1)
        out[p.id] = (int(hit.sum()), n_ok, len(pos) - n_ok, float(nll.double().sum()))
    return out


def recall_table(manifest: dict) -> dict[str, dict]:
    """Recall accuracy per task from a capture manifest: ``{task: {"accuracy", "correct", "queries",
    "excluded_nonfinite", "prompts", "nll", "perplexity", "scoring"}}`` (query-weighted), for the
    prompts that carry answers; empty when none do. ``queries`` counts the queries measured;
    ``excluded_nonfinite`` those whose logits held NaN/Inf. ``accuracy`` is ``None`` when no query was
    measured. ``nll`` is the mean negative log-likelihood per measured query (nats; the sum of the
    prompts' ``recall_nll`` over ``queries``) and ``perplexity`` = exp(``nll``); both ``None`` when no
    query was measured or a prompt of the task has no ``recall_nll`` (a manifest written before it
    was recorded). ``scoring`` is the prompts' ``scoring`` (``"next-token"`` for held-out text),
    ``"recall"`` where they name none."""
    per_task: dict[str, list] = {}
    for p in manifest.get("prompts", []):
        if "recall_correct" in p:
            acc = per_task.setdefault(p["task"], [0, 0, 0, 0, 0.0, set()])
            acc[0] += int(p["recall_correct"])
            acc[1] += int(p["recall_queries"])
            acc[2] += int(p.get("recall_excluded", 0))
            acc[3] += 1
            nll = p.get("recall_nll")
            acc[4] = None if acc[4] is None or nll is None else acc[4] + float(nll)
            acc[5].add(p.get("scoring", "recall"))
    table = {}
    for task, (c, q, x, n, nll, scoring) in per_task.items():
        mean = nll / q if q and nll is not None else None
        table[task] = {"accuracy": c / q if q else None, "correct": c, "queries": q, "excluded_nonfinite": x,
                       "prompts": n, "nll": mean, "perplexity": None if mean is None else _exp(mean),
                       "scoring": "/".join(sorted(scoring))}
    return table


def _exp(x: float) -> float:
    """exp(x), ``inf`` where it overflows a double (written ``null``)."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf
