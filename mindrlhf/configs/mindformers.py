"""MindFormers model YAMLs (the MindRLHF tutorial's ``--sft_path_train`` / ``--sft_path_infer``).

A MindFormers model config describes one model for MindFormers' own trainer: its ``parallel_config``
(the layout), ``model.model_config`` (the architecture) and many sections for runners, optimizers,
datasets and the MindSpore context. Here only two things are taken from it:

- the layout: ``data_parallel`` / ``model_parallel`` / ``pipeline_stage`` / ``micro_batch_num``
  become ``train_dp`` / ``train_tp`` / ``train_pp`` / ``train_micro_batches`` (train YAML) or
  ``infer_dp`` / ``infer_tp`` (infer YAML, whose ``pipeline_stage`` must be 1);
- the architecture keys of ``model.model_config``, which are checked against the checkpoint's own
  ``config.json`` (the weights define the model; the YAML must agree with them).

Every other key is reported by ``MindFormersYaml.ignored`` so the job can list it once in its log.
No MindSpore import: the config layer reads this before anything is initialised.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import yaml

from mindrlhf.errors import MindRLHFError

#: parallel_config key -> (our train field, our infer field); None = not a field on that side.
LAYOUT_KEYS: Dict[str, Tuple[Optional[str], Optional[str]]] = {
    "data_parallel": ("train_dp", "infer_dp"),
    "model_parallel": ("train_tp", "infer_tp"),
    "pipeline_stage": ("train_pp", None),
    "micro_batch_num": ("train_micro_batches", None),
}
#: model.model_config key -> the HF config.json / DecoderConfig attribute it must equal.
ARCHITECTURE_KEYS: Dict[str, str] = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "kv_channels": "head_dim",
    "rms_norm_eps": "rms_norm_eps",
    "theta": "rope_theta",
    "rotary_emb_base": "rope_theta",
    "max_position_embedding": "max_position_embeddings",
    "qkv_has_bias": "attention_bias",
    "tie_word_embeddings": "tie_word_embeddings",
}
YAML_SUFFIXES = (".yaml", ".yml")


def is_model_yaml(path: str) -> bool:
    """True when a model path names a YAML file (a MindFormers model config), not weights."""
    return str(path).lower().endswith(YAML_SUFFIXES)


@dataclass
class MindFormersYaml:
    """What mindrlhf takes from one MindFormers model YAML."""

    path: str
    parallel: Dict[str, Any] = field(default_factory=dict)
    model_config: Dict[str, Any] = field(default_factory=dict)
    ignored: List[str] = field(default_factory=list)

    def layout(self, side: str) -> Dict[str, Tuple[int, str]]:
        """``{our_field: (value, 'parallel_config.key')}`` of the ``train`` or ``infer`` side.

        ``micro_batch_num`` counts pipeline micro-batches, so it is used only with ``pipeline_stage`` > 1
        (MindFormers ignores it otherwise, and so do we: it is then in ``ignored``). An infer YAML with
        ``pipeline_stage`` != 1 is refused: generation runs dp x tp only.
        """
        column = 0 if side == "train" else 1
        stages = self.parallel.get("pipeline_stage", 1)
        if side == "infer" and stages != 1:
            raise MindRLHFError(f"{self.path}: parallel_config.pipeline_stage = {stages}, but generation runs "
                                "without pipeline stages; set pipeline_stage: 1 in the infer (predict) YAML")
        out: Dict[str, Tuple[int, str]] = {}
        for key, value in self.parallel.items():
            target = LAYOUT_KEYS.get(key, (None, None))[column]
            if target is None or (key == "micro_batch_num" and stages == 1):
                continue
            out[target] = (value, f"parallel_config.{key}")
        return out

    def unused_layout_keys(self, side: str) -> List[str]:
        """parallel_config keys that set nothing on this side (listed with ``ignored``)."""
        used = {where.split(".", 1)[1] for _, where in self.layout(side).values()}
        return [f"parallel_config.{k}" for k in self.parallel if k not in used and not
                (side == "infer" and k == "pipeline_stage")]

    def check_architecture(self, config: Any, checkpoint: str) -> None:
        """Every architecture key of ``model.model_config`` equals ``config``'s (a DecoderConfig read from
        the checkpoint ``checkpoint``); a mismatch raises, naming the key and both values."""
        for key, attr in ARCHITECTURE_KEYS.items():
            if key not in self.model_config or self.model_config[key] is None:  # null n_kv_heads: MHA, unset
                continue
            want, have = self.model_config[key], getattr(config, attr)
            same = (math.isclose(float(want), float(have), rel_tol=1e-9)
                    if isinstance(want, (int, float)) and not isinstance(want, bool) and not isinstance(have, bool)
                    else want == have)
            if not same:
                raise MindRLHFError(f"{self.path}: model.model_config.{key} = {want!r} but the checkpoint "
                                    f"{checkpoint} has {attr} = {have!r}; fix the YAML or load the matching "
                                    "checkpoint")


def read_model_yaml(path: "str | os.PathLike[str]") -> MindFormersYaml:
    """Parse a MindFormers model YAML (``yaml.safe_load``) and sort its keys into used and ignored."""
    source = str(path)
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MindRLHFError(f"model YAML not found: {source}") from None
    except OSError as err:
        raise MindRLHFError(f"cannot read model YAML {source}: {err.strerror}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise MindRLHFError(f"{source}:{where}: {getattr(err, 'problem', None) or 'invalid YAML'}; "
                            "fix the YAML syntax") from None
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or not isinstance(model.get("model_config"), dict):
        raise MindRLHFError(f"{source}: not a MindFormers model config (no model.model_config section); "
                            "give a MindFormers YAML such as model_configs/qwen_grpo/finetune_qwen2_5_7b.yaml, or "
                            "the weights themselves")
    parallel = data.get("parallel_config") or {}
    if not isinstance(parallel, dict):
        raise MindRLHFError(f"{source}: parallel_config must be a mapping (got {parallel!r})")
    for key in LAYOUT_KEYS:
        value = parallel.get(key)
        if key in parallel and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise MindRLHFError(f"{source}: parallel_config.{key} = {value!r} is not a positive integer")
    result = MindFormersYaml(source, dict(parallel), dict(model["model_config"]))
    ignored = [k for k in data if k not in ("model", "parallel_config")]
    ignored += [f"model.{k}" for k in model if k != "model_config"]
    ignored += [f"model.model_config.{k}" for k in result.model_config if k not in ARCHITECTURE_KEYS]
    result.ignored = ignored
    return result
