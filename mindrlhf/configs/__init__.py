"""Configuration: GRPO settings as dataclasses, loaded from YAML and the command line."""
from mindrlhf.configs.grpo_configs import (
    AlgorithmConfig,
    DataConfig,
    GenerationConfig,
    GRPOConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainConfig,
    config_reference_markdown,
    parse_args,
)

__all__ = [
    "AlgorithmConfig",
    "DataConfig",
    "GenerationConfig",
    "GRPOConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "TrainConfig",
    "config_reference_markdown",
    "parse_args",
]
