"""Capture of greedy generation: a prompt's prefill and every decoding step as one stream.

    with osdn_diag.capture(model) as cap:
        new = cap.generate(input_ids, 32)      # [1, 32] token ids, greedy
    res = osdn_diag.replay(cap)                # the prompt and its 32 tokens: one sequence per layer

A model generates in two regimes: the prompt is read in one forward pass (fla's chunk kernels, or the
fused recurrent ones for short prompts), then each new token is one forward pass of one token whose
kernel call starts from the state the previous pass left in the model's cache (fla's fused recurrent
kernels). Captured as they run, those are 1 + N calls per layer, the decoding ones each a one-token
sequence at position 0. :func:`generate` runs the loop itself — prefill, then each greedily chosen
token fed back with the cache — and :func:`stitch` joins each layer's calls into the one call they
together make: the tokens concatenated in time (positions continue the prompt's), the prompt's
initial state, the last step's final state, the output of every step. That is exactly a prefill of
prompt + tokens, provided each step started from the state the previous one returned: stitch checks
that it did (``flags["state_handoff_error"]``, the largest relative difference, 0 when the cache hands
the state over unchanged) and refuses a stream whose state was not carried, naming the versions.

Why not ``model.generate()``: its cache argument is the transformers version's (``cache`` since 5.x),
and fla 0.6.0's models read ``past_key_values``: under transformers 5.25 every decoding step of an fla
model starts from an empty state and nothing says so. :func:`generate` passes the cache by the name
the model's ``forward`` takes, and the check above catches any other way the state can be lost.

Conventions: one sequence at a time (``input_ids: [1, P]``, no padding); greedy (argmax of the last
logits, ties to the lowest id); the N tokens generated are each fed back, so every one of them is
written into the state (the (N+1)-th argmax is not a token of the stream and is not returned).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace

import torch

from .record import KernelCall

__all__ = ["GenerationError", "Generated", "STATE_HANDOFF_TOLERANCE", "generate", "stitch"]

#: Largest relative difference (Frobenius norm, per layer call) between the state a decoding step
#: started from and the one the step before returned. A cache hands the state over unchanged (0);
#: one that rounds it to bf16 differs by ~4e-3; a state not carried, by 1.
STATE_HANDOFF_TOLERANCE = 1e-2

#: Per-token fields of a record, concatenated in time ([B, T, ...]).
_TOKEN_FIELDS = ("q", "k", "v", "beta", "g", "d", "write_key", "o")


class GenerationError(ValueError):
    """The model's decoding steps cannot be joined into one stream (the state was not carried)."""


@dataclass
class Generated:
    """What :func:`generate` captured: the ``tokens`` generated (``[1, N]``, on the model's device),
    the stitched ``calls`` (one per layer call of the prefill, each covering prompt + tokens) and the
    prompt's ``logits`` (``[1, P, vocab]``, its prefill's)."""

    tokens: torch.Tensor
    calls: list[KernelCall]
    logits: torch.Tensor


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = []
    for name in ("flash-linear-attention", "transformers", "torch"):
        try:
            parts.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            parts.append(f"{name} not installed")
    return ", ".join(parts)


def cache_argument(model: torch.nn.Module) -> str:
    """The name under which ``model.forward`` takes its cache: ``"cache"`` (transformers' own models
    since 5.x) or ``"past_key_values"`` (fla 0.6.0's models, transformers before)."""
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise GenerationError(f"model {type(model).__name__}: its forward takes neither 'cache' nor "
                          f"'past_key_values', so its decoding state cannot be carried ({_versions()})")


def _returned_cache(out):
    """The cache a forward pass returned, under either name (without transformers' deprecation path)."""
    for name in ("cache", "past_key_values"):
        value = out.get(name) if hasattr(out, "get") else getattr(out, name, None)
        if value is not None:
            return value
    return None


def generate(cap, input_ids: torch.Tensor, max_new_tokens: int) -> Generated:
    """Greedy generation of ``max_new_tokens`` tokens after ``input_ids`` (``[1, P]`` or ``[P]``)
    under the live capture ``cap``; returns the tokens and the stitched calls (not added to
    ``cap.calls``: :meth:`Capture.generate` does that)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"argument 'max_new_tokens': expected an int >= 1, got {max_new_tokens!r}")
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 1:
        raise ValueError(f"argument 'input_ids': expected one sequence, [1, P] or [P] with P >= 1, got shape "
                         f"{list(ids.shape)}; generate one prompt at a time")
    model = cap.model
    ids = ids.to(model.get_input_embeddings().weight.device)
    name = cache_argument(model)
    forwards: list[list[KernelCall]] = []
    tokens = []
    with cap.collecting() as got, torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        logits = out.logits
        forwards.append(got.take())
        for _ in range(max_new_tokens):
            cache = _returned_cache(out)
            if cache is None:
                raise GenerationError(f"model {type(model).__name__} returned no cache with use_cache=True, so "
                                      f"decoding cannot continue its state ({_versions()})")
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(token)
            out = model(input_ids=token, use_cache=True, **{name: cache})
            forwards.append(got.take())
    return Generated(tokens=torch.cat(tokens, 1), calls=stitch(forwards, ids.shape[1]), logits=logits)


def _handoff_error(before: torch.Tensor | None, after: torch.Tensor | None, what: str) -> float:
    """Relative Frobenius difference between the state a call returned and the one the next started
    from (1.0 when the next started from nothing)."""
    if after is None:
        return 1.0
    if before is None or before.shape != after.shape:
        raise GenerationError(f"{what}: the state a decoding step started from has no counterpart of its shape "
                              f"in the step before ({_versions()})")
    a, b = after.double(), before.double()
    finite = torch.isfinite(b)
    if not bool(finite.all()):
        # NaN/Inf in the state (the replay flags such streams): carried when it is the same state,
        # non-finite entries where they were, bit for bit, and the finite ones compared below.
        same = torch.equal(finite, torch.isfinite(a)) and torch.equal(a[~finite].nan_to_num(), b[~finite].nan_to_num())
        if not same:
            return 1.0
        a, b = a[finite], b[finite]
    diff = (a - b).norm()
    scale = b.norm()
    if scale == 0:
        return 0.0 if diff == 0 else 1.0
    return float(diff / scale)


def stitch(forwards: list[list[KernelCall]], prompt_length: int) -> list[KernelCall]:
    """Join the calls of a prefill (``forwards[0]``, of ``prompt_length`` tokens) and of its decoding
    steps (``forwards[1:]``, one forward pass each) into one call per layer call: see the module
    docstring. Every forward pass must make the same calls (layer for layer) on one unpadded sequence."""
    first = forwards[0]
    if not first:
        raise GenerationError("the prompt's forward pass made no kernel call capture records")
    for step, calls in enumerate(forwards[1:], start=1):
        if [(c.layer, c.family) for c in calls] != [(c.layer, c.family) for c in first]:
            raise GenerationError(
                f"decoding step {step} made kernel calls {[(c.layer, c.family) for c in calls]}, the prompt's "
                f"forward pass {[(c.layer, c.family) for c in first]}: they cannot be joined into one stream")
    return [_stitch_one([calls[j] for calls in forwards], prompt_length) for j in range(len(first))]


def _one_sequence(call: KernelCall) -> KernelCall:
    """``call`` as one unpacked sequence (a ``cu_seqlens`` of ``[0, T]`` dropped)."""
    if call.k.shape[0] != 1 or (call.cu_seqlens is not None and call.cu_seqlens.numel() != 2):
        raise GenerationError(f"layer {call.layer} ({call.layer_name}): a call of {len(call.segments())} "
                              "sequences; generation is captured one sequence at a time")
    return replace(call, cu_seqlens=None) if call.cu_seqlens is not None else call


def _stitch_one(parts: list[KernelCall], prompt_length: int) -> KernelCall:
    parts = [_one_sequence(p) for p in parts]
    head = parts[0]
    where = f"layer {head.layer} ({head.layer_name}, {head.family})"
    errors = []
    for step, (before, after) in enumerate(zip(parts, parts[1:]), start=1):
        states = [(before.final_state, after.initial_state)]
        states += [(before.extra.get("final_" + n.removeprefix("initial_")), x)
                   for n, x in after.extra.items() if n.startswith("initial_")]
        err = max(_handoff_error(b, a, where) for b, a in states)
        if not err <= STATE_HANDOFF_TOLERANCE:  # NaN refused too
            raise GenerationError(
                f"{where}: decoding step {step} did not start from the state the step before left "
                f"(relative difference {err:.3g}); this model does not carry its state through its cache "
                f"with the installed {_versions()}, so its decoding cannot be diagnosed as one stream")
        errors.append(err)
        if after.scale != head.scale or after.input_dtype != head.input_dtype:
            raise GenerationError(f"{where}: decoding step {step} ran with scale {after.scale} in "
                                  f"{after.input_dtype}, the prompt with {head.scale} in {head.input_dtype}")
    joined = {}
    for name in _TOKEN_FIELDS:
        values = [getattr(p, name) for p in parts]
        if name == "write_key" and any(v is not None for v in values):
            # A record without a write key writes with the fp32 product d ⊙ k (or k): the prefill's
            # chunk path stores the key it read in the input dtype, a decoding step's fused kernel
            # forms it in registers. Each part keeps the key its own kernel wrote with.
            values = [v if v is not None else (p.k if p.d is None else p.d * p.k) for v, p in zip(values, parts)]
        if all(v is None for v in values):
            joined[name] = None
        elif any(v is None for v in values):
            raise GenerationError(f"{where}: '{name}' recorded for some steps and not others")
        else:
            joined[name] = torch.cat(values, dim=1)
    extra = {}
    for name, x in head.extra.items():
        if name.startswith("initial_"):
            extra[name] = x
        elif name.startswith("final_"):
            extra[name] = parts[-1].extra.get(name)
        else:
            extra[name] = torch.cat([p.extra[name] for p in parts], dim=1)
    # In tokens, as the table's positions are (a micro-step family's record has several rows a token).
    flags = {**head.flags, "decode_start": int(prompt_length), "decode_kernel": parts[-1].kernel,
             "state_handoff_error": max(errors, default=0.0)}
    return replace(head, **joined, extra={k: v for k, v in extra.items() if v is not None},
                   initial_state=head.initial_state, final_state=parts[-1].final_state, cu_seqlens=None,
                   flags=flags)

