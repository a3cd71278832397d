r"""Any training stage (``mindrlhf-<STAGE>``) as a script, for msrun, which launches script files.

    python examples/stages/run.py STAGE [--config FILE.yaml] [--field value ...]
    msrun --worker_num=2 --local_worker_num=2 --master_port=8118 --join=True --log_dir=log \
        examples/stages/run.py STAGE --use_parallel true --train_dp 2 [--field value ...]

STAGE is a name of the stage table (``mindrlhf.registry.STAGES``, e.g. sft or dpo; a wrong name lists them); the
flags are the ones ``mindrlhf-<STAGE>`` takes, every field of the stage's config (see its docs/config_reference*.md).
"""
import sys
from typing import Optional, Sequence

from mindrlhf.registry import stage
from mindrlhf.utils.cli import run_cli


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the stage named by the first argument on the remaining ones."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    return run_cli(lambda rest: stage(argv[0]).main(rest), argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
