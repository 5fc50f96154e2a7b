"""The decode attention pass's main loop in sm_90 machine code, compiled here without a GPU.

    python -m evals.bench.sass_loop                       # batch 128, 3200 slots (Figure 1's point)
    python -m evals.bench.sass_loop --batch 16 --slots 8192

For each way the attention pass runs (LongFlow's fused call, H2O's bare-logit pass, `flash_decode`,
and LongFlow's pass with its scratch on chip, `longflow.kernels.onchip` at 64- and 32-slot tiles), at the
kernels' heuristic configuration for the shape (Qwen3-8B heads, bf16): the registers and
shared memory of a program, how many programs fit a multiprocessor by each (the fewer decides), and
the instructions of one iteration of the loop over K/V tiles by kind: the tensor-core products
(HMMA), barriers (BAR), shared-memory traffic (LDS, LDSM, STS), global stores (STG) and asynchronous
copies (LDGSTS), shuffles (SHFL), the multi-function unit (MUFU: exp2, log2, reciprocal) and float
arithmetic. The loop is the longest backward branch's body that holds tensor-core products. These
are static counts from the compiler (`evals.bench.aot`: Triton's ptxas and cuobjdump), not timings:
what the GPU makes of them is `evals.bench.attention`'s and `evals.bench.scratch_store`'s to
measure.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re

import torch

KINDS = ("HMMA", "BAR", "LDS", "LDSM", "STS", "STG", "LDGSTS", "SHFL", "MUFU", "FFMA", "FMUL", "FADD")
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Qwen3-8B


@dataclasses.dataclass
class Loop:
    instructions: int
    kinds: dict[str, int]
    mufu: dict[str, int]


def main_loop(sass: str) -> Loop:
    """The longest loop holding tensor-core products in a kernel's SASS (`cuobjdump -sass`)."""
    code = [(int(address, 16), text.strip())
            for address, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for address, text in code:
        branch = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address:
            body = [t for a, t in code if int(branch.group(1), 16) <= a <= address]
            if any("HMMA" in t for t in body):
                loops.append(body)
    if not loops:
        raise ValueError("no loop with tensor-core products in this SASS")
    body = max(loops, key=len)
    opcodes = [re.sub(r"^@!?U?P[T0-9]+\s+", "", text).split()[0] for text in body]
    kinds = collections.Counter(opcode.split(".")[0] for opcode in opcodes)
    mufu = collections.Counter(opcode.split(".")[1] for opcode in opcodes if opcode.startswith("MUFU."))
    return Loop(len(body), {kind: kinds[kind] for kind in KINDS}, dict(mufu))


def attention_calls(batch: int, slots: int):
    """(name, zero-argument host call) of each attention pass at this shape."""
    from evals.bench.aot import L2_BYTES, SMS  # first: the kernels defined for the compiler
    from longflow.kernels import flash_decode, longflow_attention, scored_attention
    from longflow.kernels.longflow_attention import default_config
    from longflow.kernels.onchip import onchip_attention

    q = torch.randn(batch, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, KV_HEADS, slots, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2))
    valid = torch.ones(batch, KV_HEADS, slots, dtype=torch.bool)
    next_slot = torch.zeros(batch, KV_HEADS, dtype=torch.long)
    received = torch.zeros(batch, KV_HEADS, slots)
    lengths = torch.full((batch,), slots, dtype=torch.int32)
    config = default_config(batch, KV_HEADS, Q_HEADS, slots, HEAD_DIM, SMS, L2_BYTES)
    decode_config = default_config(batch, KV_HEADS, Q_HEADS, slots, HEAD_DIM, SMS, L2_BYTES, scored=False)
    return [("LongFlow", lambda: longflow_attention(q, k, v, valid[:, 0], config=config)),
            ("H2O", lambda: scored_attention(q, k, v, valid, next_slot, score="accumulated", per_kv_head=True,
                                             received=received, config=config)),
            ("flash_decode", lambda: flash_decode(q, k, v, valid[:, 0], lengths, config=decode_config)),
            ("on chip", lambda: onchip_attention(q, k, v, valid[:, 0], next_slot[:, :1], HEAD_DIM**-0.5)),
            ("on chip 32", lambda: onchip_attention(q, k, v, valid[:, 0], next_slot[:, :1], HEAD_DIM**-0.5,
                                                    block_n=32))]


def describe(batch: int, slots: int) -> list[dict]:
    """Each pass's row of the table (`main`), compiled in this process: the first import of the kernels
    here must be `evals.bench.aot`'s."""
    from evals.bench.aot import compile_launch, cuobjdump, record_launches
    from longflow.kernels.occupancy import programs_per_sm

    rows = []
    for name, call in attention_calls(batch, slots):
        kernel, arguments, options = record_launches(call)[0]  # the attention pass is the first launch
        compiled = compile_launch(kernel, arguments, options)
        usage = re.search(r"REG:(\d+)", cuobjdump(compiled, "-res-usage"))
        registers, shared = int(usage.group(1)), compiled.metadata.shared
        loop = main_loop(cuobjdump(compiled, "-sass"))
        warps = options["num_warps"]
        rows.append(dict(name=name, registers=registers, shared=shared, warps=warps, stages=options.get("num_stages"),
                         programs=programs_per_sm(registers, shared, warps), body=loop))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--slots", type=int, default=3200)
    parser.add_argument("--json", action="store_true", help="one JSON object per pass instead of the table")
    args = parser.parse_args(argv)
    import triton

    if args.json:
        for row in describe(args.batch, args.slots):
            print(json.dumps(row | {"body": dataclasses.asdict(row["body"])}))
        return

    print(f"batch {args.batch}, {args.slots} slots, sm_90, Triton {triton.__version__}: one iteration of the "
          f"attention pass's loop over K/V tiles")
    header = f"{'pass':<13}{'regs':>5}{'shared':>8}{'programs/SM':>13}{'instr':>7}"
    print(header + "".join(f"{kind:>7}" for kind in KINDS) + "  MUFU by function")
    for row in describe(args.batch, args.slots):
        programs = row["programs"]
        fit = f"{min(programs.values())} ({programs['registers']}r {programs['shared']}s)"
        line = (f"{row['name']:<13}{row['registers']:>5}{row['shared']:>8}{fit:>13}"
                f"{row['body'].instructions:>7}" + "".join(f"{row['body'].kinds[kind]:>7}" for kind in KINDS))
        print(line + "  " + " ".join(f"{fn} {n}" for fn, n in sorted(row["body"].mufu.items())), flush=True)


if __name__ == "__main__":
    main()
