"""Installs the ``mindrlhf`` package: GRPO-family RL post-training of LLMs on MindSpore."""
from setuptools import find_packages, setup

setup(
    name="mindrlhf",
    version="0.1.0",
    description="MindSpore-native RL post-training (GRPO, GSPO, DAPO, Dr.GRPO) for Qwen2.5 / Llama models",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["mindrlhf", "mindrlhf.*"]),
    package_data={"mindrlhf": ["resources/*", "resources/**/*"]},
    include_package_data=True,
    install_requires=[
        "mindspore==2.10.0",
        # MindSpore 2.10's C extension is built against numpy 1.x (numpy 2 fails in pyboost ops).
        "numpy<2",
        "tokenizers>=0.19",
        "safetensors>=0.4",
        "pyyaml>=6",
        "jinja2>=3.1",
        "tqdm>=4.60",
        "sentencepiece>=0.1.99",
    ],
    extras_require={
        # torch/transformers are references for parity tests and peers for benchmarks only.
        "test": ["pytest>=7", "torch==2.13.0", "transformers>=4.45", "gguf>=0.10"],
        "smollm2": ["gguf>=0.10"],
    },
    entry_points={
        "console_scripts": [
            "mindrlhf-convert-weight=mindrlhf.tools.convert_weight:main",
            "mindrlhf-transform-checkpoint=mindrlhf.tools.transform_checkpoint:main",
            "mindrlhf-gguf-to-hf=mindrlhf.tools.gguf_to_hf:main",
            "mindrlhf-data=mindrlhf.data.rlhf_data:main",
            "mindrlhf-grpo=mindrlhf.grpo:main",
            "mindrlhf-eval=mindrlhf.evaluation.gsm8k_eval:main",
            "mindrlhf-reward-trend=mindrlhf.tools.reward_trend:main",
        ]
    },
)
