"""Attacks on the calibration store: poisoning (crude and adaptive), idempotency-key and
profile-key churn, a store bounded by --max-store-bytes fed padded observations, a damaged
write-ahead log and a store overwritten with garbage."""

import collections
import math
import json
import os
import re
import shutil
import signal
import time
import urllib.error
import urllib.request

from harness import Server, call, call_json, free_port, request

from .suite import CURRENT, MIB, example_job, expect_statuses, observation, target


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


def job_floor(port, job, gpu="a100-40gb"):
    """The job's physical floor as the service states it, read from the refusal of a 1 MiB
    peak (a refusal records nothing)."""
    status, problem = call_json(port, "POST", "/v1/calibration/observations", observation(job, 1, gpu))
    found = re.search(r"floor of ([0-9.]+) MiB", (problem or {}).get("detail", ""))
    if status != 422 or not found:
        raise RuntimeError(f"no floor in the refusal of a 1 MiB peak: {status} {problem}")
    return float(found.group(1))


def estimate(port, job):
    status, answer = call_json(port, "POST", "/v1/estimate", job)
    if status != 200:
        raise RuntimeError(f"estimate answered {status}: {answer}")
    return answer


def reach(u, b, environment):
    """(low, high, bound high) MiB a victim's answer must stay in, whatever was posted: the GPU
    line's reach without an environment, an environment's own (the stack's factor 0.5-2x and a
    context's range, `environment::reach`) in one."""
    if environment:
        return 0.5 * u, 2 * u + 3072, 2 * max(b, u) + 3072
    return (u - 1024) / 1.5, 1.5 * u + 1024, 1.5 * max(b, u) + 1024


def within(estimate, bound, lo, hi, bound_hi):
    """Whether an answer lies in its reach, as answered: the estimate rounded to 0.1 MiB, the
    bound up to a whole MiB (a figure held at the reach's edge is within it)."""
    return lo - 0.05 <= estimate <= hi + 0.05 and bound <= math.ceil(bound_hi)


def adaptive_poisoning(port, rounds=30, per_post=250):
    """An attacker who sees the victims' estimates: each round it pushes the way that has moved
    them least so far (the README job at batch 1 observed at 40,000 MiB on a100-40gb, or at
    batch 16,384 observed 1 MiB above its floor), posting `per_post` observations without an
    environment and as many in the environment `attacker`. The victims (the README job at batch
    8, 256 and 2048 on a100-40gb, with no environment and in `attacker`) must stay within
    [(u - 1024) / 1.5, 1.5u + 1024] MiB of their uncalibrated estimate u, bound within
    1.5 max(b, u) + 1024 (in `attacker`: [0.5u, 2u + 3072], bound within 2 max(b, u) + 3072,
    [`reach`]). Then ten posts of a list with every catalogue card (a tiny job at its
    capacity): the README job's fit must flip on none."""
    job = example_job()
    statuses = collections.Counter()
    cards = [(g["id"], g["memory_mib"]) for g in call_json(port, "GET", "/v1/gpus")[1]["gpus"]]
    # the README job at its own batch on every card, before any poisoning
    readme_before = {}
    for card, _ in cards:
        for environment in (None, "attacker"):
            answer = estimate(port, dict(job, gpu=card, **({"environment": environment} if environment else {})))
            readme_before[(card, environment)] = (
                answer["memory"]["estimate_mib"],
                answer["memory"]["upper_bound_mib"],
                answer["fit"]["fits"],
                answer["calibration"]["profile_used"],
            )
    victims = []
    for batch in (8, 256, 2048):
        for environment in (None, "attacker"):
            victim_job = dict(job, batch_size=batch, gpu="a100-40gb")
            if environment:
                victim_job["environment"] = environment
            answer = estimate(port, victim_job)
            u, b = answer["memory"]["estimate_mib"], answer["memory"]["upper_bound_mib"]
            lo, hi, bound_hi = reach(u, b, environment)
            victims.append(
                {
                    "batch_size": batch,
                    "environment": environment,
                    "job": victim_job,
                    "u": u,
                    "b": b,
                    "lo": lo,
                    "hi": hi,
                    "bound_hi": bound_hi,
                    "min": u,
                    "max": u,
                    "max_bound": b,
                    "calibrated_at_start": answer["calibration"]["profile_used"],
                    "violations": [],
                }
            )
    up_job, down_job = dict(job, batch_size=1), dict(job, batch_size=16384)
    down_peak = job_floor(port, down_job) + 1
    pushes = {"up": observation(up_job, 40000), "down": observation(down_job, down_peak)}
    moved = {"up": 0.0, "down": 0.0}  # the furthest the victims went each way, in reach fractions
    history, limited = [], 0
    for round_ in range(rounds):
        direction = min(moved, key=lambda d: (moved[d], d != "up"))
        for environment in (None, "attacker"):
            push = dict(pushes[direction], **({"environment": environment} if environment else {}))
            status, answer = call_json(port, "POST", "/v1/calibration/observations", [push] * per_post)
            statuses[f"{status} {direction} {environment or 'no-env'}"] += 1
            limited += bool(answer and answer.get("limited"))
        worst = []
        for victim in victims:
            answer = estimate(port, victim["job"])
            m, b = answer["memory"]["estimate_mib"], answer["memory"]["upper_bound_mib"]
            victim["min"], victim["max"] = min(victim["min"], m), max(victim["max"], m)
            victim["max_bound"] = max(victim["max_bound"], b)
            if not within(m, b, victim["lo"], victim["hi"], victim["bound_hi"]):
                victim["violations"].append({"round": round_ + 1, "estimate_mib": m, "bound_mib": b})
            moved["up"] = max(moved["up"], (m - victim["u"]) / (victim["hi"] - victim["u"]))
            moved["down"] = max(moved["down"], (victim["u"] - m) / (victim["u"] - victim["lo"]))
            worst.append(round(m / victim["u"], 3))
        history.append({"round": round_ + 1, "push": direction, "estimate_over_u": worst})
    profiles = call_json(port, "GET", "/v1/calibration/profiles")[1]["profiles"]
    a100 = {
        p["environment"]: (round(p["offset_mib"], 1), round(p["scale"], 3), p["observations"])
        for p in profiles
        if p["gpu"] == "a100-40gb"
    }
    # every card at its capacity, ten times
    tiny = {"batch_size": 1, "layers": [{"kind": "linear", "output_size": 8, "params": 72}]}
    catalogue = [
        observation(tiny, memory, card, environment) for card, memory in cards for environment in (None, "attacker")
    ]
    for _ in range(10):
        status, _ = call_json(port, "POST", "/v1/calibration/observations", catalogue)
        statuses[f"{status} catalogue-at-capacity"] += 1
    flips, outside = [], []
    for (card, environment), (u, b, fits, _) in readme_before.items():
        answer = estimate(port, dict(job, gpu=card, **({"environment": environment} if environment else {})))
        m, bound = answer["memory"]["estimate_mib"], answer["memory"]["upper_bound_mib"]
        if fits and not answer["fit"]["fits"]:
            flips.append(f"{card}/{environment or 'no-env'}")
        lo, hi, bound_hi = reach(u, b, environment)
        if card != "a100-40gb" and not within(m, bound, lo, hi, bound_hi):
            outside.append(f"{card}/{environment or 'no-env'}: {u} -> {m} MiB (bound {b} -> {bound})")
    measured = {
        "rounds": rounds,
        "observations_per_post": per_post,
        "down_peak_mib": down_peak,
        "pushes": collections.Counter(h["push"] for h in history),
        "posts_limited": limited,
        "moved_fraction_of_reach": {d: round(v, 3) for d, v in moved.items()},
        "victims": [
            {
                "batch_size": v["batch_size"],
                "environment": v["environment"],
                "u_mib": v["u"],
                "reach_mib": [round(v["lo"], 1), round(v["hi"], 1)],
                "seen_mib": [v["min"], v["max"]],
                "bound_mib": v["b"],
                "max_bound_mib": v["max_bound"],
                "bound_reach_mib": round(v["bound_hi"], 1),
                "violations": v["violations"][:5],
            }
            for v in victims
        ],
        "a100_profiles_after": {
            str(k): {"offset_mib": v[0], "scale": v[1], "observations": v[2]} for k, v in a100.items()
        },
        "history": history,
        "catalogue_cards": len(cards),
        "fit_flips": flips,
        "cards_outside_reach": outside,
    }
    expect_statuses(statuses, {"200"})
    target(
        "victims calibrated by nothing before the attack",
        not any(v["calibrated_at_start"] for v in victims),
        f"{sum(v['calibrated_at_start'] for v in victims)} of {len(victims)} used a profile",
    )
    target(
        "poisoning: every victim within its reach after every round",
        not any(v["violations"] for v in victims),
        "; ".join(
            f"batch {v['batch_size']}/{v['environment'] or 'no-env'}: "
            f"{v['min']}..{v['max']} in [{v['lo']:.0f}, {v['hi']:.0f}]"
            f"{' VIOLATED' if v['violations'] else ''}"
            for v in victims
        ),
    )
    target(
        "catalogue at capacity: no README-job fit flips from true to false",
        not flips,
        f"{len(flips)} flips of {len(readme_before)} card/environment pairs: {flips or 'none'}",
    )
    target(
        "catalogue at capacity: every other card within its reach",
        not outside,
        f"{len(outside)} outside: {outside[:3] or 'none'}",
    )
    return statuses, measured


def idempotency_churn(port, calls=200, per_call=990, time_limit=240):
    """200 calls of 990 valid observations (the README job at its own estimate), each with a
    fresh Idempotency-Key; scaled down (and said so) past `time_limit` seconds."""
    job = dict(example_job(), gpu="a100-40gb")
    peak = estimate(port, job)["memory"]["estimate_mib"]
    body = json.dumps([observation(example_job(), peak)] * per_call).encode()
    statuses, run = collections.Counter(), f"{os.getpid()}-{time.time():.0f}"
    started, made = time.time(), 0
    for i in range(calls):
        if time.time() - started > time_limit:
            break
        status, _, _ = call(
            port, "POST", "/v1/calibration/observations", body, {"Idempotency-Key": f"churn-{run}-{i}"}, timeout=120
        )
        statuses[str(status)] += 1
        made += 1
    replay_status, _, replay_headers = call(
        port, "POST", "/v1/calibration/observations", body, {"Idempotency-Key": f"churn-{run}-0"}, timeout=120
    )
    measured = {
        "calls_planned": calls,
        "calls_made": made,
        "observations_per_call": per_call,
        "body_bytes": len(body),
        "seconds": round(time.time() - started, 1),
        "scaled_down": made < calls,
        "replay_of_the_first_key": f"{replay_status}, Idempotency-Replayed: "
        f"{replay_headers.get('idempotency-replayed')}",
    }
    expect_statuses(statuses, {"200"})
    target(
        "all planned calls made within the time limit",
        made == calls,
        f"{made} of {calls} calls in {measured['seconds']} s",
        asserted=False,
    )
    return statuses, measured


def profile_key_churn(port, environments_per_gpu=40):
    """One observation each on up to 40 environments on every catalogue GPU, until refused:
    at most 32 environments per GPU and 512 profiles in all."""
    metrics_before = len(call(port, "GET", "/metrics")[1])
    profiles_before = len(call_json(port, "GET", "/v1/calibration/profiles")[1]["profiles"])
    cards = [(g["id"], g["memory_mib"]) for g in call_json(port, "GET", "/v1/gpus")[1]["gpus"]]
    tiny = {"batch_size": 1, "layers": [{"kind": "linear", "output_size": 8, "params": 72}]}
    statuses, first, reasons, posts = collections.Counter(), {}, collections.Counter(), 0
    for card, _ in cards:
        for e in range(environments_per_gpu):
            posts += 1
            status, answer = call_json(
                port, "POST", "/v1/calibration/observations", observation(tiny, 1024, card, f"churn-{e}")
            )
            statuses[str(status)] += 1
            if status != 200:
                detail = (answer or {}).get("detail", "")
                kind = "total" if "512" in detail else "per-gpu" if "32" in detail else "other"
                reasons[kind] += 1
                first.setdefault(
                    kind,
                    {"post": posts, "gpu": card, "environment": f"churn-{e}", "status": status, "detail": detail[:300]},
                )
    profiles = call_json(port, "GET", "/v1/calibration/profiles")[1]["profiles"]
    per_gpu = collections.Counter(p["gpu"] for p in profiles if p["environment"])
    metrics_after = len(call(port, "GET", "/metrics")[1])
    measured = {
        "posts": posts,
        "profiles_before": profiles_before,
        "profiles_after": len(profiles),
        "most_environments_on_one_gpu": max(per_gpu.values(), default=0),
        "refusals_by_reason": dict(reasons),
        "first_refusal": first,
        "metrics_bytes": [metrics_before, metrics_after],
    }
    expect_statuses(statuses, {"200", "422"})
    target(
        "profiles bounded: at most 512 in all, 32 environments per GPU",
        len(profiles) <= 512 and max(per_gpu.values(), default=0) <= 32 and reasons,
        f"{len(profiles)} profiles, at most {max(per_gpu.values(), default=0)} environments "
        f"on one GPU; first refusals: "
        + "; ".join(f"{k} at post {v['post']} ({v['gpu']}/{v['environment']})" for k, v in first.items()),
    )
    created = len(profiles) - profiles_before
    target(
        "/metrics grows by less than 64 KB",
        metrics_after - metrics_before < 65536,
        f"{metrics_before} -> {metrics_after} bytes "
        f"({(metrics_after - metrics_before) / max(created, 1):.0f} bytes per profile created, "
        f"{created} created; bounded by the 512-profile limit)",
        asserted=False,
    )
    return statuses, measured


def store_bytes(port, posts=60, size=1_900_000, limit=32 * MIB):
    """60 valid observations whose job is padded with whitespace to ~1.9 MB, into a server
    started with --max-store-bytes 33554432."""
    server = CURRENT["server"]
    job = example_job()
    peak = estimate(port, dict(job, gpu="a100-40gb"))["memory"]["estimate_mib"]
    text = json.dumps(job)
    prefix = f'{{"gpu": "a100-40gb", "observed_peak_mib": {peak}, "job": {{'.encode()
    rest = (text[1:] + "}").encode()
    body = prefix + b" " * (size - len(prefix) - len(rest)) + rest
    statuses = collections.Counter()
    for _ in range(posts):
        statuses[str(call(port, "POST", "/v1/calibration/observations", body, timeout=120)[0])] += 1

    def sizes():
        path = os.path.join(server.data_dir, "gpucast.sqlite3")
        return {
            suffix or "db": os.path.getsize(path + suffix) if os.path.exists(path + suffix) else None
            for suffix in ("", "-wal")
        }

    running = sizes()
    profiles = call_json(port, "GET", "/v1/calibration/profiles")[1]["profiles"]
    kept = max((p["observations"] for p in profiles if p["gpu"] == "a100-40gb" and p["environment"] is None), default=0)
    measured = {
        "posts": posts,
        "body_bytes": len(body),
        "max_store_bytes": limit,
        "bytes_posted": posts * len(body),
        "observations_kept": kept,
        "sqlite_bytes": running["db"],
        "wal_bytes": running["-wal"],
    }
    expect_statuses(statuses, {"200"})
    on_disk = (running["db"] or 0) + (running["-wal"] or 0)
    target(
        "store on disk (sqlite + WAL) <= 2 x --max-store-bytes",
        on_disk <= 2 * limit,
        f"sqlite {running['db']} + WAL {running['-wal']} = {on_disk} bytes for {posts * len(body)} posted",
    )
    return statuses, measured


def wal_frames(path):
    with open(path, "rb") as handle:
        data = handle.read()
    if len(data) < 32:
        return data, 0, 0
    page = int.from_bytes(data[8:12], "big")
    return data, page, (len(data) - 32) // (24 + page) if page else 0


def store_faults(binary):
    """(a) 20 acknowledged observations, SIGKILL, a middle frame of the WAL damaged, restart:
    the service must say (on stderr) what SQLite's recovery drops and set the store aside.
    (b) the SQLite file overwritten with garbage: the service must set it aside and start."""
    CURRENT["attack"] = "store_faults"
    report = {"attack": "store_faults"}
    job = example_job()
    # (a)
    port = free_port()
    data_dir = f"/tmp/gpucast-adversarial-wal-{port}"
    shutil.rmtree(data_dir, ignore_errors=True)
    server = Server(binary, port, data_dir)
    peak = estimate(port, dict(job, gpu="a100-40gb"))["memory"]["estimate_mib"]
    acknowledged = sum(
        call(port, "POST", "/v1/calibration/observations", observation(job, peak + i))[0] == 200 for i in range(20)
    )
    server.stop(signal.SIGKILL)
    wal = os.path.join(data_dir, "gpucast.sqlite3-wal")
    a = {"acknowledged": acknowledged}
    if os.path.exists(wal):
        data, page, frames = wal_frames(wal)
        a.update({"wal_bytes": len(data), "page_size": page, "frames": frames})
        if frames >= 3:
            middle = frames // 2
            at = 32 + middle * (24 + page) + 24 + page // 2
            damaged = bytearray(data)
            for i in range(at, at + 64):
                damaged[i] ^= 0xFF
            with open(wal, "wb") as handle:
                handle.write(damaged)
            a["damaged_frame"] = middle
    else:
        a["wal_bytes"] = None
    log = os.path.join(data_dir, "..", f"gpucast-adversarial-wal-{port}.stderr")
    log = os.path.normpath(log)
    started = time.time()
    server = Server(binary, port, data_dir, log=log, must_start=False, ready_timeout=60)
    a["started"] = server.ready
    a["start_seconds"] = round(time.time() - started, 1)
    if server.ready:
        profiles = call_json(port, "GET", "/v1/calibration/profiles")[1]["profiles"]
        a["observations_counted"] = sum(
            p["observations"] for p in profiles if p["gpu"] == "a100-40gb" and p["environment"] is None
        )
    server.stop()
    with open(log, errors="replace") as handle:
        stderr = handle.read()
    os.remove(log)
    warning = [line for line in stderr.splitlines() if "which SQLite's recovery drops" in line]
    a["warning"] = warning[0][-400:] if warning else None
    a["damaged_dirs"] = {
        d: sorted(os.listdir(os.path.join(data_dir, d)))
        for d in sorted(os.listdir(data_dir))
        if d.startswith("damaged-")
    }
    report["wal_damaged_middle_frame"] = a
    target(
        "WAL damage: the store had a WAL of 3+ frames to damage",
        a.get("frames", 0) >= 3,
        f"{a.get('frames')} frames, {a.get('wal_bytes')} bytes",
    )
    target(
        "WAL damage: the warning ('which SQLite's recovery drops') reported on stderr",
        bool(warning),
        (warning[0][-200:] if warning else "absent"),
    )
    target(
        "WAL damage: the service started and the log was set aside in damaged-*",
        server.ready and bool(a["damaged_dirs"]),
        f"started {server.ready}, {a['damaged_dirs']}",
    )
    # (b)
    port = free_port()
    data_dir = f"/tmp/gpucast-adversarial-garbage-{port}"
    shutil.rmtree(data_dir, ignore_errors=True)
    server = Server(binary, port, data_dir)
    for i in range(3):
        call(port, "POST", "/v1/calibration/observations", observation(job, peak + i))
    server.stop()
    with open(os.path.join(data_dir, "gpucast.sqlite3"), "wb") as handle:
        handle.write(b"this is not a database, it is garbage\n" * 4096)
    log = f"/tmp/gpucast-adversarial-garbage-{port}.stderr"
    server = Server(binary, port, data_dir, log=log, must_start=False, ready_timeout=60)
    b = {"started": server.ready, "readyz": server.readyz}
    if server.ready:
        b["write_after"] = call(port, "POST", "/v1/calibration/observations", observation(job, peak))[0]
    server.stop()
    with open(log, errors="replace") as handle:
        stderr = handle.read()
    os.remove(log)
    error_lines = [line for line in stderr.splitlines() if "could not be read" in line]
    b["error_logged"] = error_lines[0][-300:] if error_lines else None
    b["damaged_dirs"] = {
        d: sorted(os.listdir(os.path.join(data_dir, d)))
        for d in sorted(os.listdir(data_dir))
        if d.startswith("damaged-")
    }
    report["garbage_store"] = b
    ready_ok = bool(server.readyz and server.readyz[0] == 200)
    target(
        "garbage store: the service started, /readyz 200, the file moved to damaged-*",
        server.ready and ready_ok and bool(b["damaged_dirs"]),
        f"started {server.ready}, /readyz {server.readyz}, {b['damaged_dirs']}",
    )
    print(json.dumps(report), flush=True)
    return report
