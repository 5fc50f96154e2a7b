"""`evals.bench.compile_options.inductor_options`: the model's compiled forwards dropped, and the
`torch.compile` that `longflow.compile` calls gets the benchmark's options instead of the engine's, and
only inside the block, which compiles into a cache directory of its own (a warm cache can hand back an
earlier setting's kernels). The options are Inductor's global config there too: freezing is decided
while Dynamo traces, where `torch.compile`'s options do not reach."""

from __future__ import annotations

import os
import types

import torch

import longflow.compile
from evals.bench.compile_options import inductor_options


def test_options_replace_the_engines_inside_the_block_only(monkeypatch):
    calls = []
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: calls.append(kwargs))
    model = types.SimpleNamespace(longflow_compiled_forwards={"decode": object()})
    assert not torch._inductor.config.freezing
    with inductor_options(model, {"max_autotune": True, "freezing": True}):
        assert model.longflow_compiled_forwards == {}  # compiled afresh
        assert torch._inductor.config.freezing and torch._inductor.config.max_autotune
        longflow.compile.torch.compile(print, fullgraph=True, options={"coordinate_descent_tuning": True})
        inside = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        assert inside != cache and os.path.isdir(inside)
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == cache and not os.path.exists(inside)
    assert not torch._inductor.config.freezing and not torch._inductor.config.max_autotune
    longflow.compile.torch.compile(print, options=None)
    assert calls == [{"fullgraph": True, "options": {"max_autotune": True, "freezing": True}}, {"options": None}]
    assert longflow.compile.torch.compile is torch.compile
