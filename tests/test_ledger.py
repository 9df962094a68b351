"""The communication ledger (ledger.py): each torch.distributed op's bytes by nccl-tests'
accounting, its mechanism from its process group, its waits, and nothing wrapped outside its block.
One launch of 4 ranks runs every op once with tensors of known sizes; the expected bytes are written
out by hand below, not computed by ledger.py's formulas."""

import torch
import torch.distributed as dist

from dist_utils import make_token_data, run_ranks, train_on_ranks
from ledger import CommLedger

N = 4
F32 = 4  # bytes


def _every_op(rank, world_size):
    pair = dist.new_group([0, 1])  # a "tp" group of 2 (ranks 2, 3 make their own)
    other = dist.new_group([2, 3])
    tp = pair if rank < 2 else other
    original = dist.all_reduce
    with CommLedger({tp: "tp"}) as ledger:
        assert dist.all_reduce is not original
        dist.all_reduce(torch.ones(100))  # world: 2 * 3/4 * 400 = 600 bytes
        dist.all_reduce(torch.ones(100), group=tp)  # tp: 2 * 1/2 * 400 = 400 bytes
        out = torch.empty(400)
        dist.all_gather_into_tensor(out, torch.ones(100))  # world: 3/4 * 1600 = 1200
        dist.reduce_scatter_tensor(torch.empty(100), torch.ones(400))  # world: 3/4 * 1600 = 1200
        # all-to-all, uneven: rank r sends r + 1 rows of 10 floats to each rank; the bytes bound for
        # the others are 3 * (r + 1) * 40
        rows = rank + 1
        recv_splits = [r + 1 for r in range(N)]
        dist.all_to_all_single(
            torch.empty(sum(recv_splits), 10),
            torch.ones(N * rows, 10),
            output_split_sizes=recv_splits,
            input_split_sizes=[rows] * N,
        )
        work = dist.all_reduce(torch.ones(100), group=tp, async_op=True)
        work.wait()
        peer = rank ^ 1  # a pipeline-like exchange with the neighbour, on the tp group
        ops = [
            dist.P2POp(dist.isend, torch.ones(25), peer, tp),
            dist.P2POp(dist.irecv, torch.empty(25), peer, tp),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    assert dist.all_reduce is original and dist.isend.__name__ == "isend"
    return ledger.summary(), ledger.waits(), ledger.bytes_sent()


def test_every_op_counts_the_bytes_nccl_tests_counts_under_its_groups_mechanism():
    for rank, (summary, waits, sent) in enumerate(run_ranks(_every_op, N)):
        world, tp, ep = summary["world"], summary["tp"], summary["ep"]
        assert world["all_reduce"]["bytes"] == 2 * 3 * 100 * F32 // 4
        assert world["all_gather"]["bytes"] == 3 * 400 * F32 // 4
        assert world["reduce_scatter"]["bytes"] == 3 * 400 * F32 // 4
        assert ep["all_to_all"]["bytes"] == 3 * (rank + 1) * 10 * F32
        assert tp["all_reduce"] == {
            "calls": 2,
            "bytes": 2 * (2 * 1 * 100 * F32 // 2),
            "waited_ms": tp["all_reduce"]["waited_ms"],
        }
        assert tp["send"]["bytes"] == 25 * F32 and tp["recv"]["bytes"] == 0
        assert tp["send"]["calls"] == tp["recv"]["calls"] == 1
        assert sent["tp"] == 800 + 100
        assert set(waits) == {"dp", "tp", "cp", "ep", "pp"} and waits["tp"] >= 0.0


def test_train_prints_the_first_steps_ledger_with_comm_ledger(tmp_path):
    """train.py --comm_ledger=True at tp=2: the first step's table, each mechanism's calls, MiB sent
    and ms waited per op (the tensor-parallel all-reduces among them), printed once."""
    make_token_data(tmp_path / "data", vocab_size=512)
    argv = [
        "--n_layer=2",
        "--n_head=4",
        "--n_embd=32",
        "--block_size=32",
        "--batch_size=2",
        "--max_iters=2",
        "--eval_interval=0",
        "--checkpoint_interval=0",
        "--device=cpu",
        "--peak_flops=1e12",
        "--tp=2",
        "--comm_ledger=True",
        f"--data_dir={tmp_path / 'data'}",
        f"--out_dir={tmp_path / 'out'}",
    ]
    ((_, out),) = train_on_ranks([argv], 2)
    assert out.count("communication ledger of step 1, rank 0") == 1, out
    table = out.split("communication ledger of step 1, rank 0")[1].splitlines()
    assert table[1].split() == ["mechanism", "op", "calls", "MiB", "sent", "ms", "waited"]
    tp_row = next(line.split() for line in table if line.startswith("tp "))
    assert tp_row[1] == "all_reduce" and int(tp_row[2]) > 0 and float(tp_row[3]) > 0, tp_row
