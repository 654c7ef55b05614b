"""Attacks on the HTTP front one caller can mount on loopback: oversized, slow, trickled, held and
half-sent bodies and headers, made-up methods, a flood of watch calls, a CPU bomb, cross-site
writes, a huge unknown field, SIGTERM with a half-sent header."""

import collections
import json
import os
import select
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

from harness import Server, call, call_json, free_port, raw_http, request

from .suite import (
    CURRENT,
    MIB,
    ROOT,
    RSS_SETTLE_MARGIN_MIB,
    SERVER_PID,
    concurrently,
    example_job,
    expect_statuses,
    observation,
    read_status,
    target,
)


def maximal_batch():
    layers = [
        {"kind": "linear", "output_size": 1024, "params": 1049600},
        {"kind": "relu", "output_size": 1024, "params": 0},
    ] * 256
    items, body = [], b""
    while True:
        candidate = json.dumps({"items": items + [{"batch_size": 64, "layers": layers}]}).encode()
        if len(candidate) > 2 * 1024 * 1024 - 1000:
            return body
        items.append({"batch_size": 64, "layers": layers})
        body = candidate


def batch_flood(port):
    body = maximal_batch()
    return concurrently(8, lambda: request(port, "POST", "/v1/estimate/batch", body, timeout=120))


def memo_churn(port, bodies=6_000, clients=8):
    """6,000 distinct valid jobs (the example at 6,000 batch sizes), 8 clients: every answer
    kept, four times what the answer memo holds at its default (16 MiB, about 1,500): the memo
    evicts and the service's memory stays bounded."""
    metrics = f"http://127.0.0.1:{port}/metrics"

    def kept_reused():
        text = urllib.request.urlopen(metrics).read().decode()
        return sum(
            float(line.split()[-1]) for line in text.splitlines() if line.startswith("gpucast_answers_reused_total")
        )

    reused_before = kept_reused()

    def post(size):
        job = example_job()
        job["batch_size"] = 1_000_000 + size
        return request(port, "POST", "/v1/estimate", job)

    statuses = concurrently(clients, post, items=range(1, bodies + 1))
    expect_statuses(statuses, {"200"})
    return statuses, {"bodies": bodies, "answers_reused": kept_reused() - reused_before}


def slow_bodies(port, connections=520):
    socks = []
    for _ in range(connections):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(
            b"POST /v1/estimate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100000\r\n\r\n{"batch_size":1'
        )
        socks.append(sock)
    statuses = collections.Counter(read_status(s, 30) for s in socks)
    for sock in socks:
        sock.close()
    return statuses


def huge_content_length(port):
    def one():
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(
            b"POST /v1/estimate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000000\r\n\r\n"
        )
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


def watch_flood(port):
    """4,000 watch requests (no GPU here: each refused, and no thread started)."""
    threads_before = len(os.listdir(f"/proc/{SERVER_PID[0]}/task"))
    statuses = collections.Counter()
    for pid in range(4000):
        statuses[str(request(port, "POST", "/v1/calibration/watch", {"pid": 100000 + pid, "job": example_job()}))] += 1
    statuses[f"threads {threads_before} -> {len(os.listdir(f'/proc/{SERVER_PID[0]}/task'))}"] = 1
    return statuses


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
        result = {
            "attack": "sigterm_with_half_sent_header",
            "exit_seconds": round(time.time() - started, 1),
            "exit_code": server.process.returncode,
        }
    except subprocess.TimeoutExpired:
        server.process.kill()
        result = {"attack": "sigterm_with_half_sent_header", "exit_seconds": None, "killed_after": 60}
    sock.close()
    print(json.dumps(result), flush=True)
    return result


# -- attacks added by the hardening issue -------------------------------------------------------


def chunked_trickle(port, connections=64, batches=60):
    """64 sockets each send a chunked POST header and one chunk (`1\\r\\n{\\r\\n`, 3.7 KB in all
    with their headers) and hold it, as long as the body timeout lets them, while 60 legitimate
    batches (each over 64 KiB, so charged to the body budget) are sent one after another. A
    body is charged for what it sent: the trickle holds nothing, and no batch is refused."""
    head = (
        f"POST /v1/estimate/batch HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{\r\n"
    ).encode()
    socks = []
    for _ in range(connections):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(head)
        socks.append(sock)
    time.sleep(0.3)
    body = json.dumps({"items": [example_job()] * 256}).encode()
    legitimate = collections.Counter()
    started = time.time()
    for _ in range(batches):
        legitimate[str(request(port, "POST", "/v1/estimate/batch", body, timeout=30))] += 1
    held_for = round(time.time() - started, 2)
    statuses = collections.Counter(read_status(s, 10) for s in socks)
    for sock in socks:
        sock.close()
    target(
        f"chunked trickle: 0 of {batches} legitimate batches ({len(body) // 1024} KiB each) refused",
        legitimate.get("200", 0) == batches,
        f"{dict(legitimate)} over {held_for} s while {connections} trickles were held",
    )
    expect_statuses(statuses, {"408"})
    return statuses, {"legitimate_batches": dict(legitimate), "batch_kib": len(body) // 1024, "seconds": held_for}


def held_bodies(port, connections=600, length=2 * MIB):
    """600 sockets each declare a 2 MiB body, send all of it but 8 bytes, and stall. Each body
    takes the bytes it sent past its first 64 KiB from the budget (--max-body-bytes-in-flight,
    64 MiB) as they arrive: about 33 hold theirs to the stall and time out with 408 after 5 s,
    the rest are refused with 503 once a frame finds no room. While they are held the budget is
    spent: one small estimate is sent then to see what any other caller gets."""
    server = CURRENT["server"]
    baseline = server.rss_mib()
    head = (
        f"POST /v1/estimate HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()
    body = memoryview(b"[" + b" " * (length - 9))  # length - 8 bytes: never complete
    socks, sent_at, offset, answers = {}, {}, {}, {}
    poller = select.poll()
    for _ in range(connections):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(head)
        sock.setblocking(False)
        fd = sock.fileno()
        socks[fd], sent_at[fd], offset[fd] = sock, time.time(), 0
        poller.register(fd, select.POLLIN | select.POLLOUT)
    arrivals = select.poll()  # the same sockets, watched for answers alone
    for fd in socks:
        arrivals.register(fd, select.POLLIN)

    def read_answer(fd):
        try:
            data = socks[fd].recv(4096)
        except BlockingIOError:
            return
        except OSError:
            answers[fd] = ("reset", time.time() - sent_at[fd], False)
        else:
            parts = data.split(b" ")
            status = parts[1].decode() if data and len(parts) > 1 else "closed"
            answers[fd] = (status, time.time() - sent_at[fd], b"retry-after:" in data.lower())
        poller.unregister(fd)
        arrivals.unregister(fd)

    deadline = time.time() + 20
    probe = None  # a small estimate sent while the admitted bodies are held
    while len(answers) < len(socks) and time.time() < deadline:
        if probe is None and all(offset[fd] >= len(body) for fd in socks if fd not in answers):
            status, _, headers = call(port, "POST", "/v1/estimate", example_job(), timeout=10)
            probe = {
                "status": status,
                "retry_after": headers.get("retry-after"),
                "seconds_into_the_hold": round(time.time() - min(sent_at.values()), 2),
            }
        sends = 0
        for fd, events in poller.poll(200):
            sock = socks[fd]
            if fd in answers:
                continue
            if events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                read_answer(fd)
                if fd in answers:
                    continue
            # Pushing 600 bodies takes this loop seconds: answers that arrive meanwhile are
            # read (and timed) every few sends, not a whole round later.
            sends += 1
            if sends % 8 == 0:
                for ready, _ in arrivals.poll(0):
                    if ready not in answers:
                        read_answer(ready)
            if events & select.POLLOUT:
                try:
                    offset[fd] += sock.send(body[offset[fd] : offset[fd] + 65536])
                except BlockingIOError:
                    pass
                except OSError:
                    continue  # the answer (or a reset) is read on the next round
                if offset[fd] >= len(body):
                    poller.modify(fd, select.POLLIN)  # all but 8 bytes sent: stall
    statuses = collections.Counter()
    for fd in socks:
        status, seconds, _ = answers.get(fd, ("no answer", None, False))
        statuses[f"{status} after {int(seconds)} s" if seconds is not None else status] += 1
    refused = [a for a in answers.values() if a[0] == "503"]
    timed_out = [a for a in answers.values() if a[0] == "408"]
    bodies_sent = sum(1 for fd in socks if offset[fd] >= len(body))
    for sock in socks.values():
        sock.close()
    closed_at = time.time()
    peak_so_far = server.rss_mib()
    time.sleep(5)
    after = server.rss_mib()
    measured = {
        "rss_baseline_mib": round(baseline, 1),
        "rss_5s_after_close_mib": round(after, 1),
        "bodies_sent_to_the_stall": bodies_sent,
        "503_with_retry_after": sum(1 for a in refused if a[2]),
        "503_max_seconds": round(max((a[1] for a in refused), default=0), 2),
        "408_seconds": [
            round(min((a[1] for a in timed_out), default=0), 1),
            round(max((a[1] for a in timed_out), default=0), 1),
        ],
        "small_estimate_during_the_hold": probe,
    }
    budget_bodies = 64 * MIB // (length - 8 - 64 * 1024)  # each holds what it sent past 64 KiB
    target(
        "every socket answered 503 or 408",
        all(a[0] in ("503", "408") for a in answers.values()) and len(answers) == connections,
        dict(statuses),
    )
    # "At once": well before the 5 s body timeout that a held body would wait for (600 sockets
    # opened together on 2 cores take about a second to be answered at all; a body is refused
    # when the frame that finds no room arrives).
    target(
        "503s come at once (< 2 s, before any body timeout) with Retry-After",
        refused and measured["503_max_seconds"] < 2 and measured["503_with_retry_after"] == len(refused),
        f"{len(refused)} x 503, slowest {measured['503_max_seconds']} s, "
        f"{measured['503_with_retry_after']} with Retry-After",
    )
    target(
        f"mostly 503: at most {budget_bodies} bodies (64 MiB / their bytes past 64 KiB) held and answered 408",
        len(timed_out) <= budget_bodies,
        f"{len(timed_out)} x 408 after {measured['408_seconds'][0]}-{measured['408_seconds'][1]} s",
    )
    target(
        f"RSS 5 s after the sockets close within {RSS_SETTLE_MARGIN_MIB} MiB of the baseline",
        after <= baseline + RSS_SETTLE_MARGIN_MIB,
        f"{baseline:.1f} -> {after:.1f} MiB "
        f"({round(time.time() - closed_at, 1)} s after closing; {peak_so_far:.1f} MiB at closing)",
    )
    return statuses, measured


BOMB = "Net(\n  (0-4094): 4095 x Linear(in_features=3000000, out_features=3000000, bias=True)\n)"


def cpu_bomb(port, concurrent=4):
    """4 concurrent module prints of 4095 x 3e6 x 3e6 linear layers, each ranked on 16 GPUs."""
    gpus = [g["id"] for g in call_json(port, "GET", "/v1/gpus")[1]["gpus"]][:16]
    body = {"summary": {"format": "module_print", "text": BOMB}, "batch_size": 8, "gpu": gpus}
    seconds, lock = [], threading.Lock()

    def one():
        started = time.perf_counter()
        status, _, _ = call(port, "POST", "/v1/estimate", body, timeout=60)
        with lock:
            seconds.append(round(time.perf_counter() - started, 3))
        return status

    statuses = concurrently(concurrent, one)
    measured = {
        "gpus_listed": len(gpus),
        "text_bytes": len(BOMB.encode()),
        "body_bytes": len(json.dumps(body).encode()),
        "seconds": sorted(seconds),
    }
    expect_statuses(statuses, {"200", "422"})
    target(
        "the bomb answered within 5 s",
        seconds and max(seconds) <= 5,
        f"slowest {max(seconds, default=None)} s of {len(seconds)}",
    )
    return statuses, measured


def cross_site_writes(port):
    """Writes a browser could be made to send: no Content-Type, text/plain, Origin
    http://evil.example, Sec-Fetch-Site: cross-site, Host evil.example:PORT; to both write
    routes. All refused (415/403), nothing recorded."""
    job = example_job()
    bodies = {
        "/v1/calibration/observations": json.dumps(observation(job, 2000)).encode(),
        "/v1/calibration/watch": json.dumps({"pid": 4242, "job": job}).encode(),
    }
    json_type = ("Content-Type", "application/json")
    cases = {
        "no Content-Type": ([], "415"),
        "text/plain": ([("Content-Type", "text/plain")], "415"),
        "Origin http://evil.example": ([json_type, ("Origin", "http://evil.example")], "403"),
        "Sec-Fetch-Site cross-site": ([json_type, ("Sec-Fetch-Site", "cross-site")], "403"),
        f"Host evil.example:{port}": ([json_type, ("Host", f"evil.example:{port}")], "403"),
    }
    before = call(port, "GET", "/v1/calibration/profiles")[1]
    statuses, got, wrong = collections.Counter(), {}, []
    for path, body in bodies.items():
        for case, (headers, expected) in cases.items():
            status, _, _ = raw_http(port, "POST", path, headers, body)
            got[f"{path} {case}"] = status
            statuses[str(status)] += 1
            if str(status) != expected:
                wrong.append(f"{path} {case}: {status}, expected {expected}")
    after = call(port, "GET", "/v1/calibration/profiles")[1]
    # the control: the same hand-written request, same-origin, reaches validation (422)
    control, _, _ = raw_http(
        port,
        "POST",
        "/v1/calibration/observations",
        [json_type, ("Origin", f"http://127.0.0.1:{port}")],
        json.dumps(observation(job, 1)).encode(),
    )
    measured = {"answers": got, "profiles_unchanged": before == after, "control_same_origin_invalid_peak": control}
    target("cross-site writes refused with the expected 415/403", not wrong, "; ".join(wrong) or f"{dict(statuses)}")
    target(
        "cross-site writes recorded nothing (GET /v1/calibration/profiles unchanged)",
        before == after,
        f"{len(before)} -> {len(after)} bytes",
    )
    target("control: a same-origin hand-written write reaches validation (422)", control == 422, f"{control}")
    return statuses, measured


def unknown_field_echo(port):
    """A body whose one unknown key is 1.5 MB long: the problem's detail must not echo it."""
    body = b'{"batch_size": 1, "' + b"x" * 1_500_000 + b'": 1}'
    status, answer, _ = call(port, "POST", "/v1/estimate", body)
    measured = {
        "body_bytes": len(body),
        "answer_bytes": len(answer),
        "answer_start": answer[:160].decode(errors="replace"),
    }
    expect_statuses({str(status): 1}, {"400", "422"})
    target("the echo under 4 KB", len(answer) < 4096, f"{len(answer)} bytes for a {len(body)}-byte body")
    return collections.Counter({str(status): 1}), measured


def one_byte_chunks(port, connections=150, chunks=65_000):
    """150 sockets each send a chunked POST of 65,000 one-byte chunks (under the free 64 KiB
    each) and hold it unfinished until the body timeout. A body holds its bytes, not an entry
    (and a pinned read buffer) per chunk: RSS grows at most 100 MiB."""
    server = CURRENT["server"]
    baseline = server.rss_mib()
    head = (
        f"POST /v1/estimate HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    payload = head + b"1\r\nx\r\n" * chunks
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(connections)]
    peak, stop = [baseline], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], server.rss_mib())
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    def send(sock):
        try:
            sock.sendall(payload)
        except OSError:
            pass

    senders = [threading.Thread(target=send, args=(s,)) for s in socks]
    started = time.time()
    for thread in senders:
        thread.start()
    for thread in senders:
        thread.join()
    sent_seconds = round(time.time() - started, 2)
    statuses = collections.Counter(read_status(s, 30) for s in socks)
    stop.set()
    sampler.join()
    for sock in socks:
        sock.close()
    growth = peak[0] - baseline
    measured = {
        "rss_baseline_mib": round(baseline, 1),
        "rss_peak_mib": round(peak[0], 1),
        "rss_growth_mib": round(growth, 1),
        "wire_bytes_per_socket": len(payload),
        "all_sent_after_s": sent_seconds,
    }
    target(
        f"{connections} x {chunks:,} one-byte chunks held: RSS +100 MiB at most",
        growth <= 100,
        f"{baseline:.1f} -> peak {peak[0]:.1f} MiB (+{growth:.1f})",
    )
    expect_statuses(statuses, {"408", "503"})
    return statuses, measured


def one_address_holds_all(port, sockets=1_100, requests=20, first_bytes=b"", ask=None):
    """1,100 idle sockets from 127.0.0.2 (opened, never a byte sent, reopened as the header
    timeout closes them), past the port's 1,024 connections; meanwhile 20 requests from
    127.0.0.1, one after another. One address holds at most its own cap: every request of the
    other is answered, each within 2 s. (`first_bytes`: what each socket sends once open;
    `ask`: the other address's request, GET /v1/gpus by default.)"""
    held, stop = [], threading.Event()
    ask = ask or (lambda: request(port, "GET", "/v1/gpus", timeout=5))

    def open_one():
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.2", 0))
        sock.settimeout(2)
        try:
            sock.connect(("127.0.0.1", port))
            if first_bytes:
                sock.sendall(first_bytes)
        except OSError:
            sock.close()
            return None
        return sock

    def hold():
        while not stop.is_set():
            alive = []
            for sock in held:
                sock.setblocking(False)
                try:
                    closed = sock.recv(1) == b""
                except BlockingIOError:
                    closed = False
                except OSError:
                    closed = True
                if closed:
                    sock.close()
                else:
                    alive.append(sock)
            held[:] = alive
            while len(held) < sockets and not stop.is_set():
                sock = open_one()
                if sock is None:
                    break
                held.append(sock)
            time.sleep(0.2)

    for _ in range(sockets):
        sock = open_one()
        if sock is not None:
            held.append(sock)
    opened = len(held)
    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    time.sleep(0.5)
    statuses, seconds = collections.Counter(), []
    for _ in range(requests):
        started = time.perf_counter()
        status = ask()
        seconds.append(round(time.perf_counter() - started, 3))
        statuses[str(status)] += 1
        time.sleep(0.2)
    stop.set()
    holder.join()
    still_open = 0
    for sock in held:
        sock.setblocking(False)
        try:
            still_open += sock.recv(1) != b""
        except BlockingIOError:
            still_open += 1
        except OSError:
            pass
        sock.close()
    answered = statuses.get("200", 0)
    measured = {
        "sockets_opened_from_127.0.0.2": opened,
        "held_open_at_the_end": still_open,
        "other_address_seconds_max": max(seconds),
        "other_address_statuses": dict(statuses),
    }
    target(
        f"{sockets:,} idle sockets from one address: {requests} of {requests} requests from another answered, each within 2 s",
        answered == requests and max(seconds) <= 2,
        f"{answered}/{requests} answered, slowest {max(seconds)} s; {still_open} of the address's sockets held open",
    )
    return statuses, measured


def tls_half_open_handshakes(binary):
    """The same from 127.0.0.2 against a TLS port (the test certificate): each socket sends the
    first bytes of a ClientHello record (a 5-byte header announcing 512 bytes) and stops, a
    handshake left half-open until the header timeout; 20 HTTPS requests from 127.0.0.1."""
    import http.client
    import ssl
    import urllib.request as fetch

    CURRENT["attack"] = "tls_half_open_1100"
    port, health = free_port(), free_port()
    tls = os.path.join(ROOT, "tests", "fixtures", "tls")
    server = Server(
        binary,
        port,
        extra_args=(
            "--tls-cert",
            os.path.join(tls, "cert.pem"),
            "--tls-key",
            os.path.join(tls, "key.pem"),
            "--health-listen",
            f"127.0.0.1:{health}",
        ),
        must_start=False,
        ready_timeout=1,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if fetch.urlopen(f"http://127.0.0.1:{health}/readyz", timeout=1).status == 200:
                break
        except Exception:
            time.sleep(0.2)
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE

    def ask():
        connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=5)
        try:
            connection.request("GET", "/v1/gpus")
            return connection.getresponse().status
        except Exception as error:
            return type(error).__name__
        finally:
            connection.close()

    try:
        statuses, measured = one_address_holds_all(port, first_bytes=b"\x16\x03\x01\x02\x00", ask=ask)
    finally:
        server.stop()
    report = {"attack": "tls_half_open_1100", "attacker_statuses": dict(statuses), "measured": measured}
    print(json.dumps(report), flush=True)
    return report
