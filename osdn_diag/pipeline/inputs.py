"""What goes into a forward pass: batches of prompts, their ids and attention masks, the model
directory's tokenizer, and the checks that a batch can run (ragged prompts, ``generate``)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch



def _progress(iterable, total: int, enabled: bool, desc: str, unit: str):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit)


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("osdn-diag", "torch", "triton", "flash-linear-attention", "fla-core", "transformers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _batches(prompts, batch_size: int):
    for i in range(0, len(prompts), batch_size):
        yield i // batch_size, prompts[i : i + batch_size]


def _inputs(batch, device):
    """``input_ids`` (right-padded) and, when lengths differ, the ``attention_mask`` fla unpads with
    (the kernels then see the batch packed as ``cu_seqlens``, sequences in batch order)."""
    width = max(len(p) for p in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, p in enumerate(batch):
        ids[row, : len(p)] = torch.tensor(p.input_ids)
        mask[row, : len(p)] = 1
    if bool(mask.all()):
        return ids.to(device), None
    return ids.to(device), mask.to(device)


def _check_generate(generate, batch_size: int) -> None:
    """``generate``: an int >= 0; decoding runs one prompt at a time (``batch_size`` 1)."""
    if isinstance(generate, bool) or not isinstance(generate, int) or generate < 0:
        raise ValueError(f"argument 'generate': expected an int >= 0 (tokens to generate per prompt), got {generate!r}")
    if generate and batch_size != 1:
        raise ValueError(f"argument 'generate': decoding is captured one prompt at a time, so it needs "
                         f"--batch-size 1 (got {batch_size})")


#: Model types whose delta-rule layer takes no attention mask (fla raises NotImplementedError on one):
#: a batch of prompts of different lengths, which needs a mask, cannot run through them.
NO_MASK_MODEL_TYPES = {"momentum_deltanet": "MomentumDeltaNet"}


def _check_batches_fit(config: dict, prompts, batch_size: int) -> None:
    """Refuse, before the run directory is touched, forward batches the model cannot run: prompts of
    different lengths in one batch of a model whose layer takes no attention mask."""
    layer = NO_MASK_MODEL_TYPES.get(config.get("model_type"))
    if layer is None or batch_size == 1:
        return
    for index, batch in _batches(prompts, batch_size):
        lengths = sorted({len(p) for p in batch})
        if len(lengths) > 1:
            raise ValueError(f"argument --batch-size: {layer} takes no attention mask, so prompts of different "
                             f"lengths cannot share a batch (batch {index}: prompts {batch[0].id}-{batch[-1].id}, "
                             f"{lengths[0]} to {lengths[-1]} tokens); use --batch-size 1")


def _load_tokenizer(directory: Path | None):
    """The model directory's own tokenizer, from local files only and never with the directory's own
    code (:func:`~osdn_diag.models.load_model` has refused an ``auto_map`` already); ``None`` when it
    has none."""
    if directory is None or not any(directory.glob("tokenizer*")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError, RecursionError) as err:  # a damaged file's many faces
        files = ", ".join(sorted(p.name for p in directory.glob("tokenizer*")))
        message = " ".join(str(err).split()) or type(err).__name__
        raise ValueError(f"the tokenizer in {directory} ({files}) cannot be loaded ({message[:300]}); repair or "
                         "replace those files, or remove them to run the model on token ids only") from err


def _session_tokenizer(directory: Path | None, quiet: bool = False):
    """``(tokenizer, tokenize, problem)`` for a run: the directory's tokenizer and ``text -> ids`` with
    it. An unreadable tokenizer fails only prompts that need it (``tokenize`` raises its error, naming
    the files); prompts of token ids run without token text, a line says so, and ``problem`` is why
    (``None`` when the tokenizer loaded or there is none)."""
    try:
        tok = _load_tokenizer(directory)
    except ValueError as err:
        message = str(err)

        def unreadable(text):
            raise ValueError(f"text prompts need the model's tokenizer, and {message}")

        if not quiet:
            print(f"osdn-diag: {message}; token text is not stored for this run", file=sys.stderr)
        return None, unreadable, message
    return tok, _tokenize(tok), None


def _tokenize(tok):
    """``text -> ids`` with tokenizer ``tok`` (no special tokens added); ``None`` without one."""
    if tok is None:
        return None
    return lambda text: tok(text, add_special_tokens=False)["input_ids"]


def _tokenizer(directory: Path | None):
    """``text -> ids`` with the model directory's own tokenizer (:func:`_load_tokenizer`); ``None`` when
    it has none."""
    return _tokenize(_load_tokenizer(directory))
