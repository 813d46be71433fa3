"""One rule for "an allocation failed", shared by the caches, model building and the
commands: ``MemoryError``, ``torch.OutOfMemoryError`` and torch's plain ``RuntimeError``
allocation failures; nothing else."""

from __future__ import annotations

import pytest
import torch

from dflash.commands.generate import build_model_checked
from dflash.commands.resources import InsufficientMemoryError
from dflash.model import HybridConfig
from dflash.model.caches import is_out_of_memory


def _real_cpu_failure() -> RuntimeError:
    try:
        torch.empty(2**62, dtype=torch.uint8)  # more bytes than any machine has
    except RuntimeError as exc:
        return exc
    raise AssertionError("an allocation of 2**62 bytes succeeded")


OUT_OF_MEMORY = {
    "memory-error": MemoryError(),
    "torch-oom": torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    "cuda-oom": torch.cuda.OutOfMemoryError("CUDA out of memory."),
    "cpu-posix": RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 4611686018427387904 bytes. Error code 12"
    ),
    "cpu-windows": RuntimeError(
        "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: "
        "you tried to allocate 911360 bytes."
    ),
    "device-runtime": RuntimeError("CUDA error: out of memory"),
    "cpu-real": _real_cpu_failure(),
}
NOT_OUT_OF_MEMORY = {
    "shapes": RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"),
    "value-error": ValueError("out of memory"),  # only RuntimeErrors are read
    "os-error": OSError(12, "Cannot allocate memory"),
    "empty-runtime": RuntimeError(),
}


@pytest.mark.parametrize("exc", OUT_OF_MEMORY.values(), ids=OUT_OF_MEMORY.keys())
def test_allocation_failures_are_out_of_memory(exc: BaseException) -> None:
    assert is_out_of_memory(exc)


@pytest.mark.parametrize("exc", NOT_OUT_OF_MEMORY.values(), ids=NOT_OUT_OF_MEMORY.keys())
def test_other_errors_are_not(exc: BaseException) -> None:
    assert not is_out_of_memory(exc)


def _building_raises(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    import dflash.execution.session as session

    def build_model(*args: object, **kwargs: object) -> None:
        raise exc

    monkeypatch.setattr(session, "build_model", build_model)
    build_model_checked(
        "tiny", HybridConfig.tiny_default(), seed=0, dtype=torch.float32, device="cpu"
    )


@pytest.mark.parametrize(
    "exc",
    [OUT_OF_MEMORY[k] for k in ("memory-error", "torch-oom", "cpu-posix", "cpu-windows")],
    ids=["memory-error", "torch-oom", "cpu-posix", "cpu-windows"],
)
def test_building_a_model_classifies_by_the_same_rule(
    monkeypatch: pytest.MonkeyPatch, exc: BaseException
) -> None:
    with pytest.raises(InsufficientMemoryError, match=r"model 'tiny' has 0\.28 M parameters.*"
                       r"cpu ran out of memory while building it"):
        _building_raises(monkeypatch, exc)


def test_building_a_model_passes_other_errors_on(monkeypatch: pytest.MonkeyPatch) -> None:
    exc = NOT_OUT_OF_MEMORY["shapes"]
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        _building_raises(monkeypatch, exc)
