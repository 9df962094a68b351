"""train.py with one thing broken on purpose, for tests/test_compare.py: at tp = 2 only, the
gradient of the parameter named by the environment variable DOUBLE_GRADIENT_AT_TP2 is doubled (a
hook on it, from step 1). Everything else is train.py's own."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train  # noqa: E402

build = train.build


def build_with_a_doubled_gradient(cfg, run):
    parts = build(cfg, run)
    params = dict(parts.model.named_parameters())
    name = os.environ["DOUBLE_GRADIENT_AT_TP2"]
    if run.layout.tp == 2 and name in params:  # (a pipeline stage holds only its own blocks)
        params[name].register_hook(lambda grad: 2 * grad)
    return parts


train.build = build_with_a_doubled_gradient

if __name__ == "__main__":
    train.run_script(train.main, sys.argv[1:])  # as train.py ends
