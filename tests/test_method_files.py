"""A method's file (a calibration, learned weights) made for one model checkpoint refuses another.

The canary and the canary suite's model share an architecture, so a file made for one loads on the
other without a shape error; the file's record of its model (`longflow.calibration.made_for`) is what
tells them apart, and the run checks it before loading any model (`check_method_files`).
"""

import pytest

from evals.configs import compose_config
from evals.fingerprint import checkpoint_fingerprint
from evals.pipeline import Setup, check_method_files
from longflow.calibration import made_for
from longflow.errors import UserError

CANARY_LKV = "evals/canary/lkv/lkv.safetensors"
SUITE_LKV = "evals/canary/lkv_suite/lkv.safetensors"
CANARY_CKV = "results/calibration/compresskv/canary-v1.pt"
SUITE_CKV = "results/calibration/compresskv/canary_suite-v1.pt"


def setup(*overrides: str) -> Setup:
    return Setup.from_config(compose_config(["dataset=canary", "budget=96", *overrides]))


@pytest.mark.parametrize("path,folder", [(CANARY_LKV, "evals/canary/model"), (SUITE_LKV, "evals/canary/suite_model"),
                                         (CANARY_CKV, "evals/canary/model"), (SUITE_CKV, "evals/canary/suite_model")])
def test_committed_files_record_the_checkpoint_they_were_made_for(path, folder):
    """Each committed file names the committed model it was fitted to, hashed as a run hashes it."""
    assert made_for(path)["checkpoint"] == checkpoint_fingerprint(folder)


@pytest.mark.parametrize("method,field,path", [("lkv", "weights", CANARY_LKV),
                                               ("compresskv", "calibration", CANARY_CKV)])
def test_a_file_made_for_the_canary_is_refused_on_the_suite_model(method, field, path):
    chosen = setup("model=canary_suite", f"method={method}", f"method.{field}={path}")
    with pytest.raises(UserError) as raised:
        check_method_files(chosen)
    message = str(raised.value)
    assert f"method.{field}=" in message and "'canary'" in message and "allow_other_model_files=true" in message


@pytest.mark.parametrize("model,method,field,path", [
    ("canary", "lkv", "weights", CANARY_LKV), ("canary_suite", "lkv", "weights", SUITE_LKV),
    ("canary", "compresskv", "calibration", CANARY_CKV), ("canary_suite", "compresskv", "calibration", SUITE_CKV),
])
def test_the_file_made_for_the_model_passes(model, method, field, path):
    check_method_files(setup(f"model={model}", f"method={method}", f"method.{field}={path}"))


def test_allow_other_model_files_and_random_weights_skip_the_check():
    check_method_files(setup("model=canary_suite", "method=lkv", f"method.weights={CANARY_LKV}",
                             "allow_other_model_files=true"))
    check_method_files(setup("model=canary_suite", "model.weights=random", "method=lkv",
                             f"method.weights={CANARY_LKV}"))


def test_the_run_refuses_before_loading_a_model(tmp_path):
    """Through the pipeline's entry: the error comes first, with nothing written."""
    from evals.pipeline import evaluate

    cfg = compose_config(["model=canary_suite", "dataset=canary", "method=lkv", "budget=96", "limit=1",
                          "device=cpu", f"results_dir={tmp_path}"])
    with pytest.raises(UserError, match="allow_other_model_files"):
        evaluate(cfg)
    assert not any(tmp_path.iterdir())
