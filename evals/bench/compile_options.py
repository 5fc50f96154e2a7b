"""The compiled decode step under other Inductor options than the engine's: does autotuning the GEMMs pay?

    python -m evals.bench.compile_options --batch 1 --methods vanilla \
        '{"coordinate_descent_tuning": true}' '{"max_autotune": true, "coordinate_descent_tuning": true}' \
        '{"max_autotune": true}'

    python -m evals.bench.compile_options --batch 1 --methods vanilla \
        '{"coordinate_descent_tuning": true, "combo_kernels": true}' '{"coordinate_descent_tuning": true}'

`engine.compile_tuning` chooses between two option sets (`longflow.compile`: Inductor's defaults, or
`TUNING_OPTIONS`, the second command's first set); this benchmark times
the step with any `torch.compile` options given as JSON, one after another on one model (Qwen3-8B
shapes, random weights, prompt 512, `--new` tokens, CUDA graphs): each set compiles afresh (Dynamo
reset, the model's compiled forward dropped), and is timed twice, the second run after the first
compiled. Options are not an engine setting, so the `torch.compile` that `longflow.compile` calls is
wrapped while each engine is built. Each line also gives the compilation's `extern_calls`, the
kernels the compiled graphs call out to, which show whether a pass such as freezing's weight
concatenation (`'{"freezing": true}'`) changed the matmuls. `"compile_gemv": true` in a set also
turns on the engine's `compile_gemv` (its graph pass kept beside the options). Needs a CUDA GPU and
Hydra (the method configs).
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache

import longflow.compile


@contextlib.contextmanager
def inductor_options(model, options: dict):
    """`model` compiled afresh (Dynamo reset, its compiled forwards dropped) by `torch.compile` as
    `longflow.compile` calls it, with `options` instead of its own, into a fresh cache directory: on
    the H200 (torch 2.11) a warm cache gave `prologue_fusion` and `epilogue_fusion` the kernels an
    earlier setting had compiled (docs/engine.md).

    The options are also Inductor's global config for the block: some are read before Inductor
    compiles, where `torch.compile`'s `options` do not reach. Dynamo keeps the parameters as graph
    attributes, which freezing turns into constants, only while `freezing` is set globally; given
    as an option alone, freezing ran with no parameter to fold (none of the 326 calls out changed at
    batch 128) and concatenated nothing."""
    torch._dynamo.reset()
    model.longflow_compiled_forwards = {}
    compile_ = torch.compile

    def with_options(*args, **kwargs):
        # The engine's graph pass (`engine.compile_gemv`) stays: it is an engine setting, not an option.
        engine_options = kwargs.get("options") or {}
        kept = {key: engine_options[key] for key in ("post_grad_custom_pre_pass",) if key in engine_options}
        return compile_(*args, **{**kwargs, "options": options | kept})

    longflow.compile.torch.compile = with_options
    try:
        with fresh_cache(), torch._inductor.config.patch(options):
            yield
    finally:
        longflow.compile.torch.compile = compile_


def main() -> None:
    from evals.bench.common import random_prompts
    from evals.bench.decode import time_engine
    from evals.configs import model_spec
    from longflow.models import load_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("options", nargs="+", help="torch.compile options, one JSON object per setting")
    parser.add_argument("--model", default="qwen3_8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--methods", default="vanilla")
    parser.add_argument("--new", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=1024)
    args = parser.parse_args()
    model, _ = load_model(model_spec(args.model, weights="random"), torch.device("cuda"))
    prompts = random_prompts(args.batch, 512, model.config.get_text_config().vocab_size)
    for options in map(json.loads, args.options):
        # `"compile_gemv": true` in a set: the engine's `compile_gemv` too (not a torch.compile option)
        setting = "gemv" if options.pop("compile_gemv", False) else "tuned"
        for method in args.methods.split(","):
            counters.clear()
            # Both runs inside the block, whose cache directory (the compiled graphs' code) goes with it.
            with inductor_options(model, options):
                first = time_engine(model, method, args.budget, prompts, args.new, True, setting)
                # Kernels Inductor calls out to in the graphs it compiled (the matmuls it leaves to
                # cuBLAS, the policy's op): where freezing concatenates q/k/v and gate/up, three fewer a
                # layer (on the CPU, with `cpp.enable_concat_linear`, the tiny Qwen3's 2 layers went
                # from 19 to 13).
                extern_calls = counters["inductor"]["extern_calls"]
                again = time_engine(model, method, args.budget, prompts, args.new, True, setting)
            print(json.dumps({"options": options, "compile_gemv": setting == "gemv", "method": method,
                              "batch": args.batch,
                              "step_ms_p50": round(first["step_ms_p50"], 3), "again": round(again["step_ms_p50"], 3),
                              "compile_s": round(first["compile_s"], 1), "extern_calls": extern_calls,
                              "peak_memory_gb": round(again["peak_memory_gb"], 2)}), flush=True)


if __name__ == "__main__":
    main()
