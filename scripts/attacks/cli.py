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
