"""What the benchmark scripts share: the random-weight model on its device, a method's policy and the
engine that decodes with it, random prompts, the printed table with its CSV, the `--compile` settings,
and the entry point's one-line errors."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch
import yaml

from evals.configs import method_config, model_spec
from longflow.config import EngineConfig, VerifyConfig
from longflow.engine import Engine
from longflow.errors import UserError, report
from longflow.methods import build_policy
from longflow.models import ModelSpec, check_fits_device, load_model, resolve_device
from longflow.policy import KVPolicy


def bench_model(name: str, device: str, dtype: str | None = None) -> tuple[object, ModelSpec, torch.device]:
    """(model, spec, device): `conf/model/<name>.yaml`'s architecture with random weights, in `dtype`
    (default: the config's), on `device` (auto, cpu, cuda[:N]); a model too large for the CPU that
    device=auto would put there is refused before its weights are made (`check_fits_device`)."""
    spec = model_spec(name, weights="random", **({"dtype": dtype} if dtype else {}))
    resolved = resolve_device(device)
    check_fits_device(spec, resolved, device, cpu_option="--device cpu")
    model, _ = load_model(spec, resolved)
    return model, spec, resolved


def require_cuda(what: str) -> None:
    """A GPU-only benchmark's refusal on a machine without CUDA."""
    if not torch.cuda.is_available():
        raise UserError(f"{what} needs a CUDA GPU (its timings are of GPU kernels)")


def run(main: Callable[[], object]) -> None:
    """A benchmark's `__main__`: `main()`, its UserError as one `error:` line and exit code 2."""
    try:
        main()
    except UserError as error:
        sys.exit(report(error))


def method_policy(method: str, budget: int | None) -> KVPolicy:
    """The policy of `conf/method/<method>.yaml` at `budget` KV slots; a method that takes no budget
    (the full cache) drops it, so `policy.budget` is the budget a row records.

    `method` may set fields after colons, `vanilla:one_launch=true` (values read as YAML),
    so that one process times two forms of a method against each other; the row keeps the string."""
    name, *fields = method.split(":")
    config = method_config(name)
    for field in fields:
        key, equals, value = field.partition("=")
        if not equals or not key:
            raise UserError(f"method {method!r}: {field!r} is not a field=value pair")
        config[key] = yaml.safe_load(value)
    return build_policy(config, budget)


def bench_engine(model, policy: KVPolicy, verify: VerifyConfig | None = None, **config) -> Engine:
    """An engine whose every cache gets a copy of `policy` (`engine.policy_factory`), decoding to
    length (no EOS; pad id 0: random prompts have no padding token); `config`: `EngineConfig` fields;
    `verify`: VeriCache's setting (`longflow.verify`), None for ordinary decoding."""
    return Engine(model, lambda: copy.deepcopy(policy), eos_ids=[], pad_id=0, config=EngineConfig(**config),
                  verify=verify)


def random_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of `length` ids from the lower half of the vocabulary, away from the special
    ids at its top; the first rows are the same whatever `count`."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab // 2, (count, length), generator=generator).tolist()


def write_table(table: pd.DataFrame, out: str | Path, heading: str, setting: dict, decimals: int = 3) -> None:
    """Prints `heading` and `table`, and writes the table with the `setting` columns to `out` (CSV)."""
    print(f"\n{heading}")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.{decimals}f}"))
    save_table(table, out, setting)
    print(f"wrote {out}")


def save_table(table: pd.DataFrame, out: str | Path, setting: dict) -> None:
    """The table with the `setting` columns to `out` (CSV), silently: a bench rewrites it after every
    row, so that a process stopped by a time limit keeps what it measured."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    table.assign(**setting).to_csv(out, index=False)


# `--compile` values: the decode forward eager; compiled as the engine does by default (Inductor's
# kernel tuning at a batch of one only); compiled with or without that tuning whatever the batch;
# tuned with the one-row products through the project's GEMV (`engine.compile_gemv`).
COMPILE_SETTINGS = {"off": {"compile": False}, "on": {"compile": True},
                    "tuned": {"compile": True, "compile_tuning": True},
                    "untuned": {"compile": True, "compile_tuning": False},
                    "gemv": {"compile": True, "compile_tuning": True, "compile_gemv": True}}


def compile_settings(value: str) -> list[str]:
    """A `--compile` argument (`on`, or several as `off,on,tuned`) as its list of settings."""
    settings = value.split(",")
    unknown = set(settings) - set(COMPILE_SETTINGS)
    if unknown:
        raise ValueError(f"--compile takes {', '.join(COMPILE_SETTINGS)} or a comma-separated list of them, "
                         f"got {value!r}")
    return settings
