"""The harness the scripts share: a `gpucast serve` on a free loopback port with its own data
directory, started, waited for (the time it took), measured (memory, CPU) and stopped (the time
that took), and calls to it (plain, JSON, or written by hand). Stdlib only. The scripts of this
folder import it from their own folder (adversarial.py, health-flood.py, request-cpu.py,
write-cost.py, answers-unchanged.py, floor-bench.py); the load test, run as a module from the
repository root (`python3 -m load-tests.run`), as `scripts.harness`.
"""

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIRS = []  # data directories this run created under /tmp, removed at the end


def commit():
    """The commit the checkout is at (with `+` when it has uncommitted changes)."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        ).stdout.strip()
        return sha + ("+" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _says_ready(body):
    """GET /readyz's 200 body says {"ready": true} (a body that is no JSON object: ready)."""
    try:
        answer = json.loads(body)
    except ValueError:
        return True
    return not isinstance(answer, dict) or answer.get("ready", True) is True


class Server:
    """A `gpucast serve` on loopback with its own data directory, started and waited for until
    GET /readyz answers 200 with {"ready": true}: `ready` says whether it did, `readyz` holds the
    last answer (status, body), `ready_ms` the milliseconds from exec to ready. `log`: a file its
    output (stdout and stderr) is appended to (else discarded). `must_start`: exit the suite when
    it does not become ready. `extra_args`: more flags of serve; `env`: more environment
    variables; `poll_s`: the pause between two asks of /readyz."""

    def __init__(
        self,
        binary,
        port,
        data_dir=None,
        extra_args=(),
        log=None,
        must_start=True,
        ready_timeout=120,
        env=None,
        poll_s=0.2,
    ):
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.data_dir = str(data_dir or f"/tmp/gpucast-harness-{port}")
        if self.data_dir not in DATA_DIRS:
            DATA_DIRS.append(self.data_dir)
        self.log = log
        output = open(log, "ab") if log else subprocess.DEVNULL
        self.started = time.perf_counter()
        self.process = subprocess.Popen(
            [binary, "serve", "--listen", f"127.0.0.1:{port}", "--no-nvml", "--data-dir", self.data_dir, *extra_args],
            cwd=ROOT,
            env=dict(os.environ, **env) if env else None,
            stdout=output,
            stderr=output,
        )
        if log:
            output.close()
        self.ready = False
        self.readyz = None
        self.ready_ms = None
        deadline = time.time() + ready_timeout
        while time.time() < deadline and self.process.poll() is None:
            try:
                with urllib.request.urlopen(f"{self.base}/readyz", timeout=1) as r:
                    self.readyz = (r.status, r.read().decode(errors="replace"))
                if _says_ready(self.readyz[1]):
                    self.ready_ms = (time.perf_counter() - self.started) * 1000.0
                    self.ready = True
                    break
                time.sleep(poll_s)
            except urllib.error.HTTPError as error:
                self.readyz = (error.code, error.read().decode(errors="replace"))
                time.sleep(poll_s)
            except Exception:
                time.sleep(poll_s)
        if not self.ready and must_start:
            exited = self.process.poll()
            self.stop()
            why = f"exited with {exited}" if exited is not None else f"not ready after {ready_timeout} s"
            raise SystemExit(f"the server did not become ready ({why})" + (f"; see {log}" if log else ""))

    def rss_mib(self):
        try:
            with open(f"/proc/{self.process.pid}/status") as status:
                for line in status:
                    if line.startswith("VmRSS"):
                        return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def memory(self):
        """VmRSS and VmHWM (the peak RSS) in MiB, from /proc."""
        fields = {}
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    fields[key] = round(int(value.split()[0]) / 1024.0, 1)
        return {"rss_mib": fields.get("VmRSS"), "hwm_mib": fields.get("VmHWM")}

    def cpu_seconds(self):
        """User and system CPU seconds the server has used, from /proc."""
        with open(f"/proc/{self.process.pid}/stat") as handle:
            stat = handle.read()
        fields = stat[stat.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self, sig=signal.SIGTERM, timeout=60):
        """Sends `sig` (SIGKILL after `timeout` seconds) and waits: {"exit_code", "shutdown_ms"}
        (the milliseconds from the signal to the exit; 0 when it had exited already)."""
        started = time.perf_counter()
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            shutdown_ms = round((time.perf_counter() - started) * 1000.0, 1)
        else:
            shutdown_ms = 0.0
        return {"exit_code": self.process.returncode, "shutdown_ms": shutdown_ms}


def request(port, method, path, body=None, timeout=30):
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, method=method, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except Exception as error:
        return type(error).__name__


def call(port, method, path, body=None, headers=None, timeout=60):
    """(status, body bytes, headers with lower-case names) of one call; the status is an
    exception's name when no answer came."""
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    sent = {"content-type": "application/json"}
    sent.update(headers or {})
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method, headers=sent)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, response.read(), {k.lower(): v for k, v in response.headers.items()}
    except urllib.error.HTTPError as error:
        return error.code, error.read(), {k.lower(): v for k, v in error.headers.items()}
    except Exception as error:
        return type(error).__name__, b"", {}


def call_json(port, method, path, body=None, headers=None, timeout=60):
    status, data, _ = call(port, method, path, body, headers, timeout)
    try:
        return status, json.loads(data)
    except ValueError:
        return status, None


def raw_http(port, method, path, headers, body=b"", timeout=30):
    """One request written by hand (exactly these headers, plus Content-Length and Connection:
    close; Host 127.0.0.1:port unless `headers` has one): (status, lower-cased headers, body)."""
    names = {name.lower() for name, _ in headers}
    lines = [f"{method} {path} HTTP/1.1"]
    if "host" not in names:
        lines.append(f"Host: 127.0.0.1:{port}")
    lines += [f"{name}: {value}" for name, value in headers]
    lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall("\r\n".join(lines).encode() + body)
        data = b""
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        except OSError:
            pass
    head, _, rest = data.partition(b"\r\n\r\n")
    if not head:
        return "no answer", {}, b""
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    answer = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        answer[name.strip().lower()] = value.strip()
    if answer.get("transfer-encoding", "").lower() == "chunked":
        decoded = b""
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0] or b"0", 16)
            if size == 0:
                break
            decoded += rest[:size]
            rest = rest[size + 2 :]
        rest = decoded
    parts = status_line.split(" ")
    return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else "garbled"), answer, rest
