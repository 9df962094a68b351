# Mixture-of-Experts (Switch Transformer, GShard; Mixtral's 8 experts, top-2): every MLP is 8 SwiGLU
# experts and a router that sends each token to 2 of them, so the model holds ~8x the MLP parameters
# but each token uses 2/8 of them. Experts take at most 1.25x their fair share of tokens and drop
# the rest; the load-balancing loss (and a small router z-loss, ST-MoE) keeps the router spreading
# tokens. The log shows both (aux_loss, moe_dropped_frac). n_shared_expert=1 adds an always-on
# expert (DeepSeekMoE).
#   python train.py config/moe.py --max_iters=200
#   # each expert split like the dense MLP:
#   torchrun --nproc_per_node=2 train.py config/moe.py --tp=2
#   # expert parallelism: 2 whole experts per rank, tokens sent to them all-to-all;
#   # --capacity_factor=0 routes dropless, and only then exports to HF:
#   torchrun --nproc_per_node=4 train.py config/moe.py --ep=4
n_layer = 4
n_head = 4
n_kv_head = 4
n_embd = 128
block_size = 256
n_expert = 8
n_expert_per_token = 2
capacity_factor = 1.25
aux_loss_coef = 0.01
router_z_loss_coef = 1e-3
n_shared_expert = 0
