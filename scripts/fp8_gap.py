"""How far FP8 moves a run from the same run in fp32: the equivalence matrix's tiny model
(tests/matrix.py: 6 steps, its data, its settings) trained in one process with fp8 'none',
'tensorwise' and 'rowwise', and the largest relative difference of each FP8 run's loss and gradient
norm from the fp32 run's. Beside the matrix's fp8 rows (a layout against one process, both in FP8)
it shows the scale: the layouts agree far closer than FP8 is to fp32 (docs/training.md#fp8).

    python scripts/fp8_gap.py            (about a minute on one core)
"""

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

import matrix  # noqa: E402
from dist_utils import read_records  # noqa: E402


def gaps(model, root, data):
    """{recipe: (largest relative loss difference, largest relative grad norm difference)} from
    fp32."""
    runs = {}
    for recipe in ("none", "tensorwise", "rowwise"):
        out = os.path.join(root, f"{model}-{recipe}")
        error = matrix.run_one(
            matrix.argv_of(matrix.settings_of(matrix._case(model=model, fp8=recipe)), data, out)
        )
        assert error is None, error
        runs[recipe] = {r["step"]: r for r in read_records([f"--out_dir={out}"]) if "loss" in r}
    fp32 = runs.pop("none")
    relative = lambda run, key: max(
        abs(r[key] - fp32[s][key]) / abs(fp32[s][key]) for s, r in run.items()
    )
    return {
        recipe: (relative(run, "loss"), relative(run, "grad_norm")) for recipe, run in runs.items()
    }


def main():
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root:
        data = matrix.make_matrix_data(os.path.join(root, "data"))
        for model in ("dense_gqa", "moe_dropless"):
            name = matrix.MODEL_NAMES[model]
            for recipe, (loss, norm) in gaps(model, root, data).items():
                print(
                    f"{name}, fp8 {recipe}: over {matrix.STEPS} steps the loss is at most "
                    f"{loss:.1e} and the gradient norm {norm:.1e} (relative) from the fp32 run"
                )


if __name__ == "__main__":
    main()
