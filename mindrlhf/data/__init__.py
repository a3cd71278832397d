"""Prompt data: GSM8K parsing, prompt building, the mindrecord reader.

The converter lives in ``mindrlhf.data.rlhf_data`` (not imported here, so that
``python -m mindrlhf.data.rlhf_data`` runs without a double-import warning).
"""
from mindrlhf.data.dataset import PromptDataset
from mindrlhf.data.gsm8k import DEFAULT_SYSTEM_PROMPT, build_prompt, extract_gsm8k_solution

__all__ = ["DEFAULT_SYSTEM_PROMPT", "PromptDataset", "build_prompt", "extract_gsm8k_solution"]
