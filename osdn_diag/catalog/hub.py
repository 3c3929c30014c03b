"""A MODEL given as a Hugging Face Hub id: ``ORG/NAME`` or ``ORG/NAME@REVISION``.

The id is resolved to a local snapshot with ``huggingface_hub`` — in the user's own cache
(``HF_HOME`` / ``HF_HUB_CACHE``), offline when ``HF_HUB_OFFLINE=1`` — fetching only what loading
reads: ``*.json`` (config, tokenizer, the safetensors index), ``*.safetensors`` and the tokenizer's
vocabulary files. Pickled weights (``*.bin``, ``*.pt``) and code (``*.py``) are never fetched, so
nothing from the repository can run; the directory is then loaded exactly as a local one is
(:func:`osdn_diag.models.load_model`), with its checks. The commit that was resolved is recorded
(:class:`HubSource`), so a run says which weights it measured.

A path that exists on disk is always a directory, never an id: ``runs/x`` is looked for as a
folder first.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["ALLOW_PATTERNS", "HubSource", "is_hub_id", "resolve"]

#: What a snapshot fetches: what loading a model and its tokenizer reads, and nothing executable.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "vocab.txt", "merges.txt"]

# ORG/NAME[@REVISION]: the Hub's naming (letters, digits, "-", "_", "."), one slash; a revision is a
# branch, tag or commit (branches may hold slashes).
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")


@dataclass(frozen=True)
class HubSource:
    """Where a Hub model came from: ``repo_id``, the ``revision`` asked for (``None``: the default
    branch), the ``commit`` it resolved to, and the local ``snapshot`` directory."""

    repo_id: str
    revision: str | None
    commit: str
    snapshot: str

    def as_dict(self) -> dict:
        return asdict(self)


def is_hub_id(spec: str) -> bool:
    """Whether ``spec`` reads as a Hub id and names no existing path."""
    return _HUB_ID.match(spec) is not None and not Path(spec).exists()


_COMMIT = re.compile(r"[0-9a-f]{40}")


def _check_revision(spec: str, revision: str | None) -> None:
    """A revision is a ref name or a commit: no ``..`` or empty path segment, no leading or trailing
    slash. ``@../../x`` was joined to the cache's paths and resolved to any directory on the disk."""
    if revision is None:
        return
    parts = revision.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"MODEL {spec!r}: revision {revision!r} is not a branch, tag or commit name "
                         "(no '.', '..' or empty path segments); give ORG/NAME@BRANCH, @TAG or @COMMIT")


def _check_snapshot(spec: str, snapshot: Path) -> None:
    """What the Hub client resolved is a snapshot of the cache: ``.../snapshots/<40-hex commit>``, as
    recorded in the manifest (a commit, not a path that happens to exist)."""
    if not (_COMMIT.fullmatch(snapshot.name) and snapshot.parent.name == "snapshots"):
        raise ValueError(f"MODEL {spec!r}: resolved to {snapshot}, which is not a snapshot of the Hub cache "
                         "(snapshots/<commit>); give a branch, tag or commit of the repository")


def resolve(spec: str) -> tuple[Path, HubSource]:
    """The local snapshot directory of Hub id ``spec`` and where it came from.

    Raises ``FileNotFoundError`` naming the id and what to do when it cannot be resolved: unknown
    repository or revision, or (offline) not in the cache.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    match = _HUB_ID.match(spec)
    if match is None:
        raise ValueError(f"MODEL {spec!r}: not a Hub id (expected ORG/NAME or ORG/NAME@REVISION)")
    repo, revision = match["repo"], match["revision"]
    _check_revision(spec, revision)
    try:
        snapshot = Path(snapshot_download(repo, revision=revision, allow_patterns=ALLOW_PATTERNS))
    except GatedRepoError as err:
        raise FileNotFoundError(f"MODEL {spec!r}: the Hub repository is gated; accept its terms on the Hub "
                                "and log in (`hf auth login`), then run again") from err
    except RepositoryNotFoundError as err:
        raise FileNotFoundError(f"MODEL {spec!r}: no such directory, and no Hub repository {repo!r} (or it is "
                                "private: log in with `hf auth login`)") from err
    except RevisionNotFoundError as err:
        raise FileNotFoundError(f"MODEL {spec!r}: the Hub repository {repo!r} has no revision {revision!r}") from err
    except LocalEntryNotFoundError as err:
        raise FileNotFoundError(
            f"MODEL {spec!r}: no such directory, and the Hub model is not in the local cache while the Hub "
            "cannot be reached (HF_HUB_OFFLINE=1, or no network); download it once online, or give a "
            "local directory") from err
    _check_snapshot(spec, snapshot)
    # A snapshot folder is named by the commit it holds.
    return snapshot, HubSource(repo_id=repo, revision=revision, commit=snapshot.name, snapshot=str(snapshot))
