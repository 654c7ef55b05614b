"""models/manifest.json: how every stage writes its part.

Standard library only. Each stage replaces its own estimators (by name) and top-level blocks in
the manifest the earlier stages wrote.
"""

import datetime
import hashlib
import json


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
