"""``GET /metrics``: the server's counters and gauges in Prometheus' text format (written here:
a dozen lines do not need a client library)."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable

from sinklab.memory import rss_mb

_RATE_WINDOW_S = 10.0


class Metrics:
    """Thread-safe counters: requests by status, tokens read and generated, a recent tokens/s,
    the batch size; gauges read at scrape time come from ``gauges()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()
        self.generated = 0
        self.prompt = 0
        self.batch = 0
        self.batch_peak = 0
        self.prefill_peak = 0  # most turns read in one prefill
        self._recent: deque[tuple[float, int]] = deque()

    def add_request(self, status: int) -> None:
        with self._lock:
            self.requests[str(status)] += 1

    def add_tokens(self, n: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.generated += n
            self._recent.append((now, n))

    def add_prompt(self, n: int) -> None:
        with self._lock:
            self.prompt += n

    def set_prefill(self, n: int) -> None:
        """``n`` turns were read in one prefill."""
        with self._lock:
            self.prefill_peak = max(self.prefill_peak, n)

    def set_batch(self, n: int) -> None:
        with self._lock:
            self.batch = n
            self.batch_peak = max(self.batch_peak, n)

    def tokens_per_s(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - _RATE_WINDOW_S:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / _RATE_WINDOW_S

    def render(self, gauges: Callable[[], dict[str, float]]) -> str:
        """The Prometheus text exposition (version 0.0.4)."""
        rate = self.tokens_per_s()
        g = gauges()
        with self._lock:
            lines = [
                "# HELP sinklab_requests_total HTTP requests answered, by status.",
                "# TYPE sinklab_requests_total counter",
                *(
                    f'sinklab_requests_total{{status="{code}"}} {n}'
                    for code, n in sorted(self.requests.items())
                ),
                *_one("generated_tokens_total", "counter", "Tokens generated.", self.generated),
                *_one("prompt_tokens_total", "counter", "Prompt tokens read.", self.prompt),
                *_one(
                    "tokens_per_second",
                    "gauge",
                    f"Tokens generated per second, last {_RATE_WINDOW_S:g} s.",
                    rate,
                ),
                *_one("batch_size", "gauge", "Sessions decoding in the batch now.", self.batch),
                *_one(
                    "batch_size_peak",
                    "gauge",
                    "Most sessions decoded in one step.",
                    self.batch_peak,
                ),
                *_one(
                    "prefill_batch_peak",
                    "gauge",
                    "Most turns read in one prefill.",
                    self.prefill_peak,
                ),
            ]
        lines += _one("sessions", "gauge", "Sessions held.", g["sessions"])
        lines += _one("kept_positions", "gauge", "Cache positions kept, all sessions.", g["kept"])
        lines += _one("queue_length", "gauge", "Turns waiting for the model.", g["queue"])
        lines += _one("rss_bytes", "gauge", "Resident memory of the server.", rss_mb() * 2**20)
        return "\n".join(lines) + "\n"


def _one(name: str, kind: str, help_: str, value: float) -> list[str]:
    v = f"{value:.6g}" if isinstance(value, float) else str(value)
    return [
        f"# HELP sinklab_{name} {help_}",
        f"# TYPE sinklab_{name} {kind}",
        f"sinklab_{name} {v}",
    ]
