"""``mindrlhf-vllm-serve``: a vLLM engine that GRPO / PPO runs share through ``--vllm_server SOCKET``.

    mindrlhf-vllm-serve --model MODEL_DIR --socket /tmp/vllm.sock [--dtype auto] [--max_model_len 1024]

The engine runs in vLLM's own virtualenv (``--vllm_python``; ``bash scripts/install_vllm.sh .venv-vllm`` makes
one) for the architecture of ``MODEL_DIR/config.json``; it holds dummy weights until a run connects and loads
its policy's. One run at a time is served; the engine's start (about two minutes on CPU) is paid once for all.
Stop it with Ctrl-C.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from typing import List, Optional

from mindrlhf.errors import MindRLHFError
from mindrlhf.utils.cli import run_cli


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mindrlhf-vllm-serve", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model folder with a Hugging Face config.json (its architecture "
                   "is served; the weights come from the run)")
    p.add_argument("--socket", required=True, help="the Unix socket to serve on (give it to a run as --vllm_server)")
    p.add_argument("--vllm_python", default="", help="the Python of vLLM's virtualenv; '' = $MINDRLHF_VLLM_PYTHON, "
                   "else the checkout's .venv-vllm/bin/python")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="'auto' = bfloat16 where the CPU has AVX-512-BF16 or AMX, else float32")
    p.add_argument("--max_model_len", type=int, default=1024, help="prompt + completion tokens")
    p.add_argument("--max_num_seqs", type=int, default=64, help="sequences decoded together")
    p.add_argument("--max_num_batched_tokens", type=int, default=0, help="tokens per engine step (0 = vLLM's)")
    p.add_argument("--kv_cache_gib", type=int, default=1, help="KV-cache space in GiB")
    p.add_argument("--seed", type=int, default=0, help="the engine's seed (each request brings its own)")
    p.add_argument("--enforce_eager", action="store_true", help="run the model without torch.compile: the engine "
                   "starts about a minute sooner on CPU and samples slower (for short jobs and tests)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    return run_cli(_main, argv)


def _main(argv: Optional[List[str]]) -> int:
    from mindrlhf.generation.vllm_sampler import cpu_has_bf16, default_vllm_python, engine_command, engine_env
    from mindrlhf.models.config import DecoderConfig

    args = build_parser().parse_args(argv)
    python = args.vllm_python or default_vllm_python()
    if not os.path.isfile(python):
        raise MindRLHFError(f"--vllm_python {python}: no such Python; make vLLM's environment with "
                            "`bash scripts/install_vllm.sh .venv-vllm`")
    config = DecoderConfig.from_file(args.model)
    dtype = ("bfloat16" if cpu_has_bf16() else "float32") if args.dtype == "auto" else args.dtype
    with tempfile.TemporaryDirectory(prefix="mindrlhf-vllm-serve-") as folder:
        cmd = engine_command(python, config.to_hf_dict(), folder, os.path.abspath(args.socket), dtype=dtype,
                             max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_gib=args.kv_cache_gib,
                             seed=args.seed, enforce_eager=args.enforce_eager)
        print(f"mindrlhf-vllm-serve: starting vLLM ({dtype}) for {args.model} on {args.socket}", file=sys.stderr,
              flush=True)
        # The engine leads a process group of its own (vLLM's processes are in it): stopping this command stops
        # the group, and an engine whose parent dies stops itself.
        proc = subprocess.Popen(cmd, env=engine_env(), start_new_session=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below
        try:
            return proc.wait()
        except KeyboardInterrupt:
            return 130
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()


if __name__ == "__main__":
    sys.exit(main())
