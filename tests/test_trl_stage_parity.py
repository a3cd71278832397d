"""Step-1 parity with TRL 1.16: ``mindrlhf-sft``, ``mindrlhf-rm``, ``mindrlhf-dpo`` and ``mindrlhf-orpo`` log the
loss, grad_norm, learning_rate and every metric TRL's SFTTrainer / RewardTrainer / DPOTrainer / (experimental)
ORPOTrainer logged for the same tiny Qwen2 models and rows (recorded in tests/data/trl_stage_reference.json by
tests/make_trl_stage_reference.py in TRL's virtualenv; rerun live when that venv is here), and make the same update.

The models are rebuilt here by the same numpy-seeded maker (``mindrlhf.testing.make_numpy_qwen2``); their
checksums must equal the recorded ones before anything is compared, so a drift in the maker, numpy or
transformers fails loudly instead of as a parity miss."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Dict

import numpy as np
import pytest

from make_trl_stage_reference import MODELS, ROWS, SETTINGS, STAGES, jsonl_text, rows_sha256, update_summary

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "tests" / "data" / "trl_stage_reference.json"

#: float32 noise: two implementations of the same float32 math (kernels, summation orders) agree to ~1e-6.
LOSS_REL = 1e-4
METRIC_REL, METRIC_ABS = 1e-4, 1e-5
#: TRL keys we do not log (yet): DPO's policy-logit, entropy and token-accuracy diagnostics.
NOT_LOGGED = {"dpo": {"entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy"},
              "orpo": {"logits/chosen", "logits/rejected"}}
#: Exact: counts, the schedule, the epoch.
EXACT = {"learning_rate", "num_tokens", "epoch"}


def _reference() -> dict:
    return json.loads(REFERENCE.read_text(encoding="utf-8"))


def _ours_argv(stage: str, files: Dict[str, Path], out: Path, tokenizer_dir: Path, n: int) -> list:
    rows, trained, ref = STAGES[stage]
    args = {"model": files[trained], "tokenizer_dir": tokenizer_dir, "train_file": files[rows], "output_dir": out,
            "max_steps": 1, "batch_size": n, "micro_batch_size": n, "max_length": SETTINGS["max_length"],
            "lr": SETTINGS["lr"], "lr_schedule": "linear", "min_lr": 0.0, "warmup_steps": 0,
            "max_grad_norm": SETTINGS["max_grad_norm"], "weight_decay": 0.0, "seed": SETTINGS["seed"],
            "dtype": "float32", "save_steps": 0, "progress_bar": "false", "tensorboard": "false"}
    if stage == "dpo":
        args.update(ref_model=files[ref], loss_type="sigmoid", beta=SETTINGS["beta"], label_smoothing=0.0)
    if stage == "orpo":
        args.update(beta=SETTINGS["beta"])
    return [x for k, v in args.items() for x in (f"--{k}", str(v))]


@pytest.fixture(scope="module")
def parity_assets(tmp_path_factory) -> Dict[str, Path]:
    """The recorded models (checksums checked) and rows files."""
    from mindrlhf.testing import make_numpy_qwen2, weights_checksum

    reference = _reference()
    root = tmp_path_factory.mktemp("trl_parity")
    files: Dict[str, Path] = {}
    for name, (seed, kind) in MODELS.items():
        files[name] = make_numpy_qwen2(root / name, seed=seed, kind=kind)
        want, got = reference["models"][name], weights_checksum(files[name])
        assert (want["seed"], want["kind"]) == (seed, kind)
        assert got["sha256"] == want["sha256"], (
            f"model {name!r} differs from the one TRL trained (numpy {np.__version__}): {got} != {want}; rerun "
            "tests/make_trl_stage_reference.py in TRL's venv if mindrlhf.testing.make_numpy_qwen2 changed")
        for key in ("tensors", "numel"):
            assert got[key] == want[key], name
        for key in ("sum", "sum_sq"):
            assert got[key] == pytest.approx(want[key], rel=1e-12), name
    for kind, rows in ROWS.items():
        assert reference["rows"][kind]["rows"] == rows, "rows changed: rerun tests/make_trl_stage_reference.py"
        assert reference["rows"][kind]["sha256"] == rows_sha256(rows)
        files[kind] = root / f"{kind}.jsonl"
        files[kind].write_text(jsonl_text(rows), encoding="utf-8")
    return files


def _update_summary(initial: Path, out: Path) -> Dict[str, float]:
    """``make_trl_stage_reference.update_summary`` of our step: the last checkpoint minus the initial weights."""
    from mindrlhf.checkpoint.manager import CheckpointManager
    from mindrlhf.models import get_weights, load_model

    step, path = CheckpointManager(str(out / "checkpoints")).latest_complete()
    assert step == 1
    return update_summary(get_weights(load_model(initial)), get_weights(load_model(path)))


def _compare(stage: str, want: Dict[str, float], got: Dict[str, float]) -> None:
    missing = set(want) - set(got) - NOT_LOGGED.get(stage, set()) - {"step"}
    assert not missing, f"{stage}: TRL logs {sorted(missing)} and we do not"
    problems = []
    for key, value in want.items():
        if key not in got or key == "step":
            continue
        if key in EXACT:
            ok = got[key] == value
        elif key == "loss":
            ok = got[key] == pytest.approx(value, rel=LOSS_REL)
        else:
            ok = got[key] == pytest.approx(value, rel=METRIC_REL, abs=METRIC_ABS)
        if not ok:
            problems.append(f"{key}: TRL {value!r}, ours {got[key]!r}")
    assert not problems, f"{stage} step 1:\n" + "\n".join(problems)


@pytest.mark.parametrize("stage", list(STAGES))
def test_step_one_equals_trl(stage, parity_assets, tmp_path, qwen_tokenizer_dir):
    """Our command's step 1 logs TRL's loss (rel 1e-4), grad_norm and metrics (rel 1e-4 / abs 1e-5), the same
    learning_rate, num_tokens and epoch; and the update matches (Adam's first step moves each weight by
    ~lr * sign(grad): the sum of |update| counts the weights that moved, the signed sum their directions)."""
    from mindrlhf import dpo, orpo, rm, sft

    recorded = _reference()["stages"][stage]
    n = len(ROWS[STAGES[stage][0]])
    out = tmp_path / "out"
    main = {"sft": sft.main, "rm": rm.main, "dpo": dpo.main, "orpo": orpo.main}[stage]
    assert main(_ours_argv(stage, parity_assets, out, qwen_tokenizer_dir, n)) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1]
    _compare(stage, recorded["logged"], rows[0])

    want, got = recorded["update"], _update_summary(parity_assets[recorded["model"]], out)
    lr = SETTINGS["lr"]
    # The same weights moved, by ~lr each; a few sign flips of noise-level gradients are float32 noise.
    assert got["abs_sum"] == pytest.approx(want["abs_sum"], rel=1e-4)
    assert got["sum_sq"] == pytest.approx(want["sum_sq"], rel=1e-4)
    assert abs(got["sum"] - want["sum"]) <= 1e-4 * want["abs_sum"] + lr, (got, want)


def _trl_python() -> Path:
    venv = Path(os.environ.get("MINDRLHF_TRL_VENV", REPO / "bench" / ".venv-trl"))
    return venv / "bin" / "python"


@pytest.mark.slow
def test_recorded_reference_is_what_trl_gives_today(tmp_path, qwen_tokenizer_dir):
    """TRL run now (its venv, bench/.venv-trl or $MINDRLHF_TRL_VENV) logs what the recorded reference says,
    on models with the recorded checksums."""
    python = _trl_python()
    if not python.is_file():
        pytest.skip(f"no TRL virtualenv at {python.parents[1]} (bench/README.md creates it; or set MINDRLHF_TRL_VENV)")
    out = tmp_path / "fresh.json"
    proc = subprocess.run([str(python), str(REPO / "tests" / "make_trl_stage_reference.py"), "--output", str(out),
                           "--tokenizer_dir", str(qwen_tokenizer_dir)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh, recorded = json.loads(out.read_text(encoding="utf-8")), _reference()
    for name in MODELS:  # the float64 sums may differ in the last bits between numpy versions; the bytes may not
        assert fresh["models"][name]["sha256"] == recorded["models"][name]["sha256"], name
    assert fresh["rows"] == recorded["rows"]
    if fresh["trl"] != recorded["trl"]:
        pytest.skip(f"TRL {fresh['trl']} in the venv, the reference records {recorded['trl']}")
    for stage in STAGES:
        _compare(stage, recorded["stages"][stage]["logged"], fresh["stages"][stage]["logged"])
