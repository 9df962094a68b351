# Llama with grouped-query attention (Ainslie et al. 2023): 4 query heads share 2 key/value heads,
# which halves the keys and values a KV cache holds. n_kv_head=1 gives multi-query attention,
# n_kv_head=n_head plain multi-head attention. Small enough for a CPU.
#   python train.py config/llama_gqa.py --max_iters=200
#   torchrun --nproc_per_node=2 train.py config/llama_gqa.py --tp=2   (tp=2 splits the kv heads too)
n_layer = 4
n_head = 4
n_kv_head = 2
n_embd = 128
block_size = 256
attention = "mha"
norm = "rmsnorm"
mlp = "swiglu"
