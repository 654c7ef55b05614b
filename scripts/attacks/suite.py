"""What every attack runs inside: the legitimate client (its own process) and the /healthz and
RSS samplers around an attack (run_attack), the targets each attack records (target,
expect_statuses) and the helpers the attacks share."""

import collections
import json
import multiprocessing
import os
import threading
import time

from harness import request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 1024 * 1024

RSS_PEAK_TARGET_MIB = 250

RSS_SETTLE_MARGIN_MIB = 50  # "back near the baseline": within this of the RSS before the attack


def example_job():
    with open(os.path.join(ROOT, "openapi", "openapi.json")) as handle:
        schema = json.load(handle)["components"]["schemas"]["EstimateRequest"]
    return schema.get("example") or schema["allOf"][0]["example"]


def observation(job, peak, gpu="a100-40gb", environment=None):
    body = {"gpu": gpu, "job": job, "observed_peak_mib": peak}
    if environment:
        body["environment"] = environment
    return body


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


# -- targets ------------------------------------------------------------------------------------

TARGETS = []
CURRENT = {"attack": None, "server": None}
SERVER_PID = [0]  # the suite's main server (watch_flood counts its threads)


def target(name, passed, measured, asserted=True, attack=None):
    """Records one target: `asserted` ones fail the run; the others are reported only."""
    TARGETS.append(
        {
            "attack": attack or CURRENT["attack"],
            "target": name,
            "passed": bool(passed),
            "asserted": asserted,
            "measured": measured,
        }
    )


def expect_statuses(statuses, allowed, ignore=()):
    """A target: every attacker status (the first word of each key; keys starting with one of
    `ignore` are measurements, not statuses) is in `allowed`."""
    counted = {k: v for k, v in statuses.items() if not str(k).startswith(tuple(ignore))}
    unexpected = {k: v for k, v in counted.items() if str(k).split(" ")[0] not in allowed}
    target(
        f"statuses all in {{{', '.join(sorted(allowed))}}}",
        bool(counted) and not unexpected,
        f"{dict(sorted(counted.items()))}" + (f"; unexpected: {unexpected}" if unexpected else ""),
    )


def run_attack(server, name, attack):
    """Runs `attack(port)` while a legitimate client and a prober run. The attack returns a
    Counter of statuses, or (Counter, dict of what it measured)."""
    CURRENT["attack"], CURRENT["server"] = name, server
    stop = threading.Event()
    rss_before = server.rss_mib()
    health_failures, rss = [0], [rss_before]
    processes = multiprocessing.get_context("spawn")
    legitimate_stop, legitimate_results = processes.Event(), processes.Queue()
    legitimate = processes.Process(
        target=legitimate_client, args=(server.port, example_job(), legitimate_stop, legitimate_results), daemon=True
    )
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
    measured, crashed = {}, None
    try:
        result = attack(server.port)
    except Exception as error:  # a bug here or a dead server: reported, and the suite goes on
        result, crashed = collections.Counter(), f"{type(error).__name__}: {error}"
    if isinstance(result, tuple):
        result, measured = result
    statuses = result
    ended = time.time()
    stop.set()
    legitimate_stop.set()
    try:
        timed, errors = legitimate_results.get(timeout=60)
    except Exception:
        timed, errors = [], {"no report from the legitimate client": 1}
    # only the answers to calls sent while the attack ran
    latencies = [ms for sent_at, ms in timed if started <= sent_at <= ended]
    legitimate.join(timeout=10)
    for thread in helpers:
        thread.join()
    # back near the baseline: polled for up to 5 s
    settle_deadline = time.time() + 5
    rss_after = server.rss_mib()
    while (
        rss_after > rss_before + RSS_SETTLE_MARGIN_MIB
        and time.time() < settle_deadline
        and server.process.poll() is None
    ):
        time.sleep(0.25)
        rss_after = server.rss_mib()
    report = {
        "attack": name,
        "seconds": round(ended - started, 1),
        "attacker_statuses": dict(sorted((str(k), v) for k, v in statuses.items())),
        "measured": measured,
        "rss_before_mib": round(rss_before, 1),
        "rss_peak_mib": round(max(rss), 1),
        "rss_after_mib": round(rss_after, 1),
        "legitimate": {
            "answered": len(latencies),
            "errors": errors,
            "p50_ms": round(percentile(latencies, 0.5) or 0, 1),
            "p99_ms": round(percentile(latencies, 0.99) or 0, 1),
        },
        "healthz_failures": health_failures[0],
    }
    if crashed:
        report["crashed"] = crashed
        target("the attack ran to its end", False, crashed)
    target(f"peak RSS <= {RSS_PEAK_TARGET_MIB} MiB", max(rss) <= RSS_PEAK_TARGET_MIB, f"{max(rss):.1f} MiB")
    target(
        f"RSS back near the baseline (within {RSS_SETTLE_MARGIN_MIB} MiB, within 5 s)",
        rss_after <= rss_before + RSS_SETTLE_MARGIN_MIB,
        f"{rss_before:.1f} -> {rss_after:.1f} MiB",
    )
    target("legitimate client: no errors", not errors, f"{errors or 'none'}")
    target("/healthz never failed", health_failures[0] == 0, f"{health_failures[0]} failures")
    target(
        "legitimate p99 <= 50 ms",
        (percentile(latencies, 0.99) or 0) <= 50,
        f"p99 {report['legitimate']['p99_ms']} ms over {len(latencies)} calls",
        asserted=False,
    )
    print(json.dumps(report), flush=True)
    return report


def check_existing(report):
    """The expected statuses of the attacks this suite had before the hardening issue."""
    name, statuses = report["attack"], report["attacker_statuses"]
    CURRENT["attack"] = name
    if name == "batch_flood_8x2MiB":
        expect_statuses(statuses, {"200", "503"})
    elif name == "slow_bodies_520":
        expect_statuses(statuses, {"408"})
    elif name == "content_length_1e12_x20":
        target("413 at once (< 1 s)", statuses == {"413 in <1 s": 20}, statuses)
    elif name == "odd_methods_2000":
        expect_statuses(statuses, {"405"}, ignore=("metrics bytes",))
    elif name == "half_sent_headers_200":
        expect_statuses(statuses, {"closed"}, ignore=("all ended",))
    elif name == "poison_calibration_40":
        expect_statuses(statuses, {"422"}, ignore=("profiles after",))
        target("no profile recorded", statuses.get("profiles after: 0") == 1, statuses)
    elif name == "watch_flood_4000":
        expect_statuses(statuses, {"409"}, ignore=("threads",))
        threads = [k for k in statuses if k.startswith("threads")]
        target("no thread left behind", threads and threads[0].split()[1] == threads[0].split()[3], threads)


def concurrently(n, work, items=None):
    """`n` threads, each calling `work()` once; with `items`, calling `work(item)` for the next
    item until none is left. The statuses returned, counted."""
    statuses = collections.Counter()
    lock = threading.Lock()
    shared = None if items is None else iter(items)

    def one():
        if shared is None:
            status = work()
            with lock:
                statuses[str(status)] += 1
            return
        while True:
            with lock:
                item = next(shared, None)
            if item is None:
                return
            status = work(item)
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
