"""reuse_full_cache (evals/reuse.py, KVPolicy.compresses_within): for every method, a run that copies
the full cache's records where the method says it cannot compress gives the records of a run that
generates everything, at budgets that bind for some items and not others; the option's checks; the
authors' rule; a missing full-cache run; reused_share in the metrics."""

from __future__ import annotations

import shutil
import subprocess
import types
import warnings

import pytest
import torch
import yaml
from helpers import method_variants, policy_of
from helpers.runs import REPO, records, run_cli, run_dirs

from evals.configs import CONF_DIR, compose_config, model_spec
from evals.grading import Grade
from evals.metrics import summarize
from evals.pipeline import Job, Setup, evaluate
from evals.reuse import LF_REPO_BELOW, MARK, full_cache_identity, reusable, row_spec
from longflow.errors import UserError
from longflow.policy import KVPolicy

# Greedy, short outputs on the tiny Qwen3 model: GSM8K prompts differ in length, so one budget
# holds the shorter items whole and cuts the longer ones. The canary's prompts are of one length;
# its first items' answers stop at 446 to 1358 tokens, so a cap of 520 leaves some stopping at EOS.
LIMIT, NEW = 6, 32
ENGINE = [f"limit={LIMIT}", "device=cpu", "engine.batch_size=2", "grading.workers=1"]
RUN = ["model=tiny_qwen3", "dataset=gsm8k", f"generation.max_new_tokens={NEW}", *ENGINE]
CANARY = ["model=canary", "dataset=canary", "generation.max_new_tokens=520", *ENGINE]
# A step method of the base rule, R-KV lf_repo's in-step cut, StreamingLLM lf_repo's re-rotation,
# LongFlow's fused decode.
CANARY_METHODS = [("h2o", "paper"), ("rkv", "lf_repo"), ("streaming", "lf_repo"), ("longflow", "paper")]
# A record's timing and peak slots depend on its batch-mates (a finished row of a batch goes on
# writing until the batch's check); every other field is a function of the item alone.
BATCH_FIELDS = ("seconds", "peak_slots", MARK)


def run(tmp_path, *overrides: str, base: tuple[str, ...] = tuple(RUN)) -> dict:
    """The metrics of one in-process run, started twice: the second start resumes and generates nothing."""
    cfg = compose_config([*base, f"results_dir={tmp_path}", *overrides])
    evaluate(cfg)
    (metrics,) = evaluate(cfg)  # a resumed run generates nothing more
    return metrics


def tiny_engine(model: str = "tiny_qwen3") -> types.SimpleNamespace:
    """The attributes of an engine on a small model that `row_spec` reads."""
    config = model_spec(model).architecture
    return types.SimpleNamespace(num_layers=config["num_hidden_layers"], q_heads=config["num_attention_heads"],
                                 kv_heads=config["num_key_value_heads"], head_dim=config["head_dim"],
                                 dtype=torch.float32, device=torch.device("cpu"), rotary=None,
                                 vocab=config["vocab_size"], scale=None)


def tightest_budget(method: str, fields: dict, prompt: int, total: int, model: str) -> int:
    """The smallest budget at which `method` holds a sequence of `prompt` and `total` tokens whole."""
    spec = row_spec(tiny_engine(model), prompt, types.SimpleNamespace(max_new_tokens=NEW))
    for budget in range(4, total + 600):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                policy = policy_of(method, budget, **fields)
        except UserError:
            continue
        if not policy.compresses_within(prompt, total, spec):
            return budget
    raise AssertionError(f"{method} never holds {total} tokens whole")


def never_answers(method: str, fields: dict, model: str) -> bool:
    """Whether `method` keeps the conservative default: it claims to compress even a sequence of two
    tokens under a budget of 4096 (its storage hooks are its own and it does not answer for them)."""
    spec = row_spec(tiny_engine(model), 1, types.SimpleNamespace(max_new_tokens=NEW))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return policy_of(method, 4096, **fields).compresses_within(1, 2, spec)


def full_cache_run(root, base) -> tuple:
    """(root, the full cache's run name, its records by id, the run's overrides)."""
    metrics = run(root, "method=vanilla", base=base)
    return root, metrics["run_id"], {r["id"]: r for r in records(root / metrics["run_id"])}, base


@pytest.fixture(scope="module")
def full_cache(tmp_path_factory, data_root, monkeypatch_module):
    monkeypatch_module.setenv("LONGFLOW_DATA_ROOT", str(data_root))
    return full_cache_run(tmp_path_factory.mktemp("reuse"), tuple(RUN))


@pytest.fixture(scope="module")
def canary_full_cache(tmp_path_factory):
    return full_cache_run(tmp_path_factory.mktemp("reuse_canary"), tuple(CANARY))


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.mark.slow
@pytest.mark.parametrize("method,variant", method_variants())
def test_reuse_gives_the_records_of_a_run_without_it(full_cache, method, variant):
    """The budget is the tightest at which the median item (by prompt + output) is held whole: the
    items at or below it are copied, the longer ones generated (and compressed), and every record
    equals the one the method generates itself; the copies are marked with the full cache's run."""
    check_reuse(full_cache, method, variant)


@pytest.mark.slow
@pytest.mark.parametrize("method,variant", [("h2o", "paper"), ("rkv", "paper"), ("streaming", "lf_repo")])
def test_reuse_in_static_batches(full_cache, tmp_path, method, variant):
    """The same in static batches, where a copied item's batch-mates change (in a folder of its own:
    the engine's settings are not part of a run's identity)."""
    root, source, vanilla, base = full_cache
    shutil.copytree(root / source, tmp_path / source)
    check_reuse((tmp_path, source, vanilla, base), method, variant, "engine.continuous=false")


@pytest.mark.slow
@pytest.mark.parametrize("method,variant", CANARY_METHODS)
def test_reuse_on_the_canary(canary_full_cache, method, variant):
    """The same on the trained canary model, whose outputs stop at EOS at different lengths."""
    check_reuse(canary_full_cache, method, variant)


def check_reuse(full_cache, method: str, variant: str | None, *engine: str) -> None:
    root, source, vanilla, base = full_cache
    model = next(argument.partition("=")[2] for argument in base if argument.startswith("model="))
    fields = {} if variant is None else {"variant": variant}
    lengths = sorted((r["prompt_tokens"], r["prompt_tokens"] + r["output_tokens"]) for r in vanilla.values())
    prompt, total = sorted(lengths, key=lambda pair: pair[1])[len(lengths) // 2 - 1]
    if never_answers(method, fields, model):  # the conservative default: nothing is ever copied
        overrides = [f"method={method}", "budget=4096", *(f"method.{k}={v}" for k, v in fields.items()), *engine]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert run(root, *overrides, "reuse_full_cache=exact", base=base)["reused_share"] == 0
        return
    budget = tightest_budget(method, fields, prompt, total, model)
    overrides = [f"method={method}", f"budget={budget}", *(f"method.{k}={v}" for k, v in fields.items()), *engine]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        generated = run(root, *overrides, base=base)
        reused = run(root, *overrides, "reuse_full_cache=exact", base=base)
    own = {r["id"]: r for r in records(root / generated["run_id"])}
    copied = {r["id"]: r for r in records(root / reused["run_id"])}
    assert set(own) == set(copied) == set(vanilla)
    marked = [i for i, record in copied.items() if record.get(MARK)]
    assert 0 < len(marked) < LIMIT, f"budget {budget} should bind for some items only"
    assert reused["reused_share"] == pytest.approx(len(marked) / LIMIT) and generated["reused_share"] == 0
    for item, record in copied.items():
        strip = {key: value for key, value in record.items() if key not in BATCH_FIELDS}
        assert strip == {key: value for key, value in own[item].items() if key not in BATCH_FIELDS}, item
        if record.get(MARK):
            assert record[MARK] == source
            assert record["peak_slots"] <= budget and record["seconds"] is None


@pytest.mark.slow
def test_the_command_line_copies_every_record_that_fits(tmp_path, data_root):
    """The issue's command after the same with method=vanilla: its 3 records are copied, none generated."""
    args = ["model=tiny_qwen3", "dataset=gsm8k", "limit=3", "generation.max_new_tokens=32", "budget=4096",
            "device=cpu", f"results_dir={tmp_path}"]
    env = {"LONGFLOW_DATA_ROOT": str(data_root)}
    assert run_cli(*args, "method=vanilla", env=env).returncode == 0
    done = run_cli(*args, "method=h2o", "reuse_full_cache=exact", env=env)
    assert done.returncode == 0, done.stderr
    (path,) = [p for p in run_dirs(tmp_path) if "__h2o__" in p.name]
    assert [bool(r.get(MARK)) for r in records(path)] == [True] * 3
    assert not (path / "batches.jsonl").exists() or not (path / "batches.jsonl").read_text()


def test_a_missing_full_cache_run_generates_everything_and_says_so(tmp_path, data_root, monkeypatch, caplog):
    monkeypatch.setenv("LONGFLOW_DATA_ROOT", str(data_root))
    cfg = compose_config([*RUN, "limit=2", "generation.max_new_tokens=4", f"results_dir={tmp_path}", "method=h2o",
                          "reuse_full_cache=exact"])
    with caplog.at_level("WARNING", logger="evals.reuse"):
        (metrics,) = evaluate(cfg)
    assert metrics["reused_share"] == 0 and metrics["n_items"] == 2
    assert [r.levelname for r in caplog.records if "no full-cache run" in r.message] == ["WARNING"]


def test_copied_records_are_graded_by_the_runs_own_grader(tmp_path, data_root, monkeypatch):
    """A copy carries the full cache's output, not the grade its run's grader gave it: graded again
    here, so that the method's run holds the grades of one grader (the one its grader.json names)."""
    monkeypatch.setenv("LONGFLOW_DATA_ROOT", str(data_root))
    base = [*RUN, "limit=2", "generation.max_new_tokens=4", "budget=4096", f"results_dir={tmp_path}"]
    (full,) = evaluate(compose_config([*base, "method=vanilla"]))
    assert not any(record["correct"] for record in records(tmp_path / full["run_id"]))

    def lenient(requests, workers, timeout):  # another grader than the full cache's run had
        return [Grade(correct=True, extracted="2", reason="correct") for _ in requests]

    monkeypatch.setattr("evals.grading.regrade.grade_many", lenient)
    (metrics,) = evaluate(compose_config([*base, "method=h2o", "reuse_full_cache=exact"]))
    copies = records(tmp_path / metrics["run_id"])
    assert len(copies) == 2 and all(record[MARK] and record["correct"] for record in copies)
    assert metrics["accuracy"] == 1.0


def test_sampling_refuses_reuse_with_one_line():
    done = run_cli("model=tiny_qwen3", "generation=sampling", "method=h2o", "reuse_full_cache=exact", "device=cpu")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: reuse_full_cache=exact needs greedy decoding (a copied record is the full cache's greedy output); "
        "generation 'sampling' samples at temperature 0.6"]


def test_an_unknown_mode_is_refused():
    done = run_cli("model=tiny_qwen3", "method=h2o", "reuse_full_cache=maybe", "device=cpu")
    assert done.returncode == 2 and "reuse_full_cache must be one of" in done.stderr


def test_lf_repo_copies_by_output_length_alone():
    """The authors' rule: output shorter than 2048 tokens, whatever the prompt and the budget."""
    policy = policy_of("h2o", 64)
    spec = row_spec(tiny_engine(), 1000, types.SimpleNamespace(max_new_tokens=8192))
    short = {"prompt_tokens": 1000, "output_tokens": LF_REPO_BELOW - 1, "finish_reason": "stop"}
    long = {**short, "output_tokens": LF_REPO_BELOW}
    assert reusable("lf_repo", policy, short, spec) and not reusable("lf_repo", policy, long, spec)
    assert not reusable("exact", policy, short, spec)


def test_a_method_that_changes_a_storage_hook_cannot_guarantee():
    """The default is conservative: a class that overrides what its cache holds, and does not answer
    `compresses_within` itself, is never reused, however large its budget."""

    class Quantized(KVPolicy):
        name = "quantized"

        def store(self, layer, k, v):
            return super().store(layer, k.half().float(), v)

    spec = row_spec(tiny_engine(), 10, types.SimpleNamespace(max_new_tokens=8))
    assert Quantized(budget=10_000).compresses_within(10, 18, spec)
    assert not policy_of("h2o", 10_000).compresses_within(10, 18, spec)


def test_metrics_count_copies_like_generated_records_and_time_only_the_generated():
    identity = {"run_id": "r", "model": "m", "hub_id": "h", "method": "h2o", "variant": "paper", "budget": 64,
                "generation": "greedy", "dataset": "d", "dataset_size": 4, "generation_params": {"n_samples": 1},
                "reuse_full_cache": "exact"}

    def record(item, correct, reused):
        return {"id": item, "sample": 0, "correct": correct, "output_tokens": 10, "finish_reason": "stop",
                "reason": "ok", "peak_slots": 20, **({MARK: "full"} if reused else {})}

    generations = [record("a", True, True), record("b", False, True), record("c", True, True), record("d", True, False)]
    batches = [{"step_seconds": [0.5, 0.5], "prefill_seconds": 1.0, "generated_tokens": 10,
                "peak_memory_bytes": None, "device": "cpu"}]
    metrics = summarize(identity, generations, batches)
    assert metrics["reused_share"] == 0.75 and metrics["reuse_full_cache"] == "exact"
    assert metrics["accuracy"] == 0.75 and metrics["n_items"] == 4
    assert metrics["tokens_per_second"] == 10 / 2.0  # the one generated record's batch
    assert metrics["step_latency_ms"]["mean"] == 500.0


def test_table1_runs_the_full_cache_first_then_the_methods():
    """`make table1` (its launcher and shard forms too): a first sweep of the full cache alone, then
    one of every other method of the experiment, which copy from it."""
    experiment = yaml.safe_load((CONF_DIR / "experiment" / "table1.yaml").read_text())
    methods = experiment["hydra"]["sweeper"]["params"]["method"].split(",")
    for form in ([], ["LAUNCHER=local_gpus", "GPUS=8", "SHARDS=2"]):
        lines = subprocess.run(["make", "-n", "table1", "PY=python", *form], cwd=REPO, capture_output=True,
                               text=True, check=True).stdout.replace("\\\n", " ").splitlines()
        runs = [line.split() for line in lines if "evals.run" in line]
        assert len(runs) == 2
        swept = [argument.partition("=")[2].split(",") for run in runs for argument in run
                 if argument.startswith("method=")]
        assert swept[0] == ["vanilla"] and sorted(swept[1]) == sorted(set(methods) - {"vanilla"})
    assert experiment["reuse_full_cache"] == "exact"


def test_the_full_cache_run_is_one_whatever_the_reuse_mode():
    """The full cache reuses nothing: its run is the same under any mode, so the methods find it;
    a method's mode is part of its identity, `off` adding nothing to it."""
    job = Job(name="gsm8k", kind="math", items=[], size=1, fingerprint="f")
    tokenizer = types.SimpleNamespace(chat_template="t")

    def identity(*overrides):
        return Setup.from_config(compose_config(list(overrides))).identity(job, tokenizer)

    assert identity("method=vanilla", "reuse_full_cache=exact") == identity("method=vanilla")
    off, exact = identity("method=h2o"), identity("method=h2o", "reuse_full_cache=exact")
    assert "reuse_full_cache" not in off and exact == {**off, "reuse_full_cache": "exact"}
    assert full_cache_identity(exact) == identity("method=vanilla")
