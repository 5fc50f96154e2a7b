"""Benchmark items: loading, GPQA option handling, and the registry of dataset specs.

A dataset is a `DatasetSpec` (the Hydra group `dataset` maps 1:1 onto its fields) and loads from a
local JSONL file (`root` set), from the Hugging Face hub (`hub_id`), or from a generator function in
code (`generator`: the canary task). The local schema is the one of the LongFlow paper's files, one
object a line: `index`, `question`, `true_answer`; generators yield rows of that schema.

GPQA items carry their four options in `Item.choices`, shuffled per question by a seeded RNG so the
gold letter is uniform (the paper's files always have the gold first, "A"). `Item.question` is then
the stem alone; `evals.prompts` renders the options.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import random
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from longflow.errors import UserError

KINDS = ("math", "gpqa")
LETTERS = "ABCD"
LOCAL_FIELDS = {"id": "index", "question": "question", "gold": "true_answer"}
DEMO_ROOT = str(Path(__file__).parent / "demo_data")

# An option line of the paper's GPQA files: "A: text" at the start of a line.
_OPTION_RE = re.compile(r"^([A-E]):[ \t]?", re.MULTILINE)


@dataclass(frozen=True)
class Item:
    """One question. For GPQA, `choices` are the four option texts in presentation order and `gold`
    is the letter of the correct one; for math, `choices` is None and `gold` the answer string."""

    id: str
    question: str
    gold: str
    choices: tuple[str, ...] | None = None


def _gsm8k_final(answer: str) -> str:
    """GSM8K hub answers are a worked solution ending in "#### <number>"; keep the number."""
    if "####" not in answer:
        raise ValueError('no "####" final-answer marker')
    return answer.rsplit("####", 1)[1].strip()


GOLD_TRANSFORMS = {"gsm8k_final": _gsm8k_final}


@dataclass
class DatasetSpec:
    """Where a benchmark's items come from and how the source's fields map onto `Item`.

    Three sources:
      - generated (`generator` set): the rows that the function `generator` ("module:function")
        returns when called with `generator_args`, read with `fields` like a local file's.
      - local (`root` set): the JSONL file `<root>/<file>`, read with `fields`, which maps our names
        (id, question, gold) to the file's; keys left out take the paper's schema (index, question,
        true_answer). GPQA options sit inside the question as "A: ..." lines, as in the paper's file.
      - hub (`root` null): `datasets.load_dataset(hub_id, hub_config, split=split)`, read with
        `hub_fields` (keys left out fall back to `fields`). For GPQA the hub's options are separate
        columns: `choice_fields` names those four, the correct one first. `gold_transform` names a
        function of `GOLD_TRANSFORMS` applied to every hub gold (GSM8K's "#### N").
    In either map, `id: null` numbers the rows from 0 instead. `shuffle_choices` and `seed` drive the
    GPQA option shuffle and belong to a run's identity.
    """

    name: str
    kind: str = "math"
    root: str | None = None
    file: str | None = None
    fields: dict[str, str | None] = field(default_factory=dict)
    hub_id: str | None = None
    hub_config: str | None = None
    split: str = "test"
    hub_fields: dict[str, str | None] = field(default_factory=dict)
    choice_fields: list[str] | None = None
    gold_transform: str | None = None
    generator: str | None = None
    generator_args: dict[str, Any] = field(default_factory=dict)
    shuffle_choices: bool = True
    seed: int = 0

    def __post_init__(self):
        if not self.name:
            raise UserError("dataset.name must be set")
        if self.kind not in KINDS:
            raise UserError(f"dataset.kind must be one of {list(KINDS)}, got {self.kind!r}")
        if self.file is None:
            self.file = f"{self.name}.jsonl"
        if self.root is None and self.hub_id is None and self.generator is None:
            raise UserError(f"dataset {self.name}: set dataset.root (a local folder) or dataset.hub_id")
        if self.generator is not None and not re.fullmatch(r"[\w.]+:\w+", self.generator):
            raise UserError(f"dataset {self.name}: generator must be 'module:function', got {self.generator!r}")
        self.generator_args = dict(self.generator_args)
        # Plain containers from here on, whatever mapping type the caller passed.
        self.fields = _field_map("fields", {**LOCAL_FIELDS, **dict(self.fields)})
        self.hub_fields = _field_map("hub_fields", {**self.fields, **dict(self.hub_fields)})
        if self.choice_fields is not None:
            self.choice_fields = list(self.choice_fields)
            if self.kind != "gpqa" or len(self.choice_fields) != len(LETTERS):
                raise UserError("dataset.choice_fields needs kind gpqa and exactly 4 field names, the "
                                f"correct one first; got {self.choice_fields} for kind {self.kind}")
        if self.gold_transform is not None and self.gold_transform not in GOLD_TRANSFORMS:
            raise UserError(f"dataset.gold_transform must be one of {sorted(GOLD_TRANSFORMS)} or null, "
                            f"got {self.gold_transform!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise UserError(f"dataset.seed must be an integer, got {self.seed!r}")

    @property
    def source(self) -> str:
        """"generated", "local" or "hub": a generator wins over a folder, a folder over the hub."""
        if self.generator is not None:
            return "generated"
        return "local" if self.root is not None else "hub"


def _field_map(key: str, fields: dict[str, str | None]) -> dict[str, str | None]:
    unknown = set(fields) - set(LOCAL_FIELDS)
    if unknown:
        raise UserError(f"dataset.{key} has unknown keys {sorted(unknown)}; allowed: {sorted(LOCAL_FIELDS)}")
    if fields["question"] is None or fields["gold"] is None:
        raise UserError(f"dataset.{key}.question and .gold must name source fields, got {fields}")
    return fields


def load(spec: DatasetSpec, limit: int | None = None) -> list[Item]:
    """The spec's items in source order, the first `limit` of them if given."""
    if limit is not None and limit <= 0:
        raise UserError(f"limit must be positive or null, got {limit}")
    if spec.source == "generated":
        source, rows, fields = f"generator {spec.generator}", _generated_rows(spec), spec.fields
    elif spec.source == "local":
        path = Path(spec.root) / spec.file
        source, rows, fields = str(path), _jsonl_rows(path), spec.fields
    else:
        source, rows, fields = f"hub dataset {spec.hub_id}", _hub_rows(spec), spec.hub_fields
    items, rows_of = [], {}
    for position, row in enumerate(rows):
        if limit is not None and position >= limit:
            break
        item = _item(spec, fields, row, f"{source}: row {position + 1}", position)
        if item.id in rows_of:  # records are keyed by id: a second item would never be asked
            raise UserError(f"{source}: rows {rows_of[item.id]} and {position + 1} have the same id {item.id!r}")
        rows_of[item.id] = position + 1
        items.append(item)
    if not items:
        raise UserError(f"{source} holds no items")
    return items


def fingerprint(items: Iterable[Item]) -> str:
    """sha256 hex of the items' content (ids, questions, options, golds, in order), as stable JSON."""
    payload = json.dumps([asdict(item) for item in items], ensure_ascii=False, sort_keys=True,
                         separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def split_options(text: str, where: str = "question") -> tuple[str, list[str]]:
    """(stem, [A, B, C, D]) from a GPQA question whose options follow it as "A: ..." lines.

    The markers are found from the end (the last "D:" line, the last "C:" line before it, ...), so a
    stem line that happens to start with "A:" stays in the stem; an option runs up to the next marker
    and may span several lines. Raises UserError unless exactly four non-empty options are found.
    """
    markers = list(_OPTION_RE.finditer(text))
    found: list[re.Match[str]] = []
    for letter in reversed(LETTERS):
        end = found[0].start() if found else len(text)
        candidates = [m for m in markers if m.group(1) == letter and m.start() < end]
        if not candidates:
            raise UserError(f"{where}: expected 4 options as lines 'A: ...' to 'D: ...', found no "
                            f"'{letter}:' line in order")
        found.insert(0, candidates[-1])
    if any(m.group(1) == "E" and m.start() > found[-1].start() for m in markers):
        raise UserError(f"{where}: expected 4 options, found a fifth ('E:' line)")
    stops = [m.start() for m in found[1:]] + [len(text)]
    options = [text[m.end():stop].strip() for m, stop in zip(found, stops, strict=True)]
    if "" in options:
        raise UserError(f"{where}: option {LETTERS[options.index('')]} is empty; expected 4 options")
    return text[:found[0].start()].strip(), options


def _jsonl_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise UserError(f"data file not found: {path} (set dataset.root or LONGFLOW_DATA_ROOT to the folder "
                        f"that holds it)")
    rows = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        line = path.read_bytes()[:error.start].count(b"\n") + 1
        raise UserError(f"{path}: line {line}: not UTF-8 text ({error.reason}); save the file as UTF-8") from None
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise UserError(f"{path}: line {number}: malformed JSON ({error.msg})") from None
        if not isinstance(row, dict):
            raise UserError(f"{path}: line {number}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def _generated_rows(spec: DatasetSpec) -> list[dict[str, Any]]:
    module, function = spec.generator.split(":")
    try:
        generate = getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as error:
        raise UserError(f"dataset {spec.name}: cannot import generator {spec.generator}: {error}") from None
    try:
        return list(generate(**spec.generator_args))
    except TypeError as error:
        raise UserError(f"dataset {spec.name}: generator_args {spec.generator_args} do not fit "
                        f"{spec.generator}: {error}") from None


def _hub_rows(spec: DatasetSpec) -> Iterable[Mapping[str, Any]]:
    # Imported here: `datasets` is slow to import and only the hub source needs it.
    import datasets

    try:
        return datasets.load_dataset(spec.hub_id, spec.hub_config, split=spec.split)
    except Exception as error:  # the hub client raises many types: offline, connection, gated, not found
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"could not load {spec.hub_id} (config {spec.hub_config}, split {spec.split}) from "
                        f"the hub: {detail}. Without hub access, set dataset.root or LONGFLOW_DATA_ROOT to a "
                        f"local folder of <name>.jsonl files") from None


def _item(spec: DatasetSpec, fields: dict[str, str | None], row: Mapping[str, Any], where: str,
          position: int) -> Item:
    def value(key: str) -> str:
        name = fields[key]
        if name not in row:
            raise UserError(f"{where}: no field {name!r} (for {key}); available: {sorted(row)}. Map it with "
                            f"dataset.{'hub_fields' if spec.source == 'hub' else 'fields'}")
        return _text(row[name])

    item_id = str(position) if fields["id"] is None else value("id")
    where = f"{where} (id {item_id})"
    question = value("question")
    if not question.strip():
        raise UserError(f"{where}: the question is empty")
    if spec.kind == "math":
        return Item(id=item_id, question=question, gold=_gold(spec, value("gold"), where))
    if spec.source != "hub" or spec.choice_fields is None:
        question, options = split_options(question, where)
        letter = _gold(spec, value("gold"), where).strip().upper()
        if len(letter) != 1 or letter not in LETTERS:
            raise UserError(f"{where}: gold {letter!r} is not one of A, B, C, D")
        gold_index = LETTERS.index(letter)
    else:
        options = []
        for name in spec.choice_fields:
            if name not in row:
                raise UserError(f"{where}: no field {name!r} (a choice field); available: {sorted(row)}")
            options.append(_text(row[name]).strip())
        gold_index = 0
    order = list(range(len(LETTERS)))
    if spec.shuffle_choices:
        # A str seed is hashed with sha512 by `random`, so the order is the same in every process and
        # Python version (unlike `hash()`), and one question's order does not depend on the others.
        random.Random(f"{spec.seed}:{item_id}").shuffle(order)
    return Item(id=item_id, question=question, gold=LETTERS[order.index(gold_index)],
                choices=tuple(options[index] for index in order))


def _text(value: Any) -> str:
    """A field as text. A list of answers (OlympiadBench's `final_answer`) joins with commas, which
    is how the paper's local files write several answers ("$69$,$84$")."""
    if isinstance(value, (list, tuple)):
        return ",".join(str(part) for part in value)
    return str(value)


def _gold(spec: DatasetSpec, gold: str, where: str) -> str:
    """The gold after the hub's `gold_transform`; local and generated golds are final answers already."""
    if spec.source != "hub" or spec.gold_transform is None:
        return gold
    try:
        return GOLD_TRANSFORMS[spec.gold_transform](gold)
    except ValueError as error:
        raise UserError(f"{where}: gold_transform {spec.gold_transform} failed: {error}") from None


# The users' default hub sources, one per benchmark; the local files come from `root` (set from
# LONGFLOW_DATA_ROOT in the Hydra config). Hub copies may differ from the paper's files: AI-MO's AMC
# set holds AMC 2022 and 2023 (83 rows against the paper's 40), OlympiadBench's config has more
# rows than the paper's 675, and GPQA is gated (accept its terms on the hub first).
REGISTRY: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        DatasetSpec("aime24", hub_id="HuggingFaceH4/aime_2024", split="train",
                    hub_fields={"id": "id", "question": "problem", "gold": "answer"}),
        DatasetSpec("aime25", hub_id="yentinglin/aime_2025", split="train",
                    hub_fields={"id": "id", "question": "problem", "gold": "answer"}),
        DatasetSpec("amc", hub_id="AI-MO/aimo-validation-amc", split="train",
                    hub_fields={"id": "id", "question": "problem", "gold": "answer"}),
        DatasetSpec("gpqa", kind="gpqa", hub_id="Idavidrein/gpqa", hub_config="gpqa_diamond", split="train",
                    hub_fields={"id": "Record ID", "question": "Question"},
                    choice_fields=["Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2",
                                   "Incorrect Answer 3"]),
        DatasetSpec("gsm8k", hub_id="openai/gsm8k", hub_config="main", split="test",
                    hub_fields={"id": None, "question": "question", "gold": "answer"},
                    gold_transform="gsm8k_final"),
        DatasetSpec("math500", hub_id="HuggingFaceH4/MATH-500", split="test",
                    hub_fields={"id": "unique_id", "question": "problem", "gold": "answer"}),
        DatasetSpec("minerva", hub_id="math-ai/minervamath", split="test",
                    hub_fields={"id": None, "question": "question", "gold": "answer"}),
        DatasetSpec("olympiad", hub_id="Hothan/OlympiadBench", hub_config="OE_TO_maths_en_COMP",
                    split="train",
                    hub_fields={"id": "id", "question": "question", "gold": "final_answer"}),
        DatasetSpec("demo_math", root=DEMO_ROOT),
        DatasetSpec("demo_gpqa", kind="gpqa", root=DEMO_ROOT),
        DatasetSpec("canary", generator="evals.canary.task:heldout_rows"),
        *(DatasetSpec(f"canary_{family}", generator="evals.canary.families:heldout_rows",
                      generator_args={"family": family})
          for family in ("state", "lookup", "plan", "redundant", "chain")),
    )
}


def registry_spec(name: str, **overrides: Any) -> DatasetSpec:
    """The registry's spec for `name` with some settings replaced, e.g. `root=...` or `seed=1`."""
    if name not in REGISTRY:
        raise UserError(f"unknown dataset {name!r}; known: {sorted(REGISTRY)}")
    settings = asdict(REGISTRY[name])
    unknown = set(overrides) - set(settings)
    if unknown:
        raise UserError(f"unknown dataset settings {sorted(unknown)}; allowed: {sorted(settings)}")
    return DatasetSpec(**{**settings, **overrides})
