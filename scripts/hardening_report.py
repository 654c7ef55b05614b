"""The adversarial suite's report writer: load-tests/adversarial.json (every attack's report and
every target) and docs/reports/hardening.md (the generated page), from what the attacks
(scripts/attacks/) returned and recorded. `python3 scripts/hardening_report.py [REPORT.json]`
renders the page again from a recorded report without running the suite."""

import datetime
import json
import os
import re
import sys
import tempfile

from harness import commit
from attacks.suite import RSS_PEAK_TARGET_MIB, RSS_SETTLE_MARGIN_MIB, TARGETS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "reports", "hardening.md")


SENT = {
    "batch_flood_8x2MiB": "8 concurrent POST /v1/estimate/batch of ~2 MiB (256-layer jobs)",
    "slow_bodies_520": "520 sockets: Content-Length 100000, 15 bytes of body, then silence",
    "content_length_1e12_x20": "20 concurrent headers declaring Content-Length 10^12",
    "odd_methods_2000": "2,000 requests with distinct made-up methods (M0ETHOD, M1ETHOD, ...)",
    "half_sent_headers_200": "200 sockets sending half a request header, then silence",
    "poison_calibration_40": "20 observations of a 1 MiB peak, 20 of 10,000,000 MiB",
    "watch_flood_4000": "4,000 POST /v1/calibration/watch (no GPU on this host)",
    "held_bodies_600x2MiB": "600 sockets: Content-Length 2097152, 2 MiB minus 8 bytes of body, then silence",
    "cpu_bomb_4x16gpu": "4 concurrent module prints of 4095 x Linear(3e6, 3e6), batch 8, 16 GPU ids",
    "cross_site_writes": "POST to both write routes with no Content-Type, text/plain, Origin "
    "http://evil.example, Sec-Fetch-Site cross-site, Host evil.example:PORT",
    "unknown_field_echo": "POST /v1/estimate whose one unknown key is 1.5 MB long",
    "adaptive_poisoning": "30 rounds of 2 x 250 observations pushing the README job's profile the way "
    "it moved least (batch 1 at 40,000 MiB or batch 16,384 at its floor + 1), "
    "without and with environment `attacker`; then 10 lists of every card at capacity",
    "idempotency_churn_200x990": "200 calls of 990 valid observations, each with a fresh Idempotency-Key",
    "profile_key_churn": "single observations on 40 environments of every catalogue GPU",
    "store_bytes": "60 valid observations padded with whitespace to ~1.9 MB, "
    "to a server with --max-store-bytes 33554432",
    "store_faults": "(a) 20 observations, SIGKILL, bytes flipped in a middle WAL frame, restart; "
    "(b) gpucast.sqlite3 overwritten with garbage, restart",
    "cli_oversized_input": "`gpucast estimate` on a 50 MB file",
    "cli_hub_cache": "`gpucast estimate --config org/m`, HF_HUB_OFFLINE=1, on caches holding a sparse 3 GB "
    "config.json, a refs/main naming an absolute path out of the cache, a config.json linked out of it",
    "sigterm_with_half_sent_header": "SIGTERM while a socket holds half a request header",
    "one_byte_chunks_150x65000": "150 sockets: a chunked POST of 65,000 one-byte chunks each, held unfinished",
    "one_address_1100_idle": "1,100 idle sockets from 127.0.0.2, reopened as they are closed, while 127.0.0.1 "
    "sends 20 GET /v1/gpus one after another",
    "tls_half_open_1100": "a TLS port: 1,100 sockets from 127.0.0.2 each sending a ClientHello's 5-byte "
    "record header and stopping, reopened as they are closed, while 127.0.0.1 sends 20 HTTPS GET /v1/gpus",
    "admission_node_selector_flood": "AdmissionReviews of a pod annotated with the README job whose required "
    "node affinity holds [{}] x 200,000 and x 520,000 terms, then 64 one-requirement terms",
}


# A temporary file's or folder's path (a store, a damaged copy, an oversized input): named by
# what it is, never by where this machine put it.
TEMPORARY = re.compile(re.escape(tempfile.gettempdir().rstrip("/")) + r"/gpucast-[^\s\"',;:)]*")


def scrub(text):
    """`text` without this machine's paths: temporary ones as `$TMP/...`, the checkout's
    relative to it."""
    text = TEMPORARY.sub("$TMP/...", text)
    return text.replace(ROOT + os.sep, "")


def brief(value, limit=400):
    text = value if isinstance(value, str) else json.dumps(value, separators=(", ", ": "))
    text = scrub(text)
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def came_back(report):
    """What came back, in a line: statuses and the attack's own measurements."""
    keep = {
        k: v
        for k, v in report.items()
        if k
        not in (
            "attack",
            "seconds",
            "attacker_statuses",
            "measured",
            "rss_before_mib",
            "rss_peak_mib",
            "rss_after_mib",
            "legitimate",
            "healthz_failures",
        )
    }
    measured = dict(report.get("measured") or {})
    measured.pop("history", None)
    measured.pop("answers", None)
    if "victims" in measured:  # one line per victim: u, the range seen, the reach
        measured["victims"] = [
            f"batch {v['batch_size']}/{v['environment'] or 'no-env'}: u {v['u_mib']}, seen "
            f"{v['seen_mib'][0]}..{v['seen_mib'][1]} in [{v['reach_mib'][0]}, {v['reach_mib'][1]}], "
            f"bound up to {v['max_bound_mib']} of {v['bound_reach_mib']}"
            f"{', VIOLATED' if v['violations'] else ''}"
            for v in measured["victims"]
        ]
    parts = []
    if "attacker_statuses" in report:
        parts.append(f"statuses {brief(report['attacker_statuses'], 300)}")
    if measured:
        parts.append(brief(measured, 1600))
    if keep:
        parts.append(brief(keep, 1600))
    return "; ".join(parts)


def write_page(path, command, binary, reports, failed, at=None, targets=None, written=None, cores=None):
    """The page: a head, one line per attack, the targets missed; every attack's report and
    every target stay in load-tests/adversarial.json. `at`: the commit measured (taken before
    anything was written, so that the report's own files do not mark it changed), else the
    checkout's now; `targets`: the recorded targets (TARGETS, those this run checked, by
    default); `written`, `cores`: when and on how many cores the suite ran (now, here)."""
    at = at or commit()
    targets = TARGETS if targets is None else targets
    written = written or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Hardening: what the adversarial suite measured",
        "",
        f"Written by `{command}` on {written} at commit `{at}`, against `{binary}` on a "
        f"{cores or os.cpu_count()}-core machine. Do not edit by hand; run the command again "
        "(`python3 scripts/hardening_report.py` renders this page again from the committed "
        "[load-tests/adversarial.json](../../load-tests/adversarial.json), which holds what each "
        "attack got back and every target with its measurement; what each sends: `SENT` in "
        "scripts/hardening_report.py, the attacks in scripts/attacks/).",
        "",
        f"Targets: peak RSS <= {RSS_PEAK_TARGET_MIB} MiB under every attack and back within "
        f"{RSS_SETTLE_MARGIN_MIB} MiB of the baseline afterwards; the legitimate client (its own "
        "process, one estimate every 20 ms) sees no errors and /healthz never fails; each attack's "
        "own targets (in the JSON). Legitimate p99 <= 50 ms is reported, not asserted.",
        "",
        f"**{'All asserted targets met.' if not failed else f'{len(failed)} asserted target(s) failed.'}**",
        "",
    ]
    if failed:
        lines += [f"- FAILED: {t['attack']}: {t['target']} ({brief(t['measured'], 300)})" for t in failed]
        lines.append("")
    lines += [
        "| attack | peak RSS MiB (before, after) | legitimate p99 ms, errors | targets met |",
        "| --- | --- | --- | --- |",
    ]
    for report in reports:
        name = report["attack"]
        if "rss_peak_mib" in report:
            rss = f"{report['rss_peak_mib']} ({report['rss_before_mib']}, {report['rss_after_mib']})"
        elif "max_rss_mib" in report:
            rss = f"{report['max_rss_mib']} (the CLI)"
        else:
            rss = "- (own servers)"
        legitimate = report.get("legitimate")
        client = f"{legitimate['p99_ms']}, {len(legitimate['errors'] or {})}" if legitimate else "-"
        own = [t for t in targets if t["attack"] == name]
        met = sum(t["passed"] for t in own)
        lines.append(f"| {name} | {rss} | {client} | {met} of {len(own)} |")
    missed = [t for t in targets if not t["passed"]]
    if missed:
        lines += ["", "Missed:", ""]
        lines += [
            f"- {t['attack']}: {t['target']} ({'asserted' if t['asserted'] else 'reported only'}): "
            f"{brief(t['measured'], 300)}"
            for t in missed
        ]
    lines.append("")
    with open(path, "w") as handle:
        handle.write("\n".join(lines))


def write_report(out, command, binary, suite_seconds, reports, failed, at=None):
    """load-tests/adversarial.json (or `out`): every attack's report, every target, the failed ones."""
    text = json.dumps(
        {
            "binary": binary,
            "command": command,
            "commit": at or commit(),
            "cores": os.cpu_count(),
            "written": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "suite_seconds": suite_seconds,
            "attacks": reports,
            "targets": TARGETS,
            "failed_targets": [f"{t['attack']}: {t['target']}" for t in failed],
        },
        indent=1,
    )
    with open(out, "w") as handle:
        handle.write(scrub(text) + "\n")


def main():
    """Renders the page again from a committed report (load-tests/adversarial.json by default)."""
    source = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "load-tests", "adversarial.json")
    with open(source) as handle:
        report = json.load(handle)
    failed = [t for t in report["targets"] if t["asserted"] and not t["passed"]]
    write_page(
        PAGE,
        report["command"],
        report["binary"],
        report["attacks"],
        failed,
        at=report["commit"],
        targets=report["targets"],
        written=report["written"],
        cores=report["cores"],
    )
    print(f"page: {os.path.relpath(PAGE, os.getcwd())}")


if __name__ == "__main__":
    main()
