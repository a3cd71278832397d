"""Data: GSM8K parsing, prompt building, the mindrecord reader; SFT, preference and prompt rows from JSONL
(``text_rows``).

The converter lives in ``mindrlhf.data.rlhf_data`` (not imported here, so that
``python -m mindrlhf.data.rlhf_data`` runs without a double-import warning).
"""
from mindrlhf.data.dataset import PromptDataset
from mindrlhf.data.gsm8k import DEFAULT_SYSTEM_PROMPT, build_prompt, extract_gsm8k_solution
from mindrlhf.data.report import ConversionReport, SkippedRow
from mindrlhf.data.text_rows import PairRows, PromptRows, SFTRows, read_pair_rows, read_prompt_rows, read_sft_rows

__all__ = ["DEFAULT_SYSTEM_PROMPT", "ConversionReport", "PairRows", "PromptDataset", "PromptRows", "SFTRows",
           "SkippedRow", "build_prompt", "extract_gsm8k_solution", "read_pair_rows", "read_prompt_rows",
           "read_sft_rows"]
