"""Teacher-forced fidelity (`longflow.fidelity`): against plain HF forwards, on a hand-built model whose
needs are known, the metrics summary's definition, the run option (resumable, same run) and its figure."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import COMPRESSING, REPO, hf_attention, policy_of, tiny_model
from helpers.reports import is_png, write_run
from helpers.runs import BASE, records, run_cli, run_dirs
from transformers import RepetitionPenaltyLogitsProcessor

from baselines.streaming import StreamingPolicy
from baselines.vanilla import VanillaPolicy
from evals.metrics import summarize, summarize_fidelity, trailing_mean
from evals.report.figures import main as figures_main
from evals.report.figures import plot_fidelity
from evals.report.runs import collect
from evals.report.table import build_table
from longflow.config import GenerationConfig
from longflow.engine import Engine
from longflow.errors import UserError
from longflow.fidelity import teacher_force
from longflow.policy import KVPolicy

# Small budgets shrink the compression interval of interval methods, with a warning expected here.
pytestmark = pytest.mark.filterwarnings("ignore:.*leaves no room:UserWarning")
# One prompt shorter than the small budget below and one longer, so that prefill compression runs.
TEXTS = ["What is 2 + 3?", "Compute the sum of the first ten odd numbers, please, and then add five."]


def prompts_of(tokenizer) -> list[list[int]]:
    return [tokenizer(t)["input_ids"] for t in TEXTS]


def streaming_mask(length: int, prompt: int, budget: int, n_sink: int) -> torch.Tensor:
    """`[1, 1, length, length]` bool: what StreamingLLM lets each position see, as a plain mask.

    Prompt queries see the whole causal prompt (compression only decides what is kept after the
    prompt forward); a generated token's query sees the first `n_sink` positions and the last
    budget - n_sink positions, itself included.
    """
    query, key = torch.arange(length)[:, None], torch.arange(length)[None, :]
    seen = (query < prompt) | (key < n_sink) | (query - key < budget - n_sink)
    return ((key <= query) & seen)[None, None]


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_statistics_match_hf_forwards(tiny, penalty):
    """Reference: HF forwards over prompt + the reference tokens, no cache, SDPA with a plain causal
    mask (the full cache) and with StreamingLLM's mask (the method); logits processing by
    transformers' own repetition-penalty processor; KL by its formula."""
    model, tokenizer = tiny
    prompts = prompts_of(tokenizer)
    budget, n_sink, steps = 20, 4, 32
    assert len(prompts[0]) < budget - 1 < len(prompts[1])
    engine = Engine(model, lambda: StreamingPolicy(budget, n_sink=n_sink), [], tokenizer.pad_token_id)
    result = teacher_force(engine, prompts, GenerationConfig(max_new_tokens=steps, ignore_eos=True,
                                                             repetition_penalty=penalty), VanillaPolicy)
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    for row, prompt in enumerate(prompts):
        tokens = result.tokens[row]
        assert len(tokens) == len(result.agreement[row]) == len(result.kl[row]) == steps
        ids = torch.tensor([prompt + tokens[:-1]])
        with hf_attention(model), torch.no_grad():
            full = model(ids).logits[0, len(prompt) - 1:].float()
            mask = streaming_mask(ids.shape[1], len(prompt), budget, n_sink)
            compressed = model(ids, attention_mask=mask).logits[0, len(prompt) - 1:].float()
        for step in range(steps):
            context = torch.tensor([prompt + tokens[:step]])
            assert processor(context, full[step:step + 1].clone()).argmax().item() == tokens[step]
            choice = processor(context, compressed[step:step + 1].clone()).argmax().item()
            assert result.agreement[row][step] == (choice == tokens[step])
        log_p, log_q = full.log_softmax(dim=-1), compressed.log_softmax(dim=-1)
        expected_kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
        torch.testing.assert_close(torch.tensor(result.kl[row]), expected_kl, atol=2e-6, rtol=1e-3)
        assert expected_kl.sum() > 1e-3  # the budget is small enough to change the distributions


@pytest.mark.parametrize("method", COMPRESSING)
def test_a_budget_above_the_sequence_changes_nothing(tiny, method):
    model, tokenizer = tiny
    prompts, steps = prompts_of(tokenizer), 24
    generation = GenerationConfig(max_new_tokens=steps, ignore_eos=True)
    budget = max(map(len, prompts)) + steps
    engine = Engine(model, lambda: policy_of(method, budget), [], tokenizer.pad_token_id)
    result = teacher_force(engine, prompts, generation, VanillaPolicy)
    full = Engine(model, VanillaPolicy, [], tokenizer.pad_token_id).generate(prompts, generation, [0, 1])
    assert result.tokens == full.tokens  # the reference is the full cache's greedy output
    assert all(all(row) for row in result.agreement)
    assert max(max(row) for row in result.kl) < 1e-6


def test_rows_stop_at_the_reference_eos(tiny):
    model, tokenizer = tiny
    prompts = prompts_of(tokenizer)
    generation = GenerationConfig(max_new_tokens=12)
    free = Engine(model, VanillaPolicy, [], tokenizer.pad_token_id).generate(prompts, generation, [0, 1])
    stop = free.tokens[0][4]  # row 0's fifth token becomes an end-of-sequence token
    engine = Engine(model, lambda: StreamingPolicy(10, n_sink=2), [stop], tokenizer.pad_token_id)
    result = teacher_force(engine, prompts, generation, VanillaPolicy)
    assert result.tokens[0] == free.tokens[0][:free.tokens[0].index(stop) + 1]
    assert result.finish_reasons[0] == "eos"
    for row in range(2):
        assert len(result.agreement[row]) == len(result.kl[row]) == len(result.tokens[row])


def test_sampling_is_refused(tiny):
    model, tokenizer = tiny
    engine = Engine(model, lambda: StreamingPolicy(16), [], tokenizer.pad_token_id)
    with pytest.raises(UserError, match="greedy"):
        teacher_force(engine, prompts_of(tokenizer), GenerationConfig(temperature=0.6), VanillaPolicy)


# ---- a model whose needs are known: the harness must catch a broken method ----------------------


def copy_model(period: int, sharpness: float = 20.0, gain: float = 4.0):
    """The tiny Qwen3 rewired by hand so that its next token is the token `period` positions back:
    greedy decoding continues the last `period` tokens of any prompt forever.

    Channel 0 of every embedding is a constant, so the first layer's queries and keys, read from it
    alone, are the same for every token: with RoPE, a score then depends only on the distance
    between query and key. The key is the query rotated by `period - 1` positions, so the score
    peaks at that distance: on the three fastest rotary pairs, the next best distance within 100
    positions scores 0.83 of the peak, and `sharpness` makes the softmax pick the peak alone. The
    values carry a random code of the token (channels 1..32), which the output projection writes
    back `gain` times stronger than the token's own and which the LM head reads. Every other weight
    is zero (the second layer and both MLPs pass the residual through).
    """
    model, tokenizer = tiny_model("qwen3")
    config = model.config
    head_dim, kv_heads, q_heads = config.head_dim, config.num_key_value_heads, config.num_attention_heads
    width = kv_heads * head_dim  # channels of the token codes
    codes = torch.randn(config.vocab_size, width, generator=torch.Generator().manual_seed(0))
    codes = codes / codes.norm(dim=-1, keepdim=True) * math.sqrt(width)
    fast, half = 3, head_dim // 2  # rotary pair i is (dim i, dim i + half), rotated by position * inv_freq[i]
    angle = (period - 1) * model.model.rotary_emb.inv_freq[:fast]
    query, key = torch.zeros(head_dim), torch.zeros(head_dim)
    query[:fast] = 1.0
    key[:fast], key[half:half + fast] = torch.cos(angle), torch.sin(angle)
    attention = model.model.layers[0].self_attn
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.fill_(1.0)
        model.model.embed_tokens.weight[:, 0] = 8.0
        model.model.embed_tokens.weight[:, 1:1 + width] = codes
        model.lm_head.weight[:, 1:1 + width] = codes
        attention.q_proj.weight[:, 0] = query.repeat(q_heads)
        attention.k_proj.weight[:, 0] = key.repeat(kv_heads)
        attention.q_norm.weight.fill_(sharpness)
        for group in range(kv_heads):  # the first query head of each KV head writes its half of the code
            channels, dims = slice(1 + group * head_dim, 1 + (group + 1) * head_dim), slice(group * head_dim,
                                                                                              (group + 1) * head_dim)
            head = group * (q_heads // kv_heads)
            attention.v_proj.weight[dims, channels] = torch.eye(head_dim)
            attention.o_proj.weight[channels, head * head_dim:(head + 1) * head_dim] = gain * torch.eye(head_dim)
    return model, tokenizer


class EvictNewest(KVPolicy):
    """Deliberately wrong: once the cache is full, each new token overwrites the previous one, so a
    query sees the kept prompt and itself, never the tokens generated in between."""

    name = "evict_newest"

    def score(self, obs) -> torch.Tensor:
        return -obs.positions  # the newest slot scores lowest (free slots still come first)


def test_a_broken_method_is_caught():
    period, budget, steps = 5, 16, 40
    model, tokenizer = copy_model(period)
    prompts = [torch.randperm(200, generator=torch.Generator().manual_seed(row))[:24].add(10).tolist()
               for row in range(4)]
    generation = GenerationConfig(max_new_tokens=steps, ignore_eos=True)

    def fidelity(policy_factory):
        engine = Engine(model, policy_factory, [], tokenizer.pad_token_id)
        result = teacher_force(engine, prompts, generation, VanillaPolicy)
        return result, np.mean(result.agreement), np.mean(result.kl)

    faithful, faithful_agreement, faithful_kl = fidelity(lambda: StreamingPolicy(budget, n_sink=4))
    for prompt, tokens in zip(prompts, faithful.tokens, strict=True):  # the model does what it was built for
        sequence = prompt + tokens
        assert tokens == [sequence[t - period] for t in range(len(prompt), len(sequence))]
    # StreamingLLM's window (budget - n_sink = 12 positions) covers the distance the model reads from.
    assert faithful_agreement == 1.0 and faithful_kl < 1e-3
    _, broken_agreement, broken_kl = fidelity(lambda: EvictNewest(budget))
    assert broken_agreement < 0.5 and broken_kl > 1.0


# ---- the summary's definition ------------------------------------------------------------------


def fidelity_record(agreement: list[int], kl: list[float], item: str = "0") -> dict:
    return {"id": item, "agreement": agreement, "kl": kl}


def test_summary_definition():
    records = [fidelity_record([1, 1, 1, 1, 0, 0, 1, 0], [0.0, 0.1, 0.1, 0.2, 0.5, 0.5, 0.3, 0.6], "a"),
               fidelity_record([1, 1, 0, 0, 0], [0.0, 0.2, 0.4, 0.4, 1.0], "b")]
    # Per step (agreeing, running): (2,2) (2,2) (1,2) (1,2) (0,2) (0,1) (1,1) (0,1). Trailing
    # windows of 4 steps, pooled: t=3: 6/8, t=4: 4/8, t=5: 2/7, t=6: 2/6, t=7: 1/5.
    expected = [math.nan] * 3 + [6 / 8, 4 / 8, 2 / 7, 2 / 6, 1 / 5]
    np.testing.assert_allclose(trailing_mean(records, "agreement", window=4), expected)
    summary = summarize_fidelity(records, window=4, threshold=0.5)
    assert summary["divergence_step"] == 5  # 0.5 at t=4 is not below the threshold
    assert summary["n_items"] == 2 and summary["n_tokens"] == 13
    assert summary["agreement"] == pytest.approx(7 / 13)
    assert summary["kl"] == pytest.approx(4.3 / 13)
    assert summarize_fidelity(records, window=4, threshold=0.25)["divergence_step"] == 7
    assert summarize_fidelity(records, window=4, threshold=0.1)["divergence_step"] is None
    assert summarize_fidelity(records, window=9, threshold=1.0)["divergence_step"] is None  # no full window


def test_metrics_carry_the_summary_only_with_records():
    identity = {"run_id": "r", "model": "m", "hub_id": "h", "method": "h2o", "variant": "paper", "budget": 8,
                "generation": "greedy", "dataset": "d", "dataset_size": 1, "generation_params": {"n_samples": 1}}
    generations = [{"id": "0", "correct": False, "output_tokens": 3, "finish_reason": "eos", "reason": "wrong"}]
    assert "fidelity" not in summarize(identity, generations, [])
    records = [fidelity_record([1, 0, 1], [0.0, 0.2, 0.1])]
    assert summarize(identity, generations, [], records)["fidelity"] == summarize_fidelity(records)


# ---- the run option ----------------------------------------------------------------------------


def test_fidelity_option_errors_are_one_line(tmp_path):
    for args, needle in ((["fidelity=true", "generation=sampling"], "fidelity=true needs greedy decoding"),
                         (["fidelity=maybe"], "fidelity must be true or false")):
        result = run_cli(*args, f"results_dir={tmp_path}", timeout=120)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and len(lines) == 1 and needle in lines[0], result.stderr


def fidelity_records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "fidelity.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_fidelity_joins_the_run_and_resumes(tmp_path):
    args = [*BASE, "method=h2o", "limit=2", f"results_dir={tmp_path}"]
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr
    before = {run.name: (records(run), (run / "batches.jsonl").read_text()) for run in run_dirs(tmp_path)}

    added = run_cli(*args, "fidelity=true")
    assert added.returncode == 0, added.stderr
    runs = run_dirs(tmp_path)
    assert [run.name for run in runs] == sorted(before)  # the same runs: fidelity is not part of the identity
    complete = {}
    for run in runs:
        assert (records(run), (run / "batches.jsonl").read_text()) == before[run.name]  # nothing regenerated
        complete[run.name] = fidelity_records(run)
        assert sorted(r["id"] for r in complete[run.name]) == sorted(r["id"] for r in records(run))
        for record in complete[run.name]:
            assert len(record["agreement"]) == len(record["kl"]) == record["reference_tokens"] == 24
        metrics = json.loads((run / "metrics.json").read_text())
        assert metrics["fidelity"] == summarize_fidelity(complete[run.name])

    run = runs[0]
    lines = (run / "fidelity.jsonl").read_text().splitlines()
    (run / "fidelity.jsonl").write_text(lines[0] + "\n" + lines[1][:20])  # one record lost, one torn
    resumed = run_cli(*args, "fidelity=true")
    assert resumed.returncode == 0, resumed.stderr
    restored = {r["id"]: r for r in fidelity_records(run)}
    assert len(restored) == len(complete[run.name])  # no duplicates
    for record in complete[run.name]:
        # The redone item runs in a smaller batch (less padding): float rounding may move KL's last digit.
        again = restored[record["id"]]
        assert again["agreement"] == record["agreement"]
        np.testing.assert_allclose(again["kl"], record["kl"], rtol=2e-3, atol=1e-7)

    regraded = subprocess.run([sys.executable, "-m", "evals.grading", str(run)], cwd=REPO, capture_output=True,
                              text=True, timeout=120)
    assert regraded.returncode == 0, regraded.stderr
    assert json.loads((run / "metrics.json").read_text())["fidelity"] == summarize_fidelity(fidelity_records(run))


@pytest.mark.slow
def test_vanilla_has_no_fidelity_pass(tmp_path):
    result = run_cli(*BASE, "method=vanilla", "limit=1", "fidelity=true", f"results_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    for run in run_dirs(tmp_path):
        assert not (run / "fidelity.jsonl").exists()
        assert "fidelity" not in json.loads((run / "metrics.json").read_text())


# ---- the figure --------------------------------------------------------------------------------


def test_fidelity_figure(tmp_path, capsys):
    root = tmp_path / "runs"
    write_run(root, "tiny_qwen3", "vanilla", None, "gsm8k", 0.6)
    rng = np.random.default_rng(0)
    for budget in (128, 256):
        for method in ("streaming", "longflow"):
            write_run(root, "tiny_qwen3", method, budget, "gsm8k", 0.5)
            run = next(root.glob(f"*__{method}__b{budget}__*"))
            lines = [json.dumps(fidelity_record((rng.random(n) < 0.9).astype(int).tolist(),
                                                rng.random(n).tolist(), str(i)))
                     for i, n in enumerate((40, 64, 64))]
            (run / "fidelity.jsonl").write_text("\n".join(lines) + "\n")
    png, pdf = plot_fidelity(collect(root), tmp_path / "figs")
    assert is_png(png) and pdf.suffix == ".pdf"
    assert figures_main(["--runs", str(root), "--out", str(tmp_path / "all")]) == 0
    printed = [p.rsplit("/", 1)[-1] for p in capsys.readouterr().out.split()]
    assert {"accuracy_vs_budget.png", "accuracy_by_method.png", "throughput_vs_budget.png"} < set(printed)
    assert printed[-2:] == ["fidelity_vs_step.png", "fidelity_vs_step.pdf"]  # by default, after the others
    without = tmp_path / "plain"
    write_run(without, "tiny_qwen3", "h2o", 128, "gsm8k", 0.5)
    with pytest.raises(UserError, match="fidelity=true"):
        plot_fidelity(collect(without), tmp_path / "figs")


def test_fidelity_table(tmp_path):
    root = tmp_path / "runs"
    write_run(root, "tiny_qwen3", "vanilla", None, "gsm8k", 0.6)
    for method, agreement, kl in (("streaming", 0.5, 0.2), ("longflow", 0.8, 0.1)):
        write_run(root, "tiny_qwen3", method, 128, "gsm8k", 0.5)
        metrics = next(root.glob(f"*__{method}__*")) / "metrics.json"
        metrics.write_text(json.dumps({**json.loads(metrics.read_text()),
                                       "fidelity": {"agreement": agreement, "kl": kl}}))
    # Agreement in percent, higher is better; KL as is, lower is better: LongFlow is bold in both.
    for metric, values in (("fidelity.agreement", [50.0, 80.0]), ("fidelity.kl", [0.2, 0.1])):
        table = build_table(collect(root), metric)
        column = table.values.columns[0]
        by_method = table.values[column].droplevel(["Model", "Budget"])
        assert math.isnan(by_method["FullKV"]) and by_method[["StreamingLLM", "LongFlow"]].tolist() == values
        bold = table.bold[column].droplevel(["Model", "Budget"])
        assert bold["LongFlow"] and not bold["StreamingLLM"]
