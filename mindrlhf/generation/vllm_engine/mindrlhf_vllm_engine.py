"""A vLLM engine serving mindrlhf's vLLM sampler over a Unix socket (runs in vLLM's virtualenv).

    python mindrlhf_vllm_engine.py --socket PATH --model DIR [--dtype float32|bfloat16] [--max_model_len N] ...

``DIR`` holds a Hugging Face ``config.json``; the engine starts from dummy weights and gets the real ones from
the trainer (``load_weights``), so nothing of the policy is written to disk. One client at a time speaks JSON
lines: every request is one object with an ``op``, every answer one object with ``ok``. No pickle crosses the
socket: token ids, numbers and the name and layout of a shared-memory block the trainer fills with HF-named
float32 arrays.

Why the weights are not loaded with vLLM's ``reload_weights``: its CPU backend hands each linear layer to a
packed kernel holding its own copy of the weight (the layer's ``weight`` is left empty), and the compiled graph
keeps calling what it was traced with. A oneDNN matmul handle (most linears) gets a new handle built from the new
weight, and its pointer is written into the old handle's tensor, which is what the graph reads at run time
(measured in docs/design.md, "vLLM on CPU"). A small linear on a CPU with AMX runs sgl-kernel's
``weight_packed_linear`` on a VNNI-packed tensor: the new weight is packed the same way and copied into that
tensor. Everything else (embeddings, norms, biases) goes through the model's own ``load_weights``.

This file imports nothing of mindrlhf: mindrlhf's environment (MindSpore, numpy 1.x) is not vLLM's.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable, NamedTuple

PROTOCOL = 1
_STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


# ---------------------------------------------------------------- in vLLM's worker process
class WeightSync:
    """Methods vLLM adds to its worker (``worker_extension_cls``), called by name through ``collective_rpc``."""

    def mindrlhf_load(self, shm_name: str, layout: list, changed: list | None) -> dict:
        """Copy the block's arrays (``layout``: [name, shape, dtype, offset] rows) into the live model in place;
        with ``changed``, only the parameters built from those names. Returns counts and seconds."""
        import numpy as np
        import torch

        t0 = time.perf_counter()
        block = np.memmap(os.path.join("/dev/shm", shm_name.lstrip("/")), mode="r+", dtype=np.uint8)
        views = {name: torch.from_numpy(np.ndarray(tuple(shape), dtype, buffer=block, offset=off))
                 for name, shape, dtype, off in layout}
        want = set(views) if changed is None else set(changed)
        model = self.model_runner.model
        tied = "lm_head.weight" not in views
        kept = set()  # sources of linears whose only copy is the handle's: not loaded into empty Parameters
        repacked = 0
        for module_name, linear in _packed_linears(model).items():
            sources = _hf_sources(module_name, tied)
            missing = [s for s in sources if s not in views]
            if missing:
                raise RuntimeError(f"{module_name}: the trainer sent no {missing[0]}")
            if linear.module.weight.numel() == 0:
                kept.update(sources)
            if want.isdisjoint(sources):
                continue
            weight = torch.cat([views[s] for s in sources]) if len(sources) > 1 else views[sources[0]]
            linear.repack(module_name, weight.to(linear.module.weight.dtype))
            repacked += 1
        rest = [(name, views[name]) for name in views if name in want and name not in kept]
        loaded = model.load_weights(iter(rest)) if rest else set()
        del views, block
        return {"repacked": repacked, "loaded": len(rest), "params": len(loaded) if loaded else 0,
                "seconds": time.perf_counter() - t0}


class _PackedLinear(NamedTuple):
    """A layer whose matmul runs on a packed copy of its weight, and the function that writes a new weight into
    that copy (``repack(module_name, weight)``, bound to the copy when the layer is found)."""

    module: Any
    repack: Callable[[str, Any], None]


def _packed_linears(model) -> dict[str, _PackedLinear]:
    """The layers whose matmul runs on a packed copy of the weight, each with its repack bound to that copy (a
    oneDNN handle, or sgl-kernel's packed tensor on AMX): the linears (their ``weight`` Parameter left empty) and
    the output head (vocabulary rows padded; the embedding's when tied)."""
    import torch

    out = {}
    for name, module in model.named_modules():
        linear = getattr(module, "cpu_linear", None)
        cells = [c.cell_contents for c in getattr(linear, "__closure__", None) or ()]
        for value in cells:
            if type(value).__name__ == "CPUDNNLGEMMHandler":
                out[name] = _PackedLinear(module, functools.partial(_repack_onednn, value))
        if name not in out and "weight_packed_linear_cpu" in getattr(getattr(linear, "__code__", None), "co_names", ()):
            (tensor,) = [v for v in cells if isinstance(v, torch.Tensor)]
            (rows,) = [v for v in cells if isinstance(v, int)]  # the engine's N
            out[name] = _PackedLinear(module, functools.partial(_repack_sgl, tensor, rows))
        if name not in out and getattr(getattr(module, "weight", None), "numel", lambda: 1)() == 0:
            raise RuntimeError(f"{name}: vLLM runs this linear through a kernel other than oneDNN's or sgl-kernel's "
                               "(zentorch on AMD Zen), which the in-place weight sync does not update yet")
    return out


def _hf_sources(module_name: str, tied: bool) -> tuple:
    """The HF tensors one vLLM linear is made of, in the order vLLM stacks them."""
    prefix, _, leaf = module_name.rpartition(".")
    if leaf in _STACKED:
        return tuple(f"{prefix}.{part}.weight" for part in _STACKED[leaf])
    if module_name == "lm_head" and tied:
        return ("model.embed_tokens.weight",)  # vLLM may keep a head of its own even when tied
    return (f"{module_name}.weight",)


def _pad_rows(weight, rows: int):
    """``weight`` (N, K) zero-padded to ``rows`` rows: the vocabulary padded to vLLM's multiple (those logits are
    never sampled)."""
    import torch

    n, k = weight.shape
    return torch.cat([weight, weight.new_zeros(rows - n, k)]) if n < rows else weight


def _repack_onednn(handler, module_name: str, weight) -> None:
    """Point a linear's oneDNN handle at a new packed copy of ``weight`` (N, K), rows zero-padded to the handle's N."""
    from vllm import _custom_ops as ops

    n, k = weight.shape
    if k != handler.k or n > handler.n:
        raise RuntimeError(f"{module_name}: the trainer's weight is {tuple(weight.shape)}, the engine's "
                           f"{(handler.n, handler.k)}")
    new = ops.create_onednn_mm(_pad_rows(weight, handler.n).t(), 32)
    old = handler.handler_tensor.clone()
    handler.handler_tensor.copy_(new.handler_tensor)  # the compiled graph now calls the new handle
    new.handler_tensor = old  # the old C++ handle is freed with ``new``: no leak, no double free


def _repack_sgl(tensor, rows: int, module_name: str, weight) -> None:
    """Overwrite sgl-kernel's packed ``tensor`` with ``weight`` (N, K) packed the same way, rows zero-padded to the
    engine's N (``rows``)."""
    import torch

    n, k = weight.shape
    new = torch.ops._C.convert_weight_packed(_pad_rows(weight, rows).contiguous())
    if new.shape != tensor.shape or new.dtype != tensor.dtype:
        raise RuntimeError(f"{module_name}: the trainer's weight {(n, k)} packs to {tuple(new.shape)} "
                           f"{new.dtype}, the engine holds {tuple(tensor.shape)} {tensor.dtype}")
    tensor.copy_(new)  # the compiled graph reads this tensor


# ---------------------------------------------------------------- the engine process
def _sampling_params(p: dict, index: int):
    from vllm import SamplingParams

    seed = (int(p["seed"]) * 1_000_003 + index) % (2 ** 31 - 1)
    return SamplingParams(
        n=int(p["n"]), temperature=float(p["temperature"]), top_p=float(p["top_p"]), top_k=int(p["top_k"]),
        min_p=float(p["min_p"]), repetition_penalty=float(p["repetition_penalty"]),
        max_tokens=int(p["max_tokens"]), min_tokens=int(p["min_tokens"]),
        stop_token_ids=[int(t) for t in p["stop_token_ids"]], ignore_eos=True,  # only the trainer's stop ids end
        seed=seed, logprobs=0, detokenize=False)


class Engine:
    """One ``vllm.LLM`` and the requests it answers."""

    def __init__(self, args: argparse.Namespace):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
        if args.ascend:  # vLLM-MindSpore replaces vLLM's platform and models once imported first (untested here)
            import vllm_mindspore  # noqa: F401
        from vllm import LLM

        # vLLM's worker processes import ``WeightSync`` by this module's name (``worker_extension_cls``).
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [os.path.dirname(os.path.abspath(__file__))] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        _check_head_size(args.model)
        t0 = time.perf_counter()
        kwargs = {}
        if args.max_num_batched_tokens:
            kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
        self.llm = LLM(model=args.model, dtype=args.dtype, load_format="dummy", skip_tokenizer_init=True,
                       max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, seed=args.seed,
                       enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                       worker_extension_cls="mindrlhf_vllm_engine.WeightSync", enforce_eager=args.enforce_eager,
                       **kwargs)
        self.start_s = time.perf_counter() - t0
        import vllm

        self.hello = {"ok": True, "protocol": PROTOCOL, "vllm": vllm.__version__, "dtype": args.dtype,
                      "model": args.model, "config": _read_config(args.model), "max_model_len": args.max_model_len,
                      "start_s": self.start_s, "pid": os.getpid()}

    def handle(self, req: dict) -> dict:
        op = req.get("op")
        if op == "generate":
            return self.generate(req["prompts"], req["params"])
        if op == "load_weights":
            out = self.llm.collective_rpc("mindrlhf_load", args=(req["shm"], req["layout"], req.get("changed")))
            t0 = time.perf_counter()
            self.llm.reset_prefix_cache()  # cached prompts were computed with the old weights
            res = dict(out[0])
            res["reset_s"] = time.perf_counter() - t0
            return {"ok": True, **res}
        if op == "release":
            self.llm.reset_prefix_cache()
            return {"ok": True}
        if op == "hello":
            return self.hello
        raise ValueError(f"unknown op {op!r}")

    def generate(self, prompts: list, params: dict) -> dict:
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": list(map(int, p))} for p in prompts],
                                 [_sampling_params(params, i) for i in range(len(prompts))], use_tqdm=False)
        rows = []
        for i, out in enumerate(outs):
            for c in out.outputs:
                ids = list(c.token_ids)
                lps = [float(step[t].logprob) for step, t in zip(c.logprobs or [], ids)]
                rows.append({"prompt_index": i, "token_ids": ids, "logprobs": lps,
                             "finish_reason": "stop" if c.finish_reason == "stop" else "length"})
        return {"ok": True, "completions": rows, "seconds": time.perf_counter() - t0}


def _check_head_size(model: str) -> None:
    """vLLM's CPU attention kernels take a few head sizes only; an other one fails at the first request."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    cfg = _read_config(model)
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head not in sizes:
        raise SystemExit(f"ValueError: the model's attention head size is {head}; vLLM's CPU attention supports "
                         f"{', '.join(map(str, sizes))}: use the native sampler (use_vllm false) for this model")


def _read_config(model: str) -> dict:
    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def serve(engine: Engine, path: str) -> None:
    """Answer one client at a time until a client sends ``close`` with ``shutdown``. A client that connects while
    another is served is told so and closed: two runs must not load their weights into one engine."""
    if os.path.exists(path):
        os.unlink(path)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path + ".tmp")
    os.replace(path + ".tmp", path)  # the path appears only once the engine can answer
    srv.listen(4)
    print(f"mindrlhf vLLM engine ready on {path} (started in {engine.start_s:.0f} s)", file=sys.stderr, flush=True)
    idle = threading.Event()
    idle.set()
    stop = threading.Event()

    def client(conn: socket.socket) -> None:
        try:
            with conn, conn.makefile("rwb") as f:
                f.write((json.dumps(engine.hello) + "\n").encode())
                f.flush()
                for line in f:
                    req = json.loads(line)
                    if req.get("op") == "close":
                        if req.get("shutdown"):
                            stop.set()
                        idle.set()  # before the answer: the client's next run may connect right after it
                        f.write(b'{"ok": true}\n')
                        f.flush()
                        if stop.is_set():
                            socket.socket(socket.AF_UNIX).connect(path)  # wakes the accept loop
                        return
                    try:
                        res = engine.handle(req)
                    except Exception as e:  # the error goes to the client, which raises it as one line
                        traceback.print_exc(file=sys.stderr)
                        res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                    f.write((json.dumps(res) + "\n").encode())
                    f.flush()
        except OSError:
            pass  # the client went away
        finally:
            idle.set()

    while not stop.is_set():
        conn, _ = srv.accept()
        if stop.is_set():
            conn.close()
            break
        # A client that went away without saying so is noticed by its thread within moments: wait that long.
        if not idle.wait(timeout=5.0):
            with conn:
                msg = {"ok": False, "protocol": PROTOCOL, "error": "busy: the engine serves another run; give each "
                       "run its own engine (leave vllm_server empty) or wait for that run to end"}
                conn.sendall((json.dumps(msg) + "\n").encode())
            continue
        idle.clear()
        threading.Thread(target=client, args=(conn,), daemon=True).start()
    srv.close()
    os.unlink(path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--socket", required=True, help="Unix socket path to serve on")
    p.add_argument("--model", required=True, help="folder with the model's Hugging Face config.json")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max_model_len", type=int, default=1024)
    p.add_argument("--max_num_seqs", type=int, default=64)
    p.add_argument("--max_num_batched_tokens", type=int, default=0)
    p.add_argument("--kv_cache_gib", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce_eager", action="store_true", help="no torch.compile: a faster start, slower sampling")
    p.add_argument("--ascend", action="store_true", help="import vllm_mindspore before vllm (Ascend)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop_group)  # a client's terminate() stops vLLM's processes too
    _die_with_parent()
    try:
        serve(Engine(args), args.socket)
    finally:
        _stop_group()


def _die_with_parent() -> None:
    """An engine whose trainer (or ``mindrlhf-vllm-serve``) died stops, with vLLM's processes: nobody would ever
    close it, and it holds its KV cache and the cores it is bound to."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        print("mindrlhf vLLM engine: its parent process ended; stopping", file=sys.stderr, flush=True)
        _stop_group()

    threading.Thread(target=watch, daemon=True).start()


def _stop_group(*_) -> None:
    """Stop this engine's process group (itself and vLLM's engine processes) when it leads one: SIGTERM, then
    SIGKILL for what is left (vLLM's engine core can hang in its own shutdown once this process is going)."""
    if os.getpgid(0) == os.getpid():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.killpg(os.getpid(), signal.SIGTERM)
        time.sleep(3.0)
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(0)


if __name__ == "__main__":
    main()
