"""`python -m evals.new_method NAME`: the three files, a skeleton the engine runs under the budget, and
no overwriting."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

import pytest
import yaml
from helpers import REPO, capped, generate, tiny_model

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


@pytest.mark.slow
def test_the_written_test_passes_in_a_copy_of_the_project(tmp_path):
    """The generated test file runs as the printed command runs it: in a copy of the project's packages,
    configs and test helpers (not in the repository, whose method configs the other tests enrol while
    this one runs), its config test passes and its reference test is marked to write."""
    copy = tmp_path / "project"
    for folder in ("longflow", "baselines", "evals", "conf", "tests/helpers"):
        shutil.copytree(REPO / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "tests/conftest.py"):
        shutil.copy(REPO / name, copy / name)
    create("my_method", copy)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                             "tests/test_my_method.py"], cwd=copy, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed, 1 skipped" in result.stdout, result.stdout


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
