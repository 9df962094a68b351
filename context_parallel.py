"""
Context parallelism: the zigzag split of every sequence across ranks and ring attention.

Context parallelism splits the sequence. Each of the cp ranks of a context-parallel group holds T/cp
of every window's tokens, and with them T/cp of every activation: the embedding, the norms, the MLP
and the loss work token by token, so they run on the local tokens unchanged. Attention alone needs
other ranks' tokens, because a query reads the keys and values of every earlier token.

Every cp rank holds the whole model, the same parameters, and computes the gradient of its own
tokens' part of the loss: the gradients are averaged over the dp x cp ranks that hold the same
parameters (parallel.py's data parallelism), and each rank's loss is its tokens' summed loss over
the microbatch's token count, times cp, so that the mean over the cp ranks is the microbatch's mean
loss and the average of their gradients its gradient (a factor cp off would hardly show in the
losses under AdamW, only in the gradient norm). A mixture-of-experts layer, whose expert capacity
couples every token of a microbatch, gathers its routing decisions from the whole window
(all_gather_context) to queue them as one process would.

The split. Causal attention's work is a triangle: a query late in the window sees many keys, an
early one few. Cut into contiguous pieces, rank r's queries would see r whole pieces of keys and
half its own, so the last rank would do 2cp-1 times the work of the first, which waits. So each
window is cut into 2*cp chunks and rank r holds chunk r and its mirror, chunk 2cp-1-r (the split of
Llama 3's context parallelism, Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.2).
Query chunk i sees key chunks 0..i, i of them whole and the diagonal one half, so rank r's two
chunks see r + (2cp-1-r) = 2cp-1 whole chunks and two diagonal halves: the same for every rank. RoPE
and the mask use the tokens' global positions, built on the host from the whole window and split the
same way as the tokens. The mask is "key position <= query position", so it holds for any split;
every rank is given every rank's positions (a few integers per token, on the host), so it decides
which blocks to skip there, without a device sync, and no positions need to travel with the keys.

Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
Context"). The key/value blocks travel round the group: at each of cp steps a rank attends its
queries to the block it holds while, point to point, it passes that block on to rank r+1 and
receives the next from rank r-1; the transfer is posted before the block is computed, so it overlaps
the compute. The partial outputs of the cp blocks are merged by their log-sum-exp. Each rank's two
chunks against the visiting two chunks make four chunk pairs: those the causal mask fully hides are
skipped, those it fully shows need no mask, the others (the diagonal) are masked.

Backward (a custom autograd function, as FlashAttention does it: Dao et al. 2022, "FlashAttention",
section 3.1 and appendix B) saves q, k, v, the output and the log-sum-exp, never the probabilities,
and recomputes each block's probabilities from them. The key/value blocks make the same trip round
the ring again; each carries with it an fp32 accumulator of its own gradients, which every rank it
visits adds to, and one more step brings the accumulator home to the rank that owns those keys.

Collectives, per attention layer, with S = B * (T/cp) * H_kv * (D + D_v) elements of k and v per
rank: forward cp-1 ring steps of S elements in k/v's dtype; backward cp-1 such steps plus cp steps
of the gradients, S elements in fp32 (see ring_attention_bytes). Each is one dist.batch_isend_irecv
of a send to the next rank and a receive from the previous, so no pair of neighbours can deadlock by
both sending first; k and v (or their two gradients) travel packed as one message.

Memory: activations per rank fall by cp, attention's too: besides q, k, v and the output it keeps
one fp32 log-sum-exp per query and head; the largest transients are one chunk pair's fp32 scores,
(B, H, T/2cp, T/2cp), which its probabilities overwrite, and in backward their gradient beside them.
The ring holds two k/v blocks (the one computed, the one arriving), and in backward two gradient
blocks.

Variants. GQA and MQA: the H_kv key/value heads travel, each serving H/H_kv query heads; their
gradients are the sums over those query heads. MLA: what travels is the per-head keys and values, H
* (qk_nope + qk_rope + v_head) numbers per token (320 for config/mla.py), not the compressed latent
(kv_lora_rank + qk_rope = 80): sending the latent would cost 4x fewer bytes, but every rank would
then run kv_up, the QK-norm and RoPE on each visiting block and sum kv_up's weight gradient over the
blocks; left for later. QK-norm and RoPE act on each token before attention, so they need nothing
here. Attention soft-capping (Gemma 2) is applied to each block's scores. Document masking: pass
each token's document id beside its position; a key is then visible when it is in the same document
and not later.
"""

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel import _all_gather_along, at_least_fp32, group_rank, group_size


def check_context_split(seq_len, cp):
    """The zigzag split needs 2*cp equal chunks (what sequence parallelism adds:
    settings.sequence_split_problems)."""
    pieces = 2 * cp
    if cp == 1 or seq_len % pieces == 0:
        return
    lower, upper = seq_len // pieces * pieces, (seq_len // pieces + 1) * pieces
    raise ValueError(
        f"block_size = {seq_len} does not split into 2 * cp = {pieces} (cp = {cp}) equal chunks: "
        f"context parallelism gives each rank chunk r and chunk 2*cp-1-r of every window. Set "
        f"block_size to a multiple of {pieces} (e.g. {lower or upper} or {upper}), or change cp"
    )


def zigzag_split(x, cp, cp_rank, dim=1):
    """cp rank cp_rank's tokens of x: chunks cp_rank and 2*cp-1-cp_rank of 2*cp along dim."""
    chunk, rest = divmod(x.shape[dim], 2 * cp)
    # (settings.check_layout stops such a block_size before a run starts, saying what to change)
    if rest:
        raise ValueError(
            f"zigzag_split: {x.shape[dim]} tokens do not split into 2 * cp = {2 * cp} equal chunks"
        )
    mine, mirror = cp_rank * chunk, (2 * cp - 1 - cp_rank) * chunk
    return torch.cat([x.narrow(dim, mine, chunk), x.narrow(dim, mirror, chunk)], dim=dim)


def zigzag_gather(parts, dim=1):
    """The inverse: the whole sequence from every cp rank's zigzag_split, given in rank order."""
    halves = [p.chunk(2, dim=dim) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


def all_gather_context(x, group, dim=1):
    """The whole window of x, from every cp rank's zigzag share of it (an all-gather, then
    zigzag_gather), with no gradient. A mixture-of-experts layer gathers its chosen expert ids this
    way (small integers) to queue them in the window's order, as one process does."""
    if group_size(group) == 1:
        return x
    # (every rank's share)
    return zigzag_gather(_all_gather_along(x, group, dim).chunk(group_size(group), dim), dim)


def split_for_every_rank(x, cp, split=zigzag_split):
    """Every cp rank's share of the last dim of x, stacked: (T,) -> (cp, T/cp), (B, T) -> (cp, B,
    T/cp). This is how ring_attention takes positions (and document ids): a rank knows which keys of
    a visiting block it may see without being sent anything, since it built the whole window's
    positions itself."""
    return torch.stack([split(x, cp, r, dim=-1) for r in range(cp)])


# The plan: which chunk pairs each ring step computes, decided on the host.
#
# Whether a pair of chunks is hidden, fully visible or partly visible follows from the positions'
# minima and maxima. Taken from device tensors, each such test would be a .item(), a host-device
# sync that stalls the GPU's queue, cp * 4 times per layer. The positions are built on the host
# (from the whole window), so the plan is made there from the host copy of every rank's positions:
# no sync, and nothing to send with the keys. Only the masks of the partly visible pairs are built
# on the device, from a device copy.


def visibility(positions, documents=None):
    """(keys, firsts), each like positions (cp, B or 1, T_local): key k is visible to query q when
    firsts[q] <= keys[k] <= keys[q]. Causal attention: keys are the positions, firsts 0. Document
    masking (documents: ids like positions, whose positions restart in each document) puts each
    document after the previous one and a query's first visible key at its document's start."""
    if documents is None:
        return positions, torch.zeros_like(positions)
    span = int(positions.max()) + 1
    return documents * span + positions, documents * span


def _pair_kind(q_key, q_first, kv_key):
    """'hidden', 'full' or 'masked' for queries (q_key, q_first) against keys kv_key, each (B, n):
    per batch row, a pair is hidden or full only when it is so in every row."""
    kv_lo, kv_hi = kv_key.amin(-1), kv_key.amax(-1)  # (B,)
    hidden = (kv_lo > q_key.amax(-1)) | (kv_hi < q_first.amin(-1))
    if bool(hidden.all()):
        return "hidden"
    full = (kv_hi <= q_key.amin(-1)) & (kv_lo >= q_first.amax(-1))
    return "full" if bool(full.all()) else "masked"


def block_plan(keys, firsts, rank):
    """For each ring step, the (query slice, key slice, 'full' or 'masked') pairs that rank computes
    of its two zigzag chunks against the visiting two; the hidden ones are left out. keys and
    firsts: visibility's, (cp, B, T_local) host tensors; at step i the block of rank (rank - i) % cp
    is visiting."""
    cp, T = keys.shape[0], keys.shape[-1]
    # (one token: one slice)
    slices = [s for s in (slice(0, T // 2), slice(T // 2, T)) if s.stop > s.start]
    plan = []
    for step in range(cp):
        source = (rank - step) % cp
        pairs = [
            (qs, ks, _pair_kind(keys[rank][..., qs], firsts[rank][..., qs], keys[source][..., ks]))
            for qs in slices
            for ks in slices
        ]
        plan.append([pair for pair in pairs if pair[2] != "hidden"])
    return plan


def attention_work(positions, documents=None):
    """Per rank, the chunk pairs computed and the score elements computed (per batch row and head)
    over one ring pass: the attention work each rank does. positions and documents as for
    ring_attention."""
    positions = positions if positions.dim() == 3 else positions[:, None]
    documents = documents if documents is None or documents.dim() == 3 else documents[:, None]
    keys, firsts = visibility(positions, documents)
    work = []
    for rank in range(positions.shape[0]):
        pairs = [pair for step in block_plan(keys, firsts, rank) for pair in step]
        scores = sum((qs.stop - qs.start) * (ks.stop - ks.start) for qs, ks, _ in pairs)
        work.append({"blocks": len(pairs), "scores": scores})
    return work


def ring_attention_bytes(batch, seq_len_local, n_kv_head, head_dim, v_head_dim, cp, element_size=4):
    """Bytes one rank sends in one attention layer's forward and backward (a dict). One ring step
    sends the held k and v: batch * seq_len_local * n_kv_head * (head_dim + v_head_dim) elements.
    Forward takes cp - 1 steps (the last block is not passed on). Backward sends k and v again cp -
    1 times, and the fp32 gradient accumulators cp times: the extra step takes them home."""
    step_elements = batch * seq_len_local * n_kv_head * (head_dim + v_head_dim)
    if cp == 1:
        return {"forward": 0, "backward": 0, "step": 0}
    kv = (cp - 1) * step_elements * element_size
    return {
        "forward": kv,
        "backward": kv + cp * step_elements * 4,
        "step": step_elements * element_size,
    }


# -----------------------------------------------------------------------------
# One chunk pair, forward and backward. Query heads are grouped by the key/value head they read: q
# is (B, H_kv, G, Tq, D) with G = H / H_kv, k is (B, H_kv, 1, Tk, D), and broadcasting does the
# rest. q comes already multiplied by the scale (once per call, not once per pair's scores), and dq
# leaves as the gradient of that scaled q. Each pass over a pair's (Tq, Tk) scores costs a kernel
# and its memory traffic, and there are ten to fifteen of them where a fused kernel makes one, so
# the scores are worked on in place.


def _scores(q, k, softcap):
    """fp32 scores q k^T (q scaled), soft-capped to cap * tanh(s / cap); and tanh, for backward."""
    s = q @ k.transpose(-2, -1)  # (B, H_kv, G, Tq, Tk)
    t = torch.tanh(s / softcap) if softcap else None
    return (s, None) if t is None else (softcap * t, t)


def _finite(lse):
    """A row with no visible key has lse = -inf, and exp(s - lse) = exp(-inf + inf) = nan; against
    0 it is exp(-inf) = 0: zero probabilities, a zero output and zero gradients."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _block_forward(q, k, v, visible, softcap):
    """This block's normalised output and log-sum-exp: (B, H_kv, G, Tq, D_v) and (B, H_kv, G, Tq).
    The softmax as FlashAttention computes it: p = exp(s - m) with m the row's largest score, l =
    sum(p), out = p v / l, lse = m + log(l). l >= 1 where a key is visible (the largest contributes
    exp(0)); where none is, l = 0, lse = -inf and p v = 0, so dividing by max(l, 1) gives zeros."""
    s, _ = _scores(q, k, softcap)
    if visible is not None:
        s.masked_fill_(~visible, float("-inf"))
    m = _finite(s.amax(-1))
    p = s.sub_(m[..., None]).exp_()
    l = p.sum(-1)
    return (p @ v) / l.clamp(min=1.0)[..., None], m + torch.log(l)


def _merge(out, lse, block_out, block_lse):
    """Two softmax-weighted averages over disjoint sets of keys, combined into the one over both:
    lse = log(e^lse1 + e^lse2), out = e^(lse1 - lse) out1 + e^(lse2 - lse) out2, each weight its
    keys' share of the softmax denominator (Milakov & Gimelshein 2018, "Online normalizer
    calculation for softmax"). Rows that have seen no visible key yet have lse = -inf, stay zero."""
    new_lse = torch.logaddexp(lse, block_lse)
    safe = _finite(new_lse)[..., None]
    weight, block_weight = torch.exp(lse[..., None] - safe), torch.exp(block_lse[..., None] - safe)
    return weight * out + block_weight * block_out, new_lse


def _block_backward(q, k, v, dout, lse, delta, visible, softcap, dq, dk, dv):
    """Adds this block's gradients into dq (B, H_kv, G, Tq, D), dk (B, H_kv, Tk, D), dv (B, H_kv,
    Tk, D_v). With p = softmax(s) recomputed from the saved lse, and delta = rowsum(dout * out):
        dv = p^T dout,  dp = dout v^T,  ds = p * (dp - delta),  then through the cap,
        dq = ds k,  dk = ds^T q  (q scaled: dq is the scaled q's gradient, dk already the keys')."""
    s, t = _scores(q, k, softcap)
    if visible is not None:
        s.masked_fill_(~visible, float("-inf"))
    p = s.sub_(_finite(lse)[..., None]).exp_()  # (B, H_kv, G, Tq, Tk); hidden keys give exactly 0
    # summed over the G query heads that read each kv head
    dv += (p.transpose(-2, -1) @ dout).sum(2)
    ds = (dout @ v.transpose(-2, -1)).sub_(delta[..., None]).mul_(p)
    if softcap:
        ds.mul_(1 - t * t)  # d/ds cap * tanh(s / cap) = 1 - tanh^2
    dq += ds @ k
    dk += (ds.transpose(-2, -1) @ q).sum(2)


# -----------------------------------------------------------------------------
# The ring


# The heads laid out contiguously, (B, H_kv, G, T, D): a chunk's slice of T is then a view that a
# batched matmul reads as it is, where the permuted view would be copied by every pair's matmul.
def _query_heads(x, n_kv_head, scale=1.0):
    B, T, H, D = x.shape
    x = x.to(at_least_fp32(x.dtype)).view(B, T, n_kv_head, H // n_kv_head, D).permute(0, 2, 3, 1, 4)
    return (x * scale).contiguous() if scale != 1.0 else x.contiguous()  # (B, H_kv, G, T, D)


def _kv_heads(x):
    # (B, T, H_kv, D) -> (B, H_kv, 1, T, D)
    return x.to(at_least_fp32(x.dtype)).permute(0, 2, 1, 3).contiguous()[:, :, None]


def _post_ring_exchange(tensors, group):
    """Post the send of `tensors` (one dtype) to the next rank and the receive of as many from the
    previous, unwaited (the caller computes meanwhile): (the received, views of one buffer, and the
    requests). One message, since each pays the link's latency (on gloo about a millisecond, more
    than 512 KiB take to cross) and packing costs far less."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    next_rank = dist.get_global_rank(group, (rank + 1) % cp)  # a P2POp's peer is a global rank
    prev_rank = dist.get_global_rank(group, (rank - 1) % cp)
    packed = torch.cat([t.reshape(-1) for t in tensors])
    arriving = torch.empty_like(packed)
    send = dist.P2POp(dist.isend, packed, next_rank, group)
    receive = dist.P2POp(dist.irecv, arriving, prev_rank, group)
    requests = dist.batch_isend_irecv([send, receive])
    parts = arriving.split([t.numel() for t in tensors])
    return [part.view(t.shape) for part, t in zip(parts, tensors)], requests


def _wait(requests):
    for request in requests:
        request.wait()


def _visible(keys, firsts, rank, source, qs, ks):
    """Which keys each query sees, (B or 1, 1, 1, Tq, Tk): firsts[q] <= keys[k] <= keys[q]."""
    q_key, q_first = keys[rank][..., qs, None], firsts[rank][..., qs, None]
    kv_key = keys[source][..., None, ks]
    return ((kv_key <= q_key) & (kv_key >= q_first))[:, None, None]


class RingAttention(torch.autograd.Function):
    """Attention of this rank's queries over every cp rank's keys and values, which travel round the
    ring (ring_attention's arguments)."""

    @staticmethod
    def forward(ctx, q, k, v, keys, firsts, group, softcap, scale):
        cp, rank = group_size(group), group_rank(group)
        B, T, H, _ = q.shape
        n_kv_head = k.shape[2]
        plan = block_plan(keys, firsts, rank)
        # the masks come from a device copy, non_blocking: a blocking one waits for the GPU's queue
        # to drain, the sync the host-side plan avoids
        keys, firsts = keys.to(q.device, non_blocking=True), firsts.to(q.device, non_blocking=True)

        qh = _query_heads(q, n_kv_head, scale)
        # (B, H_kv, G, T, D_v), fp32 (fp64)
        out = q.new_zeros(*qh.shape[:-1], v.shape[-1], dtype=qh.dtype)
        lse = q.new_full(qh.shape[:-1], float("-inf"), dtype=qh.dtype)  # (B, H_kv, G, T)
        k_block, v_block = k, v
        for step in range(cp):
            if step < cp - 1:  # the next block sets off before this one is computed
                (k_next, v_next), requests = _post_ring_exchange([k_block, v_block], group)
            source = (rank - step) % cp
            kh, vh = _kv_heads(k_block), _kv_heads(v_block)
            for qs, ks, kind in plan[step]:
                visible = _visible(keys, firsts, rank, source, qs, ks) if kind == "masked" else None
                block_out, block_lse = _block_forward(
                    qh[..., qs, :], kh[..., ks, :], vh[..., ks, :], visible, softcap
                )
                out[..., qs, :], lse[..., qs] = _merge(
                    out[..., qs, :], lse[..., qs], block_out, block_lse
                )
            if step < cp - 1:
                _wait(requests)
                k_block, v_block = k_next, v_next

        out = out.permute(0, 3, 1, 2, 4).reshape(B, T, H, v.shape[-1]).to(q.dtype)  # (B, T, H, D_v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.keys, ctx.firsts, ctx.group = plan, keys, firsts, group
        ctx.softcap, ctx.scale, ctx.cp, ctx.rank = softcap, scale, cp, rank
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, rank, group, keys, firsts = ctx.cp, ctx.rank, ctx.group, ctx.keys, ctx.firsts
        n_kv_head = k.shape[2]
        B, T, H, D = q.shape
        qh, dh = _query_heads(q, n_kv_head, ctx.scale), _query_heads(dout, n_kv_head)
        delta = (dout.to(qh.dtype) * out.to(qh.dtype)).sum(-1)  # (B, T, H): rowsum(dout * out)
        delta = delta.view(B, T, n_kv_head, H // n_kv_head).permute(0, 2, 3, 1)  # (B, H_kv, G, T)
        dq = torch.zeros_like(qh)
        # A visiting block's dk and dv come from every rank's queries: an fp32 accumulator travels
        # with it, every rank adds its part, and one more step brings the sum home to its owner.
        k_block, v_block = k, v
        grads_home = None  # the accumulators arriving for the next block, and their requests
        for step in range(cp):
            if step < cp - 1:
                (k_next, v_next), kv_requests = _post_ring_exchange([k_block, v_block], group)
            source = (rank - step) % cp
            kh, vh = _kv_heads(k_block), _kv_heads(v_block)
            # (B, H_kv, T, D)
            dk_block, dv_block = torch.zeros_like(kh[:, :, 0]), torch.zeros_like(vh[:, :, 0])
            for qs, ks, kind in ctx.plan[step]:
                visible = _visible(keys, firsts, rank, source, qs, ks) if kind == "masked" else None
                _block_backward(
                    qh[..., qs, :],
                    kh[..., ks, :],
                    vh[..., ks, :],
                    dh[..., qs, :],
                    lse[..., qs],
                    delta[..., qs],
                    visible,
                    ctx.softcap,
                    dq[..., qs, :],
                    dk_block[..., ks, :],
                    dv_block[..., ks, :],
                )
            if grads_home is not None:  # add what the previous ranks gathered for this block
                (dk_before, dv_before), grad_requests = grads_home
                _wait(grad_requests)
                dk_block, dv_block = dk_block + dk_before, dv_block + dv_before
            if cp > 1:
                grads_home = _post_ring_exchange([dk_block, dv_block], group)
            if step < cp - 1:
                _wait(kv_requests)
                k_block, v_block = k_next, v_next
        # after cp steps the accumulators that arrive are this rank's own keys' and values'
        if cp > 1:
            (dk_block, dv_block), grad_requests = grads_home
            _wait(grad_requests)

        # (B, T, H, D): q's, unscaled
        dq = (dq * ctx.scale).permute(0, 3, 1, 2, 4).reshape(B, T, H, D).to(q.dtype)
        dk = dk_block.transpose(1, 2).to(k.dtype)  # (B, T, H_kv, D)
        dv = dv_block.transpose(1, 2).to(v.dtype)  # (B, T, H_kv, D_v)
        return dq, dk, dv, None, None, None, None, None


# A compiled block (model.compile_blocks) runs around ring attention, not through it: host-side
# plans and point-to-point messages. torch._disable_dynamo is torch.compiler.disable applied at the
# first call, as torch marks its own functions: the mark imports torch._dynamo, about 2 s of every
# process's start.
@torch._disable_dynamo
def ring_attention(q, k, v, positions, group=None, softcap=0.0, scale=None, documents=None):
    """Causal attention of this rank's queries over the keys and values of every rank of the cp
    group. q: (B, T_local, H, D), k and v: (B, T_local, H_kv, D or D_v), H a multiple of H_kv (MLA's
    D_v differs). positions: every cp rank's global token positions, (cp, T_local) or (cp, B,
    T_local) on the host (split_for_every_rank); this rank's queries are row `rank`;
    check_ring_inputs says what must hold. documents (doc_mask): their document ids, the same shape
    (visibility: what a query sees then). Scores are q k^T * scale (default 1/sqrt(D)), soft-capped
    when softcap > 0 (Gemma 2). group None is one process. Returns (B, T_local, H, D_v); a query
    that sees no key gets zeros."""
    D = q.shape[-1]
    keys, firsts = visibility(
        *(x if x is None or x.dim() == 3 else x[:, None] for x in (positions, documents))
    )
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    return RingAttention.apply(q, k, v, keys, firsts, group, softcap, scale)


def loss_share(loss, targets, group, ignore_index=-1):
    """This cp rank's share of the microbatch's mean loss, from its tokens' mean `loss`: their
    summed loss over the token count of the whole microbatch (all cp ranks' targets: one all-reduce
    of a count), times cp. The mean of the cp ranks' shares is the microbatch's mean loss, and the
    average of their gradients (gradients are averaged over dp x cp) its gradient. Without context
    parallelism (group None): loss."""
    cp = group_size(group)
    if cp == 1:
        return loss
    count = (targets != ignore_index).sum()
    total = count.clone()
    dist.all_reduce(total, group=group)
    return loss * (count.clamp(min=1) * cp / total.clamp(min=1))


def check_ring_inputs(q, k, v, positions, documents, cp):
    """What ring_attention needs of its inputs (the model's RingAttentionKernel checks them each
    call): q, k, v's shapes, and positions and documents on the host, one row per cp rank."""
    B, T, H, D = q.shape
    if (
        k.shape[:2] != (B, T)
        or v.shape[:3] != k.shape[:3]
        or k.shape[-1] != D
        or H % k.shape[2] != 0
    ):
        raise ValueError(
            f"ring_attention wants q (B, T, H, D), k (B, T, H_kv, D), v (B, T, H_kv, D_v) with H a "
            f"multiple of H_kv; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    for name, x in (("positions", positions), ("documents", documents)):
        if x is None:
            continue
        if x.device.type != "cpu":
            raise ValueError(
                f"{name} must be on the host (device cpu, got {x.device}): which blocks to skip is "
                f"decided from it there, without a device sync"
            )
        if x.shape not in ((cp, T), (cp, B, T)):
            raise ValueError(
                f"{name} must be (cp, T_local) = ({cp}, {T}) or (cp, B, T_local) = ({cp}, {B}, "
                f"{T}), one row per cp rank (see split_for_every_rank); got {tuple(x.shape)}"
            )


# -----------------------------------------------------------------------------
# Context parallelism applied to a built model (model.Transformer): the pieces the model leaves for
# it to swap, each doing what one process does over the whole window.


class RingAttentionKernel(nn.Module):
    """model.AttentionKernel over the cp ranks' shares of the sequence: ring attention, whatever
    kernel the run chose (positions and document ids, every rank's, on the host, decide which blocks
    to skip)."""

    def __init__(self, group, softcap=0.0):
        super().__init__()
        self.group, self.softcap = group, softcap

    def document_mask(self, documents, device):
        """Every rank's document ids, (cp, B, T_local) on the host, as ring_attention takes them."""
        return documents

    def forward(self, q, k, v, positions=None, documents=None):
        check_ring_inputs(q, k, v, positions, documents, group_size(self.group))
        return ring_attention(
            q, k, v, positions, self.group, softcap=self.softcap, documents=documents
        )


class ContextParallelRotary(nn.Module):
    """model.Rotary reading this rank's row of every cp rank's positions, (cp, B, T_local) or (cp,
    T_local) on the host (split_for_every_rank), which ring attention needs whole."""

    def __init__(self, rotary, group):
        super().__init__()
        self.rotary, self.group = rotary, group

    def forward(self, positions=None):
        cp, shape = group_size(self.group), None if positions is None else tuple(positions.shape)
        if shape is None or len(shape) < 2 or shape[0] != cp:
            raise ValueError(
                f"Transformer.forward: under context parallelism (cp = {cp}) positions must be "
                f"every cp rank's global token positions, (cp, B, T/cp) on the host "
                f"(split_for_every_rank), got {shape}"
            )
        return self.rotary(positions[group_rank(self.group)])


class ContextWindow:
    """model.TokenWindow of the whole window: a mixture of experts' capacity queue and balance
    counts span every cp rank's share, as in one process. Each rank gathers the chosen expert ids of
    the whole window (small integers), queues them in the window's position-major order
    (zigzag_gather's), and keeps its own tokens' verdicts; the load-balancing loss takes f_e from
    the window's counts (an all-reduce) and P_e from this rank's tokens: its share of the loss, as
    the cross-entropy is; the dropped fraction is the window's."""

    def __init__(self, group):
        self.group = group

    def gather(self, choices):  # (T_local, B, k) -> the window's (T, B, k)
        return all_gather_context(choices, self.group, dim=0)

    def mine(self, window_verdicts):  # the window's (T, B, k) -> this rank's (T_local, B, k)
        return zigzag_split(window_verdicts, group_size(self.group), group_rank(self.group), dim=0)

    def total(self, counts):
        counts = counts.clone()
        dist.all_reduce(counts, group=self.group)
        return counts


class ContextParallelLoss(nn.Module):
    """The model's loss (model.NextTokenLoss, or the vocab-parallel one) as this cp rank's share of
    the microbatch's mean (loss_share)."""

    def __init__(self, loss, group):
        super().__init__()
        self.inner, self.group = loss, group

    @property
    def chunked(self):  # (the split backward's chunk_modules asks)
        return self.inner.chunked

    def forward(self, h, head, targets=None):
        logits, loss = self.inner(h, head, targets)
        return logits, (None if loss is None else loss_share(loss, targets, self.group))


def apply_context_parallel(model, group):
    """Run a model.Transformer on this cp rank's share of every window (Liu et al. 2023, "Ring
    Attention"; the zigzag split above): attention becomes ring attention, RoPE reads this rank's
    positions, a mixture of experts queues and counts over the window, and the loss is this rank's
    share. The projections and MLPs are per token and stay. Returns the model."""
    if group_size(group) == 1:
        return model
    model.rope = ContextParallelRotary(model.rope, group)
    model.loss = ContextParallelLoss(model.loss, group)
    for block in model.blocks.values():
        block.attn.attend = RingAttentionKernel(group, block.attn.attend.softcap)
        if hasattr(block.mlp, "window"):
            block.mlp.window = ContextWindow(group)
    return model
