"""The library's Triton kernels compiled for an H100/H200 (sm_90) ahead of time, on any machine.

Triton's interpreter, which the CPU tests run the kernels through, accepts code that the compiler
refuses, and says nothing of what the compiler makes of it. Here a host function of `longflow.kernels`
is called on small CPU tensors with its kernels defined for the compiler (TRITON_INTERPRET=0 before
any kernel module is imported) and its launches recorded instead of run; each launch is then
specialised as Triton specialises a real one (pointers and integers divisible by 16, integers equal
to 1 made constants) and compiled to a cubin for sm_90 by Triton's own ptxas, whose machine code
(SASS) and resources Triton's `cuobjdump` prints. `tests/helpers/sm90.py` compiles every kernel this
way; `evals.bench.sass_loop` reads the attention pass's loop.

Import this module before anything imports Triton's kernels for the interpreter (in a process of its
own, as `python -m` or a script): the interpreter's switch is read when a kernel is defined.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import tempfile
from pathlib import Path

if any(name.startswith("longflow.kernels") for name in sys.modules) and os.environ.get("TRITON_INTERPRET") == "1":
    raise RuntimeError("evals.bench.aot must be imported before the kernel modules, which are defined for "
                       "Triton's interpreter in this process")
os.environ["TRITON_INTERPRET"] = "0"  # before Triton or a kernel module is imported

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import longflow.kernels  # noqa: E402, F401  (defines every kernel for the compiler)
import longflow.kernels.onchip  # noqa: E402, F401  (imported by its caller on demand: it needs Gluon)

TARGET = GPUTarget("cuda", 90, 32)
SHARED_BYTES = 232448  # the most shared memory one program may take on sm_90 (227 KB); more fails at launch
SMS, L2_BYTES = 132, 50 * 2**20  # an H100/H200, so that the launch configurations are the GPU's
POINTER_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
                 torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "launch_pdl")
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def kernel_modules() -> list:
    return [module for name, module in sys.modules.items() if name.startswith("longflow.kernels.")]


def record_launches(calls) -> list[tuple[JITFunction, dict, dict]]:
    """(kernel, bound arguments, launch options) of every launch `calls()` makes; nothing runs."""
    launches = []

    def record(self, *args, grid, warmup, **kwargs):
        options = {name: kwargs.pop(name) for name in LAUNCH_OPTIONS if name in kwargs}
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        bound.apply_defaults()
        launches.append((self, dict(bound.arguments), options))

    # The host functions refuse CPU tensors unless the interpreter is on, and pick IEEE products under
    # it: both are read at call time, so the kernels stay compiled-mode ones while the products are
    # chosen as on a GPU (float32 only).
    originals = JITFunction.run, os.environ["TRITON_INTERPRET"]
    precision = {module: module.ieee_products for module in kernel_modules() if hasattr(module, "ieee_products")}
    attention = sys.modules["longflow.kernels.longflow_attention"]
    device_facts = attention._multiprocessors, attention._l2_bytes
    JITFunction.run, os.environ["TRITON_INTERPRET"] = record, "1"
    for module in precision:
        module.ieee_products = lambda dtype: dtype == torch.float32
    attention._multiprocessors, attention._l2_bytes = (lambda device: SMS), (lambda device: L2_BYTES)
    try:
        calls()
    finally:
        JITFunction.run, os.environ["TRITON_INTERPRET"] = originals
        for module, function in precision.items():
            module.ieee_products = function
        attention._multiprocessors, attention._l2_bytes = device_facts
    return launches


def specialise(kernel: JITFunction, arguments: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of `ASTSource`, as Triton specialises a launch with these arguments."""
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = arguments[param.name]
        key = (index,)
        if param.is_constexpr or value is None:
            signature[param.name], constexprs[key] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + POINTER_TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[key] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            if value == 1 and not param.do_not_specialize:
                signature[param.name], constexprs[key] = "constexpr", 1
                continue
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0 and not param.do_not_specialize:
                attrs[key] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"{kernel.fn.__name__}: argument {param.name} of type {type(value).__name__}")
    return signature, constexprs, attrs


def compile_launch(kernel: JITFunction, arguments: dict, options: dict):
    """One recorded launch compiled for sm_90: Triton's `CompiledKernel` (`asm["cubin"]`, `metadata`)."""
    signature, constexprs, attrs = specialise(kernel, arguments)
    source = ASTSource
    if kernel.is_gluon():  # a Gluon kernel's source is lowered from its own layouts, not Triton's passes
        from triton.experimental.gluon._runtime import GluonASTSource as source
    return triton.compile(source(kernel, signature, constexprs=constexprs, attrs=attrs), target=TARGET,
                          options=options)


def cuobjdump(compiled, flag: str) -> str:
    """`cuobjdump <flag>` (`-sass`, `-res-usage`) of a compiled kernel's cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run([str(CUOBJDUMP), flag, cubin.name], capture_output=True, text=True, check=True).stdout
