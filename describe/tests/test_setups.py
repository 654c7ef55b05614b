"""The training setups the simulation runs (docs/user/setups.md): precisions, optimizers and their
implementations, gradient accumulation, the module transforms of adapters.py (LoRA, frozen
modules, activation checkpointing) and the output contract. Small toy models, each simulated
in well under a second; the sizes asserted are what the physics of each setup makes them."""

import unittest

import torch
import torch.nn as nn
import torch.nn.functional as F

import toy_models
from gpucast_describe import describe_module, simulate, simulate_step, with_batch_size
from gpucast_describe import allocator
from _streams import assert_same_stream
from test_cli import lines, run_cli

MIB = 1 << 20
WEIGHT = 2048 * 2048  # WideLinear's parameters


def on_meta(factory):
    with torch.device("meta"):
        return factory()


class WideLinear(nn.Module):
    """One 2048 x 2048 linear: at batch 2 the model state dominates, the peak is in the
    optimizer step (every state tensor alive)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2048, 2048, bias=False)

    def forward(self, x):
        return self.fc(x)


def wide(**setup):
    return simulate_step(on_meta(WideLinear), [2048], 2, **setup)


def peak(sim, category):
    return sim["breakdown_at_peak"][category]


class Block(nn.Module):
    def __init__(self, width=256, hidden=1024):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    """Four blocks and a head: activations dominate at a large batch."""

    def __init__(self, width=256):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(width) for _ in range(4)])
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.blocks(x))


class PrecisionTest(unittest.TestCase):
    def test_pure_bf16_halves_weights_gradients_and_adam_state(self):
        fp32, bf16 = wide(), wide(precision="bf16")
        self.assertEqual(bf16["precision"], "bf16")
        for category in ("parameters", "gradients", "optimizer_state"):
            self.assertEqual(peak(bf16, category) * 2, peak(fp32, category), category)
        self.assertEqual(peak(bf16, "parameters"), WEIGHT * 2)
        self.assertEqual(peak(bf16, "optimizer_state"), 2 * WEIGHT * 2)  # exp_avg, exp_avg_sq
        self.assertLess(bf16["allocated_peak_bytes"], 0.55 * fp32["allocated_peak_bytes"])

    def test_amp_keeps_fp32_weights_gradients_and_state(self):
        fp32 = wide()
        for precision in ("amp_fp16", "amp_bf16"):
            amp = wide(precision=precision)
            self.assertEqual(amp["precision"], precision)
            for category in ("parameters", "gradients", "optimizer_state"):
                self.assertEqual(peak(amp, category), peak(fp32, category), (precision, category))

    def test_amp_keeps_16_bit_activations(self):
        # Eight linears (the outputs' sum as the loss): autocast saves each matmul's input in
        # 16 bits, pure bf16 everything; the fp32 batch stays fp32 under autocast.
        model = on_meta(lambda: nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]))
        fp32 = simulate_step(model, [1024], 4096, optimizer="sgd", loss="sum")
        amp = {
            precision: simulate_step(model, [1024], 4096, optimizer="sgd", loss="sum", precision=precision)
            for precision in ("amp_fp16", "amp_bf16", "bf16")
        }
        self.assertLess(peak(amp["amp_fp16"], "activations"), 0.9 * peak(fp32, "activations"))
        self.assertEqual(amp["amp_bf16"]["breakdown_at_peak"], amp["amp_fp16"]["breakdown_at_peak"])
        self.assertEqual(peak(amp["amp_fp16"], "parameters"), peak(fp32, "parameters"))
        self.assertLessEqual(peak(amp["bf16"], "activations"), 0.5 * peak(fp32, "activations") + 4096)

    def test_tf32_is_fp32_memory(self):
        fp32, tf32 = wide(), wide(precision="tf32")
        self.assertEqual(tf32["precision"], "tf32")
        self.assertEqual(
            {k: v for k, v in tf32.items() if k != "precision"}, {k: v for k, v in fp32.items() if k != "precision"}
        )

    def test_mixed16_is_amp_fp16(self):
        mixed, amp = wide(precision="mixed16"), wide(precision="amp_fp16")
        self.assertEqual(mixed["precision"], "amp_fp16")
        self.assertEqual(mixed, amp)

    def test_fp16_adds_a_loss_scaler(self):
        # The scale and growth tracker stay (two 512-byte blocks of state); the unscale's
        # inverse scale and found-inf flags come and go in the step; nothing else differs.
        bf16, fp16 = wide(precision="bf16"), wide(precision="fp16")
        self.assertEqual(peak(fp16, "optimizer_state") - peak(bf16, "optimizer_state"), 1024)
        self.assertEqual(peak(fp16, "parameters"), peak(bf16, "parameters"))
        self.assertEqual(peak(fp16, "gradients"), peak(bf16, "gradients"))
        self.assertGreater(fp16["allocated_peak_bytes"], bf16["allocated_peak_bytes"])

    def test_pure_precision_casts_a_copy_and_the_float_inputs(self):
        model = on_meta(toy_models.tiny_cnn)
        sim = simulate_step(model, [3, 32, 32], 4, precision="bf16")
        self.assertEqual(sim["precision"], "bf16")
        self.assertTrue(all(p.dtype == torch.float32 for p in model.parameters()))
        # the input batch [4, 3, 32, 32] in bf16 is what the first convolution keeps
        self.assertGreater(sim["allocated_peak_bytes"], 0)


class SoftmaxUnderPurePrecisionTest(unittest.TestCase):
    """softmax(x, dtype=float32): CUDA reads an fp16 input directly (half_to_float), but
    converts a bf16 one to an fp32 copy first (the kernel's conversion is fp16-only)."""

    def allocations(self, dtype):
        recorder = simulate._StepRecorder()
        with recorder, simulate._GpuKernelMode(True, False):
            x = torch.empty(64, 1024, device="meta", dtype=dtype, requires_grad=True)
            recorder.track(x, "parameters")
            y = x.softmax(-1, dtype=torch.float32)
        return [e[2] for e in recorder.events[1:] if e[0] == allocator.ALLOC], y.dtype

    def test_fp16_reads_its_input(self):
        sizes, dtype = self.allocations(torch.float16)
        self.assertEqual(dtype, torch.float32)
        self.assertEqual(sizes, [64 * 1024 * 4])  # the fp32 output only

    def test_bf16_converts_first(self):
        sizes, dtype = self.allocations(torch.bfloat16)
        self.assertEqual(sizes, [64 * 1024 * 4, 64 * 1024 * 4])  # fp32 copy, fp32 output

    def test_amp_bf16_cross_entropy_keeps_bf16_log_probabilities_and_an_fp32_copy(self):
        recorder = simulate._StepRecorder()
        target = torch.zeros(512, dtype=torch.int64, device="meta")
        with recorder, simulate._GpuKernelMode(True, torch.bfloat16):
            logits = torch.empty(512, 1000, device="meta", dtype=torch.bfloat16, requires_grad=True)
            recorder.track(logits, "parameters")
            loss = F.cross_entropy(logits, target)
            kept = [e[2] for e in recorder.events[1:] if e[0] == allocator.ALLOC and e[1] in recorder._live.values()]
        del loss
        self.assertIn(512 * 1000 * 2, kept)  # bf16 log-probabilities
        self.assertIn(512 * 1000 * 4, kept)  # their fp32 copy for nll_loss


class OptimizerTest(unittest.TestCase):
    def test_adam_8bit_keeps_two_bytes_a_parameter_and_block_scales(self):
        adam, eight = wide(optimizer="adam"), wide(optimizer="adam_8bit")
        self.assertEqual(peak(adam, "optimizer_state"), 8 * WEIGHT)
        blocks = WEIGHT // 256
        # two uint8 states, two fp32 absmax per 256-element block, the two 256-value maps
        self.assertEqual(peak(eight, "optimizer_state"), 2 * WEIGHT + 2 * 4 * blocks + 2 * 1024)
        self.assertLess(peak(eight, "optimizer_state"), 0.26 * peak(adam, "optimizer_state"))
        self.assertEqual(wide(optimizer="adamw_8bit")["breakdown_at_peak"], eight["breakdown_at_peak"])

    def test_8_bit_state_only_from_4096_elements(self):
        class Small(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = nn.Linear(64, 63, bias=False)  # 4032 elements: 32-bit state
                self.b = nn.Linear(63, 64, bias=False)  # 4032

            def forward(self, x):
                return self.b(self.a(x))

        sim = simulate_step(on_meta(Small), [64], 2, optimizer="adam_8bit")
        rounded = -(-4032 * 4 // 512) * 512  # one fp32 state of a parameter, as a block
        self.assertEqual(peak(sim, "optimizer_state"), 2 * 2 * rounded)

    def test_paged_state_is_outside_the_allocator(self):
        adamw, paged = wide(optimizer="adamw"), wide(optimizer="paged_adamw")
        self.assertEqual(paged["paged_optimizer_state_bytes"], 8 * WEIGHT)
        self.assertEqual(peak(paged, "optimizer_state"), 0)
        self.assertLessEqual(paged["allocated_peak_bytes"], adamw["allocated_peak_bytes"] - 8 * WEIGHT)
        self.assertNotIn("paged_optimizer_state_bytes", adamw)
        paged8 = wide(optimizer="paged_adamw_8bit")
        self.assertEqual(paged8["paged_optimizer_state_bytes"], 2 * WEIGHT)
        # the absmax and the maps stay device tensors
        self.assertEqual(peak(paged8, "optimizer_state"), 2 * 4 * (WEIGHT // 256) + 2 * 1024)

    def test_paged_buffers_only_from_1e5_elements(self):
        model = on_meta(lambda: nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 10)))
        sim = simulate_step(model, [256], 2, optimizer="paged_adamw")
        self.assertEqual(sim["paged_optimizer_state_bytes"], 0)  # 65,536 elements at most
        self.assertGreater(peak(sim, "optimizer_state"), 2 * 4 * 65536 - 1)

    def test_adafactor_factors_second_moments_of_matrices(self):
        adam, adafactor = wide(optimizer="adam"), wide(optimizer="adafactor")
        self.assertEqual(peak(adafactor, "optimizer_state"), 2 * 2048 * 4)  # a row, a column
        self.assertLess(peak(adafactor, "optimizer_state"), 0.001 * peak(adam, "optimizer_state"))

    def test_fused_has_fewer_temporaries_than_foreach(self):
        foreach = wide(optimizer="adam")
        fused = wide(optimizer="adam", optimizer_implementation="fused")
        self.assertEqual(fused["optimizer_implementation"], "fused")
        self.assertNotIn("optimizer_implementation", foreach)
        # foreach's _foreach_sqrt copies the second moments; the fused kernel copies nothing
        self.assertGreaterEqual(peak(foreach, "temporaries"), 4 * WEIGHT)
        self.assertLess(peak(fused, "temporaries"), MIB)
        self.assertLessEqual(fused["allocated_peak_bytes"], foreach["allocated_peak_bytes"] - 4 * WEIGHT + MIB)
        # its state: the two moments and a step tensor on the device
        self.assertEqual(peak(fused, "optimizer_state"), 8 * WEIGHT + 512)
        sgd = wide(optimizer="momentum", optimizer_implementation="fused")
        self.assertEqual(peak(sgd, "optimizer_state"), 4 * WEIGHT)

    def test_for_loop_holds_a_parameter_at_a_time(self):
        layer = 1024 * 1024 * 4
        model = on_meta(lambda: nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(4)]))
        foreach = simulate_step(model, [1024], 2, optimizer="adam")
        loop = simulate_step(model, [1024], 2, optimizer="adam", optimizer_implementation="for_loop")
        self.assertGreaterEqual(peak(foreach, "temporaries"), 4 * layer)  # every sqrt at once
        # sqrt and its quotient for one parameter, the previous quotient not yet released
        self.assertLessEqual(peak(loop, "temporaries"), 3 * layer)
        self.assertLess(loop["allocated_peak_bytes"], foreach["allocated_peak_bytes"])

    def test_refused_combinations_name_the_field(self):
        for setup, field in (
            (dict(optimizer="adafactor", optimizer_implementation="fused"), "optimizer_implementation"),
            (dict(optimizer="adam_8bit", optimizer_implementation="for_loop"), "optimizer_implementation"),
            (dict(optimizer="adamw_8bit", precision="fp16"), "optimizer"),
            (dict(optimizer="lion"), "optimizer"),
            (dict(precision="fp8"), "precision"),
            (dict(optimizer_implementation="cuda"), "optimizer_implementation"),
            (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps"),
            (dict(activation_checkpointing="some"), "activation_checkpointing"),
            (dict(lora={"rank": 0}), "lora.rank"),
            (dict(lora={"rank": 4, "base_weights": "nf8"}), "lora.base_weights"),
            (dict(trainable="head"), "trainable"),
        ):
            with self.assertRaises(ValueError, msg=setup) as caught:
                wide(**setup)
            self.assertIn(field, str(caught.exception), setup)


class AccumulationTest(unittest.TestCase):
    """Activations dominate (batch 4096 through a 256 -> 2048 -> 256 MLP)."""

    def setUp(self):
        self.model = on_meta(lambda: nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 256)))
        self.grads = sum(-(-p.numel() * 4 // 512) * 512 for p in self.model.parameters())

    def run_with(self, steps):
        return simulate_step(self.model, [256], 4096, optimizer="sgd", gradient_accumulation_steps=steps)

    def test_the_second_backward_accumulates_into_live_gradients(self):
        one, two = self.run_with(1), self.run_with(2)
        # without accumulation the peak comes before most gradients exist
        self.assertLess(peak(one, "gradients"), self.grads)
        # the second micro-batch runs with every gradient alive, beside its activations
        self.assertEqual(peak(two, "gradients"), self.grads)
        self.assertGreaterEqual(peak(two, "activations"), 0.9 * peak(one, "activations"))
        self.assertGreaterEqual(
            two["allocated_peak_bytes"], peak(one, "parameters") + self.grads + peak(one, "activations")
        )
        self.assertGreater(two["allocated_peak_bytes"], one["allocated_peak_bytes"])

    def test_further_micro_batches_change_nothing(self):
        two, four = self.run_with(2), self.run_with(4)
        self.assertEqual(four["gradient_accumulation_steps"], 4)
        self.assertEqual(four["batch_size"], 4096)  # the micro-batch
        self.assertEqual(
            {k: v for k, v in four.items() if k != "gradient_accumulation_steps"},
            {k: v for k, v in two.items() if k != "gradient_accumulation_steps"},
        )
        self.assertNotIn("gradient_accumulation_steps", self.run_with(1))


class PassReuseTest(unittest.TestCase):
    """The second step's forward/backward passes repeat the first's recorded events: the same
    stream as running them."""

    def streams(self, model, shape, batch, dtype=torch.float32, **setup):
        assert_same_stream(self, "REUSE_PASSES", model, shape, batch, dtype, **setup)

    def test_same_stream(self):
        self.streams(on_meta(toy_models.tiny_cnn), [3, 32, 32], 8, gradient_accumulation_steps=2)
        self.streams(
            on_meta(toy_models.tiny_token_model),
            [64],
            4,
            torch.int64,
            precision="fp16",
            optimizer="adamw",
            gradient_accumulation_steps=3,
        )
        self.streams(on_meta(Stack), [256], 64, precision="amp_bf16", optimizer_implementation="fused")

    def test_same_stream_with_transforms(self):
        self.streams(
            on_meta(Stack),
            [256],
            64,
            precision="amp_fp16",
            activation_checkpointing="full",
            gradient_accumulation_steps=2,
            lora={"rank": 4, "target_modules": ["up", "down"], "base_weights": "nf4"},
        )


class TransformTest(unittest.TestCase):
    def test_lora_trains_only_the_adapters(self):
        model = on_meta(Stack)
        full = simulate_step(model, [256], 64)
        lora = simulate_step(model, [256], 64, lora={"rank": 8, "target_modules": ["up", "down"]})
        adapters = 4 * (8 * (256 + 1024) + 8 * (1024 + 256))
        self.assertEqual(lora["trainable_params"], adapters)
        self.assertEqual(full["trainable_params"], sum(p.numel() for p in model.parameters()))
        self.assertLess(peak(lora, "optimizer_state"), 0.1 * peak(full, "optimizer_state"))
        # the caller's model is left as it was
        self.assertFalse(any("lora" in name for name, _ in model.named_modules()))
        self.assertTrue(all(p.requires_grad for p in model.parameters()))

    def test_trainable_modules_freeze_the_rest(self):
        model = on_meta(Stack)
        sim = simulate_step(model, [256], 64, trainable=["head"])
        self.assertEqual(sim["trainable_params"], 256 * 10 + 10)
        self.assertLess(peak(sim, "optimizer_state"), 64 * 1024)

    def test_checkpointing_drops_the_blocks_activations(self):
        model = on_meta(Stack)
        for precision in ("fp32", "amp_fp16", "amp_bf16", "bf16"):
            plain = simulate_step(model, [256], 2048, optimizer="sgd", precision=precision)
            checkpointed = simulate_step(
                model, [256], 2048, optimizer="sgd", precision=precision, activation_checkpointing="full"
            )
            self.assertEqual(checkpointed["activation_checkpointing"], "full")
            self.assertLess(checkpointed["allocated_peak_bytes"], 0.6 * plain["allocated_peak_bytes"], precision)
        named = simulate_step(model, [256], 2048, optimizer="sgd", activation_checkpointing=["blocks.0", "blocks.1"])
        self.assertEqual(named["activation_checkpointing"], ["blocks.0", "blocks.1"])
        self.assertNotIn("activation_checkpointing", plain)

    def test_qlora_base_is_four_bit(self):
        model = on_meta(Stack)
        full = simulate_step(model, [256], 8, precision="bf16")
        qlora = simulate_step(
            model, [256], 8, precision="bf16", lora={"rank": 4, "target_modules": "all-linear", "base_weights": "nf4"}
        )
        self.assertLess(peak(qlora, "parameters"), 0.5 * peak(full, "parameters"))

    def test_names_that_name_no_module_are_refused(self):
        with self.assertRaises(ValueError) as caught:
            simulate_step(on_meta(Stack), [256], 8, trainable=["nothing"])
        self.assertIn("trainable", str(caught.exception))


class OutputContractTest(unittest.TestCase):
    DEFAULT_SIMULATION = {
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
    }

    def test_default_setup_adds_only_trainable_params(self):
        model = on_meta(toy_models.mlp)
        description = describe_module(model, [20], 32)
        self.assertEqual(
            set(description),
            {
                "model",
                "family",
                "batch_size",
                "input_shape",
                "layers",
                "saved_tensors",
                "optimizer",
                "precision",
                "simulation",
            },
        )
        self.assertEqual(set(description["simulation"]), self.DEFAULT_SIMULATION)
        self.assertEqual(description["simulation"]["trainable_params"], sum(p.numel() for p in model.parameters()))

    def test_setup_fields_at_the_top_level(self):
        model = on_meta(toy_models.tiny_token_model)
        setup = dict(
            precision="mixed16", optimizer="adamw", optimizer_implementation="fused", gradient_accumulation_steps=4
        )
        setup.update(
            activation_checkpointing=["attn"],
            trainable=["head"],
            lora={"rank": 4, "alpha": 16.0, "target_modules": ["qkv"]},
        )
        description = describe_module(model, [32], 8, input_dtype=torch.int64, **setup)
        self.assertEqual(description["precision"], "amp_fp16")
        self.assertEqual(description["optimizer_implementation"], "fused")
        self.assertEqual(description["gradient_accumulation_steps"], 4)
        self.assertEqual(description["micro_batch_size"], 8)
        self.assertEqual(description["batch_size"], 32)
        sim = description["simulation"]
        self.assertEqual(sim["batch_size"], 8)
        self.assertEqual(
            (sim["precision"], sim["optimizer_implementation"], sim["gradient_accumulation_steps"]),
            ("amp_fp16", "fused", 4),
        )
        self.assertEqual(description["activation_checkpointing"], ["attn"])
        self.assertEqual(description["trainable"], {"modules": ["head"]})
        self.assertEqual(
            description["lora"], {"rank": 4, "alpha": 16, "target_modules": ["qkv"], "base_weights": "same"}
        )
        self.assertEqual(sim["activation_checkpointing"], ["attn"])
        # another micro-batch: simulated again with the same setup
        again = with_batch_size(description, 2, model=model, input_dtype=torch.int64)
        self.assertEqual((again["batch_size"], again["micro_batch_size"]), (8, 2))
        self.assertEqual(again["simulation"]["batch_size"], 2)
        self.assertEqual(again["simulation"]["trainable_params"], sim["trainable_params"])
        self.assertNotIn("simulation", with_batch_size(description, 2))

    def test_paged_bytes_only_for_paged_optimizers(self):
        self.assertIn("paged_optimizer_state_bytes", wide(optimizer="paged_adamw_8bit"))
        self.assertNotIn("paged_optimizer_state_bytes", wide(optimizer="adamw_8bit"))

    def test_breakdown_sums_to_the_peak_in_every_setup(self):
        for setup in (
            dict(precision="fp16", optimizer="adafactor"),
            dict(precision="bf16", optimizer="paged_adamw_8bit", gradient_accumulation_steps=2),
            dict(precision="amp_bf16", optimizer="sgd", optimizer_implementation="fused"),
        ):
            sim = simulate_step(on_meta(Stack), [256], 32, **setup)
            self.assertEqual(sum(sim["breakdown_at_peak"].values()), sim["allocated_peak_bytes"], setup)
            self.assertLessEqual(sim["allocated_peak_bytes"], sim["min_capacity_bytes"])
            self.assertLessEqual(sim["min_capacity_bytes"], sim["reserved_peak_bytes"])


class CliSetupTest(unittest.TestCase):
    def test_setup_flags(self):
        args = [
            "module:toy_models:tiny_token_model",
            "--seq-len",
            "32",
            "--batch-size",
            "4",
            "--precision",
            "bf16",
            "--optimizer",
            "paged_adamw_8bit",
            "--gradient-accumulation-steps",
            "2",
        ]
        args += [
            "--activation-checkpointing",
            "attn,mha",
            "--lora-rank",
            "4",
            "--lora-targets",
            "qkv,proj",
            "--lora-base",
            "nf4",
            "--trainable",
            "head",
        ]
        result = run_cli(*args)
        self.assertEqual(result.returncode, 0, result.stderr)
        [body] = lines(result.stdout)
        self.assertEqual((body["precision"], body["optimizer"]), ("bf16", "paged_adamw_8bit"))
        self.assertEqual((body["batch_size"], body["micro_batch_size"], body["gradient_accumulation_steps"]), (8, 4, 2))
        self.assertIn("paged_optimizer_state_bytes", body["simulation"])
        self.assertEqual(body["activation_checkpointing"], ["attn", "mha"])
        self.assertEqual(
            body["lora"], {"rank": 4, "alpha": 8, "target_modules": ["qkv", "proj"], "base_weights": "nf4"}
        )
        self.assertEqual(body["trainable"], {"modules": ["head"]})

    def test_bad_setups_are_usage_errors(self):
        base = ["module:toy_models:mlp", "--batch-size", "4", "--input-shape", "20"]
        for extra in (
            ["--lora-alpha", "16"],
            ["--lora-base", "nf4"],
            ["--precision", "fp16", "--optimizer", "adam_8bit"],
            ["--optimizer", "adafactor", "--optimizer-implementation", "fused"],
        ):
            result = run_cli(*base, *extra)
            self.assertEqual(result.returncode, 2, extra)
            self.assertEqual(result.stdout, "")


if __name__ == "__main__":
    unittest.main()
