"""Jobs built from live Hugging Face and Lightning trainers, and the callback posting real
observations, on CPU with tiny models: the CUDA figures come from a fake source. Needs torch,
transformers, peft and lightning (describe's venv, scripts/client-test.sh) and the service
(GPUCAST_URL)."""

from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
import unittest

import gpucast

URL = os.environ.get("GPUCAST_URL")
HAVE = {name: importlib.util.find_spec(name) is not None for name in ("torch", "transformers", "peft", "lightning")}
SEQ_LEN = 16


class FakeStats:
    """A CUDA device that is not there: the figures a test chooses."""

    def __init__(self, peak_mib: float) -> None:
        self.peak = int(peak_mib * 1024 * 1024)

    def available(self) -> bool:
        return True

    def reset(self) -> None:
        pass

    def sample(self) -> None:
        pass

    def reading(self) -> gpucast.MemoryReading:
        return gpucast.MemoryReading(max_allocated=self.peak // 2, max_reserved=self.peak // 2, device_peak=self.peak)

    def device_name(self) -> str:
        return "h100-80gb"

    def environment(self) -> str:
        return "torch2.15-cu128-drv570.1"


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def token_samples(count: int) -> list:
    import torch

    generator = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(count):
        ids = torch.randint(0, 128, (SEQ_LEN,), generator=generator)
        samples.append({"input_ids": ids, "labels": ids.clone()})
    return samples


def hf_trainer(model, output_dir: str, callbacks=(), **arguments):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=4,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        **arguments,
    )
    return Trainer(model=model, args=args, train_dataset=token_samples(16), callbacks=list(callbacks))


@unittest.skipUnless(URL, "GPUCAST_URL unset: scripts/client-test.sh starts the service and sets it")
@unittest.skipUnless(HAVE["torch"] and HAVE["transformers"], "torch and transformers are not installed")
class HuggingFaceTest(unittest.TestCase):
    def setUp(self) -> None:
        self.client = gpucast.Client(URL)
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)

    def test_from_trainer_reads_config_and_arguments(self) -> None:
        trainer = hf_trainer(tiny_llama(), self.tmp.name)
        job = gpucast.from_trainer(trainer, seq_len=SEQ_LEN, gpu="h100-80gb")
        self.assertEqual(job["transformer_config"]["hidden_size"], 32)
        self.assertEqual(job["training_arguments"]["per_device_train_batch_size"], 2)
        self.assertEqual(job["load"], {"torch_dtype": "float32", "attn_implementation": "sdpa"})
        answer = self.client.estimate(job)
        self.assertGreater(answer.memory.estimate_mib, 0)
        self.assertEqual(answer.setup.get("micro_batch_size"), 2)
        with self.assertRaises(ValueError):
            gpucast.from_trainer(trainer)  # no seq_len: said, not guessed

    @unittest.skipUnless(HAVE["peft"], "peft is not installed")
    def test_from_trainer_reads_the_adapter(self) -> None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        job = gpucast.from_trainer(hf_trainer(model, self.tmp.name), seq_len=SEQ_LEN, gpu="h100-80gb")
        self.assertEqual(job["adapter_config"]["r"], 4)
        self.assertEqual(sorted(job["adapter_config"]["target_modules"]), ["q_proj", "v_proj"])
        self.assertEqual(job["transformer_config"]["num_hidden_layers"], 2)
        answer = self.client.estimate(job)
        self.assertGreater(answer.memory.estimate_mib, 0)

    def test_deepspeed_config_is_sent_with_the_world_size(self) -> None:
        from types import SimpleNamespace

        trainer = hf_trainer(tiny_llama(), self.tmp.name)
        # A DeepSpeed config as the Trainer resolves it (deepspeed itself is not installed here).
        deepspeed = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 2}
        trainer.args.hf_deepspeed_config = SimpleNamespace(config=deepspeed)
        job = gpucast.from_trainer(trainer, seq_len=SEQ_LEN, gpu="h100-80gb")
        self.assertEqual(job["deepspeed"], deepspeed)
        self.assertEqual(job["parallelism"], {"world_size": 1})
        self.assertGreater(self.client.estimate(job).memory.estimate_mib, 0)

    def test_fsdp_plugin_is_sent_as_the_fsdp_field(self) -> None:
        from types import SimpleNamespace

        trainer = hf_trainer(tiny_llama(), self.tmp.name)
        # accelerate's FSDP plugin as a launched Trainer holds it (no process group here).
        plugin = SimpleNamespace(
            sharding_strategy=SimpleNamespace(name="SHARD_GRAD_OP"),
            cpu_offload=SimpleNamespace(offload_params=False),
            activation_checkpointing=True,
        )
        launched = SimpleNamespace(
            model=trainer.model,
            args=trainer.args,
            accelerator=SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)),
        )
        job = gpucast.from_trainer(launched, seq_len=SEQ_LEN, gpu="h100-80gb")
        self.assertEqual(
            job["fsdp"],
            {"sharding_strategy": "SHARD_GRAD_OP", "offload_params": False, "activation_checkpointing": True},
        )
        self.assertEqual(job["parallelism"], {"world_size": 1})
        answer = self.client.estimate(job)
        self.assertEqual(answer.setup.get("activation_checkpointing"), "full")
        self.assertEqual(answer.setup["parallelism"]["strategy"], "zero2")

    def test_callback_posts_an_observation(self) -> None:
        model = tiny_llama()
        probe = hf_trainer(model, self.tmp.name)
        estimate = self.client.estimate(gpucast.from_trainer(probe, seq_len=SEQ_LEN, gpu="h100-80gb"))
        callback = gpucast.GpucastCallback(
            self.client, steps=2, gpu="h100-80gb", seq_len=SEQ_LEN, stats=FakeStats(estimate.memory.estimate_mib * 1.05)
        )
        from transformers import TrainerCallback

        self.assertIsInstance(callback, TrainerCallback)
        with self.assertLogs("gpucast", logging.INFO) as logs:
            hf_trainer(model, self.tmp.name, callbacks=[callback]).train()
        # One clean estimate line before training: the figure, its bound, the card and why,
        # the stack; one prefix (the logger's).
        estimated = [line for line in logs.output if ":estimated " in line]
        self.assertEqual(len(estimated), 1, logs.output)
        self.assertRegex(
            estimated[0],
            r"^INFO:gpucast:estimated \d+ MiB \(bound \d+ MiB at 0\.95\) on h100-80gb \(named\): "
            r"(fits|does not fit); environment hf\d+\.\d+-torch\d+\.\d+",
        )
        self.assertFalse(any("gpucast: gpucast" in line for line in logs.output), logs.output)
        observer = callback.observer
        self.assertEqual(observer.response.recorded, 1)
        # Labelled with the stack it ran on (the framework's and torch's versions), and the
        # estimate made when training started.
        self.assertRegex(observer.observation["environment"], r"^hf\d+\.\d+-torch\d+\.\d+")
        self.assertGreater(callback.estimate.memory.estimate_mib, 0)
        self.assertGreater(observer.observation["step_time_ms"], 0)
        self.assertEqual(observer.observation["job"]["seq_len"], SEQ_LEN)

    def test_a_failing_service_does_not_stop_training(self) -> None:
        callback = gpucast.GpucastCallback("http://127.0.0.1:9", steps=1, seq_len=SEQ_LEN, stats=FakeStats(1000.0))
        with self.assertLogs("gpucast", "WARNING"):
            hf_trainer(tiny_llama(), self.tmp.name, callbacks=[callback]).train()
        self.assertIsNone(callback.observer.response)


def lightning_module(model):
    import lightning.pytorch as pl
    import torch

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return Module()


@unittest.skipUnless(URL, "GPUCAST_URL unset: scripts/client-test.sh starts the service and sets it")
@unittest.skipUnless(HAVE["lightning"] and HAVE["transformers"], "lightning is not installed")
class LightningTest(unittest.TestCase):
    def setUp(self) -> None:
        self.client = gpucast.Client(URL)
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)

    def trainer(self, callbacks=(), **options):
        import lightning.pytorch as pl

        return pl.Trainer(
            accelerator="cpu",
            max_steps=3,
            accumulate_grad_batches=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=self.tmp.name,
            callbacks=list(callbacks),
            **options,
        )

    def test_from_lightning_reads_precision_and_accumulation(self) -> None:
        trainer = self.trainer(precision="bf16-mixed")
        module = lightning_module(tiny_llama())
        job = gpucast.from_lightning(trainer, module, batch_size=2, seq_len=SEQ_LEN, gpu="h100-80gb")
        self.assertEqual(job["precision"], "bf16-mixed")
        self.assertEqual((job["micro_batch_size"], job["gradient_accumulation_steps"], job["batch_size"]), (2, 2, 4))
        self.assertEqual(job["transformer_config"]["hidden_size"], 32)
        self.assertEqual(job["attention"], "sdpa")
        answer = self.client.estimate(job)
        self.assertEqual(answer.setup.get("precision"), "amp_bf16")

    def test_a_plain_module_is_sent_as_its_print(self) -> None:
        import lightning.pytorch as pl
        import torch

        class Mlp(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))

        job = gpucast.from_lightning(self.trainer(), Mlp(), batch_size=8, input_shape=[64], gpu="h100-80gb")
        self.assertEqual(job["summary"]["format"], "module_print")
        self.assertGreater(self.client.estimate(job).memory.estimate_mib, 0)

    def test_callback_posts_an_observation(self) -> None:
        import lightning.pytorch as pl
        import torch

        model = tiny_llama()
        module = lightning_module(model)
        job = gpucast.from_lightning(self.trainer(), module, batch_size=2, seq_len=SEQ_LEN, gpu="h100-80gb")
        peak = self.client.estimate(job).memory.estimate_mib * 1.05
        callback = gpucast.GpucastCallback(
            self.client, steps=2, gpu="h100-80gb", seq_len=SEQ_LEN, batch_size=2, stats=FakeStats(peak)
        )
        self.assertIsInstance(callback, pl.Callback)
        loader = torch.utils.data.DataLoader(token_samples(16), batch_size=2)
        self.trainer(callbacks=[callback]).fit(module, loader)
        self.assertEqual(callback.observer.response.recorded, 1)
        self.assertEqual(callback.observer.observation["job"]["gradient_accumulation_steps"], 2)
        self.assertEqual(callback.observer.observation["job"]["optimizer"], "adamw")


if __name__ == "__main__":
    unittest.main()
