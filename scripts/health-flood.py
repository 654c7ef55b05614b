#!/usr/bin/env python3
"""Health under a CPU flood, and the work left when the flood stops (issue 34, items 2 and 3),
on loopback against a `gpucast serve` started here (the adversarial suite's Server, default
flags). Stdlib only; Linux.

    cargo build --release --bin gpucast
    python3 scripts/health-flood.py target/release/gpucast [--seconds 10] [--attackers 8] [--maximal]

Attackers (threads, a connection of their own per request, closed as soon as the flood stops):
half send request-cpu.py's `config` case (a Llama-3-8B config.json with modules_to_save x 256,
ranked on 16 GPUs), half batches of 256 README jobs each ranked on the same 16 GPUs (4,096
card estimates a batch). Meanwhile a prober sends GET /healthz then GET /readyz, a new
connection each, every 10 ms, on the main port and on the health listener (`--health-listen`),
and a legitimate client the README request every 10 ms. `--hold-connections 1024` also keeps the
main port's whole connection cap taken by idle connections. With
`--maximal` the batches are the adversarial suite's `maximal_batch` instead (as many 512-layer
jobs as fit in the 2 MB body limit). `--serve-arg=--request-timeout-secs=1` (repeatable) passes
flags to the server: with a short timeout and many attackers, work outlasts its request.

Prints one JSON object: per probe route and for the legitimate client the count, p50, p99 and
max latency (ms) and the answers other than 200; the attackers' statuses; and once the flood
stops, the seconds until the server's CPU time stops growing (/proc/PID/stat read every 50 ms;
quiet: under 5 ms of CPU in 50 ms, for 2 s) and the CPU seconds it spent meanwhile.
"""

import argparse
import collections
import importlib.util
import json
import os
import socket
import tempfile
import threading
import time

from attacks.connections import maximal_batch
from harness import Server, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("request_cpu", os.path.join(HERE, "request-cpu.py"))
request_cpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(request_cpu)


def raw_request(port, method, path, body=b"", stop=None, timeout=60.0):
    """(status, seconds) of one request on a connection of its own; status `stopped` when
    `stop` was set first (the connection is closed then), an exception's name on failure."""
    started = time.perf_counter()
    head = (
        f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(head + body)
            sock.settimeout(0.05 if stop is not None else timeout)
            data = b""
            while True:
                if stop is not None and stop.is_set():
                    return "stopped", time.perf_counter() - started
                try:
                    chunk = sock.recv(65536)
                except socket.timeout:
                    if time.perf_counter() - started > timeout:
                        return "timeout", time.perf_counter() - started
                    continue
                if not chunk:
                    break
                data += chunk
        status = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "garbled"
        return status, time.perf_counter() - started
    except OSError as error:
        return type(error).__name__, time.perf_counter() - started


def percentile(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))] if values else None


def summary(samples):
    seconds = [s for _, s in samples]
    return {
        "count": len(samples),
        "p50_ms": round(percentile(seconds, 50) * 1e3, 2) if seconds else None,
        "p99_ms": round(percentile(seconds, 99) * 1e3, 2) if seconds else None,
        "max_ms": round(max(seconds) * 1e3, 2) if seconds else None,
        "not_200": dict(collections.Counter(str(s) for s, _ in samples if s != "200")),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("binary")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--attackers", type=int, default=8)
    parser.add_argument("--maximal", action="store_true")
    parser.add_argument("--serve-arg", action="append", default=[], help="passed to gpucast serve (repeatable)")
    parser.add_argument(
        "--hold-connections",
        type=int,
        default=0,
        help="also keep this many idle connections open on the main port (1024: its whole cap)",
    )
    options = parser.parse_args()
    binary, seconds, attackers = os.path.abspath(options.binary), options.seconds, options.attackers
    maximal = options.maximal
    readme = request_cpu.readme_body()
    config = json.dumps(request_cpu.config_body()).encode()
    ranked = dict(readme, gpu=request_cpu.GPUS)
    batch = maximal_batch() if maximal else json.dumps({"items": [ranked] * 256}).encode()
    legit = json.dumps(readme).encode()
    port, health_port = free_port(), free_port()
    flood, done = threading.Event(), threading.Event()
    lock = threading.Lock()
    statuses = collections.Counter()
    probes = {"/healthz": [], "/readyz": [], "health /healthz": [], "health /readyz": [], "legitimate": []}

    def holder():
        """Keeps `--hold-connections` idle connections open on the main port: the header
        timeout closes them after 5 s, so a fresh set is opened every 4 s before the old goes."""
        held = []
        while not flood.is_set():
            fresh = []
            for _ in range(options.hold_connections):
                try:
                    fresh.append(socket.create_connection(("127.0.0.1", port), timeout=1))
                except OSError:
                    break
            for sock in held:
                sock.close()
            held = fresh
            flood.wait(4.0)
        for sock in held:
            sock.close()

    def attacker(n):
        path, body = ("/v1/estimate", config) if n % 2 == 0 else ("/v1/estimate/batch", batch)
        while not flood.is_set():
            status, _ = raw_request(port, "POST", path, body, stop=flood)
            with lock:
                statuses[f"{path} {status}"] += 1

    def prober():
        while not done.is_set():
            for path in ("/healthz", "/readyz"):
                sample = raw_request(port, "GET", path, timeout=30)
                on_health_port = raw_request(health_port, "GET", path, timeout=30)
                with lock:
                    probes[path].append(sample)
                    probes[f"health {path}"].append(on_health_port)
            time.sleep(0.01)

    def legitimate():
        while not done.is_set():
            sample = raw_request(port, "POST", "/v1/estimate", legit, timeout=30)
            with lock:
                probes["legitimate"].append(sample)
            time.sleep(0.01)

    with tempfile.TemporaryDirectory(prefix="gpucast-health-flood-") as store:
        health_arg = f"--health-listen=127.0.0.1:{health_port}"
        # No answer kept: the flood repeats its bodies, which the memo would answer without
        # estimating; an attacker varies them.
        server = Server(
            binary, port, data_dir=store, extra_args=[health_arg, "--answer-memo-mib", "0", *options.serve_arg]
        )
        try:
            pid = server.process.pid
            threads = [threading.Thread(target=attacker, args=(n,)) for n in range(attackers)]
            if options.hold_connections:
                threads.append(threading.Thread(target=holder))
            for thread in threads:
                thread.start()
            time.sleep(1.0)  # the flood under way before anything is measured
            watchers = [threading.Thread(target=prober), threading.Thread(target=legitimate)]
            for thread in watchers:
                thread.start()
            time.sleep(seconds)
            done.set()
            for thread in watchers:
                thread.join()
            # The flood stops: every attacker's connection closed at once.
            flood.set()
            stopped = time.perf_counter()
            for thread in threads:
                thread.join()
            cpu_at_stop = request_cpu.cpu_seconds(pid)
            last, busy_until, quiet_since = cpu_at_stop, stopped, stopped
            while time.perf_counter() - quiet_since < 2.0 and time.perf_counter() - stopped < 120:
                time.sleep(0.05)
                now = request_cpu.cpu_seconds(pid)
                if now - last >= 0.005:
                    busy_until = quiet_since = time.perf_counter()
                last = now
            report = {
                "binary": binary,
                "seconds": seconds,
                "attackers": attackers,
                "batch_bytes": len(batch),
                "attacker_statuses": dict(statuses),
                "healthz": summary(probes["/healthz"]),
                "readyz": summary(probes["/readyz"]),
                "held_connections": options.hold_connections,
                "health_port_healthz": summary(probes["health /healthz"]),
                "health_port_readyz": summary(probes["health /readyz"]),
                "legitimate_readme": summary(probes["legitimate"]),
                "busy_after_stop_s": round(busy_until - stopped, 2),
                "cpu_after_stop_s": round(last - cpu_at_stop, 2),
            }
        finally:
            server.stop()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
