"""`evals.report.table` on fake run directories: values, Avg., rows by budget, bold within a budget, item counts,
partial marks, standard errors, outputs (the LaTeX compiled when a LaTeX engine is installed)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from helpers.reports import write_run, write_sweep

from evals.report.runs import collect, collect_sweep
from evals.report.table import (
    best_in_group,
    build_table,
    main,
    render_latex,
    render_markdown,
    table_csv,
    write_table,
)
from longflow.errors import UserError


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "runs"
    q, llama = "tiny_qwen3", "tiny_llama"
    write_run(root, q, "vanilla", None, "gsm8k", 0.75)
    write_run(root, q, "vanilla", None, "math500", 0.5)
    write_run(root, q, "h2o", 64, "gsm8k", 0.25)
    write_run(root, q, "h2o", 64, "math500", 0.5)
    write_run(root, q, "longflow", 64, "gsm8k", 0.5)
    write_run(root, q, "longflow", 64, "math500", 0.25, n_items=4)  # partial
    write_run(root, q, "rkv", 64, "gsm8k", 0.5)  # ties LongFlow on GSM8K; no MATH-500
    write_run(root, q, "h2o", 64, "gsm8k", 0.125, variant="lf_repo")
    write_run(root, llama, "vanilla", None, "gsm8k", 1.0)
    write_run(root, llama, "streaming", 64, "gsm8k", 0.25)
    write_run(root, llama, "longflow", 64, "gsm8k", 0.0, mtime=1_000_000)  # older duplicate, dropped
    write_run(root, llama, "longflow", 64, "gsm8k", 0.75, mtime=2_000_000)
    write_run(root, llama, "longflow", 64, "aime24", 1 / 3)
    write_run(root, llama, "longflow", 64, "demo", 0.5)  # a dataset without a display name
    (root / "torn").mkdir()
    (root / "torn" / "metrics.json").write_text('{"model": "tiny_qwen3", "meth')
    (root / "nokeys").mkdir()
    (root / "nokeys" / "metrics.json").write_text('{"accuracy": 0.5}')
    (root / ".hydra" / "x").mkdir(parents=True)
    (root / ".hydra" / "x" / "metrics.json").write_text("not json")
    return root


def test_collect_skips_bad_files(runs, capsys):
    frame = collect(runs)
    assert len(frame) == 14
    err = capsys.readouterr().err
    assert err.count("warning: skipping") == 2 and "torn" in err and "nokeys" in err and ".hydra" not in err
    assert frame["budget"].isna().sum() == 3
    assert "step_latency_ms.p50" in frame


def test_table_layout_values_and_bold(runs):
    table = build_table(collect(runs))
    values, bold = table.values, table.bold
    assert list(values.columns) == ["AIME24 (30)", "GSM8K (1319)", "MATH-500 (500)", "demo (8)", "Avg."]
    assert list(values.index.names) == ["Model", "Budget", "Method"]
    assert list(values.index) == [
        ("tiny_llama", "-", "FullKV"), ("tiny_llama", "64", "StreamingLLM"), ("tiny_llama", "64", "LongFlow"),
        ("tiny_qwen3", "-", "FullKV"), ("tiny_qwen3", "64", "H2O"), ("tiny_qwen3", "64", "H2O (lf_repo)"),
        ("tiny_qwen3", "64", "Δ H2O (paper − lf_repo)"),  # a variant follows its method, then the difference
        ("tiny_qwen3", "64", "R-KV"), ("tiny_qwen3", "64", "LongFlow"),
    ]
    delta = values.loc[("tiny_qwen3", "64", "Δ H2O (paper − lf_repo)")]
    assert delta["GSM8K (1319)"] == 12.5 and pd.isna(delta["MATH-500 (500)"])
    assert delta["Avg."] == 12.5  # over GSM8K, the one dataset both variants ran
    assert table.delta.sum() == 1 and not bold.loc[("tiny_qwen3", "64", "Δ H2O (paper − lf_repo)")].any()
    row = values.loc[("tiny_qwen3", "64", "LongFlow")]
    assert row["GSM8K (1319)"] == 50.0 and row["MATH-500 (500)"] == 25.0 and pd.isna(row["AIME24 (30)"])
    assert row["Avg."] == 37.5
    assert values.loc[("tiny_llama", "64", "LongFlow"), "GSM8K (1319)"] == 75.0  # newest of the two
    assert values.loc[("tiny_llama", "64", "LongFlow"), "Avg."] == pytest.approx((100 / 3 + 75 + 50) / 3)
    assert values.loc[("tiny_qwen3", "64", "R-KV"), "Avg."] == 50.0  # over its one dataset
    assert any("2 runs with no run.json to tell them apart, kept the newest" in note for note in table.notes)

    bold_cells = {(model, method, column) for (model, _, method, column), b in bold.stack().items() if b}
    # Only cells over the same items compete: LongFlow's MATH-500 run stopped at 4 of 500 items, so
    # H2O has no rival there; an Avg. over fewer datasets (R-KV's, StreamingLLM's) is another mean.
    assert bold_cells == {
        ("tiny_llama", "LongFlow", "GSM8K (1319)"),
        ("tiny_qwen3", "R-KV", "GSM8K (1319)"), ("tiny_qwen3", "LongFlow", "GSM8K (1319)"),  # a tie
    }
    assert any(note.startswith("bold: the best compressed method") for note in table.notes)
    # FullKV is the reference, never bold, though it beats every method of tiny_qwen3 on GSM8K.
    assert not bold.xs("FullKV", level="Method").to_numpy().any()
    assert table.partial.loc[("tiny_qwen3", "64", "LongFlow"), "MATH-500 (500)"]
    assert table.partial.loc[("tiny_qwen3", "64", "LongFlow"), "Avg."]
    assert table.partial.to_numpy().sum() == 2
    assert table.footnotes == ["† incomplete: tiny_qwen3 / 64 / LongFlow / MATH-500 (500): 4 of 500 items"]


def test_bold_rules():
    index = pd.MultiIndex.from_tuples(
        [("m", "-", "FullKV"), ("m", "64", "H2O"), ("m", "64", "R-KV"), ("m", "64", "LongFlow"),
         ("n", "-", "FullKV"), ("n", "64", "H2O")], names=["Model", "Budget", "Method"])
    values = pd.DataFrame({"tie": [9.0, 1.0, 1.0, 1.0, 9.0, 1.0], "ms": [1.0, 3.04, 4.0, 3.01, 2.0, 5.0]},
                          index=index)
    candidate = pd.DataFrame({column: [False, True, True, True, False, True] for column in values}, index=index)
    bold = best_in_group(values, candidate, decimals=1, lower=True)
    assert not bold["tie"].any()  # all candidates tie: nothing stands out; model n has one candidate
    assert bold["ms"].tolist() == [False, True, False, True, False, False]  # 3.0 and 3.0 as shown
    bold = best_in_group(values, candidate, decimals=2, lower=True)
    assert bold["ms"].tolist() == [False, False, False, True, False, False]


def test_bold_within_each_budget(tmp_path):
    """The paper's layout: FullKV, then a block per budget, the best of each block bold."""
    root = tmp_path / "runs"
    write_run(root, "r1_distill_llama_8b", "vanilla", None, "gsm8k", 0.9)
    for budget, scores in ((128, {"h2o": 0.25, "longflow": 0.5, "rkv": 0.4}),
                           (512, {"h2o": 0.75, "longflow": 0.7, "rkv": 0.6})):
        for method, accuracy in scores.items():
            write_run(root, "r1_distill_llama_8b", method, budget, "gsm8k", accuracy)
    table = build_table(collect(root))
    assert list(table.values.index) == [
        ("R1-Distill-Llama-8B", "-", "FullKV"), ("R1-Distill-Llama-8B", "128", "H2O"),
        ("R1-Distill-Llama-8B", "128", "R-KV"), ("R1-Distill-Llama-8B", "128", "LongFlow"),
        ("R1-Distill-Llama-8B", "512", "H2O"), ("R1-Distill-Llama-8B", "512", "R-KV"),
        ("R1-Distill-Llama-8B", "512", "LongFlow")]
    bold = table.bold["GSM8K (1319)"]
    assert list(bold[bold].index.get_level_values("Method")) == ["LongFlow", "H2O"]  # one per budget, no FullKV
    md = render_markdown(table)
    assert "| R1-Distill-Llama-8B | - | FullKV | 90.0 |" in md  # one column: no Avg. repeating it
    assert "|  | 512 | H2O | **75.0** |" in md and "|  |  | R-KV | 60.0 |" in md


def test_header_counts_the_items_run(tmp_path):
    """A limited sweep: the header says how many items were run of how many, a run killed short of
    them is marked and not compared, and a note says the column is a subset of its benchmark."""
    root = tmp_path / "runs"
    write_run(root, "m", "vanilla", None, "gsm8k", 0.5, n_items=8, planned=8)
    write_run(root, "m", "h2o", 64, "gsm8k", 0.25, n_items=8, planned=8)
    write_run(root, "m", "longflow", 64, "gsm8k", 0.4, n_items=5, planned=8)  # killed at 5
    write_run(root, "m", "h2o", 64, "math500", 0.5)  # complete, no items.json: the whole benchmark
    table = build_table(collect(root))
    assert list(table.values.columns) == ["GSM8K (8 of 1319)", "MATH-500 (500)", "Avg."]
    assert table.partial["GSM8K (8 of 1319)"].tolist() == [False, False, True]
    assert not table.bold.to_numpy().any()  # H2O's 25.0 has no finished rival over the same 8 items
    assert table.footnotes == ["† incomplete: 64 / LongFlow / GSM8K (8 of 1319): 5 of 8 items"]  # one model
    assert "a column of N of M items holds the first N of its benchmark: GSM8K (8 of 1319)" in table.notes


def test_stderr(tmp_path):
    root = tmp_path / "runs"
    write_run(root, "m", "h2o", 64, "gsm8k", 0.25, accuracy_stderr=0.03)
    write_run(root, "m", "h2o", 64, "math500", 0.5, accuracy_stderr=0.04)
    write_run(root, "m", "h2o", 64, "aime24", 0.5)  # made before runs recorded it: no ±
    write_run(root, "m", "h2o", 64, "gsm8k", 0.125, variant="lf_repo", accuracy_stderr=0.02)
    write_run(root, "m", "h2o", 64, "math500", 0.25, variant="lf_repo", accuracy_stderr=0.06)
    table = build_table(collect(root), stderr=True)
    row = table.stderr.loc[("m", "64", "H2O")]
    assert row["GSM8K (1319)"] == pytest.approx(3.0) and pd.isna(row["AIME24 (30)"])
    assert pd.isna(row["Avg."])  # AIME24 has none: the mean's would be too small
    assert table.stderr.loc[("m", "64", "H2O (lf_repo)"), "Avg."] == pytest.approx((2.0**2 + 6.0**2) ** 0.5 / 2)
    assert table.stderr.loc[("m", "64", "Δ H2O (paper − lf_repo)")].isna().all()
    md = render_markdown(table)
    assert "| m | 64 | H2O | 50.0 | **25.0** ± 3.0 | **50.0** ± 4.0 | 41.7 |" in md  # lf_repo's Avg. lacks AIME24
    assert r"{\scriptsize $\pm$3.0}" in render_latex(table)
    csv = table_csv(table)
    assert csv["GSM8K (1319) SE"].tolist()[0] == pytest.approx(3.0)
    with pytest.raises(UserError, match="--stderr is for --metric accuracy"):
        build_table(collect(root), "tokens_per_second", stderr=True)


def test_markdown_marks(runs):
    md = render_markdown(build_table(collect(runs)))
    print(md)
    lines = md.splitlines()
    assert lines[0] == ("| Model | Budget | Method | AIME24 (30) | GSM8K (1319) | MATH-500 (500) | demo (8) "
                        "| Avg. |")
    assert lines[1] == "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"
    assert lines[2] == "| tiny_llama | - | FullKV | - | 100.0 | - | - | 100.0 |"
    assert "|  | 64 | H2O | - | 25.0 | 50.0 | - | 37.5 |" in md  # model shown once, budget once per block
    assert "|  |  | LongFlow | - | **50.0** | 25.0† | - | 37.5† |" in md
    assert "† incomplete: tiny_qwen3 / 64 / LongFlow / MATH-500 (500): 4 of 500 items" in md
    assert "|  |  | Δ H2O (paper − lf_repo) | - | +12.5 | - | - | +12.5 |" in md


def test_outputs_and_csv_round_trip(runs, tmp_path):
    table = build_table(collect(runs))
    paths = write_table(table, tmp_path / "out" / "table1")
    assert [p.name for p in paths] == ["table1.md", "table1.tex", "table1.csv"]
    assert all(p.stat().st_size > 0 for p in paths)
    back = pd.read_csv(paths[2])
    expected = table_csv(table)
    assert list(back.columns) == list(expected.columns)
    numeric = list(table.values.columns)
    pd.testing.assert_frame_equal(back[numeric], expected[numeric], check_dtype=False)
    assert back["Budget"].isna().sum() == 2 and set(back["Budget"].dropna()) == {64}
    assert back["Partial"].fillna("").tolist().count("MATH-500 (500)") == 1
    assert not back.astype(str).apply(lambda c: c.str.contains(r"\*|†|textbf")).to_numpy().any()
    tex = paths[1].read_text()
    assert r"\toprule" in tex and r"\bottomrule" in tex and r"\textbf{50.0}" in tex
    assert r"tiny\_qwen3" in tex and r"25.0$^\dagger$" in tex and r"4 of 500 items" in tex
    assert tex == render_latex(table)


def test_filters_and_generation_key(runs):
    write_run(runs, "tiny_qwen3", "h2o", 64, "gsm8k", 0.5, generation="sampling", **{"pass_at_k": {"1": 0.5}})
    frame = collect(runs)
    assert "Gen." in build_table(frame).values.index.names  # two generation configs: a row key
    table = build_table(frame[frame["generation"] == "greedy"], metric="tokens_per_second")
    assert table.values.loc[("tiny_qwen3", "64", "H2O"), "GSM8K (1319)"] == pytest.approx(156.25)
    with pytest.raises(UserError, match="unknown metric"):
        build_table(frame, metric="nonsense")
    with pytest.raises(UserError, match="no selected run has a number"):
        build_table(frame, metric="peak_memory_gb")  # null on the CPU


def test_cli(runs, tmp_path, capsys):
    out = tmp_path / "t" / "table1"
    assert main(["--runs", str(runs), "--out", str(out), "--model", "tiny_qwen3", "--dataset", "GSM8K"]) == 0
    printed = capsys.readouterr().out
    assert "| Model | Budget | Method | GSM8K (1319) |" in printed and "tiny_llama" not in printed
    assert out.with_name("table1.csv").exists()


def test_no_runs(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError):
        build_table(collect(tmp_path / "empty"))
    assert main(["--runs", str(tmp_path / "empty"), "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no metrics.json found under") and len(err.strip().splitlines()) == 1
    assert main(["--runs", str(tmp_path / "missing")]) == 2


LATEX_DOCUMENT = ("\\documentclass{article}\n\\usepackage[T1]{fontenc}\n\\usepackage{booktabs}\n"
                  "\\begin{document}\n%s\\end{document}\n")


def test_latex_is_a_table_with_a_caption(runs, tmp_path):
    """Every row has one cell per column, environments open and close in order, models are named in
    rows of their own, and a LaTeX engine, when one is installed, compiles it."""
    write_run(runs, "tiny_qwen3", "h2o", 128, "gsm8k", 0.5, accuracy_stderr=0.01)
    table = build_table(collect(runs), stderr=True)
    tex = render_latex(table, label="tab:main")
    lines = tex.splitlines()
    assert lines[:5] == [r"\begin{table}[t]", r"\centering", lines[2], r"\label{tab:main}", r"\small"]
    assert lines[2].startswith(r"\caption{Accuracy (\%) of tiny\_llama, tiny\_qwen3, rows grouped by KV budget")
    assert lines[-1] == r"\end{table}" and r"\begin{tabular}{llrrrrr}" in lines
    assert lines.index(r"\toprule") < lines.index(r"\bottomrule") < lines.index(r"\end{tabular}")
    rows = [line for line in lines if line.endswith(r"\\") and not line.startswith(r"\multicolumn")]
    assert all(row.count(" & ") == 6 for row in rows)  # Budget, Method and five columns
    assert r"\multicolumn{7}{l}{\textit{tiny\_qwen3}} \\" in lines
    assert r" & $\Delta$ H2O (paper $-$ lf\_repo) & - & +12.5 & - & - & +12.5 \\" in lines
    assert lines[lines.index(r"\end{tabular}") + 1].startswith(r"\par\smallskip{\footnotesize $^\dagger$ incomplete:")
    assert render_latex(table, wide=True).startswith(r"\begin{table*}[t]")
    if shutil.which("pdflatex") is None:
        return
    (tmp_path / "doc.tex").write_text(LATEX_DOCUMENT % tex)
    result = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "doc.tex"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    assert (tmp_path / "doc.pdf").stat().st_size > 1000


def test_budget_forms_other_than_the_cap_are_rows_of_their_own(tmp_path):
    """A run of a method's uncapped form (RPC's `ratio`, R-KV's `target`) is its own row, named so,
    with its peak slots above the budget; runs recorded without a budget form are the cap's."""
    root = tmp_path / "runs"
    write_run(root, "tiny_qwen3", "rpc", 64, "gsm8k", 0.5, budget_mode="cap")
    write_run(root, "tiny_qwen3", "rpc", 64, "gsm8k", 0.75, budget_mode="ratio", peak_kv_slots=300, mtime=1)
    write_run(root, "tiny_qwen3", "rkv", 64, "gsm8k", 0.25)
    write_run(root, "tiny_qwen3", "rkv", 64, "gsm8k", 0.125, budget_mode="target", peak_kv_slots=191, mtime=1)
    accuracy = build_table(collect(root))
    methods = list(accuracy.values.index.get_level_values("Method"))
    assert methods == ["R-KV", "R-KV (target)", "RPC", "RPC (ratio)"]
    peaks = build_table(collect(root), metric="peak_kv_slots").values["GSM8K (1319)"]
    assert list(peaks) == [64, 191, 64, 300]


def test_runs_of_other_limits_are_other_columns(tmp_path):
    """Issue 28's trap: runs of 8, 16 and 48 canary items in one folder are three columns, each over
    its own items; no cell is bolded against a cell over other items."""
    root = tmp_path / "runs"
    write_run(root, "canary", "vanilla", None, "canary", 1.0, n_items=48, planned=48)
    write_run(root, "canary", "h2o", 96, "canary", 0.5, n_items=8, planned=8)
    write_run(root, "canary", "rkv", 96, "canary", 0.25, n_items=16, planned=16)
    write_run(root, "canary", "longflow", 96, "canary", 0.125, n_items=48, planned=48)
    write_run(root, "canary", "rkv", 96, "canary", 0.375, n_items=48, planned=48, mtime=2_000_000)
    table = build_table(collect(root))
    assert list(table.values.columns) == ["canary (8 of 200)", "canary (16 of 200)", "canary (48 of 200)"]
    bold = table.bold
    assert bold.sum().sum() == 1 and bold.loc[("canary", "96", "R-KV"), "canary (48 of 200)"]
    assert "no Avg.: the columns hold one dataset over different item sets" in table.notes
    assert "no FullKV run of canary over canary (16 of 200), canary (8 of 200): no full-cache reference there" \
        in table.notes


def test_same_count_other_items_are_other_columns(tmp_path):
    """Two runs of 16 items that are not the same 16 (another generator setting) do not share a column."""
    root = tmp_path / "runs"
    first = write_run(root, "canary", "h2o", 96, "canary", 0.5, n_items=16, planned=16)
    other = write_run(root, "canary", "rkv", 96, "canary", 0.25, n_items=16, planned=16)
    (other / "items.json").write_text(json.dumps([f"x{i}" for i in range(16)]))
    columns = list(build_table(collect(root)).values.columns)
    assert len(columns) == 2 and all(c.startswith("canary (16 of 200, items ") for c in columns)
    assert first.exists()


def test_dirty_runs_are_marked(tmp_path):
    root = tmp_path / "runs"
    clean = write_run(root, "m", "h2o", 64, "gsm8k", 0.25)
    dirty = write_run(root, "m", "longflow", 64, "gsm8k", 0.5)
    (clean / "provenance.json").write_text(json.dumps([{"git_commit": "a", "git_dirty": False}]))
    (dirty / "provenance.json").write_text(json.dumps([{"git_dirty": False}, {"git_dirty": True}]))  # resumed dirty
    write_run(root, "m", "rkv", 64, "gsm8k", 0.125)  # no provenance.json: not marked
    table = build_table(collect(root))
    assert table.dirty["GSM8K (1319)"].tolist() == [False, False, True]  # H2O, R-KV, LongFlow
    md = render_markdown(table)
    assert "| **50.0**‡ |" in md
    assert "‡ made by uncommitted code (provenance.json): 64 / LongFlow / GSM8K (1319)" in md
    assert table_csv(table)["Dirty"].tolist() == ["", "", "GSM8K (1319)"]
    assert r"\textbf{50.0}$^\ddagger$" in render_latex(table)


def test_sweep_and_filters(tmp_path, capsys):
    """--sweep reads exactly the runs its sweep.json lists (paths absolute, or relative to the sweep
    folder); --method and --budget keep FullKV as the reference; --limit picks runs by item count."""
    root = tmp_path / "runs"
    ours = [write_run(root, "canary", "vanilla", None, "canary", 1.0, n_items=16, planned=16),
            write_run(root, "canary", "h2o", 96, "canary", 0.5, n_items=16, planned=16),
            write_run(root, "canary", "h2o", 192, "canary", 0.75, n_items=16, planned=16),
            write_run(root, "canary", "rkv", 96, "canary", 0.25, n_items=16, planned=16)]
    write_run(root, "canary", "h2o", 384, "canary", 0.875, n_items=48, planned=48)  # another sweep's
    sixteen = [str(i) for i in range(16)]
    # vanilla: two jobs, one run
    sweep = write_sweep(tmp_path / "sweep", [[(run, sixteen)] for run in [*ours, ours[0], root / "never_ran"]])
    out = tmp_path / "t" / "table"
    assert main(["--sweep", str(sweep), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "never_ran is in the sweep but has no metrics.json" in captured.err
    assert "384" not in captured.out and "canary (16 of 200)" in captured.out and "kept the newest" not in captured.out
    assert main(["--runs", str(root), "--out", str(out), "--method", "h2o", "--budget", "96"]) == 0
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("| canary") or line.startswith("|  |")]
    assert rows == ["| canary | - | FullKV | 100.0 |", "|  | 96 | H2O | 50.0 |"]
    assert main(["--runs", str(root), "--out", str(out), "--limit", "48"]) == 0
    printed = capsys.readouterr().out
    assert "canary (48 of 200)" in printed and "(16 of 200)" not in printed
    relative = write_sweep(tmp_path / "rel", [[(Path("..") / "runs" / run.name, sixteen)] for run in ours[:2]])
    assert len(collect_sweep(relative)) == 2
    assert main(["--sweep", str(tmp_path / "nowhere")]) == 2
    assert "sweep.json does not exist" in capsys.readouterr().err


def test_every_run_dirty_is_one_line(tmp_path):
    root = tmp_path / "runs"
    for method in ("h2o", "longflow"):
        run = write_run(root, "m", method, 64, "gsm8k", 0.5)
        (run / "provenance.json").write_text(json.dumps([{"git_dirty": True}]))
    table = build_table(collect(root))
    assert not table.dirty.to_numpy().any()
    assert table.footnotes == ["every run was made by uncommitted code (provenance.json)"]


def test_a_filter_that_matches_nothing_is_an_error_naming_what_there_is(runs, tmp_path, capsys):
    out = str(tmp_path / "t")
    assert main(["--runs", str(runs), "--out", out, "--method", "h2oo"]) == 2
    assert (f"error: --method h2oo matches nothing in {runs}, which has method h2o, longflow, rkv, streaming, "
            "vanilla\n") in capsys.readouterr().err
    assert main(["--runs", str(runs), "--out", out, "--budget", "97"]) == 2
    assert f"error: --budget 97 matches nothing in {runs}, which has budget 64\n" in capsys.readouterr().err
    assert main(["--runs", str(runs), "--out", out, "--method", "streaming", "--model", "tiny_qwen3"]) == 2
    assert f"error: nothing in {runs} matches the filters together (FullKV aside" in capsys.readouterr().err
    assert main(["--runs", str(runs), "--out", out, "--method", "vanilla"]) == 0  # FullKV alone, as asked
    assert not (tmp_path / "results").exists()


def test_the_default_output_is_not_table_1(runs, tmp_path, monkeypatch, capsys):
    """`make table1` writes results/table1.*; a table without --out goes where `make table` writes."""
    monkeypatch.chdir(tmp_path)
    assert main(["--runs", str(runs)]) == 0
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["table.csv", "table.md", "table.tex"]
    assert main(["--runs", str(runs), "--metric", "peak_kv_slots"]) == 0
    assert (tmp_path / "results" / "table_peak_kv_slots.md").exists()


def test_a_reader_that_stops_early_gets_the_files_and_no_traceback(runs, tmp_path):
    """`evals.report.table ... | head`: the reader closes the pipe before the table is printed."""
    out = tmp_path / "t" / "table"
    table = subprocess.Popen([sys.executable, "-m", "evals.report.table", "--runs", str(runs), "--out", str(out)],
                             cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    table.stdout.close()  # before the process has started to write
    assert table.wait(timeout=120) == 0
    assert "Traceback" not in table.stderr.read().decode()
    assert all(out.with_suffix(suffix).exists() for suffix in (".md", ".tex", ".csv"))
