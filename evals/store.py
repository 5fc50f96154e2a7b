"""Run directories: identity, resumable append-only records, provenance.

A run is identified by everything that changes its outputs (model id, revision and weights,
method and its parameters, budget, generation parameters, the rendered prompts, the dataset's
content, the seeds) and by nothing else (not the batch size, not the output path). The identity is
hashed into the directory name, so changing any of those starts a new run, and starting the same
config again resumes the old one. The code is not in the identity but in provenance.json, one entry
per start (`evals.fingerprint`): a start by other code than the last is refused unless asked for.
The grader is in grader.json, the one grader every stored grade is from: a start under another
grader grades the stored outputs again (`evals.pipeline`, through `evals.grading.regrade`).

Records are appended to `generations.jsonl` one whole line per item and sample, flushed and
fsynced after every batch. A run killed at any moment leaves at worst a torn last line, which the
next start cuts off: that item is redone, nothing else is lost or duplicated. The teacher-forced
fidelity records (`fidelity.jsonl`, one line per item) are kept the same way. They belong to the
same run: they are a function of its identity and change none of its outputs.

The shards of a run (`evals.shards`) write its directory together: every read and write of its
files happens under a short write lock, so that no shard reads another's half-written line, and
metrics.json is always rewritten from every shard's records.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from longflow.errors import UserError

if TYPE_CHECKING:
    import torch

    from evals.shards import Shard

GENERATIONS = "generations.jsonl"
FIDELITY = "fidelity.jsonl"
BATCHES = "batches.jsonl"
METRICS = "metrics.json"
IDENTITY = "run.json"
CONFIG = "config.yaml"
PROVENANCE = "provenance.json"
ITEMS = "items.json"  # the ids of the items the last config run here covers (`limit` picks a prefix)
GRADER = "grader.json"  # the grader every stored grade is from (`evals.fingerprint.grader_record`)
LOCK = ".lock"
WRITE_LOCK = ".write.lock"  # held for one read or write of the run's files


def stable_hash(value: Any, length: int = 10) -> str:
    """Hex digest of a JSON-serialisable value, independent of dict order."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def run_name(identity: dict[str, Any]) -> str:
    """Readable prefix plus the identity hash: `<model>__<method>__b<budget>__<generation>__<dataset>__<hash>`."""
    budget = "full" if identity["budget"] is None else f"b{identity['budget']}"
    method = identity["method"] + (f"+{identity['verify']['name']}" if identity.get("verify") else "")
    parts = [identity["model"], method, budget, identity["generation"], identity["dataset"]]
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


def peek_records(path: Path) -> list[dict]:
    """Every complete line of a JSONL file, for readers that do not hold the run's lock (tables,
    figures): a torn last line is skipped, not cut off, since a live run may be writing it."""
    if not path.exists():
        return []
    data = path.read_bytes()
    return [json.loads(line) for line in data[:data.rfind(b"\n") + 1].splitlines() if line.strip()]


def planned_items(run: Path) -> list[str] | None:
    """The ids of the items a run's last config covers (items.json), for readers outside the run:
    None when the run has no readable list."""
    try:
        items = json.loads((run / ITEMS).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return items if isinstance(items, list) else None


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


def lock_run(path: Path, shared: bool = False) -> TextIO:
    """A lock on the run directory `path`, held while the returned file stays open: exclusive for a
    whole run or a re-grade, shared by the shards of one run."""
    return _lock(path / LOCK, fcntl.LOCK_SH if shared else fcntl.LOCK_EX,
                 f"{path} is being written by another process; wait for it or stop it")


def lock_shard(path: Path, shard: Shard) -> TextIO:
    """An exclusive lock on one shard of the run directory `path`: the same shard started twice
    would generate the same items twice."""
    return _lock(path / f"{LOCK}.shard-{shard.index}-of-{shard.count}", fcntl.LOCK_EX,
                 f"shard {shard} of {path} is being written by another process; wait for it or stop it")


def _lock(path: Path, mode: int, busy: str) -> TextIO:
    handle = open(path, "a")
    try:
        fcntl.flock(handle, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise UserError(busy) from None
    return handle


def append_records(path: Path, records: Iterable[dict]) -> None:
    """Append whole lines and make them durable before returning."""
    text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    with open(path, "a") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


class RunDir:
    """One run's directory, locked against a second process writing it at the same time; with a
    `shard`, shared with the other shards of the run (each shard alone in its own)."""

    def __init__(self, root: Path, identity: dict[str, Any], shard: Shard | None = None):
        self.identity = identity
        self.path = Path(root) / run_name(identity)
        self.path.mkdir(parents=True, exist_ok=True)
        self._locks = [lock_run(self.path, shared=shard is not None)]
        try:
            if shard is not None:
                self._locks.append(lock_shard(self.path, shard))
            with self.writing():
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

    @contextmanager
    def writing(self) -> Iterator[None]:
        """The write lock, around every read and write of the run's files (blocking: it is held briefly).
        Not reentrant: inside it, the files are read and written directly, not through this object."""
        with open(self.path / WRITE_LOCK, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield

    def clear(self) -> None:
        """Deletes the run's records (`overwrite=true`): it starts again under the same identity."""
        with self.writing():
            for name in (GENERATIONS, BATCHES, FIDELITY, METRICS, PROVENANCE, ITEMS, CONFIG, GRADER):
                (self.path / name).unlink(missing_ok=True)

    def close(self) -> None:
        for lock in self._locks:
            lock.close()

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generations(self) -> list[dict]:
        with self.writing():
            return read_records(self.path / GENERATIONS)

    def batches(self) -> list[dict]:
        with self.writing():
            return read_records(self.path / BATCHES)

    def fidelity(self) -> list[dict]:
        with self.writing():
            return read_records(self.path / FIDELITY)

    def append_fidelity(self, records: list[dict]) -> None:
        with self.writing():
            append_records(self.path / FIDELITY, records)

    def commit(self, generations: list[dict], batch: dict | None,
               summarize: Callable[[list[dict], list[dict], list[dict]], dict[str, Any]]) -> dict[str, Any]:
        """Appends one engine batch (its records, and its timing record unless None) and rewrites
        metrics.json as `summarize(every stored record, every batch record, every fidelity record)`,
        in one step against the other shards; returns the metrics. Records of an (item, sample)
        already stored are dropped (a shard of another count made them), and the batch record with
        them when none is left."""
        with self.writing():
            stored = read_records(self.path / GENERATIONS)
            batches = read_records(self.path / BATCHES)
            done = {(record["id"], record["sample"]) for record in stored}
            new = [record for record in generations if (record["id"], record["sample"]) not in done]
            # Generations first: a batch line without its generations would count time for lost work.
            append_records(self.path / GENERATIONS, new)
            if batch is not None and new:
                append_records(self.path / BATCHES, [batch])
                batches.append(batch)
            metrics = summarize(stored + new, batches, read_records(self.path / FIDELITY))
            atomic_write(self.path / METRICS, _json_text(metrics))
        return metrics

    def read_json(self, name: str, default: Any = None) -> Any:
        with self.writing():
            path = self.path / name
            return read_json_file(path) if path.exists() else default

    def write_json(self, name: str, value: Any) -> None:
        with self.writing():
            atomic_write(self.path / name, _json_text(value))

    def update_json(self, name: str, change: Callable[[Any], Any], default: Any = None) -> None:
        """Rewrites a JSON file as `change(its value, or default)`, in one step against the other shards."""
        with self.writing():
            path = self.path / name
            atomic_write(path, _json_text(change(read_json_file(path) if path.exists() else default)))

    def write_text(self, name: str, text: str) -> None:
        with self.writing():
            atomic_write(self.path / name, text)


def _json_text(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str) + "\n"


def provenance(seeds: dict[str, int], device: torch.device, code: dict[str, Any]) -> dict[str, Any]:
    """Where and with what a run was made: git state (from `code`, the run start's
    `evals.fingerprint.code_record`, asked of git once per process), package versions, the device
    (`evals.gpus`), seeds, and `code` itself."""
    from evals.gpus import device_record

    packages = {}
    for name in ("torch", "transformers", "triton", "datasets", "hydra-core", "math-verify", "longflow-bench"):
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            packages[name] = None
    import torch

    return {
        "git_commit": code["git_commit"],
        "git_dirty": code["dirty"],
        "packages": packages,
        "python": platform.python_version(),
        "host": platform.node(),
        "device": device_record(device),
        "cuda": torch.version.cuda,
        "seeds": seeds,
        "code": code,
    }
