"""Rollout throughput: mindrlhf's NativeSampler vs Hugging Face ``generate`` on the same weights.

A random Qwen2-architecture model (real Qwen vocabulary, 151,936 rows) is written with
``mindrlhf.testing.make_tiny_qwen2``; both engines sample with temperature 1.0, top-p 1.0,
top-k off and exactly ``--new_tokens`` new tokens per row (HF ``min_new_tokens=max_new_tokens``,
ours ``min_tokens=max_tokens``). Each engine is warmed up first (our compile time is reported
separately), then the engines are timed in alternation ``--repeats`` times in the same process;
the best run of each counts (the machine may be shared: the best run is the least disturbed).

    python bench/generation.py [--hidden_size 256 --num_layers 4 --batch 16 --prompt_len 64 --new_tokens 128]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden_size", type=int, default=256, help="model hidden size")
    p.add_argument("--num_layers", type=int, default=4, help="decoder layers")
    p.add_argument("--intermediate_size", type=int, default=0, help="MLP size (default 4 x hidden)")
    p.add_argument("--heads", type=int, default=0, help="attention heads (default hidden / 64)")
    p.add_argument("--kv_heads", type=int, default=0, help="key/value heads (default heads / 2)")
    p.add_argument("--batch", type=int, default=16, help="rows generated together")
    p.add_argument("--prompt_len", type=int, default=64, help="prompt tokens per row")
    p.add_argument("--new_tokens", type=int, default=128, help="new tokens per row (forced in both engines)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine (best counts)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for the HF baseline")
    p.add_argument("--jit_level", default="O0", help="mindspore.jit level for our step (O0 or O1)")
    p.add_argument("--skip_hf", action="store_true", help="measure only our sampler")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    import mindspore as ms

    from mindrlhf.generation import NativeSampler, SamplingParams
    from mindrlhf.models import DecoderConfig, load_model
    from mindrlhf.testing import make_tiny_qwen2

    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    h = args.hidden_size
    heads = args.heads or max(1, h // 64)
    kv = args.kv_heads or max(1, heads // 2)
    tmp = tempfile.TemporaryDirectory()
    hf_dir = make_tiny_qwen2(Path(tmp.name) / "model", hidden_size=h, num_hidden_layers=args.num_layers,
                             intermediate_size=args.intermediate_size or 4 * h, num_attention_heads=heads,
                             num_key_value_heads=kv,
                             max_position_embeddings=max(4096, args.prompt_len + args.new_tokens))
    cfg = DecoderConfig.from_file(hf_dir)
    print(f"model: Qwen2 random, hidden {h}, layers {args.num_layers}, heads {heads}/{kv}, vocab {cfg.vocab_size}, "
          f"{cfg.num_parameters / 1e6:.1f}M params; batch {args.batch}, prompt {args.prompt_len}, "
          f"new tokens {args.new_tokens}")

    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, (args.batch, args.prompt_len)).tolist()
    n_tok = args.batch * args.new_tokens

    # -- ours: build and warm up (compiles the prefill and decode graphs) ---------------------------
    model = load_model(hf_dir)
    sampler = NativeSampler(model, jit_level=args.jit_level)
    params = SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=0, max_tokens=args.new_tokens,
                            min_tokens=args.new_tokens, stop_token_ids=[cfg.eos_token_id], seed=0)
    t0 = time.perf_counter()
    sampler.generate(prompts, params)
    warm = time.perf_counter() - t0
    compile_s = sampler.last_stats["compile_s"]
    print(f"ours: compile {compile_s:.2f}s (warm-up call {warm:.2f}s)")

    def run_ours(r: int) -> float:
        params.seed = r + 1
        t0 = time.perf_counter()
        out = sampler.generate(prompts, params)
        dt = time.perf_counter() - t0
        assert all(len(c.token_ids) == args.new_tokens for c in out)
        st = sampler.last_stats
        print(f"  ours run {r}: {n_tok / dt:8.1f} tok/s  (prefill {st['prefill_s']:.3f}s, decode "
              f"{st['decode_s']:.3f}s, sampling {st['sample_s']:.3f}s)")
        return dt

    # -- Hugging Face transformers: build and warm up -----------------------------------------------
    run_hf = None
    if not args.skip_hf:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(args.threads)
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        ids = torch.tensor(prompts)
        mask = torch.ones_like(ids)
        kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0)
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, min_new_tokens=8, max_new_tokens=8, **kw)

        def run_hf(r: int) -> float:
            torch.manual_seed(r)
            t0 = time.perf_counter()
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=mask, min_new_tokens=args.new_tokens,
                                  max_new_tokens=args.new_tokens, **kw)
            dt = time.perf_counter() - t0
            assert out.shape[1] == args.prompt_len + args.new_tokens
            print(f"  HF   run {r}: {n_tok / dt:8.1f} tok/s")
            return dt

    # Runs alternate between the engines so that load from other processes hits both alike.
    ours, theirs = [], []
    for r in range(args.repeats):
        ours.append(run_ours(r))
        if run_hf is not None:
            theirs.append(run_hf(r))
    ours_tps = n_tok / min(ours)
    print(f"ours: {ours_tps:.1f} tok/s (best of {args.repeats})")
    if run_hf is None:
        return
    hf_tps = n_tok / min(theirs)
    print(f"transformers: {hf_tps:.1f} tok/s (best of {args.repeats}, torch threads {args.threads})")
    print(f"ratio ours / transformers: {ours_tps / hf_tps:.2f}x")


if __name__ == "__main__":
    main()
