"""public_setups: the CSV columns parsed into docs/user/setups.md's fields, on strings taken from
public_training_memory.csv, and the committed data/public/setup_jobs.jsonl.gz checked against
the CSV (every row emitted or left out with a reason). Standard library only.

Run from the repository root:  python3 -m unittest discover -s training/tests -t training
"""

import csv
import gzip
import hashlib
import json
import os
import unittest


from gpucast_training import public_setups as ps
from gpucast_training.data import PUBLIC_CSV, REPO, default_data_dir

CSV_PATH = os.environ.get("GPUCAST_PUBLIC_CSV") or os.path.join(default_data_dir(), PUBLIC_CSV)
JOBS = os.path.join(REPO, *ps.OUT_JOBS)
LEFT = os.path.join(REPO, *ps.OUT_LEFT)
DOC = os.path.join(REPO, *ps.OUT_DOC)


class ColumnTest(unittest.TestCase):
    def out(self, reason, function, *args):
        with self.assertRaises(ps.Out) as caught:
            function(*args)
        self.assertEqual(caught.exception.reason, reason)

    def test_precision(self):
        cases = {
            "pure bfloat16 weights": "bf16",
            "bf16-true (pure bf16)": "bf16",
            "bf16-true": "bf16",
            "full BF16": "bf16",
            'bf16 (train.py default precision "bf16")': "bf16",
            "bf16 weights (torch_dtype bfloat16; HF Trainer bf16)": "bf16",
            "BF16 AMP (autocast), fp32 weights": "amp_bf16",
            "bf16-mixed (AMP, fp32 weights) - lit-gpt default at the time": "amp_bf16",
            "fp16 AMP (Trainer fp16=True)": "amp_fp16",
            "FSDP2 mixed precision: bf16 params/compute, fp32 master + fp32 reduce": "amp_bf16",
            "bf16 mixed (DeepSpeed bf16)": "amp_bf16",
            "bf16 mixed; base 4-bit NF4 double-quant, quant_storage bf16": "amp_bf16",
            "bf16 (--bf16 True; accelerate mixed_precision no); NF4 double-quant base, quant_storage bf16": "amp_bf16",
            "4-bit QLoRA base, fp16 compute (T4)": "amp_fp16",
            "fp32 (accelerate mixed_precision: no)": "fp32",
            "fp16 mixed precision (mmcv Fp16OptimizerHook, loss scale)": "amp_fp16",
        }
        for text, expected in cases.items():
            self.assertEqual(ps.parse_precision(text)[0], expected, text)
        self.out(
            ps.LOW_PRECISION,
            ps.parse_precision,
            "FSDP2 mixed precision: bf16 params/compute, fp32 master + fp32 reduce + Float8 linears (torchao)",
        )
        self.out(ps.LOW_PRECISION, ps.parse_precision, "MXFP8; weights/collectives bf16")
        self.out(ps.NOT_STATED, ps.parse_precision, "4-bit QLoRA base, fp16/bf16 compute")
        self.out(ps.NOT_STATED, ps.parse_precision, "4-bit (QLoRA) base")
        self.out(ps.NOT_STATED, ps.parse_precision, "not stated")

    def test_base_weights(self):
        self.assertEqual(ps.parse_base_weights("4-bit QLoRA base, fp16 compute (T4)", "QLoRA (rank in Colab)"), "nf4")
        self.assertEqual(
            ps.parse_base_weights(
                "bf16-true",
                "LoRA r=8 alpha=16 dropout 0.05 on query,value + base quantized bnb.nf4-dq (QLoRA-style); "
                "trainable params 1,572,864",
            ),
            "nf4",
        )
        self.assertEqual(ps.parse_base_weights("bf16-true", "LoRA r=32 alpha=16 dropout=0.05 on query,value"), "same")

    def test_optimizer(self):
        cases = {
            "bitsandbytes PagedAdamW (used by lit-gpt when quantizing)": ("paged_adamw", "fused"),
            "adamw_8bit (bitsandbytes), lr 2e-4, wd 0.01": ("adamw_8bit", "fused"),
            "8-bit Adam (bitsandbytes bnb.optim.Adam8bit)": ("adam_8bit", "fused"),
            "bitsandbytes 8-bit AdamW": ("adamw_8bit", "fused"),
            "torchao 8-bit AdamW": ("adamw_8bit", "fused"),
            "PyTorch AdamW (fused)": ("adamw", "fused"),
            "AdamW (Trainer default adamw_hf)": ("adamw", "for_loop"),
            "torch.optim.Adam (default foreach=True)": ("adam", "foreach"),
            "torch.optim.AdamW (no optimizer_in_bwd)": ("adamw", "foreach"),
            "AdamW; offload: None (plain AdamW on GPU)": ("adamw", "foreach"),
            'Adafactor (optim="adafactor")': ("adafactor", "for_loop"),
            "SGD momentum 0.9, lr 0.02, wd 1e-4": ("momentum", "foreach"),
            'AdamW {"lr": 0.0001, "weight_decay": 0.1}': ("adamw", "foreach"),
        }
        for text, expected in cases.items():
            self.assertEqual(ps.parse_optimizer(text)[:2], expected, text)
        self.out(ps.IN_BACKWARD, ps.parse_optimizer, "torch.optim.AdamW with optimizer_in_bwd=True")
        self.out(
            ps.IN_BACKWARD,
            ps.parse_optimizer,
            "bitsandbytes PagedAdamW8bit with optimizer_in_bwd=True (recipe 8B_full_single_device default)",
        )
        self.out(ps.OFFLOAD, ps.parse_optimizer, "AdamW; offload: torchao CPUOffloadOptimizer")
        self.out(ps.OFFLOAD, ps.parse_optimizer, "AdamW (DeepSpeed CPU-offloaded optimizer)")
        self.out(ps.OPTIMIZER, ps.parse_optimizer, "torchao 4-bit AdamW")
        self.out(ps.OPTIMIZER, ps.parse_optimizer, "Muon (swift --optimizer muon) lr 1e-4")
        self.out(ps.NOT_STATED, ps.parse_optimizer, "not stated (T4 runs used adamw_8bit)")

    def test_checkpointing(self):
        cases = {
            "off": "none",
            "False": "none",
            "config default off": "none",
            "off (config enable_activation_checkpointing False)": "none",
            "True": "full",
            "full": "full",
            "on (FSDP activation_checkpointing_policy={Block})": "full",
            "on (swift default)": "full",
            "FSDP activation checkpointing (fsdp_activation_checkpointing true; HF GC disabled)": "full",
            "not stated (likely on)": "full",
            "not stated (LLaMA-Factory default on)": "full",
        }
        for text, expected in cases.items():
            self.assertEqual(ps.parse_checkpointing(text)[0], expected, text)
        self.out(ps.SELECTIVE, ps.parse_checkpointing, "per-op selective AC")
        self.out(ps.SELECTIVE, ps.parse_checkpointing, "toml default (selective per-op SAC)")
        self.out(ps.OFFLOAD, ps.parse_checkpointing, "on (+activation offloading to CPU)")
        self.out(ps.NOT_STATED, ps.parse_checkpointing, "not stated in doc")

    def test_parallelism(self):
        cases = [
            ("single GPU (--single_gpu)", "1", {"strategy": "none", "world_size": 1}),
            ("DDP x8", "8", {"strategy": "ddp", "world_size": 8}),
            ("FSDP2 x8 (single node)", "8", {"strategy": "fsdp", "world_size": 8}),
            ("FSDP (lora_finetune_distributed), fsdp cpu_offload False", "8", {"strategy": "fsdp", "world_size": 8}),
            (
                'FSDP sharding_strategy "ddp" (replicated weights, FSDP in DDP mode) x2',
                "2",
                {"strategy": "ddp", "world_size": 2},
            ),
            ("DeepSpeed ZeRO-2 x2", "2", {"strategy": "zero2", "world_size": 2}),
            ("DeepSpeed ZeRO-3 (no offload) x8", "8", {"strategy": "zero3", "world_size": 8}),
            ("FSDP2 across 4 nodes x 8", "32", {"strategy": "fsdp", "world_size": 32}),
            (
                "FSDP2 + Context Parallel: FSDP 4, CP 2",
                "8",
                {"strategy": "fsdp", "world_size": 8, "context_parallel": 2},
            ),
            ("FSDP 32 x TP 8 (2D)", "256", {"strategy": "fsdp", "world_size": 256, "tensor_parallel": 8}),
            (
                "4D: TP 8 x PP 8 x FSDP 2, CP 4",
                "512",
                {
                    "strategy": "fsdp",
                    "world_size": 512,
                    "tensor_parallel": 8,
                    "pipeline_parallel": 8,
                    "context_parallel": 4,
                },
            ),
        ]
        for text, gpus, expected in cases:
            self.assertEqual(ps.parse_parallelism(text, gpus), expected, text)
        self.out(ps.OFFLOAD, ps.parse_parallelism, "DeepSpeed ZeRO-3 + CPU optimizer offload, single GPU", "1")
        self.out(ps.OFFLOAD, ps.parse_parallelism, "FSDP full_shard + CPU offload of params x2", "2")
        self.out(ps.SEQUENCE, ps.parse_parallelism, "DeepSpeed ZeRO-3 x4 + Ulysses SP=4", "4")

    def test_peft(self):
        self.assertIsNone(ps.parse_peft("none (full finetune)"))
        lora = ps.parse_peft("LoRA r=8 alpha=16 dropout 0.05 on query, value")
        self.assertEqual(
            (lora["rank"], lora["alpha"], lora["targets"], lora["dropout"]), (8, 16, ["query", "value"], 0.05)
        )
        lora = ps.parse_peft(
            "LoRA r=8 alpha=16 dropout 0.05 on query,value + base quantized bnb.nf4 (QLoRA-style); "
            "trainable params 1,572,864"
        )
        self.assertEqual(lora["targets"], ["query", "value"])
        lora = ps.parse_peft(
            "QLoRA (bnb NF4 base, --train_type qlora) r=64 alpha=16 dropout=0.1 on k,q,v,up,down,gate "
            "(train.py defaults)"
        )
        self.assertEqual((lora["rank"], lora["targets"]), (64, ["k", "q", "v", "up", "down", "gate"]))
        lora = ps.parse_peft("QLoRA (NF4 base via torchao) r=8 alpha=16 on q,k,v,output_proj + MLP")
        self.assertEqual(lora["targets"], ["q", "k", "v", "output_proj", "MLP"])
        lora = ps.parse_peft("LoRA r=64 alpha=128, all layers (q,k,v,output_proj + MLP + output)")
        self.assertEqual(lora["targets"], ["q", "k", "v", "output_proj", "MLP", "output"])
        lora = ps.parse_peft("LORA r=64 lora_alpha=64 target_modules=['v_proj', 'q_proj'] use_rslora=True")
        self.assertEqual((lora["targets"], lora["rslora"]), (["v_proj", "q_proj"], True))
        self.assertEqual(ps.parse_peft("LoRA r=8 alpha=16 dropout 0.1 all-linear")["targets"], "all-linear")
        self.assertEqual(ps.parse_peft("LoRA r=8 alpha=32 dropout 0.1 (default targets q,v)")["targets"], ["q", "v"])
        self.assertEqual(
            ps.parse_peft("LoRA r=8 alpha=32 dropout 0.1 (query_key_value)")["targets"], ["query_key_value"]
        )
        self.assertIsNone(ps.parse_peft("LoRA r=8 alpha=32 dropout 0.1")["targets"])  # the framework's default
        self.assertEqual(
            ps.parse_peft("LN_TUNING target_modules=['input_layernorm', 'norm', 'post_attention_layernorm']"),
            {"ln_tuning": ["input_layernorm", "norm", "post_attention_layernorm"]},
        )
        self.out(ps.ADAPTER, ps.parse_peft, "LLaMA-Adapter (finetune/adapter.py); trainable params 573,888")
        self.out(ps.ADAPTER, ps.parse_peft, "DoRA (LoRA r=8 alpha=32, use_dora)")
        self.out(ps.ADAPTER, ps.parse_peft, "LORA r=32 lora_alpha=64 target_modules=['q_proj', 'v_proj'] use_dora=True")
        self.out(ps.ADAPTER, ps.parse_peft, "IA3 target_modules=['down_proj', 'v_proj', 'k_proj']")
        self.out(ps.ADAPTER, ps.parse_peft, "PROMPT_TUNING num_virtual_tokens=200")
        self.out(ps.NOT_STATED, ps.parse_peft, "QLoRA (rank in Colab)")
        self.out(ps.NOT_STATED, ps.parse_peft, "LoRA r=8")  # no alpha

    def test_lora_targets(self):
        self.assertEqual(ps.lora_targets(["query", "value"], "llama"), (["q_proj", "v_proj"], ""))
        self.assertEqual(
            ps.lora_targets(["q", "k", "v", "output_proj", "MLP"], "llama")[0],
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        )
        self.assertEqual(
            ps.lora_targets(["query", "key", "value", "projection", "mlp", "head"], "phi")[0],
            ["q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2", "lm_head"],
        )
        self.assertEqual(
            ps.lora_targets(["query", "key", "value", "projection", "mlp", "head"], "phi3")[0],
            ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"],
        )
        names, note = ps.lora_targets(["query", "value"], "neox")
        self.assertEqual(names, ["query_key_value"])
        self.assertIn("fused", note)
        self.assertEqual(ps.lora_targets(["query_key_value"], "fused"), (["query_key_value"], ""))
        self.assertEqual(ps.lora_targets("all-linear", "llama"), ("all-linear", ""))
        self.assertEqual(ps.lora_targets("peft-default", "t5")[0], ["q", "v"])
        # PEFT's matching: the last name component(s).
        self.assertTrue(ps._matches("model.layers.0.self_attn.q_proj", "q_proj"))
        self.assertFalse(ps._matches("model.layers.0.self_attn.qq_proj", "q_proj"))
        layers = [
            {
                "kind": "linear",
                "name": "model.layers.0.self_attn.q_proj",
                "params": 16,
                "in_features": 4,
                "out_features": 4,
            },
            {"kind": "linear", "name": "lm_head", "params": 0, "in_features": 4, "out_features": 10},
        ]
        self.assertEqual(ps.lora_count(layers, ["q_proj"], 2, "llama"), 16)
        self.assertEqual(ps.lora_count(layers, "all-linear", 2, "llama"), 16)
        with self.assertRaises(ValueError):
            ps.lora_count(layers, ["v_proj"], 2, "llama")

    def test_measure_kind(self):
        cases = {
            'torch.cuda.max_memory_allocated()/1e9 ("Memory used")': "allocated",
            "torchtune peak_memory_active (torch.cuda.memory_stats active_bytes.all.peak / 2^30), column "
            '"Peak Memory Active (GiB)"': "active",
            "torch.cuda.max_memory_reserved() at end of run minus reserved at init; WHOLE run incl. periodic eval "
            "generation (batch_size_eval=50)": "reserved_minus_weights",
            "torchtitan logged max reserved GiB (% of device)": "reserved",
            "NVML nvmlDeviceGetMemoryInfo().used//1024**2 (= nvidia-smi used, whole device incl. ~1343 MiB CUDA "
            "context) printed right after trainer.train()": "device",
            "informal per-GPU memory note in script header (likely nvidia-smi; method not stated)": "device",
            'TorchTracemalloc in example script: torch.cuda.max_memory_allocated() during train ("Total Peak Memory '
            'consumed during the train (max)", MiB) ; README rounds to GB': "allocated",
            "torchtune peak memory per GPU (likely max_memory_reserved as in prior README note)": "reserved",
        }
        for text, expected in cases.items():
            self.assertEqual(ps.parse_compare(text)[0], expected, text)
        self.assertTrue(
            ps.parse_compare("informal per-GPU memory note in script header (likely nvidia-smi; method not stated)")[1]
        )
        self.out(
            ps.MEASURE,
            ps.parse_compare,
            "torchtune log_peak_memory_stats (get_memory_stats: CUDA peak active/alloc/reserved bytes / 2^30); "
            'README column "Peak Memory per GPU" does not say which of the three',
        )
        self.out(ps.MEASURE, ps.parse_compare, '"GRAM" column (method not stated)')
        self.out(ps.MEASURE, ps.parse_compare, "per-GPU memory reported in doc (method not stated)")

    def test_sizes(self):
        self.assertEqual(
            ps.parse_sequence("1304 (longest Alpaca example for this tokenizer; batches padded to longest)")[0], 1304
        )
        self.assertEqual(ps.parse_sequence("2048 (packed)")[0], 2048)
        self.assertEqual(ps.parse_sequence("<= 768 (dynamic padding, length-bucketed)")[0], 768)
        self.assertEqual(ps.parse_sequence("short tweets, dynamic padding (causal example max_length=64)")[0], 64)
        self.out(ps.NOT_STATED, ps.parse_sequence, "<=2048 (STS-B pairs are short)")
        self.out(ps.NOT_STATED, ps.parse_sequence, "<=4096 (unpacked, padded per batch)")
        self.out(ps.NOT_STATED, ps.parse_sequence, "dataset max (no packing)")
        self.assertEqual(ps.parse_image("random crop 1024x1024")[0], 1024)
        self.assertEqual(ps.parse_micro_batch("recipe default (2)")[0], 2)
        self.out(ps.NOT_STATED, ps.parse_micro_batch, "not stated")
        self.assertEqual(ps.parse_accumulation("128", "", 1, 1, "single GPU")[0], 128)
        self.assertEqual(
            ps.parse_accumulation(
                "global/(4*devices)",
                "global 32 for FSDP runs, 512 default otherwise (per reproduction commands)",
                4,
                8,
                "DDP x8",
            )[0],
            16,
        )
        self.assertEqual(
            ps.parse_accumulation(
                "global/(4*devices)",
                "global 32 for FSDP runs, 512 default otherwise (per reproduction commands)",
                4,
                8,
                "FSDP ZeRO-3 (FULL_SHARD) x8",
            )[0],
            1,
        )
        self.out(ps.NOT_STATED, ps.parse_accumulation, "recipe default (not stated)", "", 2, 1, "single GPU")

    def test_architectures(self):
        cases = {
            "gemma-2b (HF google/gemma-2-2b)": "google/gemma-2-2b",
            "gemma-2b (HF google/gemma-2b)": "google/gemma-2b",
            "mistral-7b-v0.2 (HF unsloth/Mistral-7B-v0.2)": "mistral-community/Mistral-7B-v0.2",
            "mistral-7b (HF mistralai/Mistral-7B-v0.1)": "mistralai/Mistral-7B-v0.1",
            "llama-3.1-8b (HF meta-llama/Meta-Llama-3.1-8B)": "meta-llama/Llama-3.1-8B",
            "meta-llama/Meta-Llama-3-8B-Instruct": "meta-llama/Meta-Llama-3-8B",
            "Llama 2 13B (meta-llama/Llama-2-13b-hf)": "meta-llama/Llama-2-13b-hf",
            "StableLM Alpha 3B (stabilityai/stablelm-base-alpha-3b)": "stabilityai/stablelm-base-alpha-3b",
            "meta-llama/Llama-3.1-405B architecture": "meta-llama/Llama-3.1-405B",
        }
        for text, expected in cases.items():
            self.assertEqual(ps.architecture_of(text), expected, text)
            self.assertIn(expected, ps.ARCHITECTURES)
        self.out(ps.MODEL, ps.architecture_of, "Faster R-CNN, ResNet-50-FPN (pytorch style)")
        self.out(ps.MODEL, ps.architecture_of, "black-forest-labs/FLUX.2-klein-base-4B")
        for arch, (kind, config, naming) in ps.ARCHITECTURES.items():
            self.assertTrue(naming is None or naming in ps.LORA_NAMES, arch)

    def test_families(self):
        job = {
            "precision": "bf16",
            "activation_checkpointing": "full",
            "gradient_accumulation_steps": 4,
            "lora": {"rank": 8, "alpha": 16, "target_modules": ["q_proj"], "base_weights": "nf4"},
            "optimizer": "paged_adamw_8bit",
            "parallelism": {"strategy": "fsdp", "world_size": 2},
        }
        self.assertEqual(
            ps.families_of(job),
            [
                "precision:bf16",
                "checkpointing",
                "accumulation",
                "qlora",
                "low_bit_optimizer",
                "paged_optimizer",
                "fsdp_zero",
            ],
        )
        plain = {
            "precision": "fp32",
            "activation_checkpointing": "none",
            "gradient_accumulation_steps": 1,
            "optimizer": "adamw",
            "parallelism": {"strategy": "none", "world_size": 1},
        }
        self.assertEqual(ps.families_of(plain), ["plain"])


@unittest.skipUnless(
    os.path.exists(CSV_PATH) and os.path.exists(JOBS) and os.path.exists(LEFT),
    "public_training_memory.csv or the committed setup files are not here",
)
class CommittedFilesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(CSV_PATH, newline="") as handle:
            cls.rows = list(csv.DictReader(handle))
        with gzip.open(JOBS, "rt") as handle:
            cls.lines = [json.loads(line) for line in handle]
        with open(LEFT) as handle:
            cls.left = json.load(handle)

    def test_every_row_is_emitted_or_left_out_with_a_reason(self):
        emitted = [line["row"] for line in self.lines]
        left = [item["row"] for item in self.left]
        self.assertEqual(len(emitted), len(set(emitted)))
        self.assertFalse(set(emitted) & set(left))
        self.assertEqual(sorted(emitted + left), list(range(len(self.rows))))
        for item in self.left:
            self.assertTrue(item["reasons"], item["row"])
            self.assertIn(item["reasons"][0][0], ps.REASONS)

    def test_the_parsers_agree_with_the_committed_files(self):
        plans, left = ps.plan_all(self.rows)
        committed_left = {item["row"]: item["reasons"] for item in self.left}
        for item in left:  # what the CSV alone rules out
            self.assertEqual(committed_left.get(item["row"]), item["reasons"], item["row"])
        planned = {plan["row"]: plan for plan in plans}
        for line in self.lines:
            plan = planned[line["row"]]
            job = line["job"]
            self.assertEqual(
                (
                    line["compare"],
                    job["precision"],
                    job["optimizer"],
                    job["activation_checkpointing"],
                    job["micro_batch_size"],
                    job["gradient_accumulation_steps"],
                    job["parallelism"],
                ),
                (
                    plan["compare"],
                    plan["precision"],
                    plan["optimizer"],
                    plan["checkpointing"],
                    plan["micro"],
                    plan["accumulation"],
                    plan["parallelism"],
                ),
                line["row"],
            )
            self.assertEqual(job["batch_size"], plan["micro"] * plan["accumulation"])
            self.assertEqual(line["measured_mib"], float(self.rows[line["row"]]["measured_mib"]))
        # Planned rows missing from the lines were left out after the model was built.
        for row in set(planned) - {line["row"] for line in self.lines}:
            self.assertEqual(committed_left[row][0][0], ps.VARIANT, row)

    def test_the_jobs_are_well_formed(self):
        for line in self.lines:
            job = line["job"]
            for key in (
                "batch_size",
                "layers",
                "saved_tensors",
                "family",
                "input_shape",
                "model",
                "precision",
                "optimizer",
                "optimizer_implementation",
                "activation_checkpointing",
                "micro_batch_size",
                "gradient_accumulation_steps",
                "parallelism",
            ):
                self.assertIn(key, job, line["row"])
            self.assertLessEqual(len(job["layers"]), 4096)
            self.assertTrue(line["families"])
            self.assertIn(
                line["compare"],
                ("allocated", "reserved", "device", "allocated_minus_weights", "reserved_minus_weights", "active"),
            )
            for key in ("deepspeed_zero2_mib", "deepspeed_zero3_mib", "accelerate_mib"):
                self.assertIn(key, line["baselines"])
            names = [layer["name"] for layer in job["layers"]]
            lora = job.get("lora")
            if lora and lora["target_modules"] != "all-linear":
                for target in lora["target_modules"]:
                    self.assertTrue(any(ps._matches(name, target) for name in names), (line["row"], target))
            for module in job.get("trainable", {}).get("modules", []):
                self.assertIn(module, names)

    def test_the_files_are_of_this_csv_and_deterministic(self):
        digest = hashlib.sha256()
        with open(CSV_PATH, "rb") as handle:
            digest.update(handle.read())
        with open(DOC) as handle:
            self.assertIn(digest.hexdigest(), handle.read())
        with open(JOBS, "rb") as handle:
            self.assertEqual(handle.read(8)[4:8], b"\0\0\0\0")  # gzip mtime 0


if __name__ == "__main__":
    unittest.main()
