"""One-stage GRPO training (the tutorial's entry point).

    python grpo_one_stage.py [--config grpo_config.yaml] [--field value ...]
    msrun --worker_num=2 --local_worker_num=2 --master_port=8118 --join=True --log_dir=log \
        grpo_one_stage.py --config grpo_config.yaml --use_parallel true --train_dp 2 --infer_dp 2

Every option is a field of mindrlhf/configs/grpo_configs.py; see docs/config_reference.md.
"""
from mindrlhf.grpo import main

if __name__ == "__main__":
    raise SystemExit(main())
