"""PPO (``mindrlhf-ppo``) as a script, for msrun, which launches script files.

    python examples/stages/ppo.py [--config ppo.yaml] [--field value ...]
    msrun --worker_num=2 --local_worker_num=2 --master_port=8118 --join=True --log_dir=log \
        examples/stages/ppo.py --use_parallel true --train_dp 2 --infer_dp 2 [--field value ...]

Every option is a field of the stage's config; see docs/config_reference_ppo.md.
"""
from mindrlhf.ppo import main

if __name__ == "__main__":
    raise SystemExit(main())
