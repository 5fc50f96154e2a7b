"""Whether a run's records were made by code that no commit holds: a table's ‡.

Each start of a run appends an entry to its provenance.json (`evals.store.provenance`): the git
commit, `git_dirty` (whether the whole checkout had uncommitted changes) and `code`, the hash of every
source file that `evals.fingerprint` counts as making the run's tokens (the method's classes and the
library, plus the files the method reads). Each record names the start that made it (`start`).

Records are marked when a start that made some of them ran a Python source of its `code` record
that differs from that file at the start's commit, or that the commit lacks (a method not committed
yet). Uncommitted changes that are not part of what a start records (the scaffold
`evals.new_method` leaves untracked, a notebook, the docs) do not mark its runs, nor does a start
that made none of the records (a restart that found nothing to generate). Where the commit cannot be
read here (another clone's unpushed commit, no git), the start's `git_dirty` decides; records made
before records named their start count every start.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

from evals.fingerprint import REPO
from evals.store import PROVENANCE

# (commit, path) -> the file's hash at that commit (as `evals.fingerprint.source_hashes` hashes it),
# None when the commit lacks the file; a commit this repository cannot read maps to `_UNREADABLE`.
_COMMITTED: dict[tuple[str, str], str | None] = {}
_UNREADABLE: set[str] = set()


def git_objects(names: list[str]) -> list[bytes | None] | None:
    """The contents of `git cat-file --batch` objects (`commit:path`, or a commit), None for a missing
    one; None when git cannot be asked."""
    try:
        output = subprocess.run(["git", "-C", str(REPO), "cat-file", "--batch"], input="".join(
            f"{name}\n" for name in names).encode(), capture_output=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    contents, position = [], 0
    for _ in names:
        end = output.index(b"\n", position)
        header = output[position:end].split()
        if header[-1] == b"missing" or len(header) != 3:
            contents.append(None)
            position = end + 1
            continue
        size = int(header[2])
        contents.append(output[end + 1:end + 1 + size])
        position = end + 1 + size + 1
    return contents


def committed_hashes(commit: str, paths: list[str]) -> dict[str, str | None] | None:
    """`{path: its hash at commit, or None when the commit lacks it}`; None when this repository
    cannot read the commit. Each (commit, path) is asked of git once per process."""
    wanted = [path for path in paths if (commit, path) not in _COMMITTED]
    if commit not in _UNREADABLE and wanted:
        found = git_objects([commit, *(f"{commit}:{path}" for path in wanted)])
        if found is None or found[0] is None:
            _UNREADABLE.add(commit)
        else:
            for path, content in zip(wanted, found[1:], strict=True):
                _COMMITTED[commit, path] = None if content is None else hashlib.sha256(content).hexdigest()[:16]
    if commit in _UNREADABLE:
        return None
    return {path: _COMMITTED[commit, path] for path in paths}


def start_dirty(entry: dict) -> bool | None:
    """Whether one start ran uncommitted code: its recorded Python sources against its commit, else
    its `git_dirty`; None when it says neither."""
    code = entry.get("code")
    if isinstance(code, dict) and isinstance(code.get("files"), dict) and isinstance(code.get("git_commit"), str):
        sources = {path: digest for path, digest in code["files"].items()
                   if path.endswith(".py") and not Path(path).is_absolute()}
        committed = committed_hashes(code["git_commit"], sorted(sources))
        if committed is not None:
            return any(committed[path] != digest for path, digest in sources.items())
    flag = entry.get("git_dirty")
    return flag if isinstance(flag, bool) else None


def uncommitted(run: Path, records: list[dict] | None) -> bool | None:
    """Whether `records` of the run (None: it has none to read, every start counts) were made by a
    start that ran uncommitted code (`start_dirty`); None when no start that made them says, or
    when there are no records."""
    if records is not None and not records:
        return None
    try:
        entries = json.loads((run / PROVENANCE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    entries = entries if isinstance(entries, list) else [entries]
    if records is not None and all(isinstance(record.get("start"), int) for record in records):
        makers = {record["start"] for record in records}
        entries = [entry for position, entry in enumerate(entries) if position in makers]
    flags = [start_dirty(entry) for entry in entries if isinstance(entry, dict)]
    flags = [flag for flag in flags if flag is not None]
    return any(flags) if flags else None
