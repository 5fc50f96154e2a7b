"""`evals.report.order`: confident reversals of pairs of methods between item sets, on runs whose
answer is known by construction."""

from __future__ import annotations

import pandas as pd
import pytest
from helpers.reports import write_generations, write_run

from evals.report.order import main, reversals, scored_runs
from evals.report.runs import collect
from evals.report.stats import BootstrapConfig
from longflow.errors import UserError

ITEMS = 100


def run(root, method, family, solved):
    path = write_run(root, "canary_suite", method, 96, f"canary_{family}", solved / ITEMS, dataset_size=ITEMS,
                     n_items=ITEMS, complete=True)
    return write_generations(path, {f"{family}-{i}": i < solved for i in range(ITEMS)})


@pytest.fixture
def runs(tmp_path):
    """On state H2O solves 80 of 100 items, LongFlow 50, R-KV 20; on lookup the order turns over (R-KV
    90, LongFlow 52, H2O 10), far outside chance for every pair; on chain it is state's (70, 50, 30)."""
    root = tmp_path / "runs"
    write_run(root, "canary_suite", "vanilla", None, "canary_state", 1.0)
    for family, (h2o, rkv, longflow) in {"state": (80, 20, 50), "lookup": (10, 90, 52), "chain": (70, 30, 50)}.items():
        run(root, "h2o", family, h2o)
        run(root, "rkv", family, rkv)
        run(root, "longflow", family, longflow)
    return root


def test_reversals(runs):
    found, summary = reversals(scored_runs(collect(runs)), "state", BootstrapConfig(resamples=2000))
    flips = {(r.dataset, r.a, r.b) for r in found}
    assert flips == {("lookup", "H2O", "R-KV"), ("lookup", "H2O", "LongFlow"), ("lookup", "R-KV", "LongFlow")}
    [flip] = [r for r in found if (r.a, r.b) == ("H2O", "R-KV")]
    assert flip.on_reference.estimate == pytest.approx(60.0) and flip.on_dataset.estimate == pytest.approx(-80.0)
    assert flip.on_reference.low > 0 and flip.on_dataset.high < 0
    by_set = summary.set_index("dataset")
    assert by_set.loc["chain", "confident_reversals"] == 0 and by_set.loc["chain", "spearman"] == pytest.approx(1.0)
    assert by_set.loc["lookup", "spearman"] == pytest.approx(-1.0) and by_set.loc["lookup", "pairs"] == 3


def test_command(runs, tmp_path, capsys):
    out = tmp_path / "order"
    assert main(["--runs", str(runs), "--reference", "canary_state", "--bootstrap", "500", "--out", str(out)]) == 0
    assert "| canary_suite | 96 | lookup | 3 | -1.00 | 3 of 3 |" in out.with_suffix(".md").read_text()
    assert len(pd.read_csv(out.with_suffix(".csv"))) == 3
    assert main(["--runs", str(runs), "--reference", "plan", "--out", str(out)]) == 2
    assert "no runs of canary_suite on the reference 'plan'" in capsys.readouterr().err


def test_runs_without_records(tmp_path):
    write_run(tmp_path, "canary_suite", "h2o", 96, "canary_state", 0.5)
    with pytest.raises(UserError, match="no per-item records"):
        scored_runs(collect(tmp_path))
