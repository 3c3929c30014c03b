"""The command line's argument checks, run before anything heavy is imported or written.

Loading fla (and, on a CPU, Triton's interpreter) takes seconds, and a run directory is created
before the model loads; an argument that cannot work should fail in well under a second, naming the
argument or file and what to do, and leave nothing behind. Every check raises :class:`UsageError`
(a ``ValueError``), which the console script prints as one line with exit status 2. These checks
read files (JSON, safetensors headers) but import neither torch's CUDA runtime nor fla.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

from ..runtime.usage import UsageError, check_suite_size, what_if_settings_error

__all__ = ["UsageError", "check_args", "check_suite_size", "parse_d_head", "check_safetensors", "check_writable_dir",
           "check_writable_file"]

#: The built-in suites (osdn_diag.prompts.SUITES, named here without importing torch).
BUILTIN_SUITES = ("random", "mqar", "mqar-pair", "lm-heldout", "lm-heldout-pair")
#: The shortest --length each built-in suite can honour (mqar: one key-value pair and its query is
#: four tokens; lm-heldout: a token and the next one it is scored on; random --twice: a context of one
#: token, repeated).
MIN_LENGTH = {"mqar": 4, "mqar-pair": 4, "lm-heldout": 2, "lm-heldout-pair": 2}
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def _nearest_existing(path: Path) -> Path:
    for parent in (path, *path.parents):
        if parent.exists():
            return parent
    return Path(".")


def check_writable_dir(path: str | os.PathLike, what: str) -> None:
    """``path`` is, or can be created as, a directory that this process can write into."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{what} {str(path)!r}: is a file, not a directory; give a directory path")
    base = _nearest_existing(path)
    if not base.is_dir():
        raise UsageError(f"{what} {str(path)!r}: {str(base)!r} is a file, so no directory can be made "
                         "under it; give another path")
    if not os.access(base, os.W_OK | os.X_OK):
        raise UsageError(f"{what} {str(path)!r}: {str(base)!r} is not writable; give a directory you can "
                         "write to")
    # os.access answers yes to root everywhere, /proc and /sys included, and nothing about a read-only
    # mount: make (and at once remove) a directory where the command will make its own.
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".osdn-diag-probe-", dir=base))
    except OSError as err:
        raise UsageError(f"{what} {str(path)!r}: no directory can be made in {str(base)!r} "
                         f"({err.strerror or err}); give a directory you can write to") from None


def check_writable_file(path: str | os.PathLike, what: str) -> None:
    """``path`` names a file that can be written: not a directory, nor a FIFO, device or socket (or a link
    to one), in an existing, writable directory."""
    from ..runtime.atomic import NotAFileError, refuse_special

    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{what} {str(path)!r}: is a directory; give a file name")
    try:  # /dev/null, /dev/stdout, a FIFO: the file is renamed into place, which would replace it
        refuse_special(path)
    except NotAFileError:
        raise UsageError(f"{what} {str(path)!r}: not a regular file (a FIFO, a device, a socket or a link to "
                         "one), which osdn-diag would replace with its file; give the path of a file") from None
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{what} {str(path)!r}: the directory {str(parent)!r} does not exist; create it "
                         "or give another path")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{what} {str(path)!r}: not writable; give a path you can write to")


def check_output_file(path: str | os.PathLike, what: str) -> None:
    """A file a command writes on its own (``view``'s page, ``prove``'s ledger, ``warmup``'s tuning
    table): not a symbolic link
    (never written through nor replaced), a file that can be written (:func:`check_writable_file`), and
    none of a run's own files nor among them (:func:`~osdn_diag.rundir.check_file_placement`)."""
    from ..rundir import RunDirectoryError, check_file_placement

    if os.path.islink(path):
        raise UsageError(f"{what} {str(path)!r}: a symbolic link; osdn-diag never writes through a link nor "
                         "replaces one: remove it or give another path")
    check_writable_file(path, what)
    try:
        check_file_placement(path, what)
    except RunDirectoryError as err:
        raise UsageError(str(err)) from None


def check_safetensors(path: Path, what: str) -> None:
    """``path`` is a complete safetensors file: an 8-byte header length, a JSON header, and every
    tensor's bytes inside the file (a truncated download or copy fails here, not deep in a loader)."""
    size = path.stat().st_size
    try:
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ValueError("shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ValueError(f"header of {n} bytes in a file of {size}")
            header = json.loads(fh.read(n))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as err:
        raise UsageError(f"{what}: {path} is not a readable safetensors file ({err}); replace it with a "
                         "complete copy") from None
    if 8 + n + end > size:
        raise UsageError(f"{what}: {path} is truncated ({size:,} bytes, its header promises "
                         f"{8 + n + end:,}); replace it with a complete copy")


def _read_json(path: Path, what: str):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(f"{what}: {path} is not valid JSON ({err}); repair or replace it") from None
    except RecursionError:
        raise UsageError(f"{what}: {path} is JSON nested too deeply to read; repair or replace it") from None


def _check_model(spec: str) -> None:
    if spec.startswith("random:"):
        from ..catalog import PRESETS

        if spec.removeprefix("random:") not in PRESETS:
            raise UsageError(f"MODEL {spec!r}: unknown preset {spec.removeprefix('random:')!r}; available: "
                             + ", ".join(f"random:{p}" for p in PRESETS))
        return
    if spec.startswith("builtin:"):
        from ..catalog import builtin_path

        directory = builtin_path(spec.removeprefix("builtin:"))
    else:
        from ..catalog import is_hub_id

        if is_hub_id(spec):
            return  # resolved when the model loads (the cache, or the Hub)
        directory = Path(spec)
        if not directory.is_dir():
            raise UsageError(f"MODEL {spec!r}: no such directory; give a Hugging Face model directory, "
                             "a Hub id ORG/NAME[@REVISION], builtin:NAME or random:PRESET")
    # What the directory's files alone tell, before torch is imported (the loader checks it all again).
    from ..runtime.config_checks import check_config, check_model_files, refuse_auto_map

    try:
        check_model_files(spec, directory)
        config = directory / "config.json"
        data = _read_json(config, f"MODEL {spec!r}")
        check_config(spec, data, config)
        refuse_auto_map(spec, config, data)
        tokenizer = directory / "tokenizer_config.json"
        if tokenizer.is_file():
            refuse_auto_map(spec, tokenizer, _read_json(tokenizer, f"MODEL {spec!r}"))
    except (ValueError, FileNotFoundError) as err:
        raise UsageError(str(err)) from None
    for weights in sorted(directory.glob("*.safetensors")):
        check_safetensors(weights, f"MODEL {spec!r}")


def _positive(name: str, value, minimum: int = 1) -> None:
    if value is not None and value < minimum:
        raise UsageError(f"argument {name}: expected an integer >= {minimum}, got {value}")


def parse_d_head(text: str) -> tuple[int, int]:
    """``--d-head LAYER.HEAD`` as ``(layer, head)``: two whole numbers in ASCII digits (``int()`` alone
    would also take " 3", "+3", "3_0" or other scripts' digits)."""
    if not re.fullmatch(r"[0-9]+\.[0-9]+", text):
        raise UsageError(f"argument --d-head: expected LAYER.HEAD (e.g. 3.1), got {text!r}")
    layer, head = (int(x) for x in text.split("."))
    if layer < 0 or head < 0:
        raise UsageError(f"argument --d-head: expected LAYER.HEAD of numbers >= 0, got {text!r}")
    return layer, head


def parse_strip_prompts(text: str) -> list[int]:
    """``--strip-prompts ID,ID,...`` as a list of prompt ids (ASCII digits, at least one)."""
    if not re.fullmatch(r"[0-9]+(,[0-9]+)*", text):
        raise UsageError(f"argument --strip-prompts: expected prompt ids separated by commas (e.g. 0,3,7), "
                         f"got {text!r}")
    return [int(x) for x in text.split(",")]


def _check_placement(out: str) -> None:
    from ..rundir import RunDirectoryError, check_placement

    try:
        check_placement(out)
    except RunDirectoryError as err:
        raise UsageError(str(err)) from None


def _check_existing_run(out: str, overwrite: bool) -> None:
    """Refuse, from its files alone, an ``--out`` that the run would refuse only after loading the model
    (seconds): a directory holding a run without ``--overwrite``, or a run's files and no manifest,
    but not an unfinished run of several processes (refused later, saying how to resume it). One
    process only: under torchrun an unfinished run of the same command is resumed, which only the
    loaded inputs can decide (the run checks again in any case, holding the directory's lock)."""
    if os.environ.get("WORLD_SIZE", "1") != "1":
        return
    from ..rundir import check_output, run_manifest

    held = run_manifest(out)
    if held is not None and not held.get("complete") and held.get("world_size", 1) != 1:
        return  # an unfinished run of several processes: the run says how to resume it
    check_output(out, overwrite=overwrite)  # a RunDirectoryError: exit 2, one line


#: The positional arguments' names as the usage line gives them (the others: --dest-with-dashes).
_POSITIONAL = {"model": "MODEL", "dir": "DIR", "runs": "RUN", "dirs": "DIR"}


def _check_utf8(args) -> None:
    """Every argument is text that UTF-8 can encode. A file name in another encoding (bytes such as
    0xff) reaches Python as lone surrogates, which pyarrow and safetensors cannot take as a path and the
    result tables cannot store (a prompt file's name is its default task name): the command would fail
    after the capture, so such an argument is refused here, naming it."""
    for dest, value in vars(args).items():
        for text in value if isinstance(value, list) else [value]:
            if not isinstance(text, str):
                continue
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                name = _POSITIONAL.get(dest) or f"argument --{dest.replace('_', '-')}"
                raise UsageError(f"{name} {text!r}: not valid UTF-8 (a name in another encoding); osdn-diag "
                                 "keeps paths and labels as UTF-8 text: rename it or give another name") from None


#: Arguments that name a file or directory: empty, each would mean the working directory (an unset
#: shell variable, ``--out "$OUT"``, writes a whole run there) or nothing at all.
_PATHS = ("out", "dir", "runs", "dirs", "model", "prompts", "save_tuning")


def _check_empty_paths(args) -> None:
    for dest in _PATHS:
        value = getattr(args, dest, None)
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str) and not text.strip():
                name = _POSITIONAL.get(dest) or f"argument --{dest.replace('_', '-')}"
                raise UsageError(f"{name}: an empty path{' (an unset shell variable?)' if not text else ''}; "
                                 "give a file or directory by name (. for the working directory)")


def check_args(args) -> None:
    """Check ``args`` (parsed) before the command imports fla or writes anything."""
    cmd = args.command
    _check_utf8(args)
    _check_empty_paths(args)
    device = getattr(args, "device", None)
    if device is not None:
        if not _DEVICE.match(device):
            raise UsageError(f"argument --device: expected cpu, cuda or cuda:N, got {device!r}")
        if device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise UsageError(f"argument --device: {device!r} asked for, but torch sees no CUDA GPU here; "
                                 "use --device cpu")
            index = int(device.partition(":")[2] or 0)
            if index >= torch.cuda.device_count():
                raise UsageError(f"argument --device: {device!r}, but there are {torch.cuda.device_count()} "
                                 "GPUs (numbered from 0)")
    tolerance = getattr(args, "tolerance", None)
    if tolerance is not None and not (tolerance > 0):  # NaN fails this too
        raise UsageError(f"argument --tolerance: expected a number > 0, got {tolerance}")
    if cmd == "prove" and args.json:
        check_output_file(args.json, "argument --json")
    if cmd == "warmup":
        _positive("--batch-size", args.batch_size)
        _positive("--length", args.length)
        check_suite_size(args.batch_size, args.length)
        _check_model(args.model)
        if args.save_tuning is not None:
            from ..runtime.tuning import check_table_file

            # As every file a command writes on its own: not a link, a FIFO or a device, nor a run's file.
            check_output_file(args.save_tuning, "argument --save-tuning")
            check_table_file(args.save_tuning)  # its GPU is checked once CUDA is up (cli._cmd_warmup)
    if cmd in ("run", "capture"):
        _positive("--num-prompts", args.num_prompts)
        _positive("--batch-size", args.batch_size)
        if args.generate < 0:
            raise UsageError(f"argument --generate: expected a number of tokens >= 0, got {args.generate}")
        if args.generate and args.batch_size != 1:
            raise UsageError(f"argument --generate: decoding is captured one prompt at a time; drop "
                             f"--batch-size {args.batch_size} (it must be 1)")
        minimum = MIN_LENGTH.get(args.prompts, 2 if args.twice else 1)
        _positive("--length", args.length, minimum)
        check_suite_size(args.num_prompts, args.length)
        if args.prompts not in BUILTIN_SUITES:
            path = Path(args.prompts)
            if not path.is_file():
                raise UsageError(f"argument --prompts: {args.prompts!r} is neither a built-in suite "
                                 f"({', '.join(BUILTIN_SUITES)}) nor an existing JSONL file")
        check_writable_dir(args.out, "argument --out")
        _check_placement(args.out)
        _check_model(args.model)
        _check_existing_run(args.out, args.overwrite)
    if cmd == "demo":
        if args.out is None:
            args.out = "osdn-demo-lm" if args.lm else "osdn-demo"
        if args.num_prompts is not None:
            _positive("--num-prompts", args.num_prompts)
        if args.length is not None:
            if not args.lm:
                raise UsageError("argument --length: the MQAR demo asks its models at the shape they were "
                                 "trained on; --length applies to the language-model demo (--lm) only")
            _positive("--length", args.length, 2)
            check_suite_size(args.num_prompts or 1, args.length)
        check_writable_dir(args.out, "argument --out")
    if cmd in ("replay", "what-if"):
        directory = Path(args.dir)
        if not directory.is_dir():
            raise UsageError(f"DIR {args.dir!r}: no such directory; give a run directory")
        manifest = directory / "manifest.json"
        if manifest.is_file():
            _read_json(manifest, f"DIR {args.dir!r}")
        if cmd == "what-if":
            error = what_if_settings_error(args.eta, args.d_min, args.d_max, args.retention,
                                           name=lambda n: n.replace("_", "-"), arg=lambda n: f"--{n}")
            if error:
                raise UsageError(error)
            if args.out:
                check_writable_dir(args.out, "argument --out")
        else:
            check_writable_dir(directory, "DIR")
    if cmd == "report":
        for run in args.runs:
            if not Path(run).is_dir():
                raise UsageError(f"RUN {run!r}: no such directory; give a run directory")
        if len(args.runs) > 1 and not args.out:
            raise UsageError(f"argument --out: required when comparing {len(args.runs)} runs (the comparison "
                             "report is a directory of its own); give --out DIR")
        if args.labels is not None and len(args.labels) != len(args.runs):
            raise UsageError(f"argument --labels: one label per run: {len(args.runs)} run(s), "
                             f"{len(args.labels)} label(s) given")
        if args.out:
            check_writable_dir(args.out, "argument --out")
        if args.d_head:
            parse_d_head(args.d_head)
    if cmd == "view":
        _check_view(args)


def _check_view(args) -> None:
    """``view``: the runs exist, the labels match, the strip options parse, plotly is there, and the
    page's file can be written (not a directory, not a symbolic link)."""
    for run in args.runs:
        if not Path(run).is_dir():
            raise UsageError(f"RUN {run!r}: no such directory; give a run directory")
    if len(args.runs) > 1 and not args.out:
        raise UsageError(f"argument --out: required for a view of {len(args.runs)} runs; give --out FILE.html")
    if args.labels is not None and len(args.labels) != len(args.runs):
        raise UsageError(f"argument --labels: one label per run: {len(args.runs)} run(s), "
                         f"{len(args.labels)} label(s) given")
    if args.strips is not None and args.strips < 0:
        raise UsageError(f"argument --strips: expected a number of prompts >= 0, got {args.strips}")
    if args.strips is not None and args.strip_prompts:
        raise UsageError("argument --strip-prompts: give either --strips N or --strip-prompts, not both")
    if args.strip_prompts:
        parse_strip_prompts(args.strip_prompts)
    out = Path(args.out) if args.out else Path(args.runs[0]) / "view.html"
    check_output_file(out, "argument --out" if args.out else "the view's file")
    import importlib.util

    if importlib.util.find_spec("plotly") is None:
        raise UsageError("osdn-diag view needs plotly, which is not installed: pip install 'osdn-diag[view]' "
                         "(or pip install plotly)")
