"""What counts as an uncommitted change in a run's provenance: every tracked change, and untracked
files only under the code a run reads (a folder of wheels beside the checkout marks no run dirty)."""
import subprocess

import pytest

from evals import fingerprint


def git(repo, *args):
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=repo, check=True,
                   capture_output=True)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    (tmp_path / "baselines").mkdir()
    (tmp_path / "baselines" / "h2o.py").write_text("x = 1\n")
    (tmp_path / "README.md").write_text("readme\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "init")
    monkeypatch.setattr(fingerprint, "REPO", tmp_path)
    return tmp_path


def test_a_clean_tree_has_no_changes(repo):
    assert fingerprint.uncommitted_changes() == ""


def test_untracked_files_outside_the_code_are_not_changes(repo):
    (repo / ".whl").mkdir()
    (repo / ".whl" / "hydra.whl").write_text("wheel")
    (repo / "notes.txt").write_text("notes")
    assert fingerprint.uncommitted_changes() == ""


def test_an_untracked_module_under_the_code_is_a_change(repo):
    (repo / "baselines" / "mine.py").write_text("y = 2\n")
    assert "baselines/mine.py" in fingerprint.uncommitted_changes()


def test_a_tracked_edit_anywhere_is_a_change(repo):
    (repo / "README.md").write_text("edited\n")
    assert "README.md" in fingerprint.uncommitted_changes()


def test_outside_git_there_is_no_answer(tmp_path, monkeypatch):
    monkeypatch.setattr(fingerprint, "REPO", tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert fingerprint.uncommitted_changes() is None
