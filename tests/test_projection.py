"""evals.bench.projection: the copy rule at Table 1's budget (by the methods' own rules: total - 1
stored tokens within the capacity, R-KV lf_repo's within budget - lf_margin, StreamingLLM lf_repo's
before its re-rotation), the full cache's measured lengths, and that reuse only removes work."""

from __future__ import annotations

import json

import pytest

from evals.bench.projection import BUDGET, MODEL, assumed_lengths, copy_rule, hours, measured_lengths

pytestmark = pytest.mark.filterwarnings("ignore:.*leaves no room:UserWarning")


@pytest.mark.parametrize("method,variant,longest", [
    ("longflow", "lf_repo", BUDGET + 1), ("h2o", "paper", BUDGET + 1), ("rkv", "paper", BUDGET + 1),
    ("rkv", "lf_repo", BUDGET - 4 + 1), ("streaming", "lf_repo", BUDGET), ("streaming", "paper", BUDGET + 1),
])
def test_the_copy_rule_is_each_methods_own(method, variant, longest):
    """`longest`: the most prompt + output tokens a method holds whole at budget 2400."""
    copies = copy_rule(method, variant, "exact")
    assert copies(100, longest - 100) and not copies(100, longest - 99)
    authors = copy_rule(method, variant, "lf_repo")
    assert authors(2000, 2047) and not authors(10, 2048)


def test_measured_lengths_are_the_full_caches_table1_records(tmp_path):
    for name, method, model in (("a", "vanilla", MODEL), ("b", "h2o", MODEL), ("c", "vanilla", "qwen3_8b")):
        run = tmp_path / name
        run.mkdir()
        (run / "metrics.json").write_text(json.dumps({"method": method, "model": model, "generation": "lf_repo",
                                                      "dataset": "gsm8k"}))
        (run / "generations.jsonl").write_text(
            json.dumps({"prompt_tokens": 10, "output_tokens": 5 if name == "a" else 7}) + "\n"
            + json.dumps({"prompt_tokens": 10, "output_tokens": 0}) + "\n")
    assert measured_lengths(tmp_path) == {"gsm8k": [(10, 5)]}


def test_reuse_removes_work_and_copies_the_short_items():
    lengths = assumed_lengths()
    for static in (False, True):
        alone, none = hours("longflow", lengths, None, static)
        reused, copied = hours("longflow", lengths, copy_rule("longflow", "lf_repo", "exact"), static)
        assert none == 0 and 0 < copied < 1 and reused < alone
