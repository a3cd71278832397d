"""Architecture hyperparameters of a Qwen2 / Llama decoder, read from a Hugging Face config.json."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from mindrlhf.errors import MindRLHFError

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")


@dataclass
class DecoderConfig:
    """The fields of an HF ``config.json`` that define a Qwen2 / Llama decoder."""

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
    extra: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_hf_dict(cls, d: Dict[str, Any], source: str = "config.json") -> "DecoderConfig":
        """Build from a parsed HF config; ``source`` names the file in error messages."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise MindRLHFError(
                f"{source}: model_type {model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (Qwen2/Qwen2.5 and Llama-family checkpoints)")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(d.get(key), int) or d[key] <= 0:
                raise MindRLHFError(f"{source}: field {key!r} must be a positive integer, got {d.get(key)!r}")
        heads = d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or heads
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        if heads % kv_heads:
            raise MindRLHFError(
                f"{source}: num_attention_heads={heads} is not divisible by num_key_value_heads={kv_heads}")
        # transformers >= 5 nests rope settings under rope_parameters; older files use rope_scaling.
        params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
        rope_theta = d.get("rope_theta", params.get("rope_theta"))
        rope = d.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
        if rope is not None:
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type not in ("default", "llama3"):
                raise MindRLHFError(
                    f"{source}: rope_scaling type {rope_type!r} is not supported; supported: default, llama3")
            if rope_type == "default":
                rope = None
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
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
            # Qwen2 always has q/k/v bias; Llama has it only when attention_bias is set.
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
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
        out = dict(extra)
        out.update(d)
        out.setdefault("architectures", ["Qwen2ForCausalLM" if self.model_type == "qwen2" else "LlamaForCausalLM"])
        return out

    @property
    def num_parameters(self) -> int:
        """Parameter count implied by the architecture."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        mlp = 3 * h * i
        layer = attn + mlp + 2 * h
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * layer + h

    def expected_shapes(self) -> Dict[str, tuple]:
        """HF parameter name → shape, for every parameter the model holds."""
        from mindrlhf.checkpoint.hf_io import expected_hf_shapes

        return expected_hf_shapes(self.to_hf_dict())
