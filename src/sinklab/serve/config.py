"""What a ``sinklab serve`` process is allowed to do: its address, keys, limits (one dataclass,
checked before the model loads)."""

from __future__ import annotations

import hashlib
import ipaddress
import math
from dataclasses import dataclass, field
from pathlib import Path

from sinklab.errors import SinklabError


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def tenant_of(key: str) -> str:
    """The tenant a key stands for, as stored with its sessions (never the key itself)."""
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def _plain(key: str) -> bool:
    """A key a client can send as ``Authorization: Bearer KEY``: printable ASCII, no spaces."""
    return bool(key) and all(33 <= ord(c) <= 126 for c in key)


@dataclass(frozen=True)
class ServeConfig:
    """A server's settings. ``api_keys``: one tenant per key (none: one open tenant, loopback
    only). Limits answer with an OpenAI-style 4xx, never by dropping a connection."""

    model_id: str = "smollm2-135m"
    n_sink: int = 4
    window: int = 508
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    sessions_dir: Path | None = None
    max_sessions: int = 64
    max_batch: int = 16
    max_queue: int = 64  # turns waiting for the model, beyond which a request gets 429
    max_body_bytes: int = 1 << 20
    max_messages: int = 256
    max_tokens_limit: int = 2048  # the most a request may ask for
    default_max_tokens: int = 256
    request_timeout_s: float = 300.0
    prompt_chunk: int = 128  # --prefill-chunk: tokens of a turn read per engine step, at most
    session_ttl_s: float = 3600.0  # an idle session is removed after this long
    max_sessions_per_key: int = 64
    max_requests_per_key: int = 16  # requests (and turns) of one key in flight at once
    max_saved_sessions: int = 256  # sessions out of memory kept on disk (LRU beyond)
    metrics_key: str | None = None  # per-key series in /metrics, for this key only
    header_timeout_s: float = 10.0  # a request's headers and body must arrive within this
    idle_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this long
    max_connections_per_client: int = 64  # open connections from one client address
    tenants: dict[str, str] = field(default_factory=dict, compare=False)  # key -> tenant

    def __post_init__(self) -> None:
        for name in (
            "n_sink",
            "window",
            "max_sessions",
            "max_batch",
            "max_queue",
            "prompt_chunk",
            "max_sessions_per_key",
            "max_requests_per_key",
            "max_saved_sessions",
            "max_connections_per_client",
        ):
            if getattr(self, name) < 1:
                flag = "prefill_chunk" if name == "prompt_chunk" else name
                raise SinklabError(f"--{flag.replace('_', '-')} must be a positive integer")
        for name in ("max_body_bytes", "max_messages", "max_tokens_limit", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise SinklabError(f"{name} must be a positive integer")
        for name in ("request_timeout_s", "session_ttl_s", "header_timeout_s", "idle_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                flag = "--" + name.removesuffix("_s").replace("_", "-")
                raise SinklabError(f"{flag} must be a positive number of seconds, got {value}")
        if not 0 <= self.port <= 65535:
            raise SinklabError(f"--port must be in 0..65535 (0: any free port), got {self.port}")
        for flag, keys in (("--api-key", self.api_keys), ("--metrics-key", (self.metrics_key,))):
            if any(k is not None and not _plain(k) for k in keys):
                raise SinklabError(
                    f"a {flag} is empty or has spaces or characters outside printable ASCII "
                    "(no client can send it in a header); pass a plain ASCII token"
                )
        if self.metrics_key is not None and self.metrics_key in self.api_keys:
            raise SinklabError("--metrics-key must differ from every --api-key")
        if len(set(self.api_keys)) != len(self.api_keys):
            raise SinklabError("the same --api-key is given twice; give each tenant's key once")
        if not self.api_keys and not is_loopback(self.host):
            raise SinklabError(
                f"--host {self.host} accepts connections from other machines, and no --api-key "
                "is given; pass --api-key KEY (one per tenant), or keep --host 127.0.0.1"
            )
        self.tenants.update({k: tenant_of(k) for k in self.api_keys})
