"""A tool turn's continuation on the native sampler with and without the first turn's KV cache kept
(``Sampler.reuse_prefixes``), in one run on the same weights.

SmolLM2-135M-Instruct (the embedded model), GSM8K training questions rendered with the calculator's schema (the
Hermes form: ~600-token prompts). Turn one samples up to ``--turn_tokens`` tokens and stops at the end of a sentence
or of the turn; every row that stopped is continued with the calculator's result for ``2 + 2`` as the template
renders it and ``--reply_tokens`` more tokens: inside ``reuse_prefixes`` (the prompt and turn one come from the
kept cache) and outside it (the whole context prefilled), alternating ``--repeats`` times; the best run of each
counts. Both give the same tokens (checked).

    python bench/tool_turns.py [--rows 8 --turn_tokens 48 --reply_tokens 32 --repeats 3]
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=8, help="questions (one completion each)")
    p.add_argument("--turn_tokens", type=int, default=48, help="turn one's token limit")
    p.add_argument("--reply_tokens", type=int, default=32, help="the continuation's token limit (forced)")
    p.add_argument("--repeats", type=int, default=3, help="timed continuations of each kind (best counts)")
    args = p.parse_args(argv)

    from mindrlhf.checkpoint.smollm2 import prepare_smollm2
    from mindrlhf.data.gsm8k import DEFAULT_SYSTEM_PROMPT
    from mindrlhf.generation import NativeSampler, SamplingParams
    from mindrlhf.models import load_model
    from mindrlhf.rollout_tools import ToolBox, render_prompt, tool_result_ids
    from mindrlhf.tokenizer import Tokenizer

    model_dir = prepare_smollm2()
    tok, box = Tokenizer.from_dir(model_dir), ToolBox(["calculator"])
    sample = Path(__import__("mindrlhf.resources", fromlist=["x"]).__file__).parent / "gsm8k_train_sample.jsonl"
    questions = [json.loads(line)["question"] for line in sample.read_text(encoding="utf-8").splitlines()][:args.rows]
    prompts = [tok.encode(render_prompt(tok, [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
                                              {"role": "user", "content": q}], box.schemas)) for q in questions]
    suffix = tool_result_ids(tok, box.run('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 2"}}'
                                          '\n</tool_call>'))
    stops = sorted(set(tok.stop_token_ids) | {tok.encode(".")[-1]})
    sampler = NativeSampler(load_model(model_dir))
    turn = SamplingParams(n=1, temperature=0.7, max_tokens=args.turn_tokens, stop_token_ids=stops, seed=1)
    reply = SamplingParams(n=1, temperature=0.7, max_tokens=args.reply_tokens, min_tokens=args.reply_tokens, seed=2)

    def continuation(reuse: bool):
        with sampler.reuse_prefixes(lambda ids: reuse):
            first = sampler.generate(prompts, turn)
            first_s = sampler.last_stats["total_s"]  # with the cache kept: its copy to the host included
            keep_s = sampler.last_stats["keep_s"]
            rows = [prompts[c.prompt_index] + c.token_ids + suffix for c in first if c.finish_reason == "stop"]
            out = sampler.generate(rows, reply)
            return rows, out, dict(sampler.last_stats, first_s=first_s, first_keep_s=keep_s)

    continuation(True), continuation(False)  # compile every shape
    best = {}
    for _ in range(args.repeats):
        for reuse in (True, False):
            rows, out, stats = continuation(reuse)
            ids = [c.token_ids for c in out]
            if reuse not in best or stats["total_s"] < best[reuse][2]["total_s"]:
                best[reuse] = (rows, ids, stats)
    (rows, with_ids, kept), (_, whole_ids, whole) = best[True], best[False]
    assert with_ids == whole_ids, "the continuations differ"
    context = [len(r) for r in rows]
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    print(f"machine: {cpu or platform.processor()}; SmolLM2-135M-Instruct, float32")
    print(f"{len(rows)} continuations of {min(context)}-{max(context)} tokens (prompt, turn one, calculator result), "
          f"{args.reply_tokens} new tokens each; best of {args.repeats}")
    for name, s in (("whole context prefilled", whole), ("turn one's cache kept", kept)):
        print(f"  {name:24s} call {s['total_s']:6.2f} s  prefill {s['prefill_s']:6.2f} s  decode {s['decode_s']:6.2f} s"
              f"  reused tokens {s['reused_tokens']}  (turn one {s['first_s']:.2f} s, "
              f"{s['first_keep_s']:.2f} s of it keeping the cache)")
    print(f"continuation call: {kept['total_s'] / whole['total_s']:.2f}x, prefill "
          f"{kept['prefill_s'] / max(whole['prefill_s'], 1e-9):.2f}x (time {time.strftime('%Y-%m-%d')})")


if __name__ == "__main__":
    main()
