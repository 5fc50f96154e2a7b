"""`evals.bench.compile_options.inductor_options`: the `torch.compile` that `longflow.compile` calls gets
the benchmark's options instead of the engine's, and only inside the block."""

from __future__ import annotations

import torch

import longflow.compile
from evals.bench.compile_options import inductor_options


def test_options_replace_the_engines_inside_the_block_only(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: calls.append(kwargs))
    with inductor_options({"max_autotune": True}):
        longflow.compile.torch.compile(print, fullgraph=True, options={"coordinate_descent_tuning": True})
    longflow.compile.torch.compile(print, options=None)
    assert calls == [{"fullgraph": True, "options": {"max_autotune": True}}, {"options": None}]
    assert longflow.compile.torch.compile is torch.compile
