"""The vLLM engine process of the vLLM sampler (``mindrlhf_vllm_engine.py``, run by its path in vLLM's own
virtualenv: it imports nothing of mindrlhf, whose environment it does not share)."""
