"""models/manifest.json and tests/fixtures/golden_features.json: how every stage writes its part.

Standard library only. Each stage replaces its own estimators (by name) and top-level blocks in
the manifest the earlier stages wrote, and the golden fixture's cases are built by one function
(`golden_case`) from the manifest entries whose inputs they pin.
"""

import datetime
import hashlib
import json

from . import features as gf


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def utc_now():
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()


def read_json(path):
    with open(path) as handle:
        return json.load(handle)


def write_json(path, value, indent=1, newline=True, separators=None):
    with open(path, "w") as handle:
        json.dump(value, handle, indent=indent, separators=separators)
        if newline:
            handle.write("\n")


def replace_estimators(manifest, names, entries):
    """The manifest's estimators without those named `names`, then `entries` (in place)."""
    manifest["estimators"] = [e for e in manifest["estimators"] if e["name"] not in set(names)] + list(entries)
    return manifest


def write_manifest(path, manifest):
    """Stamps `generated_at` and writes the manifest."""
    manifest["generated_at"] = utc_now()
    write_json(path, manifest)


def estimators_by_name(manifest):
    return {entry["name"]: entry for entry in manifest["estimators"]}


def golden_case(name, job, aggregate_entries, kind_vocab, token_entries, extra_aggregate=None):
    """One case of the golden fixture: the job, its raw aggregate features, the normalised
    aggregate vector, kind ids and token features (N = 1, no padding), and, when given, the
    aggregate vectors of further estimators (`extra_aggregate`: name -> feature entries)."""
    case = {
        "name": name,
        "job": job,
        "raw_aggregate": gf.raw_aggregate_features(job),
        "aggregate": gf.aggregate_vector(job, aggregate_entries),
        "kind_ids": gf.kind_ids(job, kind_vocab),
        "token_features": gf.token_vectors(job, token_entries),
    }
    if extra_aggregate is not None:
        case["extra_aggregate"] = {
            extra: gf.aggregate_vector(job, entries) for extra, entries in extra_aggregate.items()
        }
    return case


def manifest_golden_case(name, job, estimators, by_name):
    """golden_case with the inputs of the fixture's named estimators (`estimators`: {"aggregate",
    "sequence", "extra_aggregate"}) as the manifest (`by_name`) has them."""
    sequence = by_name[estimators["sequence"]]["input"]
    return golden_case(
        name,
        job,
        by_name[estimators["aggregate"]]["input"]["features"],
        sequence["kind_vocab"],
        sequence["token_features"],
        {extra: by_name[extra]["input"]["features"] for extra in estimators.get("extra_aggregate", [])},
    )
