"""``Registry``: name → function tables that configs select from, and the algorithm registries.

One small class serves every "pick it by name" table: policy losses, importance-sampling modes, rejection
sampling criteria, advantage estimators, KL estimators (here), reward functions (``rewards.registry``) and
rollout tools (``rollout_tools.registry``); ``resolve`` also reads a user function's dotted path.
Register with a decorator, look up with ``get`` (a one-line ``MindRLHFError`` naming the unknown name and the
choices), list with ``names()``. ``STAGES`` is the stage table: each training command's module, config class
and generated config reference, read by ``configs.REFERENCES``, ``examples/stages/run.py`` and the tests
(which also tie ``pyproject.toml``'s console scripts to it).

This module imports no MindSpore, so ``configs`` reads its choices from here. The functions of the
algorithm registries live in ``mindrlhf.algorithms`` (MindSpore code); each registry lists the names
that module registers as ``builtins`` and names the module, so the choices are known without
importing MindSpore, and ``get`` imports the module when a built-in is first needed. A test ties each
``builtins`` list to what its module really registers.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Dict, Generic, Iterator, Mapping, Optional, Sequence, Tuple, TypeVar

from mindrlhf.errors import MindRLHFError

T = TypeVar("T", bound=Callable)


class Registry(Generic[T]):
    """Functions of one kind by name.

    ``kind`` names the table in errors ("policy loss"). ``module`` is where the built-ins are
    registered, imported on first need; ``builtins``, when given, are the names it registers, so
    ``names()`` answers without importing it (for modules that import MindSpore). ``hints`` map a
    likely wrong name (lower case) to advice appended to the unknown-name error.
    """

    def __init__(self, kind: str, *, module: str = "", builtins: Optional[Sequence[str]] = None,
                 hints: Optional[Mapping[str, str]] = None):
        self.kind = kind
        self.module = module
        self.builtins: Optional[Tuple[str, ...]] = tuple(builtins) if builtins is not None else None
        self.hints = dict(hints or {})
        self._entries: Dict[str, T] = {}

    # ------------------------------------------------------------------ registering
    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: register ``fn`` under ``name``; a different function already there is an error."""
        if not isinstance(name, str) or not name:
            raise MindRLHFError(f"a {self.kind} name must be a non-empty string, got {name!r}")

        def wrap(fn: T) -> T:
            previous = self._entries.get(name)
            if previous is not None and previous is not fn:
                raise MindRLHFError(f"{self.kind} {name!r} is already registered (by {_where(previous)}); "
                                    f"register {_where(fn)} under another name")
            self._entries[name] = fn
            return fn

        return wrap

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a no-op when absent); for tests and interactive sessions."""
        self._entries.pop(name, None)

    # ------------------------------------------------------------------ looking up
    def names(self) -> Tuple[str, ...]:
        """Every choice: the built-ins, then the names registered since, in registration order."""
        if self.builtins is None:
            self._load()
            return tuple(self._entries)
        return self.builtins + tuple(n for n in self._entries if n not in self.builtins)

    def check(self, name) -> None:
        """Raise the one-line unknown-name error unless ``name`` is a choice."""
        if not isinstance(name, str) or name not in self.names():
            hint = self.hints.get(str(name).lower(), "")
            raise MindRLHFError(f"unknown {self.kind} {name!r}; choose one of {', '.join(sorted(self.names()))}"
                                + (f" ({hint})" if hint else ""))

    def get(self, name: str) -> T:
        """The function registered as ``name``; a one-line ``MindRLHFError`` listing the choices otherwise."""
        self.check(name)
        if name not in self._entries:
            self._load()
        if name not in self._entries:  # a builtins list that its module does not keep
            raise MindRLHFError(f"{self.kind} {name!r} is listed as a built-in but {self.module} did not register "
                                "it; fix the builtins list in mindrlhf/registry.py")
        return self._entries[name]

    @property
    def entries(self) -> Dict[str, T]:
        """The registered functions by name (do not modify). Inside ``mindspore.jit`` look up here after
        a ``constexpr`` check: the compiler parses ``get``'s ``raise`` of a non-builtin exception and fails."""
        return self._entries

    def resolve(self, name: str) -> T:
        """A registered function by name, or a user function given by dotted path: ``"package.module:function"``
        (``"package.module.function"`` also works). How every "built-in or yours" option is read (reward functions,
        rollout tools); the one-line errors name the kind, the built-ins and the path form."""
        if not isinstance(name, str) or not name.strip():
            raise MindRLHFError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self:
            return self.get(name)
        builtins = ", ".join(sorted(self.names()))
        if ":" in name:
            module_name, _, attr = name.partition(":")
        elif "." in name:
            module_name, _, attr = name.rpartition(".")
        else:
            raise MindRLHFError(f"unknown {self.kind} {name!r}; built-ins: {builtins}; "
                                "or give a user function as 'package.module:function'")
        try:
            module = importlib.import_module(module_name)
        except Exception as err:  # ImportError, or any error raised while the user module runs
            raise MindRLHFError(
                f"{self.kind} {name!r}: cannot import module {module_name!r} ({type(err).__name__}: {err}); "
                f"check the path and PYTHONPATH (built-ins: {builtins})") from err
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise MindRLHFError(f"{self.kind} {name!r}: module {module_name!r} has no callable {attr!r}")
        return fn

    def _load(self) -> None:
        if self.module:
            importlib.import_module(self.module)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.names()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self.names())})"


def _where(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


# --- the algorithm registries (functions in mindrlhf.algorithms, which imports MindSpore) --------
POLICY_LOSSES: Registry = Registry(
    "policy loss", module="mindrlhf.algorithms.losses",
    builtins=("grpo", "gspo", "gspo-token", "decoupled", "cispo", "sapo", "gmpo", "clip_cov", "kl_cov", "luspo",
              "vespo"),
    hints={"dapo": "DAPO is loss_type='grpo' with epsilon_high > epsilon_low and loss_agg_mode='token-mean'",
           "geo_mean": "verl's geo_mean is loss_type='gmpo'"})
#: The hyper-parameters each built-in policy loss reads beyond the clip range: its keyword arguments, which are
#: also the GRPO config's field names (``configs.AlgorithmConfig``); a test ties the three together.
POLICY_LOSS_PARAMS: Dict[str, Tuple[str, ...]] = {
    "grpo": ("delta", "clip_ratio_c"),
    "cispo": ("cispo_ratio_max",),
    "sapo": ("sapo_temperature_pos", "sapo_temperature_neg"),
    "clip_cov": ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
    "kl_cov": ("kl_cov_ratio", "kl_cov_coef"),
    "vespo": ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
}
#: Losses defined on one value per sequence whose formula fixes the aggregation (their papers' and peers' mean
#: over sequences); any other ``loss_agg_mode`` would weight the sequences by length again.
POLICY_LOSS_AGGREGATION: Dict[str, str] = {"gmpo": "seq-mean-token-mean", "luspo": "seq-mean-token-mean"}
IS_MODES: Registry = Registry(
    "importance sampling mode", module="mindrlhf.algorithms.losses",
    builtins=("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"))
#: The importance-sampling modes of one weight per token, (B, T); the others give one per sequence, (B, 1).
TOKEN_IS_MODES: Tuple[str, ...] = ("token_truncate", "token_mask")
#: Policy losses that fold the importance-sampling correction's per-token weights into a sequence weight of their own
#: (their ``is_ratio=`` keyword; TRL 1.16's VESPO) rather than having their per-token loss multiplied by them; they
#: take the ``TOKEN_IS_MODES`` only, as TRL requires.
IS_FOLDING_LOSSES: Tuple[str, ...] = ("vespo",)
ROLLOUT_RS: Registry = Registry(
    "rejection sampling criterion", module="mindrlhf.algorithms.losses",
    builtins=("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3"))
#: The criteria bounded on both sides (verl's ``*_k1``): their statistic is a log-ratio, kept within
#: [log lower, log upper] of two ratio bounds; every other criterion's statistic is kept at or below one upper bound.
TWO_SIDED_ROLLOUT_RS: Tuple[str, ...] = ("token_k1", "seq_sum_k1", "seq_mean_k1")
#: The rollout_rs choice that turns rejection sampling off.
ROLLOUT_RS_OFF = "none"
ADVANTAGE_ESTIMATORS: Registry = Registry(
    "advantage estimator", module="mindrlhf.algorithms.advantages",
    builtins=("grpo", "dr_grpo", "batch_std", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"))
#: Estimators that give one advantage per completion token, (B, T) rather than (B,): they are called with the
#: completion mask (``completion_mask=``), and the policy losses that need one advantage per sequence reject them.
PER_TOKEN_ADVANTAGE_ESTIMATORS: Tuple[str, ...] = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
#: The hyper-parameters each built-in advantage estimator reads: its keyword arguments, also GRPO config field names.
ADVANTAGE_ESTIMATOR_PARAMS: Dict[str, Tuple[str, ...]] = {"reinforce_plus_plus": ("gamma",)}
#: Policy losses defined on one advantage per sequence (a (B, T) advantage is an error there).
SEQUENCE_ADVANTAGE_LOSSES: Tuple[str, ...] = ("gspo", "gmpo", "luspo")
KL_ESTIMATORS: Registry = Registry("KL estimator", module="mindrlhf.algorithms.kl", builtins=("k1", "k2", "k3"))
#: What the built-in KL estimators compute (``algorithms.kl``), for the config fields that choose one.
KL_ESTIMATOR_FORMULAS = (
    "with d = logp - logp_ref of the sampled token: k1 = d (unbiased; negative on a token the reference finds "
    "likelier), k2 = d^2 / 2 (biased, low variance), k3 = exp(-d) + d - 1 (unbiased, non-negative) (Schulman, "
    "'Approximating KL divergence', 2020; verl's kl_penalty kl / mse / low_var_kl)")
PREFERENCE_LOSSES: Registry = Registry(
    "DPO loss", module="mindrlhf.algorithms.supervised", builtins=("sigmoid", "ipo", "hinge", "robust"))

#: Fixed choices of the algorithm code (plain branches, not registries), here so configs read them without MindSpore.
LOSS_AGG_MODES = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
SCALE_REWARDS = ("group", "batch", "none")
#: How several reward functions become one advantage (TRL's multi_objective_aggregation; GDPO normalises first).
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


# --- the stage table --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stage:
    """One training command. Module and config class are dotted names, imported on first need, so reading
    the table imports no MindSpore and no stage module."""

    name: str  #: the stage's name: ``mindrlhf-<name>``, ``python -m <module>``, recorded in its runs
    module: str  #: the recipe module, whose ``main(argv)`` is the command
    config: str  #: ``module:ClassName`` of the stage's config dataclass
    reference: str  #: the generated config reference under the repository (named by unknown-key errors)
    title: str  #: that reference's title

    @property
    def script(self) -> str:
        """The console script's name (``pyproject.toml``'s ``[project.scripts]``)."""
        return f"mindrlhf-{self.name}"

    @property
    def entry_point(self) -> str:
        """The console script's target, ``module:main``."""
        return f"{self.module}:main"

    def config_class(self) -> type:
        """The stage's config dataclass (imports its config module, never MindSpore)."""
        module, _, cls = self.config.partition(":")
        return getattr(importlib.import_module(module), cls)

    def main(self, argv: Optional[Sequence[str]] = None) -> int:
        """Run the command (``mindrlhf-<name> ARGV``); imports the stage module."""
        return importlib.import_module(self.module).main(argv)


#: name -> stage. Adding a stage: its recipe module (with ``main``), its registered loss, its config
#: group/class (``REFERENCE_FILE = STAGES[name].reference``) and one row here; then its console script in
#: pyproject.toml (a test checks the two agree) and ``write_config_references()`` for its reference file.
STAGES: Dict[str, Stage] = {stage.name: stage for stage in (
    Stage("grpo", "mindrlhf.grpo", "mindrlhf.configs.grpo_configs:GRPOConfig", "docs/config_reference.md",
          "GRPO configuration reference"),
    Stage("sft", "mindrlhf.sft", "mindrlhf.configs.offline:SFTConfig", "docs/config_reference_sft.md",
          "SFT configuration reference (mindrlhf-sft)"),
    Stage("rm", "mindrlhf.rm", "mindrlhf.configs.offline:RMConfig", "docs/config_reference_rm.md",
          "Reward-model configuration reference (mindrlhf-rm)"),
    Stage("dpo", "mindrlhf.dpo", "mindrlhf.configs.offline:DPOConfig", "docs/config_reference_dpo.md",
          "DPO configuration reference (mindrlhf-dpo)"),
    Stage("orpo", "mindrlhf.orpo", "mindrlhf.configs.offline:ORPOConfig", "docs/config_reference_orpo.md",
          "ORPO configuration reference (mindrlhf-orpo)"),
    Stage("ppo", "mindrlhf.ppo", "mindrlhf.configs.ppo:PPOConfig", "docs/config_reference_ppo.md",
          "PPO configuration reference (mindrlhf-ppo)"),
)}


def stage(name: str) -> Stage:
    """The stage called ``name``; a one-line ``MindRLHFError`` listing the stages otherwise."""
    if name not in STAGES:
        raise MindRLHFError(f"unknown stage {name!r}; choose one of {', '.join(STAGES)}")
    return STAGES[name]
