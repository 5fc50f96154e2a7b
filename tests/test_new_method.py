"""`python -m evals.new_method NAME`: the three files, a skeleton the engine runs under the budget, and
no overwriting."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import yaml
from helpers import capped, generate, tiny_model

from evals.new_method import create
from longflow.errors import UserError


@pytest.fixture
def repo(tmp_path):
    for folder in ("baselines", "conf/method", "tests"):
        (tmp_path / folder).mkdir(parents=True)
    return tmp_path


def test_the_skeleton_runs_under_its_budget(repo, monkeypatch):
    written = create("my_method", repo)
    assert sorted(str(path.relative_to(repo)) for path in written) == [
        "baselines/my_method.py", "conf/method/my_method.yaml", "tests/test_my_method.py"]
    spec = importlib.util.spec_from_file_location("my_method", repo / "baselines" / "my_method.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "my_method", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    config = yaml.safe_load((repo / "conf" / "method" / "my_method.yaml").read_text())
    assert config["_target_"] == "baselines.my_method.MyMethodPolicy" and config["name"] == "my_method"
    fields = {key: value for key, value in config.items() if key not in ("_target_", "name")}
    checked = capped(module.MyMethodPolicy)
    _, result = generate(tiny_model("qwen3"), lambda: checked(budget=24, **fields),
                         ["a long enough prompt to be cut at prefill, " * 3], max_new_tokens=16)
    assert len(result.tokens[0]) == 16 and max(result.peak_slots) <= 24
    with pytest.raises(UserError, match="window must be positive"):
        module.MyMethodPolicy(budget=24, window=0)
    compile(written[2].read_text(), "test_my_method.py", "exec")


def test_an_existing_method_is_not_overwritten(repo):
    (repo / "conf" / "method" / "h2o.yaml").write_text("kept")
    with pytest.raises(UserError, match=r"method 'h2o' exists already \(conf/method/h2o.yaml\)"):
        create("h2o", repo)
    assert (repo / "conf" / "method" / "h2o.yaml").read_text() == "kept"
    assert not (repo / "baselines" / "h2o.py").exists()


@pytest.mark.parametrize("name", ["MyMethod", "1st", "class", "my-method"])
def test_a_bad_name_is_refused(repo, name):
    with pytest.raises(UserError, match="lower-case Python identifier"):
        create(name, repo)
