"""Torch modules of the real-model (cnn / transformer) and MLP MiB estimators.

Every model predicts the natural log of the peak MiB as a learned correction of the analytic
`first_principles_mib` (docs/design/models.md): the graph recovers log(first_principles) from its
normalised log1p input (x * std + mean; log1p(v) = log(v) to 1e-3 for v >= 1,300 MiB) and adds
the mean correction of an ensemble of small MLPs.  Ensemble members are stacked into batched
weight tensors ([K, in, out]), so the whole ensemble is three MatMuls in the ONNX graph.
"""

import torch
from torch import nn


class StackedMLP(nn.Module):
    """K independent two-hidden-layer MLPs evaluated at once: [N, F] -> [K, N, out]."""

    def __init__(self, members, n_inputs, hidden, n_outputs):
        super().__init__()

        def weight(fan_in, fan_out):
            bound = 1.0 / fan_in**0.5
            return nn.Parameter(torch.empty(members, fan_in, fan_out).uniform_(-bound, bound))

        self.w1, self.b1 = weight(n_inputs, hidden), nn.Parameter(torch.zeros(members, 1, hidden))
        self.w2, self.b2 = weight(hidden, hidden), nn.Parameter(torch.zeros(members, 1, hidden))
        self.w3, self.b3 = weight(hidden, n_outputs), nn.Parameter(torch.zeros(members, 1, n_outputs))
        with torch.no_grad():
            self.w3.mul_(0.1)

    def forward(self, x):
        """x: [N, F], or [K, N, F] with one input per member."""
        h = torch.nn.functional.silu(torch.matmul(x if x.dim() == 3 else x.unsqueeze(0), self.w1) + self.b1)
        h = torch.nn.functional.silu(torch.matmul(h, self.w2) + self.b2)
        return torch.matmul(h, self.w3) + self.b3


class LogBase(nn.Module):
    """log(first_principles_mib) from its normalised log1p column."""

    def __init__(self, column, mean, std):
        super().__init__()
        self.column = column
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32))

    def forward(self, x):
        return x[:, self.column : self.column + 1] * self.std + self.mean


class MemoryRegressor(nn.Module):
    """features [N, F] -> per-member log MiB [K, N, 1] (training) / mean `log_mib` [N, 1] (export).

    `member_inputs` [K, F] (0/1), optional: which features each member sees; members that see
    fewer features disagree with the others where the extra features mislead, and the mean
    hedges between them."""

    def __init__(self, n_features, base, members=5, hidden=32, cap=None, member_inputs=None):
        super().__init__()
        self.base = base
        self.cap = cap
        self.members = StackedMLP(members, n_features, hidden, 1)
        if member_inputs is None:
            member_inputs = torch.ones(members, n_features)
        self.register_buffer("member_inputs", torch.as_tensor(member_inputs, dtype=torch.float32).unsqueeze(1))

    def member_outputs(self, x):
        correction = self.members(x.unsqueeze(0) * self.member_inputs)
        if self.cap is not None:  # |log correction| < cap: no wild extrapolation on unseen families
            correction = self.cap * torch.tanh(correction / self.cap)
        return self.base(x).unsqueeze(0) + correction

    def forward(self, x):
        return self.member_outputs(x).mean(dim=0)


def ordinal_probabilities(mu, log_spread, log_bins):
    """Class probabilities from a logistic distribution of log(peak): mu, spread [.., 1]."""
    spread = torch.nn.functional.softplus(log_spread) + 0.02
    cdf = torch.sigmoid((log_bins - mu) / spread)  # P(peak <= b_i)
    ones = torch.ones_like(cdf[..., :1])
    zeros = torch.zeros_like(cdf[..., :1])
    upper = torch.cat([cdf, ones], dim=-1)
    lower = torch.cat([zeros, cdf], dim=-1)
    return (upper - lower).clamp(min=1e-6)


class AggregateClassifier(nn.Module):
    """GPUMemNet-style MLP ensemble with an ordinal head: each member predicts log(peak) (as a
    correction of first_principles) and a spread; class probabilities are the logistic mass
    between the class boundaries, averaged over members inside the graph."""

    def __init__(self, n_features, base, class_bins_mib, members=5, hidden=32):
        super().__init__()
        self.base = base
        self.members = StackedMLP(members, n_features, hidden, 2)
        self.register_buffer("log_bins", torch.log(torch.tensor(class_bins_mib, dtype=torch.float32)))

    def member_outputs(self, x):
        out = self.members(x)
        mu = self.base(x).unsqueeze(0) + out[..., :1]
        return mu, ordinal_probabilities(mu, out[..., 1:2], self.log_bins)

    def forward(self, x):
        return self.member_outputs(x)[1].mean(dim=0)


class SequenceClassifier(nn.Module):
    """Transformer over layer tokens, pooled first so that ~1,700 tokens stay cheap.

    tokens -> (kind embedding + linear(token features)) -> masked average over chunks of
    `pool` tokens (<= 128 pooled tokens for 2,048 layers) -> attention blocks over the chunks ->
    masked mean.  A first-principles base is computed inside the graph from the tokens
    (1,300 MiB + 16 B x params + 4 B x outputs x batch: adam, fp32) and the network predicts
    the correction of its log and a spread (ordinal head as above).
    """

    def __init__(
        self, n_kinds, n_token_features, raw_columns, class_bins_mib, d_model=32, n_heads=4, n_layers=1, pool=16
    ):
        super().__init__()
        self.pool = pool
        self.n_heads = n_heads
        self.embed_kind = nn.Embedding(n_kinds + 1, d_model, padding_idx=0)
        self.embed_features = nn.Linear(n_token_features, d_model)
        self.blocks = nn.ModuleList()
        for _ in range(n_layers):
            self.blocks.append(
                nn.ModuleDict(
                    {
                        "norm1": nn.LayerNorm(d_model),
                        "qkv": nn.Linear(d_model, 3 * d_model),
                        "proj": nn.Linear(d_model, d_model),
                        "norm2": nn.LayerNorm(d_model),
                        "ff1": nn.Linear(d_model, 2 * d_model),
                        "ff2": nn.Linear(2 * d_model, d_model),
                    }
                )
            )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Sequential(nn.Linear(d_model + 2, 32), nn.SiLU(), nn.Linear(32, 2))
        # raw_columns: (index, mean, std) of the log1p-normalised params and output_x_batch.
        (p_col, p_mean, p_std), (o_col, o_mean, o_std) = raw_columns
        self.p_col, self.o_col = p_col, o_col
        self.register_buffer("raw_mean", torch.tensor([p_mean, o_mean], dtype=torch.float32))
        self.register_buffer("raw_std", torch.tensor([p_std, o_std], dtype=torch.float32))
        self.register_buffer("log_bins", torch.log(torch.tensor(class_bins_mib, dtype=torch.float32)))

    def attention(self, block, h, key_bias):
        n, length, d = h.shape
        qkv = block["qkv"](block["norm1"](h)).reshape(n, length, 3, self.n_heads, d // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # [N, H, L, dh]
        scores = torch.matmul(q, k.transpose(-1, -2)) * (d // self.n_heads) ** -0.5 + key_bias
        out = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).reshape(n, length, d)
        h = h + block["proj"](out)
        return h + block["ff2"](torch.nn.functional.silu(block["ff1"](block["norm2"](h))))

    def member_outputs(self, kind_ids, token_features, mask):
        m = mask.unsqueeze(-1)
        h = torch.nn.functional.silu(self.embed_kind(kind_ids) + self.embed_features(token_features)) * m
        # Masked chunk means: sum over chunks of h * mask / number of real tokens in the chunk.
        pooled_h = torch.nn.functional.avg_pool1d(h.transpose(1, 2), self.pool, self.pool, ceil_mode=True)
        pooled_m = torch.nn.functional.avg_pool1d(mask.unsqueeze(1), self.pool, self.pool, ceil_mode=True)
        h = (pooled_h / pooled_m.clamp(min=1e-6)).transpose(1, 2)  # [N, L', d]
        chunk_mask = (pooled_m > 0).to(h.dtype).transpose(1, 2)  # [N, L', 1]
        key_bias = (chunk_mask.transpose(1, 2).unsqueeze(1) - 1.0) * 1e4  # [N, 1, 1, L']
        for block in self.blocks:
            h = self.attention(block, h, key_bias)
        h = self.norm(h)
        summary = (h * chunk_mask).sum(dim=1) / chunk_mask.sum(dim=1).clamp(min=1.0)
        # First-principles base from the raw token values (log1p inverted inside the graph).
        cols = torch.stack([token_features[..., self.p_col], token_features[..., self.o_col]], dim=-1)
        raw = torch.expm1(cols * self.raw_std + self.raw_mean) * m  # [N, L, 2]
        totals = raw.sum(dim=1)  # [N, 2]
        base = torch.log(1300.0 + (16.0 * totals[:, :1] + 4.0 * totals[:, 1:2]) / 1048576.0)
        scale = torch.log1p(totals) / 20.0
        out = self.head(torch.cat([summary, scale], dim=-1))
        mu = base + out[:, :1]
        return mu.unsqueeze(0), ordinal_probabilities(mu, out[:, 1:2], self.log_bins).unsqueeze(0)

    def forward(self, kind_ids, token_features, mask):
        return self.member_outputs(kind_ids, token_features, mask)[1].mean(dim=0)
