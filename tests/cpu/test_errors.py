"""The error hierarchy (``dflash.errors``) and the CLI's exit codes 2 / 3 / 4 and ``--debug``."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import dflash
import dflash.commands.generate as generate_command
import dflash.execution.run as run_module
from dflash import api, errors
from dflash.cli import main
from dflash.commands.validate import UnusableInput
from dflash.errors import (
    CheckpointError,
    ConfigError,
    DFlashError,
    ExecutionError,
    GeometryError,
    KernelBoundsError,
    UsageError,
)
from dflash.execution.capture_gate import CaptureGate, ShardStorage
from dflash.execution.errors import (
    IllegalTransitionError,
    InjectedFault,
    LayerSplitError,
    PoisonedError,
    RollbackConfigError,
    ShardPositionError,
)
from dflash.execution.session import SessionError
from dflash.kernels import RollbackBoundsError
from dflash.model.caches import CacheError
from dflash.model.drafters import errors as drafter_errors
from dflash.model.tokenizer import TextEncodingError
from dflash.serve import ServeError

LAYERS = (GeometryError, KernelBoundsError, CheckpointError, ConfigError, ExecutionError,
          UsageError)
#: family roots that belong to no single layer (their subclasses do)
ROOTS = (DFlashError, drafter_errors.DrafterError)

# public error class -> the layer(s) it belongs to
EXPECTED: list[tuple[type[Exception], tuple[type[Exception], ...]]] = [
    (RollbackBoundsError, (KernelBoundsError,)),
    (drafter_errors.DrafterCheckpointError, (CheckpointError,)),
    (drafter_errors.CheckpointFileError, (CheckpointError,)),
    (drafter_errors.CheckpointConfigError, (CheckpointError,)),
    (drafter_errors.MissingKeysError, (CheckpointError,)),
    (drafter_errors.UnexpectedKeysError, (CheckpointError,)),
    (drafter_errors.TensorShapeError, (CheckpointError,)),
    (drafter_errors.TargetMismatchError, (ConfigError,)),
    (drafter_errors.DraftArgumentError, (UsageError,)),
    (drafter_errors.UnknownDrafterSpecError, (UsageError,)),
    (drafter_errors.OracleMismatchError, (UsageError,)),
    (CacheError, (ExecutionError,)),
    (ShardPositionError, (ExecutionError,)),
    (PoisonedError, (ExecutionError,)),
    (IllegalTransitionError, (ExecutionError,)),
    (InjectedFault, (ExecutionError,)),
    (LayerSplitError, (ExecutionError, UsageError)),  # a bad --devices / --layer-split
    (RollbackConfigError, (ExecutionError, UsageError)),  # a bad --rollback / env value
    (SessionError, (UsageError,)),
    (UnusableInput, (UsageError,)),
    (api.ArgumentError, (UsageError,)),  # a bad argument of dflash.load / LLM methods
    (api.ChatTemplateError, (CheckpointError,)),
    (TextEncodingError, (UsageError,)),  # text that is not valid UTF-8
    (ServeError, (UsageError,)),  # a request dflash serve refuses (answered 4xx / 503)
]


def _dflash_exception_classes() -> dict[type[BaseException], str]:
    found: dict[type[BaseException], str] = {}
    for info in pkgutil.walk_packages(dflash.__path__, "dflash."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if (inspect.isclass(obj) and issubclass(obj, BaseException)
                    and obj.__module__ == module.__name__):
                found[obj] = module.__name__
    return found


def test_every_error_class_in_the_package_is_a_dflash_error_of_a_layer() -> None:
    found = _dflash_exception_classes()
    assert set(EXPECTED_CLASSES := [c for c, _ in EXPECTED]) <= set(found)
    assert len(EXPECTED_CLASSES) == len(set(EXPECTED_CLASSES))
    outside = [f"{m}.{c.__name__}" for c, m in found.items() if not issubclass(c, DFlashError)]
    assert outside == [], "error classes outside the dflash.errors hierarchy"
    layerless = [f"{m}.{c.__name__}" for c, m in found.items()
                 if c not in ROOTS and not any(issubclass(c, layer) for layer in LAYERS)]
    assert layerless == [], "error classes that belong to no layer"


@pytest.mark.parametrize(("cls", "layers"), EXPECTED, ids=lambda v: getattr(v, "__name__", ""))
def test_public_errors_belong_to_their_layer(
    cls: type[Exception], layers: tuple[type[Exception], ...]
) -> None:
    assert issubclass(cls, DFlashError)
    assert {layer for layer in LAYERS if issubclass(cls, layer)} == set(layers)


def test_layer_errors_are_the_package_errors() -> None:
    """One class per layer: the names each package exports are dflash.errors' classes."""
    import dflash.execution
    import dflash.geometry
    import dflash.model
    import dflash.model.loading

    assert dflash.geometry.GeometryError is GeometryError
    assert dflash.model.ConfigError is ConfigError
    assert dflash.model.CheckpointError is CheckpointError
    assert dflash.model.loading.CheckpointError is CheckpointError
    assert dflash.execution.ExecutionError is ExecutionError
    assert sorted(errors.__all__) == sorted(c.__name__ for c in (DFlashError, *LAYERS))


def test_compatibility_bases() -> None:
    """Former ValueErrors still are; execution errors are neither ValueError nor RuntimeError."""
    cls: type[Exception]
    for cls in (GeometryError, KernelBoundsError, CheckpointError, ConfigError, UsageError,
                RollbackBoundsError, drafter_errors.DrafterError, SessionError):
        assert issubclass(cls, ValueError), cls
    for cls in (ExecutionError, PoisonedError, IllegalTransitionError, CacheError):
        assert not issubclass(cls, (ValueError, RuntimeError)), cls
    for cls in (CheckpointError, ConfigError, ExecutionError, UsageError, KernelBoundsError):
        assert not any(issubclass(cls, other) for other in LAYERS if other is not cls), cls


def test_geometry_error_carries_the_rejection() -> None:
    from dflash.geometry import RejectReason, require_chain

    with pytest.raises(DFlashError) as info:
        require_chain([0, 0])
    exc = info.value
    assert isinstance(exc, GeometryError) and isinstance(exc, ValueError)
    assert exc.reason is RejectReason.MALFORMED_ROOT and exc.slot == 0
    assert str(exc).startswith("malformed_root: ")


def test_errors_and_geometry_import_no_torch() -> None:
    code = ("import sys, dflash.errors, dflash.geometry; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)")
    subprocess.run([sys.executable, "-c", code], check=True)


def _storage(live_slot: int | None) -> ShardStorage:
    return ShardStorage(index=0, device="cpu", layers=(0, 1), owned_recurrent=(0,),
                        pool=SimpleNamespace(live_slot=live_slot),  # type: ignore[arg-type]  # only live_slot is read
                        state_shape=(1, 1, 1, 1), conv_rows_shape=(1, 1, 1))


def test_capture_gate_refuses_with_a_typed_error() -> None:
    gate = CaptureGate(requested=True, tolerance=1e-3)
    with pytest.raises(IllegalTransitionError, match=r"live state lies in a slot \(live_slot=2\)"):
        gate.arm([_storage(2)])
    with pytest.raises(IllegalTransitionError, match=r"replayed live state .*\(live_slot=0\)"):
        gate.self_test([_storage(0)], 0, [(torch.zeros(1), torch.zeros(1))], step=1)


# -- the CLI: exit 2 (bad input), 3 (decoding failed), 4 (internal error), --debug -------------

FAST = [  # the seeded tiny model (the default model is the embedded trained pair)
    "--model", "tiny", "--max-new-tokens", "4", "--block-size", "4", "--no-progress",
    "--devices", "cpu",
]


def _raise(exc: BaseException) -> object:
    def raiser(*args: object, **kwargs: object) -> object:
        raise exc

    return raiser


@pytest.mark.parametrize(
    "exc",
    [UsageError("--thing must be >= 1 (got 0)"), ConfigError("config field 'x': bad"),
     CheckpointError("'model.safetensors' is truncated"), SessionError("--prompt is empty")],
    ids=lambda e: type(e).__name__,
)
def test_bad_input_exits_2_with_one_line(
    exc: Exception, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(generate_command, "prepare", _raise(exc))
    assert main(["generate", *FAST]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"dflash generate: error: {exc}\n"


def test_a_real_bad_option_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", *FAST, "--max-new-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert err == "dflash generate: error: --max-new-tokens must be >= 1 (got 0)\n"


@pytest.mark.parametrize(
    "exc",
    [PoisonedError("rollback failed mid-way"), CacheError("KV cache exhausted"),
     KernelBoundsError("'commit_n' out of range"),
     torch.cuda.OutOfMemoryError("CUDA out of memory")],
    ids=lambda e: type(e).__name__,
)
def test_a_decoding_failure_exits_3(
    exc: Exception, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(run_module, "generate", _raise(exc))
    assert main(["generate", *FAST]) == 3
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err.splitlines()[-1] == f"dflash generate: failed: {type(exc).__name__}: {exc}"


@pytest.mark.parametrize("phase", ["prepare", "decode"])
@pytest.mark.parametrize(
    "exc", [ValueError("a bug\nover two lines"), KeyError("bug"), RuntimeError("bug")],
    ids=lambda e: type(e).__name__,
)
def test_an_internal_error_exits_4_with_one_line(
    phase: str, exc: Exception, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bugs (a bare ValueError included) are neither 'unusable arguments' nor 'failed'."""
    if phase == "prepare":
        monkeypatch.setattr(generate_command, "prepare", _raise(exc))
    else:
        monkeypatch.setattr(run_module, "generate", _raise(exc))
    assert main(["generate", *FAST]) == 4
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and "Traceback" not in err
    if phase == "prepare":  # nothing else was printed yet: exactly one line
        assert len(lines) == 1
    message = " ".join(str(exc).split())
    assert lines[-1] == (f"dflash generate: internal error: {type(exc).__name__}: {message} "
                         "(run `dflash --debug ...` for the traceback)")


def test_debug_prints_the_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        # a genuine bug, a KeyError from inside the command; the traceback shows this line
        {}["missing"]  # type: ignore[index]  # the untyped empty dict on purpose

    monkeypatch.setattr(generate_command, "prepare", broken)
    assert main(["--debug", "generate", *FAST]) == 4
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert 'in broken\n    {}["missing"]' in err
    assert err.splitlines()[-1] == "dflash generate: internal error: KeyError: 'missing'"

    monkeypatch.setattr(generate_command, "prepare", _raise(UsageError("--x is bad")))
    assert main(["--debug", "generate", *FAST]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.splitlines()[-1] == "dflash generate: error: --x is bad"

    monkeypatch.setattr(generate_command, "prepare", _raise(PoisonedError("oracle run failed")))
    assert main(["--debug", "generate", *FAST]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err
    assert err.splitlines()[-1] == "dflash generate: failed: PoisonedError: oracle run failed"


def test_an_internal_error_in_any_command_exits_4(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import dflash.commands.validate as validate_command

    monkeypatch.setattr(validate_command, "run", _raise(AttributeError("no attribute 'x'")))
    assert main(["validate", "-"]) == 4
    assert capsys.readouterr().err == (
        "dflash validate: internal error: AttributeError: no attribute 'x' "
        "(run `dflash --debug ...` for the traceback)\n"
    )


def test_interrupt_and_closed_stdout_keep_their_exits(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import dflash.cli as cli

    monkeypatch.setattr(generate_command, "prepare", _raise(BrokenPipeError()))
    assert main(["generate", *FAST]) == cli.EXIT_BROKEN_PIPE
    monkeypatch.setattr(generate_command, "prepare", _raise(KeyboardInterrupt()))
    assert main(["generate", *FAST]) == cli.EXIT_INTERRUPTED
    assert "internal error" not in capsys.readouterr().err
