# Multi-head latent attention (DeepSeek-V2, 2024): keys and values are rebuilt per head from a
# 64-wide latent, and RoPE rides on a separate 16-wide key shared by all heads, so a KV cache would
# hold 64 + 16 numbers per token and layer instead of 2 * 4 * 32 = 256. q_lora_rank=0 keeps
# full-rank queries, as in DeepSeek-V2-Lite; set e.g. q_lora_rank=96 to compress the queries too, as
# the full DeepSeek-V2 does.
#   python train.py config/mla.py --max_iters=200
#   torchrun --nproc_per_node=2 train.py config/mla.py --tp=2
n_layer = 4
n_head = 4
n_embd = 128
block_size = 256
attention = "mla"
kv_lora_rank = 64
q_lora_rank = 0
qk_rope_head_dim = 16
qk_nope_head_dim = 32
v_head_dim = 32
