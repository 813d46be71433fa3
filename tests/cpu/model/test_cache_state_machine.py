"""Stateful property test: any sequence of decode / verify + rollback (checkpoint, remap,
recompute, snapshot + replay, abort, a fast rollback undone) keeps the caches equal to plain
one-token-at-a-time decoding.

The in-memory model is a second set of caches that only ever sees ``decode`` of the
committed tokens. After every step the logits of the committed positions and the live
recurrent state of every layer must agree bit for bit (the decode, verify and replay
forwards run on M-invariant kernels).
"""

from __future__ import annotations

from typing import ClassVar, TypedDict

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from dflash.geometry import require_chain
from dflash.model import RecurrentPool, TargetModel
from dflash.model.caches import CaptureKind

MODEL = TargetModel.tiny_default(seed=5)
VOCAB = MODEL.config.vocab_size
MAX_DRAFT = 5
MAX_LEN = 96


class Tolerance(TypedDict):
    """assert_close's tolerance keywords."""

    rtol: float
    atol: float


TOL: Tolerance = {"rtol": 0.0, "atol": 0.0}  # bitwise
torch.set_num_threads(1)  # tiny matrices: one thread is faster and immune to machine load


def _ids(tokens: list[int]) -> torch.Tensor:
    return torch.tensor([tokens])


def roll_back(pool: RecurrentPool, mode: str, commit_n: int) -> None:
    """A fast rollback as the engine runs it: the host checks, the device work on the
    count, the host mirrors once the count is known."""
    pool.mark_device_rollback(mode)
    pool.rollback_on_device(mode, torch.tensor([commit_n], device=pool.position.device))
    pool.finish_rollback(mode, commit_n)


class CachesMatchSequentialDecode(RuleBasedStateMachine):
    #: what the verify captures, and the fast rollback modes it serves
    CAPTURE: CaptureKind = "states"
    FAST: ClassVar[dict[str, str]] = {"checkpoint": "checkpoint", "remap": "remap"}

    @initialize(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6))
    def prefill(self, prompt: list[int]) -> None:
        self.caches = MODEL.new_caches(max_len=MAX_LEN, max_draft=MAX_DRAFT, capture=self.CAPTURE)
        self.oracle = MODEL.new_caches(max_len=MAX_LEN, max_draft=1)
        with torch.inference_mode():
            MODEL(_ids(prompt), self.caches, "prefill")
            MODEL(_ids(prompt), self.oracle, "prefill")

    def _oracle_decode(self, tokens: list[int]) -> list[torch.Tensor]:
        out = []
        for tok in tokens:
            logits, _ = MODEL(_ids([tok]), self.oracle, "decode")
            out.append(logits[0, -1])
        return out

    @rule(token=st.integers(0, VOCAB - 1))
    def decode(self, token: int) -> None:
        if self.caches.length + 1 > MAX_LEN:
            return
        with torch.inference_mode():
            logits, _ = MODEL(_ids([token]), self.caches, "decode")
            (want,) = self._oracle_decode([token])
        torch.testing.assert_close(logits[0, -1], want, **TOL)

    @rule(
        draft=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=MAX_DRAFT),
        accept=st.floats(0.0, 1.0),
        path=st.sampled_from(
            ["checkpoint", "remap", "replay", "abort", "undo-checkpoint", "undo-remap"]
        ),
    )
    def verify_and_roll_back(self, draft: list[int], accept: float, path: str) -> None:
        start = self.caches.length
        if start + len(draft) > MAX_LEN:
            return
        commit_n = 1 + int(accept * (len(draft) - 1))
        pool = self.caches.pool
        with torch.inference_mode():
            geometry = require_chain(list(range(-1, len(draft) - 1)))
            logits, _ = MODEL(_ids(draft), self.caches, "verify", geometry=geometry)
            if path in ("checkpoint", "remap"):
                roll_back(pool, self.FAST[path], commit_n)
            else:
                if path.startswith("undo-"):  # a fast rollback, then the way back
                    roll_back(pool, self.FAST[path[len("undo-") :]], commit_n)
                pool.restore_pre_verify()
                self.caches.kv.truncate(start)
                if path == "replay":
                    MODEL(_ids(draft[:commit_n]), self.caches, "replay")
            if path in ("abort", "undo-checkpoint", "undo-remap"):
                commit_n = 0
            self.caches.kv.truncate(start + commit_n)
            want = self._oracle_decode(draft[:commit_n])
        for i, w in enumerate(want):
            torch.testing.assert_close(logits[0, i], w, **TOL)

    @invariant()
    def same_position_and_live_state(self) -> None:
        if not hasattr(self, "caches"):
            return
        assert self.caches.length == self.oracle.length
        assert self.caches.pool.length == self.oracle.pool.length
        # the device copy of the position (what the kernels read) mirrors the host's
        assert self.caches.pool.position.tolist() == [self.caches.pool.length]
        for layer in self.caches.pool.layer_ids:
            state, conv = self.caches.pool.live_views(layer)
            want_state, want_conv = self.oracle.pool.live_views(layer)
            torch.testing.assert_close(state, want_state, **TOL)
            torch.testing.assert_close(conv, want_conv, **TOL)


CachesMatchSequentialDecode.TestCase.settings = settings(
    max_examples=15, stateful_step_count=8, deadline=None
)
TestCachesMatchSequentialDecode = CachesMatchSequentialDecode.TestCase


class InputCapturingCachesMatchSequentialDecode(CachesMatchSequentialDecode):
    """The same, with caches that capture the recurrence's inputs: every fast rollback is a
    ``recompute``."""

    CAPTURE: CaptureKind = "inputs"
    FAST: ClassVar[dict[str, str]] = {"checkpoint": "recompute", "remap": "recompute"}


InputCapturingCachesMatchSequentialDecode.TestCase.settings = settings(
    max_examples=15, stateful_step_count=8, deadline=None
)
TestInputCapturingCachesMatchSequentialDecode = InputCapturingCachesMatchSequentialDecode.TestCase
