"""A new KV-cache method from a template: `python -m evals.new_method NAME`.

Writes `baselines/NAME.py` (a `KVPolicy` subclass whose `score` is a placeholder to replace: it
keeps the newest tokens, so that everything runs before the method does anything of its own),
`conf/method/NAME.yaml` (its class and fields) and `tests/test_NAME.py` (its own tests, to fill in).
The shared contract tests (tests/test_methods.py, tests/test_method_configs.py) cover every config
of conf/method/, so they run on the new method at once. Refuses to overwrite any of the three files.
"""

from __future__ import annotations

import argparse
import keyword
import re
import sys
from pathlib import Path

from longflow.errors import UserError, report

REPO = Path(__file__).resolve().parents[1]

MODULE = '''"""{title}: <one line: what it evicts, and by which score>.

<Authors> <year>, "<paper title>", arXiv:<id> (official code: <repository, file>).

Per layer and decode step: the new token's K/V overwrite the slot chosen at the previous step; the
current query attends to every held slot; each slot scores `score` (higher = keep); the next slot is
the lowest free one, else the lowest-scoring one (`longflow.selection`). A prompt longer than the
budget is cut by `prefill_scores` (default: SnapKV).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longflow.errors import UserError
from longflow.policy import KVPolicy, Observation


@dataclass(eq=False)
class {cls}(KVPolicy):
    """{title} (see the module docstring). Fields: `window` (an example field: replace it)."""

    window: int = 32

    name = "{name}"
    # The placeholder score reads no attention probabilities; set True (the default) once `score` does.
    step_probs = False

    def __post_init__(self):
        super().__post_init__()
        if self.window <= 0:
            raise UserError(f"{{self.name}}: window must be positive, got {{self.window}}")

    def score(self, obs: Observation) -> torch.Tensor:
        """Per-slot scores `[n, Hkv, S]`, higher = keep.

        PLACEHOLDER, to replace with the method's score: the slots' positions, so that the newest
        tokens are kept (a sliding window). Reads `obs.keys`, `obs.values` `[n, Hkv, S, D]`,
        `obs.valid`, `obs.positions` `[n, Hkv, S]`, and with `step_probs = True` `obs.probs`
        `[n, Hkv, G, S]` (the newest query's attention).
        """
        return obs.positions.float()
'''

CONFIG = '''# {title} (<paper, arXiv id>): <one line>. See baselines/{name}.py.
_target_: baselines.{name}.{cls}
name: {name}
window: 32  # <what it is, and where the default comes from>
'''

TEST = '''"""{title}: its score against an independent reference (a plain PyTorch transcription of the paper's
formula or of the official code), and its config.

Greedy tokens equal the full cache's with a large budget, and the budget holds at every step:
tests/test_methods.py, for every method config.
"""

from __future__ import annotations

import pytest
import yaml
from helpers import REPO, method_defaults, policy_of

from baselines.{name} import {cls}
from longflow.methods import locate


def test_config():
    fields = yaml.safe_load((REPO / "conf" / "method" / "{name}.yaml").read_text())
    assert fields.pop("name") == {cls}.name and locate(fields.pop("_target_")) is {cls}
    assert fields == method_defaults({cls})
    assert isinstance(policy_of("{name}", 64), {cls})


@pytest.mark.skip(reason="to write: the score against a plain transcription of the paper's formula")
def test_score_matches_the_reference():
    """Drive one layer with `helpers.drive_layer` on random tensors and compare the held positions
    and outputs of every step with the reference's."""
'''


def class_name(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_")) + "Policy"


def files(name: str, root: Path = REPO) -> dict[Path, str]:
    """The three files of method `name` in the repository at `root`, by path."""
    fields = {"name": name, "cls": class_name(name), "title": name.replace("_", " ").title()}
    return {
        root / "baselines" / f"{name}.py": MODULE.format(**fields),
        root / "conf" / "method" / f"{name}.yaml": CONFIG.format(**fields),
        root / "tests" / f"test_{name}.py": TEST.format(**fields),
    }


def create(name: str, root: Path = REPO) -> list[Path]:
    """Writes the three files of method `name` into the repository at `root`; UserError for a bad
    name or when any of them exists."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or keyword.iskeyword(name):
        raise UserError(f"a method name is a lower-case Python identifier (letters, digits, _), got {name!r}")
    planned = files(name, root)
    existing = [str(path.relative_to(root)) for path in planned if path.exists()]
    if existing:
        raise UserError(f"method {name!r} exists already ({', '.join(existing)}); choose another name")
    for path, text in planned.items():
        path.write_text(text)
    return list(planned)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m evals.new_method", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", help="the method's name: module, config and label (lower case, e.g. my_method)")
    args = parser.parse_args(argv)
    try:
        written = create(args.name)
    except UserError as error:
        sys.exit(report(error))
    for path in written:
        print(f"wrote {path.relative_to(REPO)}")
    print(f"next: replace the placeholder score in baselines/{args.name}.py, then run "
          f"python -m pytest -q tests/test_{args.name}.py tests/test_methods.py -k {args.name}")


if __name__ == "__main__":
    main()
