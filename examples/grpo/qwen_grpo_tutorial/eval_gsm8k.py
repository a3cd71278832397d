"""GSM8K evaluation of a model before/after GRPO (the tutorial's eval step).

    python eval_gsm8k.py --limit 64 --output eval_base.jsonl                 # embedded SmolLM2, greedy
    python eval_gsm8k.py --model qwen2.5-0.5b-instruct --mode maj --k 8 --limit 64   # HF dir or .ckpt + config.json

Every option: ``python eval_gsm8k.py --help`` (same as ``mindrlhf-eval``).
"""
from mindrlhf.evaluation.gsm8k_eval import main

if __name__ == "__main__":
    raise SystemExit(main())
