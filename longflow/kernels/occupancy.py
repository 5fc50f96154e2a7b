"""How many programs of a kernel one multiprocessor holds at once, and what a GPU offers for it.

Used where a launch is tiled by how its programs fill the GPU (`longflow.kernels.onchip.tiling`) and by
`evals.bench.sass_loop`, which reads a compiled kernel's registers and shared memory for sm_90.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

SHARED_RESERVED = 1024  # what the driver keeps of each program's shared memory (sm_80 on)
# A launch whose programs each take one whole row's work (no splits) is tiled for it only where its
# last wave keeps at least this share of the program places busy (`wave_fill`).
WAVE_FILL = 0.9


@dataclass(frozen=True)
class GPU:
    """What tiling by occupancy needs of a GPU. The defaults are an H100's and H200's (sm_90) but for
    the bandwidth, which is an H200's: of the two the one that asks more bytes in flight."""

    multiprocessors: int = 132
    registers: int = 65536  # a multiprocessor's
    shared: int = 233472  # a multiprocessor's shared memory, 228 KB
    shared_per_program: int = 232448  # the most one program may take, 227 KB
    warps: int = 64  # a multiprocessor's
    bandwidth: float = 4.8e12  # the device memory's bytes/s


SM90 = GPU()


@functools.cache
def gpu(device: torch.device) -> GPU:
    """`device`'s figures as torch reports them; sm_90's for any it does not. The bandwidth is the
    memory's peak from its clock and bus width (two transfers a clock)."""
    properties = torch.cuda.get_device_properties(device)

    def reported(name: str, default):
        return getattr(properties, name, None) or default

    clock_khz, bus_bits = reported("memory_clock_rate", 0), reported("memory_bus_width", 0)
    return GPU(
        multiprocessors=properties.multi_processor_count,
        registers=reported("regs_per_multiprocessor", SM90.registers),
        shared=reported("shared_memory_per_multiprocessor", SM90.shared),
        shared_per_program=reported("shared_memory_per_block_optin", SM90.shared_per_program),
        warps=reported("max_threads_per_multi_processor", SM90.warps * 32) // 32,
        bandwidth=2 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else SM90.bandwidth,
    )


def programs_per_sm(registers: int, shared: int, warps: int, on: GPU = SM90) -> dict[str, int]:
    """Resident programs of `warps` warps with `registers` a thread and `shared` bytes, by each limit:
    registers (allocated 256 a warp at a time), shared memory (none where one program's is more than
    the GPU lets a program take) and warps. The fewest is the answer."""
    per_warp = -(-registers * 32 // 256) * 256
    fits = shared <= on.shared_per_program
    return {"registers": on.registers // (per_warp * warps),
            "shared": on.shared // (shared + SHARED_RESERVED) if fits else 0,
            "warps": on.warps // warps}


def wave_fill(programs: int, places: int) -> float:
    """The share of program places busy over a launch's waves: `programs` over `places` resident at once
    (multiprocessors x programs each), 1 where the last wave is full."""
    return programs / (-(-programs // places) * places)
