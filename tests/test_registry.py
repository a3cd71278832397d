"""mindrlhf.registry: the Registry class, and every config choice tied to the registry it names.

Runs without MindSpore where it can: the configs must read their choices without importing it.
"""
from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

import pytest

from mindrlhf import registry
from mindrlhf.configs import AlgorithmConfig, GRPOConfig, grpo_configs
from mindrlhf.errors import MindRLHFError
from mindrlhf.registry import Registry
from mindrlhf.rewards import REWARD_FUNCS


def test_register_get_names_and_errors():
    reg = Registry("widget", hints={"gizmo": "a gizmo is a widget with wheels"})

    @reg.register("b")
    def b():
        return "b"

    @reg.register("a")
    def a():
        return "a"

    assert reg.names() == ("b", "a")  # registration order
    assert reg.get("a") is a and "b" in reg and "c" not in reg and len(reg) == 2 and list(reg) == ["b", "a"]
    reg.register("a")(a)  # the same function again is fine
    with pytest.raises(MindRLHFError, match=r"widget 'a' is already registered \(by .*test_registry.*a\)"):
        reg.register("a")(lambda: None)
    with pytest.raises(MindRLHFError, match=r"^unknown widget 'c'; choose one of a, b$"):
        reg.get("c")
    with pytest.raises(MindRLHFError, match=r"unknown widget 'Gizmo'; choose one of a, b \(a gizmo is a widget"):
        reg.get("Gizmo")
    with pytest.raises(MindRLHFError, match="unknown widget 3"):
        reg.get(3)
    with pytest.raises(MindRLHFError, match="non-empty string"):
        reg.register("")
    reg.unregister("a")
    assert reg.names() == ("b",)


def test_builtins_are_known_without_importing_their_module():
    reg = Registry("thing", module="no_such_module_xyz", builtins=("x", "y"))
    assert reg.names() == ("x", "y") and "x" in reg
    with pytest.raises(ModuleNotFoundError):  # get imports the module that registers the built-ins
        reg.get("x")


def test_configs_and_registries_import_no_mindspore():
    code = ("import sys, mindrlhf.configs, mindrlhf.registry, mindrlhf.rewards; "
            "mindrlhf.configs.GRPOConfig().validate(); "
            "from mindrlhf.configs import REFERENCES, config_reference_markdown as m; [m(s) for s in REFERENCES]; "
            "print(sorted(k for k in sys.modules if k.split('.')[0] == 'mindspore'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def _choices(field: str):
    return {f.name: f for f in dataclasses.fields(AlgorithmConfig)}[field].metadata["choices"]


def _check_params_reach_the_function(reg: Registry, params_by_name, choice: str, config_params: str) -> None:
    """Each registered function's hyper-parameters (``params_by_name``) are keyword-only arguments of it and
    algorithm config fields of the same default, and the config selecting it with ``choice`` hands exactly those
    on (its ``config_params`` property)."""
    fields = {f.name: f for f in dataclasses.fields(AlgorithmConfig)}
    for name, params in params_by_name.items():
        signature = inspect.signature(reg.get(name)).parameters
        for param in params:
            assert signature[param].kind is inspect.Parameter.KEYWORD_ONLY, (name, param)
            assert fields[param].default == signature[param].default, (name, param)
        assert tuple(getattr(GRPOConfig.from_dict({choice: name}), config_params)) == params, name


def test_every_config_choice_is_its_registry():
    pytest.importorskip("mindspore")
    import mindrlhf.algorithms  # noqa: F401  (registers the built-ins)

    # The builtins lists in mindrlhf.registry are exactly what the algorithm modules register.
    for reg in (registry.POLICY_LOSSES, registry.IS_MODES, registry.ROLLOUT_RS, registry.ADVANTAGE_ESTIMATORS,
                registry.KL_ESTIMATORS):
        own = {name for name, fn in reg.entries.items() if fn.__module__ == reg.module}
        assert set(reg.builtins) == own, reg.kind
        for name in reg.builtins:
            assert callable(reg.get(name))
    assert _choices("loss_type") == registry.POLICY_LOSSES.names() + tuple(grpo_configs.TRL_LOSS_TYPES)
    # Each loss's hyper-parameters are keyword arguments of its function and GRPO config fields of the same
    # default, and reach the loss through the config.
    assert set(registry.POLICY_LOSS_PARAMS) | set(registry.POLICY_LOSS_AGGREGATION) <= set(registry.POLICY_LOSSES)
    _check_params_reach_the_function(registry.POLICY_LOSSES, registry.POLICY_LOSS_PARAMS, "loss_type",
                                     "policy_loss_params")
    assert set(grpo_configs.TRL_LOSS_TYPES).isdisjoint(registry.POLICY_LOSSES.names())
    assert set(grpo_configs.TRL_LOSS_TYPES.values()) <= set(registry.LOSS_AGG_MODES)
    # The advantage estimators' hyper-parameters likewise; the per-token ones take the completion mask.
    assert set(registry.ADVANTAGE_ESTIMATOR_PARAMS) | set(registry.PER_TOKEN_ADVANTAGE_ESTIMATORS) <= set(
        registry.ADVANTAGE_ESTIMATORS)
    _check_params_reach_the_function(registry.ADVANTAGE_ESTIMATORS, registry.ADVANTAGE_ESTIMATOR_PARAMS,
                                     "advantage_estimator", "advantage_estimator_params")
    for name in registry.ADVANTAGE_ESTIMATORS.names():
        signature = inspect.signature(registry.ADVANTAGE_ESTIMATORS.get(name)).parameters
        assert ("completion_mask" in signature) == (name in registry.PER_TOKEN_ADVANTAGE_ESTIMATORS), name
    assert set(registry.SEQUENCE_ADVANTAGE_LOSSES) <= set(registry.POLICY_LOSSES)
    assert _choices("importance_sampling_mode") == registry.IS_MODES.names()
    assert _choices("rollout_rs") == (registry.ROLLOUT_RS_OFF,) + registry.ROLLOUT_RS.names()
    assert set(registry.TWO_SIDED_ROLLOUT_RS) <= set(registry.ROLLOUT_RS)
    assert _choices("advantage_estimator") == registry.ADVANTAGE_ESTIMATORS.names()
    assert _choices("kl_estimator") == registry.KL_ESTIMATORS.names()
    assert _choices("loss_agg_mode") == registry.LOSS_AGG_MODES
    assert _choices("scale_rewards") == registry.SCALE_REWARDS
    from mindrlhf.algorithms import LOSS_AGG_MODES, SCALE_REWARDS
    assert LOSS_AGG_MODES is registry.LOSS_AGG_MODES and SCALE_REWARDS is registry.SCALE_REWARDS
    # Every advantage_estimator choice and every scale_rewards resolves to a registered estimator.
    for estimator in registry.ADVANTAGE_ESTIMATORS.names():
        for scale in registry.SCALE_REWARDS if estimator == "grpo" else ("group",):
            cfg = grpo_configs.GRPOConfig()
            cfg.algorithm.advantage_estimator, cfg.algorithm.scale_rewards = estimator, scale
            cfg.validate()
            assert cfg.advantage_estimator in registry.ADVANTAGE_ESTIMATORS.entries


def test_reward_registry_is_a_registry():
    assert isinstance(REWARD_FUNCS, Registry)
    assert {"accuracy", "format", "gsm8k_format", "boxed"} <= set(REWARD_FUNCS.names())
