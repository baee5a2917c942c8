"""The public `swarm.kernels` API: dispatch, the wire container's validation, the wire budget, mixed backends."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import assert_within_bound, over_the_wire, sample

import swarm.kernels as kernels
from swarm.kernels import (
    DEFAULT_GROUP_SIZE,
    SCALE_DTYPE,
    QuantizedTensor,
    apply_delta,
    aqsgd_update,
    cpu,
    dequantize,
    packed_nbytes,
    quantize,
    reference,
)


def test_default_call_round_trips_any_shape():
    x = torch.randn(4, 33, 17)
    q = quantize(x, 4)
    assert q.group_size == DEFAULT_GROUP_SIZE and q.scales.dtype == SCALE_DTYPE
    y = dequantize(q).view_as(x)
    assert_within_bound(x, q, y.reshape(-1), stochastic=True)


def test_tensors_that_require_grad_are_taken_as_data():
    a = torch.randn(8, 64, requires_grad=True)
    m = torch.zeros(8, 64, dtype=torch.float16)
    q = aqsgd_update(a * 2, m, 4)
    assert not q.packed.requires_grad and not m.requires_grad
    assert not dequantize(quantize(a, 8)).requires_grad


def test_dispatch_on_this_machine():
    assert kernels.backend_name("cpu") == ("cpu" if cpu.available() else "reference")
    assert kernels.backend_name("cpu", group_size=100) == "reference"  # groups must start on a byte
    x = sample("normal", 1000)
    q = quantize(x, 3, group_size=100, stochastic=False)
    assert torch.equal(q.packed, reference.quantize(x, 3, 100, stochastic=False).packed)
    assert_within_bound(x, q, dequantize(q), stochastic=False)


@pytest.mark.parametrize("bits,budget", [(2, 14), (4, 7)])
def test_wire_budget_at_the_default_group_size(bits, budget):
    """2-bit codes with their scales and mins fit in 1/14 of float32's bytes; 4-bit in 1/7."""
    numel = 1 << 20
    q = quantize(torch.randn(numel), bits)
    assert q.nbytes == packed_nbytes(numel, bits) + 2 * q.scales.numel() * q.scales.element_size()
    assert q.nbytes <= numel * 4 / budget
    assert 64 <= DEFAULT_GROUP_SIZE <= 512


@pytest.mark.parametrize(
    "field,value",
    [
        ("packed", torch.zeros(99, dtype=torch.uint8)),
        ("packed", torch.zeros(100, dtype=torch.int8)),
        ("scales", torch.zeros(4, dtype=torch.float16)),
        ("mins", torch.zeros(3)),
        ("bits", 5),
        ("group_size", 0),
    ],
)
def test_malformed_wire_tensors_are_rejected(field, value):
    """A QuantizedTensor decoded from the wire cannot make a kernel read out of bounds."""
    fields = {
        "packed": torch.zeros(100, dtype=torch.uint8),
        "scales": torch.zeros(4),
        "mins": torch.zeros(4),
        "bits": 4,
        "group_size": 64,
        "numel": 200,
    }
    QuantizedTensor(**fields)
    with pytest.raises(ValueError):
        QuantizedTensor(**{**fields, field: value})


@pytest.mark.parametrize("sender,receiver", [(cpu, reference), (reference, cpu)])
def test_mixed_backends_keep_buffers_bit_identical(sender, receiver):
    if not cpu.available():
        pytest.skip("the C++ CPU kernels could not be built here")
    generator = torch.Generator().manual_seed(1)
    activation = torch.randn(4, 300, generator=generator)
    m_sender = activation.to(torch.bfloat16)
    m_receiver = m_sender.clone()
    for step in range(20):
        activation = activation * 0.98 + 0.1 * torch.randn(activation.shape, generator=generator)
        q = sender.aqsgd_update(activation, m_sender, 2, 256, seed=step)
        receiver.apply_delta(m_receiver, over_the_wire(q))
        assert torch.equal(m_sender, m_receiver)


def test_public_update_and_apply_delta_agree_over_rounds():
    generator = torch.Generator().manual_seed(2)
    activation = torch.randn(2, 64, 48, generator=generator)
    m_sender = activation.half()
    m_receiver = m_sender.clone()
    for _ in range(30):
        activation = activation + 0.05 * torch.randn(activation.shape, generator=generator)
        q = aqsgd_update(activation, m_sender, 2)
        assert apply_delta(m_receiver, over_the_wire(q)) is m_receiver
        assert torch.equal(m_sender, m_receiver)


def test_public_names():
    assert set(kernels.__all__) >= {
        "QuantizedTensor",
        "quantize",
        "dequantize",
        "aqsgd_update",
        "apply_delta",
        "DEFAULT_GROUP_SIZE",
        "packed_nbytes",
    }
    assert packed_nbytes(0, 3) == 0 and packed_nbytes(3, 3) == 2 and packed_nbytes(8, 3) == 3
