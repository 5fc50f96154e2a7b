"""`python -m evals.report.identity`: two folders of runs compared item by item, against outputs
written by hand here (what is identical, where a pair parts, what has no counterpart)."""

import json

from evals.report.identity import main


def write_run(folder, name, outputs, torn=False):
    run = folder / name
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"method": name}))
    lines = [json.dumps({"id": item, "sample": 0, "output": text}) for item, text in outputs.items()]
    text = "\n".join(lines) + "\n"
    if torn:
        text += '{"id": "late", "sam'
    (run / "generations.jsonl").write_text(text)
    return run


def test_identical_folders_exit_0_and_count_every_output(tmp_path, capsys):
    for side in ("a", "b"):
        write_run(tmp_path / side, "h2o__b96__x", {"1": "x = 3", "2": "y = 4"})
        write_run(tmp_path / side, "vanilla__full__y", {"1": "x = 3"}, torn=side == "b")
    assert main(["--runs", str(tmp_path / "a"), "--against", str(tmp_path / "b")]) == 0
    assert capsys.readouterr().out.strip().endswith(
        "3 of 3 outputs identical, over 2 runs in both folders (0 only in the first, 0 only in the second)")


def test_a_difference_says_where_the_outputs_part_and_exits_1(tmp_path, capsys):
    write_run(tmp_path / "a", "h2o__b96__x", {"1": "x = 3; y = 5", "2": "same"})
    write_run(tmp_path / "b", "h2o__b96__x", {"1": "x = 3; y = 6!", "2": "same"})
    out = tmp_path / "pairs.csv"
    assert main(["--runs", str(tmp_path / "a"), "--against", str(tmp_path / "b"), "--out", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "h2o__b96__x: 1 of 2 identical; 1#0 at character 11 of 12 / 13" in printed
    assert "1 of 2 outputs identical" in printed
    assert out.read_text().splitlines() == ["run,compared,identical,missing", "h2o__b96__x,2,1,0"]


def test_runs_of_another_identity_are_listed_not_compared(tmp_path, capsys):
    """A run name carries its identity's hash: a run made with another parameter has no counterpart.
    With no run in both folders nothing was compared, which is no proof of identity: exit 1."""
    write_run(tmp_path / "a", "compresskv__b96__aaaa", {"1": "one"})
    write_run(tmp_path / "b", "compresskv__b96__bbbb", {"1": "two"})
    out = tmp_path / "pairs.csv"
    assert main(["--runs", str(tmp_path / "a"), "--against", str(tmp_path / "b"), "--out", str(out)]) == 1
    printed = capsys.readouterr().out
    assert f"compresskv__b96__aaaa: only in {tmp_path / 'a'}" in printed
    assert f"compresskv__b96__bbbb: only in {tmp_path / 'b'}" in printed
    assert printed.strip().endswith(
        "no run is in both folders (1 only in the first, 1 only in the second): nothing was compared")
    assert out.read_text() == "run,compared,identical,missing\n"
    write_run(tmp_path / "a", "h2o__b96__x", {"1": "same"})
    write_run(tmp_path / "b", "h2o__b96__x", {"1": "same"})
    assert main(["--runs", str(tmp_path / "a"), "--against", str(tmp_path / "b")]) == 0


def test_an_item_missing_from_one_run_fails_and_a_bad_folder_is_one_line(tmp_path, capsys):
    write_run(tmp_path / "a", "tova__b96__x", {"1": "a", "2": "b"})
    write_run(tmp_path / "b", "tova__b96__x", {"1": "a"})
    assert main(["--runs", str(tmp_path / "a"), "--against", str(tmp_path / "b")]) == 1
    assert "tova__b96__x: 1 of 1 identical; items in one run only: 1" in capsys.readouterr().out
    assert main(["--runs", str(tmp_path / "missing"), "--against", str(tmp_path / "b")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'missing'} is not a folder of runs"
