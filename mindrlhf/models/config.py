"""Architecture hyperparameters of a decoder, read from a Hugging Face config.json (family facts: ``models.family``)."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from mindrlhf.errors import MindRLHFError
from mindrlhf.models.family import ModelFamily, get_family, supported_model_types

SUPPORTED_MODEL_TYPES = supported_model_types()


@dataclass
class DecoderConfig:
    """The fields of an HF ``config.json`` that define a decoder of one of ``models.family.FAMILIES``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    rope_scaling: Optional[Dict[str, Any]] = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: Optional[int] = None
    eos_token_id: Union[int, List[int], None] = None
    pad_token_id: Optional[int] = None
    # 0: a causal LM (``lm_head``); n > 0: HF's ``*ForSequenceClassification`` with an n-output ``score``
    # head read at each row's last real token (a reward model or critic has 1).
    num_labels: int = 0
    extra: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_hf_dict(cls, d: Dict[str, Any], source: str = "config.json", *,
                     check_rope: bool = True) -> "DecoderConfig":
        """Build from a parsed HF config; ``source`` names the file in error messages.

        ``check_rope=False`` accepts any rope scaling (weight conversion needs shapes, not the forward)."""
        model_type = d.get("model_type")
        family = get_family(model_type, source=source)
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(d.get(key), int) or d[key] <= 0:
                raise MindRLHFError(f"{source}: field {key!r} must be a positive integer, got {d.get(key)!r}")
        heads = d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or heads
        head_dim = d.get("head_dim") or family.default_head_dim or d["hidden_size"] // heads
        if heads % kv_heads:
            raise MindRLHFError(
                f"{source}: num_attention_heads={heads} is not divisible by num_key_value_heads={kv_heads}")
        # transformers >= 5 nests rope settings under rope_parameters; older files use rope_scaling.
        params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
        rope_theta = d.get("rope_theta", params.get("rope_theta"))
        rope = d.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
        if rope is not None:
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if check_rope and rope_type not in family.rope_types:
                raise MindRLHFError(f"{source}: rope_scaling type {rope_type!r} is not supported for "
                                    f"{model_type}; supported: {', '.join(family.rope_types)}")
            if rope_type == "default":
                rope = None
        known = {f for f in cls.__dataclass_fields__ if f != "extra"} | {"id2label", "label2id"}
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # What the file says (the family decides what it means: ``qkv_bias``/``o_bias``).
            attention_bias=bool(d.get("attention_bias", bool(family.qkv_bias))),
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            num_labels=_num_labels(d, source),
            extra={k: v for k, v in d.items() if k not in known},
        )

    @classmethod
    def from_file(cls, path: Union[str, os.PathLike]) -> "DecoderConfig":
        """Read an HF ``config.json`` (or a directory that holds one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise MindRLHFError(f"{path}: config.json not found; copy the model's config.json from its HF directory")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise MindRLHFError(f"{path}: not valid JSON ({err}); restore the model's config.json") from None
        return cls.from_hf_dict(data, source=str(path))

    def to_hf_dict(self) -> Dict[str, Any]:
        """The HF config.json content (unknown original fields preserved)."""
        d = asdict(self)
        extra = d.pop("extra")
        if d["rope_scaling"] is None:
            d.pop("rope_scaling")
        labels = d.pop("num_labels")
        out = dict(extra)
        out.update(d)
        if labels:  # transformers derives num_labels from id2label
            out["architectures"] = [self.family.score_architecture]
            out["id2label"] = {str(i): f"LABEL_{i}" for i in range(labels)}
            out["label2id"] = {f"LABEL_{i}": i for i in range(labels)}
        else:
            out.setdefault("architectures", [self.family.architecture])
        return out

    # -- the family's rules, applied to this config ------------------------------------------------
    @property
    def family(self) -> ModelFamily:
        return get_family(self.model_type)

    @property
    def qkv_bias(self) -> bool:
        """Whether q/k/v projections have a bias."""
        return self.family.has_qkv_bias(self.attention_bias)

    @property
    def o_bias(self) -> bool:
        """Whether o_proj has a bias."""
        return self.family.has_o_bias(self.attention_bias)

    @property
    def mlp_has_bias(self) -> bool:
        """Whether the MLP projections have biases."""
        return self.family.has_mlp_bias(self.mlp_bias)

    @property
    def qk_norm(self) -> bool:
        """Whether q and k get a per-head RMSNorm before RoPE."""
        return self.family.qk_norm

    @property
    def tied_output(self) -> bool:
        """Whether the output projection is the embedding table (a tied causal LM; never a score head)."""
        return self.tie_word_embeddings and not self.num_labels

    @property
    def num_parameters(self) -> int:
        """Parameter count implied by the architecture."""
        total = 0
        for shape in self.expected_shapes().values():
            n = 1
            for dim in shape:
                n *= dim
            total += n
        return total

    def expected_shapes(self) -> Dict[str, tuple]:
        """HF parameter name → shape, for every parameter the model holds, in model order."""
        key = tuple(getattr(self, f) for f in _SHAPE_FIELDS)
        if key not in _SHAPE_CACHE:
            _SHAPE_CACHE[key] = {n: t.shape for n, t in self.family.tensors(self).items()}
        return dict(_SHAPE_CACHE[key])


def require_causal_lm(config: DecoderConfig, path: Union[str, os.PathLike], flag: str, role: str,
                      fix: str = "pass a *ForCausalLM checkpoint") -> None:
    """Refuse a sequence-classification checkpoint (a reward model or critic: a ``score`` head, no ``lm_head``)
    where a causal LM is needed: it can neither generate nor give token log-probs. ``flag`` names the input as
    the user gave it (``--ref_model``), ``role`` what it is for (``the DPO reference``), ``fix`` the remedy."""
    if config.num_labels:
        raise MindRLHFError(f"{flag} {path} is a sequence-classification model ({config.family.score_architecture}, "
                            f"a reward model or critic: a score head, no lm_head); {role} must be a causal LM: "
                            f"{fix}")


# expected_shapes is asked for per parameter by the sharding helpers: memoise on what decides it.
_SHAPE_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings", "attention_bias",
                 "mlp_bias", "num_labels")
_SHAPE_CACHE: Dict[tuple, Dict[str, tuple]] = {}


def _num_labels(d: Dict[str, Any], source: str) -> int:
    """0 for a causal LM; the label count of a ``*ForSequenceClassification`` config (``id2label``, as
    transformers reads it; its default is 2)."""
    arch = (d.get("architectures") or [""])[0] or ""
    if not str(arch).endswith("ForSequenceClassification"):
        return 0
    labels = d.get("id2label")
    n = len(labels) if isinstance(labels, dict) and labels else d.get("num_labels", 2)
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise MindRLHFError(f"{source}: num_labels must be a positive integer, got {n!r}")
    return n
