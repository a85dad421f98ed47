"""Tiny models shaped like those users bring, written here (no download, no ``transformers``): GPT-2 (learned
positions, fused qkv, GELU, tied head), BERT (padded batches with an attention mask, a pooler and a classifier),
Llama (RMSNorm, rotary positions, SwiGLU, untied head) and a BatchNorm CNN.

The text loaders pad each batch to its longest sequence, so the sequence length varies from batch to batch (and
between the ranks, which read different samples); every loader leaves a short last batch (10 samples a rank, batches
of 4). No ``self.log``: Lightning's ``ddp`` with ``torch.compile`` crashes on it in Lightning 2.6 (docs/how-it-works.md).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, HEADS, LAYERS = 32, 16, 2, 2
SAMPLES, BATCH = 20, 4  # 10 a rank on 2 ranks: batches of 4, 4 and 2
LENGTHS = (8, 12, 12, 12, 8, 16, 8, 8, 12, 16, 16, 8, 12, 8, 16, 12, 8, 12, 16, 8)
"""Each sample's length: a batch is padded to its longest (8, 12 or 16), which differs by batch and by rank (the first
batches: 12 on rank 0, 16 on rank 1)."""


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any = None, causal: bool = False) -> Any:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


def _heads(x: torch.Tensor) -> torch.Tensor:
    b, t, _ = x.shape
    return x.view(b, t, HEADS, WIDTH // HEADS).transpose(1, 2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    b, _, t, _ = x.shape
    return x.transpose(1, 2).reshape(b, t, WIDTH)


class GPT2Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.c_attn, self.c_proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(approximate="tanh"), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(self.ln_1(x)).split(WIDTH, dim=2)
        x = x + self.c_proj(_merge(_attention(_heads(q), _heads(k), _heads(v), causal=True)))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(32, WIDTH)
        self.h = nn.ModuleList(GPT2Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT2LMHeadModel's

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class BertLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.ln_attn, self.ln_out = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.ffn = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(WIDTH, dim=2)
        x = self.ln_attn(x + self.out(_merge(_attention(_heads(q), _heads(k), _heads(v), mask=mask))))
        return self.ln_out(x + self.ffn(x))  # post-LN, as BERT's


class Bert(nn.Module):
    def __init__(self, labels: int = 3) -> None:
        super().__init__()
        self.word, self.position, self.token_type = nn.Embedding(VOCAB, WIDTH), nn.Embedding(32, WIDTH), nn.Embedding(2, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)
        self.layers = nn.ModuleList(BertLayer() for _ in range(LAYERS))
        self.pooler, self.classifier = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, labels)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.ln(self.word(input_ids) + self.position(positions) + self.token_type(torch.zeros_like(input_ids)))
        # padding masked out of every key, as BertModel's extended attention mask
        mask = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        for layer in self.layers:
            x = layer(x, mask)
        return self.classifier(torch.tanh(self.pooler(x[:, 0])))


class RMSNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _rotary_tables(d: int, longest: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(longest, dtype=torch.float32), inv)
    return torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Llama's ``apply_rotary_pos_emb``), over ``(batch, heads, time, head_dim)``, from
    tables cut to the sequence's length."""
    t, d = x.shape[2], x.shape[3]
    half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos[:t] + half * sin[:t]


class LlamaBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(), RMSNorm()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(4))
        self.gate_proj, self.up_proj = nn.Linear(WIDTH, 2 * WIDTH, bias=False), nn.Linear(WIDTH, 2 * WIDTH, bias=False)
        self.down_proj = nn.Linear(2 * WIDTH, WIDTH, bias=False)
        cos, sin = _rotary_tables(WIDTH // HEADS)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        q, k = (_rotate(_heads(proj(h)), self.cos, self.sin) for proj in (self.q_proj, self.k_proj))
        v = _heads(self.v_proj(h))
        x = x + self.o_proj(_merge(_attention(q, k, v, causal=True)))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(LlamaBlock() for _ in range(LAYERS))
        self.norm = RMSNorm()
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


class BatchNormCNN(nn.Module):
    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, stride=2, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.fc = nn.Linear(8, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(images).mean((2, 3)))


# ------------------------------------------------------------------------------------------------ data


def _text() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g), "label": torch.randint(0, 3, (), generator=g)}
            for n in LENGTHS[:SAMPLES]]


def pad(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pad to the batch's longest sequence (0 tokens, mask 0, language-model labels -100), as a tokenizer's
    ``padding=True`` does."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, :len(s["input_ids"])], mask[i, :len(s["input_ids"])] = s["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100),
            "label": torch.stack([s["label"] for s in samples])}


class UserModel(L.LightningModule):
    """One of the models above in a plain LightningModule, with its loader (unshuffled: Lightning's ``ddp`` and
    static_dist give each rank the same samples)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        torch.manual_seed(0)
        self.net = {"gpt2": GPT2, "bert": Bert, "llama": Llama, "cnn": BatchNormCNN}[kind]()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.kind == "cnn":
            images, classes = batch
            return F.cross_entropy(self.net(images), classes)
        if self.kind == "bert":
            return F.cross_entropy(self.net(batch["input_ids"], batch["attention_mask"]), batch["label"])
        logits = self.net(batch["input_ids"])[:, :-1]  # causal LM: predict the next token, padding ignored
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1), ignore_index=-100)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> Any:
        if self.kind == "cnn":
            g = torch.Generator().manual_seed(5)
            data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 3, 8, 8, generator=g),
                                                  torch.randint(0, 4, (SAMPLES,), generator=g))
            return torch.utils.data.DataLoader(data, batch_size=BATCH)
        return torch.utils.data.DataLoader(_text(), batch_size=BATCH, collate_fn=pad)


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}
