"""The CLI fed an oversized file."""

import json
import os
import resource
import subprocess
import time


from .suite import CURRENT, MIB, RSS_PEAK_TARGET_MIB, ROOT, target


def cli_oversized_input(binary, size=50 * MIB):
    """`gpucast estimate` on a 50 MB file: it must read at most --max-body-bytes and exit 1."""
    CURRENT["attack"] = "cli_oversized_input"
    path = f"/tmp/gpucast-adversarial-{os.getpid()}-50MB.json"
    with open(path, "wb") as handle:  # in 1 MiB pieces: this process stays small (see below)
        handle.write(b'{"batch_size": 1, "model": "')
        for _ in range(size // MIB - 1):
            handle.write(b"a" * MIB)
        handle.write(b"a" * (size % MIB + MIB - 40) + b'"}\n')
    # Linux keeps a process's high-water RSS across exec, and the child starts as this
    # interpreter (vfork): the child's figure is at least this process's own peak so far.
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    started = time.time()
    child = subprocess.Popen([binary, "estimate", path], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        stdout, stderr = child.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        child.kill()
        stdout, stderr = child.communicate()
    seconds = time.time() - started
    children_maxrss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    os.remove(path)
    stderr_text = stderr.decode(errors="replace").strip()
    report = {
        "attack": "cli_oversized_input",
        "file_bytes": size,
        "exit_code": child.returncode,
        "seconds": round(seconds, 2),
        "stderr": stderr_text[-400:],
        "stdout_bytes": len(stdout),
        "max_rss_mib": round(children_maxrss / 1024, 1),
        "rusage_children_before_mib": round(before / 1024, 1),
        "this_interpreter_max_rss_mib": round(own / 1024, 1),
    }
    print(json.dumps(report), flush=True)
    target(
        "the CLI refused: exit 1 with 'larger than --max-body-bytes'",
        child.returncode == 1 and "larger than --max-body-bytes" in stderr_text,
        f"exit {child.returncode} in {seconds:.2f} s: {stderr_text[-160:]}",
    )
    target(
        f"CLI max RSS <= {RSS_PEAK_TARGET_MIB} MiB",
        children_maxrss / 1024 <= RSS_PEAK_TARGET_MIB,
        f"{children_maxrss / 1024:.1f} MiB "
        "(RUSAGE_CHILDREN, before any other child was reaped; it includes up to "
        f"{own / 1024:.1f} MiB of this interpreter's pre-exec image)",
    )
    return report


def cli_hub_cache(binary):
    """`gpucast estimate --config org/m` with HF_HUB_OFFLINE=1 on a Hugging Face cache whose
    config.json is a sparse 3 GB file; then on caches whose refs/main is an absolute path out
    of the cache, and whose snapshot's config.json links out of it. Refused in under 1 s of
    CPU, and nothing outside the cache root is read (the outside config is a valid one: read,
    it would be answered)."""
    import shutil
    import tempfile

    CURRENT["attack"] = "cli_hub_cache"
    base = tempfile.mkdtemp(prefix="gpucast-adversarial-hub-")
    outside = os.path.join(base, "outside")
    os.makedirs(outside)
    valid = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 100, "n_positions": 128}
    with open(os.path.join(outside, "config.json"), "w") as handle:
        json.dump(valid, handle)

    def cache(name, revision, config):
        root = os.path.join(base, name)
        folder = os.path.join(root, "models--org--m")
        os.makedirs(os.path.join(folder, "refs"))
        os.makedirs(os.path.join(folder, "snapshots", "abc123"))
        with open(os.path.join(folder, "refs", "main"), "w") as handle:
            handle.write(revision)
        config(os.path.join(folder, "snapshots", "abc123", "config.json"))
        return root

    def sparse(path):
        with open(path, "wb") as handle:
            handle.truncate(3 << 30)

    cases = {
        "sparse_3GB_config": cache("sparse", "abc123", sparse),
        "absolute_ref": cache("absolute", outside, lambda path: None),
        "symlink_out": cache("symlink", "abc123", lambda path: os.symlink(os.path.join(outside, "config.json"), path)),
    }
    results = {}
    for name, root in cases.items():
        env = dict(os.environ, HF_HUB_CACHE=root, HF_HUB_OFFLINE="1")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        child = subprocess.run(
            [binary, "estimate", "--config", "org/m", "--seq-len", "128", "--batch-size", "1"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            timeout=120,
        )
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        results[name] = {
            "exit_code": child.returncode,
            "cpu_seconds": round(cpu, 3),
            # the temporary cache's path named as such: the report holds no machine paths
            "stderr": child.stderr.decode(errors="replace").replace(base, "$TMP").strip()[-200:],
        }
        target(
            f"{name}: refused (exit 1, nothing outside the cache read) in under 1 s of CPU",
            child.returncode == 1 and cpu < 1,
            f"exit {child.returncode}, {cpu:.3f} s CPU: {results[name]['stderr'][-120:]}",
        )
    shutil.rmtree(base, ignore_errors=True)
    report = {"attack": "cli_hub_cache", "cases": results}
    print(json.dumps(report), flush=True)
    return report
