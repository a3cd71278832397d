"""Configuration: every stage's settings as dataclasses, loaded from YAML and the command line.

``REFERENCES`` names each stage's config class, its generated reference file and title (read from the
stage table, ``mindrlhf.registry.STAGES``); ``config_reference_markdown(stage)`` renders one and
``write_config_references()`` regenerates them all, and the table of MindRLHF's grpo_config.yaml keys
(``mindrlhf_yaml.REFERENCE_FILE``).
"""
from pathlib import Path
from typing import Dict, Tuple

from mindrlhf.configs.common import RewardConfig
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
from mindrlhf.configs.mindrlhf_yaml import REFERENCE_FILE as MINDRLHF_REFERENCE
from mindrlhf.configs.mindrlhf_yaml import reference_markdown as mindrlhf_reference_markdown
from mindrlhf.configs.offline import DPOConfig, RMConfig, SFTConfig
from mindrlhf.configs.ppo import PPOConfig
from mindrlhf.registry import STAGES

#: stage -> (config class, reference file under the repository (the class's REFERENCE_FILE), title), in the
#: order of the stage table.
REFERENCES: Dict[str, Tuple[type, str, str]] = {
    name: (stage.config_class(), stage.reference, stage.title) for name, stage in STAGES.items()}


def config_reference_markdown(stage: str = "grpo") -> str:
    """The text of a stage's generated config reference (one table per group)."""
    cls, _, title = REFERENCES[stage]
    return cls.reference_markdown(title)


def write_config_references(repo: "str | Path" = ".") -> None:
    """Regenerate every stage's reference file under ``repo``, and the table of MindRLHF's keys."""
    for stage, (_, path, _) in REFERENCES.items():
        (Path(repo) / path).write_text(config_reference_markdown(stage), encoding="utf-8")
    (Path(repo) / MINDRLHF_REFERENCE).write_text(mindrlhf_reference_markdown(), encoding="utf-8")

__all__ = [
    "REFERENCES",
    "AlgorithmConfig",
    "DPOConfig",
    "PPOConfig",
    "RMConfig",
    "RewardConfig",
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
