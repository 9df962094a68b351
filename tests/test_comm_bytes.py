import io
from contextlib import redirect_stdout

import build
from ledger import CommLedger, layout_groups
from tools import machines, step_time
from tools.bench import Picotron, parse_args

from dist_utils import run_ranks

TINY = [
    "--n_layer=4", "--n_embd=32", "--n_head=4", "--n_kv_head=2", "--block_size=16",
    "--batch_size=2", "--vocab_size=128", "--gradient_accumulation_steps=2",
    "--bucket_size_mb=0.01", "--device=cpu", "--dtype=float32", "--compile=False",
]


def _ledger_bytes(rank, world_size, layouts):
    out = []
    for argv in layouts:
        with redirect_stdout(io.StringIO()):
            cfg, _ = parse_args(TINY + argv)
            setup = build.setup(cfg, training=False)
            picotron = Picotron(cfg, setup)
        picotron.step(0)
        picotron.step(1)
        with CommLedger(layout_groups(setup.layout, picotron.parts.pipeline)) as ledger:
            picotron.step(2)
        run = step_time.run_of(cfg, setup.layout.world_size)
        predicted = step_time.predict(setup.model_cfg, run, machines.load_machine("a100"))
        out.append((ledger.bytes_sent(), ledger.summary(), predicted["comm_bytes"]))
    return out
