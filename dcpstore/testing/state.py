"""State dicts for tests: one that exercises every tensor kind DCP round-trips, and a
bit-exact comparison."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["assert_state_equal", "empty_like_state", "many_dtypes_state"]


def many_dtypes_state(seed: int = 0) -> dict[str, Any]:
    """A state dict exercising every tensor kind DCP must round-trip, plus objects."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(6, 8, generator=g)
    return {
        "f32": torch.randn(33, 7, generator=g),
        "f64": torch.randn(5, dtype=torch.float64, generator=g),
        "f16": torch.randn(4, 4, generator=g).half(),
        "bf16": torch.randn(17, generator=g).to(torch.bfloat16),
        "i8": torch.randint(-128, 127, (9,), dtype=torch.int8, generator=g),
        "u8": torch.randint(0, 255, (3, 3), dtype=torch.uint8, generator=g),
        "i64": torch.randint(-(2**40), 2**40, (4,), generator=g),
        "bool": torch.rand(10, generator=g) > 0.5,
        "c64": torch.randn(3, dtype=torch.complex64, generator=g),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "view_t": base.t(),
        "view_slice": base[1:4, ::2],
        "nested": {"w": torch.arange(12.0).reshape(3, 4), "step": 7},
        "obj": {"name": "run7", "lr": 3e-4, "milestones": [1, 2, 3]},
        "text": "hello",
    }


def empty_like_state(state: dict[str, Any]) -> dict[str, Any]:
    """Zeros of the same shapes and dtypes (``None`` for objects), to load into."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v.contiguous())
        elif isinstance(v, dict):
            out[k] = empty_like_state(v)
        else:
            out[k] = None
    return out


def assert_state_equal(actual: Any, expected: Any, path: str = "") -> None:
    """Bit-exact comparison of nested state (tensors compared by bytes, dtype, shape)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {actual.shape} != {expected.shape}"
        a = actual.detach().contiguous().view(-1)
        e = expected.detach().contiguous().view(-1)
        if a.numel():
            assert torch.equal(a.view(torch.uint8) if a.dtype != torch.bool else a,
                               e.view(torch.uint8) if e.dtype != torch.bool else e), path
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), f"{path}: keys {set(actual)} != {set(expected)}"
        for k in expected:
            assert_state_equal(actual[k], expected[k], f"{path}.{k}" if path else k)
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"
