import unittest

import torch
import torch.nn as nn

import toy_models
from _streams import assert_same_stream
from gpucast_describe import SimulationError, describe_module, simulate_step, with_batch_size
from gpucast_describe.simulate import CATEGORIES, interpolate_simulation

MIB = 1 << 20

try:
    import transformers
except ImportError:
    transformers = None


def on_meta(factory):
    with torch.device("meta"):
        return factory()


def rounded(nbytes):
    """The caching allocator's block size for a request (512-byte multiples)."""
    return max(512, -(-nbytes // 512) * 512)


class WideLinear(nn.Module):
    """One 2048 x 2048 linear (16 MiB of weights): at batch 2 the model state dominates and
    the peak is in Adam's step."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2048, 2048, bias=False)

    def forward(self, x):
        return self.fc(x)


class DropoutNet(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.fc = nn.Linear(256, 4096)
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(4096, 10)

    def forward(self, x):
        return self.head(self.drop(self.fc(x)))


class AttentionNet(nn.Module):
    """Token embeddings through one SDPA call: its kernel decides what backward keeps."""

    def __init__(self, dim=64, heads=4, vocab=50):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = toy_models.SelfAttention(dim, heads)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        return self.head(self.attn(self.embed(ids)))


class SimulationFieldsTest(unittest.TestCase):
    def setUp(self):
        self.model = on_meta(toy_models.mlp)
        self.sim = simulate_step(self.model, [20], 64)

    def test_fields(self):
        self.assertEqual(
            set(self.sim),
            {
                "batch_size",
                "optimizer",
                "precision",
                "attention",
                "trainable_params",
                "allocated_peak_bytes",
                "reserved_peak_bytes",
                "min_capacity_bytes",
                "breakdown_at_peak",
                "interpolated",
            },
        )
        self.assertEqual(self.sim["batch_size"], 64)
        self.assertEqual((self.sim["optimizer"], self.sim["precision"]), ("adam", "fp32"))
        self.assertFalse(self.sim["interpolated"])

    def test_breakdown_sums_to_the_allocated_peak(self):
        self.assertEqual(set(self.sim["breakdown_at_peak"]), set(CATEGORIES))
        self.assertEqual(sum(self.sim["breakdown_at_peak"].values()), self.sim["allocated_peak_bytes"])

    def test_allocated_min_capacity_reserved_are_ordered(self):
        self.assertLessEqual(self.sim["allocated_peak_bytes"], self.sim["min_capacity_bytes"])
        self.assertLessEqual(self.sim["min_capacity_bytes"], self.sim["reserved_peak_bytes"])

    def test_small_tensors_are_carved_from_two_mib_segments(self):
        # Every tensor of this toy is far below 1 MiB: one or two small-pool segments hold all.
        self.assertEqual(self.sim["reserved_peak_bytes"] % (2 * MIB), 0)
        self.assertLessEqual(self.sim["reserved_peak_bytes"], 4 * MIB)

    def test_parameters_counted_once_as_blocks(self):
        expected = sum(rounded(p.numel() * 4) for p in self.model.parameters()) + sum(
            rounded(b.numel() * b.element_size()) for b in self.model.buffers()
        )
        self.assertEqual(self.sim["breakdown_at_peak"]["parameters"], expected)

    def test_the_callers_module_keeps_its_flags(self):
        self.model.eval()
        simulate_step(self.model, [20], 8)
        self.assertFalse(any(m.training for m in self.model.modules()))


class OptimizerStateTest(unittest.TestCase):
    """Model state by the optimizer as PyTorch runs it (foreach), at the step's peak."""

    def setUp(self):
        self.model = on_meta(WideLinear)
        self.weight = 2048 * 2048 * 4  # 16 MiB

    def breakdown(self, optimizer):
        sim = simulate_step(self.model, [2048], 2, optimizer=optimizer)
        return sim, sim["breakdown_at_peak"]

    def test_adam_peak_is_in_the_step_with_its_sqrt_temporary(self):
        sim, b = self.breakdown("adam")
        self.assertEqual(b["parameters"], self.weight)
        self.assertEqual(b["gradients"], self.weight)
        self.assertEqual(b["optimizer_state"], 2 * self.weight)  # exp_avg, exp_avg_sq
        # _foreach_sqrt(exp_avg_sq) allocates one more copy of the weights
        self.assertGreaterEqual(b["temporaries"], self.weight)
        self.assertGreaterEqual(sim["allocated_peak_bytes"], 5 * self.weight)

    def test_sgd_keeps_no_state_and_momentum_one_buffer(self):
        _, sgd = self.breakdown("sgd")
        self.assertEqual(sgd["optimizer_state"], 0)
        _, momentum = self.breakdown("momentum")
        self.assertEqual(momentum["optimizer_state"], self.weight)

    def test_adam_state_exists_during_the_second_steps_forward(self):
        # A wide activation makes the peak fall in forward/backward, where Adam's state from
        # step one is already resident: the steady state is the second step.
        sim = simulate_step(self.model, [2048], 4096, optimizer="adam")
        self.assertEqual(sim["breakdown_at_peak"]["optimizer_state"], 2 * self.weight)
        self.assertGreater(sim["breakdown_at_peak"]["activations"], 0)

    def test_physical_floor(self):
        for optimizer in ("sgd", "momentum", "adam", "adamw"):
            sim, b = self.breakdown(optimizer)
            state = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}[optimizer]
            self.assertGreaterEqual(sim["allocated_peak_bytes"], (2 + state) * self.weight, optimizer)

    def test_unknown_optimizer_is_refused(self):
        with self.assertRaises(ValueError):
            simulate_step(self.model, [2048], 2, optimizer="lion")


class GpuKernelChoiceTest(unittest.TestCase):
    def test_dropout_saves_a_one_byte_mask(self):
        # With dropout, backward keeps the dropout output (4 B an element) and its mask: 1 B
        # an element as CUDA's native_dropout saves it (a float mask would be 4 B).
        batch, width = 256, 4096
        with_dropout = simulate_step(on_meta(lambda: DropoutNet(0.5)), [256], batch)
        without = simulate_step(on_meta(lambda: DropoutNet(0.0)), [256], batch)
        extra = with_dropout["breakdown_at_peak"]["activations"] - without["breakdown_at_peak"]["activations"]
        elements = batch * width
        self.assertGreaterEqual(extra, 5 * elements - 4096)
        self.assertLessEqual(extra, 5 * elements + 4096)

    def test_efficient_attention_keeps_no_n_by_n_probabilities(self):
        model = on_meta(AttentionNet)
        seq, batch, heads = 512, 8, 4
        efficient = simulate_step(model, [seq], batch, torch.int64, attention="efficient")
        math_path = simulate_step(model, [seq], batch, torch.int64, attention="math")
        n_by_n = batch * heads * seq * seq * 4
        gap = math_path["breakdown_at_peak"]["activations"] - efficient["breakdown_at_peak"]["activations"]
        # the softmax output (N x N, fp32) less what the efficient kernel keeps instead
        self.assertGreaterEqual(gap, 0.75 * n_by_n)
        self.assertEqual(efficient["attention"], "efficient")

    def test_mixed16_saves_half_precision_inputs(self):
        # Four linears: autocast keeps the hidden activations (and the matmuls' saved inputs)
        # in fp16, so what backward keeps shrinks although the fp32 batch and loss stay.
        model = on_meta(lambda: nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)]))
        fp32 = simulate_step(model, [1024], 4096, optimizer="sgd")
        mixed = simulate_step(model, [1024], 4096, optimizer="sgd", precision="mixed16")
        self.assertEqual(mixed["precision"], "amp_fp16")  # mixed16's canonical name
        self.assertLess(mixed["breakdown_at_peak"]["activations"], fp32["breakdown_at_peak"]["activations"])
        # fp32 master weights stay: parameters unchanged
        self.assertEqual(mixed["breakdown_at_peak"]["parameters"], fp32["breakdown_at_peak"]["parameters"])


class FastMetaTest(unittest.TestCase):
    """The directly-made outputs of the norm ops equal the real meta kernels' in shape, dtype,
    strides and bytes, so the allocation stream is the same, only faster."""

    def compare(self, model, example, precision="fp32"):
        from torch.utils._python_dispatch import TorchDispatchMode
        from gpucast_describe import simulate

        seen, mismatches = [], []

        def key(t):
            if not isinstance(t, torch.Tensor):
                return t
            # strides of size-1 dimensions never matter (to contiguity or to bytes)
            strides = tuple(st for size, st in zip(t.shape, t.stride()) if size > 1)
            return (tuple(t.shape), t.dtype, strides, t.untyped_storage().nbytes())

        class Compare(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                fast = simulate._FAST_META.get(func)
                if fast is not None:
                    seen.append(func)
                    direct = fast(*args, **(kwargs or {}))
                    if [key(t) for t in out] != [key(t) for t in direct]:
                        mismatches.append((str(func), [key(t) for t in out], [key(t) for t in direct]))
                return out

        kernels = simulate._GpuKernelMode(True, precision == "mixed16")
        model.train()
        with Compare(), kernels:
            simulate.default_loss(model(example)).backward()
        model.eval()
        with Compare(), kernels:
            model(example[:1])
        self.assertTrue(seen)
        self.assertEqual(mismatches, [])

    def test_batch_norm_cnn(self):
        model = on_meta(toy_models.tiny_cnn)
        self.compare(model, torch.zeros(4, 3, 32, 32, device="meta"))
        self.compare(model, torch.zeros(4, 3, 32, 32, device="meta"), "mixed16")

    def test_layer_norm_on_permuted_and_transposed_inputs(self):
        class Norms(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(3, 16, 3)
                self.channels_last_norm = nn.LayerNorm(16)
                self.token_norm = nn.LayerNorm(16)
                self.head = nn.Linear(16, 10)

            def forward(self, x):
                x = self.conv(x)
                x = self.channels_last_norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)  # convnext
                tokens = self.token_norm(x.flatten(2).transpose(1, 2))  # pvt
                return self.head(tokens.mean(1))

        model = on_meta(Norms)
        self.compare(model, torch.zeros(4, 3, 16, 16, device="meta"))
        self.compare(model, torch.zeros(4, 3, 16, 16, device="meta"), "mixed16")


class MemoisedMetaKernelTest(unittest.TestCase):
    """Meta kernels memoised by their arguments' metadata make the same allocation stream, in
    the same order, as running every kernel."""

    def events(self, model, shape, batch, dtype=torch.float32, **setup):
        assert_same_stream(self, "MEMOISE_META_KERNELS", model, shape, batch, dtype, **setup)

    def test_cnn_and_token_models(self):
        self.events(on_meta(toy_models.tiny_cnn), [3, 32, 32], 8)
        self.events(on_meta(toy_models.tiny_cnn), [3, 32, 32], 8, precision="mixed16")
        self.events(on_meta(toy_models.tiny_token_model), [64], 4, torch.int64, optimizer="momentum")

    @unittest.skipIf(transformers is None, "transformers is not installed")
    def test_llama(self):
        config = transformers.LlamaConfig(
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=256,
            vocab_size=500,
        )
        model = on_meta(lambda: transformers.LlamaForCausalLM(config))
        self.events(model, [64], 2, torch.int64, optimizer="adamw", precision="mixed16")


class LossTest(unittest.TestCase):
    def test_sum_loss_for_outputs_without_logits(self):
        model = on_meta(WideLinear)
        auto = simulate_step(model, [2048], 8)
        summed = simulate_step(model, [2048], 8, loss="sum")
        self.assertGreater(auto["allocated_peak_bytes"], 0)
        self.assertGreater(summed["allocated_peak_bytes"], 0)

    @unittest.skipIf(transformers is None, "transformers is not installed")
    def test_token_logits_get_cross_entropy_at_every_position(self):
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128)
        model = on_meta(lambda: transformers.GPT2LMHeadModel(config))
        sim = simulate_step(model, [128], 4, torch.int64)
        logits = 4 * 128 * 1000 * 4
        # The logits and their log-softmax are kept for backward.
        self.assertGreaterEqual(sim["breakdown_at_peak"]["activations"], 2 * logits)

    @unittest.skipIf(transformers is None, "transformers is not installed")
    def test_eager_attention_switches_hugging_face_models_and_restores_them(self):
        config = transformers.BertConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=500
        )
        model = on_meta(lambda: transformers.BertForMaskedLM(config))
        before = model.config._attn_implementation
        sdpa = simulate_step(model, [256], 8, torch.int64)
        eager = simulate_step(model, [256], 8, torch.int64, attention="eager")
        self.assertEqual(model.config._attn_implementation, before)
        # eager keeps each layer's N x N probabilities (and their dropout mask and output)
        n_by_n = 8 * 4 * 256 * 256 * 4
        gap = eager["breakdown_at_peak"]["activations"] - sdpa["breakdown_at_peak"]["activations"]
        self.assertGreaterEqual(gap, 2 * n_by_n)

    def test_a_model_that_cannot_train_raises_simulation_error(self):
        frozen = on_meta(WideLinear)
        for p in frozen.parameters():
            p.requires_grad_(False)
        with self.assertRaises(SimulationError):
            simulate_step(frozen, [2048], 2)


class DescriptionTest(unittest.TestCase):
    def test_description_carries_the_simulation_of_its_batch(self):
        model = on_meta(toy_models.mlp)
        description = describe_module(model, [20], 32, optimizer="sgd")
        self.assertEqual(description["simulation"]["batch_size"], 32)
        self.assertEqual(description["optimizer"], "sgd")
        self.assertEqual(description["simulation"]["optimizer"], "sgd")

    def test_another_batch_size_is_simulated_again_or_dropped(self):
        model = on_meta(toy_models.mlp)
        description = describe_module(model, [20], 32)
        again = with_batch_size(description, 64, model=model)
        self.assertEqual(again["simulation"]["batch_size"], 64)
        dropped = with_batch_size(description, 64)
        self.assertNotIn("simulation", dropped)
        kept = with_batch_size(description, 32)
        self.assertEqual(kept["simulation"], description["simulation"])

    def test_simulation_can_be_skipped(self):
        model = on_meta(toy_models.mlp)
        self.assertNotIn("simulation", describe_module(model, [20], 32, simulation=False))

    def test_peaks_grow_with_the_batch(self):
        model = on_meta(lambda: DropoutNet(0.1))
        peaks = [simulate_step(model, [256], b)["allocated_peak_bytes"] for b in (8, 64, 512)]
        self.assertEqual(peaks, sorted(peaks))
        self.assertLess(peaks[0], peaks[-1])


class InterpolationTest(unittest.TestCase):
    def test_interpolated_between_two_batches(self):
        model = on_meta(lambda: DropoutNet(0.1))
        low, high = simulate_step(model, [256], 256), simulate_step(model, [256], 4096)
        middle = interpolate_simulation(low, high, 1024)
        self.assertTrue(middle["interpolated"])
        self.assertEqual(middle["batch_size"], 1024)
        self.assertEqual(sum(middle["breakdown_at_peak"].values()), middle["allocated_peak_bytes"])
        self.assertLessEqual(middle["allocated_peak_bytes"], middle["min_capacity_bytes"])
        self.assertLessEqual(middle["min_capacity_bytes"], middle["reserved_peak_bytes"])
        self.assertLessEqual(low["allocated_peak_bytes"], middle["allocated_peak_bytes"])
        self.assertLessEqual(middle["allocated_peak_bytes"], high["allocated_peak_bytes"])
        self.assertLess(low["allocated_peak_bytes"], high["allocated_peak_bytes"])
        exact = simulate_step(model, [256], 1024)
        self.assertLess(abs(middle["allocated_peak_bytes"] / exact["allocated_peak_bytes"] - 1), 0.1)

    def test_outside_the_two_batches_is_refused(self):
        model = on_meta(toy_models.mlp)
        low, high = simulate_step(model, [20], 8), simulate_step(model, [20], 16)
        with self.assertRaises(ValueError):
            interpolate_simulation(low, high, 32)


if __name__ == "__main__":
    unittest.main()
