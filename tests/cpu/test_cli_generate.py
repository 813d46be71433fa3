"""``dflash generate``: the result contract (README, `--json`), stdout/stderr discipline, errors."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dflash.cli import main
from dflash.execution import reference_greedy, token_sha256

FAST = [  # the seeded tiny model (the default model is the embedded trained pair)
    "--model", "tiny", "--max-new-tokens", "8", "--block-size", "4", "--no-progress",
    "--devices", "cpu",
]
SECTION5 = {
    "tokens",
    "sha256",
    "steps",
    "acceptance_rate",
    "avg_commit",
    "target_forwards_per_step",
    "rollback",
    "capture",
    "checkpoint_bytes",
    "parity",
    "timings",
}


def _json_run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[dict, str]:  # type: ignore[type-arg]
    code = main(["generate", "--json", *FAST, *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 1  # exactly one JSON object on stdout, nothing else
    return json.loads(lines[0]), err


def test_json_result_has_the_section_5_contract(capsys: pytest.CaptureFixture[str]) -> None:
    result, err = _json_run(capsys, "--rollback", "checkpoint", "--check-parity")
    assert set(result) >= SECTION5
    assert len(result["tokens"]) == 8 and all(isinstance(t, int) for t in result["tokens"])
    assert result["sha256"] == token_sha256(result["tokens"])
    assert set(result["rollback"]) >= {
        "requested",
        "status",
        "fast",
        "replay",
        "replay_after_failure",
    }
    assert result["rollback"]["requested"] == "checkpoint"
    assert result["rollback"]["status"] == "effective"
    assert result["capture"]["verdict"] == "validated"
    assert set(result["timings"]) == {
        "prefill_s",
        "prefill_tokens_per_s",
        "decode_s",
        "tokens_per_s",
        "greedy_decode_s",
        "greedy_tokens_per_s",
        "decode_runs_s",
        "greedy_decode_runs_s",
    }
    assert result["parity"] is True
    assert result["checkpoint_bytes"] > 0
    assert "status requested" in err  # reported at start: requested, not "on"
    assert "capture gate" in err and "sha256" in err  # the summary table is on stderr


def test_the_baseline_checks_parity_and_replay_reports_off(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result, _ = _json_run(capsys, "--rollback", "replay")
    assert result["parity"] is True  # the greedy baseline's tokens, compared for free
    assert result["parity_sha256"] == result["sha256"]
    assert result["rollback"]["status"] == "off" and result["rollback"]["fast"] == 0


def test_two_cpu_shards_give_the_same_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    one, _ = _json_run(capsys, "--rollback", "remap")
    code = main(
        [
            "generate",
            "--json",
            *FAST[:-2],
            "--devices",
            "cpu,cpu",
            "--layer-split",
            "2,4",
            "--rollback",
            "remap",
        ]
    )
    out, _ = capsys.readouterr()
    assert code == 0
    two = json.loads(out)
    assert two["tokens"] == one["tokens"] and two["layer_split"] == [2, 4]


def test_environment_variable_selects_the_mode(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DFLASH_ROLLBACK", "remap")
    result, _ = _json_run(capsys)
    assert result["rollback"]["requested"] == "remap"
    result, _ = _json_run(capsys, "--rollback", "replay")  # the CLI wins over the environment
    assert result["rollback"]["requested"] == "replay"
    monkeypatch.setenv("DFLASH_ROLLBACK", "fastest")
    assert main(["generate", *FAST]) == 2
    assert (
        "environment variable DFLASH_ROLLBACK must be one of replay, checkpoint, remap, "
        "recompute (got 'fastest')" in capsys.readouterr().err
    )


def test_synthetic_drafter_with_full_acceptance(capsys: pytest.CaptureFixture[str]) -> None:
    result, _ = _json_run(
        capsys,
        "--draft",
        "synthetic",
        "--acceptance",
        "1.0",
        "--prompt-ids",
        "3,14,15",
        "--check-parity",
    )
    assert result["acceptance_rate"] == 1.0 and result["parity"] is True
    assert result["drafter"] == "synthetic"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--devices", "cpu,cpu", "--layer-split", "6,0"], "--layer-split entry 1 must be >= 1"),
        (["--devices", "cpu,cpu", "--layer-split", "2,2"], "must sum to the model's 6 layers"),
        (["--devices", "cpu", "--layer-split", "3,3"], "has 2 counts but --devices names 1"),
        (["--devices", "cpu,,cpu"], "without empty entries"),
        (["--prompt-ids", "3,999"], "--prompt-ids entry 1 must be a token id in [0, 256)"),
        (["--block-size", "1"], "--block-size must be in [2, 1024] (got 1)"),
        (["--block-size", "100000"], "--block-size must be in [2, 1024] (got 100000)"),
        (["--eos-id", "-3"], "--eos-id must be a token id in [0, 256) (got -3)"),
        (["--devices", ""], "--devices must name at least one device (got '')"),
        (
            ["--model", "/no/such/dir"],
            "or a checkpoint directory (got '/no/such/dir': no such directory)",
        ),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["generate", *FAST[:-2], *args]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert message in err and "Traceback" not in err


def test_eos_stops_generation(capsys: pytest.CaptureFixture[str]) -> None:
    full, _ = _json_run(capsys, "--rollback", "checkpoint")
    eos = full["tokens"][3]
    first = full["tokens"].index(eos)
    cut, _ = _json_run(capsys, "--rollback", "checkpoint", "--eos-id", str(eos))
    assert cut["tokens"] == full["tokens"][: first + 1]
    assert cut["stop_reason"] == "eos"


def test_a_bad_split_is_refused_before_building_a_large_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # nine-b-shape has 32 layers; the refusal comes from the config, no weights are drawn
    code = main(
        [
            "generate",
            "--model",
            "nine-b-shape",
            "--devices",
            "cpu,cpu",
            "--layer-split",
            "16,15",
            "--no-progress",
        ]
    )
    assert code == 2
    assert "must sum to the model's 32 layers (got [16, 15], sum 31)" in capsys.readouterr().err


def test_a_failure_while_decoding_exits_3_without_a_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import dflash.execution.run as run_module
    from dflash.execution.errors import PoisonedError

    def broken(*args: object, **kwargs: object) -> None:
        raise PoisonedError("device lost")  # any DFlashError while decoding (bugs exit 4)

    monkeypatch.setattr(run_module, "generate", broken)
    assert main(["generate", *FAST]) == 3
    out, err = capsys.readouterr()
    assert out == ""
    assert "failed: PoisonedError: device lost" in err and "Traceback" not in err


def _count_greedy(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    """Record every plain-greedy decode that ``generate`` runs (its keyword arguments)."""
    import dflash.execution.run as run_module

    calls: list[dict[str, object]] = []
    real = reference_greedy

    def counting(*args: Any, **kwargs: Any) -> list[int]:
        calls.append({"n": args[3], **kwargs})
        return real(*args, **kwargs)

    monkeypatch.setattr(run_module, "reference_greedy", counting)
    return calls


def test_greedy_baseline_is_measured_in_the_same_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _count_greedy(monkeypatch)
    result, err = _json_run(capsys, "--check-parity", "--no-graphs", "--repeats", "1")
    # one greedy decode of the same token count serves the baseline and the parity check,
    # with the speculative run's CUDA-graph setting
    assert [(c["n"], c["graphs"]) for c in calls] == [(len(result["tokens"]), False)]
    assert result["parity"] is True
    t = result["timings"]
    assert t["greedy_decode_s"] > 0 and t["greedy_decode_runs_s"] == [t["greedy_decode_s"]]
    assert t["decode_runs_s"] == [t["decode_s"]]
    assert t["greedy_tokens_per_s"] == (len(result["tokens"]) - 1) / t["greedy_decode_s"]
    assert result["speedup_vs_greedy"] == t["tokens_per_s"] / t["greedy_tokens_per_s"]
    speedup, greedy = result["speedup_vs_greedy"], t["greedy_tokens_per_s"]
    assert f"speed-up vs plain greedy  {speedup:.2f}x (greedy {greedy:.1f} tokens/s)\n" in err


def test_the_cpu_default_times_three_alternating_runs_each(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import statistics

    import dflash.execution.run as run_module

    order: list[str] = []
    real_spec, real_greedy = run_module._speculative_run, reference_greedy

    def spec(*args: Any, **kwargs: Any) -> Any:
        order.append("spec")
        return real_spec(*args, **kwargs)

    def greedy(*args: Any, **kwargs: Any) -> list[int]:
        order.append("greedy")
        order.append(f"target {id(kwargs['target'])}")
        return real_greedy(*args, **kwargs)

    monkeypatch.setattr(run_module, "_speculative_run", spec)
    monkeypatch.setattr(run_module, "reference_greedy", greedy)
    result, err = _json_run(capsys)  # CPU, no --repeats: 3
    assert order[::3] == ["spec"] * 3 and order[1::3] == ["greedy"] * 3  # alternating
    assert len(set(order[2::3])) == 1  # one greedy target for the three
    t, n = result["timings"], len(result["tokens"])
    assert len(t["decode_runs_s"]) == len(t["greedy_decode_runs_s"]) == 3
    assert t["decode_s"] == statistics.median(t["decode_runs_s"])
    assert t["greedy_decode_s"] == statistics.median(t["greedy_decode_runs_s"])
    assert t["tokens_per_s"] == (n - 1) / t["decode_s"]
    assert t["greedy_tokens_per_s"] == (n - 1) / t["greedy_decode_s"]
    assert result["speedup_vs_greedy"] == t["tokens_per_s"] / t["greedy_tokens_per_s"]
    assert result["parity"] is True and "medians of 3 alternating runs each)" in err
    order.clear()
    result, _ = _json_run(capsys, "--repeats", "2")
    assert order[::3] == ["spec"] * 2 and len(result["timings"]["decode_runs_s"]) == 2


def test_a_repeat_with_other_tokens_fails_parity(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import dflash.execution.run as run_module

    real = run_module._speculative_run
    runs: list[int] = []

    def drifting(*args: Any, **kwargs: Any) -> Any:
        tokens, stop, times = real(*args, **kwargs)
        runs.append(1)
        if len(runs) == 3:  # the third run decodes something else
            tokens = [(tokens[0] + 1) % 64, *tokens[1:]]
        return tokens, stop, times

    monkeypatch.setattr(run_module, "_speculative_run", drifting)
    code = main(["generate", "--json", *FAST])
    out, _ = capsys.readouterr()
    assert code == 1 and json.loads(out)["parity"] is False and len(runs) == 3


def test_bad_repeats_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", *FAST, "--repeats", "0"]) == 2
    assert "--repeats must be >= 1 (got 0)" in capsys.readouterr().err
    assert main(["generate", *FAST, "--repeats", "2", "--no-baseline"]) == 2
    assert "--repeats 2 times the plain greedy baseline too" in capsys.readouterr().err


def test_no_baseline_nulls_the_fields_and_parity_still_decodes_once(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _count_greedy(monkeypatch)
    result, err = _json_run(capsys, "--no-baseline")
    assert calls == [] and result["parity"] is None
    assert result["timings"]["greedy_tokens_per_s"] is None
    assert result["timings"]["greedy_decode_s"] is None
    assert result["speedup_vs_greedy"] is None
    assert "speed-up vs plain greedy  not measured (--no-baseline)" in err
    result, _ = _json_run(capsys, "--no-baseline", "--check-parity")
    assert len(calls) == 1 and result["parity"] is True
    assert result["timings"]["greedy_tokens_per_s"] is None
    assert result["speedup_vs_greedy"] is None


def test_synthetic_drafter_reuses_its_oracle_but_times_a_real_greedy_decode(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _count_greedy(monkeypatch)  # the drafter's own oracle run is not counted here
    synthetic = ("--draft", "synthetic", "--acceptance", "1.0", "--check-parity")
    result, _ = _json_run(capsys, *synthetic, "--no-baseline")
    assert calls == [] and result["parity"] is True  # parity from the drafter's oracle
    result, _ = _json_run(capsys, *synthetic, "--repeats", "1")
    assert len(calls) == 1 and result["parity"] is True
    t = result["timings"]
    assert result["speedup_vs_greedy"] == t["tokens_per_s"] / t["greedy_tokens_per_s"]


def test_one_token_has_no_speedup(capsys: pytest.CaptureFixture[str]) -> None:
    result, err = _json_run(capsys, "--max-new-tokens", "1")
    assert result["timings"]["tokens_per_s"] is None
    assert result["timings"]["greedy_decode_s"] is not None  # the baseline ran (prefill only)
    assert result["timings"]["greedy_tokens_per_s"] is None
    assert result["speedup_vs_greedy"] is None
    assert "speed-up vs plain greedy  none (no decode step" in err


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be reported later"),
        MemoryError("host allocation of 4096 bytes failed"),
    ],
    ids=["runtime-oom", "memory-error"],
)
def test_out_of_memory_mid_decode_exits_3_with_no_partial_json(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    from dflash.model.target import TargetModel

    real = TargetModel.compute_layers
    calls = {"n": 0}

    def failing(self: TargetModel, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:  # the prefill and a verify ran; the next forward fails
            raise error
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TargetModel, "compute_layers", failing)
    assert main(["generate", "--json", *FAST, "--no-baseline"]) == 3
    out, err = capsys.readouterr()
    assert calls["n"] == 3
    assert out == ""  # no partial JSON object
    last = err.strip().splitlines()[-1]
    assert last.startswith("dflash generate: failed:") and "memory" in last.lower()
    assert "Traceback" not in err and "reported later" not in err


@pytest.mark.parametrize("timing", [["--no-baseline"], ["--repeats", "3"]])
def test_a_budget_past_max_position_exits_2_before_decoding(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, timing: list[str]
) -> None:
    """One run (the library's generate refuses it) or kept targets for repeats (the
    speculative target refuses it before the greedy one is built): nothing decodes."""
    import dflash.execution.run as run_module
    from dflash.execution.shards import ShardedTarget

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("a target was built or decoding started")

    monkeypatch.setattr(run_module, "_speculative_run", never)
    monkeypatch.setattr(run_module, "reference_greedy", never)
    monkeypatch.setattr(ShardedTarget, "__init__", never)
    args = ["generate", "--json", *FAST, *timing]
    args[args.index("--max-new-tokens") + 1] = "5000"
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "max_new_tokens=5000" in err and "max_position_embeddings=4096" in err
    assert "Traceback" not in err


def test_capture_storage_that_does_not_fit_is_reported_and_decoding_goes_on(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import dflash.model.caches as caches_module

    real = caches_module.allocate_capture

    def allocate(what: str, shape: tuple[int, ...], dtype: Any, device: Any) -> Any:
        if what == "checkpoints" and shape[0] > 1:
            raise RuntimeError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return real(what, shape, dtype, device)

    monkeypatch.setattr(caches_module, "allocate_capture", allocate)
    data, err = _json_run(capsys, "--rollback", "checkpoint", "--check-parity")
    rollback = data["rollback"]
    assert data["parity"] is True and rollback["status"] == "requested"
    assert rollback["fast"] == 0 and rollback["replay"] == data["steps"]
    assert "could not be allocated on cpu" in rollback["fast_unavailable_reason"]
    assert "fast rollback unavailable: shard 0: checkpoint storage of" in err


def test_warmup_runs_untimed_on_the_targets_the_timed_run_reuses(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, _ = _json_run(capsys, "--draft", "dflash")
    calls = _count_greedy(monkeypatch)
    warmed, _ = _json_run(capsys, "--draft", "dflash", "--warmup-tokens", "5")
    assert warmed["tokens"] == plain["tokens"] and warmed["parity"] is True
    # the engine is kept too: the gate ran in the warm-up, every timed step is a fast one
    assert plain["rollback"]["status_at_start"] == "requested" and plain["rollback"]["replay"] == 1
    assert warmed["rollback"]["status_at_start"] == "effective"
    assert warmed["rollback"]["replay"] == 0 and warmed["rollback"]["fast"] == warmed["steps"]
    assert warmed["capture"]["verdict"] == "validated"
    # the two warm-up generations' greedy, then the timed ones' (three on CPU)
    assert [c["n"] for c in calls] == [5, 5, 8, 8, 8]
    kept = [c["target"] for c in calls]
    assert kept[0] is not None and all(k is kept[0] for k in kept)  # one greedy target
    calls.clear()
    _json_run(capsys, "--warmup-tokens", "0", "--repeats", "1")
    assert [c["n"] for c in calls] == [8] and calls[0]["target"] is None  # CPU default: none
    code = main(["generate", *FAST, "--warmup-tokens", "-2"])
    assert code == 2 and "--warmup-tokens must be >= 0 (got -2)" in capsys.readouterr().err


def test_the_default_drafter_is_lookup_assisted_and_counts_its_copies(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--draft`` defaults to ``dflash+lookup``: the JSON and the summary report the copied
    drafts; a drafter that never copies reports null and no row."""
    import re

    repeating = ["--prompt-ids", "3,14,15,3,14,15,3,14,15"]
    code = main(["generate", *FAST, *repeating])
    _, err = capsys.readouterr()
    assert code == 0, err
    rows = dict(re.findall(r"(?m)^  (\S.*?)\s{2,}(\S.*)$", err))
    assert rows["drafter"] == "dflash+lookup"
    assert re.fullmatch(rf"\d+ of {rows['steps']} steps \(prompt lookup\)", rows["copied drafts"])
    result, _ = _json_run(capsys, *repeating)
    assert result["drafter"] == "dflash+lookup"
    assert isinstance(result["copied_drafts"], int)
    assert 0 <= result["copied_drafts"] <= result["steps"]
    result, err = _json_run(capsys, "--draft", "prompt-lookup")
    assert result["copied_drafts"] is None and "copied drafts" not in err


def test_verify_window_and_draft_dtype_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """``--verify-window full`` verifies every draft whole on CPU (``auto`` cuts windows
    there); ``--draft-dtype`` changes the drafter's products only: the tokens are the same."""
    args = ["--model", "default", "--max-new-tokens", "40", "--block-size", "16",
            "--check-parity"]
    code = main(["generate", "--json", "--no-progress", "--devices", "cpu", *args])
    auto = json.loads(capsys.readouterr()[0])
    assert code == 0 and auto["parity"] is True
    assert auto["drafted_tokens"] < auto["steps"] * 15  # some windows were cut
    for extra in (["--verify-window", "full"], ["--draft-dtype", "bfloat16"]):
        code = main(["generate", "--json", "--no-progress", "--devices", "cpu", *args, *extra])
        result = json.loads(capsys.readouterr()[0])
        assert code == 0 and result["parity"] is True and result["sha256"] == auto["sha256"]
        if extra[0] == "--verify-window":
            assert result["drafted_tokens"] == result["steps"] * 15  # every draft whole
    with pytest.raises(SystemExit) as exc:  # argparse's usage error
        main(["generate", *FAST, "--verify-window", "half"])
    assert exc.value.code == 2 and "invalid choice: 'half'" in capsys.readouterr()[1]
