"""Attacks on the admission webhook (`POST /v1/kubernetes/admission`, the suite's server runs
with --admission): objects whose shape would make the answer, not the body, large."""

import base64
import collections
import json

from harness import call

from .suite import CURRENT, MIB, example_job, target

ANSWER_LIMIT_BYTES = 1_000_000
CPU_LIMIT_SECONDS = 1.0
RSS_GROWTH_LIMIT_MIB = 100


def review(object_, operation="CREATE"):
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "operation": operation,
            "object": object_,
        },
    }


def pod_with_terms(terms):
    """A pod annotated with the tiny MLP job, its required node affinity holding `terms`."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "train", "annotations": {"gpucast.dev/job": json.dumps(example_job())}},
        "spec": {
            "containers": [{"name": "t", "image": "t:1", "resources": {"limits": {"nvidia.com/gpu": 1}}}],
            "affinity": {
                "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}
            },
        },
    }


def node_selector_flood(port):
    """AdmissionReviews whose pod holds N empty node selector terms (`[{}] * N`: 200,000 and
    520,000), then 64 terms each of one requirement (the most placed). Each answered or refused
    within 1 s of server CPU, in at most 1 MB, RSS growing at most 100 MiB."""
    server = CURRENT["server"]
    statuses, measured = collections.Counter(), {}
    cases = [
        ("200k_empty_terms", [{}] * 200_000),
        ("520k_empty_terms", [{}] * 520_000),
        ("64_terms", [{"matchExpressions": [{"key": f"zone{i}", "operator": "Exists"}]} for i in range(64)]),
    ]
    for name, terms in cases:
        body = json.dumps(review(pod_with_terms(terms))).encode()
        rss_before, cpu_before = server.rss_mib(), server.cpu_seconds()
        status, answer, _ = call(port, "POST", "/v1/kubernetes/admission", body, timeout=60)
        cpu = server.cpu_seconds() - cpu_before
        rss_growth = server.memory()["rss_mib"] - rss_before
        try:
            response = json.loads(answer)["response"]
        except (ValueError, KeyError, TypeError):
            response = {}
        outcome = (
            "placed"
            if response.get("allowed") and response.get("patch")
            else f"denied {response.get('status', {}).get('code')}"
            if response.get("allowed") is False
            else "allowed"
        )
        patch_bytes = len(base64.b64decode(response["patch"])) if response.get("patch") else 0
        statuses[f"{status} {outcome}"] += 1
        measured[name] = {
            "body_bytes": len(body),
            "status": status,
            "outcome": outcome,
            "answer_bytes": len(answer),
            "patch_bytes": patch_bytes,
            "server_cpu_s": round(cpu, 2),
            "rss_growth_mib": round(rss_growth, 1),
        }
        target(
            f"{name}: answered or refused in <= {CPU_LIMIT_SECONDS} s CPU, <= 1 MB, RSS +{RSS_GROWTH_LIMIT_MIB} MiB",
            status == 200
            and cpu <= CPU_LIMIT_SECONDS
            and len(answer) <= ANSWER_LIMIT_BYTES
            and rss_growth <= RSS_GROWTH_LIMIT_MIB,
            f"{status} {outcome}, {len(answer)} bytes, {cpu:.2f} s CPU, RSS {rss_growth:+.1f} MiB",
        )
    target(
        "the flood is refused, the 64 terms placed",
        measured["200k_empty_terms"]["outcome"].startswith("denied")
        and measured["520k_empty_terms"]["outcome"].startswith("denied")
        and measured["64_terms"]["outcome"] == "placed",
        {k: v["outcome"] for k, v in measured.items()},
    )
    measured["answer_limit_mib"] = round(ANSWER_LIMIT_BYTES / MIB, 2)
    return statuses, measured
