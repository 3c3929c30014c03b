"""The text the built-in language models were trained and are diagnosed on.

The corpus is the Python standard library's own source files — code, comments and docstrings — under
the PSF License (version 2), present wherever Python is installed, so nothing is downloaded. A file
belongs to the held-out split when the first byte of the sha256 of its path relative to the library's
root is below :data:`HELDOUT_BYTE` (about 5 % of the files); the split therefore depends only on the
path, never on the order files are listed in or on their contents, and a module never straddles both.

The package ships what the diagnostic needs of it, in ``osdn_diag/builtin/lm-corpus/``:

* ``tokenizer.json`` / ``tokenizer_config.json`` — the byte-level BPE tokenizer trained on the train
  split (also copied into every ``builtin:lm-*`` model, so ``{"text": ...}`` prompts work there);
* ``heldout.safetensors`` — the held-out split tokenised: ``tokens`` (int16, every held-out document
  one after another; so a vocabulary of at most 32,768 tokens) and ``offsets`` (int64,
  ``[num_docs + 1]``: document ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``), documents in path order;
* ``corpus.json`` — where the text came from (Python version, file counts, a sha256 over every path
  and file), the tokenizer's settings and the token counts of both splits.

``examples/train_lm.py prepare`` writes these from the running interpreter's standard library.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

__all__ = [
    "CORPUS_DIR", "END_OF_TEXT", "HELDOUT_BYTE", "corpus_info", "heldout_documents", "split_of",
    "stdlib_documents", "stdlib_root",
]

#: Where the shipped tokenizer and held-out tokens live.
CORPUS_DIR = Path(__file__).resolve().parent.parent / "builtin" / "lm-corpus"

#: A path whose sha256 starts with a byte below this is held out: 13/256 ≈ 5.1 % of the files.
HELDOUT_BYTE = 13

#: The tokenizer's one special token, id 0: it separates documents in the training stream.
END_OF_TEXT = "<|endoftext|>"


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str) -> str:
    """``"heldout"`` or ``"train"`` for a file's path relative to the library's root (POSIX form)."""
    return "heldout" if hashlib.sha256(relpath.encode("utf-8")).digest()[0] < HELDOUT_BYTE else "train"


def stdlib_documents(root: Path | None = None) -> dict[str, list[tuple[str, str]]]:
    """Every ``.py`` file of the standard library as ``(relative path, text)``, sorted by path, by split:
    ``{"train": [...], "heldout": [...]}``. Installed third-party packages (``site-packages``,
    ``dist-packages``) and bytecode caches are not part of it; a file that is not UTF-8 is skipped
    (the standard library has none)."""
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"standard library directory {root} does not exist")
    out: dict[str, list[tuple[str, str]]] = {"train": [], "heldout": []}
    skip = {"site-packages", "dist-packages", "__pycache__"}
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if skip.intersection(rel.parts) or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        out[split_of(rel.as_posix())].append((rel.as_posix(), text))
    return out


def corpus_info(directory: Path | None = None) -> dict:
    """``corpus.json`` of the shipped corpus (or of ``directory``)."""
    import json

    path = (CORPUS_DIR if directory is None else Path(directory)) / "corpus.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing: the language-model corpus was not installed with the "
                                "package (examples/train_lm.py prepare writes it)") from None


def heldout_documents(directory: Path | None = None) -> list[list[int]]:
    """The held-out split's documents as lists of token ids, in path order."""
    from safetensors.numpy import load_file

    path = (CORPUS_DIR if directory is None else Path(directory)) / "heldout.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the language-model corpus was not installed with the "
                                "package (examples/train_lm.py prepare writes it)")
    data = load_file(str(path))
    tokens, offsets = data["tokens"], data["offsets"]
    if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(tokens):
        raise ValueError(f"{path}: 'offsets' must run from 0 to len(tokens) = {len(tokens)}")
    return [tokens[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
