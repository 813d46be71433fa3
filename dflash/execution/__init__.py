"""Execution layer: shards, capture gate, rollback policy, the fail-closed step, results.

See ``dflash.execution.engine`` for the step semantics and ``specs/rollback.md`` for the
state machine.
"""

from dflash.execution.capture_gate import CaptureGate, ShardStorage
from dflash.execution.engine import SpecDecoder, StepRecord, chain_of
from dflash.execution.errors import (
    ContextLengthError,
    ExecutionError,
    IllegalTransitionError,
    InjectedFault,
    LayerSplitError,
    PoisonedError,
    RollbackConfigError,
    ShardPositionError,
)
from dflash.execution.faults import FaultInjector, FaultPhase
from dflash.execution.oracle import reference_greedy
from dflash.execution.policy import (
    ENV_VAR,
    ROLLBACK_MODES,
    RollbackMode,
    RollbackPolicy,
    RollbackStatus,
)
from dflash.execution.results import (
    CaptureReport,
    GenerationResult,
    RollbackReport,
    SelfTestReport,
    ShardCaptureEvidence,
    Timings,
    token_sha256,
)
from dflash.execution.rollback import Lifecycle, Phase
from dflash.execution.run import generate
from dflash.execution.shards import ShardedTarget, ShardPlan, plan_shards
from dflash.model.caches import CaptureStorageError

__all__ = [
    "ENV_VAR",
    "ROLLBACK_MODES",
    "CaptureGate",
    "CaptureReport",
    "CaptureStorageError",
    "ContextLengthError",
    "ExecutionError",
    "FaultInjector",
    "FaultPhase",
    "GenerationResult",
    "IllegalTransitionError",
    "InjectedFault",
    "LayerSplitError",
    "Lifecycle",
    "Phase",
    "PoisonedError",
    "RollbackConfigError",
    "RollbackMode",
    "RollbackPolicy",
    "RollbackReport",
    "RollbackStatus",
    "SelfTestReport",
    "ShardCaptureEvidence",
    "ShardPlan",
    "ShardPositionError",
    "ShardStorage",
    "ShardedTarget",
    "SpecDecoder",
    "StepRecord",
    "Timings",
    "chain_of",
    "generate",
    "plan_shards",
    "reference_greedy",
    "token_sha256",
]
