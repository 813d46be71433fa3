"""``--tree-budget``: tree drafts (the SYNTHETIC tree drafter) through the main command and
the benchmark, parity with plain greedy decoding, the tree figures in the result, refusals."""

from __future__ import annotations

import json

import pytest

from dflash.cli import main

ARGS = [
    "--model", "tiny", "--draft", "synthetic", "--acceptance", "0.6", "--block-size", "6",
    "--max-new-tokens", "32", "--no-progress", "--devices", "cpu", "--no-baseline",
]


def _run(capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, object]:
    code = main(["generate", "--json", *ARGS, *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    result: dict[str, object] = json.loads(out)
    return result


@pytest.mark.parametrize("mode", ["checkpoint", "remap", "replay", "recompute"])
def test_trees_are_plain_greedy_and_report_their_shape(
    capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    tree = _run(capsys, "--tree-budget", "10", "--rollback", mode, "--check-parity")
    chain = _run(capsys, "--rollback", mode)
    assert tree["parity"] is True and tree["tokens"] == chain["tokens"]
    assert tree["tree_budget"] == 10 and chain["tree_budget"] is None
    assert tree["drafter"] == "synthetic-tree"
    nodes = tree["nodes_per_step"]
    assert isinstance(nodes, float) and 6 < nodes <= 10  # wider than the chain's block
    commit, chain_commit = tree["avg_commit"], chain["avg_commit"]
    assert isinstance(commit, float) and isinstance(chain_commit, float)
    assert commit > chain_commit  # more tokens per step for the same drafter quality
    storage = tree["capture_bytes"]
    assert isinstance(storage, dict)
    # recompute's trees keep their reloaded node states in a one-layer scratch, reported
    assert ("tree_states" in storage) == (mode == "recompute")
    assert ("checkpoints" in storage) == (mode != "recompute")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tree-budget", "1"], "--tree-budget must be in [2, "),
        (["--tree-budget", "8", "--draft", "prompt-lookup"], "needs a drafter that gives per-slot"),
    ],
)
def test_tree_budget_refusals(
    capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    args = ARGS
    if "--draft" in extra:  # another drafter: --acceptance is the synthetic drafter's only
        i = ARGS.index("--draft")
        args = [*ARGS[:i], *ARGS[i + 4 :]]  # without "--draft synthetic --acceptance 0.6"
    assert main(["generate", *args, *extra]) == 2
    assert message in capsys.readouterr().err
