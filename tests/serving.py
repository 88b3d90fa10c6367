"""A ``sinklab serve`` process for the tests: started on a free loopback port, its log read by a
thread (a pipe, so that a file-size limit on the server touches only its session files), killed
with SIGKILL or stopped with SIGTERM; every wait bounded."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

_LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)/v1")


class Served:
    """``sinklab serve ARGS --port 0`` until :meth:`stop` or :meth:`kill`."""

    def __init__(self, *args: str, timeout: float = 180.0, prefix: tuple[str, ...] = ()) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "sinklab.cli", "serve", *args, "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._seen = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.url = self._wait_for(_LISTENING, timeout).group(1)
        self.base = self.url + "/v1"

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._seen:
                self.lines.append(line.rstrip("\n"))
                self._seen.notify_all()
        with self._seen:
            self._seen.notify_all()

    def _wait_for(self, pattern: re.Pattern[str], timeout: float) -> re.Match[str]:
        end = time.monotonic() + timeout
        with self._seen:
            while True:
                for line in self.lines:
                    if m := pattern.search(line):
                        return m
                left = end - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    self.kill()
                    raise AssertionError("sinklab serve did not start:\n" + self.log)
                self._seen.wait(min(left, 0.5))

    @property
    def log(self) -> str:
        with self._seen:
            return "\n".join(self.lines)

    def kill(self) -> None:
        """SIGKILL: no chance to write anything."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
