import json
import os
import tempfile
import threading
import unittest
from http.server import BaseHTTPRequestHandler, HTTPServer

from probe.gpucast_probe import cli
from probe.gpucast_probe.generators import generate
from probe.gpucast_probe.post import OBSERVATIONS_PATH, api_kind, environment_label, observation, post_rows
from probe.gpucast_probe.schema import CsvWriter, row_for


def rows(n=3, **overrides):
    out = []
    for spec, _ in zip(generate(["mlp", "cnn", "transformer"], 21), range(n)):
        fields = dict(peak_mib=3000, metrics={}, gpu_sku="NVIDIA L4", driver="550", status="ok")
        fields.update(overrides)
        out.append(row_for(spec, **fields))
    return out


class Server:
    """A stand-in gpucast that records observations and checks the token."""

    def __init__(self, token=None, fail_first=0):
        received = self.received = []
        keys = self.keys = []
        failures = [fail_first]

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                ok = token is None or self.headers.get("Authorization") == f"Bearer {token}"
                if ok and self.path == OBSERVATIONS_PATH:
                    received.append(body)
                    keys.append(self.headers.get("Idempotency-Key"))
                status = 200 if ok else 401
                if ok and failures[0] > 0:
                    # recorded, then answered as a timed-out call would be
                    failures[0] -= 1
                    status = 503
                self.send_response(status)
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args):
                pass

        self.httpd = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class Observations(unittest.TestCase):
    def test_an_ok_row_becomes_an_observation_in_the_api_shape(self):
        body = observation(rows(1)[0], "attached")
        self.assertEqual(body["gpu"], "attached")
        self.assertEqual(body["observed_peak_mib"], 3000.0)
        job = body["job"]
        self.assertEqual(job["family"], "mlp")
        self.assertTrue(all(set(layer) == {"kind", "output_size", "params"} for layer in job["layers"]))
        self.assertEqual(job["layers"][0]["kind"], "linear")

    def test_the_steady_step_time_and_environment_go_with_the_observation(self):
        row = rows(1, step_time_ms=12.5, environment="torch2.5.1+cu124")[0]
        body = observation(row, "h200-141gb")
        self.assertEqual(body["step_time_ms"], 12.5)
        self.assertEqual(body["environment"], "torch2.5.1+cu124")
        # From a CSV read back: text; an empty or bad cell is left out.
        self.assertEqual(observation(dict(row, step_time_ms="12.5"), "l4")["step_time_ms"], 12.5)
        for bad in ("", None, "0", "-3", "nan", "inf"):
            self.assertNotIn("step_time_ms", observation(dict(row, step_time_ms=bad), "l4"))
        self.assertNotIn("environment", observation(dict(row, environment="a b"), "l4"))
        self.assertNotIn("environment", observation(dict(row, environment=""), "l4"))

    def test_the_environment_label_is_the_torch_build(self):
        self.assertEqual(environment_label({"torch": "2.5.1+cu124", "cuda": "12.4"}), "torch2.5.1+cu124")
        self.assertEqual(environment_label({"torch": "2.5.1", "cuda": "12.4"}), "torch2.5.1-cu12.4")
        self.assertEqual(environment_label({"torch": "2.5.1 (dev)"}), "torch2.5.1__dev_")
        self.assertIsNone(environment_label({"torch": None}))
        self.assertIsNone(environment_label(None))
        self.assertEqual(len(environment_label({"torch": "9" * 100})), 64)

    def test_failed_or_unmeasured_rows_are_not_observations(self):
        self.assertIsNone(observation(rows(1, status="oom")[0], "l4"))
        self.assertIsNone(observation(rows(1, status="timeout")[0], "l4"))
        self.assertIsNone(observation(rows(1, peak_mib=None)[0], "l4"))

    def test_layer_kinds_are_mapped_to_the_api(self):
        self.assertEqual(api_kind("batch_normalization"), "batch_norm")
        self.assertEqual(api_kind("LeakyReLU"), "leaky_relu")
        self.assertEqual(api_kind("GELU"), "gelu")
        self.assertEqual(api_kind("multihead_attention"), "attention")


class Posting(unittest.TestCase):
    def test_rows_are_posted_with_the_token(self):
        server = Server(token="T")
        try:
            sent, skipped, errors = post_rows(server.url, rows(3) + rows(1, status="oom"), "h200-141gb", "T")
            self.assertEqual((sent, skipped, errors), (3, 1, []))
            self.assertEqual(len(server.received), 3)
            self.assertTrue(all(b["gpu"] == "h200-141gb" for b in server.received))
        finally:
            server.close()

    def test_each_row_carries_a_key_that_a_retry_repeats(self):
        server = Server(fail_first=1)
        try:
            sent, skipped, errors = post_rows(server.url, rows(2), "l4", None)
            self.assertEqual((sent, skipped, errors), (2, 0, []))
            # the first row was sent twice (503, then again), with the same key both times
            self.assertEqual(len(server.keys), 3)
            self.assertEqual(server.keys[0], server.keys[1])
            self.assertNotEqual(server.keys[1], server.keys[2])
            self.assertTrue(all(k and k.startswith("probe-") for k in server.keys))
            # a rerun of the same rows sends the same keys, so the service can answer from its record
            post_rows(server.url, rows(2), "l4", None)
            self.assertEqual(server.keys[3:], server.keys[1:3])
        finally:
            server.close()

    def test_a_refused_token_is_reported(self):
        server = Server(token="T")
        try:
            sent, _, errors = post_rows(server.url, rows(2), "attached", "wrong")
            self.assertEqual(sent, 0)
            self.assertEqual(len(errors), 2)
            self.assertIn("401", errors[0])
        finally:
            server.close()

    def test_posting_stops_when_time_runs_out(self):
        sent, skipped, errors = post_rows("http://127.0.0.1:9", rows(3), "l4", None, 5.0, lambda: 1.0)
        self.assertEqual((sent, skipped, errors), (0, 3, []))

    def test_the_cli_posts_an_earlier_run(self):
        server = Server()
        try:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "rows.csv")
                with CsvWriter(path) as writer:
                    writer.write_all(rows(4))
                code = cli.main(["--minutes", "1", "--out", path, "--post", server.url, "--post-existing"])
            self.assertEqual(code, 0)
            self.assertEqual(len(server.received), 4)
            self.assertEqual(server.received[1]["job"]["family"], "cnn")
        finally:
            server.close()


class Cli(unittest.TestCase):
    def test_bad_arguments_exit_2(self):
        self.assertEqual(cli.main(["--minutes", "0", "--out", "x.csv"]), 2)
        self.assertEqual(cli.main(["--minutes", "1", "--out", "x.csv", "--families", "rnn"]), 2)
        self.assertEqual(cli.main(["--minutes", "1", "--out", "x.csv", "--post-existing"]), 2)


if __name__ == "__main__":
    unittest.main()
