"""Drafting on the device: the DFlash drafter's static context cache and its steps.

``start_device`` / ``set_device_inputs`` / ``device_step``: the same maths as drafting on
the host, over a static-capacity context cache, for a step whose accepted count is still
on the device. Guesses are the argmax of each slot's logits, or, when the target samples,
the same rule drawn with the target's noise (coupled drafting, :meth:`DeviceDrafting.couple`).
The cache holds ``capacity`` positions per layer — or, when the drafter's blocks see only
the last ``reach`` committed positions (:attr:`DFlashDrafter.context_reach`), a ring of
``reach + B`` rows, so a step costs the same at any context length; a step projects a
fixed ``B`` rows (the verify's tap rows, of which the first ``commit_n`` are committed),
writes their keys/values at the drafter's device position (its ring row), advances it by
``commit_n`` and runs the block over every cached row with the uncommitted ones (and those
past the reach) masked out. No host value
and no shape depends on the step, so a CUDA graph can hold it. Rows past ``commit_n``
land at positions the next step overwrites before they become visible.

For trees (:meth:`DeviceDrafting.use_candidates`), each proposal also carries its ``k``
best tokens per guess slot with their log-probabilities (:func:`slot_candidates`, the host
proposal's :meth:`~dflash.model.drafters.dflash_host.HostDrafting.candidates` computed
alike), so a tree grows from the step's one read-back without a host proposal.

:class:`DeviceDrafting` holds those buffers for one :class:`DFlashDrafter` (its
``on_device``) and runs the drafter's weights and forward pieces; the drafter's public
device methods delegate to it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash.model.drafters.base import check_block_size, check_token
from dflash.model.drafters.dflash_products import (
    DrafterWeights,
    DraftingPart,
    candidate_lists,
    drafting,
    slot_candidates,
)
from dflash.model.drafters.errors import DraftArgumentError
from dflash.sampling import GREEDY, SamplingParams, sample_tokens


class _DeviceCache:
    """Static buffers of drafting on the device (see the module docstring): a ring of
    ``rows`` context rows — ``capacity`` when the block may see every committed position,
    else the drafter's reach and a block (:attr:`DFlashDrafter.context_reach`) — position
    ``p`` in row ``p mod rows``, ``slot_pos`` the position each row holds (-1: none)."""

    def __init__(self, drafter: DrafterWeights, capacity: int, block_size: int) -> None:
        cfg, dev, dt = drafter.config, drafter.device, drafter.dtype
        self.capacity, self.block_size, self.dtype, self.device = capacity, block_size, dt, dev
        self.reach = drafter.context_reach
        self.rows_held = capacity if self.reach is None else min(capacity,
                                                                 self.reach + block_size)
        shape = (1, cfg.num_key_value_heads, self.rows_held, cfg.head_dim)
        # zeros: masked keys/values must be finite (0 · NaN would poison the attention)
        self.kv = [
            (torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev))
            for _ in range(cfg.num_hidden_layers)
        ]
        self.position = torch.zeros(1, dtype=torch.int64, device=dev)  # committed tokens
        self.rows = torch.zeros(block_size, cfg.feature_size, dtype=dt, device=dev)
        self.count = torch.ones(1, dtype=torch.int64, device=dev)
        self.tokens = torch.zeros(block_size, dtype=torch.int64, device=dev)
        self.masks = torch.full((1, block_size), cfg.mask_token_id, dtype=torch.long, device=dev)
        self.slot_pos = torch.full((self.rows_held,), -1, dtype=torch.int64, device=dev)
        self.block_index = torch.arange(block_size, device=dev)  # [B]
        self.block_visible = torch.ones(block_size, dtype=torch.bool, device=dev)

    def fits(self, drafter: DrafterWeights, capacity: int, block_size: int) -> bool:
        return (
            self.capacity >= capacity and self.block_size == block_size
            and self.dtype == drafter.dtype and self.device == drafter.device
            and self.reach == drafter.context_reach
        )


class DeviceDrafting(DraftingPart):
    """The device drafting state of a :class:`DFlashDrafter` (see the module docstring)."""

    def __init__(self, drafter: DrafterWeights) -> None:
        super().__init__(drafter)
        self._device: _DeviceCache | None = None
        #: bumped whenever the device buffers are allocated anew (graphs of the old ones
        #: must be dropped: they hold their addresses) or the sampling rule changes (the
        #: graphs hold its parameters)
        self.device_buffers_version = 0
        #: the rule the target draws its tokens by: the device guesses are drawn with the
        #: same noise at their absolute positions (coupled drafting); greedy by default
        self.sampling: SamplingParams = GREEDY
        #: candidates per guess slot each proposal carries (0: the guesses alone)
        self.candidates_k = 0

    def use_candidates(self, k: int) -> None:
        """Each proposal (:meth:`start_device`, :meth:`device_step`) returns, after its
        ``B-1`` guesses, the ``k`` best tokens of every guess slot (``(B-1)·k`` ids, best
        first) and their float64 log-probabilities as int64 bit patterns (``(B-1)·k``):
        :func:`split_candidates` reads them back. ``0``: the guesses alone. A change drops
        the captured drafting steps (they return the other layout)."""
        vocab = self.drafter.config.vocab_size
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= vocab:
            raise DraftArgumentError(f"'k' must be an int in [0, {vocab}] (got {k!r})")
        if k != self.candidates_k:
            self.candidates_k = k
            self.device_buffers_version += 1

    def couple(self, sampling: SamplingParams) -> None:
        """Draw the device guesses by ``sampling``'s rule (see :attr:`sampling`); a change
        drops the captured drafting steps."""
        if sampling != self.sampling:
            self.sampling = sampling
            self.device_buffers_version += 1

    @drafting
    @torch.no_grad()
    def start_device(
        self, features: Tensor, last: int, capacity: int, block_size: int, start: int = 0,
        skipped: int = 0,
    ) -> Tensor:
        """Begin drafting on the device after a prefill of ``skipped + n`` tokens at
        positions ``start …``, of which the last ``n = features.shape[0]`` come with their
        tap rows ``[n, F]``: fill the static cache (``capacity`` positions, at least
        ``start + skipped + n + block_size``) and return the first proposal after ``last``,
        ``[B-1]`` int64 on the LM head's device (eager). ``start`` 0 begins a new context;
        a later one continues the context already on the device, which must hold exactly
        ``start`` positions (:meth:`can_continue_device`). ``skipped`` rows come without
        features: allowed only when the ``n`` given cover the drafter's reach
        (:attr:`DFlashDrafter.context_reach`), so no block reads the skipped ones."""
        d = self.drafter
        check_block_size(block_size)
        check_token("last", last, d.config.vocab_size)
        n = int(features.shape[0]) if isinstance(features, Tensor) else 0
        features = d._check_features(features, n)
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise DraftArgumentError(f"'start' must be an int >= 0 (got {start!r})")
        reach = d.context_reach
        if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0 or (
            skipped and (reach is None or n < reach)
        ):
            raise DraftArgumentError(
                f"'skipped' must be 0, or an int >= 0 when the {n} rows given cover the "
                f"drafter's reach ({reach}) (got {skipped!r})"
            )
        need = start + skipped + n + block_size
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < need:
            raise DraftArgumentError(
                f"'capacity' must be an int >= {need} (the {need - block_size} context rows "
                f"and a "
                f"block of {block_size}; got {capacity!r})"
            )
        if start and not self.can_continue_device(start, capacity, block_size):
            raise DraftArgumentError(
                f"'start'={start}: the device context cannot continue there (it holds "
                f"{self._held()} positions in buffers of {self._capacity()})"
            )
        dev = self._device
        if dev is None or not dev.fits(d, capacity, block_size):
            dev = self._device = _DeviceCache(d, capacity, block_size)
            self.device_buffers_version += 1
        if not start:
            dev.position.zero_()
            dev.slot_pos.fill_(-1)
        # rows the ring cannot hold are seen by no block: only the last ones are written
        skip = max(0, n - dev.rows_held)
        dev.position.add_(skipped + skip)
        self._write_context(dev, features[skip:].to(d.device, d.dtype), None)
        last_t = torch.full((1,), last, dtype=torch.int64, device=d.device)
        return self._device_block(dev, last_t)

    def can_continue_device(self, committed: int, capacity: int, block_size: int) -> bool:
        """Whether the device context holds exactly ``committed`` positions in buffers that
        fit ``capacity`` and ``block_size`` (reads the position: one host sync, at a
        prefill)."""
        dev = self._device
        return (
            dev is not None and dev.fits(self.drafter, capacity, block_size)
            and self._held() == committed
        )

    def forget(self) -> None:
        """Drop the device buffers (a new context window needs a ring of another size)."""
        if self._device is not None:
            self._device = None
            self.device_buffers_version += 1

    def _held(self) -> int | None:
        return None if self._device is None else int(self._device.position[0])

    def _capacity(self) -> int | None:
        return None if self._device is None else self._device.capacity

    def set_device_inputs(self, rows: Tensor, commit_n: Tensor, tokens: Tensor) -> None:
        """The inputs of the next :meth:`device_step`, copied into its static buffers:
        ``rows [T, F]`` the tap rows of the last verify (``T <= B``), ``commit_n [1]`` how
        many of them were committed, ``tokens [T]`` the target's tokens after each (the
        new pending token is ``tokens[commit_n-1]``)."""
        dev = self._require_device()
        t = int(rows.shape[0])
        width = self.drafter.config.feature_size
        if rows.dim() != 2 or rows.shape[1] != width or not 1 <= t <= dev.block_size:
            raise DraftArgumentError(
                f"'rows' must be [T, {width}] with 1 <= T <= "
                f"{dev.block_size} (got {list(rows.shape)})"
            )
        if tuple(tokens.shape) != (t,) or tuple(commit_n.shape) != (1,):
            raise DraftArgumentError(
                f"'tokens' must be [{t}] and 'commit_n' [1] (got {list(tokens.shape)}, "
                f"{list(commit_n.shape)})"
            )
        dev.rows[:t].copy_(rows)
        dev.tokens[:t].copy_(tokens)
        dev.count.copy_(commit_n)

    @drafting
    @torch.no_grad()
    def device_step(self) -> Tensor:
        """One drafting step on the device (capture-safe: no host value, static shapes):
        the committed rows of :meth:`set_device_inputs` join the context and the block
        after the new pending token is drafted; returns ``[B-1]`` int64 guesses."""
        dev = self._require_device()
        self._write_context(dev, dev.rows, dev.count)
        last = dev.tokens.gather(0, dev.count - 1)  # [1]
        return self._device_block(dev, last)

    def _require_device(self) -> _DeviceCache:
        if self._device is None:
            raise DraftArgumentError("drafting on the device needs start_device() first")
        return self._device

    def _write_context(self, dev: _DeviceCache, rows: Tensor, count: Tensor | None) -> None:
        """Keys/values of ``rows [R, F]`` at positions ``position … position+R-1``;
        ``position += count`` (all ``R`` rows when ``count`` is None)."""
        d = self.drafter
        r = rows.shape[0]
        ctx = d.hidden_norm(d.fc(rows))[None]  # [1, R, H]
        positions = dev.position + (dev.block_index if r == dev.block_size
                                    else torch.arange(r, device=d.device))  # [R]
        # ring rows (the identity while the ring holds ``capacity`` rows): ``r`` never
        # exceeds the ring, so the rows are distinct
        slots = positions.remainder(dev.rows_held)
        for (k_buf, v_buf), (k, v) in zip(dev.kv, d.context_kv(ctx, positions[None]),
                                          strict=True):
            k_buf.index_copy_(2, slots, k)
            v_buf.index_copy_(2, slots, v)
        dev.slot_pos.index_copy_(0, slots, positions)
        if count is None:
            dev.position.add_(r)
        else:
            dev.position.add_(count)

    def _device_block(self, dev: _DeviceCache, last: Tensor) -> Tensor:
        """``[B-1]`` guesses after ``last [1]`` over the cached context (positions below
        ``position`` visible, the rest masked)."""
        d = self.drafter
        ids = torch.cat([last.view(1, 1), dev.masks[:, 1:]], dim=1)  # [1, B]
        x = d.embed(ids)
        q_pos = (dev.position + dev.block_index)[None]  # [1, B]
        held = dev.slot_pos
        ctx_visible = (held >= 0) & (held < dev.position)  # [C]: committed rows
        if dev.reach is not None:  # and only the last ``reach`` of them
            ctx_visible &= held >= dev.position - dev.reach
        visible = torch.cat([ctx_visible, dev.block_visible])[None, None]  # [1, 1, C+B]
        visible = visible.expand(1, dev.block_size, -1)
        hidden = d.run_block(x, q_pos, dev.kv, held[None], visible)[0]  # [B, H]
        logits = d.logits(hidden[1:])  # [B-1, V]
        # the drafter's own choice (a DFlash2 selector), on the device: slot 1 at q_pos[1]
        chosen = d.select(hidden[1:], logits, last, q_pos[0, 1:2], self.sampling)
        if chosen is not None:
            guesses = chosen
        elif self.sampling.greedy:
            guesses = logits.argmax(dim=-1)
        else:
            # coupled: guess slot i (1-based) draws position `position + i`, as the
            # target's chain row i - 1 does, with the target's rule and noise
            guesses = sample_tokens(logits, q_pos[0, 1:], self.sampling)
        if not self.candidates_k:
            return guesses
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))  # as the host's
        ids, log_probs = slot_candidates(wide, self.candidates_k)
        return torch.cat([guesses, ids.flatten(), log_probs.view(torch.int64).flatten()])


def split_candidates(read: list[int], slots: int, k: int
                     ) -> tuple[list[int], list[list[tuple[int, float]]]]:
    """A proposal read back from the device with ``k`` candidates per slot
    (:meth:`DeviceDrafting.use_candidates`) → ``(guesses, candidates)``: the ``slots``
    guesses and each slot's ``k`` ``(token, log_prob)`` pairs, best first."""
    want = slots * (1 + 2 * k)
    if len(read) != want:
        raise DraftArgumentError(
            f"a proposal of {slots} slots with {k} candidates each is {want} values "
            f"(got {len(read)})"
        )
    n = slots * k
    ids = read[slots : slots + n]
    bits = torch.tensor(read[slots + n :], dtype=torch.int64).view(torch.float64).tolist()
    return (read[:slots],
            candidate_lists([ids[i : i + k] for i in range(0, n, k)],
                            [bits[i : i + k] for i in range(0, n, k)]))
