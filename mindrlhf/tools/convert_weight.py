"""Convert Hugging Face weights (any family of ``models.family``) to a MindSpore checkpoint, and back.

HF → MindSpore::

    python mindrlhf/tools/convert_weight.py --model qwen2_5 --input_path HF_DIR \\
        --output_path OUT.ckpt|OUT.safetensors --dtype bf16 [--config_path overrides.yaml]

writes the checkpoint and, next to it, ``OUT.config.json`` (the HF config with its dtype updated and
the overrides applied), which is what ``mindrlhf.checkpoint.load_weights`` reads back; the folder's
``config.json`` too, unless another checkpoint in the folder may be loading with it.

MindSpore → HF (``--reverse``)::

    python mindrlhf/tools/convert_weight.py --reverse --input_path OUT.ckpt --output_path HF_OUT_DIR

writes ``config.json``, ``model.safetensors`` (sharded with an index above ``--max_shard_size``)
and copies ``generation_config.json`` and tokenizer files found next to the checkpoint.

A LoRA adapter merged into a full HF model (``--reverse --adapter``)::

    python mindrlhf/tools/convert_weight.py --reverse --input_path BASE --adapter ADAPTER_DIR \
        --output_path HF_OUT_DIR

``BASE`` is the model the adapter was trained on (an HF directory or a MindSpore checkpoint), ``ADAPTER_DIR``
a PEFT adapter folder (a LoRA run's ``output_dir/adapter`` or a checkpoint ``step_N``); each adapted weight
is written as ``W + alpha/r * B A``, streamed a tensor at a time. The adapter of a reward model or critic (PEFT's
SEQ_CLS: its ``score`` head saved in full) on the causal LM it was trained from exports a
``*ForSequenceClassification`` model: the adapter's head in place of ``lm_head``, the config a one-label classifier's.

Parameter names are the HF names on both sides, so conversion is a dtype cast plus a container
change; every tensor's shape is checked against the config first. Nothing is ever written into
the input directory, and existing outputs are only replaced with ``--overwrite``.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mindrlhf.checkpoint import hf_io
from mindrlhf.checkpoint.manifest import check_adapter_base
from mindrlhf.errors import MindRLHFError
from mindrlhf.models.family import LM_HEAD, SCORE, cli_names, family_of_cli_name, get_family
from mindrlhf.tokenizer import TOKENIZER_FILES
from mindrlhf.utils.cli import run_cli
from mindrlhf.utils.fs import is_inside

# keys a --config_path file may set even when config.json lacks them (HF defaults otherwise)
OVERRIDABLE_EXTRA_KEYS = frozenset({
    "head_dim", "num_key_value_heads", "attention_bias", "mlp_bias", "tie_word_embeddings",
    "rope_theta", "rope_scaling", "rope_parameters", "rms_norm_eps", "max_position_embeddings",
    "sliding_window", "use_sliding_window", "max_window_layers", "hidden_act",
    "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype",
})


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(
        prog="convert_weight",
        description=f"Convert Hugging Face safetensors ({', '.join(cli_names())}) to a MindSpore checkpoint "
                    "(.ckpt or .safetensors), or back with --reverse.")
    p.add_argument("--model", default=None,
                   help=f"model family: {', '.join(cli_names())}; must agree with model_type in config.json "
                        "(default: taken from config.json)")
    p.add_argument("--input_path", required=True,
                   help="HF model directory (config.json + *.safetensors); with --reverse a MindSpore "
                        ".ckpt/.safetensors file with config.json (or <stem>.config.json) next to it")
    p.add_argument("--output_path", required=True,
                   help="MindSpore checkpoint file ending in .ckpt or .safetensors; with --reverse the HF "
                        "output directory")
    p.add_argument("--dtype", default=None,
                   help="dtype of the written weights: bf16|bfloat16, fp16|float16, fp32|float32 "
                        "(default: the torch_dtype/dtype in the config, else fp32)")
    p.add_argument("--config_path", default=None,
                   help="optional YAML/JSON mapping whose keys override config.json values (flat HF keys, "
                        "e.g. rms_norm_eps: 1.0e-6); the result is written next to the output")
    p.add_argument("--reverse", action="store_true",
                   help="export a MindSpore checkpoint back to a Hugging Face directory")
    p.add_argument("--adapter", default=None,
                   help="--reverse only: a PEFT LoRA adapter folder (adapter_config.json + "
                        "adapter_model.safetensors, e.g. a LoRA run's output_dir/adapter) to merge into the "
                        "exported weights (W + alpha/r * B A); --input_path may then also be an HF directory, "
                        "the base the adapter was trained on")
    p.add_argument("--overwrite", action="store_true",
                   help="replace existing output files instead of refusing")
    p.add_argument("--max_shard_size", default="2GB",
                   help="--reverse only: max size of one model-XXXXX-of-YYYYY.safetensors shard, "
                        "e.g. 2GB, 500MB (default: 2GB)")
    p.add_argument("--no_progress", action="store_true", help="do not show the progress bar")
    return p


# ---------------------------------------------------------------------------------------------
def _parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", str(text), flags=re.IGNORECASE)
    if not m:
        raise MindRLHFError(f"--max_shard_size {text!r} is not a size; use e.g. 2GB or 500MB")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    size = int(float(m.group(1)) * scale)
    if size <= 0:
        raise MindRLHFError(f"--max_shard_size {text!r} must be positive; use e.g. 2GB")
    return size


def _human(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{size:.1f} TiB"  # pragma: no cover


def _apply_overrides(config: Dict[str, Any], config_path: Optional[str]) -> Tuple[Dict[str, Any], str]:
    """Apply a --config_path file to ``config``; return it and a label naming the config source(s)."""
    if not config_path:
        return config, ""
    import yaml

    path = Path(config_path)
    if not path.is_file():
        raise MindRLHFError(f"--config_path {path}: file not found; pass a YAML/JSON file of config.json overrides")
    try:
        overrides = yaml.safe_load(path.read_text(encoding="utf-8"))  # JSON is YAML too
    except (OSError, yaml.YAMLError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise MindRLHFError(f"--config_path {path}: cannot parse ({first}); fix the YAML/JSON syntax") from None
    if overrides is None:
        overrides = {}
    if not isinstance(overrides, dict):
        raise MindRLHFError(f"--config_path {path}: expected a mapping of config.json keys to values, "
                            f"got {type(overrides).__name__}")
    unknown = sorted(str(k) for k in overrides if k not in config and k not in OVERRIDABLE_EXTRA_KEYS)
    if unknown:
        raise MindRLHFError(f"--config_path {path}: unknown key(s) {', '.join(unknown)}; use flat Hugging Face "
                            "config.json keys (e.g. hidden_size, rms_norm_eps, rope_theta)")
    merged = dict(config)
    merged.update(overrides)
    return merged, f" (+ overrides from {path})"


def _check_model(model: Optional[str], config: Dict[str, Any], config_label: str) -> str:
    model_type = config.get("model_type")
    family = get_family(model_type, source=config_label)
    if model is not None and family_of_cli_name(model) is not family:
        raise MindRLHFError(f"--model {model} does not match model_type {model_type!r} in {config_label}; "
                            f"pass --model {' or '.join(family.cli_names)} (or fix the config)")
    return model_type


def _tensor_progress(items, total: int, desc: str, disable: bool):
    from tqdm import tqdm

    return tqdm(items, total=total, unit="tensor", desc=desc, disable=disable, file=sys.stderr)


def _same_json(path: Path, data: Dict[str, Any]) -> bool:
    try:
        return json.loads(path.read_text(encoding="utf-8")) == data
    except (OSError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------
def hf_to_ms(args: argparse.Namespace) -> int:
    """HF directory → MindSpore checkpoint + config.json next to it."""
    in_dir, out = Path(args.input_path), Path(args.output_path)
    if not in_dir.is_dir():
        raise MindRLHFError(f"--input_path {in_dir}: not a directory; pass the Hugging Face model directory "
                            "(or add --reverse to export a MindSpore checkpoint)")
    if out.suffix.lower() not in (".ckpt", ".safetensors"):
        raise MindRLHFError(f"--output_path {out}: must end in .ckpt or .safetensors")
    if is_inside(out.parent, in_dir):
        raise MindRLHFError(f"--output_path {out} is inside the input directory {in_dir.resolve()}; "
                            "write the checkpoint somewhere else (inputs are never modified)")
    config_file = in_dir / "config.json"
    config, extra = _apply_overrides(hf_io.read_hf_config(in_dir), args.config_path)
    label = f"{config_file}{extra}"
    _check_model(args.model, config, label)
    dtype = hf_io.normalize_dtype(args.dtype, where=f"--dtype for {out}") if args.dtype else hf_io.config_dtype(config)
    out_config = hf_io.config_with_dtype(config, dtype)
    # <stem>.config.json belongs to this checkpoint alone (loaders prefer it); the folder's config.json is
    # written too while no other checkpoint in the folder may be reading it, so converting a second model
    # into the folder never changes the config the first one loads with.
    config_out = out.with_name(out.stem + ".config.json")
    shared = out.with_name("config.json")
    if out.is_dir():
        raise MindRLHFError(f"--output_path {out} is a directory; give a file name ending in .ckpt or .safetensors")
    if not args.overwrite and out.exists():
        raise MindRLHFError(f"--output_path {out} already exists; pass --overwrite to replace it")
    others = [p for p in out.parent.glob("*") if p.suffix.lower() in (".ckpt", ".safetensors") and p.name != out.name]
    write_shared = not shared.exists() or not others or _same_json(shared, out_config)

    specs = hf_io.hf_tensor_specs(in_dir)
    skip = set(hf_io.check_tensor_specs(specs, config, source=str(in_dir), config_file=label))
    stream = ((n, a) for n, a in hf_io.iter_hf_tensors(in_dir) if n not in skip)
    with _tensor_progress(stream, len(specs) - len(skip), f"to {dtype}", args.no_progress) as bar:
        summary = hf_io.save_ms_checkpoint(bar, out, dtype)
    hf_io.write_json_atomic(config_out, out_config)
    if write_shared:
        hf_io.write_json_atomic(shared, out_config)
    print(f"converted {summary.num_tensors} tensors ({summary.num_params:,} parameters) to {dtype}, "
          f"{_human(summary.nbytes)} -> {out} (config: {config_out}{' and ' + shared.name if write_shared else ''})")
    return 0


def ms_to_hf(args: argparse.Namespace) -> int:
    """MindSpore checkpoint (+ config next to it) → HF directory."""
    ckpt, out_dir = Path(args.input_path), Path(args.output_path)
    adapter_dir = Path(args.adapter) if args.adapter else None
    if ckpt.is_dir() and adapter_dir is None:
        raise MindRLHFError(f"--input_path {ckpt}: --reverse expects a MindSpore .ckpt/.safetensors file, "
                            "not a directory (an HF directory is taken with --adapter, to merge a LoRA adapter)")
    if not ckpt.exists():
        raise MindRLHFError(f"--input_path {ckpt}: not found; pass the MindSpore checkpoint to export")
    if not ckpt.is_dir() and ckpt.suffix.lower() not in (".ckpt", ".safetensors"):
        raise MindRLHFError(f"--input_path {ckpt}: must end in .ckpt or .safetensors")
    folder = ckpt if ckpt.is_dir() else ckpt.parent
    for given in (folder, adapter_dir):
        if given is not None and is_inside(out_dir, given):
            raise MindRLHFError(f"--output_path {out_dir} is inside the input directory {given.resolve()}; "
                                "export to a directory outside it (inputs are never modified)")
    if out_dir.exists() and not out_dir.is_dir():
        raise MindRLHFError(f"--output_path {out_dir} is a file; --reverse writes a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not args.overwrite:
        raise MindRLHFError(f"--output_path {out_dir} exists and is not empty; pass --overwrite to replace "
                            "its model files")
    max_shard = _parse_size(args.max_shard_size)
    config_file = ckpt / "config.json" if ckpt.is_dir() else hf_io.ms_config_path(ckpt)
    config, extra = _apply_overrides(hf_io.read_json(config_file), args.config_path)
    label = f"{config_file}{extra}"
    _check_model(args.model, config, label)
    dtype = (hf_io.normalize_dtype(args.dtype, where=f"--dtype for {out_dir}") if args.dtype
             else hf_io.config_dtype(config))

    source = hf_io.open_weights(ckpt)
    skip = set(hf_io.check_tensor_specs(source.specs, config, source=str(ckpt), config_file=label))
    gen_cfg = None
    for name in (ckpt.stem + ".generation_config.json", "generation_config.json"):
        if (folder / name).is_file():
            gen_cfg = hf_io.read_json(folder / name)
            break
    merged, spec, adapter = "", None, {}
    if adapter_dir is not None:
        from mindrlhf.models import lora  # imports MindSpore: only when merging

        spec, adapter = lora.read_adapter(adapter_dir)
        # --input_path names the base explicitly: another base than the adapters' recorded one is warned about.
        check_adapter_base(adapter_dir, str(ckpt), hf_io.model_files(ckpt), flag="--input_path", explicit=True)
        if SCORE in adapter and SCORE not in source.specs:  # a reward model's / critic's adapter on its causal LM
            config = _classifier_config(config, adapter[SCORE].shape[0], ckpt, label)
            skip.add(LM_HEAD)  # a *ForSequenceClassification model has the score head instead
    stream = ((n, a) for n, a in source if n not in skip)
    total = len(source.specs) - len(skip & set(source.specs))
    if adapter_dir is not None:
        stream = lora.merge_adapter(source.specs, stream, spec, adapter, source=str(adapter_dir))
        saved = sorted(n for n in adapter if ".lora_" not in n)
        total += sum(n not in source.specs for n in saved)
        merged = f", merged the LoRA adapter {adapter_dir} (r {spec.r}, alpha {spec.alpha:g}, " \
                 f"{sum('.lora_A.' in n for n in adapter)} projections" \
                 f"{', ' + ', '.join(saved) + ' in full' if saved else ''})"
    with _tensor_progress(stream, total, f"to HF {dtype}", args.no_progress) as bar:
        summary = hf_io.save_hf_dir(bar, config, out_dir, dtype, generation_config=gen_cfg,
                                    max_shard_bytes=max_shard)
    copied: List[str] = []
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, out_dir / name)
            copied.append(name)
    shards = sum(1 for p in summary.paths if p.suffix == ".safetensors")
    tok = f", copied {', '.join(copied)}" if copied else ""
    print(f"exported {summary.num_tensors} tensors ({summary.num_params:,} parameters) as {dtype}, "
          f"{_human(summary.nbytes)} in {shards} shard(s) -> {out_dir}{merged}{tok}")
    return 0


def _classifier_config(config: Dict[str, Any], labels: int, ckpt: Path, label: str) -> Dict[str, Any]:
    """The HF config of the ``labels``-output ``*ForSequenceClassification`` model built on the causal LM whose
    ``config`` this is (a reward model's or critic's LoRA export: its base is the causal LM it was trained from).
    transformers' classifier finds each row's last token through ``pad_token_id``: without one in the config, the
    tokenizer's beside the weights (as mindrlhf-rm sets it), else none (a one-row batch still scores)."""
    from dataclasses import replace

    from mindrlhf.models.config import DecoderConfig

    decoder = DecoderConfig.from_hf_dict(config, source=label)
    if decoder.pad_token_id is None:
        from mindrlhf.tokenizer import resolve_tokenizer

        try:
            decoder = replace(decoder, pad_token_id=resolve_tokenizer(ckpt).pad_token_id)
        except MindRLHFError:  # no tokenizer beside the weights
            pass
    return hf_io.config_with_dtype(replace(decoder, num_labels=labels).to_hf_dict(), hf_io.config_dtype(config))


def _main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.adapter and not args.reverse:
        raise MindRLHFError(f"--adapter {args.adapter}: merging a LoRA adapter writes an HF model; add --reverse "
                            "(--input_path the base it was trained on, --output_path the HF directory to write)")
    return ms_to_hf(args) if args.reverse else hf_to_ms(args)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point (``mindrlhf-convert-weight``); errors print ``error: ...`` and return 2."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
