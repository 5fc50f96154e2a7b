"""Decode kernels: LongFlow's fused Triton attention and its plain PyTorch reference, the same kernel
with the score epilogues of the other step methods (`scored_attention`: H2O, VATP, TOVA), its
flash-decoding pass without the score (`flash_decode`), vanilla's whole decode step of a layer in one
launch (`append_decode`: the token's write, that pass and its combine), the decode token's slot write
(`write_token`), the batch-of-one step's products with the norm, SwiGLU and residual around them
(`gemv`), R-KV's newest near-duplicate search (`newest_duplicates`), its
similarities' column sums (`similarity_sums`) and its window importance (`window_importance`), and
an interval method's compaction of K and V in place (`compact_in_place`). LongFlow's pass with its
score scratch on chip (`longflow.kernels.onchip`, Gluon) is imported by its caller on demand
(`LaunchConfig(onchip=True)`).

The kernel module is imported here, eagerly, so that the package attribute `longflow_attention` is
the function (a later `import longflow.kernels.longflow_attention` does not rebind it to the
module). Without Triton (e.g. macOS) only `reference` works and the kernels raise on call.
"""

from __future__ import annotations

from longflow.kernels.reference import reference

try:
    from longflow.kernels.compaction import compact_in_place
    from longflow.kernels.duplicates import newest_duplicates
    from longflow.kernels.gemv import gemv
    from longflow.kernels.longflow_attention import append_decode, flash_decode, longflow_attention, scored_attention
    from longflow.kernels.similarity_sums import similarity_sums
    from longflow.kernels.slot_write import write_token
    from longflow.kernels.window_importance import window_importance
except ImportError as error:  # Triton is a Linux-only dependency
    _triton_error = error

    def longflow_attention(*args, **kwargs):
        raise ImportError(f"the fused LongFlow kernel needs Triton: {_triton_error}")

    def flash_decode(*args, **kwargs):
        raise ImportError(f"the flash-decoding kernel needs Triton: {_triton_error}")

    def append_decode(*args, **kwargs):
        raise ImportError(f"the appending flash-decoding kernel needs Triton: {_triton_error}")

    def write_token(*args, **kwargs):
        raise ImportError(f"the slot-write kernel needs Triton: {_triton_error}")

    def scored_attention(*args, **kwargs):
        raise ImportError(f"the fused score kernel needs Triton: {_triton_error}")

    def newest_duplicates(*args, **kwargs):
        raise ImportError(f"the duplicate-search kernel needs Triton: {_triton_error}")

    def similarity_sums(*args, **kwargs):
        raise ImportError(f"the similarity-sums kernel needs Triton: {_triton_error}")

    def compact_in_place(*args, **kwargs):
        raise ImportError(f"the compaction kernel needs Triton: {_triton_error}")

    def window_importance(*args, **kwargs):
        raise ImportError(f"the window-importance kernel needs Triton: {_triton_error}")

    def gemv(*args, **kwargs):
        raise ImportError(f"the GEMV kernel needs Triton: {_triton_error}")


__all__ = ["append_decode", "compact_in_place", "flash_decode", "gemv", "longflow_attention", "newest_duplicates",
           "reference", "scored_attention", "similarity_sums", "window_importance", "write_token"]
