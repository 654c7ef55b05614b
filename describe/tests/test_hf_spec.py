"""``hf:`` specs: Hugging Face models built from a config.json alone, never from the network."""

import json
import os
import socket
import tempfile
import unittest
from unittest import mock

import torch


os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers imports huggingface_hub

from gpucast_describe import SpecError, describe_spec, resolve_spec, total_params  # noqa: E402
from gpucast_describe.specs import SPEC_PREFIXES  # noqa: E402

try:
    import huggingface_hub.constants
    import transformers
except ImportError:
    transformers = None

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 1000,
    "torch_dtype": "bfloat16",
}


def write_config(folder, **changes):
    config = dict(TINY_LLAMA, **changes)
    config = {key: value for key, value in config.items() if value is not None}
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as out:
        json.dump(config, out)
    return folder


def write_cached(cache, repo_id, **changes):
    """A model in huggingface_hub's cache layout (refs/main -> snapshots/<commit>/)."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    commit = "0" * 40
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as out:
        out.write(commit)
    write_config(os.path.join(repo, "snapshots", commit), **changes)


class NoNetwork:
    """Records and refuses every connection and name lookup while active."""

    def __enter__(self):
        self.attempts = []

        def refuse(what):
            def call(*args, **kwargs):
                self.attempts.append(what)
                raise OSError(f"network disabled in this test ({what})")

            return call

        self.patches = [
            mock.patch.object(socket.socket, "connect", refuse("connect")),
            mock.patch.object(socket.socket, "connect_ex", refuse("connect_ex")),
            mock.patch.object(socket, "getaddrinfo", refuse("getaddrinfo")),
            mock.patch.object(socket, "create_connection", refuse("create_connection")),
        ]
        for patch in self.patches:
            patch.start()
        return self

    def __exit__(self, *exc):
        for patch in reversed(self.patches):
            patch.stop()


@unittest.skipIf(transformers is None, "transformers is not installed")
class HfSpecTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.env = mock.patch.dict(os.environ, {"HF_HUB_OFFLINE": "1"})
        cls.env.start()
        cls.tmp = tempfile.TemporaryDirectory()
        cls.llama = write_config(os.path.join(cls.tmp.name, "tiny-llama"))
        cls.cache = os.path.join(cls.tmp.name, "hub")
        write_cached(cls.cache, "gpucast-tests/tiny-llama-cached")

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()
        cls.env.stop()

    def test_prefix_listed(self):
        self.assertIn("hf", SPEC_PREFIXES)
        with self.assertRaises(SpecError) as caught:
            resolve_spec("huggingface:gpt2")
        self.assertIn("hf:<model id or folder>", str(caught.exception))

    def test_folder_resolves_on_meta_in_float32(self):
        resolved = resolve_spec(f"hf:{self.llama}")
        self.assertIsInstance(resolved.module, transformers.LlamaForCausalLM)
        self.assertEqual(resolved.spec, f"hf:{self.llama}")
        self.assertIsNone(resolved.default_input_shape)
        self.assertTrue(all(p.is_meta for p in resolved.module.parameters()))
        # the config's bfloat16 is the checkpoint's: --precision decides the job's
        self.assertEqual({p.dtype for p in resolved.module.parameters()}, {torch.float32})

    def test_folder_describes_with_seq_len(self):
        desc = describe_spec(f"hf:{self.llama}", batch_size=2, seq_len=16)
        names = [layer["name"] for layer in desc["layers"]]
        self.assertIn("model.layers.0.self_attn.q_proj", names)
        self.assertIn("model.layers.1.mlp.down_proj", names)
        self.assertEqual(names[-1], "lm_head")
        self.assertEqual(desc["model"], f"hf:{self.llama}")
        self.assertEqual(desc["input_shape"], [16])
        self.assertEqual(desc["family"], "transformer")
        self.assertEqual(sum(l["kind"] == "attention" for l in desc["layers"]), 2)
        self.assertEqual(desc["layers"][-1]["output_size"], 16 * 1000)
        self.assertEqual(
            sum(l["params"] for l in desc["layers"]), total_params(resolve_spec(f"hf:{self.llama}").module)
        )
        self.assertEqual(desc["simulation"]["batch_size"], 2)

    def test_needs_seq_len(self):
        with self.assertRaises(SpecError) as caught:
            describe_spec(f"hf:{self.llama}")
        self.assertIn("--seq-len", str(caught.exception))

    def test_config_file_itself(self):
        resolved = resolve_spec(f"hf:{os.path.join(self.llama, 'config.json')}")
        self.assertIsInstance(resolved.module, transformers.LlamaForCausalLM)

    def test_sequence_classification_gets_a_score_head(self):
        folder = write_config(
            os.path.join(self.tmp.name, "reward"), architectures=["LlamaForSequenceClassification"], num_labels=3
        )
        resolved = resolve_spec(f"hf:{folder}")
        self.assertIsInstance(resolved.module, transformers.LlamaForSequenceClassification)
        self.assertEqual(resolved.module.score.out_features, 3)
        # no pad_token_id in the config: one is set, so that batches above 1 run
        desc = describe_spec(f"hf:{folder}", batch_size=2, seq_len=8)
        self.assertEqual(desc["layers"][-1]["name"], "score")
        self.assertEqual(desc["layers"][-1]["params"], 64 * 3)
        self.assertEqual(desc["simulation"]["batch_size"], 2)

    def test_architectures_fallbacks(self):
        # no architectures, or one this transformers lacks: the causal LM
        for name, architectures in (("plain", None), ("unknown", ["NoSuchModelForCausalLM"])):
            folder = write_config(os.path.join(self.tmp.name, name), architectures=architectures)
            module = resolve_spec(f"hf:{folder}").module
            self.assertIsInstance(module, transformers.LlamaForCausalLM, name)
            self.assertEqual({p.dtype for p in module.parameters()}, {torch.float32}, name)
        # no causal LM for this model type: the base model
        folder = os.path.join(self.tmp.name, "vit")
        os.makedirs(folder)
        with open(os.path.join(folder, "config.json"), "w") as out:
            json.dump(
                {
                    "model_type": "vit",
                    "hidden_size": 32,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                    "intermediate_size": 64,
                },
                out,
            )
        self.assertIsInstance(resolve_spec(f"hf:{folder}").module, transformers.ViTModel)

    def test_unknown_model_type(self):
        folder = write_config(os.path.join(self.tmp.name, "odd"), model_type="no_such_type_xyz")
        with self.assertRaises(SpecError):
            resolve_spec(f"hf:{folder}")

    def online_hub(self):
        """As if huggingface_hub had been imported before HF_HUB_OFFLINE was set (by another
        module of the process): the spec must stay off the network all the same."""
        return mock.patch.object(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    def test_cached_id_resolves_offline(self):
        from_pretrained = transformers.AutoConfig.from_pretrained
        with (
            mock.patch.object(huggingface_hub.constants, "HF_HUB_CACHE", self.cache),
            mock.patch.object(transformers.AutoConfig, "from_pretrained", side_effect=from_pretrained) as spy,
            self.online_hub(),
            NoNetwork() as network,
        ):
            resolved = resolve_spec("hf:gpucast-tests/tiny-llama-cached")
        self.assertEqual(network.attempts, [])
        # read from the cache's snapshot folder, never through the hub's download path
        [call] = spy.call_args_list
        self.assertTrue(os.path.isfile(os.path.join(call.args[0], "config.json")))
        self.assertTrue(call.args[0].startswith(self.cache), call.args[0])
        self.assertIs(call.kwargs.get("local_files_only"), True)
        self.assertIs(call.kwargs.get("trust_remote_code"), False)
        self.assertIsInstance(resolved.module, transformers.LlamaForCausalLM)
        self.assertEqual(resolved.spec, "hf:gpucast-tests/tiny-llama-cached")

    def test_uncached_id_is_a_spec_error_without_network(self):
        from_pretrained = transformers.AutoConfig.from_pretrained
        with (
            mock.patch.object(huggingface_hub.constants, "HF_HUB_CACHE", self.cache),
            mock.patch.object(transformers.AutoConfig, "from_pretrained", side_effect=from_pretrained) as spy,
            self.online_hub(),
            NoNetwork() as network,
        ):
            for spec in ("hf:gpucast-tests/no-such-model-xyz", "hf:gpt2"):
                with self.assertRaises(SpecError, msg=spec) as caught:
                    resolve_spec(spec)
                message = str(caught.exception)
                self.assertIn("not in the local Hugging Face cache", message)
                self.assertIn("hf download", message)
                self.assertIn("folder holding config.json", message)
            with self.assertRaises(SpecError) as caught:
                resolve_spec("hf:not an id")
            self.assertIn("neither a folder nor a model id", str(caught.exception))
        self.assertEqual(network.attempts, [])
        self.assertEqual(spy.call_count, 0)  # the cache lacks them: transformers is not asked

    def test_missing_folder_or_config_is_a_spec_error_without_network(self):
        empty = os.path.join(self.tmp.name, "empty")
        os.makedirs(empty, exist_ok=True)
        with self.online_hub(), NoNetwork() as network:
            for spec, expected in (
                (f"hf:{empty}", "no config.json"),
                (f"hf:{os.path.join(self.tmp.name, 'missing')}", "no such folder"),
                ("hf:./no/such/folder", "no such folder"),
                ("hf:", "bad spec"),
            ):
                with self.assertRaises(SpecError, msg=spec) as caught:
                    resolve_spec(spec)
                self.assertIn(expected, str(caught.exception), spec)
        self.assertEqual(network.attempts, [])

    def test_sets_hub_offline(self):
        with mock.patch.dict(os.environ):
            os.environ.pop("HF_HUB_OFFLINE", None)
            resolve_spec(f"hf:{self.llama}")
            self.assertEqual(os.environ.get("HF_HUB_OFFLINE"), "1")


@unittest.skipIf(transformers is None, "transformers is not installed")
class HfSpecCliTest(unittest.TestCase):
    def test_cli_seq_len_and_batch_sizes(self):
        from test_cli import lines, run_cli

        with tempfile.TemporaryDirectory() as tmp:
            folder = write_config(os.path.join(tmp, "tiny-llama"))
            cache = os.path.join(tmp, "hub")
            write_cached(cache, "gpucast-tests/tiny-llama-cached")
            with mock.patch.dict(os.environ, {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": cache}):
                result = run_cli(
                    f"hf:{folder}",
                    "hf:gpucast-tests/tiny-llama-cached",
                    "hf:gpucast-tests/no-such-model-xyz",
                    "--seq-len",
                    "512",
                    "--batch-size",
                    "2",
                    "4",
                )
        self.assertEqual(result.returncode, 1, result.stderr)
        self.assertIn("hf:gpucast-tests/no-such-model-xyz: not in the local Hugging Face cache", result.stderr)
        bodies = lines(result.stdout)
        self.assertEqual(
            [(b["model"], b["batch_size"]) for b in bodies],
            [
                (f"hf:{folder}", 2),
                (f"hf:{folder}", 4),
                ("hf:gpucast-tests/tiny-llama-cached", 2),
                ("hf:gpucast-tests/tiny-llama-cached", 4),
            ],
        )
        self.assertEqual(bodies[0]["input_shape"], [512])
        self.assertEqual(bodies[0]["layers"], bodies[2]["layers"])


if __name__ == "__main__":
    unittest.main()
