"""What a cluster's own runs teach the service about its stack, measured as a cluster meets it
(docs/reports/stack-learning.md).

Leave one framework out of public_training_memory.csv (its `framework` column, normalised by
[`framework_of`]): a fresh `gpucast serve` is started, k = 0, 1, 3, 5 of that framework's runs
are posted one by one to `POST /v1/calibration/observations` as observations of one
environment, and the framework's other runs are asked in that environment through `POST
/v1/estimate`. Each answer is compared like with like with what the run measured (allocated,
reserved or the device total: `decisions.like_with_like`). The observations are the runs'
peaks on the device's scale (what the run measured plus what the uncalibrated answer counts
beyond that measure, `decisions.on_device`), as the probe or nvidia-smi would report them.

Which runs are posted is drawn [`DRAWS`] times per k (seeded): the table gives the median over
the asked runs of every draw. Beside it, the floor of what learning can reach: the error left
by the best single factor per framework, fitted to all its runs (the median ratio).

    cd training && python -m gpucast_training stacks   # with the newest build of gpucast
    cd training && python -m gpucast_training stacks --from-data   # the page from its JSON
"""

import csv
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections import defaultdict

from . import pages, service
from .decisions import ROOT, like_with_like, on_device, rows, written_at

PAGE = ROOT / "docs/reports/stack-learning.md"
KS = (0, 1, 3, 5)
# The key of k = 0 with the framework's stack stated in the request.
STATED = "0, stack stated"
DRAWS = 5
CONFIDENCE = 0.95
TOKEN = "stack-learning"
# The card of a run whose card the source does not state: the largest common one, so that its
# peak is a reading the service accepts.
UNSTATED_CARD = "a100-80gb"
# Frameworks with fewer runs are left out: one observation and too few others to ask.
MIN_RUNS = 4
# The `stack` each framework's runs state in the "0, stack stated" row: the Hugging Face stacks
# the physics follows, the others by name, `other` for a framework with its own engine.
STACK_OF = {
    "hf-trainer": "transformers",
    "transformers-peft": "transformers",
    "ms-swift": "transformers",
    "accelerate-peft": "accelerate",
    "litgpt": "litgpt",
    "litgpt-thunder": "litgpt",
    "torchtune": "torchtune",
    "torchtitan": "torchtitan",
}


def framework_of(name):
    """The stack of a row's `framework` column: one name per framework and launcher (LitGPT's
    Thunder executors are a stack of their own: they compile the step)."""
    n = name.lower()
    rules = [
        ("thunder", "litgpt-thunder"),
        ("litgpt", "litgpt"),
        ("lit-gpt", "litgpt"),
        ("torchtitan", "torchtitan"),
        ("torchtune", "torchtune"),
        ("mmdetection", "mmdetection"),
        ("mmsegmentation", "mmsegmentation"),
        ("fsdp_qlora", "fsdp_qlora"),
        ("ms-swift", "ms-swift"),
        ("llama-factory", "llama-factory"),
        ("unsloth", "unsloth"),
        ("timm", "timm"),
        ("accelerate (+deepspeed) + peft", "accelerate-peft"),
        ("trainer", "hf-trainer"),
        ("peft", "transformers-peft"),
    ]
    for needle, stack in rules:
        if needle in n:
            return stack
    return "other"


def public_frameworks(csv_path):
    with open(csv_path, newline="") as f:
        return {i: framework_of(r["framework"]) for i, r in enumerate(csv.DictReader(f))}


def runs(csv_path):
    """One request per published run: from its config.json where one is committed (what
    schedulers send most), else describe's job; with its framework and its card."""
    frameworks = public_frameworks(csv_path)
    by_row = {}
    for r in rows():
        if not r["id"].startswith("public") or r["measured"] is None:
            continue
        row, detail = r["id"][len("public") :].split("/")
        rank = {"config": 0, "simulation": 1}.get(detail)
        if rank is None:
            continue
        if row not in by_row or rank < by_row[row][0]:
            by_row[row] = (rank, r)
    out = []
    for row, (_, r) in sorted(by_row.items(), key=lambda kv: int(kv[0])):
        request = dict(r["request"])
        request["gpu"] = r.get("card") or UNSTATED_CARD
        request.pop("environment", None)
        out.append(dict(r, row=int(row), framework=frameworks[int(row)], request=request))
    return out


class Serve:
    """A `gpucast serve` on a free loopback port with its own store, writes open to TOKEN."""

    def __init__(self, binary):
        self.dir = tempfile.mkdtemp(prefix="gpucast-stacks-")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.process = subprocess.Popen(
            [binary, "serve", "--listen", f"127.0.0.1:{self.port}", "--no-nvml", "--data-dir", self.dir],
            cwd=ROOT,
            env=dict(os.environ, GPUCAST_TOKEN=TOKEN, GPUCAST_PROFILE_REFRESH_SECS="1"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=1) as r:
                    if r.status == 200:
                        return
            except Exception:
                time.sleep(0.2)
        self.stop()
        raise SystemExit("gpucast serve did not become ready")

    def call(self, path, body, token=False):
        headers = {"content-type": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {TOKEN}"
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(), headers=headers, method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def estimate(server, run, environment=None, stack=None):
    request = dict(run["request"], confidence=CONFIDENCE)
    if environment:
        request["environment"] = environment
    if stack:
        request["stack"] = stack
    status, answer = server.call("/v1/estimate", request)
    return answer if status == 200 else None


def observe(server, run, device_peak, environment):
    body = {
        "gpu": run["request"]["gpu"],
        "job": {k: v for k, v in run["request"].items() if k != "gpu"},
        "observed_peak_mib": round(device_peak, 1),
        "environment": environment,
    }
    status, answer = server.call("/v1/calibration/observations", body, token=True)
    return status == 200, answer


def score(run, answer):
    figure, bound, _, _ = like_with_like(run, answer)
    return abs(figure / run["measured"] - 1.0), run["measured"] > bound, bound / figure, figure


def evaluate(binary, framework, members):
    """{k: [(error, above, width), ...]} over every draw, and the skipped observations."""
    server = Serve(binary)
    out = defaultdict(list)
    basis = defaultdict(lambda: defaultdict(int))
    refused = 0
    try:
        plain = {}
        for run in members:
            answer = estimate(server, run)
            if answer is not None:
                plain[run["row"]] = answer
        members = [r for r in members if r["row"] in plain]
        for run in members:
            out[0].append(score(run, plain[run["row"]])[:3])
            basis[0][plain[run["row"]]["memory"]["uncertainty"].get("basis", "-")] += 1
            stated = estimate(server, run, stack=STACK_OF.get(framework, "other"))
            if stated is not None:
                out[STATED].append(score(run, stated)[:3])
                basis[STATED][stated["memory"]["uncertainty"]["basis"]] += 1
        for k in KS[1:]:
            if k >= len(members):
                continue
            for draw in range(DRAWS):
                order = list(members)
                random.Random(f"{framework}/{draw}").shuffle(order)
                environment = f"lofo-{framework}-{k}-{draw}"[:64]
                observed = []
                for run in order:
                    if len(observed) == k:
                        break
                    ok, _ = observe(server, run, on_device(run, plain[run["row"]]), environment)
                    if ok:
                        observed.append(run["row"])
                    else:
                        refused += 1
                time.sleep(1.2)  # one refresh of the profiles
                for run in members:
                    if run["row"] in observed:
                        continue
                    answer = estimate(server, run, environment)
                    if answer is not None:
                        out[k].append(score(run, answer)[:3])
                        basis[k][answer["memory"]["uncertainty"].get("basis", "-")] += 1
    finally:
        server.stop()
    return out, basis, refused


def single_factor_floor(binary, members):
    """The median error left by the best single factor (the median ratio) over all runs."""
    answers = service.run_batch("estimate", [dict(r["request"], confidence=CONFIDENCE) for r in members], (), binary)
    ratios, pairs = [], []
    for run, item in zip(members, answers):
        answer = item.get("estimate")
        if answer is None:
            continue
        figure = like_with_like(run, answer)[0]
        ratios.append(run["measured"] / figure)
        pairs.append((run["measured"], figure))
    if not ratios:
        return None
    factor = statistics.median(ratios)
    return statistics.median(abs(factor * f / m - 1.0) for m, f in pairs)


def run(layout, threads=None):
    del threads
    binary = service.binary()
    members_of = defaultdict(list)
    for r in runs(layout.public_csv):
        members_of[r["framework"]].append(r)
    lines = []
    for framework, members in sorted(members_of.items()):
        if len(members) < MIN_RUNS or framework == "other":
            continue
        results, basis, refused = evaluate(binary, framework, members)
        floor = single_factor_floor(binary, members)
        for k in (0, STATED, *KS[1:]):
            if not results.get(k):
                continue
            errors = [e for e, _, _ in results[k]]
            above = sum(a for _, a, _ in results[k])
            widths = [w for _, _, w in results[k]]
            lines.append(
                dict(
                    framework=framework,
                    runs=len(members),
                    k=k,
                    asked=len(errors),
                    median_error=statistics.median(errors),
                    above=above / len(errors),
                    width=statistics.median(widths),
                    floor=floor,
                    basis=dict(basis[k]),
                    refused=refused,
                )
            )
        print(json.dumps([x for x in lines if x["framework"] == framework]), flush=True)
    write_report(lines)


def write_report(lines):
    out = [
        "# Stack learning: leave one framework out, through the service",
        "",
        "Written by `cd training && python -m gpucast_training stacks` (training/gpucast_training/stacks.py) on "
        f"{written_at()}. Do not edit by hand.",
        "",
        "For each framework of public_training_memory.csv (its `framework` column, normalised), a fresh",
        "`gpucast serve` is started; k of its runs are posted one by one to",
        "`POST /v1/calibration/observations` as observations of one environment (their peaks on the",
        "device's scale), and its other runs are asked in that environment (`POST /v1/estimate`),",
        f"compared like with like with what they measured. k > 0 is drawn {DRAWS} times (seeded); each",
        "cell is over the asked runs of every draw. *floor*: the median error the best single factor",
        "per framework leaves (the median ratio over all its runs), the least learning can reach;",
        "*target*: the issue's bound after 3 observations, max(5 %, 1.25 x floor). *basis*: what",
        "the answers' bounds rested on (`memory.uncertainty.basis`). *0, stack stated*: no observation, the",
        "request's `stack` the framework's (transformers, accelerate, litgpt, torchtune, else other).",
        "",
        "## Every framework and k",
        "",
        "| framework | runs | k | asked | median error | above the 0.95 bound | median bound / figure | floor | target at k = 3 | basis |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for x in lines:
        floor = x["floor"]
        target = max(0.05, 1.25 * floor) if floor is not None else None
        basis = ", ".join(f"{b} {n}" for b, n in sorted(x["basis"].items()))
        out.append(
            f"| {x['framework']} | {x['runs']} | {x['k']} | {x['asked']} | {100 * x['median_error']:.1f} % | "
            f"{100 * x['above']:.1f} % | {x['width']:.2f} | "
            + (f"{100 * floor:.1f} %" if floor is not None else "-")
            + " | "
            + (f"{100 * target:.1f} %" if target is not None else "-")
            + f" | {basis} |"
        )
    out.append("")
    print(pages.write(PAGE, "\n".join(out), {}, "stacks", summary))


def summary(sections):
    """The median error by k, a line per framework, from the full table."""
    full = pages.table("Every framework and k", sections)
    col = {name: i for i, name in enumerate(full["columns"])}
    ks = [str(k) for k in KS[:1]] + [STATED] + [str(k) for k in KS[1:]]
    by = defaultdict(dict)
    for row in full["rows"]:
        by[row[col["framework"]]][row[col["k"]]] = row
    rows, met = [], 0
    for framework, cells in by.items():
        first = next(iter(cells.values()))
        target, at3 = first[col["target at k = 3"]], cells.get("3")
        if at3 is not None and target != "-":
            met += float(at3[col["median error"]].rstrip(" %")) <= float(target.rstrip(" %"))
        rows.append(
            [framework, first[col["runs"]], first[col["floor"]], target]
            + [cells[k][col["median error"]] if k in cells else "-" for k in ks]
        )
    return [
        "Median error of the asked runs by the number k of the framework's runs observed "
        f"(*stated*: k = 0 with the request's `stack`); k = 3 meets its target for {met} of {len(rows)} "
        "frameworks. The bounds' coverage and width and the answers' basis, for every k: the JSON.",
        pages.markdown_table(
            ["framework", "runs", "floor", "target at k = 3", "k = 0", "stated", "k = 1", "k = 3", "k = 5"], rows
        ),
    ]


def render(layout=None):
    """`stacks --from-data`: the page again from docs/reports/stack-learning.json."""
    print(pages.render(PAGE, {}, "stacks", summary))
