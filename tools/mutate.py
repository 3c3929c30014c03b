#!/usr/bin/env python
"""Mutation check: plant realistic bugs one at a time and see whether the tests catch them.

    python tools/mutate.py                      # every mutation of tools/mutations.toml, its own tests
    python tools/mutate.py --only ID [ID ...]   # some of them
    python tools/mutate.py --list               # list them (and whether each still applies)
    python tools/mutate.py --full --only ID     # the whole suite instead of the mutation's tests
    python tools/mutate.py --jobs 2             # two mutations at a time

Each mutation (an entry of the list, see ``tools/mutations.toml``) replaces one exact snippet of one
file — optionally more, under ``also`` — in a fresh temporary copy of the repository: the files git
tracks plus the untracked files it does not ignore, as they are in the working tree (uncommitted edits
included). The working tree itself is never written. In the copy it then

1. imports the mutated modules and ``osdn_diag`` (and every package ``[tool.setuptools.package-dir]``
   maps, i.e. ``osdn_diag.proofs``) and checks that each comes from the copy — an import that fails
   is a *trivial* catch, labelled so; a module imported from elsewhere stops the check;
2. runs ``pytest -x`` on the tests the mutation names (or the whole suite with ``--full``).

Result per mutation: ``caught`` (a test failed; the first one is named), ``caught (import)`` or
``caught (collection)`` (the code did not even import: trivial), ``survived`` (every test passed),
``broken`` (the mutation did not apply, or pytest could not run the tests) or ``timeout``. The exit
status is 0 only if every mutation is caught, trivially or not.

Why the copy's code is what runs: the package is installed in editable mode from another checkout, and
``proofs/`` reaches Python as ``osdn_diag.proofs`` only through the editable install's mapping. The
child processes get ``PYTHONPATH=<copy>`` (first), run in the copy, and the copy gets a symbolic link
``osdn_diag/proofs -> ../proofs`` (from pyproject's ``package-dir``), so that the path-based import
finds the copy's ``osdn_diag.proofs`` before the editable install's finder is asked; step 1 checks it.
Children also get ``PYTHONDONTWRITEBYTECODE=1`` (no bytecode cache that could outlive an edit),
``OMP_NUM_THREADS=1`` and ``TRITON_INTERPRET=1`` unless those two are already set.

Before the mutations, a *baseline* runs the union of their tests on an unmutated copy (``--no-baseline``
skips the tests, not the import check of step 1). A test that fails there is deselected from every
mutation's run (and listed), so that it cannot pass off as a catch; an unmutated copy that does not
import its own code, or whose tests cannot run, stops the check (exit status 2).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_LIST = ROOT / "tools" / "mutations.toml"

#: results that count as caught (the last two: the mutated code did not import, labelled as trivial)
CAUGHT = ("caught", "caught (import)", "caught (collection)")
RESULTS = (*CAUGHT, "survived", "broken", "timeout")

_REQUIRED = ("id", "description", "file", "old", "new", "tests")
_OPTIONAL = ("also", "note")
_ID = re.compile(r"[a-z0-9][a-z0-9-]*")


class MutationListError(ValueError):
    """The mutation list cannot be read or an entry is malformed (the message names the file and entry)."""


@dataclass(frozen=True)
class Edit:
    """Replace ``old`` (which must occur exactly once) by ``new`` in ``file`` (relative to the root)."""

    file: str
    old: str
    new: str


@dataclass(frozen=True)
class Mutation:
    """One planted bug: its edits (the first is the entry's own ``file/old/new``) and the tests to run
    (pytest paths or node ids, relative to the root)."""

    id: str
    description: str
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]
    note: str = ""


@dataclass
class Outcome:
    id: str
    result: str
    detail: str
    seconds: float
    log: str = ""


# --- the list -------------------------------------------------------------------------------------


def _edit(raw: object, where: str) -> Edit:
    if not isinstance(raw, dict):
        raise MutationListError(f"{where}: expected a table with file, old and new")
    unknown = set(raw) - {"file", "old", "new"}
    if unknown:
        raise MutationListError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    for key in ("file", "old", "new"):
        if not isinstance(raw.get(key), str):
            raise MutationListError(f"{where}: '{key}' must be a string")
    if not raw["file"] or not raw["old"]:
        raise MutationListError(f"{where}: 'file' and 'old' must not be empty")
    return Edit(raw["file"], raw["old"], raw["new"])


def load_mutations(path: str | os.PathLike = DEFAULT_LIST) -> list[Mutation]:
    """The mutations of a list file (``[[mutation]]`` tables; see ``tools/mutations.toml``).

    Raises :class:`MutationListError` naming the file and the entry for a malformed entry or a
    repeated id. Whether the snippets still apply is :func:`edit_problem`'s business."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise MutationListError(f"{path}: cannot read the mutation list ({err})") from None
    entries = data.get("mutation")
    if not isinstance(entries, list) or not entries:
        raise MutationListError(f"{path}: expected [[mutation]] entries")
    out, seen = [], set()
    for i, raw in enumerate(entries):
        where = f"{path}: mutation #{i + 1}" + (f" ({raw.get('id')!r})" if isinstance(raw, dict) else "")
        missing = [k for k in _REQUIRED if k not in raw]
        if missing:
            raise MutationListError(f"{where}: missing {', '.join(missing)}")
        unknown = set(raw) - set(_REQUIRED) - set(_OPTIONAL)
        if unknown:
            raise MutationListError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
        mid = raw["id"]
        if not isinstance(mid, str) or not _ID.fullmatch(mid):
            raise MutationListError(f"{where}: 'id' must be lower-case letters, digits and dashes")
        if mid in seen:
            raise MutationListError(f"{where}: id {mid!r} is used twice")
        seen.add(mid)
        if not isinstance(raw["description"], str) or not raw["description"].strip():
            raise MutationListError(f"{where}: 'description' must be a non-empty string")
        tests = raw["tests"]
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t for t in tests):
            raise MutationListError(f"{where}: 'tests' must be a non-empty list of pytest paths or node ids")
        also = raw.get("also", [])
        if not isinstance(also, list):
            raise MutationListError(f"{where}: 'also' must be a list of tables")
        edits = [_edit({k: raw[k] for k in ("file", "old", "new")}, where)]
        edits += [_edit(e, f"{where}, also #{j + 1}") for j, e in enumerate(also)]
        note = raw.get("note", "")
        if not isinstance(note, str):
            raise MutationListError(f"{where}: 'note' must be a string")
        out.append(Mutation(mid, raw["description"].strip(), tuple(edits), tuple(tests), note.strip()))
    return out


def edit_problem(root: Path, edit: Edit, text: str | None = None) -> str | None:
    """Why ``edit`` does not apply to the tree at ``root`` (``None``: it does). ``text``: the file's
    content if already read (or edited by an earlier edit of the same mutation)."""
    if edit.new == edit.old:
        return f"{edit.file}: 'new' equals 'old'"
    if text is None:
        path = root / edit.file
        if not path.is_file():
            return f"{edit.file}: no such file"
        text = path.read_text(encoding="utf-8")
    n = text.count(edit.old)
    if n != 1:
        return f"{edit.file}: 'old' occurs {n} times, not once: {edit.old[:60]!r}"
    return None


def mutation_problems(root: Path, mutation: Mutation) -> list[str]:
    """Every reason the mutation does not apply to the tree at ``root`` (edits applied in order, so a
    second edit of the same file sees the first)."""
    texts: dict[str, str] = {}
    problems = []
    for edit in mutation.edits:
        path = root / edit.file
        if edit.file not in texts and path.is_file():
            texts[edit.file] = path.read_text(encoding="utf-8")
        problem = edit_problem(root, edit, texts.get(edit.file))
        if problem:
            problems.append(problem)
        elif edit.file in texts:
            texts[edit.file] = texts[edit.file].replace(edit.old, edit.new, 1)
    return problems


def test_target_problem(root: Path, target: str) -> str | None:
    """Why a pytest target (``path``, ``path::name``, ``path::Class::name[param]``) names nothing in the
    tree at ``root`` (``None``: the path exists and each name is defined in the file)."""
    path, *names = target.split("::")
    file = root / path
    if not file.exists():
        return f"{path}: no such test file or directory"
    if names and not file.is_file():
        return f"{target}: node ids need a file"
    text = file.read_text(encoding="utf-8") if names else ""
    for name in names:
        bare = name.split("[", 1)[0]
        if not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(bare)}\b", text, re.M):
            return f"{target}: {bare!r} is not defined in {path}"
    return None


# --- the copy -------------------------------------------------------------------------------------


def source_files(root: Path) -> list[str]:
    """The files of the working tree a copy needs: tracked, or untracked and not ignored (paths
    relative to ``root``; deleted tracked files left out)."""
    out = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True, capture_output=True,
    ).stdout.decode()
    names = sorted({n for n in out.split("\0") if n})
    return [n for n in names if (root / n).is_file() or (root / n).is_symlink()]


def package_dirs(root: Path) -> dict[str, str]:
    """pyproject's ``[tool.setuptools.package-dir]``: package name → folder (``osdn_diag.proofs`` →
    ``proofs``), the packages an installed distribution maps from elsewhere in the tree."""
    try:
        data = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    except OSError:
        return {}
    mapping = data.get("tool", {}).get("setuptools", {}).get("package-dir", {})
    return {pkg: folder for pkg, folder in mapping.items() if pkg and folder}


def make_copy(root: Path, files: list[str], dest: Path) -> None:
    """Copy ``files`` from ``root`` into ``dest`` and link every mapped package into place, so that a
    path-based import of the copy finds it (``dest/osdn_diag/proofs -> ../proofs``)."""
    for name in files:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target, follow_symlinks=False)
    for pkg, folder in package_dirs(root).items():
        link = dest.joinpath(*pkg.split("."))
        if (dest / folder).is_dir() and not (link.exists() or link.is_symlink()):
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(dest / folder, link.parent), target_is_directory=True)


def apply(dest: Path, mutation: Mutation) -> str | None:
    """Apply the mutation's edits to the copy at ``dest``; the reason it does not apply, or ``None``."""
    for edit in mutation.edits:
        path = dest / edit.file
        text = path.read_text(encoding="utf-8") if path.is_file() else None
        problem = edit_problem(dest, edit, text)
        if problem:
            return problem
        path.write_text(text.replace(edit.old, edit.new, 1), encoding="utf-8")
    return None


def module_of(path: str, mapping: dict[str, str]) -> str | None:
    """The importable module of a repository file (``osdn_diag/math/phase1.py`` → ``osdn_diag.math.phase1``,
    ``proofs/ledger.py`` → ``osdn_diag.proofs.ledger``), or ``None`` for a file outside the package."""
    if not path.endswith(".py"):
        return None
    parts = list(Path(path).with_suffix("").parts)
    for pkg, folder in sorted(mapping.items(), key=lambda kv: -len(Path(kv[1]).parts)):
        fparts = list(Path(folder).parts)
        if parts[: len(fparts)] == fparts:
            parts = pkg.split(".") + parts[len(fparts):]
            break
    if parts[0] != "osdn_diag":
        return None
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def child_env(copy: Path) -> dict[str, str]:
    """The environment of the processes run in the copy: its code first on the path, no bytecode
    cache, one OpenMP thread and Triton's interpreter unless already chosen."""
    env = dict(os.environ)
    keep = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
            if p and Path(p).resolve() != ROOT]
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *keep])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TRITON_INTERPRET", "1")
    return env


# The probe: import each module, report where it came from, or why it did not import.
_PROBE = r"""
import importlib, json, sys, traceback
out = {}
for name in sys.argv[1:]:
    try:
        mod = importlib.import_module(name)
    except BaseException as err:
        last = traceback.format_exception_only(type(err), err)[-1].strip()
        print(json.dumps({"failed": name, "error": last}))
        sys.exit(3)
    out[name] = getattr(mod, "__file__", None)
print(json.dumps({"files": out}))
"""


def _run(cmd: list[str], cwd: Path, env: dict, timeout: float | None) -> tuple[int | None, str]:
    """Run ``cmd``; ``(exit code, stdout + stderr)``, exit code ``None`` on timeout (the whole process
    group is killed: tests start processes of their own)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out.decode(errors="replace")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out.decode(errors="replace")
    except BaseException:  # Ctrl-C: take the tests' processes down too (their own session ignores it)
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def probe(copy: Path, env: dict, modules: list[str], timeout: float | None) -> tuple[str | None, str | None]:
    """Import ``modules`` in the copy. ``(import error, None)`` when one fails to import;
    ``(None, problem)`` when one came from outside the copy; ``(None, None)`` when all is well."""
    # Run from outside the copy: `python -c` puts its working directory first on the path, which would
    # hide a wrong PYTHONPATH from the probe (and not from a test's subprocess started elsewhere).
    rc, out = _run([sys.executable, "-c", _PROBE, *modules], copy.parent, env, timeout)
    if rc is None:
        return None, "importing the mutated modules timed out"
    lines = [line for line in out.splitlines() if line.startswith("{")]
    try:
        report = json.loads(lines[-1])
    except (IndexError, ValueError):
        return None, f"the import probe failed (exit {rc}): {out.strip()[-300:]}"
    if "failed" in report:
        return f"{report['failed']}: {report['error']}", None
    real = copy.resolve()
    for name, file in report["files"].items():
        if file is None or not Path(file).resolve().is_relative_to(real):
            return None, f"{name} was imported from {file}, not from the copy {copy}"
    return None, None


_SUMMARY_LINE = re.compile(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", re.M)


def failing_tests(output: str) -> list[str]:
    """Node ids of pytest's short summary (``-rfE``): failed and erroring tests, in order."""
    return _SUMMARY_LINE.findall(output)


def pytest_command(targets: list[str], *, stop_first: bool, deselect: list[str], extra: list[str],
                   rootdir: Path) -> list[str]:
    # One process (-n 0 overrides the suite's workers): a mutation's few tests stop at the first failure.
    cmd = [sys.executable, "-m", "pytest", *targets, "-q", "-rfE", "-p", "no:cacheprovider", "-n", "0",
           "--rootdir", str(rootdir)]
    if stop_first:
        cmd.append("-x")
    for node in deselect:
        cmd += ["--deselect", node]
    return cmd + extra


_EXCEPTION_LINE = re.compile(r"^E\s+(\w+(?:Error|Exception|Exit)\b.*)$", re.M)


def _first_exception(output: str) -> str:
    """The first ``E   SomeError: ...`` line of pytest's output (else its first ``E`` line)."""
    m = _EXCEPTION_LINE.search(output)
    if m:
        return m.group(1).strip()
    return next((ln[1:].strip() for ln in output.splitlines() if ln.startswith("E ")), "")


def classify(rc: int | None, output: str) -> tuple[str, str]:
    """``(result, detail)`` of a mutation's pytest run."""
    if rc is None:
        return "timeout", "the tests ran past --timeout"
    failed = failing_tests(output)
    if rc == 0:
        return "survived", "every test passed"
    if rc == 1:
        return "caught", failed[0] if failed else "a test failed"
    if rc == 2 and "during collection" in output:
        where = failed[0] if failed else "?"
        return "caught (collection)", f"{where}: {_first_exception(output)}"[:200]
    if rc == 5:
        return "broken", "pytest collected no tests"
    return "broken", f"pytest exit status {rc}"


# --- running --------------------------------------------------------------------------------------


@dataclass
class Settings:
    full: bool = False
    timeout: float | None = 3600.0
    keep: bool = False
    logs: Path | None = None
    deselect: tuple[str, ...] = ()
    pytest_args: tuple[str, ...] = ()


def _copy_for(files: list[str], label: str) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix=f"osdn-mutate-{label}-"))
    make_copy(ROOT, files, tmp / "repo")
    return tmp


def run_mutation(mutation: Mutation, files: list[str], s: Settings) -> Outcome:
    """Apply one mutation in a fresh copy, probe its imports, run its tests; the copy is removed."""
    start = time.perf_counter()
    tmp = _copy_for(files, mutation.id)
    copy = tmp / "repo"
    log = ""
    try:
        problem = apply(copy, mutation)
        if problem:
            return Outcome(mutation.id, "broken", f"does not apply: {problem}", time.perf_counter() - start)
        env = child_env(copy)
        mapping = package_dirs(copy)
        modules = ["osdn_diag", *sorted(mapping)]
        modules += [m for e in mutation.edits if (m := module_of(e.file, mapping)) and m not in modules]
        import_error, problem = probe(copy, env, modules, s.timeout)
        if import_error:
            return Outcome(mutation.id, "caught (import)", import_error[:200], time.perf_counter() - start)
        if problem:
            return Outcome(mutation.id, "broken", problem, time.perf_counter() - start)
        targets = [] if s.full else list(mutation.tests)
        cmd = pytest_command(targets, stop_first=True, deselect=list(s.deselect), extra=list(s.pytest_args),
                             rootdir=copy)
        rc, log = _run(cmd, copy, env, s.timeout)
        result, detail = classify(rc, log)
        return Outcome(mutation.id, result, detail, time.perf_counter() - start, log)
    finally:
        if s.logs is not None and log:
            s.logs.mkdir(parents=True, exist_ok=True)
            (s.logs / f"{mutation.id}.log").write_text(log, encoding="utf-8")
        if s.keep:
            print(f"  (kept {copy})", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def union_targets(mutations: list[Mutation]) -> list[str]:
    """Every test target of ``mutations`` once, in first-seen order, leaving out those inside a
    directory or file that is itself a target (pytest would run them twice)."""
    seen: list[str] = []
    for m in mutations:
        for t in m.tests:
            if t not in seen:
                seen.append(t)

    def covered(t: str) -> bool:
        path = Path(t.split("::")[0])
        for other in seen:
            if other == t or "::" in other:
                continue
            o = Path(other)
            if ("::" in t and path == o) or (path != o and path.is_relative_to(o)):
                return True
        return False

    return [t for t in seen if not covered(t)]


def run_baseline(mutations: list[Mutation], files: list[str], s: Settings, *,
                 tests: bool = True) -> tuple[list[str], float]:
    """An unmutated copy: check that its code is what gets imported, then (``tests``) run the
    mutations' tests there. Returns ``(failing node ids, seconds)``; exits (status 2) when the copy's
    code is not what gets imported or pytest cannot run the tests."""
    start = time.perf_counter()
    tmp = _copy_for(files, "baseline")
    copy = tmp / "repo"
    try:
        env = child_env(copy)
        import_error, problem = probe(copy, env, ["osdn_diag", *sorted(package_dirs(copy))], s.timeout)
        if import_error or problem:
            sys.exit(f"unmutated copy: {import_error or problem}")
        if not tests:
            return [], time.perf_counter() - start
        targets = [] if s.full else union_targets(mutations)
        cmd = pytest_command(targets, stop_first=False, deselect=[], extra=list(s.pytest_args), rootdir=copy)
        rc, out = _run(cmd, copy, env, s.timeout)
        if s.logs is not None:
            s.logs.mkdir(parents=True, exist_ok=True)
            (s.logs / "baseline.log").write_text(out, encoding="utf-8")
        if rc not in (0, 1):
            tail = "\n".join(out.strip().splitlines()[-15:])
            sys.exit(f"baseline: the unmutated tests do not run (pytest exit status {rc}):\n{tail}")
        return failing_tests(out), time.perf_counter() - start
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def format_table(outcomes: list[Outcome]) -> str:
    width = max([len("mutation")] + [len(o.id) for o in outcomes])
    rw = max(len(r) for r in RESULTS)
    lines = [f"{'mutation':<{width}}  {'result':<{rw}}  {'time':>7}  first failing test / why",
             f"{'-' * width}  {'-' * rw}  {'-' * 7}  {'-' * 40}"]
    lines += [f"{o.id:<{width}}  {o.result:<{rw}}  {o.seconds:6.1f}s  {o.detail}" for o in outcomes]
    counts = {r: sum(o.result == r for o in outcomes) for r in RESULTS}
    caught = sum(counts[r] for r in CAUGHT)
    trivial = counts["caught (import)"] + counts["caught (collection)"]
    lines.append(
        f"{caught} of {len(outcomes)} caught ({trivial} trivially: the mutated code does not import), "
        f"{counts['survived']} survived, {counts['broken']} broken, {counts['timeout']} timed out"
    )
    return "\n".join(lines)


def list_mutations(mutations: list[Mutation]) -> int:
    bad = 0
    for m in mutations:
        problems = mutation_problems(ROOT, m) + [p for t in m.tests if (p := test_target_problem(ROOT, t))]
        bad += bool(problems)
        files = ", ".join(dict.fromkeys(e.file for e in m.edits))
        print(f"{m.id}  [{files}]\n    {m.description}\n    tests: {' '.join(m.tests)}")
        if m.note:
            print(f"    note: {m.note}")
        for p in problems:
            print(f"    DOES NOT APPLY: {p}")
    print(f"{len(mutations)} mutations" + (f", {bad} that do not apply" if bad else ""))
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", metavar="ID", help="run only these mutations")
    ap.add_argument("--list", action="store_true", help="list the mutations and check that they apply")
    ap.add_argument("--jobs", type=int, default=1, help="mutations run at a time (default 1)")
    ap.add_argument("--full", action="store_true", help="run the whole suite for each mutation")
    ap.add_argument("--mutations", type=Path, default=DEFAULT_LIST,
                    help="the mutation list (default tools/mutations.toml)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the baseline tests (the unmutated copy's import check still runs)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per mutation (default 3600)")
    ap.add_argument("--logs", type=Path, help="write each mutation's pytest output to DIR/ID.log")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copies (for debugging)")
    ap.add_argument("--pytest-args", default="", help="extra pytest arguments, one string")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error("argument --jobs: expected a number >= 1")
    try:
        mutations = load_mutations(args.mutations)
    except MutationListError as err:
        print(err, file=sys.stderr)
        return 2
    if args.only:
        known = {m.id for m in mutations}
        unknown = [i for i in args.only if i not in known]
        if unknown:
            print(f"--only: no mutation {', '.join(map(repr, unknown))} in {args.mutations}", file=sys.stderr)
            return 2
        mutations = [m for m in mutations if m.id in set(args.only)]
    if args.list:
        return list_mutations(mutations)

    settings = Settings(full=args.full, timeout=args.timeout, keep=args.keep, logs=args.logs,
                        pytest_args=tuple(args.pytest_args.split()))
    files = source_files(ROOT)
    if args.no_baseline:
        # Still check, once, that an unmutated copy imports its own code: otherwise a module missing
        # from the copy would pass off as a mutation caught at import.
        run_baseline(mutations, files, settings, tests=False)
    else:
        print("baseline: the tests on an unmutated copy ...", file=sys.stderr, flush=True)
        failing, seconds = run_baseline(mutations, files, settings)
        print(f"baseline: {seconds:.1f}s, {len(failing)} failing test(s)"
              + "".join(f"\n  deselected (fails unmutated): {t}" for t in failing), file=sys.stderr, flush=True)
        settings.deselect = tuple(failing)

    outcomes: dict[str, Outcome] = {}
    lock = threading.Lock()

    def one(m: Mutation) -> Outcome:
        o = run_mutation(m, files, settings)
        with lock:
            outcomes[m.id] = o
            print(f"[{len(outcomes)}/{len(mutations)}] {m.id}: {o.result} ({o.seconds:.1f}s) {o.detail}",
                  file=sys.stderr, flush=True)
            if o.result in ("broken", "timeout") and o.log and settings.logs is None:
                print("\n".join("    " + ln for ln in o.log.strip().splitlines()[-12:]), file=sys.stderr)
        return o

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(one, mutations))
    ordered = [outcomes[m.id] for m in mutations]
    print(format_table(ordered))
    return 0 if all(o.result in CAUGHT for o in ordered) else 1


if __name__ == "__main__":
    sys.exit(main())
