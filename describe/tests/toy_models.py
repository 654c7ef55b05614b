"""Small local models for the tests (also used through the CLI as module:toy_models:<factory>)."""

import torch
import torch.nn as nn


def mlp() -> nn.Module:
    """The docs/design/models.md example shape: linear, batch norm, relu, dropout, linear, softmax."""
    return nn.Sequential(
        nn.Linear(20, 30),
        nn.BatchNorm1d(30),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(30, 5),
        nn.Softmax(dim=-1),
    )


class SharedAndOwned(nn.Module):
    """A layer called twice, a parameter owned by a non-leaf module, and an unused layer."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.fc = nn.Linear(8, 8)
        self.act = nn.GELU()
        self.unused = nn.Linear(8, 3)

    def forward(self, x):
        x = self.act(self.fc(x)) * self.scale
        return self.fc(x)


def shared_and_owned() -> nn.Module:
    return SharedAndOwned()


class SelfAttention(nn.Module):
    """Class name ends in "Attention": gets an attention layer besides its children's."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        x = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


class TinyTokenModel(nn.Module):
    """Token ids in, logits out: embedding, two kinds of attention, a norm and a head."""

    def __init__(self, vocab=100, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, 64, dim))
        self.attn = SelfAttention(dim)
        self.mha = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.embed(ids) + self.pos[:, : ids.shape[1]]
        x = x + self.attn(x)
        x = x + self.mha(x, x, x, need_weights=False)[0]
        return self.head(self.norm(x))


def tiny_token_model() -> nn.Module:
    return TinyTokenModel()


def tiny_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU6(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 4, 1),
        nn.Hardswish(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 2),
    )


def not_a_module():
    return 42


def small_mlp() -> nn.Module:
    """Linear, ReLU, Linear: saved tensors easy to count by hand."""
    return nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 3))


def token_linear() -> nn.Module:
    """Token ids in: an embedding (saves the int64 ids) and a linear (saves the embeddings)."""
    return nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 4))


class GradRefusing(nn.Module):
    """Runs without autograd (the layer walk) but raises with it (the saved-tensor trace)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        if torch.is_grad_enabled():
            raise NotImplementedError("no autograd on this device")
        return self.fc(x)


def grad_refusing() -> nn.Module:
    return GradRefusing()


class SdpaBlock(nn.Module):
    """Tokens [N, dim] in: q, k, v from one linear, F.scaled_dot_product_attention, a linear.

    ``mask``: None, ``"bool"`` (an [N, N] boolean mask), ``"bias"`` (an additive [N, N] float
    bias, N not a multiple of 8 then padded on a GPU) or ``"transposed"`` (a float mask whose
    last dimension is not contiguous: the fused kernels refuse it). ``gqa``: k and v with one
    head and ``enable_gqa=True`` (the memory-efficient kernel refuses it).
    """

    def __init__(self, dim=32, heads=4, mask=None, gqa=False):
        super().__init__()
        self.heads, self.mask, self.gqa = heads, mask, gqa
        self.head_dim = dim // heads
        kv_dim = self.head_dim if gqa else dim
        self.qkv = nn.Linear(dim, dim + 2 * kv_dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).split([c, (self.qkv.out_features - c) // 2, (self.qkv.out_features - c) // 2], dim=-1)
        q = q.reshape(b, n, self.heads, -1).transpose(1, 2)
        k = k.reshape(b, n, -1, self.head_dim).transpose(1, 2)
        v = v.reshape(b, n, -1, self.head_dim).transpose(1, 2)
        kwargs = {"enable_gqa": True} if self.gqa else {}
        if self.mask == "bool":
            kwargs["attn_mask"] = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        elif self.mask == "bias":
            kwargs["attn_mask"] = torch.zeros(n, n, device=x.device)
        elif self.mask == "transposed":
            kwargs["attn_mask"] = torch.zeros(n, n, device=x.device).t()
        x = nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


def sdpa_block() -> nn.Module:
    return SdpaBlock()
