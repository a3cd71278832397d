"""mindrlhf: MindSpore-native RL post-training of LLMs (GRPO, GSPO, DAPO, Dr.GRPO)."""
__version__ = "0.1.0"
