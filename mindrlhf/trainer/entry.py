"""What every training command does around its stage: parse, check the run's directories, set up the device and
the parallel groups, build the trainer (``load_policy``: the trainable model and its float32 masters;
``load_reference``: a frozen reference), resume, start the run's files, train, and turn a lost worker into one
line. A stage's command is ``run_cli(partial(run_stage, spec), argv)``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

import mindspore as ms
import numpy as np

from mindrlhf.checkpoint.manager import CheckpointManager
from mindrlhf.checkpoint.run_dir import check_run_dirs, clear_previous_run, identify_models
from mindrlhf.checkpoint.run_record import write_run_id
from mindrlhf.errors import MindRLHFError, WorkerLostError
from mindrlhf.parallel import comm
from mindrlhf.parallel.groups import RunLayout, init_run_layout
from mindrlhf.parallel.layout import ParallelLayout

log = logging.getLogger("mindrlhf")


@dataclass
class StageSpec:
    """A training command: its name (``mindrlhf-<name>``, recorded in its runs and checkpoints so no other
    stage continues them; equal to its trainer's ``stage``), how to read its config, which input models it
    reads (``models``: each model's flag -> the path given, '' = that role's default, the trained model
    first), what to check before the runtime starts (cheap checks that must fail before a model loads,
    e.g. importing reward functions), and how to build its ``trainer.base.Trainer`` on this rank's layout."""

    name: str
    parse: Callable[[Optional[Sequence[str]]], object]
    build: Callable[[object, RunLayout], object]
    models: Callable[[object], Dict[str, str]]
    precheck: Callable[[object], None] = lambda cfg: None


def setup_runtime(cfg) -> RunLayout:
    """Device, execution mode, compile cache, communication, parallel groups and seeds, from the config
    (``cfg.parallel``: the device, ``use_parallel``, the train layout and, if the stage has one, the infer
    layout; ``cfg.train``: seed and output_dir; ``cfg.world_size``)."""
    p = cfg.parallel
    ms.set_device(p.device_target)
    ms.set_context(mode=ms.PYNATIVE_MODE)  # hot paths are compiled with mindspore.jit
    if p.enable_compile_cache:
        ms.set_context(enable_compile_cache=True,
                       compile_cache_path=str(Path(cfg.train.output_dir) / "compile_cache"))
    gen_workers = getattr(p, "gen_workers", 0)  # a rollout stage's disaggregated generators
    if p.use_parallel:
        comm.init_distributed(p.collective_timeout, p.device_target)
        if gen_workers:
            return _disaggregated_runtime(cfg)
        if comm.world_size() != cfg.world_size:
            raise MindRLHFError(f"msrun started {comm.world_size()} workers but the config's layout needs "
                                f"train_dp*train_tp*train_pp = {cfg.world_size}; set --worker_num={cfg.world_size} "
                                f"or change the layout")
    ms.set_seed(cfg.train.seed)
    train = ParallelLayout(dp=p.train_dp, tp=p.train_tp, pp=p.train_pp, micro_batches=p.train_micro_batches)
    # A stage without a generator has no infer layout: its processes form one data-parallel "generator".
    infer = ParallelLayout(dp=p.infer_dp, tp=p.infer_tp) if hasattr(p, "infer_dp") else \
        ParallelLayout(dp=comm.world_size())
    return init_run_layout(train, infer, comm.rank(), comm.world_size())


def _disaggregated_runtime(cfg) -> RunLayout:
    """The rest of ``setup_runtime`` for a job whose last ``gen_workers`` ranks only generate: both layouts from
    the world size (train_dp, unless given, is what the generators leave; the config is checked again with it),
    then this rank's side (``groups.init_disaggregated_layout``)."""
    from mindrlhf.parallel.groups import disaggregated_layouts, init_disaggregated_layout

    p = cfg.parallel
    ms.set_seed(cfg.train.seed)
    train = ParallelLayout(dp=p.train_dp, tp=p.train_tp, pp=p.train_pp, micro_batches=p.train_micro_batches)
    train, infer = disaggregated_layouts(comm.world_size(), p.gen_workers, train,
                                         ParallelLayout(dp=p.infer_dp, tp=p.infer_tp),
                                         train_dp_given="train_dp" in cfg.explicitly_set())
    if train.dp != p.train_dp:
        p.train_dp = train.dp
        cfg.validate(source=f"train_dp = {train.dp} from the world of {comm.world_size()} minus gen_workers "
                            f"{p.gen_workers}")
    if comm.is_main():
        world = comm.world_size()
        log.info("disaggregated rollout: ranks 0..%d train (%s), ranks %d..%d only generate (%s), max_staleness %d",
                 train.world_size - 1, train, train.world_size, world - 1, infer, p.max_staleness)
    return init_disaggregated_layout(train, infer, comm.rank())


def resolve_weights(path: str) -> str:
    """The model weights a stage was given (a training run's folder: its newest intact checkpoint,
    ``checkpoint.run_record.model_of_run``); the embedded SmolLM2 default (converted once into a user cache,
    ``checkpoint.smollm2``) when ``path`` is ''."""
    if path:
        from mindrlhf.checkpoint.run_record import model_of_run

        return str(model_of_run(path))
    from mindrlhf.checkpoint.smollm2 import prepare_smollm2

    # The conversion into the cache is atomic, so racing ranks are harmless; rank 0 goes first
    # so the others find it done instead of converting again.
    if comm.is_main():
        prepare_smollm2()
    comm.job_barrier()
    return str(prepare_smollm2())


def load_tokenizer(model_cfg, model_path: str):
    """The tokenizer of a stage's model group: tokenizer_dir, vocab_path + merges_file_path, or the
    files beside the model (``configs.common.ModelBaseConfig``)."""
    from mindrlhf.tokenizer import resolve_tokenizer

    m = model_cfg
    return resolve_tokenizer(model_path, m.tokenizer_dir or None, m.vocab_path or None, m.merges_file_path or None)


def model_source(model_cfg, role: Optional[str] = None):
    """``(path, tokenizer, config)`` of the model a stage trains (``model_cfg.model_path``, resolved as
    ``resolve_weights`` does), read before any weights; with ``role`` (e.g. "the policy DPO trains") it must be
    a causal LM (one line naming ``--model`` otherwise)."""
    from mindrlhf.models.config import require_causal_lm
    from mindrlhf.parallel.resharding import checkpoint_config

    path = resolve_weights(model_cfg.model_path)
    tokenizer = load_tokenizer(model_cfg, path)
    config = checkpoint_config(path)
    if role:
        require_causal_lm(config, path, "--model", role)
    return path, tokenizer, config


def load_policy(path: str, config, layout: RunLayout, dtype: str, *, load: bool = True,
                num_labels: Optional[int] = None, seed: int = 0, lora=None):
    """This rank's trainable shard (train layout) of the model at ``path`` and, under bf16/fp16, its float32
    master weights read from the file, so nothing is rounded before training starts (the compute copy is
    cast from them). Returns ``(model, masters)``; ``masters`` is ``None`` in float32 (the optimizer keeps
    the model's own parameters) and when ``load`` is false (random init of ``config``, for tests).

    ``num_labels``: train a sequence-classification model (reward model, critic) with that many labels; a
    causal LM checkpoint then gets a new ``score`` head in place of its ``lm_head``, drawn with ``seed``.

    ``lora``: the stage's model group (``configs.common.ModelBaseConfig``); when it asks for LoRA (``lora_rank``,
    ``lora_init_from``) the shard is loaded in the compute dtype, frozen, and given adapters (``attach_lora``,
    drawn with ``seed``): the trainable parameters are the adapters alone, and ``masters`` is ``None`` (the
    optimizer keeps float32 masters of the adapters only; the base is never cast up)."""
    from dataclasses import replace

    from mindrlhf.models import CausalLM, cast_weights_into
    from mindrlhf.parallel.resharding import load_shard

    new_head = None
    if num_labels is not None and config.num_labels != num_labels:
        if config.num_labels:
            raise MindRLHFError(f"{path} is a sequence-classification model with {config.num_labels} labels; this "
                                f"stage needs {num_labels}: start from its causal LM or a {num_labels}-label model")
        config, new_head = replace(config, num_labels=num_labels), seed
        if comm.is_main():
            log.info("%s is a causal LM: its lm_head is replaced by a new %d-output score head", path, num_labels)
    shard = layout.groups.shard()
    kw = dict(tp_group=shard.tp_group, config=config, new_score_head=new_head)
    if lora is not None and lora.lora:
        model = load_shard(path, layout.train, layout.rank, dtype=dtype, **kw) if load else \
            CausalLM(config, dtype, shard)
        attach_lora(model, lora, seed, base=path if load else None)
        return model, None
    if not load:
        return CausalLM(config, dtype, shard), None
    if dtype == "float32":
        return load_shard(path, layout.train, layout.rank, dtype=dtype, **kw), None
    masters = load_shard(path, layout.train, layout.rank, dtype="float32", **kw)
    model = CausalLM(masters.config, dtype, shard)
    cast_weights_into(model, masters)
    return model, masters.trainable_params()


def lora_spec(model_cfg, seed: int = 0):
    """The ``models.lora.LoRASpec`` a model group's ``lora_*`` fields describe (``lora_target_modules``: names,
    ``all-linear``, or one regex, as PEFT reads ``target_modules``)."""
    import re

    from mindrlhf.models.lora import LoRASpec

    targets = list(model_cfg.lora_target_modules)
    if len(targets) == 1 and (targets[0] == "all-linear" or not re.fullmatch(r"\w+", targets[0])):
        targets = targets[0]  # PEFT: a string is all-linear or a regex over whole module names
    return LoRASpec(r=model_cfg.lora_rank, alpha=model_cfg.lora_alpha, dropout=model_cfg.lora_dropout,
                    target_modules=targets if isinstance(targets, str) else tuple(targets), seed=seed)


#: What PEFT's sequence-classification task always trains in full and saves (``PeftModelForSequenceClassification``).
SEQ_CLS_MODULES = ("classifier", "score")


def attach_lora(model, model_cfg, seed: int = 0, base: Optional[str] = None) -> None:
    """Freeze ``model`` and give it the adapters the model group asks for: ``lora_init_from``'s (a PEFT adapter
    folder, whose adapter_config.json sets rank, alpha and targets) or new ones with PEFT's init. ``base``: the
    path ``model`` was loaded from (a LoRA checkpoint's adapters trained on another base are warned about)."""
    from dataclasses import replace

    from mindrlhf.models.lora import apply_lora, lora_modules, read_adapter, set_adapter_weights

    m = model_cfg
    tensors = None
    if m.lora_init_from:
        spec, tensors = read_adapter(m.lora_init_from)
        if base is not None:  # the user chose the adapter and the base: another base than its own is warned about
            from mindrlhf.checkpoint.hf_io import model_files
            from mindrlhf.checkpoint.manifest import check_adapter_base

            check_adapter_base(m.lora_init_from, base, model_files(base), flag="--model", explicit=True)
        spec = replace(spec, seed=seed)  # the factors are the folder's; the run's seed draws the dropout masks
        if m.lora_rank and m.lora_rank != spec.r:
            raise MindRLHFError(f"lora_rank = {m.lora_rank} but lora_init_from {m.lora_init_from} holds rank-{spec.r} "
                                f"adapters; drop lora_rank (the folder sets it) or give lora_rank {spec.r}")
    else:
        spec = lora_spec(m, seed)
    if model.config.num_labels:  # a reward model / critic: its score head is trained in full (PEFT's SEQ_CLS task)
        spec = replace(spec, task_type="SEQ_CLS",
                       modules_to_save=tuple(dict.fromkeys(spec.modules_to_save + SEQ_CLS_MODULES)))
    apply_lora(model, spec)
    if tensors is not None:
        set_adapter_weights(model, tensors, f"lora_init_from {m.lora_init_from}")
    if comm.is_main():
        trainable = sum(int(np.prod(p.shape)) for p in model.trainable_params())
        total = sum(int(np.prod(p.shape)) for p in model.get_parameters())
        log.info("LoRA rank %d (alpha %g) on %d projections%s: %d trainable parameters of %d (%.2f%%)", spec.r,
                 spec.alpha, len(lora_modules(model)), f" from {m.lora_init_from}" if m.lora_init_from else "",
                 trainable, total, 100.0 * trainable / max(total, 1))


def load_reference(path: str, policy, layout: RunLayout, dtype: str, source: str = "initial policy"):
    """A stage's frozen reference in the train layout: this rank's shard of the checkpoint at ``path``, or (``path``
    '') a copy of the initial ``policy``'s weights in the compute ``dtype`` (``source`` names it in errors)."""
    from mindrlhf.models import CausalLM, get_weights, set_weights
    from mindrlhf.parallel.resharding import load_shard

    shard = layout.groups.shard()
    if path:
        return load_shard(path, layout.train, layout.rank, dtype=dtype, tp_group=shard.tp_group)
    ref = CausalLM(policy.config, dtype, shard)
    set_weights(ref, get_weights(policy), source=source)
    return ref


def reference_runner(cfg, policy, layout: RunLayout, head, path: str, *, share_prompts: bool = False,
                     source: str = "initial policy"):
    """A stage's frozen reference as a runner (``forward(micro_batches)``): the checkpoint at ``path`` when given;
    else, for a LoRA ``policy``, the policy itself with its adapters switched off (``update.AdaptersOff``: no second
    copy of the base); else a copy of the initial ``policy`` (``load_reference``)."""
    from mindrlhf.trainer.update import AdaptersOff, build_frozen_runner

    if not path and getattr(policy, "lora_spec", None) is not None:
        return AdaptersOff(build_frozen_runner(cfg, policy, layout.groups, head, share_prompts=share_prompts), policy)
    ref = load_reference(path, policy, layout, cfg.model.dtype, source)
    return build_frozen_runner(cfg, ref, layout.groups, head, share_prompts=share_prompts)


def worker_lost(cfg, op: str, err: RuntimeError) -> WorkerLostError:
    """The one-line report of a collective that got no answer: another worker died or hangs."""
    # MindSpore's message may open with ruler and heading lines; log its first line with words in it.
    said = next((line.strip() for line in str(err).splitlines() if any(c.isalnum() for c in line)
                 and "Kernel error" not in line), "")
    log.error("rank %d: %s failed: %s", comm.rank(), op, said)
    found = CheckpointManager(cfg.checkpoint_dir).latest_complete()
    resume = (f"the newest complete checkpoint here is step {found[0]}: rerun the same command with --resume"
              if found else "no complete checkpoint here yet: rerun the same command")
    return WorkerLostError(f"worker rank {comm.rank()} of {comm.job_size()}: {op} got no answer from the other "
                           f"workers within {comm.collective_timeout_text()}, so another "
                           f"worker of this job died or hangs (msrun's --log_dir has each worker's log); {resume}")


def run_stage(spec: StageSpec, argv: Optional[Sequence[str]] = None) -> int:
    """Run one training command to the end; returns its exit code (errors raise ``MindRLHFError``)."""
    cfg = spec.parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t = cfg.train
    # Before anything is written, on every worker (msrun's rendezvous in setup_runtime comes after):
    # what this start may do in the output and checkpoint directories, and which checkpoint it resumes.
    models = spec.models(cfg)
    start = check_run_dirs(t.output_dir, cfg.checkpoint_dir, resume=t.resume, overwrite=t.overwrite_output_dir,
                           stage=spec.name, models=models)
    started = False
    try:
        spec.precheck(cfg)
        layout = setup_runtime(cfg)
        trainer = spec.build(cfg, layout)
        trainer.check_inputs()
        if start.checkpoint is not None:
            trainer.resume(start.checkpoint)
        started = True
        # Everything is validated and loaded: only now may the previous run go and this one's files begin. A resume
        # of a run that already reached max_steps trains nothing and writes nothing (its config stays the one that
        # trained).
        if comm.is_main() and trainer.step < trainer.total_steps:
            # What each input model was, for the checkpoints (a resume with another model is refused).
            trainer.input_models = start.models or identify_models(models)
            if t.overwrite_output_dir and start.checkpoint is None:
                clear_previous_run(t.output_dir, cfg.checkpoint_dir)
            write_run_id(t.output_dir, trainer.run_id, spec.name)
            trainer.run_config().save_yaml(Path(t.output_dir) / "config.yaml")  # with the resolved run length
        history = trainer.train()
    except RuntimeError as err:
        op = comm.collective_failure(err) if comm.job_size() > 1 else None
        if op is None:
            raise
        raise worker_lost(cfg, op, err) from None
    finally:
        if not started:
            start.undo()  # a failed start leaves no empty output or checkpoint directory behind
        start.release()  # the run's folders are free for the next launch
    if comm.is_main() and history:
        log.info("%s", trainer.finished(history))
    return 0
