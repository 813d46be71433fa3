"""Hybrid target model: config, layers, caches, checkpoint loading (see ARCHITECTURE.md)."""

from dflash.model.caches import CacheError, KVCache, RecurrentPool, ShardCaches
from dflash.model.config import ConfigError, HybridConfig
from dflash.model.layers import AttentionLayer, DeltaNetLayer
from dflash.model.loading import CheckpointError, LoadReport
from dflash.model.target import Mode, TargetModel, greedy_generate

__all__ = [
    "AttentionLayer",
    "CacheError",
    "CheckpointError",
    "ConfigError",
    "DeltaNetLayer",
    "HybridConfig",
    "KVCache",
    "LoadReport",
    "Mode",
    "RecurrentPool",
    "ShardCaches",
    "TargetModel",
    "greedy_generate",
]
