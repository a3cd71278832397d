"""Which part of a decoder one process builds: a tp slice and a pipeline stage (``ModelShard``).

The model only needs to know its own part; how ranks are laid out over devices is
``mindrlhf.parallel.layout`` (``ModelShard.of(layout, rank)`` reads a rank's part from a layout).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from mindrlhf.errors import MindRLHFError

if TYPE_CHECKING:  # pragma: no cover
    from mindrlhf.models.config import DecoderConfig


def check_divisible(config: "DecoderConfig", tp: int, pp: int, what: str) -> None:
    """tp must divide the attention heads, the kv heads, the vocabulary and the MLP width, pp the layer
    count; a one-line ``MindRLHFError`` naming ``what`` (the layout) and both numbers otherwise."""
    checks = (
        ("num_attention_heads", config.num_attention_heads, "tp", tp),
        ("num_key_value_heads", config.num_key_value_heads, "tp", tp),
        ("vocab_size", config.vocab_size, "tp", tp),
        ("intermediate_size", config.intermediate_size, "tp", tp),
        ("num_hidden_layers", config.num_hidden_layers, "pp", pp),
    )
    for field_name, value, axis, n in checks:
        if value % n:
            hint = " (pad the embedding/lm_head rows to a multiple of tp first)" if field_name == "vocab_size" else ""
            raise MindRLHFError(f"{what}: {field_name}={value} is not divisible by {axis}={n}; "
                                f"choose a {axis} that divides {value}{hint}")


@dataclass(frozen=True)
class ModelShard:
    """The part of a decoder one process holds: tp slice ``tp_rank`` of ``tp``, pipeline stage ``stage`` of ``pp``.

    ``tp_group`` names the tp communication group (required when ``tp > 1``). The default is the
    whole model on one process. ``CausalLM(config, dtype, shard)`` builds exactly this part.
    """

    tp: int = 1
    tp_rank: int = 0
    tp_group: Optional[str] = None
    pp: int = 1
    stage: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp:
            raise MindRLHFError(f"model shard: tp_rank {self.tp_rank} is outside tp={self.tp} (0..{self.tp - 1})")
        if not 0 <= self.stage < self.pp:
            raise MindRLHFError(f"model shard: stage {self.stage} is outside pp={self.pp} (0..{self.pp - 1})")
        if self.tp > 1 and not self.tp_group:
            raise MindRLHFError(f"model shard with tp={self.tp} needs tp_group=<tp group name>; get it from "
                                "mindrlhf.parallel.groups.init_parallel_groups(layout)")

    @classmethod
    def of(cls, layout, rank: int, tp_group: Optional[str] = None) -> "ModelShard":
        """The shard global ``rank`` holds in ``layout`` (a ``parallel.layout.ParallelLayout``)."""
        c = layout.coords(rank)
        return cls(tp=layout.tp, tp_rank=c.tp, tp_group=tp_group, pp=layout.pp, stage=c.pp)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.pp - 1

    def validate(self, config: "DecoderConfig") -> None:
        """Heads, kv heads, vocabulary and MLP width divisible by tp; layers by pp (error names both)."""
        check_divisible(config, self.tp, self.pp, f"parallel layout dp=1, tp={self.tp}, pp={self.pp}")

    def layer_range(self, config: "DecoderConfig") -> range:
        """Global indices of the decoder layers this stage owns (contiguous, ``L/pp`` each)."""
        self.validate(config)
        per = config.num_hidden_layers // self.pp
        return range(self.stage * per, (self.stage + 1) * per)
