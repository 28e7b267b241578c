"""Typed run configuration loaded from YAML with command-line overrides."""
from hacpo_megatron.config.loader import ConfigError, config_to_dict, dump_config, load_config
from hacpo_megatron.config.schema import (
    AgentConfig,
    AlgorithmConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    MoEConfig,
    ParallelConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    TrainConfig,
)

__all__ = [
    "AgentConfig", "AlgorithmConfig", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "LoggingConfig",
    "MoEConfig", "ParallelConfig", "RewardConfig", "RolloutConfig", "RunConfig", "TrainConfig", "config_to_dict",
    "dump_config", "load_config",
]
