"""
A straightforward GPT-2 (nanoGPT-style), the yardstick bench.py --reference=True times picotron against.

Written the plain way on purpose: learned positions, LayerNorm, one fused qkv projection, PyTorch SDPA,
a 4x GELU MLP, tied embeddings, the vocabulary padded to a multiple of 64, the full (B, T, V) logits
into F.cross_entropy, and fused AdamW. Nothing here is tuned for this machine: it is what someone would
write first, and picotron's training step should be no slower than it at the same size.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class SelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = SelfAttention(n_embd, n_head)
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.fc_proj = nn.Linear(4 * n_embd, n_embd, bias=False)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.vocab_size = vocab_size
        padded = (vocab_size + 63) // 64 * 64  # nanoGPT's 50257 -> 50304: fast matmul sizes
        self.wte = nn.Embedding(padded, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, padded, bias=False)
        self.lm_head.weight = self.wte.weight
        self.n_layer, self.n_head, self.n_embd, self.block_size = n_layer, n_head, n_embd, block_size
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "fc_proj.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))[..., :self.vocab_size]
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        return logits, loss

    def flops_per_token(self):
        """6 FLOPs per matmul parameter (forward 2, backward 4) plus the attention scores and their use:
        6 * n_layer * T * 2 * n_embd (Kaplan et al. 2020; nanoGPT's estimate_mfu)."""
        matmul_params = sum(p.numel() for p in self.blocks.parameters() if p.dim() >= 2)
        matmul_params += self.n_embd * self.vocab_size  # the head, not its padding
        return 6 * matmul_params + 12 * self.n_layer * self.n_embd * self.block_size


def make_optimizer(model, lr=1e-3, weight_decay=0.1):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=True)
