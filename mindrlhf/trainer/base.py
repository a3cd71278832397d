"""The training loop every stage shares: steps, metrics, progress bar, checkpoints and exact resume.

A stage (GRPO, SFT, RM, DPO, PPO) subclasses ``Trainer`` (the offline ones through ``trainer.offline``, the
rollout ones through ``trainer.rollout``) and writes ``train_one_step``; it adds its own state through the
hooks (``stage_state`` / ``load_stage_state`` for numbers in ``state.json``, ``extra_tensors`` (shards) or
``full_extra_tensors`` (whole on rank 0) /
``load_extra_tensors`` for tensors beside the model and the optimizer) and names the config groups that change
its math (``math_groups``). Checkpoints go through ``checkpoint.manager`` (atomic, checksummed, run-scoped)
and always hold full tensors, so a run resumes under any layout.
"""
from __future__ import annotations

import copy
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

import mindspore as ms
import yaml
from tqdm.auto import tqdm

from mindrlhf.checkpoint.hf_io import config_with_dtype
from mindrlhf.checkpoint.manager import CheckpointManager, load_parameters_into
from mindrlhf.checkpoint.run_dir import ADAPTER_DIR
from mindrlhf.data.report import (
    SKIPPED_ROWS_FILE,
    SKIPPED_ROWS_LOGGED,  # noqa: F401  (its old home: tests read it here)
    ConversionReport,
    log_report,
    write_skipped_rows,
)
from mindrlhf.errors import MindRLHFError
from mindrlhf.parallel import comm
from mindrlhf.parallel.groups import RunLayout, data_parallel_groups
from mindrlhf.parallel.layout import ParallelLayout
from mindrlhf.parallel.resharding import STATE_PREFIXES, assemble, load_full_into, model_names
from mindrlhf.tokenizer import TOKENIZER_FILES
from mindrlhf.trainer.metrics import Curve, MetricsLogger, console_line
from mindrlhf.trainer.schedule import lr_at
from mindrlhf.trainer.update import Updater
from mindrlhf.utils import faults

log = logging.getLogger(__name__)



def log_data_report(cfg, report: ConversionReport, what: str) -> ConversionReport:
    """On the main rank, log a data reader's ``report`` of the file given as ``what`` (``data.report.log_report``:
    its summary, its first skipped rows by name, where all are listed). Returns ``report``, for the trainer's
    ``data_reports``."""
    if comm.is_main():
        log_report(report, what, cfg.train.output_dir)
    return report


def recorded_path(identity: Optional[Dict[str, object]]) -> Optional[str]:
    """The folder an input model recorded in ``input_models`` was read from: its path, or for the packaged default
    (recorded as ``manifest.DEFAULT_MODEL``) the converted SmolLM2 folder it was loaded from, so an adapter trained
    on the default names a base that peft and ``mindrlhf-eval`` can load. ``None`` when nothing was recorded."""
    from mindrlhf.checkpoint.manifest import DEFAULT_MODEL

    if not identity or "path" not in identity:
        return None
    if identity["path"] == DEFAULT_MODEL:
        from mindrlhf.checkpoint.smollm2 import prepare_smollm2

        return str(prepare_smollm2())
    return str(identity["path"])


class Trainer:
    """Owns the trained model's updater, the run's id, step counters and checkpoints."""

    #: The stage's name (``trainer.entry.StageSpec.name``: recorded in checkpoints) and the progress bar's label.
    stage = "train"
    #: Config groups whose fields change what resumed steps compute (compared on resume).
    math_groups: Tuple[str, ...] = ("optimizer", "data")
    #: Further (group, field) pairs that change the math: the seed, the run length (``run_config``), the dtype.
    math_fields: Tuple[Tuple[str, str], ...] = (("train", "seed"), ("train", "max_steps"), ("model", "dtype"))
    #: The metric shown beside the progress bar.
    headline = "loss"
    #: Plots written beside metrics.jsonl with each checkpoint: (metric, file, title, y label).
    curves: Tuple[Curve, ...] = (("loss", "loss.png", "training loss", "loss"),)
    #: What a user runs next on the run's newest checkpoint folder (``{checkpoint}``); the last log line says it.
    next_command = "evaluate it: mindrlhf-eval --model {checkpoint}"
    #: The same for a LoRA run, whose output is an adapter folder: mindrlhf-eval applies it on its recorded base.
    lora_next_command = "evaluate it: mindrlhf-eval --model {adapter}"

    def __init__(self, cfg, *, model, updater: Updater, tokenizer, layout: Optional[RunLayout] = None,
                 total_steps: Optional[int] = None):
        self.cfg = cfg
        t = cfg.train
        self.model, self.updater, self.tokenizer = model, updater, tokenizer
        self.rank, self.world = comm.rank(), comm.world_size()
        if layout is None:
            dp = ParallelLayout(dp=self.world)
            layout = RunLayout(train=dp, infer=dp, groups=data_parallel_groups(self.rank, self.world),
                               infer_tp_group=None, rank=self.rank)
        self.layout = layout
        self.output_dir = Path(t.output_dir)
        if comm.is_main():
            self.output_dir.mkdir(parents=True, exist_ok=True)
        self.run_id = uuid.uuid4().hex[:12]  # a resumed run takes its checkpoint's
        self.ckpt = CheckpointManager(cfg.checkpoint_dir, t.keep_last, self.run_id, self.stage)
        #: Each input model's identity (``checkpoint.run_dir.identify_models``), recorded in every checkpoint.
        self.input_models: Dict[str, Dict[str, object]] = {}
        #: The reports of the data files the stage read as text rows (``log_data_report``): ``train`` lists every
        #: row they skipped in ``output_dir/skipped_rows.jsonl``.
        self.data_reports: List[ConversionReport] = []
        self.total_steps = int(total_steps if total_steps is not None else t.max_steps)
        self.step = 0
        self.consecutive_nonfinite = 0
        self.skipped_updates = 0

    # -- what a stage writes ------------------------------------------------------------------------
    def train_one_step(self) -> Dict[str, float]:
        """Run step ``self.step + 1``, advance ``self.step``; return its metrics."""
        raise NotImplementedError

    def stage_state(self) -> Dict[str, object]:
        """The stage's numbers to checkpoint in ``state.json`` (JSON values)."""
        return {}

    def load_stage_state(self, state: Mapping[str, object]) -> None:
        """Restore what ``stage_state`` returned."""

    def trained(self) -> List[Tuple[str, str, Updater]]:
        """Every model the stage trains, as ``(weights stem, optimizer stem, updater)``: checkpoints hold each
        one's float32 masters and optimizer state (full tensors) and resume restores them. The first is the
        model the checkpoint folder loads as (its config.json)."""
        return [("policy", "optimizer", self.updater)]

    def extra_tensors(self) -> Dict[str, Dict[str, ms.Parameter]]:
        """Further model-shaped tensors to checkpoint, by file stem (e.g. a re-synced reference): this rank's
        shards, assembled into full tensors when the model is sharded."""
        return {}

    def full_extra_tensors(self) -> Dict[str, Dict[str, object]]:
        """Further tensors to checkpoint that rank 0 already holds whole, by file stem (written as they are; e.g. a
        disaggregated run's weights in flight, which rank 0 assembled when it sent them); ``{}`` on the others."""
        return {}

    def load_extra_tensors(self, path: Path, state: Mapping[str, object]) -> None:
        """Load what ``extra_tensors`` saved (``self.load_tensors`` reads one file into this rank's shard)."""

    def after_load(self) -> None:
        """Called after a resume loaded the weights (e.g. to push them to a generator)."""

    def run_config(self):
        """The config as this run runs it: ``self.cfg`` (left as the user gave it) with ``train.max_steps`` the
        resolved run length (``total_steps``: max_steps, or the epochs' steps when an epochs field sets it). Saved
        as config.yaml in output_dir and every checkpoint, so running that file again gives the same length, and
        compared on resume (a checkpoint written before this method saved the same)."""
        cfg = copy.deepcopy(self.cfg)
        cfg.train.max_steps = self.total_steps
        return cfg

    def write_curves(self, logger: MetricsLogger) -> None:
        """Plots refreshed with each checkpoint (``curves``)."""
        logger.write_curves(self.curves)

    # -- shared pieces of a step --------------------------------------------------------------------
    def learning_rate(self) -> float:
        """The schedule's rate for the coming step (it advances once per training step)."""
        o = self.cfg.optimizer
        return lr_at(self.step, lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps,
                     total_steps=self.total_steps, schedule=o.lr_schedule)

    def count_nonfinite(self, res: Dict[str, float]) -> None:
        """The non-finite policy: a float16 overflow or a non-finite loss/gradient skipped the update;
        ``max_consecutive_nonfinite`` non-finite updates in a row stop the run."""
        if res["overflow"]:  # float16: the loss scale halves and the next update tries again
            self.skipped_updates += 1
            log.info("float16 gradients overflowed: update skipped, loss scale now %g", self.updater.loss_scale)
        elif res["skipped"]:
            self.skipped_updates += 1
            self.consecutive_nonfinite += 1
            limit = self.cfg.optimizer.max_consecutive_nonfinite
            log.warning("non-finite loss or gradient (loss=%s, grad_norm=%s): update skipped",
                        res["loss"], res["grad_norm"])
            if self.consecutive_nonfinite >= limit:
                raise MindRLHFError(
                    f"{self.consecutive_nonfinite} consecutive updates had non-finite loss/gradients "
                    f"(max_consecutive_nonfinite={limit}); lower lr, check the data, or use float32")
        else:
            self.consecutive_nonfinite = 0

    def update_metrics(self) -> Dict[str, float]:
        """The counters every stage logs after its own metrics."""
        out = {"skipped_updates": float(self.skipped_updates)}
        if self.updater.scaler is not None:
            out["loss_scale"] = self.updater.loss_scale
        return out

    # -- checkpoints ------------------------------------------------------------------------------
    @property
    def sharded(self) -> bool:
        """Whether the trained model is split over tensor/pipeline ranks."""
        return self.layout.train.tp * self.layout.train.pp > 1

    def _full_state(self, tensors: Dict[str, object], names: List[str], config=None,
                    shapes: Optional[Mapping[str, Tuple[int, ...]]] = None) -> Dict[str, object]:
        """Full tensors of a sharded state (of the model ``config`` describes, the trained model's by default;
        ``shapes``: ``resharding.assemble``'s), assembled on every rank (kept by rank 0 only)."""
        out = {}
        for name, full in assemble(tensors, names, config or self.model.config, self.layout.train, self.rank,
                                   shapes=shapes):
            if comm.is_main():
                out[name] = ms.Tensor(full)
        return out

    @staticmethod
    def _trained_shapes(model) -> Optional[Dict[str, Tuple[int, ...]]]:
        """The full shape of each tensor a checkpoint holds of trained ``model``: with LoRA its adapters and
        modules to save (``models.lora.adapter_shapes``), else ``None`` (the config's parameters)."""
        from mindrlhf.models.lora import adapter_shapes

        spec = getattr(model, "lora_spec", None)
        return adapter_shapes(model.config, spec) if spec is not None else None

    def _full_adapters(self, model=None) -> Optional[Dict[str, object]]:
        """LoRA on a tp/pp-sharded model: the whole adapters of ``model`` (default the policy; a collective, every
        rank calls it), for the PEFT folder rank 0 writes; ``None`` otherwise (the folder is written from the model
        itself)."""
        from mindrlhf.parallel.resharding import gather_adapter_weights

        if not (self.lora and self.sharded):
            return None
        return gather_adapter_weights(model if model is not None else self.model, self.layout.train, self.rank)

    def save_checkpoint(self) -> None:
        """Rank 0 writes the full (unsharded) state, so any layout can resume from it. Each trained model is
        stored as its float32 master weights, whatever the compute dtype."""
        tensors = {}
        for stem, optimizer_stem, updater in self.trained():
            masters, optimizer = updater.master_weights(), updater.optimizer_state()
            if self.sharded:  # a collective: every rank takes part
                config = updater.model.config
                shapes = self._trained_shapes(updater.model)
                names = list(shapes) if shapes is not None else model_names(config)
                masters = self._full_state(masters, names, config, shapes)
                moments = [p + n for p in STATE_PREFIXES for n in names]
                optimizer = dict(self._full_state(optimizer, moments, config, shapes),
                                 adam_step=optimizer["adam_step"])
            tensors[stem], tensors[optimizer_stem] = masters, optimizer
        extra = self.extra_tensors()
        if self.sharded:
            names = model_names(self.model.config)
            extra = {stem: self._full_state(params, names) for stem, params in extra.items()}
        adapters = self._full_adapters()
        if comm.is_main():
            tensors.update(extra)
            tensors.update(self.full_extra_tensors())
            state = {"step": self.step, "run_id": self.run_id, "stage": self.stage, "models": self.input_models,
                     "consecutive_nonfinite": self.consecutive_nonfinite,
                     "skipped_updates": self.skipped_updates, "world_size": self.world,
                     "recompute": {stem: updater.recompute for stem, _, updater in self.trained()},
                     **self.stage_state(), **self.updater.loss_scale_state()}
            self.ckpt.save(self.step, tensors, state, yaml.safe_dump(self.run_config().to_dict(), sort_keys=False),
                           files=self._model_files(adapters))
        # No rank starts the next step before the checkpoint is complete: msrun kills every worker of a
        # node when one dies, and rank 0 must not be taken down mid-write by a death in the next step.
        comm.barrier()

    @property
    def lora(self) -> bool:
        """Whether the trained model carries LoRA adapters (``models.lora``): then only they are trained and saved."""
        return getattr(self.model, "lora_spec", None) is not None

    def base_model(self) -> Optional[str]:
        """The trained model's input path as recorded (``input_models``; PEFT's ``base_model_name_or_path``)."""
        return recorded_path(next(iter(self.input_models.values()), None))

    def _model_files(self, adapters: Optional[Dict[str, object]] = None) -> Dict[str, object]:
        """config.json of the model and its tokenizer's files: a checkpoint folder is a loadable model. With LoRA
        it is a PEFT adapter folder instead (adapter_config.json + adapter_model.safetensors, no config.json: the
        base is not in it; state.json records the base's path and checksum); ``adapters``: ``_full_adapters``."""
        from mindrlhf.models.lora import adapter_files

        if self.lora:
            files: Dict[str, object] = dict(adapter_files(self.model, self.base_model(), adapters))
        else:
            config = config_with_dtype(self.model.config.to_hf_dict(), "float32")  # policy.ckpt holds the masters
            files = {"config.json": json.dumps(config, indent=2).encode("utf-8")}
        folder = Path(self.tokenizer.source)
        if folder.is_dir():
            files.update({name: folder / name for name in TOKENIZER_FILES if (folder / name).is_file()})
        return files

    def load_tensors(self, params: Dict[str, object], path: Path, config=None,
                     shapes: Optional[Mapping[str, Tuple[int, ...]]] = None) -> None:
        """Load a full checkpoint file into this rank's (possibly sharded) tensors of the model ``config``
        describes (the trained model's by default; ``shapes``: ``resharding.load_full_into``'s)."""
        if not self.sharded:
            load_parameters_into(params, path)
            return
        loaded = ms.load_checkpoint(str(path))
        load_full_into(params, ((n, p.asnumpy()) for n, p in loaded.items()), config or self.model.config,
                       self.layout.train, self.rank, source=str(path), shapes=shapes)

    def resume(self, path: Path) -> None:
        """Restore the run from checkpoint folder ``path`` (``checkpoint.run_dir.check_run_dirs`` found and
        verified it): weights, optimizer, counters and the stage's state; this run takes its run id."""
        path = Path(path)
        state = CheckpointManager.read_state(path)
        done, limit = int(state["step"]), self.total_steps
        if done > limit:
            raise MindRLHFError(f"--resume {path}: the checkpoint is at step {done}, past --max_steps {limit}; "
                                f"raise --max_steps to train on, or resume an earlier checkpoint")
        self.check_lora_resume(path)
        self.warn_config_changes(path)
        self.warn_recompute_change(path, state.get("recompute") or {})
        self.run_id = self.ckpt.run_id = str(state.get("run_id") or self.run_id)
        for stem, optimizer_stem, updater in self.trained():
            config, shapes = updater.model.config, self._trained_shapes(updater.model)
            self.load_tensors(updater.master_weights(), path / f"{stem}.ckpt", config, shapes)
            updater.refresh_weights()
            self.load_tensors(updater.optimizer_state(), path / f"{optimizer_stem}.ckpt", config, shapes)
        self.load_extra_tensors(path, state)
        self.step = done
        self.consecutive_nonfinite = int(state["consecutive_nonfinite"])
        self.skipped_updates = int(state["skipped_updates"])
        self.load_stage_state(state)
        self.updater.load_loss_scale_state(state)
        self.after_load()
        log.info("resumed from %s (step %d)", path, self.step)
        if self.step == limit:
            log.warning("--resume %s: the run already reached --max_steps %d; nothing to train (raise --max_steps "
                        "to train on)", path, limit)

    def check_lora_resume(self, path: Path) -> None:
        """A resume trains what the checkpoint trained: a full fine-tune's weights, or LoRA adapters of the same
        rank, alpha, rsLoRA and targets (other values would load factors trained under another scaling, or drop
        some: refused, naming the field); a changed ``lora_dropout`` keeps the factors and is warned about. PPO's
        critic takes the actor's settings, so the actor's adapter_config.json in the checkpoint speaks for both."""
        from mindrlhf.checkpoint.hf_io import read_json
        from mindrlhf.models.lora import ADAPTER_CONFIG, adapted_by, lora_modules, spec_from_peft

        saved_file, now = path / ADAPTER_CONFIG, getattr(self.model, "lora_spec", None)
        fresh = "or start a new run in another --output_dir"
        if not saved_file.is_file():
            if now is not None:
                raise MindRLHFError(f"--resume {path}: the run is a full fine-tune, and this launch trains LoRA "
                                    f"adapters (lora_rank {now.r}); drop --lora_rank and --lora_init_from to "
                                    f"continue it, {fresh}")
            return
        saved = spec_from_peft(read_json(saved_file), str(saved_file))
        if now is None:
            raise MindRLHFError(f"--resume {path}: the run trained LoRA adapters (rank {saved.r}, alpha "
                                f"{saved.alpha:g}), and this launch is a full fine-tune; pass --lora_rank {saved.r} "
                                f"--lora_alpha {saved.alpha:g} to continue it, {fresh}")
        changed = [f"{name} {was} -> {is_}" for name, was, is_ in (
            ("lora_rank", saved.r, now.r), ("lora_alpha", f"{saved.alpha:g}", f"{now.alpha:g}"),
            ("use_rslora", saved.use_rslora, now.use_rslora)) if was != is_]
        trained, adapted = adapted_by(self.model, saved), [name for name, _ in lora_modules(self.model)]
        if trained != adapted:
            def short(names: List[str]) -> str:
                kinds = sorted({n.rsplit(".", 1)[-1] for n in names})
                return " ".join(kinds) + f" ({len(names)} projections)"
            changed.append(f"lora_target_modules {short(trained)} -> {short(adapted)}")
        if changed:
            raise MindRLHFError(f"--resume {path}: the run's adapters were trained with other LoRA settings "
                                f"({'; '.join(changed)}); a resumed run keeps them: pass the run's values (its "
                                f"config.yaml), {fresh}")
        if saved.dropout != now.dropout:
            log.warning("--resume %s: lora_dropout %g -> %g: the same adapters train on with another dropout, so the "
                        "resumed steps are not what the original run would have computed", path, saved.dropout,
                        now.dropout)

    def warn_config_changes(self, path: Path) -> None:
        """Name every field that changes the math and differs from the checkpoint's config."""
        saved_path = path / "config.yaml"
        if not saved_path.is_file():
            return
        # regroup: a checkpoint written before a field moved group (the reward group) compares field by field.
        saved = type(self.cfg).regroup(yaml.safe_load(saved_path.read_text(encoding="utf-8")) or {})
        now = self.run_config().to_dict()
        keys = [(g, k) for g in self.math_groups for k in now.get(g, {})] + list(self.math_fields)
        changed = [f"{k} {saved[g][k]!r} -> {now[g][k]!r}" for g, k in keys
                   if k in saved.get(g, {}) and k in now.get(g, {}) and saved[g][k] != now[g][k]]
        if changed:
            log.warning("--resume: %s was trained with a different config: %s; the resumed steps will not be "
                        "what the original run would have computed", path, "; ".join(changed))

    def warn_recompute_change(self, path: Path, saved: Dict[str, str]) -> None:
        """``recompute auto`` decides again on resume, from this machine's memory: say so when it now decides
        otherwise than the checkpointed run did (the same math, summed in another order: equal to float
        rounding, not bit for bit)."""
        changed = [f"{stem} {saved[stem]} -> {updater.recompute}" for stem, _, updater in self.trained()
                   if saved.get(stem, updater.recompute) != updater.recompute]
        if changed:
            log.warning("--resume %s: recompute differs from the checkpointed run's (%s); the resumed steps equal "
                        "the original's to float rounding, not bit for bit (set recompute to the checkpoint's mode "
                        "to resume exactly)", path, "; ".join(changed))

    def finished(self, history: List[Dict[str, float]]) -> str:
        """The run's last log line: its steps and headline, every output it wrote, and what to run next."""
        out = self.output_dir
        found = self.ckpt.latest_complete(self.run_id)
        names = ["metrics.jsonl"]
        if found:
            where = found[1].relative_to(out) if found[1].is_relative_to(out) else found[1]
            names.append(f"{where} (the {'LoRA adapters' if self.lora else 'model'})")
        for folder, what in self.adapter_outputs():
            if (out / folder).is_dir():
                names.append(f"{folder}/ ({what})")
        names += sorted(p.name for p in out.glob("*.png"))
        if (out / "tensorboard").is_dir():
            names.append("tensorboard/")
        dumps = sorted(out.glob("completions_step_*.jsonl"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
        if dumps:
            names.append(f"{len(dumps)} completions_step_N.jsonl (the last {dumps[-1].name})")
        skipped = sum(len(report.skipped) for report in self.data_reports)
        if skipped:
            names.append(f"{SKIPPED_ROWS_FILE} ({skipped} rows)")
        line = (f"done: {self.step} steps, last {self.headline} {history[-1].get(self.headline, float('nan')):.4f}; "
                f"in {out}: {', '.join(names)}")
        if self.lora:
            target = out / ADAPTER_DIR if (out / ADAPTER_DIR).is_dir() else found[1] if found else None
            command = self.lora_next_command.format(adapter=target, base=self.base_model())
            return f"{line}; {command}" if target else line
        return f"{line}; {self.next_command.format(checkpoint=found[1])}" if found else line

    # -- the loop ---------------------------------------------------------------------------------
    def check_inputs(self) -> None:
        """Read and check what the run reads only later (an evaluation's questions), so that a bad input fails
        before a previous run is replaced or a step is trained (``entry.run_stage`` calls it after building)."""

    def evaluate_step(self) -> Dict[str, float]:
        """The evaluations due after the step just trained, as metrics of its row (none by default)."""
        return {}

    def train(self) -> List[Dict[str, float]]:
        """Run from ``self.step`` (0, or where ``resume`` left it) until ``total_steps``; checkpoints every
        ``save_steps`` and at the end."""
        t = self.cfg.train
        if self.step >= self.total_steps:  # a resume of a finished run: nothing to train, so nothing is written
            return []
        if self.data_reports and comm.is_main():
            # Written here, not as the rows are read: run_stage replaces a previous run (--overwrite_output_dir,
            # which removes its skipped_rows.jsonl with its other outputs) only after the trainer is built, and a
            # start that fails before that must leave the previous run's files as they were.
            write_skipped_rows(self.output_dir / SKIPPED_ROWS_FILE, self.data_reports)
        logger = MetricsLogger(self.output_dir, comm.is_main(), t.tensorboard, resume_step=self.step)
        history = []
        bar = tqdm(total=self.total_steps, initial=self.step, desc=self.stage.upper(), unit="step",
                   disable=not (t.progress_bar and comm.is_main()), dynamic_ncols=True)
        try:
            while self.step < self.total_steps:
                t0 = time.perf_counter()
                faults.enter_step(self.step + 1)
                metrics = self.train_one_step()
                metrics.setdefault("step_time", time.perf_counter() - t0)
                try:
                    metrics.update(self.evaluate_step())
                except MindRLHFError:
                    # An evaluation that fails (its data, its memory) must not lose the step it follows.
                    logger.log(self.step, metrics)
                    self.save_checkpoint()
                    raise
                history.append(metrics)
                if self.step % t.logging_steps == 0 or self.step == self.total_steps:
                    logger.log(self.step, metrics)
                    if comm.is_main():
                        bar.write(console_line(self.step, metrics))
                # The postfix first: update() redraws the bar, which then shows this step's headline.
                value = metrics.get(self.headline, float("nan"))
                bar.set_postfix({self.headline: f"{value:.3f}"}, refresh=False)
                bar.update(1)
                if (t.save_steps and self.step % t.save_steps == 0) or self.step == self.total_steps:
                    self.save_checkpoint()
                    self.write_curves(logger)
        finally:
            bar.close()
            logger.close()
            for _, _, updater in self.trained():
                updater.release_graphs()
        if self.lora:
            self.save_adapter()
        return history

    def adapter_outputs(self) -> List[Tuple[str, str]]:
        """LoRA: the adapter folders the run ends with (``save_adapter``), each with what it is, for ``finished``."""
        return [(ADAPTER_DIR, f"the PEFT adapter on {self.base_model()}")] if self.lora else []

    def save_adapter(self) -> Optional[Path]:
        """LoRA: the trained adapters as a PEFT adapter folder ``output_dir/adapter`` (``models.lora.save_adapter``;
        peft's ``PeftModel.from_pretrained(base, folder)`` loads it, ``--lora_init_from`` reads it). Every rank
        calls it (a tp/pp-sharded model's adapters are assembled with a collective); rank 0 writes, and returns the
        folder (``None`` elsewhere)."""
        from mindrlhf.models.lora import save_adapter

        adapters = self._full_adapters()
        if not comm.is_main():
            return None
        out = save_adapter(self.model, self.output_dir / ADAPTER_DIR, self.base_model(), adapters)
        log.info("LoRA adapter (PEFT format) written to %s", out)
        return out

