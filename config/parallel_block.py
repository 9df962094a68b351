# The parallel attention/MLP block of GPT-J (Wang & Komatsuzaki 2021) and PaLM (Chowdhery et al.
# 2022): x + attn(norm(x)) + mlp(norm(x)) with one norm per block, instead of the MLP reading the
# attention's output. Here with PaLM's choices (no biases, SwiGLU); GPT-J's are --norm=layernorm
# --mlp=gelu --bias=True.
#   python train.py config/parallel_block.py --max_iters=200
#   torchrun --nproc_per_node=2 train.py config/parallel_block.py --tp=2
n_layer = 4
n_head = 4
n_kv_head = 4
n_embd = 128
block_size = 256
parallel_block = True
norm = "rmsnorm"
mlp = "swiglu"
bias = False
