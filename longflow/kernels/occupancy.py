"""How many programs of a kernel one multiprocessor of an H100/H200 (sm_90) holds at once.

Used where a launch is tiled by how the programs fill the GPU (`longflow.kernels.onchip.tiling`) and by
`evals.bench.sass_loop`, which reads a compiled kernel's registers and shared memory.
"""

from __future__ import annotations

REGISTERS_PER_SM = 65536
SHARED_PER_SM = 233472  # 228 KB
SHARED_RESERVED = 1024  # what the driver keeps of each program's shared memory
WARPS_PER_SM = 64


def programs_per_sm(registers: int, shared: int, warps: int) -> dict[str, int]:
    """Resident programs of `warps` warps with `registers` a thread and `shared` bytes, by each limit:
    registers (allocated 256 a warp at a time), shared memory and warps. The fewest is the answer."""
    per_warp = -(-registers * 32 // 256) * 256
    return {"registers": REGISTERS_PER_SM // (per_warp * warps),
            "shared": SHARED_PER_SM // (shared + SHARED_RESERVED),
            "warps": WARPS_PER_SM // warps}
