"""How much padding and how many layer-graph shapes the offline stages' micro-batches cost, counted, not timed.

    python bench/micro_batch_shapes.py                      # the packaged GSM8K sample, SmolLM2's tokenizer
    python bench/micro_batch_shapes.py --sft_file rows.jsonl --steps 128 --batch_size 8 --micro_batch_size 4
    python bench/micro_batch_shapes.py --time dpo --time_steps 24   # and SmolLM2 steps with / without the grid

Rows: SFT rows (``--sft_file``, default: the packaged GSM8K sample as conversational rows, system prompt +
question -> reference solution) and preference pairs made from the same questions as ``bench/peer_trl.py`` makes
them (chosen = the question's reference solution, rejected = the next question's), tokenised as the stages read
them (``read_sft_rows``, ``read_pair_rows``). ``--steps`` random steps of ``--batch_size`` rows (a fixed seed)
are cut into micro-batches of ``--micro_batch_size`` rows / pairs by the stages' own functions
(``sft.sft_micro_batches``, ``dpo.pair_logp_micro_batches``) under each layout:

- ``data order``: the rows in the drawn order, each padded to multiples of 32 (the layout before
  ``micro_batch_order``);
- ``longest first``: ``micro_batch_order length`` (and SFT's shared cut where it is narrower);
- ``+ grid``: with the widths / shapes a run on static layer graphs pads to (``sft.micro_batch_widths``,
  ``trainer.offline.pair_shape_grid``), sampled with another seed than the steps counted here.

Printed per layout: the positions the decoder computes (SFT: rows x width; pairs: each pair's prompt once and its
two completions, as they pack behind the prompt), the real tokens, the distinct shapes the layer graphs see (SFT: the
width; pairs: prompt and completion widths) and the share of micro-batches whose shape is not among the first 8 a
run meets (those run the dynamic-shape graphs, ``layer_graphs.STATIC_VARIANTS``).

``--time sft|rm|dpo``: then times ``--time_steps`` steps of that stage on SmolLM2 (built as its command builds it,
every default but ``layer_graph_shapes static``; the rows above; steps of ``--batch_size`` in micro-batches of
``--micro_batch_size``) twice, each in a process of its own: as built (the grid) and with the grid removed (bucket
widths only, later shapes on the dynamic graphs). Printed per run: every step's seconds, the total and the mean of
the steps after the first 8 (when both runs have compiled their static shapes).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np


def _write_rows(sft_file: Path, work: Path) -> Tuple[Path, Path]:
    """The SFT file and a pair file made from its questions (chosen: its completion; rejected: the next row's)."""
    import mindrlhf.resources
    from mindrlhf.data.gsm8k import sft_row

    if sft_file is None:
        source = Path(mindrlhf.resources.__file__).parent / "gsm8k_train_sample.jsonl"
        rows = [json.loads(line) for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
        convs = [sft_row(r["question"], r["answer"]) for r in rows]
        sft_file = work / "sft.jsonl"
        sft_file.write_text("".join(json.dumps(c) + "\n" for c in convs), encoding="utf-8")
    convs = [json.loads(line) for line in Path(sft_file).read_text(encoding="utf-8").splitlines() if line.strip()]
    pairs = [{"prompt": c["prompt"], "chosen": c["completion"], "rejected": convs[(i + 1) % len(convs)]["completion"]}
             for i, c in enumerate(convs)]
    pair_file = work / "pairs.jsonl"
    pair_file.write_text("".join(json.dumps(p) + "\n" for p in pairs), encoding="utf-8")
    return Path(sft_file), pair_file


def _count(steps: List[np.ndarray], cut: Callable[[np.ndarray], List[Dict[str, np.ndarray]]],
           shape_of: Callable[[Dict[str, np.ndarray]], Tuple], positions_of: Callable[[Dict[str, np.ndarray]], int],
           static: int) -> Dict[str, float]:
    """Positions, distinct shapes and the share of micro-batches past the first ``static`` shapes met."""
    first: List[Tuple] = []
    seen, dynamic, total, positions = set(), 0, 0, 0
    for rows in steps:
        for mb in cut(rows):
            shape = shape_of(mb)
            seen.add(shape)
            if shape not in first and len(first) < static:
                first.append(shape)
            dynamic += shape not in first
            total += 1
            positions += positions_of(mb)
    return {"positions": positions, "shapes": len(seen), "dynamic": dynamic / max(total, 1)}


def _print(title: str, real: int, results: Dict[str, Dict[str, float]]) -> None:
    print(f"\n{title}: {real:,} real tokens")
    print("| layout | positions | vs data order | shapes | micro-batches on dynamic graphs |")
    print("| --- | --- | --- | --- | --- |")
    base = results["data order"]["positions"]
    for name, r in results.items():
        print(f"| {name} | {r['positions']:,} | {r['positions'] / base:.3f} | {r['shapes']} | {r['dynamic']:.0%} |")


def _timed_child(stage: str, rows_file: str, steps: int, batch: int, micro: int, grid: bool) -> None:
    """``steps`` steps of ``stage`` on SmolLM2 over ``rows_file``, with its micro-batch grid or without; prints one
    JSON line of the steps' seconds."""
    import importlib

    from mindrlhf.checkpoint.smollm2 import prepare_smollm2
    from mindrlhf.trainer.entry import setup_runtime

    parse = getattr(importlib.import_module("mindrlhf.configs.offline"), f"parse_{stage}_args")
    with tempfile.TemporaryDirectory() as out:
        cfg = parse(["--model", str(prepare_smollm2()), "--train_file", rows_file, "--output_dir", out, "--max_steps",
                     str(steps), "--batch_size", str(batch), "--micro_batch_size", str(micro), "--max_length", "2048",
                     "--save_steps", "0", "--progress_bar", "false", "--tensorboard", "false",
                     "--layer_graph_shapes", "static"])
        trainer = importlib.import_module(f"mindrlhf.{stage}").build_trainer(cfg, setup_runtime(cfg))
        grid_attr = "widths" if stage == "sft" else "shapes"
        if not grid:
            setattr(trainer, grid_attr, None)
        seconds = []
        for _ in range(steps):
            start = time.perf_counter()
            trainer.train_one_step()
            seconds.append(time.perf_counter() - start)
        print(json.dumps({"grid": getattr(trainer, grid_attr), "seconds": seconds}, default=str))


def _time(stage: str, rows_file: Path, args) -> None:
    """Both runs of ``--time`` (see the module docstring), one after the other, each in its own process."""
    print(f"\n{stage} on SmolLM2, {args.time_steps} steps of {args.batch_size} in micro-batches of "
          f"{args.micro_batch_size}, static layer graphs")
    print("| micro-batches | total s | mean s of steps 9.. | steps s |")
    print("| --- | --- | --- | --- |")
    for grid in (True, False):
        proc = subprocess.run([sys.executable, __file__, "--child", stage, str(rows_file), str(args.time_steps),
                               str(args.batch_size), str(args.micro_batch_size), str(int(grid))],
                              capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(proc.stderr[-3000:])
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        secs = res["seconds"]
        name = f"the grid {res['grid']}" if grid else "bucket widths only"
        print(f"| {name} | {sum(secs):.1f} | {statistics.mean(secs[8:] or secs):.2f} | "
              f"{' '.join(f'{x:.1f}' for x in secs)} |")


def main(argv: Sequence[str] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft_file", type=Path, default=None, help="conversational SFT rows (default: the GSM8K sample)")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--micro_batch_size", type=int, default=4)
    ap.add_argument("--max_length", type=int, default=2048)
    ap.add_argument("--time", choices=("sft", "rm", "dpo"), default=None,
                    help="also time this stage's SmolLM2 steps with and without the grid")
    ap.add_argument("--time_steps", type=int, default=24)
    ap.add_argument("--child", nargs=6, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        stage, rows_file, steps, batch, micro, grid = args.child
        return _timed_child(stage, rows_file, int(steps), int(batch), int(micro), grid == "1")

    from mindrlhf.checkpoint.smollm2 import prepare_smollm2
    from mindrlhf.configs.offline import parse_dpo_args
    from mindrlhf.data.text_rows import read_pair_rows, read_sft_rows
    from mindrlhf.dpo import pair_logp_micro_batches
    from mindrlhf.models.layer_graphs import STATIC_VARIANTS
    from mindrlhf.sft import micro_batch_widths, sequences, sft_micro_batches, split_point
    from mindrlhf.tokenizer import resolve_tokenizer
    from mindrlhf.trainer.offline import longest_first, pair_lengths, pair_shape_grid

    tokenizer = resolve_tokenizer(prepare_smollm2())
    rng = np.random.default_rng(1)
    mb = args.micro_batch_size
    work = tempfile.TemporaryDirectory()
    sft_file, pair_file = _write_rows(args.sft_file, Path(work.name))
    rows, _ = read_sft_rows(sft_file, tokenizer, max_length=args.max_length, show_progress=False)
    pairs, _ = read_pair_rows(pair_file, tokenizer, max_length=args.max_length, show_progress=False)

    seqs = sequences(rows)
    ids, trained = seqs["input_ids"], seqs["trained"]
    steps = [rng.choice(len(ids), min(args.batch_size, len(ids)), replace=False) for _ in range(args.steps)]
    widths = micro_batch_widths(ids, [split_point(m) for m in trained], STATIC_VARIANTS)

    def sft_cut(order: bool, cut: str, grid) -> Callable:
        def run(pick):
            step = {"i": [ids[i] for i in pick], "t": [trained[i] for i in pick]}
            if order:
                step = longest_first(step, [len(x) for x in step["i"]])
            return sft_micro_batches(step["i"], step["t"], mb, 0, cut=cut, widths=grid)
        return run

    def sft_width(batch):
        return batch["input_ids"].shape[1]

    def sft_positions(batch):
        return batch["input_ids"].size

    _print(f"SFT, {len(ids)} rows, {args.steps} steps of {args.batch_size} in micro-batches of {mb} "
           f"(grid {widths})", sum(len(ids[i]) for s in steps for i in s),
           {"data order": _count(steps, sft_cut(False, "row", None), sft_width, sft_positions, STATIC_VARIANTS),
            "longest first": _count(steps, sft_cut(True, "auto", None), sft_width, sft_positions, STATIC_VARIANTS),
            "+ grid": _count(steps, sft_cut(True, "auto", widths), sft_width, sft_positions, STATIC_VARIANTS)})

    prompts, chosen, rejected = pairs.prompt_ids, pairs.chosen_ids, pairs.rejected_ids
    with tempfile.TemporaryDirectory() as tmp:
        cfg = parse_dpo_args(["--model", "m", "--train_file", "f", "--output_dir", tmp, "--batch_size",
                              str(args.batch_size), "--micro_batch_size", str(mb), "--layer_graph_shapes", "static"])
    lengths = pair_lengths(prompts, chosen, rejected)
    shapes = pair_shape_grid(cfg, *lengths)
    pair_steps = [rng.choice(len(prompts), min(args.batch_size, len(prompts)), replace=False)
                  for _ in range(args.steps)]

    def pair_cut(order: bool, grid) -> Callable:
        def run(pick):
            step = {"p": [prompts[i] for i in pick], "c": [chosen[i] for i in pick], "r": [rejected[i] for i in pick]}
            if order:
                step = longest_first(step, [lengths[2][i] for i in pick])
            return pair_logp_micro_batches(step["p"], step["c"], step["r"], mb, 0, shapes=grid)
        return run

    def pair_shape(batch):
        width_c = batch["completion_ids"].shape[1]
        return batch["input_ids"].shape[1] + 1 - width_c, width_c

    def pair_positions(batch):
        width_p, width_c = pair_shape(batch)
        return batch["input_ids"].shape[0] // 2 * (width_p + 2 * width_c)

    real = sum(lengths[2][i] - len(prompts[i]) for s in pair_steps for i in s)  # each prompt once
    _print(f"Pairs (DPO, RM), {len(prompts)} pairs, {args.steps} steps of {args.batch_size} in micro-batches of {mb} "
           f"(grid {shapes})", real,
           {"data order": _count(pair_steps, pair_cut(False, None), pair_shape, pair_positions, STATIC_VARIANTS),
            "longest first": _count(pair_steps, pair_cut(True, None), pair_shape, pair_positions, STATIC_VARIANTS),
            "+ grid": _count(pair_steps, pair_cut(True, shapes), pair_shape, pair_positions, STATIC_VARIANTS)})
    if args.time:
        _time(args.time, sft_file if args.time == "sft" else pair_file, args)
    work.cleanup()


if __name__ == "__main__":
    main()
