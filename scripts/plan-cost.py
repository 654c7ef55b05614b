"""What `POST /v1/plan` costs against single estimates, and whether it agrees with them.

    python3 scripts/plan-cost.py BINARY [--rounds N]

On a served BINARY: QLoRA of Llama-3-8B on an RTX 4090 at 2048 tokens (micro-batch 1, the
README's job with all-linear targets). It bisects the largest micro-batch that fits by hand
over POST /v1/estimate, asks POST /v1/plan (setups off, then on), and times each request over
N rounds, interleaved so that a noisy machine slows both alike. Prints the plan's answer, the
hand bisection's, the estimates each plan made, and the median wall time of each request and
of a plan over a single estimate's.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

CONFIG = "tests/fixtures/transformer_configs/public/meta-llama__Meta-Llama-3-8B.json"


def job():
    with open(os.path.join(harness.ROOT, CONFIG)) as f:
        config = json.load(f)
    return {
        "transformer_config": config,
        "seq_len": 2048,
        "batch_size": 1,
        "precision": "bf16",
        "activation_checkpointing": "full",
        "lora": {"rank": 16, "alpha": 32, "target_modules": "all-linear", "base_weights": "nf4"},
        "gpu": "rtx-4090",
    }


def fits(port, base, m):
    at = dict(base, micro_batch_size=m, batch_size=m)
    status, answer = harness.call_json(port, "POST", "/v1/estimate", at)
    assert status == 200, answer
    return answer["fit"]["fits"]


def bisected(port, base, high):
    low = 1
    while high - low > 1:
        middle = (low + high) // 2
        if fits(port, base, middle):
            low = middle
        else:
            high = middle
    return low


def timed(port, path, body):
    started = time.perf_counter()
    status, answer = harness.call_json(port, "POST", path, body)
    assert status == 200, answer
    return (time.perf_counter() - started) * 1000.0, answer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("binary")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    port = harness.free_port()
    # Every estimate computed: the single estimates timed repeat one body, which the memo
    # would answer without estimating.
    server = harness.Server(args.binary, port, extra_args=["--answer-memo-mib", "0"])
    try:
        base = job()
        hand = bisected(port, base, 65)
        without = {"job": base, "setups": False}
        with_setups = {"job": base}
        for _ in range(3):  # warm up
            timed(port, "/v1/estimate", base)
            timed(port, "/v1/plan", without)
        single, plan, plan_setups = [], [], []
        for _ in range(args.rounds):
            single.append(timed(port, "/v1/estimate", base)[0])
            ms, answer = timed(port, "/v1/plan", without)
            plan.append(ms)
            ms, answer_setups = timed(port, "/v1/plan", with_setups)
            plan_setups.append(ms)
        row = answer["cards"][0]
        one = statistics.median(single)
        print(f"commit {harness.commit()}, {args.rounds} rounds, median wall time per request")
        print(f"hand bisection over /v1/estimate: largest micro-batch {hand}")
        print(
            f"/v1/plan: largest micro-batch {row['largest_micro_batch']} on {row['gpu']} "
            f"at {answer['confidence']} (bound {row['at_largest']['upper_bound_mib']} MiB)"
        )
        print(f"/v1/estimate: {one:.2f} ms")
        for name, times, made in [
            ("/v1/plan, setups off", plan, answer["estimates"]),
            ("/v1/plan, setups on", plan_setups, answer_setups["estimates"]),
        ]:
            median = statistics.median(times)
            print(f"{name}: {median:.2f} ms, {made} estimates, {median / one:.1f} single estimates' time")
        if abs(row["largest_micro_batch"] - hand) > 1:
            raise SystemExit("the plan disagrees with the bisection by more than one step")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
