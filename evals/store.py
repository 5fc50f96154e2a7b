"""Run directories: identity, resumable append-only records, provenance.

A run is identified by everything that changes its outputs (model id, revision and weights,
method and its parameters, budget, generation parameters, the rendered prompts, the dataset's
content, the seeds) and by nothing else (not the batch size, not the output path). The identity is
hashed into the directory name, so changing any of those starts a new run, and starting the same
config again resumes the old one.

Records are appended to `generations.jsonl` one whole line per item and sample, flushed and
fsynced after every batch. A run killed at any moment leaves at worst a torn last line, which the
next start cuts off: that item is redone, nothing else is lost or duplicated. The teacher-forced
fidelity records (`fidelity.jsonl`, one line per item) are kept the same way. They belong to the
same run: they are a function of its identity and change none of its outputs.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import subprocess
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

from longflow.errors import UserError

GENERATIONS = "generations.jsonl"
FIDELITY = "fidelity.jsonl"
BATCHES = "batches.jsonl"
METRICS = "metrics.json"
IDENTITY = "run.json"
CONFIG = "config.yaml"
PROVENANCE = "provenance.json"
ITEMS = "items.json"  # the ids of the items the last config run here covers (`limit` picks a prefix)
LOCK = ".lock"


def stable_hash(value: Any, length: int = 10) -> str:
    """Hex digest of a JSON-serialisable value, independent of dict order."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def run_name(identity: dict[str, Any]) -> str:
    """Readable prefix plus the identity hash: `<model>__<method>__b<budget>__<generation>__<dataset>__<hash>`."""
    budget = "full" if identity["budget"] is None else f"b{identity['budget']}"
    parts = [identity["model"], identity["method"], budget, identity["generation"], identity["dataset"]]
    return "__".join([*parts, stable_hash(identity)])


def atomic_write(path: Path, text: str) -> None:
    """Write through a temporary file and rename, so readers never see half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def read_records(path: Path) -> list[dict]:
    """Every complete line of a JSONL file; a torn last line (no newline) is cut off the file."""
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as handle:
            handle.truncate(end)
    records = []
    for number, line in enumerate(data[:end].splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            detail = error.msg if isinstance(error, json.JSONDecodeError) else "not UTF-8"
            raise UserError(f"{path}:{number}: corrupt record ({detail}); delete that line to redo the item") from None
        if not isinstance(record, dict):
            raise UserError(f"{path}:{number}: corrupt record (a JSON {type(record).__name__}, not an object); "
                            "delete that line to redo the item")
        records.append(record)
    return records


def read_json_file(path: Path) -> Any:
    """A JSON file of a run directory; UserError naming it when it is not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"{path} is corrupt ({error}); delete it, or the run directory to start over") from None


def in_scope(records: list[dict], item_ids: Iterable[str] | None) -> list[dict]:
    """The records of the given items (all of them when `item_ids` is None): a run redone with a
    smaller `limit` keeps the other items' records, but they are not its results."""
    if item_ids is None:
        return records
    wanted = set(item_ids)
    return [record for record in records if record["id"] in wanted]


def lock_run(path: Path) -> TextIO:
    """An exclusive lock on the run directory `path`, held while the returned file stays open."""
    handle = open(path / LOCK, "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise UserError(f"{path} is being written by another process; wait for it or stop it") from None
    return handle


def append_records(path: Path, records: Iterable[dict]) -> None:
    """Append whole lines and make them durable before returning."""
    text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    with open(path, "a") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


class RunDir:
    """One run's directory, locked against a second process writing it at the same time."""

    def __init__(self, root: Path, identity: dict[str, Any]):
        self.identity = identity
        self.path = Path(root) / run_name(identity)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = lock_run(self.path)
        try:
            self._check_identity()
        except BaseException:
            self.close()
            raise

    def _check_identity(self) -> None:
        identity_path = self.path / IDENTITY
        if identity_path.exists():
            stored = read_json_file(identity_path)
            if stored != json.loads(json.dumps(self.identity, default=str)):
                raise UserError(f"{self.path}: {IDENTITY} does not match this config (hash collision?)")
        else:
            atomic_write(identity_path, json.dumps(self.identity, indent=2, sort_keys=True, default=str) + "\n")

    def close(self) -> None:
        self._lock.close()

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generations(self) -> list[dict]:
        return read_records(self.path / GENERATIONS)

    def batches(self) -> list[dict]:
        return read_records(self.path / BATCHES)

    def fidelity(self) -> list[dict]:
        return read_records(self.path / FIDELITY)

    def append_fidelity(self, records: list[dict]) -> None:
        append_records(self.path / FIDELITY, records)

    def append(self, generations: list[dict], batch: dict | None = None) -> None:
        # Generations first: a batch line without its generations would count time for lost work.
        append_records(self.path / GENERATIONS, generations)
        if batch is not None:
            append_records(self.path / BATCHES, [batch])

    def read_json(self, name: str, default: Any = None) -> Any:
        path = self.path / name
        return read_json_file(path) if path.exists() else default

    def write_json(self, name: str, value: Any) -> None:
        atomic_write(self.path / name, json.dumps(value, indent=2, sort_keys=True, default=str) + "\n")

    def write_text(self, name: str, text: str) -> None:
        atomic_write(self.path / name, text)


def provenance(seeds: dict[str, int]) -> dict[str, Any]:
    """Where and with what a run was made: git state, package versions, device, seeds."""
    repo = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    packages = {}
    for name in ("torch", "transformers", "triton", "datasets", "hydra-core", "math-verify", "longflow-bench"):
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            packages[name] = None
    import torch

    status = git("status", "--porcelain")
    return {
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
        "packages": packages,
        "python": platform.python_version(),
        "host": platform.node(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "cuda": torch.version.cuda,
        "seeds": seeds,
    }
