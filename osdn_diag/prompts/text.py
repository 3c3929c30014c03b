"""Token text: the piece of text each token id stands for, from the model's tokenizer.

:class:`TokenText` turns token ids into one piece of text per id — each id decoded on its own, so that
the pieces align one to one with positions and can be computed for any ids, those of a prompt file or
ids a model generated after it. A piece is ``tokenizer.decode([id])`` (special tokens kept, no
clean-up of spaces), so for a byte-level BPE tokenizer (GPT-2, Llama 3, Qwen, the built-in language
models) the pieces of a text joined are ``tokenizer.decode(ids)`` exactly, wherever no character is
split over several tokens. Where one is — a token that holds part of a character's UTF-8 bytes, which
decodes to U+FFFD on its own — the piece shows the token's bytes instead, each byte that is not part of
a whole character written ``<0xNN>`` (SentencePiece's spelling of its byte-fallback tokens), e.g.
``<0xC3>`` for the first byte of ``é``. The bytes are read from the token's vocabulary entry: a
byte-level entry (every character one of the 256 that byte-level BPE maps bytes to) or a byte-fallback
entry ``<0xNN>``; a token of another kind keeps its U+FFFD. A SentencePiece word-start token (``▁the``)
whose lone decode drops the word's space keeps it (`` the``).

Pieces are computed once per distinct id (a run's prompts hold at most its vocabulary's worth).
"""

from __future__ import annotations

import codecs
import hashlib
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["BYTE_ERRORS", "TOKENIZER_FILES", "TokenText", "byte_level_decoder", "render_bytes", "tokenizer_files"]

#: The ``errors`` handler that writes a byte outside whole UTF-8 characters as ``<0xNN>``.
BYTE_ERRORS = "osdn_diag.token_bytes"


def _hex_bytes(err: UnicodeDecodeError) -> tuple[str, int]:
    return "".join(f"<0x{b:02X}>" for b in err.object[err.start:err.end]), err.end


codecs.register_error(BYTE_ERRORS, _hex_bytes)


def render_bytes(raw: bytes) -> str:
    """``raw`` as text: whole UTF-8 characters as themselves, every other byte as ``<0xNN>``."""
    return raw.decode("utf-8", errors=BYTE_ERRORS)


def byte_level_decoder() -> dict[str, int]:
    """The inverse of byte-level BPE's byte-to-character table (GPT-2's ``bytes_to_unicode``): the
    printable bytes stand for themselves, the other 68 are moved to U+0100 onwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = byte_level_decoder()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_REPLACEMENT = "\ufffd"

#: The files of a model directory that make its tokenizer (those present are hashed in the manifest).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt")


def tokenizer_files(directory: Path) -> dict[str, str]:
    """``{file name: sha256}`` of the tokenizer files in ``directory`` (:data:`TOKENIZER_FILES` and any
    other ``tokenizer*`` or ``*.tiktoken`` file), sorted by name."""
    directory = Path(directory)
    names = {p.name for p in directory.iterdir() if p.is_file()
             and (p.name in TOKENIZER_FILES or p.name.startswith("tokenizer") or p.name.endswith(".tiktoken"))}
    out = {}
    for name in sorted(names):
        h = hashlib.sha256()
        with (directory / name).open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        out[name] = h.hexdigest()
    return out


class TokenText:
    """The text of token ids under ``tokenizer`` (a transformers tokenizer): :meth:`pieces` gives one
    piece per id (module docstring), each distinct id decoded once and kept.

    ``info`` describes the tokenizer for the manifest: its class and, given ``directory``, the files it
    was read from with their sha256."""

    def __init__(self, tokenizer, directory: Path | None = None):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}
        self.info = {"class": type(tokenizer).__name__,
                     **({"directory": str(directory), "files": tokenizer_files(directory)} if directory else {})}

    def pieces(self, ids: Iterable[int]) -> list[str]:
        """One piece of text per id, in order."""
        ids = [int(i) for i in ids]
        missing = sorted(set(ids) - self.cache.keys())
        if missing:
            self.cache.update(zip(missing, self._decode(missing)))
        return [self.cache[i] for i in ids]

    def __call__(self, ids: Iterable[int]) -> list[str]:
        return self.pieces(ids)

    def _decode(self, ids: Sequence[int]) -> list[str]:
        tok = self.tokenizer
        entries = tok.convert_ids_to_tokens(list(ids))
        out = []
        for i, entry in zip(ids, entries):
            piece = tok.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if _REPLACEMENT in piece and isinstance(entry, str):
                raw = _entry_bytes(entry)
                if raw is not None:
                    piece = render_bytes(raw)
            elif isinstance(entry, str) and entry.startswith("▁") and not piece.startswith(" "):
                piece = " " + piece  # a SentencePiece word start whose lone decode dropped its space
            out.append(piece)
        return out


def _entry_bytes(entry: str) -> bytes | None:
    """The bytes a vocabulary entry stands for: a byte-fallback entry ``<0xNN>``, or a byte-level BPE
    entry (every character one of byte-level BPE's 256); ``None`` for other entries."""
    m = _BYTE_FALLBACK.fullmatch(entry)
    if m:
        return bytes([int(m.group(1), 16)])
    if entry and all(c in _BYTE_LEVEL for c in entry):
        return bytes(_BYTE_LEVEL[c] for c in entry)
    return None
