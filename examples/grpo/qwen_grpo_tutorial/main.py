"""GRPO with MindRLHF's tutorial command line (its main.py) and its sectioned grpo_config.yaml.

    python main.py --config ../../../model_configs/qwen_grpo/grpo_config_mindrlhf_cpu.yaml --use_vllm 0 \
        --actor_checkpoint_path MODEL --dataset_file DATA.mindrecord --max_steps 2
    msrun --worker_num=8 --local_worker_num=8 --master_port=9887 --join=True --log_dir=log main.py \
        --config grpo_config.yaml --tokenizer_dir M --dataset_file D --save_checkpoint_dir S \
        --actor_checkpoint_path M --ref_checkpoint_path M --generate_checkpoint_path M \
        --verifier_function "qwen_accuracy_reward,format_reward" --verifier_weight "1.0,1.0"

MindRLHF's flags, plus --use_vllm 0|1 and any --field value of docs/config_reference.md (applied last);
the YAML may be MindRLHF's (docs/reference/mindrlhf_config.md) or ours (grpo_config.yaml beside this file).
"""
from mindrlhf.grpo import tutorial_main

if __name__ == "__main__":
    raise SystemExit(tutorial_main())
