#!/usr/bin/env python3
"""The adversarial suite: attacks one caller can mount on loopback, run against a real gpucast
server started here, with a legitimate client (its own process, as a real one would be)
estimating throughout. Stdlib only.

    scripts/adversarial.sh                 # builds, runs, writes load-tests/adversarial.json

Per attack it reports the attackers' statuses (counts), the server's peak RSS (VmRSS sampled
every 20 ms), the legitimate single estimates' p50/p99 latency and errors, and /healthz
failures. Last, SIGTERM with a half-sent header held open: seconds until the process exits.
Targets (the hardening issue): legitimate p99 <= 50 ms and 0 errors, /healthz always 200,
RSS < 250 MiB.
"""

import collections
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, binary, port):
        self.port = port
        self.process = subprocess.Popen(
            [binary, "serve", "--listen", f"127.0.0.1:{port}", "--no-nvml",
             "--data-dir", f"/tmp/gpucast-adversarial-{port}"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1)
                return
            except Exception:
                time.sleep(0.2)
        raise SystemExit("the server did not become ready")

    def rss_mib(self):
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS"):
                    return int(line.split()[1]) / 1024
        return 0.0


def request(port, method, path, body=None, timeout=30):
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except Exception as error:
        return type(error).__name__


def example_job():
    with open(os.path.join(ROOT, "openapi", "openapi.json")) as handle:
        schema = json.load(handle)["components"]["schemas"]["EstimateRequest"]
    return schema.get("example") or schema["allOf"][0]["example"]


def percentile(values, p):
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p * (len(ordered) - 1))))]


def legitimate_client(port, job, stop, results):
    """A legitimate caller estimating every 20 ms until `stop`; puts ([(sent_at, latency_ms)],
    errors).
    It runs in its own process: in the attackers' interpreter it would wait on their GIL (their
    JSON and socket work) and measure that instead of the service."""
    latencies, errors = [], collections.Counter()
    while not stop.is_set():
        sent_at, started = time.time(), time.perf_counter()
        status = request(port, "POST", "/v1/estimate", job)
        if status == 200:
            latencies.append((sent_at, (time.perf_counter() - started) * 1000))
        else:
            errors[str(status)] += 1
        time.sleep(0.02)
    results.put((latencies, dict(errors)))


def run_attack(server, name, attack):
    """Runs `attack(port) -> Counter of statuses` while a legitimate client and a prober run."""
    stop = threading.Event()
    health_failures, rss = [0], [server.rss_mib()]
    processes = multiprocessing.get_context("spawn")
    legitimate_stop, legitimate_results = processes.Event(), processes.Queue()
    legitimate = processes.Process(
        target=legitimate_client,
        args=(server.port, example_job(), legitimate_stop, legitimate_results), daemon=True)
    legitimate.start()
    time.sleep(1.0)  # the client is estimating before the attack starts

    def probe():
        while not stop.is_set():
            if request(server.port, "GET", "/healthz", timeout=5) != 200:
                health_failures[0] += 1
            time.sleep(0.1)

    def sample():
        while not stop.is_set():
            rss.append(server.rss_mib())
            time.sleep(0.02)

    helpers = [threading.Thread(target=f, daemon=True) for f in (probe, sample)]
    for thread in helpers:
        thread.start()
    started = time.time()
    statuses = attack(server.port)
    stop.set()
    legitimate_stop.set()
    ended = time.time()
    timed, errors = legitimate_results.get(timeout=60)
    # only the answers to calls sent while the attack ran
    latencies = [ms for sent_at, ms in timed if started <= sent_at <= ended]
    legitimate.join(timeout=10)
    for thread in helpers:
        thread.join()
    report = {
        "attack": name,
        "seconds": round(time.time() - started, 1),
        "attacker_statuses": dict(sorted((str(k), v) for k, v in statuses.items())),
        "rss_peak_mib": round(max(rss), 1),
        "legitimate": {"answered": len(latencies), "errors": errors,
                       "p50_ms": round(percentile(latencies, 0.5) or 0, 1),
                       "p99_ms": round(percentile(latencies, 0.99) or 0, 1)},
        "healthz_failures": health_failures[0],
    }
    print(json.dumps(report), flush=True)
    return report


def maximal_batch():
    layers = [{"kind": "linear", "output_size": 1024, "params": 1049600},
              {"kind": "relu", "output_size": 1024, "params": 0}] * 256
    items, body = [], b""
    while True:
        candidate = json.dumps({"items": items + [{"batch_size": 64, "layers": layers}]}).encode()
        if len(candidate) > 2 * 1024 * 1024 - 1000:
            return body
        items.append({"batch_size": 64, "layers": layers})
        body = candidate


def concurrently(n, work):
    statuses = collections.Counter()
    lock = threading.Lock()

    def one():
        status = work()
        with lock:
            statuses[str(status)] += 1

    threads = [threading.Thread(target=one) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return statuses


def read_status(sock, limit):
    sock.settimeout(limit)
    try:
        data = sock.recv(64)
    except OSError:
        return "no answer"
    if not data:
        return "closed"
    parts = data.split(b" ")
    return parts[1].decode() if len(parts) > 1 else "garbled"


def batch_flood(port):
    body = maximal_batch()
    return concurrently(8, lambda: request(port, "POST", "/v1/estimate/batch", body, timeout=120))


def slow_bodies(port, connections=520):
    socks = []
    for _ in range(connections):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /v1/estimate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n{\"batch_size\":1")
        socks.append(sock)
    statuses = collections.Counter(read_status(s, 30) for s in socks)
    for sock in socks:
        sock.close()
    return statuses


def huge_content_length(port):
    def one():
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /v1/estimate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000000000000\r\n\r\n")
        started = time.time()
        status = read_status(sock, 15)
        sock.close()
        return f"{status} in {'<1' if time.time() - started < 1 else '>=1'} s"
    return concurrently(20, one)


def odd_methods(port):
    before = len(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read())
    statuses = collections.Counter()
    for i in range(2000):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(f"M{i}ETHOD /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        statuses[read_status(sock, 5)] += 1
        sock.close()
    after = len(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read())
    statuses[f"metrics bytes {before} -> {after}"] = 1
    return statuses


def poison_calibration(port):
    """20 observations of a 1 MiB peak, then 20 of 10,000,000 MiB: all must be refused (the
    listener is loopback, so writes are open without a token, but physics holds them)."""
    statuses = collections.Counter()
    job = example_job()
    for peak in [1] * 20 + [10_000_000] * 20:
        body = {"gpu": "a100-40gb", "observed_peak_mib": peak, "job": job}
        statuses[str(request(port, "POST", "/v1/calibration/observations", body))] += 1
    profiles = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/calibration/profiles").read())
    statuses[f"profiles after: {len(profiles['profiles'])}"] = 1
    return statuses


def watch_flood(port):
    """4,000 watch requests (no GPU here: each refused, and no thread started)."""
    threads_before = len(os.listdir(f"/proc/{SERVER_PID[0]}/task"))
    statuses = collections.Counter()
    for pid in range(4000):
        statuses[str(request(port, "POST", "/v1/calibration/watch", {"pid": 100000 + pid, "job": example_job()}))] += 1
    statuses[f"threads {threads_before} -> {len(os.listdir(f'/proc/{SERVER_PID[0]}/task'))}"] = 1
    return statuses


SERVER_PID = [0]


def half_headers(port, connections=200):
    socks = []
    for _ in range(connections):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /v1/estimate HTTP/1.1\r\nHost: x\r\n")
        socks.append(sock)
    started = time.time()
    statuses = collections.Counter(read_status(s, 30) for s in socks)
    statuses[f"all ended after {round(time.time() - started)} s"] = 1
    for sock in socks:
        sock.close()
    return statuses


def sigterm_with_half_header(binary):
    server = Server(binary, free_port())
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/estimate HTTP/1.1\r\nHost: x\r\n")
    started = time.time()
    server.process.send_signal(signal.SIGTERM)
    try:
        server.process.wait(timeout=60)
        result = {"attack": "sigterm_with_half_sent_header", "exit_seconds": round(time.time() - started, 1),
                  "exit_code": server.process.returncode}
    except subprocess.TimeoutExpired:
        server.process.kill()
        result = {"attack": "sigterm_with_half_sent_header", "exit_seconds": None, "killed_after": 60}
    sock.close()
    print(json.dumps(result), flush=True)
    return result


def main():
    binary = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target", "debug", "gpucast")
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(ROOT, "load-tests", "adversarial.json")
    server = Server(binary, free_port())
    SERVER_PID[0] = server.process.pid
    reports = []
    try:
        for name, attack in [("batch_flood_8x2MiB", batch_flood), ("slow_bodies_520", slow_bodies),
                             ("content_length_1e12_x20", huge_content_length),
                             ("odd_methods_2000", odd_methods), ("half_sent_headers_200", half_headers),
                             ("poison_calibration_40", poison_calibration),
                             ("watch_flood_4000", watch_flood)]:
            reports.append(run_attack(server, name, attack))
    finally:
        server.process.terminate()
        server.process.wait(timeout=60)
    reports.append(sigterm_with_half_header(binary))
    with open(out, "w") as handle:
        json.dump({"binary": os.path.relpath(binary, ROOT), "attacks": reports}, handle, indent=1)
        handle.write("\n")
    print(f"report: {os.path.relpath(out, ROOT)}")


if __name__ == "__main__":
    main()
