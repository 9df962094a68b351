# The README's main job: a tiny Llama-style model (~7M parameters, most of them the GPT-2 embedding)
# pretrained on FineWeb-Edu. It trains on a laptop CPU in a few minutes; on a GPU, raise max_iters.
#
#   python prepare_data.py --max_tokens=20000000   # FineWeb-Edu sample-10BT -> data/fineweb_edu
#   python train.py config/tiny_fineweb.py
#   torchrun --nproc_per_node=8 train.py config/tiny_fineweb.py --tp=2 --pp=2
out_dir = "out/tiny_fineweb"
data_dir = "data/fineweb_edu"

n_layer = 4
n_head = 4
n_kv_head = 2
n_embd = 128
block_size = 256
tie_embeddings = True

batch_size = 8
gradient_accumulation_steps = 1
max_iters = 300
lr_decay_iters = 300
warmup_iters = 30
learning_rate = 3e-3
min_lr = 3e-4

log_interval = 10
eval_interval = 100
eval_iters = 10
checkpoint_interval = 100
