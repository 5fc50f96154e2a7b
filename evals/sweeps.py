"""The jobs of a `-m` sweep, as Hydra's basic sweeper makes them: the config's `hydra.sweeper.params`
(an experiment's) first, then the command line's overrides, a later value of a key replacing an
earlier one, and every combination of the swept values in order."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from evals.configs import compose_config


def split_overrides(arguments: Sequence[str]) -> list[list[str]]:
    """Every job of the overrides `arguments` (`key=a,b` sweeps; `key=a` holds), each as its overrides."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    values: dict[str, list[str]] = {}
    for override in OverridesParser.create().parse_overrides(list(arguments)):
        key = override.get_key_element()
        if override.is_sweep_override():
            if not override.is_discrete_sweep():
                raise HydraException(f"only sweeps over listed values are supported: {override.input_line}")
            values[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            values[key] = [f"{key}={override.get_value_element_as_str()}"]
    return [list(job) for job in itertools.product(*values.values())]


def sweep_jobs(arguments: Sequence[str]) -> list[list[str]]:
    """The overrides of each job of `python -m evals.run -m <arguments>`, the sweep params of the
    config they select included (`experiment=demo` sweeps methods and budgets)."""
    first = split_overrides(arguments)[0]
    params = (compose_config(first, hydra_fields=True)["hydra"].get("sweeper") or {}).get("params") or {}
    return split_overrides([*(f"{key}={value}" for key, value in params.items()), *arguments])
