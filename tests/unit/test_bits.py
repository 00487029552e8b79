"""The one raw-bits module: reinterpretation, hex for messages, equality and the mismatch message."""

import pytest
import torch

from moeverify.oracles.bits import bits, bitwise_equal, compare_bits, hex_bits


def test_bits_bf16_and_hex():
    x = torch.tensor([1.0], dtype=torch.bfloat16)
    assert bits(x).dtype == torch.int16 and hex_bits(int(bits(x)[0]), torch.bfloat16) == "0x3f80"
    assert hex_bits(-1, torch.float32) == "0xffffffff"


def test_bits_complex_refused():
    with pytest.raises(TypeError, match="complex tensors are not supported"):
        bits(torch.zeros(2, dtype=torch.complex64))


def test_bitwise_equal_same_bits():
    a = torch.tensor([1.0, -2.5, float("nan")])
    assert bitwise_equal(a, a.clone())


def test_bitwise_equal_negative_zero_differs():
    assert not bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0]))


def test_bitwise_equal_dtype_differs():
    assert not bitwise_equal(torch.zeros(2), torch.zeros(2, dtype=torch.float64))


def test_bitwise_equal_one_ulp_differs():
    a = torch.tensor([1.0])
    assert not bitwise_equal(a, torch.nextafter(a, torch.tensor([2.0])))


def test_bitwise_equal_bool_and_int_and_non_contiguous():
    assert bitwise_equal(torch.tensor([True, False]), torch.tensor([True, False]))
    assert not bitwise_equal(torch.tensor([1, 2]), torch.tensor([1, 3]))
    m = torch.arange(6.0).reshape(2, 3)
    assert bitwise_equal(m.t(), m.t().contiguous())


def test_compare_bits_equal_is_none():
    a = torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)
    assert compare_bits("w", a, a.clone()) is None


def test_compare_bits_negative_zero_names_element_and_bits():
    msg = compare_bits("w", torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0]))
    assert msg == "w: 1 of 2 elements differ: [0] expected 0x00000000 got 0x80000000"


def test_compare_bits_dtype_mismatch():
    msg = compare_bits("w", torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16))
    assert msg == "w: dtype/shape torch.bfloat16 (2,) != expected torch.float32 (2,)"
