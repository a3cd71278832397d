"""Configuration: every stage's settings as dataclasses, loaded from YAML and the command line.

``REFERENCES`` names each stage's config class, its generated reference file and title;
``config_reference_markdown(stage)`` renders one and ``write_config_references()`` regenerates them all.
"""
from pathlib import Path
from typing import Dict, Tuple

from mindrlhf.configs.grpo_configs import (
    AlgorithmConfig,
    DataConfig,
    GenerationConfig,
    GRPOConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainConfig,
    parse_args,
)
from mindrlhf.configs.offline import DPOConfig, RMConfig, SFTConfig
from mindrlhf.configs.ppo import PPOConfig

#: stage -> (config class, reference file under the repository (the class's REFERENCE_FILE), title)
REFERENCES: Dict[str, Tuple[type, str, str]] = {
    stage: (cls, cls.REFERENCE_FILE, title) for stage, cls, title in (
        ("grpo", GRPOConfig, "GRPO configuration reference"),
        ("sft", SFTConfig, "SFT configuration reference (mindrlhf-sft)"),
        ("rm", RMConfig, "Reward-model configuration reference (mindrlhf-rm)"),
        ("dpo", DPOConfig, "DPO configuration reference (mindrlhf-dpo)"),
        ("ppo", PPOConfig, "PPO configuration reference (mindrlhf-ppo)"))}


def config_reference_markdown(stage: str = "grpo") -> str:
    """The text of a stage's generated config reference (one table per group)."""
    cls, _, title = REFERENCES[stage]
    return cls.reference_markdown(title)


def write_config_references(repo: "str | Path" = ".") -> None:
    """Regenerate every stage's reference file under ``repo``."""
    for stage, (_, path, _) in REFERENCES.items():
        (Path(repo) / path).write_text(config_reference_markdown(stage), encoding="utf-8")

__all__ = [
    "REFERENCES",
    "AlgorithmConfig",
    "DPOConfig",
    "PPOConfig",
    "RMConfig",
    "SFTConfig",
    "write_config_references",
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
