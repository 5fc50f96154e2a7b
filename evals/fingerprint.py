"""What code made a run: a hash of the source of the method's classes, of the library on the decode
path, of the prompts each item is asked with, and of the files its method reads (a calibration,
learned weights), and the git state (commit, whether the tree was dirty, a hash of the uncommitted
diff); and the content hash of a local model checkpoint (`checkpoint_fingerprint`), part of a run's
identity and of the record of the model a method's file was made for.

A run's identity covers its config, not its code (a fix must not orphan every run), so a run
resumed after its method or the library changed would mix outputs of two programs and print the
old numbers as if they were the new code's. Each start of a run records its `code_record` in
provenance.json; a start whose source hash differs from the last one's is refused
(`check_code`) unless the config says `overwrite=true` (start the run again) or
`allow_code_change=true` (resume it knowingly).

The grader is recorded apart (`grader_record`, in each run's grader.json): grading is deterministic
and cheap, so a run resumed under another grader has its stored outputs graded again rather than
being refused, and every grade of a run comes from the one grader its grader.json names.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import subprocess
import sysconfig
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any

from longflow.errors import UserError

REPO = Path(__file__).resolve().parents[1]
# The library: every module of it can change a decoded token (engine, kernels, cache, models, sampling).
LIBRARY = "longflow"
# Outside the library, the code that writes each item's prompt decides the tokens as much: an edited
# instruction changes every prompt, while the run's identity records only the prompt format.
PROMPTS = "evals/prompts.py"
# The grader: every module of it takes part in a verdict (the rules, answer extraction, the per-item
# time limit), and so do the packages its comparisons call.
GRADER = "evals/grading"
GRADER_PACKAGES = ("math-verify", "sympy")


def policy_sources(policy: Any) -> list[Path]:
    """The source files of the policy's classes (its class and bases, and those of policies held in
    its fields, such as AMS's scorer) outside the library, which `generation_sources` covers, and
    outside Python's and the installed packages' own."""
    installed = [Path(sysconfig.get_paths()[key]).resolve() for key in ("stdlib", "purelib", "platlib")]
    excluded = [(REPO / LIBRARY).resolve(), *installed]
    files: set[Path] = set()
    pending = [policy]
    while pending:
        value = pending.pop()
        for cls in type(value).__mro__:
            try:
                files.add(Path(inspect.getsourcefile(cls)).resolve())
            except TypeError:  # a built-in class: no source file
                continue
        pending += [field for field in vars(value).values() if dataclasses.is_dataclass(field)
                    and not isinstance(field, type)]
    return sorted(path for path in files if not any(folder in path.parents for folder in excluded))


def policy_files(policy: Any) -> list[Path]:
    """The files the policy's fields name (a calibration, learned weights): a run made with other
    contents under the same path is another run's continuation as much as one made by other code."""
    return sorted(set(policy_file_fields(policy).values()))


def policy_file_fields(policy: Any) -> dict[str, Path]:
    """`{field: the file it names}` for each of the policy's fields that names an existing file
    (from the working directory, else from the repository)."""
    files = {}
    for name, value in vars(policy).items():
        if isinstance(value, str) and value:
            for path in (Path(value), REPO / value):
                if path.is_file():
                    files[name] = path.resolve()
                    break
    return files


def generation_sources() -> list[Path]:
    """The sources that decide a run's tokens whatever its method: the library's, and the prompts'."""
    return [*sorted((REPO / LIBRARY).rglob("*.py")), REPO / PROMPTS]


def source_hashes(files: list[Path]) -> dict[str, str]:
    """`{path relative to the repository (or absolute outside it): sha256 of its bytes, 16 hex}`."""
    hashes = {}
    for path in files:
        try:
            name = str(path.relative_to(REPO))
        except ValueError:
            name = str(path)
        hashes[name] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return hashes


def git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


# Untracked files count as changes only inside what a run imports or reads: a notebook or a folder of
# wheels beside the checkout changes nothing a run computes, and would mark every run dirty.
CODE_PATHS = ("longflow", "baselines", "evals", "conf", "pyproject.toml")


def uncommitted_changes() -> str | None:
    """`git status --porcelain` lines of the tracked changes anywhere and the untracked files under
    CODE_PATHS; "" for a clean tree, None outside git."""
    tracked = git("status", "--porcelain", "--untracked-files=no")
    untracked = git("status", "--porcelain", "--untracked-files=all", "--", *CODE_PATHS)
    if tracked is None or untracked is None:
        return None
    lines = tracked.splitlines() + [line for line in untracked.splitlines() if line.startswith("??")]
    return "\n".join(lines)


def code_record(policy: Any) -> dict[str, Any]:
    """The code of a run start: `fingerprint` (one hash of `files`), `files` (each source's hash),
    `git_commit`, `dirty` (uncommitted changes; None outside git) and `diff` (hash of `git diff HEAD`)."""
    files = source_hashes([*policy_sources(policy), *generation_sources(), *policy_files(policy)])
    status = uncommitted_changes()
    diff = git("diff", "HEAD") if status else None
    commit = git("rev-parse", "HEAD")
    return {
        "fingerprint": hashlib.sha256(repr(sorted(files.items())).encode()).hexdigest()[:16],
        "files": files,
        "git_commit": commit or None,
        "dirty": bool(status) if status is not None else None,
        "diff": hashlib.sha256(diff.encode()).hexdigest()[:16] if diff else None,
    }


def grader_record() -> dict[str, Any]:
    """The grader of this process: `fingerprint` (one hash of the rest), `files` (each source's hash)
    and `packages` (each package's version, None when it is not installed)."""
    files = source_hashes(sorted((REPO / GRADER).rglob("*.py")))
    packages = {}
    for name in GRADER_PACKAGES:
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            packages[name] = None
    return {"fingerprint": hashlib.sha256(repr([sorted(files.items()), sorted(packages.items())]).encode())
            .hexdigest()[:16], "files": files, "packages": packages}


def grader_changes(before: dict[str, Any] | None, now: dict[str, Any]) -> str:
    """What differs between the grader that made a run's grades (its grader.json; None for a run made
    before grader records) and `now`, in words."""
    if not isinstance(before, dict) or "files" not in before:
        return "graded before runs recorded their grader"
    changed = changed_files(before, now)
    old = before.get("packages", {})
    changed += [f"{name} {old.get(name)} -> {version}" for name, version in now["packages"].items()
                if old.get(name) != version]
    return ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "") + " changed since"


def last_code(provenance: list[dict]) -> dict[str, Any] | None:
    """The code record of the last start that has one (runs made before fingerprints have none)."""
    for entry in reversed(provenance):
        if isinstance(entry, dict) and isinstance(entry.get("code"), dict):
            return entry["code"]
    return None


def changed_files(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    old, new = before.get("files", {}), now["files"]
    return sorted(name for name in set(old) | set(new) if old.get(name) != new.get(name))


class CodeChanged(UserError):
    """A run resumed by other code than the code that made it (`check_code`)."""

    def __init__(self, run: Path, changes: str):
        self.run, self.changes = run, changes
        super().__init__(f"{run} was made by other code ({changes}); overwrite=true starts it again, "
                         "allow_code_change=true resumes it knowingly")


def check_code(run: Path, provenance: list[dict], now: dict[str, Any], allow_change: bool) -> None:
    """CodeChanged when the run at `run` was made by other code than `now`, unless `allow_change`."""
    before = last_code(provenance)
    if allow_change or before is None or before.get("fingerprint") == now["fingerprint"]:
        return
    changed = changed_files(before, now)
    shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
    raise CodeChanged(run, f"{shown} changed since")


_FINGERPRINTS: dict[tuple, str] = {}  # (name, size, mtime) of a folder's files -> their content hash


def checkpoint_fingerprint(hub_id: str) -> str | None:
    """Content hash of a local checkpoint folder's weights, config and tokenizer, or None for a hub id.

    A local folder has no revision: without this, retraining the model in place (the canary) would
    resume the old model's runs. Files are read in blocks and each folder state is hashed once per
    process: an 8B checkpoint is 16 GB.
    """
    # Imported here: this module stays free of torch, which longflow.models loads.
    from longflow.models import checkpoint_location

    folder = Path(checkpoint_location(hub_id))
    if not folder.is_dir():
        return None
    files = [path for path in sorted(folder.iterdir())
             if path.suffix in (".json", ".safetensors", ".jinja") and path.name != "train_log.json"]
    state = tuple((path.name, path.stat().st_size, path.stat().st_mtime_ns) for path in files)
    if state not in _FINGERPRINTS:
        digest = hashlib.sha256()
        for path in files:
            digest.update(path.name.encode())
            with path.open("rb") as handle:
                for block in iter(partial(handle.read, 1 << 24), b""):
                    digest.update(block)
        _FINGERPRINTS[state] = digest.hexdigest()[:16]
    return _FINGERPRINTS[state]
