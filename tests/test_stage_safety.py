"""Every stage (sft, rm, dpo, ppo, grpo) as safe as GRPO, probed the way users misuse them.

One short run of each stage (a checkpoint at step 1) is shared by the module; every probe below runs each
stage's command in this process against those runs and checks the one-line refusal and that nothing of the
existing run changed (every file's checksum, so metrics.jsonl, config.yaml, run.json and the checkpoints):
- a resume of another stage's run (its output_dir, or its checkpoint folder) is refused;
- a resume with another model than the run's (another path and content) is refused; a moved copy is the same;
- an output or checkpoint directory inside an input model's folder is refused;
- a damaged checkpoint (one flipped bit in policy.ckpt) is never read: training from it, evaluating it,
  converting or resharding it is one line;
- a start that fails (a missing data file or model) leaves no empty output or checkpoint folder.
Exact resume after kill -9 is tested per stage where each stage is: test_offline_stages (sft, rm, dpo),
test_ppo (ppo) and test_never_lose_a_run / test_grpo_e2e (grpo).
- every skipped data row is named: the first ones in the log, all in output_dir/skipped_rows.jsonl (the training
  and validation rows of sft, rm and dpo; the prompt JSONL rows of ppo and grpo).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest
import yaml

from grpo_runs import SUITE_RECOMPUTE, byhand, grpo_args
from mindrlhf.checkpoint.run_dir import LOCK_FILE, RUN_OUTPUTS, clear_previous_run
from mindrlhf.data.report import REASONS, SKIPPED_ROWS_FILE
from mindrlhf.trainer.base import SKIPPED_ROWS_LOGGED

REPO = Path(__file__).resolve().parents[1]
GSM8K = REPO / "mindrlhf" / "resources" / "gsm8k_train_sample.jsonl"
FILLER = 9  # bad rows after the named ones: more than SKIPPED_ROWS_LOGGED in all, so the log counts the rest
STAGES = ("sft", "rm", "dpo", "ppo", "grpo")
#: The flag of the trained model in each stage's command.
MODEL_FLAG = {"sft": "--model", "rm": "--model", "dpo": "--model", "ppo": "--model", "grpo": "--sft_path_train"}


def _flags(args: Dict[str, object]) -> List[str]:
    return [x for k, v in args.items()
            for x in (f"--{k}", *(map(str, v) if isinstance(v, (list, tuple)) else [str(v)]))]


@pytest.fixture(scope="module")
def assets(tmp_path_factory, ppo_assets, data_dir) -> dict:
    """One tiny Qwen2 (with the real tokenizer) every stage reads, the tiny one-label reward model for PPO and the
    16-prompt GSM8K mindrecord of the GRPO tests (``ppo_assets``), SFT rows and preference pairs."""
    from mindrlhf.data.gsm8k import sft_row, strip_calculator_notes

    root = tmp_path_factory.mktemp("safety")
    rows = [json.loads(line) for line in (data_dir / "gsm8k" / "train.jsonl").read_text().splitlines()[:4]]
    sft = root / "sft.jsonl"
    sft.write_text("".join(json.dumps(sft_row(r["question"], r["answer"])) + "\n" for r in rows))
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"Q: {r['question']}\nA:",
                                         "chosen": " " + strip_calculator_notes(r["answer"]),
                                         "rejected": " I do not know."}) + "\n" for r in rows))
    return {**ppo_assets, "sft": sft, "pairs": pairs}


def stage_argv(stage: str, assets: dict, out: Path, **extra) -> List[str]:
    """A one-step run of ``stage`` on the tiny models, saving its checkpoint; keywords override flags."""
    if stage == "grpo":
        args = dict(max_steps=1, num_generations=2, chunk_size=2, max_completion_length=4,
                    reward_funcs=["e2e_rewards:length_reward"], tensorboard="false")
        args.update(extra)
        return grpo_args(assets, out, **args)
    common = {"model": assets["model"], "output_dir": out, "max_steps": 1, "save_steps": 1, "lr": 1e-3,
              "progress_bar": "false", **SUITE_RECOMPUTE}
    if stage == "ppo":
        args = {**common, "reward_model": assets["rm"], "train_file": assets["data"], "batch_size": 2,
                "max_new_tokens": 4, "max_prompt_length": 256, "micro_batch_size": 1, "reward_funcs": "accuracy"}
    else:
        args = {**common, "train_file": assets["sft" if stage == "sft" else "pairs"], "batch_size": 2,
                "micro_batch_size": 2, "max_length": 256}
    args.update(extra)
    return _flags(args)


def run_stage(stage: str, argv: List[str]) -> int:
    """``mindrlhf-<stage>`` in this process; returns its exit code."""
    import importlib

    return importlib.import_module(f"mindrlhf.{stage}").main(argv)


def child_run(stage: str, argv: List[str]) -> subprocess.CompletedProcess:
    """``mindrlhf-<stage>`` in a child process (its compiled graphs are not kept in this one)."""
    from grpo_runs import launch_env

    return subprocess.run([sys.executable, "-m", f"mindrlhf.{stage}", *map(str, argv)], cwd=REPO, env=launch_env(),
                          capture_output=True, text=True, timeout=900)


def child_start(stage: str, argv: List[str], log: Path) -> subprocess.Popen:
    """``mindrlhf-<stage>`` started in a child process that runs on while the test goes on (stderr into ``log``)."""
    from grpo_runs import launch_env

    with open(log, "w") as err:
        return subprocess.Popen([sys.executable, "-m", f"mindrlhf.{stage}", *map(str, argv)], cwd=REPO,
                                env=launch_env(), stdout=subprocess.DEVNULL, stderr=err)


def stopped_holding_the_lock(proc: subprocess.Popen, folder: Path, log: Path, timeout: float = 300) -> None:
    """Wait until ``proc`` holds ``folder``'s run lock (its PID in the lock file), then stop it there (SIGSTOP), so
    a second launch meets the folder in use however fast the first one would have finished."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if json.loads((folder / LOCK_FILE).read_text())["pid"] == proc.pid:
                os.kill(proc.pid, signal.SIGSTOP)
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"{proc.args} did not lock {folder} in {timeout} s")


def snapshot(folder: Path) -> Dict[str, str]:
    """relative path -> md5 of every file under ``folder``."""
    return {str(p.relative_to(folder)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(capsys) -> str:
    """The one error line a refused command printed."""
    err = capsys.readouterr().err.strip().splitlines()
    lines = [line for line in err if line.startswith("error: ")]
    assert len(lines) == 1, err[-5:]
    return lines[0]


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory) -> Dict[str, Path]:
    """Each stage's one-step run (output_dir), with its checkpoint at step 1."""
    root = tmp_path_factory.mktemp("stage_runs")
    out = {}
    for stage in STAGES:  # in child processes: their compiled graphs would stay in this one (~2.3 GiB)
        out[stage] = root / stage
        proc = child_run(stage, stage_argv(stage, assets, out[stage]))
        assert proc.returncode == 0, proc.stderr[-3000:]
        (root / f"{stage}.log").write_text(proc.stderr)  # beside the run, not in it
        assert (out[stage] / "checkpoints" / "step_00000001" / "manifest.json").is_file()
    return out


#: The stages probed for LoRA and evaluation-input rules: every stage with LoRA (ORPO too). The rules are the
#: Trainer's, one code path for all stages: CI probes an offline stage, DPO (its reference) and GRPO (a rollout);
#: RM, PPO and ORPO are probed by hand.
LORA_STAGES = ("sft", "dpo", "grpo",
               *(byhand(s, "sft, dpo and grpo probe the same rule") for s in ("rm", "ppo", "orpo")))


class _LazyRuns(dict):
    """stage -> its one-step run folder, each trained (in a child process) the first time a test asks for it, so a
    stage whose probes do not run costs nothing."""

    def __init__(self, build, given=None):
        super().__init__(given or {})
        self._build = build

    def __missing__(self, stage: str) -> Path:
        self[stage] = self._build(stage)
        return self[stage]


@pytest.fixture(scope="module")
def every_run(runs, assets, tmp_path_factory) -> Dict[str, Path]:
    """``runs`` and ORPO's one-step full run, for the probes of the rules ORPO shares."""
    def build(stage: str) -> Path:
        out = tmp_path_factory.mktemp(f"{stage}_run") / stage
        proc = child_run(stage, stage_argv(stage, assets, out))
        assert proc.returncode == 0, proc.stderr[-3000:]
        return out

    return _LazyRuns(build, runs)


@pytest.fixture(scope="module")
def lora_runs(assets, tmp_path_factory) -> Dict[str, Path]:
    """Each stage's one-step LoRA run (rank 4, alpha 8, every projection), with its checkpoint at step 1."""
    root = tmp_path_factory.mktemp("lora_runs")

    def build(stage: str) -> Path:
        out = root / stage
        proc = child_run(stage, stage_argv(stage, assets, out, lora_rank=4, lora_alpha=8))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (out / "checkpoints" / "step_00000001" / "adapter_config.json").is_file()
        return out

    return _LazyRuns(build)


#: A resume's LoRA change, and the part of the one-line refusal that names it.
LORA_CHANGES = {
    "targets": ({"lora_target_modules": ["q_proj", "v_proj"]}, "lora_target_modules down_proj gate_proj k_proj o_proj "
                "q_proj up_proj v_proj (14 projections) -> q_proj v_proj (4 projections)"),
    "alpha": ({"lora_alpha": 64}, "lora_alpha 8 -> 64"),
    "rank": ({"lora_rank": 8}, "lora_rank 4 -> 8"),
}


@pytest.mark.slow
@pytest.mark.parametrize("stage", LORA_STAGES)
def test_a_lora_resume_keeps_its_settings_and_a_finished_one_writes_nothing(lora_runs, every_run, assets, capsys,
                                                                            caplog, stage):
    """A LoRA --resume with other lora_target_modules rewrote the run's adapter with 8 tensors instead of 28 (later
    checkpoints dropped the other factors), with another lora_alpha it rewrote adapter_config.json over factors
    trained at the old alpha, and a resume that trained nothing still rewrote config.yaml and adapter/. Now each
    change is one line naming the field, a LoRA <-> full mismatch names --lora_rank, and a resume of a finished run
    (same settings) changes no file."""
    import logging

    out = lora_runs[stage]
    before = snapshot(out)
    step = out / "checkpoints" / "step_00000001"
    lora = {"lora_rank": 4, "lora_alpha": 8}
    for change, said in LORA_CHANGES.values():
        capsys.readouterr()
        assert run_stage(stage, stage_argv(stage, assets, out, resume="latest", **{**lora, **change})) == 2
        assert refused(capsys) == (f"error: --resume {step}: the run's adapters were trained with other LoRA settings "
                                   f"({said}); a resumed run keeps them: pass the run's values (its config.yaml), or "
                                   f"start a new run in another --output_dir")
        assert snapshot(out) == before
    assert run_stage(stage, stage_argv(stage, assets, out, resume="latest")) == 2
    assert refused(capsys) == (f"error: --resume {step}: the run trained LoRA adapters (rank 4, alpha 8), and this "
                               f"launch is a full fine-tune; pass --lora_rank 4 --lora_alpha 8 to continue it, or "
                               f"start a new run in another --output_dir")
    full = every_run[stage]
    full_before = snapshot(full)
    assert run_stage(stage, stage_argv(stage, assets, full, resume="latest", **lora)) == 2
    assert refused(capsys) == (f"error: --resume {full / 'checkpoints' / 'step_00000001'}: the run is a full "
                               f"fine-tune, and this launch trains LoRA adapters (lora_rank 4); drop --lora_rank and "
                               f"--lora_init_from to continue it, or start a new run in another --output_dir")
    assert snapshot(full) == full_before
    with caplog.at_level(logging.WARNING):  # the same settings at the run's end: nothing to train, nothing written
        assert run_stage(stage, stage_argv(stage, assets, out, resume="latest", seed=7, **lora)) == 0
    assert any("already reached --max_steps 1; nothing to train" in r.getMessage() for r in caplog.records)
    assert snapshot(out) == before


@pytest.mark.slow
def test_a_lora_resume_with_another_dropout_is_warned(lora_runs, assets, tmp_path, caplog):
    """DPO resumed with lora_dropout 0 -> 0.3 said nothing; the factors are the same, the masks from here on not."""
    import logging

    out = tmp_path / "dpo"
    shutil.copytree(lora_runs["dpo"], out)
    with caplog.at_level(logging.WARNING):
        assert run_stage("dpo", stage_argv("dpo", assets, out, resume="latest", max_steps=2, lora_rank=4,
                                           lora_alpha=8, lora_dropout=0.3)) == 0
    assert any(f"--resume {out / 'checkpoints' / 'step_00000001'}: lora_dropout 0 -> 0.3: the same adapters train on "
               "with another dropout" in r.getMessage() for r in caplog.records)
    assert _steps(out) == [1, 2]


def _steps(out: Path) -> List[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_second_launch_into_a_folder_in_use_is_refused_before_it_writes(assets, tmp_path):
    """Two launches into one output_dir mixed their runs: the second rewrote run.json and config.yaml and appended
    its rows to the first run's metrics (steps 1, 2, 1, 3), and two concurrent --resume launches both trained steps
    3 and 4. The first launch now holds the folder's lock; a second one, fresh or resumed, is one line naming the
    holder and changes no file; a holder killed with SIGKILL leaves its lock file but not the lock."""
    out = tmp_path / "sft"
    argv = stage_argv("sft", assets, out, max_steps=2, seed=1)
    first = child_start("sft", argv, tmp_path / "first.log")
    stopped_holding_the_lock(first, out, tmp_path / "first.log")
    holder = f"is in use by another run (pid {first.pid} on host {socket.gethostname()} since "
    try:
        before = snapshot(out)
        second = child_run("sft", stage_argv("sft", assets, out, max_steps=2, seed=2, lr=5e-4))
        assert second.returncode == 2, second.stderr[-3000:]
        (line,) = [x for x in second.stderr.splitlines() if x.startswith("error: ")]
        assert line.startswith(f"error: --output_dir {out} {holder}") and ": sft.py --model " in line, line
        assert line.endswith("; wait for it to end, or choose another --output_dir"), line
        assert snapshot(out) == before
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert first.wait(timeout=600) == 0, (tmp_path / "first.log").read_text()[-3000:]
    assert _steps(out) == [1, 2] and yaml.safe_load((out / "config.yaml").read_text())["train"]["seed"] == 1
    assert not (out / LOCK_FILE).exists()  # a run that ends removes it

    # Two resumes of the finished run to step 4: the second is refused while the first runs.
    resumed = stage_argv("sft", assets, out, max_steps=4, seed=1, resume="latest")
    third = child_start("sft", resumed, tmp_path / "third.log")
    stopped_holding_the_lock(third, out, tmp_path / "third.log")
    before = snapshot(out)
    fourth = child_run("sft", resumed)
    assert fourth.returncode == 2 and f"error: --output_dir {out} is in use by another run (pid {third.pid} " in \
        fourth.stderr, fourth.stderr[-3000:]
    assert snapshot(out) == before
    # The holder dies without a word (SIGKILL while stopped): its lock file stays, the lock went with it.
    os.kill(third.pid, signal.SIGKILL)
    third.wait(timeout=60)
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == third.pid
    fifth = child_run("sft", resumed)
    assert fifth.returncode == 0, fifth.stderr[-3000:]
    assert _steps(out) == [1, 2, 3, 4] and not (out / LOCK_FILE).exists()


@pytest.mark.slow
def test_each_run_knows_its_stage_and_models(runs, assets):
    """run.json, every checkpoint's manifest and state.json name the stage; state.json records each input model
    by path and checksum (the default as '')."""
    from mindrlhf.checkpoint.manifest import sha256_file

    for stage, out in runs.items():
        step = out / "checkpoints" / "step_00000001"
        assert json.loads((out / "run.json").read_text())["stage"] == stage
        assert json.loads((step / "manifest.json").read_text())["stage"] == stage
        state = json.loads((step / "state.json").read_text())
        assert state["stage"] == stage
        trained = state["models"][MODEL_FLAG[stage]]
        assert trained["path"] == str(Path(assets["model"]).resolve())
        assert trained["files"]["model.safetensors"]["sha256"] == sha256_file(Path(assets["model"]) /
                                                                               "model.safetensors")
    assert json.loads((runs["dpo"] / "checkpoints" / "step_00000001" / "state.json").read_text())["models"][
        "--ref_model"] == {"path": ""}
    assert set(json.loads((runs["ppo"] / "checkpoints" / "step_00000001" / "state.json").read_text())["models"]) == {
        "--model", "--ref_model", "--reward_model", "--critic_model"}


@pytest.mark.slow
def test_the_last_line_names_every_output_and_the_next_command(runs):
    """The run's last line named only metrics.jsonl; it names the checkpoint, plots, TensorBoard events and
    completion dumps the run wrote, and the command to run next on the checkpoint."""
    for stage, out in runs.items():
        last = (out.parent / f"{stage}.log").read_text().strip().splitlines()[-1]
        step = out / "checkpoints" / "step_00000001"
        assert "done: 1 steps, last " in last, last
        assert f"; in {out}: metrics.jsonl, checkpoints/step_00000001 (the model), " in last, last
        pngs = sorted(p.name for p in out.glob("*.png"))
        assert pngs and all(name in last for name in pngs), last
        if stage == "rm":
            assert last.endswith(f"use it as PPO's reward model: mindrlhf-ppo --reward_model {step}, or export it: "
                                 f"mindrlhf-convert-weight --reverse --input_path {step}/policy.ckpt --output_path DIR")
        else:
            assert last.endswith(f"; evaluate it: mindrlhf-eval --model {step}"), last
        if stage in ("grpo", "ppo"):
            assert "1 completions_step_N.jsonl (the last completions_step_1.jsonl)" in last, last


@pytest.mark.slow
def test_the_last_steps_completions_are_dumped(runs):
    """`completions_step_N.jsonl` appeared only every log_completions_steps (10) steps, so a short run had
    none; the last step's are written too."""
    for stage in ("grpo", "ppo"):
        rows = [json.loads(line) for line in (runs[stage] / "completions_step_1.jsonl").read_text().splitlines()]
        assert rows and all(row["completion"] is not None for row in rows), stage


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_a_resume_of_another_stages_run_is_refused(runs, assets, tmp_path, capsys, stage):
    """`mindrlhf-dpo --output_dir <an SFT run> --resume` loaded the SFT checkpoint as its policy,
    appended to its metrics, overwrote its config.yaml and exited 0 (PPO in a DPO run died with a raw ValueError).
    Now, for every other stage's run: --resume latest into its output_dir, and --resume of its checkpoint folder
    into a new output_dir, are one line each, and the other run is unchanged."""
    for other in STAGES:
        if other == stage:
            continue
        before = snapshot(runs[other])
        capsys.readouterr()
        assert run_stage(stage, stage_argv(stage, assets, runs[other], resume="latest")) == 2
        assert refused(capsys) == (f"error: --resume: --output_dir {runs[other]} holds a {other} run (mindrlhf-"
                                   f"{other}); mindrlhf-{stage} cannot continue it: choose another --output_dir")
        step = runs[other] / "checkpoints" / "step_00000001"
        fresh = tmp_path / f"from_{other}"
        assert run_stage(stage, stage_argv(stage, assets, fresh, resume=step)) == 2
        assert refused(capsys) == (f"error: --resume {step}: a checkpoint of a {other} run (mindrlhf-{other}); "
                                   f"mindrlhf-{stage} cannot continue it: to start {stage} from its weights pass "
                                   f"{MODEL_FLAG[stage]} {step} without --resume, with another --output_dir")
        assert snapshot(runs[other]) == before
        assert not fresh.exists()  # the refused start left no folder behind


def _changed_copy(model: Path, dest: Path, change: bool) -> Path:
    """A copy of an HF model folder; with ``change``, one weight byte differs (same size)."""
    shutil.copytree(model, dest)
    if change:
        weights = dest / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-3] ^= 0x01
        weights.write_bytes(bytes(data))
    return dest


#: The model each stage's probe changes on resume: DPO's reference (the issue's silent 0.6394 vs 0.6586 loss), PPO's
#: reward model, the trained model's start for the others.
CHANGED = {"sft": "--model", "rm": "--model", "dpo": "--ref_model", "ppo": "--reward_model",
           "grpo": "--sft_path_train"}


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_a_resume_with_another_model_is_refused(runs, assets, tmp_path, capsys, stage):
    """A resume with another --model / --ref_model / --reward_model changed the run silently. Each
    stage now refuses it in one line naming the flag, the run's model and the new one, and the run is unchanged."""
    flag = CHANGED[stage]
    source = assets["rm"] if flag == "--reward_model" else assets["model"]
    other = _changed_copy(source, tmp_path / "other", change=True)
    before = snapshot(runs[stage])
    step = runs[stage] / "checkpoints" / "step_00000001"
    capsys.readouterr()
    assert run_stage(stage, stage_argv(stage, assets, runs[stage], resume="latest", **{flag[2:]: other})) == 2
    line = refused(capsys)
    assert line.startswith(f"error: --resume {step}: {flag} differs from the run's: it trained with ")
    assert f"now {other.resolve()} (sha256 " in line and "a resumed run reads the same models" in line
    assert snapshot(runs[stage]) == before


@pytest.mark.slow
def test_a_resume_with_a_moved_copy_of_the_model_continues(runs, assets, tmp_path, caplog):
    """The same weights at another path are the same model: the resume goes on (to max_steps 1: nothing left to
    train) and the checkpoint's record is checked by content, not by path."""
    import logging

    out = tmp_path / "sft"
    shutil.copytree(runs["sft"], out)
    moved = _changed_copy(assets["model"], tmp_path / "moved", change=False)
    with caplog.at_level(logging.WARNING):
        assert run_stage("sft", stage_argv("sft", assets, out, resume="latest", model=moved)) == 0
    assert any("already reached --max_steps 1" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_output_inside_an_input_model_is_refused(assets, tmp_path, capsys, stage):
    """SFT and GRPO wrote their run into the input model's folder when --output_dir was (inside) it.
    Every stage now refuses it, before anything is written there."""
    model = _changed_copy(assets["model"], tmp_path / "model", change=False)
    before = snapshot(model)
    capsys.readouterr()
    argv = stage_argv(stage, assets, model / "run", **{MODEL_FLAG[stage][2:]: model})
    assert run_stage(stage, argv) == 2
    assert refused(capsys) == (f"error: --output_dir {model / 'run'} is inside the input model folder {model} "
                               f"({MODEL_FLAG[stage]} {model}); a run never writes into its inputs: choose a "
                               f"--output_dir outside it")
    assert snapshot(model) == before and not (model / "run").exists()


@pytest.mark.slow
def test_a_damaged_checkpoint_is_never_read(runs, assets, tmp_path, capsys):
    """Checksums were checked only by --resume: a policy.ckpt with one flipped bit was trained from
    (--model), evaluated, converted and resharded without a word. Each is now one line naming the damage."""
    from mindrlhf.evaluation.gsm8k_eval import main as evaluate
    from mindrlhf.tools.convert_weight import main as convert
    from mindrlhf.tools.transform_checkpoint import main as transform

    step = tmp_path / "step_00000001"
    shutil.copytree(runs["sft"] / "checkpoints" / "step_00000001", step)
    policy = step / "policy.ckpt"
    data = bytearray(policy.read_bytes())
    data[len(data) // 2] ^= 0x10
    policy.write_bytes(bytes(data))
    damaged = f"{policy}: the checkpoint is damaged (policy.ckpt checksum mismatch against {step / 'manifest.json'})"
    capsys.readouterr()
    for stage in ("dpo", "rm"):
        assert run_stage(stage, stage_argv(stage, assets, tmp_path / stage, model=step)) == 2
        assert refused(capsys).startswith(f"error: {damaged}")
    assert evaluate(["--model", str(step), "--limit", "1", "--output", str(tmp_path / "eval.jsonl")]) == 2
    assert refused(capsys).startswith(f"error: {damaged}")
    assert convert(["--reverse", "--input_path", str(policy), "--output_path", str(tmp_path / "hf"),
                    "--no_progress"]) == 2
    assert refused(capsys).startswith(f"error: {damaged}")
    assert transform(["--src_checkpoint", str(policy), "--dst_checkpoint", str(tmp_path / "tp2"), "--layout",
                      "1,2,1"]) == 2
    assert refused(capsys).startswith(f"error: {damaged}")
    assert not any((tmp_path / name).exists() for name in ("dpo", "rm", "eval.jsonl", "hf", "tp2"))


@pytest.mark.slow
@pytest.mark.parametrize("stage,bad", [("sft", {"train_file": "missing.jsonl"}),
                                       ("dpo", {"valid_file": "missing.jsonl"}), ("rm", {"model": "no_such_model"}),
                                       ("ppo", {"reward_model": "no_such_model"}),
                                       ("rm", {"train_file": "bad.jsonl", "strict": "true"})])
def test_a_failed_start_leaves_no_empty_folders(assets, tmp_path, capsys, stage, bad):
    """A start that failed on a missing data file or model, or a bad row under --strict, left an empty
    checkpoints/ folder."""
    bad = {k: tmp_path / v if k != "strict" else v for k, v in bad.items()}
    (tmp_path / "bad.jsonl").write_text(Path(assets["pairs"]).read_text() + "{not json\n")
    out = tmp_path / "out"
    capsys.readouterr()
    assert run_stage(stage, stage_argv(stage, assets, out, **bad)) == 2
    assert str(next(iter(bad.values()))) in refused(capsys)
    assert not out.exists()


# -- bad rows named ------------------------------------------------------------------------------------------
def _message(role: str, content: str) -> list:
    return [{"role": role, "content": content}]


def _data(stage: str, rows: list) -> tuple:
    """(train lines, valid lines, {train line: reason} of the named bad rows, {valid line: reason}) of ``stage``:
    conversational rows from the packaged GSM8K sample, 8 good train rows and 2 good valid rows, with bad ones
    between them."""
    if stage == "sft":
        good = [{"messages": _message("user", r["question"]) + _message("assistant", r["answer"])} for r in rows]
        bad = {"malformed_json": '{"messages": [{"role": "user", "content": "unterminated"',
               "missing_field": json.dumps({"prompt": "a prompt, and no messages"}),
               "unknown_role": json.dumps({"messages": _message("wizard", "abracadabra")
                                           + _message("assistant", "poof")})}
    else:
        good = [{"prompt": _message("user", r["question"]), "chosen": _message("assistant", r["answer"]),
                 "rejected": _message("assistant", r["answer"].replace("####", "#### 1"))} for r in rows]
        same = _message("assistant", rows[0]["answer"])
        bad = {"malformed_json": '{"prompt": [{"role": "user", "content": "unterminated"',
               "missing_field": json.dumps({"prompt": _message("user", "q"), "chosen": _message("assistant", "a")}),
               "unknown_role": json.dumps({"prompt": _message("wizard", "q"), "chosen": _message("assistant", "a"),
                                           "rejected": _message("assistant", "b")}),
               "identical_pair": json.dumps({"prompt": _message("user", "q"), "chosen": same, "rejected": same})}
    lines, named = [json.dumps(good[0]), json.dumps(good[1])], {}
    for reason, line in bad.items():
        lines.append(line)
        named[len(lines)] = reason
    lines += ["not json at all"] * FILLER + [json.dumps(g) for g in good[2:8]]
    valid = [json.dumps(good[8]), bad["unknown_role"], json.dumps(good[9])]
    return lines, valid, named, {2: "unknown_role"}


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["sft", "dpo", byhand("rm", "dpo reads its pairs through the same reader")])
def test_every_skipped_row_is_named_in_the_log_and_listed_in_output_dir(stage, assets, tmp_path):
    """Mindrlhf-sft/-rm/-dpo counted skipped rows but never named them (the readers kept each one's
    file, line and reason). The log names the first SKIPPED_ROWS_LOGGED of each file and counts the rest,
    output_dir/skipped_rows.jsonl lists all of them, and training goes on with the good rows."""
    model_dir = assets["model"]
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[:10]]
    train_lines, valid_lines, named, valid_named = _data(stage, rows)
    train, valid = tmp_path / "train.jsonl", tmp_path / "valid.jsonl"
    train.write_text("\n".join(train_lines) + "\n", encoding="utf-8")
    valid.write_text("\n".join(valid_lines) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    args = {"model": model_dir, "train_file": train, "valid_file": valid, "output_dir": out, "max_steps": 1,
            "batch_size": 4, "micro_batch_size": 2, "max_length": 512, "save_steps": 1, "seed": 3,
            "progress_bar": "false", **SUITE_RECOMPUTE}
    proc = child_run(stage, _flags(args))
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stderr

    # The log: each named bad row by file:line and reason, in file order, then a count of the rest.
    bad_lines = sorted(named) + list(range(len(named) + 3, len(named) + 3 + FILLER))
    for line, reason in named.items():
        assert f"{train}:{line}: skipped ({REASONS[reason]}): " in log, (line, reason, log[-3000:])
    shown = [n for n in bad_lines if f"{train}:{n}: skipped (" in log]
    assert shown == bad_lines[:SKIPPED_ROWS_LOGGED]
    listing = out / SKIPPED_ROWS_FILE
    more = len(bad_lines) - SKIPPED_ROWS_LOGGED
    assert f"... and {more} more (all in {listing})" in log
    key = "messages" if stage == "sft" else "prompt"
    assert f"{valid}:2: skipped ({REASONS['unknown_role']}): '{key}'[0] has role 'wizard'" in log
    if stage != "sft":
        assert "chosen and rejected are the same" in log
    kept = "8 kept (8 pairs)" if stage != "sft" else "8 kept"
    assert f"train_file: {train}: {len(train_lines)} rows read, {kept}, {len(bad_lines)} skipped" in log

    # The file: every skipped row of both files, as JSON objects, in the order they were read.
    listed = [json.loads(line) for line in listing.read_text(encoding="utf-8").splitlines()]
    assert [(r["path"], r["line"]) for r in listed] == [(str(train), n) for n in bad_lines] + [(str(valid), 2)]
    assert {r["line"]: r["reason"] for r in listed if r["path"] == str(train) and r["line"] in named} == named
    assert all(r["reason"] == "malformed_json" for r in listed[len(named):-1])
    assert listed[-1]["reason"] == valid_named[2] and "'wizard'" in listed[-1]["detail"]
    assert all(set(r) == {"path", "line", "reason", "detail"} and r["detail"] for r in listed)

    # Training went on with the good rows (and evaluated on the valid file's two good rows).
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1] and any(k.startswith("eval/") for k in metrics[-1])

    if stage == "sft":  # (once: the rule is OfflineTrainer's) a replacing run removes the listing, then writes its own
        train.write_text("\n".join(line for n, line in enumerate(train_lines, 1) if n not in bad_lines) + "\n",
                         encoding="utf-8")
        proc = child_run(stage, _flags(dict(args, overwrite_output_dir="true")))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert SKIPPED_ROWS_FILE in proc.stderr.split("removed the previous run from")[1].splitlines()[0]
        assert [json.loads(line)["path"] for line in listing.read_text().splitlines()] == [str(valid)]


def test_the_listing_is_a_run_output_that_overwrite_removes(tmp_path):
    """skipped_rows.jsonl belongs to the run: --overwrite_output_dir removes it with the run's other outputs
    (the new run then writes its own when training starts)."""
    assert SKIPPED_ROWS_FILE in RUN_OUTPUTS
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / SKIPPED_ROWS_FILE).write_text('{"path": "old.jsonl", "line": 3}\n')
    removed = clear_previous_run(out, out / "checkpoints")
    assert out / SKIPPED_ROWS_FILE in removed and not (out / SKIPPED_ROWS_FILE).exists()


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["grpo", byhand("ppo", "grpo reads prompt rows through the same reader")])
def test_every_skipped_prompt_row_is_named_too(stage, assets, tmp_path):
    """The prompt JSONL files of the RL stages follow the same rules: bad rows named in the log and listed in
    output_dir/skipped_rows.jsonl, training on the good ones."""
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[:4]]
    good = [json.dumps({"prompt": _message("user", r["question"]), "answer": r["answer"]}) for r in rows]
    bad = {"malformed_json": '{"prompt": [{"role": "user"', "missing_field": json.dumps({"answer": "#### 1"}),
           "unknown_role": json.dumps({"prompt": _message("wizard", "q"), "answer": "#### 1"})}
    lines = good[:2] + list(bad.values()) + good[2:]
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    key = "mind_dataset_dir" if stage == "grpo" else "train_file"
    proc = child_run(stage, stage_argv(stage, assets, out, **{key: data}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line, reason in zip((3, 4, 5), bad):
        assert f"{data}:{line}: skipped ({REASONS[reason]}): " in proc.stderr, (reason, proc.stderr[-3000:])
    listed = [json.loads(line) for line in (out / SKIPPED_ROWS_FILE).read_text().splitlines()]
    assert [(r["path"], r["line"], r["reason"]) for r in listed] == [(str(data), n, r) for n, r in zip((3, 4, 5), bad)]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]


def test_overwrite_removes_the_previous_runs_adapter_folders(tmp_path):
    """--overwrite_output_dir left the previous LoRA run's adapter/ and critic_adapter/ behind (RUN_OUTPUTS did not
    name them), so `mindrlhf-eval --model o/adapter` evaluated the previous run after a full fine-tune replaced it."""
    out = tmp_path / "out"
    for folder in ("adapter", "critic_adapter"):
        (out / folder).mkdir(parents=True)
        (out / folder / "adapter_config.json").write_text("{}\n")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "notes.txt").write_text("the user's own file\n")
    removed = clear_previous_run(out, out / "checkpoints")
    assert {out / "adapter", out / "critic_adapter", out / "metrics.jsonl"} <= set(removed)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def _flip(path: Path) -> None:
    """One bit of ``path`` flipped in its middle (same size)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_a_damaged_adapter_or_another_base_is_never_used_in_silence(lora_runs, assets, tmp_path, capsys, caplog):
    """A bit-flipped checkpoints/step_N/adapter_model.safetensors was evaluated, merged and trained from with rc 0
    (the adapter reader never checked the manifest), and an adapter was applied to another base of the same shapes
    although the checkpoint's state.json records its base's checksum. Now damage is one line for each; another base
    is one line where the adapter's recorded base changed under it, and a warning where the user named the base."""
    import logging

    from mindrlhf.evaluation.gsm8k_eval import main as evaluate
    from mindrlhf.tools.convert_weight import main as convert

    step = tmp_path / "step_00000001"
    shutil.copytree(lora_runs["sft"] / "checkpoints" / "step_00000001", step)
    weights = step / "adapter_model.safetensors"
    _flip(weights)
    damaged = (f"error: {weights}: the checkpoint is damaged (adapter_model.safetensors checksum mismatch against "
               f"{step / 'manifest.json'})")
    capsys.readouterr()
    assert evaluate(["--model", str(step), "--limit", "1"]) == 2
    assert refused(capsys).startswith(damaged)
    assert convert(["--reverse", "--input_path", str(assets["model"]), "--adapter", str(step), "--output_path",
                    str(tmp_path / "merged"), "--no_progress"]) == 2
    assert refused(capsys).startswith(damaged)
    assert run_stage("sft", stage_argv("sft", assets, tmp_path / "again", lora_init_from=step)) == 2
    assert refused(capsys).startswith(damaged)
    assert not any((tmp_path / name).exists() for name in ("merged", "again"))

    # Another base of the same shapes: a LoRA run on a copy of the model, whose weights then change.
    base = _changed_copy(assets["model"], tmp_path / "base", change=False)
    out = tmp_path / "on_copy"
    proc = child_run("sft", stage_argv("sft", assets, out, model=base, lora_rank=4))
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = out / "checkpoints" / "step_00000001"
    _flip(base / "model.safetensors")
    capsys.readouterr()
    assert evaluate(["--model", str(step), "--limit", "1"]) == 2
    line = refused(capsys)
    sha, here, real = r"\(sha256 [0-9a-f]{12}\)", re.escape(str(base)), re.escape(str(base.resolve()))
    assert re.fullmatch(rf"error: the adapters in {re.escape(str(step))} were trained on {real} {sha}, and {here} now "
                        rf"holds another model \({real} {sha}\); restore the base they were trained on, or pass "
                        rf"--base_model to apply them to another model", line), line
    asked = "is another model ("
    with caplog.at_level(logging.WARNING):
        assert evaluate(["--model", str(step), "--base_model", str(base), "--limit", "1"]) == 0
        assert convert(["--reverse", "--input_path", str(base), "--adapter", str(step), "--output_path",
                        str(tmp_path / "merged"), "--no_progress"]) == 0
        assert run_stage("sft", stage_argv("sft", assets, tmp_path / "again", model=base, lora_init_from=step)) == 0
    warned = [r.getMessage() for r in caplog.records if f"the adapters in {step} were trained on " in r.getMessage()]
    assert [w.split(asked)[0].rsplit(", and ", 1)[1] for w in warned] == [
        f"--base_model {base} ", f"--input_path {base} ", f"--model {base} "], warned
    assert all(w.endswith("; applying them to it as asked") for w in warned)


#: The flags that make each stage evaluate its policy by generation at every step (four new tokens).
EVAL_FLAGS = {"sft": {"eval_generation": "true", "eval_max_new_tokens": 4, "eval_limit": 2},
              "dpo": {"eval_generation": "true", "eval_max_new_tokens": 4, "eval_limit": 2},
              "orpo": {"eval_generation": "true", "eval_max_new_tokens": 4, "eval_limit": 2},
              "grpo": {"eval_steps": 1, "eval_limit": 2}, "ppo": {"eval_steps": 1, "eval_limit": 2}}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [s if s != "orpo" else byhand(s, "dpo's evaluation is orpo's") for s in EVAL_FLAGS])
def test_a_bad_eval_input_fails_before_the_previous_run_is_replaced(every_run, assets, tmp_path, capsys, stage):
    """With --overwrite_output_dir true and a malformed --eval_file, the old run's checkpoints, config and metrics
    were removed, step 1 trained, then the first evaluation failed; --eval_num_generations 100000 was accepted and
    failed after step 1 allocating 61 GiB. Both are now one line before anything is removed or trained."""
    bad = tmp_path / "bad.jsonl"
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[:1]]
    bad.write_text(json.dumps({"question": rows[0]["question"], "answer": rows[0]["answer"]}) + "\n{not json\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"question": "How many?", "answer": "no final answer"}) + "\n")
    out = every_run[stage]
    before = snapshot(out)
    replace = {**EVAL_FLAGS[stage], "overwrite_output_dir": "true"}
    capsys.readouterr()
    assert run_stage(stage, stage_argv(stage, assets, out, eval_file=bad, **replace)) == 2
    assert refused(capsys).startswith(f"error: {bad} line 2: malformed JSON (")
    assert run_stage(stage, stage_argv(stage, assets, out, eval_file=empty, **replace)) == 2
    assert refused(capsys) == (f"error: eval_file {empty}: no question to evaluate (1 rows without a '#### N' final "
                               f"answer); give GSM8K-style question/answer rows, or '' for the packaged sample")
    assert run_stage(stage, stage_argv(stage, assets, out, eval_num_generations=100000, **replace)) == 2
    line = refused(capsys)
    assert re.fullmatch(r"error: eval_num_generations = 100000: the evaluation samples 2 questions x 100000 "
                        r"completions at once, whose KV cache alone needs at least [\d.]+ GiB, more than this "
                        r"worker's [\d.]+ GiB \(.*\); use at most \d+", line), line
    assert snapshot(out) == before


@pytest.mark.slow
def test_an_evaluation_that_fails_mid_run_keeps_the_step_it_follows(assets, tmp_path):
    """The evaluation ran inside the step, before its checkpoint and row were written, so an evaluation that failed
    (here: its file damaged after the start's check) lost the step. The step's row and checkpoint come first now."""
    from mindrlhf.checkpoint.manager import CheckpointManager
    from mindrlhf.errors import MindRLHFError
    from mindrlhf.sft import SFT
    from mindrlhf.trainer.entry import setup_runtime

    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(line + "\n" for line in GSM8K.read_text().splitlines()[:2]))
    out = tmp_path / "sft"
    cfg = SFT.parse(stage_argv("sft", assets, out, max_steps=2, save_steps=2, eval_file=questions,
                               **{**EVAL_FLAGS["sft"], "eval_steps": 1}))
    trainer = SFT.build(cfg, setup_runtime(cfg))
    trainer.check_inputs()
    questions.write_text("{not json\n")  # damaged while the run trains
    with pytest.raises(MindRLHFError, match=rf"^{questions} line 1: malformed JSON"):
        trainer.train()
    assert _steps(out) == [1]
    assert CheckpointManager(str(out / "checkpoints")).latest_complete()[0] == 1
