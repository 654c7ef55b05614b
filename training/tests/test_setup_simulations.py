"""The setup-simulations stage's pure parts (stdlib): its case list, the requests it sends, the
delta arithmetic and the tables, without torch or the gpucast binary.

Run from the repository root:  python3 -m unittest discover -s training/tests -t training
"""

import os
import unittest

from gpucast_training import setup_simulations as ss

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


MIB = 1024 * 1024


def estimate(
    parameters=100.0,
    gradients=0.0,
    state=200.0,
    activations=50.0,
    temporaries=10.0,
    cache=20.0,
    context=1300.0,
    peak="backward_start",
    trainable=1000,
):
    """A service answer with the fields the stage reads."""
    allocated = parameters + gradients + state + activations + temporaries
    return {
        "memory": {
            "estimate_mib": allocated + cache + context,
            "peak_moment": peak,
            "breakdown": {
                "parameters": parameters,
                "gradients": gradients,
                "optimizer_state": state,
                "activations": activations,
                "temporaries": temporaries,
                "allocator_cache": cache,
                "cuda_context": context,
                "collective_buffers": 0.0,
                "paged_optimizer_state": 0.0,
            },
        },
        "setup": {"trainable_params": trainable},
    }


def simulation(
    parameters=100, gradients=0, state=200, activations=50, temporaries=10, reserved_extra=30, trainable=1000
):
    """describe's result, MiB given, bytes as describe writes them."""
    parts = {
        "parameters": parameters,
        "gradients": gradients,
        "optimizer_state": state,
        "activations": activations,
        "temporaries": temporaries,
    }
    allocated = sum(parts.values())
    return {
        "simulation": {
            "breakdown_at_peak": {k: int(v * MIB) for k, v in parts.items()},
            "allocated_peak_bytes": int(allocated * MIB),
            "reserved_peak_bytes": int((allocated + reserved_extra) * MIB),
            "trainable_params": trainable,
        },
        "params": 5000,
    }


class CaseList(unittest.TestCase):
    def test_the_committed_cases_and_deltas_are_valid(self):
        self.assertTrue(ss.check_cases())
        for path in ss.CONFIGS.values():
            self.assertTrue(os.path.exists(os.path.join(REPO, path)), path)

    def test_every_new_setup_is_covered_by_a_delta(self):
        by_name = {c["name"]: c for c in ss.CASES}
        changed = [by_name[b] for _, _, b in ss.DELTAS]
        self.assertTrue(any(c["modules_to_save"] for c in changed))
        self.assertTrue(any(c["head"] == "reward" for c in changed))
        self.assertEqual({c["reference"] for c in changed} - {"none"}, {"copy", "adapters_disabled"})
        self.assertEqual({c["loss"] for c in changed} - {"upcast_fp32"}, {"chunked", "fused", "native"})
        fields = {k for _, _, extra in ss.ANALYTIC for k in extra}
        self.assertEqual(fields, {"master_weights", "base_weights"})

    def test_bad_lists_are_refused(self):
        good = ss.case("a", "llama-3.2-1b")
        for cases, deltas in [
            ([good, good], []),
            ([ss.case("a", "no-such-model")], []),
            ([ss.case("a", "llama-3.2-1b", modules_to_save=["lm_head"])], []),
            ([ss.case("a", "llama-3.2-1b", reference="adapters_disabled")], []),
            ([ss.case("a", "llama-3.2-1b", loss="sideways")], []),
            ([ss.case("a", "llama-3.2-1b", head="reward", loss="fused")], []),
            ([good], [("x", "a", "b")]),
            ([good, ss.case("b", "tinyllama-1.1b")], [("x", "a", "b")]),
        ]:
            with self.assertRaises(ValueError):
                ss.check_cases(cases, deltas, [])


CONFIGS = {"llama-3.2-1b": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64}}


class Requests(unittest.TestCase):
    configs = CONFIGS

    def test_a_reward_case_asks_for_a_one_label_classifier_and_no_vocabulary_loss(self):
        c = ss.case("r", "llama-3.2-1b", head="reward", lora=True, modules_to_save=["score"])
        body = ss.service_request(c, self.configs)
        self.assertEqual(body["transformer_config"]["architectures"], ["LlamaForSequenceClassification"])
        self.assertEqual(body["transformer_config"]["num_labels"], 1)
        self.assertNotIn("loss_implementation", body)
        self.assertEqual(body["lora"]["modules_to_save"], ["score"])
        self.assertEqual(self.configs["llama-3.2-1b"]["architectures"], ["LlamaForCausalLM"])

    def test_both_sides_get_the_same_setup(self):
        c = ss.case(
            "m",
            "llama-3.2-1b",
            lora=True,
            modules_to_save=["embed_tokens", "lm_head"],
            reference="adapters_disabled",
            loss="chunked",
        )
        body = ss.service_request(c, self.configs)
        job = ss.describe_job(c, "/folder")
        self.assertEqual(body["batch_size"], job["batch_size"])
        self.assertEqual(body["seq_len"], job["seq_len"])
        self.assertEqual(body["precision"], job["precision"])
        self.assertEqual(body["optimizer"], job["optimizer"])
        self.assertEqual(body["lora"]["target_modules"], job["lora"]["target_modules"])
        self.assertEqual(body["lora"]["rank"], job["lora"]["rank"])
        self.assertEqual(body["lora"]["alpha"], job["lora"]["alpha"])
        self.assertEqual(body["lora"]["modules_to_save"], job["modules_to_save"])
        self.assertEqual(body["reference_model"], job["reference"])
        self.assertEqual(body["loss_implementation"], job["loss"])

    def test_an_analytic_field_goes_where_the_contract_has_it(self):
        c = ss.case("l", "llama-3.2-1b", lora=True)
        body = ss.service_request(c, self.configs, {"base_weights": "gptq_int4"})
        self.assertEqual(body["lora"]["base_weights"], "gptq_int4")
        self.assertNotIn("base_weights", body)
        body = ss.service_request(ss.case("f", "llama-3.2-1b"), self.configs, {"master_weights": "fp32"})
        self.assertEqual(body["master_weights"], "fp32")
        self.assertNotIn("lora", body)


class Arithmetic(unittest.TestCase):
    def test_terms_sum_as_each_path_counts_them(self):
        s = ss.service_terms(estimate())
        self.assertEqual(s["terms"]["allocated"], 360.0)
        self.assertEqual(s["terms"]["reserved"], 380.0)
        self.assertEqual(s["terms"]["figure"], 1680.0)
        d = ss.simulation_terms(simulation(), s["cuda_context"])
        self.assertAlmostEqual(d["terms"]["allocated"], 360.0)
        self.assertAlmostEqual(d["terms"]["reserved"], 390.0)
        self.assertAlmostEqual(d["terms"]["figure"], 1690.0)
        self.assertEqual(d["peak"], "backward_start")
        self.assertEqual(ss.simulation_terms(simulation(activations=0), 0)["peak"], "optimizer_step")
        self.assertEqual(ss.simulation_terms(simulation(gradients=5), 0)["peak"], "in backward")

    def test_deltas_and_errors(self):
        self.assertEqual(ss.delta({"a": 1.0, "b": 5.0}, {"a": 4.0, "b": 2.0}), {"a": 3.0, "b": -3.0})
        self.assertAlmostEqual(ss.relative(110.0, 100.0), 0.10)
        self.assertIsNone(ss.relative(5.0, 0.0))
        # off: beyond 10 % of describe's delta and beyond the floor
        self.assertTrue(ss.delta_off(1000.0, 1500.0))
        self.assertFalse(ss.delta_off(1000.0, 1050.0))  # 5 %
        self.assertFalse(ss.delta_off(0.0, 20.0))  # under the floor
        self.assertTrue(ss.delta_off(0.0, 100.0))

    def test_packed_int4_layouts(self):
        # one 4096 x 4096 projection, groups of 128: int4 weights, fp16 scales, packed zeros
        weights = 4096 * 4096
        awq = weights / 2 + 32 * 4096 * 2 + 32 * 512 * 4
        self.assertEqual(ss.packed_int4_bytes([(4096, 4096)], "awq_int4"), awq)
        self.assertEqual(ss.packed_int4_bytes([(4096, 4096)], "gptq_int4"), awq + 4096 * 4)
        config = {
            "hidden_size": 2048,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "intermediate_size": 8192,
            "num_hidden_layers": 2,
        }
        shapes = ss.linear_shapes(config)
        self.assertEqual(len(shapes), 14)
        self.assertIn((2048, 512), shapes)  # k/v with 8 key-value heads of 64


class Tables(unittest.TestCase):
    def test_case_and_delta_terms(self):
        a = ss.case("A", "llama-3.2-1b", lora=True)
        b = ss.case("B", "llama-3.2-1b", lora=True, modules_to_save=["lm_head"])
        service = {"A": ss.service_terms(estimate()), "B": ss.service_terms(estimate(parameters=600.0, state=1200.0))}
        simulated = {
            "A": ss.simulation_terms(simulation(), 1300.0),
            "B": ss.simulation_terms(simulation(parameters=1100, state=2200), 1300.0),
        }
        terms = ss.terms_by_case(service, simulated, cases=[a, b], deltas=[("saved head", "A", "B")])
        self.assertEqual(terms["cases"]["A"]["service"]["parameters"], 100.0)
        self.assertEqual(terms["cases"]["A"]["describe"]["parameters"], 100.0)
        (saved,) = terms["deltas"]
        self.assertEqual(saved["cases"], ["B", "A"])
        self.assertEqual(saved["service"]["parameters"], 500.0)
        self.assertAlmostEqual(saved["describe"]["parameters"], 1000.0)
        self.assertTrue(ss.delta_off(saved["service"]["parameters"], saved["describe"]["parameters"]))
        self.assertFalse(ss.delta_off(saved["service"]["activations"], saved["describe"]["activations"]))
        self.assertIn("modules_to_save ['lm_head']", ss.describe_setup(b))


if __name__ == "__main__":
    unittest.main()
