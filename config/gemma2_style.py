# Gemma 2's logit soft-capping (Gemma Team 2024): cap * tanh(x / cap) on the attention scores (cap
# 50) and on the output logits (cap 30), plus QK-norm (RMSNorm on every query and key head, as in
# Gemma 3 and OLMo 2) and grouped-query attention. SDPA cannot cap scores, so on a CPU
# attn_impl='auto' picks the explicit (eager) attention, and on a GPU FlashAttention-2 (>= 2.6) when
# it is installed; the start-up log line says which and why.
#   python train.py config/gemma2_style.py --max_iters=200
#   torchrun --nproc_per_node=2 train.py config/gemma2_style.py --tp=2
n_layer = 4
n_head = 4
n_kv_head = 2
n_embd = 128
block_size = 256
attn_softcap = 50.0
final_softcap = 30.0
qk_norm = True
