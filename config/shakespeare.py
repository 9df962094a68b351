# A local corpus, no network needed: tiny shakespeare (or any text file of yours), GPT-2 tokens.
#
#   python prepare_data.py --dataset=path/to/input.txt --out_dir=data/shakespeare
#   python train.py config/shakespeare.py
#
# A .txt file is one document, so a single file gives no validation split and only the train loss is
# evaluated; several files (or a .jsonl of documents) give both.
out_dir = "out/shakespeare"
data_dir = "data/shakespeare"

n_layer = 4
n_head = 4
n_kv_head = 4
n_embd = 128
block_size = 256

batch_size = 8
max_iters = 500
lr_decay_iters = 500
warmup_iters = 50
learning_rate = 3e-3
min_lr = 3e-4

log_interval = 10
eval_interval = 100
eval_iters = 10
checkpoint_interval = 250
