"""No config field is dead, in any stage's config: each is read by the code (directly or through a derived
property of its config), and the few that only constrain a layout are checked by validation."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from mindrlhf.configs import REFERENCES
from mindrlhf.errors import MindRLHFError
from mindrlhf.registry import ADVANTAGE_ESTIMATOR_PARAMS, POLICY_LOSS_PARAMS

PKG = Path(__file__).resolve().parents[1] / "mindrlhf"
# Fields the code reads only through the parallel layout objects (ParallelLayout / RunLayout are
# built from them in trainer.entry.setup_runtime): besides being read, a wrong value must be rejected, naming the field.
LAYOUT_CHECKED = {"train_micro_batches": {"train_micro_batches": 2}, "infer_dp": {"infer_dp": 2}}


def _code_outside_configs() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in PKG.rglob("*.py") if "configs" not in p.parts)


def _read(name: str, code: str) -> bool:
    return re.search(r"\.%s\b" % re.escape(name), code) is not None


def _derived_properties(config_cls) -> dict:
    """A config's derived properties and methods (``model_weights``) and its groups' (``ModelConfig.weight_fields``),
    by name: their source. A group's ``check`` is validation, not a read: it is left out."""
    found = {}
    for cls in [config_cls] + [group for _, group in config_cls.groups()]:
        for klass in reversed(cls.__mro__):  # the class's own and those of its bases (the shared TrainingConfig)
            found.update({name: inspect.getsource(obj.fget if isinstance(obj, property) else obj)
                          for name, obj in vars(klass).items()
                          if (isinstance(obj, property) or (inspect.isfunction(obj) and not name.startswith("__")))
                          and not (cls is not config_cls and name == "check")})
    return found


def _live_properties(code: str, config_cls) -> dict:
    """Derived properties that the code reads, directly or through other live properties."""
    props = _derived_properties(config_cls)
    live = {name: src for name, src in props.items() if _read(name, code)}
    grew = True
    while grew:
        grew = False
        for name, src in props.items():
            if name not in live and any(_read(name, other) for other in live.values()):
                live[name] = src
                grew = True
    return live


@pytest.mark.parametrize("stage,field", [(stage, field) for stage, (cls, _, _) in REFERENCES.items()
                                         for field in sorted(cls.field_index())])
def test_every_field_is_read_or_validated(stage, field):
    cls = REFERENCES[stage][0]
    code = _code_outside_configs()
    live = _live_properties(code, cls)
    used = _read(field, code) or any(_read(field, src) for src in live.values())
    # A policy loss's hyper-parameters are read by name from registry.POLICY_LOSS_PARAMS by policy_loss_params.
    used = used or ("policy_loss_params" in live and any(field in p for p in POLICY_LOSS_PARAMS.values()))
    used = used or ("advantage_estimator_params" in live
                    and any(field in p for p in ADVANTAGE_ESTIMATOR_PARAMS.values()))
    if field in LAYOUT_CHECKED and "infer_dp" in cls.field_index():
        with pytest.raises(MindRLHFError, match=field):
            cls.from_dict(LAYOUT_CHECKED[field])
    assert used, f"{stage}: config field {field!r} is never read by mindrlhf (dead field)"
