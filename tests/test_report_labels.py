"""Display labels of runs (`evals.report.runs.label`): a run checked by a verifier is a row of its own,
named after the verifier's display name (`evals.report.names.VERIFY_NAMES`) or its config name."""

from __future__ import annotations

import pandas as pd

from evals.report.runs import label


def test_a_verified_run_is_labelled_by_its_verifier():
    runs = pd.DataFrame({
        "model": "canary", "method": ["h2o", "h2o", "streaming"], "variant": "paper", "budget": 96,
        "dataset": "canary", "n_items": 200, "n_planned": 200, "dataset_size": 200, "complete": True,
        "verify": [None, "vericache", "another_check"],
    })
    assert label(runs)["method_label"].tolist() == ["H2O", "H2O + VeriCache", "StreamingLLM + another_check"]


def test_a_table_label_reads_back_as_the_run_it_names():
    """`parse_method_label` inverts `label`: every method's display name, with a variant, a variant and
    a budget mode, and a verifier, gives back the run's keys; an unknown name stays as it is."""
    from evals.report.names import METHOD_NAMES, parse_method_label

    methods = [*METHOD_NAMES, "my_method"]
    runs = pd.DataFrame({
        "model": "canary", "method": methods * 3, "variant": ["paper"] * len(methods) + ["lf_repo"] * 2 * len(methods),
        "budget_mode": [None] * 2 * len(methods) + ["ratio"] * len(methods), "budget": 96, "dataset": "canary",
        "n_items": 200, "n_planned": 200, "dataset_size": 200, "complete": True,
        "verify": ["vericache", None, None] * len(methods),
    })
    labelled = label(runs)
    for row in labelled.itertuples():
        mode = row.budget_mode if isinstance(row.budget_mode, str) else None
        verify = row.verify if isinstance(row.verify, str) else None
        assert parse_method_label(row.method_label) == (row.method, row.variant, mode, verify), row.method_label
