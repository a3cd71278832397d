"""One spec per model family (HF ``model_type``): everything that differs between Llama, Qwen2, ...

Every other module reads these facts from here: the config reader (``models.config``), the decoder
(bias and norm rules), the HF/MindSpore weight I/O (``checkpoint.hf_io``: names and shapes), the
converters (``--model`` names), the GGUF importer (tensor names, rotary row order) and tensor
parallelism (``parallel.sharding``: which dimension of a tensor is split). Adding a family is adding
a ``ModelFamily`` to ``FAMILIES`` (and, when it brings a new kind of tensor, a row to ``_LAYER_TENSORS``).

Pure Python, no MindSpore: configs and converters import it cheaply.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

from mindrlhf.errors import MindRLHFError

# How tensor parallelism splits a tensor (Megatron): column = dim 0 (output features), row = dim 1
# (input features), vocab = dim 0 (vocabulary rows), replicated = every rank holds all of it.
COLUMN, ROW, VOCAB, REPLICATED = "column", "row", "vocab", "replicated"
SPLIT_DIM = {COLUMN: 0, ROW: 1, VOCAB: 0, REPLICATED: None}

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
SCORE = "score.weight"    # HF *ForSequenceClassification: (num_labels, hidden), no bias
LAYER_PREFIX = "model.layers.{i}."
# Buffers some HF checkpoints carry that are derived from the config (recomputed, never loaded).
DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


def is_derived_buffer(name: str) -> bool:
    """True for tensors that are derived from the config (skipped silently on load)."""
    return name.endswith(DERIVED_SUFFIXES)


class DecoderDims(Protocol):
    """The fields of a decoder's config that the tensor table reads (``models.config.DecoderConfig`` has them).

    Named here rather than imported from ``models.config``: the config reads its family from this module."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    num_labels: int


@dataclass(frozen=True)
class ModelFamily:
    """The facts of one HF ``model_type`` that the shared decoder skeleton does not already fix.

    ``qkv_bias`` / ``mlp_bias``: ``None`` means "as the config's ``attention_bias`` / ``mlp_bias``
    says", a bool means the HF model hard-codes it. ``o_bias_follows_attention_bias``: whether
    ``attention_bias`` also puts a bias on ``o_proj``. ``qk_norm``: a per-head RMSNorm on q and k
    (before RoPE). ``default_head_dim``: HF's default when config.json omits ``head_dim``
    (``None``: hidden_size // num_attention_heads).
    """

    model_type: str
    architecture: str                 # HF ``architectures[0]``
    cli_names: Tuple[str, ...]        # ``convert_weight.py --model`` spellings
    description: str                  # for error messages: which checkpoints this covers
    qkv_bias: Optional[bool] = None
    o_bias_follows_attention_bias: bool = True
    mlp_bias: Optional[bool] = None
    qk_norm: bool = False
    default_head_dim: Optional[int] = None
    rope_types: Tuple[str, ...] = ("default", "llama3")
    gguf_arch: Optional[str] = None   # ``general.architecture`` of its llama.cpp GGUF files
    gguf_permuted_qk: bool = False    # llama.cpp interleaves the rotary halves of q/k rows
    # config.json keys the GGUF importer writes for this family: f(config so far, has q bias) -> keys
    gguf_config: Callable[[Dict[str, Any], bool], Dict[str, Any]] = field(default=lambda cfg, bias: {}, repr=False)

    # -- rules read from a config ------------------------------------------------------------------
    def has_qkv_bias(self, attention_bias: bool) -> bool:
        """Whether q/k/v have biases, given the config's ``attention_bias``."""
        return attention_bias if self.qkv_bias is None else self.qkv_bias

    def has_o_bias(self, attention_bias: bool) -> bool:
        """Whether o_proj has a bias, given the config's ``attention_bias``."""
        return self.has_qkv_bias(attention_bias) and self.o_bias_follows_attention_bias

    def has_mlp_bias(self, mlp_bias: bool) -> bool:
        """Whether the MLP projections have biases, given the config's ``mlp_bias``."""
        return mlp_bias if self.mlp_bias is None else self.mlp_bias

    # -- tensors ---------------------------------------------------------------------------------
    def tensors(self, config: DecoderDims) -> Dict[str, "TensorSpec"]:
        """HF name -> ``TensorSpec`` of every parameter of the model ``config`` describes, in model order."""
        out: Dict[str, TensorSpec] = {EMBED: TensorSpec((config.vocab_size, config.hidden_size), VOCAB)}
        for i in range(config.num_hidden_layers):
            prefix = LAYER_PREFIX.format(i=i)
            for row in _LAYER_TENSORS:
                if row.present(self, config):
                    out[prefix + row.suffix] = TensorSpec(row.shape(config), row.split)
        out[FINAL_NORM] = TensorSpec((config.hidden_size,), REPLICATED)
        if config.num_labels:  # a sequence-classification model has a score head instead of lm_head
            out[SCORE] = TensorSpec((config.num_labels, config.hidden_size), REPLICATED)
        elif not config.tie_word_embeddings:
            out[LM_HEAD] = TensorSpec((config.vocab_size, config.hidden_size), VOCAB)
        return out

    @property
    def score_architecture(self) -> str:
        """HF ``architectures[0]`` of the family's sequence-classification model (reward models, critics)."""
        return self.architecture.replace("ForCausalLM", "ForSequenceClassification")

    def gguf_to_hf_name(self, gguf_name: str, num_layers: int) -> Optional[str]:
        """The HF name of a llama.cpp tensor name (``blk.3.attn_q.weight``), or ``None`` if unknown."""
        if gguf_name in _GGUF_GLOBAL:
            return _GGUF_GLOBAL[gguf_name]
        parts = gguf_name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit() or int(parts[1]) >= num_layers:
            return None
        module = _GGUF_LAYER.get(parts[2])
        if module is None or parts[3] not in ("weight", "bias"):
            return None
        return f"{LAYER_PREFIX.format(i=int(parts[1]))}{module}.{parts[3]}"


@dataclass(frozen=True)
class TensorSpec:
    """A parameter's full (unsharded) HF shape and how tensor parallelism splits it."""

    shape: Tuple[int, ...]
    split: str

    @property
    def split_dim(self) -> Optional[int]:
        return SPLIT_DIM[self.split]


@dataclass(frozen=True)
class _LayerTensor:
    suffix: str                                               # under model.layers.{i}.
    split: str
    shape: Callable[[DecoderDims], Tuple[int, ...]]
    present: Callable[[ModelFamily, DecoderDims], bool] = lambda fam, c: True


def _q(c) -> int:
    return c.num_attention_heads * c.head_dim


def _kv(c) -> int:
    return c.num_key_value_heads * c.head_dim


def _qkv_bias(fam, c) -> bool:
    return fam.has_qkv_bias(c.attention_bias)


def _mlp_bias(fam, c) -> bool:
    return fam.has_mlp_bias(c.mlp_bias)


# The decoder layer every family shares (HF order). Heads are contiguous head_dim row blocks, so a
# column split is a split by contiguous head blocks (GQA stays rank-local); a row-parallel bias is
# added after the all-reduce, so it is replicated; norms are replicated.
_LAYER_TENSORS: Tuple[_LayerTensor, ...] = (
    _LayerTensor("self_attn.q_proj.weight", COLUMN, lambda c: (_q(c), c.hidden_size)),
    _LayerTensor("self_attn.q_proj.bias", COLUMN, lambda c: (_q(c),), _qkv_bias),
    _LayerTensor("self_attn.k_proj.weight", COLUMN, lambda c: (_kv(c), c.hidden_size)),
    _LayerTensor("self_attn.k_proj.bias", COLUMN, lambda c: (_kv(c),), _qkv_bias),
    _LayerTensor("self_attn.v_proj.weight", COLUMN, lambda c: (_kv(c), c.hidden_size)),
    _LayerTensor("self_attn.v_proj.bias", COLUMN, lambda c: (_kv(c),), _qkv_bias),
    _LayerTensor("self_attn.o_proj.weight", ROW, lambda c: (c.hidden_size, _q(c))),
    _LayerTensor("self_attn.o_proj.bias", REPLICATED, lambda c: (c.hidden_size,),
                 lambda fam, c: fam.has_o_bias(c.attention_bias)),
    _LayerTensor("self_attn.q_norm.weight", REPLICATED, lambda c: (c.head_dim,), lambda fam, c: fam.qk_norm),
    _LayerTensor("self_attn.k_norm.weight", REPLICATED, lambda c: (c.head_dim,), lambda fam, c: fam.qk_norm),
    _LayerTensor("mlp.gate_proj.weight", COLUMN, lambda c: (c.intermediate_size, c.hidden_size)),
    _LayerTensor("mlp.gate_proj.bias", COLUMN, lambda c: (c.intermediate_size,), _mlp_bias),
    _LayerTensor("mlp.up_proj.weight", COLUMN, lambda c: (c.intermediate_size, c.hidden_size)),
    _LayerTensor("mlp.up_proj.bias", COLUMN, lambda c: (c.intermediate_size,), _mlp_bias),
    _LayerTensor("mlp.down_proj.weight", ROW, lambda c: (c.hidden_size, c.intermediate_size)),
    _LayerTensor("mlp.down_proj.bias", REPLICATED, lambda c: (c.hidden_size,), _mlp_bias),
    _LayerTensor("input_layernorm.weight", REPLICATED, lambda c: (c.hidden_size,)),
    _LayerTensor("post_attention_layernorm.weight", REPLICATED, lambda c: (c.hidden_size,)),
)
_LAYER_SPLIT = {row.suffix: row.split for row in _LAYER_TENSORS}
#: The decoder layer's projections (its linear layers, PEFT's module names, in layer order): LoRA's targets.
PROJECTIONS: Tuple[str, ...] = tuple(row.suffix.split(".")[1] for row in _LAYER_TENSORS
                                     if row.suffix.endswith("_proj.weight"))

# llama.cpp tensor names (gguf-py's TENSOR_NAMES) -> HF names.
_GGUF_GLOBAL = {"token_embd.weight": EMBED, "output_norm.weight": FINAL_NORM, "output.weight": LM_HEAD}
_GGUF_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def split_kind(name: str) -> str:
    """``column`` / ``row`` / ``vocab`` / ``replicated``: how tp splits parameter ``name`` (any family).

    A LoRA factor (``...q_proj.lora_B.weight``, ``models.lora``) follows its layer: a column-parallel layer's B is
    split with the output rows (``column``), a row-parallel layer's A with the input columns (``row``); the other
    factor is replicated."""
    if name in (EMBED, LM_HEAD):
        return VOCAB
    module, lora, factor = name.rpartition(".lora_")
    if lora:
        kind = split_kind(f"{module}.weight")
        return kind if (factor, kind) in (("B.weight", COLUMN), ("A.weight", ROW)) else REPLICATED
    if name.startswith("model.layers."):
        suffix = name.split(".", 3)[-1]
        return _LAYER_SPLIT.get(suffix, REPLICATED)
    return REPLICATED


# -- the families ----------------------------------------------------------------------------------
FAMILIES: Dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    """Add a family (its ``model_type`` must be new)."""
    if family.model_type in FAMILIES:
        raise ValueError(f"model family {family.model_type!r} is defined twice")
    FAMILIES[family.model_type] = family
    return family


register(ModelFamily(
    model_type="qwen2", architecture="Qwen2ForCausalLM", cli_names=("qwen2_5", "qwen2"),
    description="Qwen2/Qwen2.5 checkpoints",
    # HF Qwen2 hard-codes q/k/v biases, no o_proj or MLP bias.
    qkv_bias=True, o_bias_follows_attention_bias=False, mlp_bias=False,
    gguf_arch="qwen2",
    gguf_config=lambda cfg, bias: dict(use_sliding_window=False, sliding_window=None,
                                       max_window_layers=cfg["num_hidden_layers"]),
))
register(ModelFamily(
    model_type="llama", architecture="LlamaForCausalLM", cli_names=("llama",),
    description="Llama-family checkpoints (Llama 2/3, SmolLM, ...)",
    gguf_arch="llama", gguf_permuted_qk=True,
    gguf_config=lambda cfg, bias: dict(attention_bias=bias, mlp_bias=False, pretraining_tp=1),
))
register(ModelFamily(
    model_type="qwen3", architecture="Qwen3ForCausalLM", cli_names=("qwen3",),
    description="Qwen3 dense checkpoints",
    # RMSNorm over each q/k head before RoPE; attention_bias (default off) covers q/k/v and o_proj;
    # head_dim is its own config field (transformers' default 128), not hidden_size / heads.
    qk_norm=True, mlp_bias=False, default_head_dim=128,
    gguf_arch="qwen3",
    gguf_config=lambda cfg, bias: dict(attention_bias=bias, use_sliding_window=False, sliding_window=None,
                                       max_window_layers=cfg["num_hidden_layers"]),
))


def supported_model_types() -> Tuple[str, ...]:
    """Every HF ``model_type`` with a spec, in registration order."""
    return tuple(FAMILIES)


def get_family(model_type: Any, *, source: str = "config.json") -> ModelFamily:
    """The spec of ``model_type``; a one-line error naming ``source`` and the supported types otherwise."""
    if model_type not in FAMILIES:
        described = "; ".join(f"{f.model_type} ({f.description})" for f in FAMILIES.values())
        raise MindRLHFError(f"{source}: model_type {model_type!r} is not supported; supported: {described}")
    return FAMILIES[model_type]


def family_of_cli_name(name: str) -> ModelFamily:
    """The family of a ``--model`` value (``qwen2_5``, ``Qwen2.5``, ``llama``, ...)."""
    key = name.strip().lower().replace(".", "_").replace("-", "_")
    for fam in FAMILIES.values():
        if key in fam.cli_names:
            return fam
    raise MindRLHFError(f"--model {name!r} is not supported; use one of {', '.join(cli_names())}")


def cli_names() -> List[str]:
    """Every ``--model`` spelling of every family."""
    return [n for fam in FAMILIES.values() for n in fam.cli_names]


def gguf_family(arch: Any, *, source: str) -> ModelFamily:
    """The family whose llama.cpp files declare ``general.architecture = arch``."""
    for fam in FAMILIES.values():
        if fam.gguf_arch is not None and fam.gguf_arch == arch:
            return fam
    supported = ", ".join(f.gguf_arch for f in FAMILIES.values() if f.gguf_arch)
    raise MindRLHFError(f"{source}: general.architecture={arch!r} is not supported (supported: {supported}); "
                        f"convert the original HF checkpoint instead")
