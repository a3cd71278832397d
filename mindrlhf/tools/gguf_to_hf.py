"""Convert a GGUF file (llama.cpp format) into a Hugging Face model directory: the command line.

The conversion itself is ``mindrlhf.checkpoint.gguf`` (supported architectures, quantisation types,
pre-tokenizers and what is written are described there).

Usage::

    python -m mindrlhf.tools.gguf_to_hf --gguf model.gguf --output_dir hf_model [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

from mindrlhf.checkpoint.gguf import DEFAULT_MAX_SHARD_BYTES, SUPPORTED_ARCHITECTURES, SUPPORTED_DTYPES, convert_gguf
from mindrlhf.errors import MindRLHFError
from mindrlhf.utils.cli import run_cli


def _parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="mindrlhf-gguf-to-hf",
        description=f"Convert a llama.cpp GGUF file ({' / '.join(SUPPORTED_ARCHITECTURES)} architecture, "
                    "GPT2-style BPE tokenizer) into a Hugging Face model directory (config, safetensors weights, "
                    "tokenizer).",
    )
    parser.add_argument("--gguf", required=True, help="path of the input .gguf file (only read)")
    parser.add_argument("--output_dir", required=True,
                        help="directory to create for the HF model; must be new or empty unless --overwrite")
    parser.add_argument("--dtype", default="float32", choices=SUPPORTED_DTYPES,
                        help="dtype of the written weights (default float32; quantised weights are "
                             "dequantised first)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the converted files in an existing non-empty output_dir")
    parser.add_argument("--max_shard_gb", type=float, default=DEFAULT_MAX_SHARD_BYTES / 1024**3,
                        help="split model.safetensors into shards of at most this many GiB (default 4)")
    parser.add_argument("--no_progress", action="store_true", help="hide the progress bar")
    return parser.parse_args(argv)


def _main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse_args(argv)
    if args.max_shard_gb <= 0:
        raise MindRLHFError(f"--max_shard_gb {args.max_shard_gb} must be positive; pass e.g. --max_shard_gb 4")
    out, info = convert_gguf(Path(args.gguf), Path(args.output_dir), args.dtype, overwrite=args.overwrite,
                             progress=not args.no_progress, max_shard_bytes=int(args.max_shard_gb * 1024**3))
    tok = info["tokenizer"]
    print(f"wrote {out}: {info['architecture']} model, {info['n_params'] / 1e6:.1f}M parameters in "
          f"{info['n_tensors']} tensors ({', '.join(info['types'])} -> {info['dtype']}), "
          f"{len(info['shards'])} weight file(s); tokenizer: {tok['n_tokens']} tokens, {tok['n_merges']} merges, "
          f"pre-tokenizer {tok['pre']}, chat template {'yes' if tok['chat_template'] else 'no'}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point: ``mindrlhf-gguf-to-hf --gguf PATH --output_dir DIR [--dtype ...] [--overwrite]``."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
