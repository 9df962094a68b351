"""Context parallelism (ring_attention.py): the zigzag split and its balance, and ring attention at cp = 2
and cp = 4 equal to one process's plain causal attention, output and gradients, fp32 on CPU with gloo.

The reference is written out here, on the whole sequence: softmax(q k^T * scale, soft-capped, causal) v,
in fp32, key/value heads repeated for GQA/MQA. To pay the process start-up once per cp, one run_ranks call
per cp runs every case and returns each rank's pieces (module fixture); the tests below each read one
behaviour from it.
"""
import math

import pytest
import torch
import torch.distributed as dist

import parallel as ra
from dist_utils import run_ranks
from parallel import (attention_work, check_context_split, ring_attention, ring_attention_bytes,
                            split_for_every_rank, zigzag_gather, zigzag_split)

B, T = 2, 32
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32; the largest difference seen, 3.9e-6 in a gradient of ~7, is a third of it

# name -> query heads, key/value heads, q/k head size, v head size, soft-cap, document masking
CASES = {
    "mha": dict(H=4, H_kv=4, D=8, Dv=8, softcap=0.0, documents=False),
    "gqa": dict(H=4, H_kv=2, D=8, Dv=8, softcap=0.0, documents=False),
    "mqa": dict(H=4, H_kv=1, D=8, Dv=8, softcap=0.0, documents=False),
    "mla_like": dict(H=4, H_kv=4, D=12, Dv=8, softcap=0.0, documents=False),  # D = qk_nope + qk_rope != D_v
    "softcap": dict(H=4, H_kv=2, D=8, Dv=8, softcap=5.0, documents=False),
    "documents": dict(H=4, H_kv=2, D=8, Dv=8, softcap=0.0, documents=True),
}
# per batch row, the lengths of the documents packed into the window (boundaries fall inside chunks)
DOCUMENT_LENGTHS = [[5, 14, 13], [19, 3, 10]]


def make_inputs(name):
    """q, k, v, the output's gradient, and the window's positions and document ids (None without documents).
    q is scaled up so that the scores reach the soft-cap and the softmax is far from uniform."""
    case = CASES[name]
    g = torch.Generator().manual_seed(list(CASES).index(name))
    q = 2 * torch.randn(B, T, case["H"], case["D"], generator=g)
    k = torch.randn(B, T, case["H_kv"], case["D"], generator=g)
    v = torch.randn(B, T, case["H_kv"], case["Dv"], generator=g)
    dout = torch.randn(B, T, case["H"], case["Dv"], generator=g)
    if not case["documents"]:
        return q, k, v, dout, torch.arange(T), None
    documents = torch.stack([torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n)) for n in DOCUMENT_LENGTHS])
    starts = torch.stack([torch.tensor([sum(n[:d]) for d in range(len(n))])[doc] for n, doc in
                          zip(DOCUMENT_LENGTHS, documents)])
    positions = torch.arange(T) - starts  # (B, T): each document's positions restart at 0
    return q, k, v, dout, positions, documents


def reference_attention(q, k, v, softcap, documents=None):
    """Plain attention over the whole sequence: (B, T, H, D) -> (B, T, H, D_v)."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    visible = torch.ones(T, T, dtype=torch.bool).tril()
    if documents is not None:
        visible = visible & (documents[:, :, None] == documents[:, None, :])[:, None]  # (B, 1, T, T)
    return (scores.masked_fill(~visible, float("-inf")).softmax(dim=-1) @ v).transpose(1, 2)


def reference(name):
    """The reference output and the gradients of q, k, v, on the whole sequence."""
    q, k, v, dout, _, documents = make_inputs(name)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = reference_attention(q, k, v, CASES[name]["softcap"], documents)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))


def run_case(name, group):
    """This rank's ring attention of case `name`: its output, its gradients, and the bytes it sent."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, dout, positions, documents = make_inputs(name)
    q, k, v = (zigzag_split(t, cp, rank).requires_grad_() for t in (q, k, v))
    positions = split_for_every_rank(positions, cp)  # (cp, T/cp) or (cp, B, T/cp)
    documents = split_for_every_rank(documents, cp) if documents is not None else None
    SENT.clear()
    out = ring_attention(q, k, v, positions, group, softcap=CASES[name]["softcap"], documents=documents)
    forward_bytes, blocks = sum(SENT), BLOCKS.pop("count", 0)
    SENT.clear()
    out.backward(zigzag_split(dout, cp, rank))
    # numpy: torch tensors would cross the result queue as shared memory, gone once the worker exits
    return dict(out=out.detach().numpy(), dq=q.grad.numpy(), dk=k.grad.numpy(), dv=v.grad.numpy(),
                forward_bytes=forward_bytes, backward_bytes=sum(SENT), blocks=blocks)


SENT, BLOCKS = [], {}  # in the worker processes: bytes of each isend, chunk pairs computed in forward


def _count_communication_and_blocks():
    batch_isend_irecv, block_forward = dist.batch_isend_irecv, ra._block_forward

    def counting_batch_isend_irecv(ops):
        SENT.extend(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return batch_isend_irecv(ops)

    def counting_block_forward(*args):
        BLOCKS["count"] = BLOCKS.get("count", 0) + 1
        return block_forward(*args)

    dist.batch_isend_irecv, ra._block_forward = counting_batch_isend_irecv, counting_block_forward


def _ring_worker(rank, world_size):
    _count_communication_and_blocks()
    results = {name: run_case(name, dist.group.WORLD) for name in CASES}
    if world_size == 4:  # a cp group that is not the whole world: ranks {0, 2} and {1, 3}
        pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        results["subgroup"] = run_case("gqa", pairs[rank % 2])
    return results


@pytest.fixture(scope="module")
def ring2():
    return 2, run_ranks(_ring_worker, 2)


@pytest.fixture(scope="module")
def ring4():
    return 4, run_ranks(_ring_worker, 4)


@pytest.fixture(params=["ring2", "ring4"], ids=["cp2", "cp4"])
def ring(request):
    """(cp, every rank's results) of one launch."""
    return request.getfixturevalue(request.param)


def gathered(pieces, key):
    """The whole sequence of one result from every cp rank's pieces, in rank order."""
    return zigzag_gather([torch.from_numpy(p[key]) for p in pieces])


# -----------------------------------------------------------------------------
# the split


def test_zigzag_split_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r():
    tokens = torch.arange(8)[None]
    assert [zigzag_split(tokens, 2, r)[0].tolist() for r in range(2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [zigzag_split(tokens, 4, r)[0].tolist() for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_zigzag_gather_undoes_the_split():
    x = torch.randn(2, 24, 3)
    for cp in (1, 2, 3, 4):
        for dim in (1, -2):
            assert torch.equal(zigzag_gather([zigzag_split(x, cp, r, dim) for r in range(cp)], dim), x)


def test_length_that_does_not_split_into_2cp_chunks_is_a_clear_error():
    with pytest.raises(ValueError, match=r"block_size = 30 does not split into 2 \* cp = 4 .* multiple of 4 "
                                         r"\(e.g. 28 or 32\)"):
        check_context_split(30, cp=2)
    with pytest.raises(ValueError, match=r"block_size = 36 does not split into 2 \* cp \* tp = 8 \(cp = 2, tp = 2"):
        check_context_split(36, cp=2, tp=2)
    with pytest.raises(ValueError, match=r"block_size = 12 does not split into 2 \* cp = 8"):
        zigzag_split(torch.zeros(1, 12), cp=4, cp_rank=0)
    check_context_split(32, cp=4, tp=2)


def unmasked_pairs(tokens):
    """Causal (query, key) pairs of the queries at these global indices: query i sees keys 0..i."""
    return sum(int(i) + 1 for i in tokens)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_gives_every_rank_the_same_attention_work(cp):
    seq = 64
    tokens = split_for_every_rank(torch.arange(seq), cp)  # global index = position here
    assert len({unmasked_pairs(t) for t in tokens}) == 1
    # 2cp - 1 chunk pairs under the diagonal and two on it, of 4cp^2 pairs (the section's count)
    assert attention_work(tokens) == [{"blocks": 2 * cp + 1, "scores": (2 * cp + 1) * (seq // (2 * cp)) ** 2}] * cp


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_contiguous_split_does_not_balance_the_work(cp):
    tokens = torch.arange(64).view(cp, -1)  # rank r holds tokens r*T/cp .. (r+1)*T/cp - 1
    pairs = [unmasked_pairs(t) for t in tokens]
    blocks = [w["blocks"] for w in attention_work(tokens)]
    assert pairs == sorted(pairs) and pairs[0] < pairs[-1]
    assert blocks == [4 * r + 3 for r in range(cp)]  # r whole pieces (4 chunk pairs each), 3 of its own


# -----------------------------------------------------------------------------
# one process: the ring of one is ordinary attention


@pytest.mark.parametrize("name", list(CASES))
def test_single_process_equals_plain_attention(name):
    q, k, v, dout, positions, documents = make_inputs(name)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(q, k, v, positions[None], None, softcap=CASES[name]["softcap"],
                         documents=documents[None] if documents is not None else None)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    expected = reference(name)
    torch.testing.assert_close(out, expected[0], **TOL)
    for got, want in zip(grads, expected[1:]):
        torch.testing.assert_close(got, want, **TOL)


def test_query_with_no_visible_key_gets_zeros_not_nan():
    # in a chunk pair a query can see none of the keys (another document); merged and differentiated, its
    # lse of -inf must give zeros
    # (B, H_kv, G, T, D): 3 queries, 5 keys
    q, k, v, dout = (torch.randn(1, 1, 1, n, d) for n, d in ((3, 4), (5, 4), (5, 2), (3, 2)))
    visible = torch.tensor([[True] * 5, [False] * 5, [True, True, False, False, False]])
    out, lse = ra._block_forward(q, k, v, visible, 0.5, 5.0)
    assert lse[..., 1].item() == float("-inf") and out[..., 1, :].abs().max().item() == 0.0
    empty = (torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    merged, merged_lse = ra._merge(*empty, out, lse)
    torch.testing.assert_close(merged, out)
    torch.testing.assert_close(ra._merge(*empty, *empty)[0], torch.zeros_like(out))
    dq, dk, dv = torch.zeros_like(q), torch.zeros(1, 1, 5, 4), torch.zeros(1, 1, 5, 2)
    delta = (dout * out).sum(-1)
    ra._block_backward(q, k, v, dout, merged_lse, delta, visible, 0.5, 5.0, dq, dk, dv)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert dq[..., 1, :].abs().max().item() == 0.0


# -----------------------------------------------------------------------------
# cp = 2 and cp = 4 (one launch each), against one process on the whole sequence


@pytest.mark.parametrize("name", list(CASES))
def test_ring_output_equals_one_process(ring, name):
    _, ranks = ring
    torch.testing.assert_close(gathered([r[name] for r in ranks], "out"), reference(name)[0], **TOL)


@pytest.mark.parametrize("name", list(CASES))
def test_ring_gradients_equal_one_process(ring, name):
    _, ranks = ring
    _, dq, dk, dv = reference(name)
    torch.testing.assert_close(gathered([r[name] for r in ranks], "dq"), dq, **TOL)
    torch.testing.assert_close(gathered([r[name] for r in ranks], "dk"), dk, **TOL)
    torch.testing.assert_close(gathered([r[name] for r in ranks], "dv"), dv, **TOL)


def test_ring_in_a_group_that_is_not_the_whole_world(ring4):
    _, ranks = ring4  # the 4-rank launch ran cp = 2 in the groups {0, 2} and {1, 3} too
    expected = reference("gqa")
    for group in ([0, 2], [1, 3]):
        pieces = [ranks[r]["subgroup"] for r in group]
        for i, key in enumerate(("out", "dq", "dk", "dv")):
            torch.testing.assert_close(gathered(pieces, key), expected[i], **TOL)


@pytest.mark.parametrize("name", list(CASES))
def test_ring_sends_the_analytic_bytes(ring, name):
    cp, ranks = ring
    case = CASES[name]
    expected = ring_attention_bytes(B, T // cp, case["H_kv"], case["D"], case["Dv"], cp, element_size=4)
    assert [(r[name]["forward_bytes"], r[name]["backward_bytes"]) for r in ranks] == \
        [(expected["forward"], expected["backward"])] * cp


def test_every_rank_computes_the_same_number_of_blocks(ring):
    cp, ranks = ring
    assert [r["mha"]["blocks"] for r in ranks] == [2 * cp + 1] * cp
    assert [r["mha"]["blocks"] for r in ranks] == [w["blocks"] for w in attention_work(
        split_for_every_rank(torch.arange(T), cp))]
