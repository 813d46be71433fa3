"""CUDA graphs of the target's decode, verify and replay forwards, one per shard.

A shard's forward is host bookkeeping (``TargetModel.begin_layers`` / ``end_layers``:
checks, cache lengths) around device work (``compute_layers``, plus the embedding on the
first shard and the LM head on the last) that reads every runtime value — positions, the
KV length — from device tensors and never synchronises with the host. That device work
is what is captured: a graph per shard and per *key* ``(mode, T)``. The live recurrent
slot of a remap is not part of the key: the kernels read it on the device
(``RecurrentPool.live``), so one graph serves every slot. A tree verify is the mode
``"verify-tree"``: its node depths, path table and parents are device tables
(``ShardCaches.tree``) the host refills before each replay, so one graph serves every tree
of ``T`` nodes. Inputs are copied into a static
buffer before each replay; outputs are the graph's own tensors, valid until its next
replay.

Policy: the first forward of each ``(mode, T)`` runs eagerly (it compiles the Triton
kernels and warms the allocator); the next forward of a key captures the graph and
replays it; later ones replay. A capture that fails (an operation that is not
capture-safe) leaves that key eager for the target's lifetime and is recorded in
:attr:`ShardGraphs.failures`. Graphs hold the addresses of the caches they were captured
on: :meth:`ShardGraphs.reset` forgets them when capture storage is rebuilt. Every graph
has its own memory pool, so no graph's intermediates can overwrite another's outputs.

The rollback of a fast step is captured too (:meth:`ShardGraphs.run_rollback`, key
``("rollback:<mode>", 1, False)``): its input is the accepted count, still on the device
(the restore or remap reads it there), so the step enqueues the rollback before its one
host synchronisation. A tree step's rollback is keyed ``("rollback:tree:<mode>", 2 + T,
False)``: its input is the accepted node, its path's length and the padded path, found on
the device (``dflash.model.tree_device``), so one graph serves every tree of ``T`` nodes.

The DFlash drafter's step runs on the first shard's graphs as well
(:meth:`ShardGraphs.run_static`, key ``("draft", B, False)``): device work over the
drafter's own static buffers, which it fills before each call; :meth:`ShardGraphs.bind`
drops those graphs when another drafter, or new buffers, take over.

The step's acceptance (the sampling rule's draw at every row, the accepted count or a
tree's accepted path) and a plain decode's draw run on the last shard's graphs
(:meth:`ShardGraphs.run_reading`, key ``("logits:<kind>", T, False)``): device work on the
forward's logits, which the graph reads where they lie — so it is replayed only while the
logits are the memory it was captured on (a verify graph's output is, replay after
replay), and the rule it applies is bound (``bind("logits", rule)``): another rule drops
it.

The prefill, the capture gate's checks, the self-test and fault injection never run
inside a graph: they run on the host between a step's graphs. The gate's verify itself
replays the verify graph when one exists (a target kept across generations), so its
evidence comes from the path every later fast step runs; its between-shard checks run
after each shard's replay (their reads wait for it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from dflash.model import TargetModel

#: hidden states (or the last shard's), logits (last shard, when asked) and tap outputs
ShardOutput = tuple[Tensor, Tensor | None, dict[int, Tensor]]
#: ``compute(x, on_layer)``: the device work of one shard's forward
ShardCompute = Callable[[Tensor, Callable[[int], None] | None], ShardOutput]
GraphKey = tuple[str, int, bool]  # mode, T, logits wanted
#: ``capture(work) -> (replay, outputs)``: record ``work()`` once; ``replay()`` runs it
Capture = Callable[[Callable[[], Any]], tuple[Callable[[], None], Any]]
#: a rollback's device work on the accepted count ``commit_n: [1]`` int64
RollbackWork = Callable[[Tensor], None]
W = TypeVar("W")


def cuda_capture(work: Callable[[], W]) -> tuple[Callable[[], None], W]:
    """Capture ``work`` in a CUDA graph with its own memory pool (nothing runs yet)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = work()
    return graph.replay, outputs


@dataclass
class _Captured:
    replay: Callable[[], None]
    static_in: Tensor
    outputs: Any  # what the captured work returned (a ShardOutput; None for a rollback)


class ShardGraphs:
    """The CUDA graphs of one shard (see the module docstring).

    ``capture`` records a shard's device work; the default is :func:`cuda_capture` (tests
    substitute a stand-in to exercise the bookkeeping on CPU).
    """

    def __init__(self, device: torch.device, capture: Capture = cuda_capture) -> None:
        self.device = device
        self._capture_work = capture
        self._graphs: dict[GraphKey, _Captured] = {}
        self._warm: set[tuple[str, int]] = set()
        self._eager_only: set[GraphKey] = set()
        self.failures: list[str] = []
        self.captures = 0
        self.replays = 0
        self._bound: dict[str, object] = {}
        self._reads: dict[GraphKey, tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]] = {}
        self._no_input = torch.empty(0, device=device)

    @property
    def captured_keys(self) -> tuple[GraphKey, ...]:
        """The keys of the graphs held now, in capture order."""
        return tuple(self._graphs)

    def run(
        self,
        key: GraphKey,
        x: Tensor,
        compute: ShardCompute,
        on_layer: Callable[[int], None] | None,
    ) -> ShardOutput:
        """The shard's forward on input ``x``: replayed, captured then replayed, or eager."""
        out: ShardOutput = self._run(
            key, x, lambda: compute(x, on_layer), lambda static: compute(static, None)
        )
        return out

    def run_rollback(self, mode: str, commit_n: Tensor, work: RollbackWork) -> None:
        """A fast rollback's device work ``work(commit_n)`` (``commit_n``: what was
        accepted, int64 on this shard's device — a chain's count ``[1]``, a tree's node,
        count and padded path ``[2 + T]`` with ``mode`` ``"tree:<mode>"``): replayed,
        captured, or eager; one graph per mode and input length."""
        key = (f"rollback:{mode}", commit_n.shape[0], False)
        self._run(key, commit_n, lambda: work(commit_n), work)

    def run_static(self, key: GraphKey, work: Callable[[], W]) -> W:
        """Device work ``work()`` that reads only static buffers its owner fills before
        each call (no input is copied): replayed, captured then replayed, or eager."""
        return self._run(key, self._no_input, work, lambda _: work())

    def run_reading(
        self, key: GraphKey, x: Tensor, reads: Tensor, work: Callable[[Tensor], W]
    ) -> W:
        """Device work ``work(x)`` that also reads ``reads`` where it lies — a tensor
        another graph owns, such as the verify graph's logits: replayed, captured, or eager
        as :meth:`run`, but a graph is replayed only while ``reads`` is the memory it was
        captured on (address, shape, strides, dtype). Otherwise that key's graph and its
        warm-up are forgotten and the work runs eagerly."""
        seen = (reads.data_ptr(), tuple(reads.shape), reads.stride(), reads.dtype)
        if self._reads.get(key) != seen:
            self._forget(lambda k: k == key)
            self._reads[key] = seen
        return self._run(key, x, lambda: work(x), work)

    def bind(self, kind: str, owner: object) -> None:
        """The graphs of key kind ``kind`` (and of the kinds ``kind:…``) belong to
        ``owner`` (compared by equality); a different owner drops them (they hold the
        previous owner's buffers, or run its rule)."""
        if kind in self._bound and self._bound[kind] != owner:
            self._forget(lambda k: k[0] == kind or k[0].startswith(kind + ":"))
        self._bound[kind] = owner

    def _forget(self, which: Callable[[GraphKey], bool]) -> None:
        """Drop the graphs, warm-ups and eager-only marks of the keys ``which`` selects."""
        for key in [k for k in self._graphs if which(k)]:
            del self._graphs[key]
        self._eager_only = {k for k in self._eager_only if not which(k)}
        self._warm = {w for w in self._warm if not which((w[0], w[1], False))
                      and not which((w[0], w[1], True))}

    def _run(
        self, key: GraphKey, x: Tensor, eager: Callable[[], W], work: Callable[[Tensor], W]
    ) -> W:
        captured = self._graphs.get(key)
        if captured is None:
            warm = (key[0], key[1])
            if warm not in self._warm or key in self._eager_only:
                self._warm.add(warm)
                return eager()
            made = self._capture(key, x, work)
            if made is None:
                return eager()
            captured = made
        captured.static_in.copy_(x)
        captured.replay()
        self.replays += 1
        out: W = captured.outputs
        return out

    def _capture(
        self, key: GraphKey, x: Tensor, work: Callable[[Tensor], object]
    ) -> _Captured | None:
        static_in = x.clone()
        try:
            replay, outputs = self._capture_work(lambda: work(static_in))
        except Exception as exc:  # not capture-safe: this key stays eager
            self._eager_only.add(key)
            self.failures.append(f"{key}: {type(exc).__name__}: {exc}")
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return None
        captured = _Captured(replay, static_in, outputs)
        self._graphs[key] = captured
        self.captures += 1
        return captured

    def reset(self) -> None:
        """Forget every graph (the storage they were captured on was replaced)."""
        self._graphs.clear()
        self._eager_only.clear()
        self._reads.clear()


def graphs_supported(model: TargetModel, devices: list[torch.device]) -> str | None:
    """None when the model's forwards can be captured on ``devices``, else the reason."""
    if not all(d.type == "cuda" for d in devices):
        return "CUDA graphs need every shard on a CUDA device"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if model.kernel_backend == "reference":
        return "the torch reference kernels read host values (kernel_backend 'reference')"
    if model.config.sparse_layer_ids:
        return "mixture-of-experts layers route tokens on the host"
    return None
