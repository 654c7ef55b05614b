"""Torch modules of the gpucast estimators (the mlp stage, mlp.py, exports them to ONNX).

All models take the *normalised* inputs of docs/design/models.md.  Peak memory is close to linear in
parameter and activation counts (CUDA context + ~16 B/param for Adam fp32 + activations x batch),
while the inputs are log-scaled, so every model carries a fixed "linear-scale" input layer: it
undoes the normalisation of a few count features inside the graph (expm1(x * std + mean)) and
divides by a training-set scale, giving the network both log and linear views of the counts.
The constants are buffers, so the ONNX files stay self-contained.
"""

import torch
from torch import nn


class LinearScaleInputs(nn.Module):
    """Recover selected raw log1p features from their normalised values, rescaled to ~1."""

    def __init__(self, columns, means, stds, scales):
        super().__init__()
        self.register_buffer("columns", torch.tensor(columns, dtype=torch.long))
        self.register_buffer("means", torch.tensor(means, dtype=torch.float32))
        self.register_buffer("stds", torch.tensor(stds, dtype=torch.float32))
        self.register_buffer("scales", torch.tensor(scales, dtype=torch.float32))

    def raw(self, x):
        return torch.expm1(x.index_select(-1, self.columns) * self.stds + self.means)

    def forward(self, x):
        return self.raw(x) / self.scales


def mlp(n_inputs, hidden, n_outputs):
    return nn.Sequential(
        nn.Linear(n_inputs, hidden),
        nn.SiLU(),
        nn.Linear(hidden, hidden),
        nn.SiLU(),
        nn.Linear(hidden, n_outputs),
    )


class AggregateMLP(nn.Module):
    """One member: aggregate features (+ their linear-scale view) -> logits / raw output."""

    def __init__(self, n_features, linear_scale, hidden, n_outputs):
        super().__init__()
        self.linear_scale = linear_scale
        self.body = mlp(n_features + len(linear_scale.columns), hidden, n_outputs)

    def forward(self, features):
        return self.body(torch.cat([features, self.linear_scale(features)], dim=-1))


class OrdinalMemoryHead(nn.Module):
    """Estimate peak memory, then turn it into class probabilities with soft class boundaries.

    memory = linear(linear-scale counts) + mlp(all inputs), in GiB (1000 MiB) units;
    P(peak <= b_i) = sigmoid((b_i - memory) / spread), and class i gets the mass between
    consecutive boundaries.  Training also regresses `memory` on the measured peak, which uses
    far more of the label than the class alone.
    """

    def __init__(self, n_linear, n_inputs, hidden, bins_mib):
        super().__init__()
        self.linear = nn.Linear(n_linear, 1)
        self.correction = mlp(n_inputs, hidden, 1)
        self.log_spread = nn.Parameter(torch.tensor(-3.0))  # spread ~ 50 MiB to start
        self.register_buffer("bins", torch.tensor(bins_mib, dtype=torch.float32) / 1000.0)

    def forward(self, linear_inputs, inputs):
        memory = self.linear(linear_inputs) + self.correction(inputs)  # [N, 1]
        below = torch.sigmoid((self.bins - memory) / torch.exp(self.log_spread))  # [N, K]
        zeros, ones = torch.zeros_like(memory), torch.ones_like(memory)
        cdf = torch.cat([zeros, below, ones], dim=-1)  # [N, K + 2]
        return cdf[:, 1:] - cdf[:, :-1], memory[:, 0]


class AggregateMemoryModel(nn.Module):
    """One ensemble member: aggregate features -> (class probabilities, memory in GiB)."""

    def __init__(self, n_features, linear_scale, hidden, bins_mib):
        super().__init__()
        self.linear_scale = linear_scale
        n_linear = len(linear_scale.columns)
        self.head = OrdinalMemoryHead(n_linear, n_features + n_linear, hidden, bins_mib)

    def forward(self, features):
        linear = self.linear_scale(features)
        return self.head(linear, torch.cat([features, linear], dim=-1))


class ProbabilityEnsemble(nn.Module):
    """Exported memory classifier: mean of the members' softmax probabilities."""

    def __init__(self, members):
        super().__init__()
        self.members = nn.ModuleList(members)

    def forward(self, features):
        probabilities = [member(features)[0] for member in self.members]
        return torch.stack(probabilities, dim=0).mean(dim=0)


class SigmoidEnsemble(nn.Module):
    """Exported utilization regressor: mean of the members' sigmoid outputs, shape [N, 1]."""

    def __init__(self, members):
        super().__init__()
        self.members = nn.ModuleList(members)

    def forward(self, features):
        values = [torch.sigmoid(member(features)) for member in self.members]
        return torch.stack(values, dim=0).mean(dim=0)


class MaskedSelfAttention(nn.Module):
    """Multi-head self-attention that ignores padded keys (hand-written so it exports cleanly)."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, h, key_bias):
        n, length, d_model = h.shape
        qkv = self.qkv(h).reshape(n, length, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # [N, H, L, Dh]
        scores = q @ k.transpose(-1, -2) * (self.head_dim**-0.5) + key_bias
        context = torch.softmax(scores, dim=-1) @ v  # [N, H, L, Dh]
        return self.out(context.transpose(1, 2).reshape(n, length, d_model))


class EncoderBlock(nn.Module):
    """Pre-norm Transformer encoder block."""

    def __init__(self, d_model, n_heads, d_ff):
        super().__init__()
        self.norm_attention = nn.LayerNorm(d_model)
        self.attention = MaskedSelfAttention(d_model, n_heads)
        self.norm_ff = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))

    def forward(self, h, key_bias):
        h = h + self.attention(self.norm_attention(h), key_bias)
        return h + self.ff(self.norm_ff(h))


class SequenceTransformer(nn.Module):
    """Layer tokens -> Transformer encoder -> masked mean pool -> (probabilities, memory).

    Besides the pooled encoding, the head sees the masked *sums* of the tokens' linear-scale
    params and output x batch (total parameters and activation volume, the quantities memory is
    linear in), which mean pooling alone cannot express.
    """

    def __init__(
        self,
        n_kinds,
        n_token_features,
        token_linear_scale,
        sum_log_mean,
        sum_log_std,
        bins_mib,
        d_model=32,
        n_heads=4,
        n_layers=2,
        d_ff=64,
    ):
        super().__init__()
        self.kind_embedding = nn.Embedding(n_kinds + 1, d_model, padding_idx=0)
        self.token_projection = nn.Linear(n_token_features, d_model)
        self.blocks = nn.ModuleList(EncoderBlock(d_model, n_heads, d_ff) for _ in range(n_layers))
        self.final_norm = nn.LayerNorm(d_model)
        self.token_linear_scale = token_linear_scale
        self.register_buffer("sum_log_mean", torch.tensor(sum_log_mean, dtype=torch.float32))
        self.register_buffer("sum_log_std", torch.tensor(sum_log_std, dtype=torch.float32))
        n_sums = len(token_linear_scale.columns)
        self.head = OrdinalMemoryHead(n_sums, d_model + 2 * n_sums, 2 * d_model, bins_mib)

    def forward(self, kind_ids, token_features, mask):
        key_bias = ((mask - 1.0) * 1e9)[:, None, None, :]  # [N, 1, 1, L]; 0 for real tokens
        h = self.kind_embedding(kind_ids) + self.token_projection(token_features)
        for block in self.blocks:
            h = block(h, key_bias)
        h = self.final_norm(h)
        weights = mask[..., None]
        pooled = (h * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)
        raw_sums = (self.token_linear_scale.raw(token_features) * weights).sum(dim=1)
        sums = raw_sums / self.token_linear_scale.scales
        log_sums = (torch.log1p(raw_sums) - self.sum_log_mean) / self.sum_log_std
        return self.head(sums, torch.cat([pooled, sums, log_sums], dim=-1))


class SequenceProbabilities(nn.Module):
    """Exported sequence classifier: the transformer's class probabilities only."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, kind_ids, token_features, mask):
        return self.model(kind_ids, token_features, mask)[0]


class SequenceEnsemble(nn.Module):
    """Exported sequence classifier: mean of K independently seeded transformers' probabilities.

    The members run one after another inside the one graph (same inputs and output as a single
    `SequenceProbabilities`); averaging their class probabilities smooths the seed-to-seed noise
    of the soft class boundaries, where all of the single model's errors lie.
    """

    def __init__(self, members):
        super().__init__()
        self.members = nn.ModuleList(members)

    def forward(self, kind_ids, token_features, mask):
        probabilities = [member(kind_ids, token_features, mask)[0] for member in self.members]
        if len(probabilities) == 1:
            return probabilities[0]
        return torch.stack(probabilities, dim=0).mean(dim=0)


class StackedSequenceEnsemble(nn.Module):
    """The same mean of K transformers as `SequenceEnsemble`, with the members' weights stacked.

    Every linear layer becomes one batched MatMul over a leading member axis [K, ...], so the
    exported graph has the node count of a single transformer whatever K is (ONNX Runtime's
    per-node overhead, not arithmetic, dominates at N = 1).  Built from trained members; the
    token sums' scaling constants are shared (all members are fitted on the same rows).
    """

    def __init__(self, members):
        super().__init__()
        first = members[0]
        for member in members[1:]:
            for name in ("sum_log_mean", "sum_log_std"):
                assert torch.equal(getattr(member, name), getattr(first, name))
            for name in ("columns", "means", "stds", "scales"):
                assert torch.equal(getattr(member.token_linear_scale, name), getattr(first.token_linear_scale, name))
            assert torch.equal(member.head.bins, first.head.bins)
        self.n_members = len(members)
        self.token_linear_scale = first.token_linear_scale
        self.register_buffer("sum_log_mean", first.sum_log_mean.clone())
        self.register_buffer("sum_log_std", first.sum_log_std.clone())
        self.register_buffer("bins", first.head.bins.clone())
        self.n_heads = first.blocks[0].attention.n_heads
        self.head_dim = first.blocks[0].attention.head_dim
        self.n_blocks = len(first.blocks)

        def stack(get, linear=False):
            tensors = [get(member).detach() for member in members]
            if linear:  # nn.Linear weight [out, in] -> [in, out] for x @ W
                tensors = [t.t() for t in tensors]
            return nn.Parameter(torch.stack(tensors, dim=0).contiguous())

        self.embedding = stack(lambda m: m.kind_embedding.weight)  # [K, V, D]
        self.projection_w = stack(lambda m: m.token_projection.weight, True)  # [K, T, D]
        self.projection_b = stack(lambda m: m.token_projection.bias)
        self.block_params = nn.ParameterList()
        names = []
        for b in range(self.n_blocks):
            for key, get, linear in (
                ("ln1_w", lambda m: m.blocks[b].norm_attention.weight, False),
                ("ln1_b", lambda m: m.blocks[b].norm_attention.bias, False),
                ("qkv_w", lambda m: m.blocks[b].attention.qkv.weight, True),
                ("qkv_b", lambda m: m.blocks[b].attention.qkv.bias, False),
                ("out_w", lambda m: m.blocks[b].attention.out.weight, True),
                ("out_b", lambda m: m.blocks[b].attention.out.bias, False),
                ("ln2_w", lambda m: m.blocks[b].norm_ff.weight, False),
                ("ln2_b", lambda m: m.blocks[b].norm_ff.bias, False),
                ("ff1_w", lambda m: m.blocks[b].ff[0].weight, True),
                ("ff1_b", lambda m: m.blocks[b].ff[0].bias, False),
                ("ff2_w", lambda m: m.blocks[b].ff[2].weight, True),
                ("ff2_b", lambda m: m.blocks[b].ff[2].bias, False),
            ):
                self.block_params.append(stack(get, linear))
                names.append((b, key))
        self.block_index = {name: i for i, name in enumerate(names)}
        self.final_w = stack(lambda m: m.final_norm.weight)
        self.final_b = stack(lambda m: m.final_norm.bias)
        self.eps = first.final_norm.eps
        self.linear_w = stack(lambda m: m.head.linear.weight, True)  # [K, S, 1]
        self.linear_b = stack(lambda m: m.head.linear.bias)
        self.corr = nn.ParameterList()
        for i in (0, 2, 4):
            self.corr.append(stack(lambda m: m.head.correction[i].weight, True))
            self.corr.append(stack(lambda m: m.head.correction[i].bias))
        self.log_spread = stack(lambda m: m.head.log_spread.reshape(1))  # [K, 1]

    def _block(self, b, key):
        return self.block_params[self.block_index[(b, key)]]

    @staticmethod
    def _linear(x, weight, bias):
        # x [K, M, in] @ [K, in, out] + [K, 1, out]
        return torch.matmul(x, weight) + bias[:, None, :]

    def _norm(self, x, weight, bias):
        x = nn.functional.layer_norm(x, x.shape[-1:], eps=self.eps)
        return x * weight[:, None, :] + bias[:, None, :]

    def forward(self, kind_ids, token_features, mask):
        n, length = kind_ids.shape
        k, d_model, heads, dh = self.n_members, self.embedding.shape[-1], self.n_heads, self.head_dim
        rows = n * length
        embedded = self.embedding.index_select(1, kind_ids.reshape(-1))  # [K, N*L, D]
        flat_tokens = token_features.reshape(1, rows, -1)
        h = embedded + self._linear(flat_tokens, self.projection_w, self.projection_b)
        key_bias = ((mask - 1.0) * 1e9)[None, :, None, None, :]  # [1, N, 1, 1, L]
        for b in range(self.n_blocks):
            x = self._norm(h, self._block(b, "ln1_w"), self._block(b, "ln1_b"))
            qkv = self._linear(x, self._block(b, "qkv_w"), self._block(b, "qkv_b"))
            qkv = qkv.reshape(k, n, length, 3, heads, dh).permute(3, 0, 1, 4, 2, 5)  # [3, K, N, H, L, Dh]
            q, key, v = qkv[0], qkv[1], qkv[2]
            scores = q @ key.transpose(-1, -2) * (dh**-0.5) + key_bias
            context = torch.softmax(scores, dim=-1) @ v  # [K, N, H, L, Dh]
            context = context.permute(0, 1, 3, 2, 4).reshape(k, rows, d_model)
            h = h + self._linear(context, self._block(b, "out_w"), self._block(b, "out_b"))
            x = self._norm(h, self._block(b, "ln2_w"), self._block(b, "ln2_b"))
            x = nn.functional.gelu(self._linear(x, self._block(b, "ff1_w"), self._block(b, "ff1_b")))
            h = h + self._linear(x, self._block(b, "ff2_w"), self._block(b, "ff2_b"))
        h = self._norm(h, self.final_w, self.final_b).reshape(k, n, length, d_model)
        weights = mask[..., None]  # [N, L, 1]
        pooled = (h * weights).sum(dim=2) / weights.sum(dim=1).clamp(min=1.0)  # [K, N, D]
        raw_sums = (self.token_linear_scale.raw(token_features) * weights).sum(dim=1)  # [N, S]
        sums = raw_sums / self.token_linear_scale.scales
        log_sums = (torch.log1p(raw_sums) - self.sum_log_mean) / self.sum_log_std
        shared = torch.cat([sums, log_sums], dim=-1)[None].expand(k, n, -1)
        inputs = torch.cat([pooled, shared], dim=-1)  # [K, N, D + 2S]
        x = nn.functional.silu(self._linear(inputs, self.corr[0], self.corr[1]))
        x = nn.functional.silu(self._linear(x, self.corr[2], self.corr[3]))
        memory = self._linear(x, self.corr[4], self.corr[5]) + self._linear(
            sums[None].expand(k, n, -1), self.linear_w, self.linear_b
        )  # [K, N, 1]
        spread = torch.exp(self.log_spread)[:, None, :]  # [K, 1, 1]
        below = torch.sigmoid((self.bins - memory) / spread)  # [K, N, B]
        zeros, ones = torch.zeros_like(memory), torch.ones_like(memory)
        cdf = torch.cat([zeros, below, ones], dim=-1)
        return (cdf[..., 1:] - cdf[..., :-1]).mean(dim=0)  # [N, C]
