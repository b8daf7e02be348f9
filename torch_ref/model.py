"""GPT-2 in plain PyTorch: the oracle that jaxgpt is checked against.

It mirrors ``jaxgpt/model.py`` class for class (LayerNorm, Linear, CausalSelfAttention, MLP, Block, GPT)
with the same parameter names, so the two files read as a translation table. It takes the same
``GPTConfig``. No speed tricks beyond ``F.scaled_dot_product_attention`` and ``torch.autocast``.

Parameter layout: ``Linear.weight`` is (in, out) like Hugging Face's Conv1D (and jaxgpt's kernel), so
weights move between the three implementations without transposes. bf16 compute is ``torch.autocast``;
LayerNorm, softmax, logits and the loss are computed in fp32 as in jaxgpt's precision policy.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from jaxgpt.config import GPTConfig
from torch_ref import fp8 as f8

INIT_STD = 0.02


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias, statistics in fp32."""

    def __init__(self, dim: int, *, bias: bool, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.eps = eps

    def forward(self, x):
        return F.layer_norm(x.float(), self.weight.shape, self.weight, self.bias, self.eps)


class Linear(nn.Module):
    """y = x @ weight + bias, ``weight`` stored (in, out) like Hugging Face's Conv1D. ``gemm``: its kind for fp8
    ("attn" or "mlp"); ``fp8``: e4m3 operands (torch_ref.fp8, set by GPT.set_fp8)."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool, std: float, gemm: str = "attn"):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_in, d_out) * std)
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None
        self.gemm, self.fp8 = gemm, False

    def forward(self, x):
        y = f8.matmul(x, self.weight) if self.fp8 else x @ self.weight
        return y + self.bias if self.bias is not None else y


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, attention: str = "sdpa"):
        super().__init__()
        C = config.n_embd
        resid_std = INIT_STD / math.sqrt(2 * config.n_layer)
        self.c_attn = Linear(C, 3 * C, bias=config.bias, std=INIT_STD)
        self.c_proj = Linear(C, C, bias=config.bias, std=resid_std)
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.attention = attention  # "sdpa" (fused) or "math" (explicit matmuls, for FLOP counting)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = att.float().masked_fill(~mask, float("-inf"))
            att = F.dropout(F.softmax(att, dim=-1), p).to(v.dtype)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads side by side
        return F.dropout(self.c_proj(y), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        C = config.n_embd
        resid_std = INIT_STD / math.sqrt(2 * config.n_layer)
        self.c_fc = Linear(C, 4 * C, bias=config.bias, std=INIT_STD, gemm="mlp")
        self.c_proj = Linear(4 * C, C, bias=config.bias, std=resid_std, gemm="mlp")
        self.dropout = config.dropout

    def forward(self, x):
        h = F.gelu(self.c_fc(x).float(), approximate="tanh")  # GPT-2's tanh GELU, in fp32
        return F.dropout(self.c_proj(h), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, config: GPTConfig, attention: str = "sdpa"):
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias, eps=eps)
        self.attn = CausalSelfAttention(config, attention)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias, eps=eps)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x)).float()  # the residual stream stays fp32
        x = x + self.mlp(self.ln_2(x)).float()
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, *, attention: str = "sdpa", seed: int = 0):
        super().__init__()
        if attention not in ("sdpa", "math"):
            raise ValueError(f"attention = {attention!r}: allowed values are 'sdpa', 'math'")
        self.config = config
        self.fp8_head = False  # the lm_head GEMM in e4m3 (set_fp8)
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.wte = nn.Embedding(config.vocab_rows, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([Block(config, attention) for _ in range(config.n_layer)])
        self.ln_f = LayerNorm(config.n_embd, bias=config.bias, eps=config.layer_norm_epsilon)
        with torch.no_grad():
            nn.init.normal_(self.wte.weight, std=INIT_STD)
            self.wte.weight[config.vocab_size:] = 0.0  # padded rows: never a target, never sampled
            nn.init.normal_(self.wpe.weight, std=INIT_STD)
        torch.random.set_rng_state(gen_state)

    def set_attention(self, attention: str) -> None:
        for block in self.h:
            block.attn.attention = attention

    def set_fp8(self, gemms: str) -> None:
        """jaxgpt's ``precision: fp8``: the forward GEMMs named by ``gemms`` (jaxgpt.kernels.fp8.GEMM_SETS' names) with
        e4m3 operands; run the model under ``torch.autocast`` (bf16) as for bf16, or without it for an fp32 rest."""
        chosen = f8.GEMM_SETS[gemms]
        for m in self.modules():
            if isinstance(m, Linear):
                m.fp8 = m.gemm in chosen
        self.fp8_head = "lm_head" in chosen

    def forward(self, idx, targets=None):
        B, T = idx.size()
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} > block_size {self.config.block_size}")
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        head = f8.matmul if self.fp8_head else torch.matmul
        logits = head(x, self.wte.weight.t()).float()[..., : self.config.vocab_size]  # tied lm_head, fp32
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None):
        """nanoGPT's plain generate: recompute the (cropped) context for every new token.
        temperature == 0 means greedy decoding."""
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :]
            if temperature == 0.0:
                idx_next = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float("inf")
                probs = F.softmax(logits, dim=-1)
                idx_next = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx
