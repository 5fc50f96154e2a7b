"""Dataset loading: the benchmark files (via the `data_root` fixture), GPQA options and their seeded
shuffle, the hub field mapping (with a stand-in for `datasets.load_dataset`), and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from evals.datasets import (
    DEMO_ROOT,
    LETTERS,
    REGISTRY,
    DatasetSpec,
    Item,
    fingerprint,
    load,
    registry_spec,
    split_options,
)
from longflow.errors import UserError

hf_datasets = pytest.importorskip("datasets")  # absent from the GPU image, which runs only the gpu-marked tests

REPO = Path(__file__).resolve().parents[1]
SIZES = {"aime24": 30, "aime25": 30, "amc": 40, "gpqa": 198, "gsm8k": 1319, "math500": 500, "minerva": 272,
         "olympiad": 675}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def gpqa_row(index: int, options: list[str], stem: str = "Which one?") -> dict:
    body = "\n".join(f"{letter}: {option}" for letter, option in zip(LETTERS, options, strict=True))
    return {"index": index, "question": f"{stem}\n\n{body}", "true_answer": "A"}


@pytest.mark.parametrize("name", sorted(SIZES))
def test_benchmark_files_load_in_full(data_root, name):
    items = load(registry_spec(name, root=str(data_root)))
    assert len(items) == SIZES[name]
    assert len({item.id for item in items}) == len(items)
    assert all(item.question.strip() and item.gold.strip() for item in items)
    assert all((item.choices is not None) == (name == "gpqa") for item in items)


def test_every_gpqa_row_has_four_options_and_a_stem(data_root):
    for item in load(registry_spec("gpqa", root=str(data_root))):
        assert len(item.choices) == 4 and all(choice.strip() for choice in item.choices)
        assert "\nA:" not in item.question and "\nD:" not in item.question


def test_gpqa_shuffle_is_seeded_reproducible_and_keeps_the_right_option(data_root):
    root = str(data_root)
    plain = load(registry_spec("gpqa", root=root, shuffle_choices=False))
    shuffled = load(registry_spec("gpqa", root=root))
    assert shuffled == load(registry_spec("gpqa", root=root))
    assert {item.gold for item in plain} == {"A"}  # the paper's file order
    for before, after in zip(plain, shuffled, strict=True):
        assert sorted(after.choices) == sorted(before.choices)
        assert after.choices[LETTERS.index(after.gold)] == before.choices[0]
    other_seed = load(registry_spec("gpqa", root=root, seed=1))
    assert [item.choices for item in other_seed] != [item.choices for item in shuffled]


def test_gpqa_gold_letters_are_roughly_uniform(data_root):
    counts = Counter(item.gold for item in load(registry_spec("gpqa", root=str(data_root))))
    assert set(counts) == set(LETTERS)
    assert all(30 <= count <= 70 for count in counts.values()), counts  # 49.5 expected of each


def test_shuffle_is_the_same_in_another_process(tmp_path):
    """The order must not depend on the interpreter's string hash seed."""
    spec = registry_spec("demo_gpqa")
    code = ("from evals.datasets import REGISTRY, fingerprint, load; "
            "print(fingerprint(load(REGISTRY['demo_gpqa'])))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                           check=True).stdout.strip()
    assert other == fingerprint(load(spec))


def test_split_options_handles_multiline_options_and_a_stem_line_like_a_marker():
    text = "A: first line of the stem\nwhat now?\n\nA: one\nstill one\nB: two\n\nC: three\nD: four\n"
    stem, options = split_options(text)
    assert stem == "A: first line of the stem\nwhat now?"
    assert options == ["one\nstill one", "two", "three", "four"]


@pytest.mark.parametrize("options", ["A: x\nB: y\nC: z", "A: x\nB: \nC: z\nD: w", "A: x\nB: y\nC: z\nD: w\nE: v"])
def test_a_gpqa_row_without_four_options_names_the_row(tmp_path, options):
    rows = [gpqa_row(0, ["a", "b", "c", "d"]), {"index": 1, "question": f"Q?\n\n{options}", "true_answer": "A"}]
    write_jsonl(tmp_path / "gpqa.jsonl", rows)
    with pytest.raises(UserError, match=r"gpqa\.jsonl: row 2 \(id 1\)"):
        load(registry_spec("gpqa", root=str(tmp_path)))


def test_malformed_line_names_the_file_and_line(tmp_path):
    path = tmp_path / "amc.jsonl"
    path.write_text('{"index": 0, "question": "q", "true_answer": "1"}\n\n{"index": 1, "question": \n')
    with pytest.raises(UserError, match=rf"{path}: line 3: malformed JSON") as error:
        load(registry_spec("amc", root=str(tmp_path)))
    assert "\n" not in str(error.value)


def test_missing_file_names_the_path_and_the_root_settings(tmp_path):
    with pytest.raises(UserError, match=r"aime24\.jsonl.*dataset\.root or LONGFLOW_DATA_ROOT"):
        load(registry_spec("aime24", root=str(tmp_path)))


def test_missing_field_names_it_and_the_available_ones(tmp_path):
    write_jsonl(tmp_path / "amc.jsonl", [{"index": 0, "problem": "q", "true_answer": "1"}])
    available = r"\['index', 'problem', 'true_answer'\]"
    with pytest.raises(UserError, match=rf"row 1 .*no field 'question'.*{available}"):
        load(registry_spec("amc", root=str(tmp_path)))


def test_local_fields_map_and_limit(tmp_path):
    rows = [{"uid": f"q{i}", "problem": f"{i} + 1?", "answer": str(i + 1)} for i in range(5)]
    write_jsonl(tmp_path / "mine.jsonl", rows)
    fields = {"id": "uid", "question": "problem", "gold": "answer"}
    spec = DatasetSpec("mine", root=str(tmp_path), fields=fields)
    assert load(spec, limit=2) == [Item("q0", "0 + 1?", "1"), Item("q1", "1 + 1?", "2")]
    numbered = DatasetSpec("mine", root=str(tmp_path), fields={**fields, "id": None})
    assert [item.id for item in load(numbered)] == ["0", "1", "2", "3", "4"]


def test_demo_sets_load_from_the_package():
    math_items = load(REGISTRY["demo_math"])
    gpqa_items = load(REGISTRY["demo_gpqa"])
    assert len(math_items) >= 8 and len(gpqa_items) == 2
    assert all(len(item.choices) == 4 for item in gpqa_items)
    assert Path(DEMO_ROOT).is_relative_to(REPO / "evals")


def test_fingerprint_follows_the_content():
    items = load(REGISTRY["demo_math"])
    assert fingerprint(items) == fingerprint(load(REGISTRY["demo_math"]))
    assert len(fingerprint(items)) == 64
    changed = [Item(items[0].id, items[0].question, "43"), *items[1:]]
    assert fingerprint(changed) != fingerprint(items)
    assert fingerprint(load(registry_spec("demo_gpqa", seed=3))) != fingerprint(load(REGISTRY["demo_gpqa"]))


class FakeHub:
    """Stands in for `datasets.load_dataset`: rows per hub id, and the arguments it was called with."""

    def __init__(self, rows: dict[str, list[dict]]):
        self.rows, self.calls = rows, []

    def __call__(self, hub_id, config=None, split=None):
        self.calls.append((hub_id, config, split))
        return self.rows[hub_id]


def test_hub_rows_are_mapped_and_transformed(monkeypatch):
    hub = FakeHub({
        "openai/gsm8k": [{"question": "2 + 2?", "answer": "2 + 2 = 4\n#### 4"}],
        "Hothan/OlympiadBench": [{"id": 7, "question": "Roots?", "final_answer": ["$2$", "$3$"]}],
        "Idavidrein/gpqa": [{"Record ID": "rec1", "Question": "Pick the right one.",
                             "Correct Answer": "right", "Incorrect Answer 1": "w1",
                             "Incorrect Answer 2": "w2", "Incorrect Answer 3": "w3"}],
    })
    monkeypatch.setattr(hf_datasets, "load_dataset", hub)
    assert load(REGISTRY["gsm8k"]) == [Item("0", "2 + 2?", "4")]
    assert load(REGISTRY["olympiad"]) == [Item("7", "Roots?", "$2$,$3$")]
    (item,) = load(REGISTRY["gpqa"])
    assert item.question == "Pick the right one." and item.choices[LETTERS.index(item.gold)] == "right"
    assert load(registry_spec("gpqa", shuffle_choices=False))[0].choices == ("right", "w1", "w2", "w3")
    assert hub.calls[0] == ("openai/gsm8k", "main", "test")
    assert hub.calls[2] == ("Idavidrein/gpqa", "gpqa_diamond", "train")


def test_hub_failure_says_how_to_go_local():
    """The real client, offline: one line that points at dataset.root / LONGFLOW_DATA_ROOT."""
    code = ("from evals.datasets import REGISTRY, load\n"
            "try:\n    load(REGISTRY['math500'])\nexcept Exception as error:\n"
            "    print(type(error).__name__, error, sep='|')\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                            timeout=120)
    kind, message = result.stdout.strip().split("|")
    assert kind == "UserError"
    assert "HuggingFaceH4/MATH-500" in message and "set dataset.root or LONGFLOW_DATA_ROOT" in message


@pytest.mark.parametrize("settings, message", [
    (dict(kind="code"), "dataset.kind"),
    (dict(root=None, hub_id=None), "set dataset.root"),
    (dict(fields={"answer": "x"}), "unknown keys"),
    (dict(fields={"gold": None}), "must name source fields"),
    (dict(choice_fields=["a", "b", "c", "d"]), "needs kind gpqa"),
    (dict(kind="gpqa", choice_fields=["a", "b"]), "exactly 4"),
    (dict(gold_transform="nope"), "gold_transform"),
    (dict(seed=1.5), "dataset.seed"),
])
def test_spec_checks(settings, message):
    with pytest.raises(UserError, match=message):
        DatasetSpec(**{"name": "x", "root": "somewhere", **settings})


def test_registry_holds_every_benchmark():
    suite = {f"canary_{family}" for family in ("state", "lookup", "plan", "redundant", "chain")}
    assert set(SIZES) | {"demo_math", "demo_gpqa", "canary"} | suite == set(REGISTRY)
    assert {name for name, spec in REGISTRY.items() if spec.kind == "gpqa"} == {"gpqa", "demo_gpqa"}
    assert all(spec.hub_id for name, spec in REGISTRY.items() if name in SIZES)
    with pytest.raises(UserError, match="unknown dataset"):
        registry_spec("mmlu")
    with pytest.raises(UserError, match="unknown dataset settings"):
        registry_spec("amc", shuffle=False)
