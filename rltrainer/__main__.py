"""``python -m rltrainer fit --config grpo.yaml``: the config-file CLI, :mod:`rltrainer.cli`."""

import sys

from rltrainer.cli import main

if __name__ == "__main__":
    sys.exit(main())
