"""`longflow.kernels.precision.ieee_products`: the kernels' rule for IEEE float32 products."""

import pytest
import torch

from longflow.kernels.precision import ieee_products


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_stay_16_bit_on_a_gpu(monkeypatch, dtype):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not ieee_products(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_interpreter_widens_16_bit_inputs(monkeypatch, dtype):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ieee_products(dtype)


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_float32_inputs_never_drop_to_tf32(monkeypatch, interpret):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    assert ieee_products(torch.float32)
