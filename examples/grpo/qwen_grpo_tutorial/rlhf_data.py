"""Convert GSM8K (or another JSONL math set) into the prompt mindrecord used by GRPO training.

    python examples/grpo/qwen_grpo_tutorial/rlhf_data.py --vocab_path vocab.json \\
        --merges_file_path merges.txt --file_path gsm8k/train.jsonl --output_path gsm8k_train.mindrecord

All options: ``--help``; the work is done by ``mindrlhf.data.rlhf_data``.
"""
from mindrlhf.data.rlhf_data import main

if __name__ == "__main__":
    raise SystemExit(main())
