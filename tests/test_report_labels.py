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
