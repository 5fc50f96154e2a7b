"""LongFlow decode attention: the fused Triton kernel and its plain PyTorch reference.

The kernel module is imported here, eagerly, so that the package attribute `longflow_attention` is
the function (a later `import longflow.kernels.longflow_attention` does not rebind it to the
module). Without Triton (e.g. macOS) only `reference` works and the kernel raises on call.
"""

from __future__ import annotations

from longflow.kernels.reference import reference

try:
    from longflow.kernels.longflow_attention import longflow_attention
except ImportError as error:  # Triton is a Linux-only dependency
    _triton_error = error

    def longflow_attention(*args, **kwargs):
        raise ImportError(f"the fused LongFlow kernel needs Triton: {_triton_error}")


__all__ = ["longflow_attention", "reference"]
