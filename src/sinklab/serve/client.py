"""``sinklab chat --server URL``: the chat REPL against a running ``sinklab serve`` (standard
library HTTP, server-sent events read line by line). The session lives on the server: each line
sends only the new message with the session's id."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from sinklab.errors import SinklabError


class RemoteChat:
    """A conversation held by a server: :meth:`turn`, :meth:`stats`, :meth:`reset`."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        timeout: float = 300.0,
    ) -> None:
        self.base = url.rstrip("/")
        if not self.base.endswith("/v1"):
            self.base += "/v1"
        self.key, self.timeout = api_key, timeout
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.session_id: str | None = None
        self.model = self._get("/models")["data"][0]["id"]

    def _request(
        self, path: str, body: dict[str, Any] | None = None, method: str | None = None
    ) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data, headers, method=method)
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as err:
            try:
                message = json.loads(err.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = err.reason
            raise SinklabError(f"the server answered {err.code}: {message}") from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise SinklabError(
                f"cannot reach {self.base} ({reason}); is sinklab serve running?"
            ) from None

    def _get(self, path: str) -> Any:
        with self._request(path) as resp:
            return json.loads(resp.read())

    def turn(self, text: str, on_text: Callable[[str], None] | None = None) -> str:
        """Send ``text``; stream the reply to ``on_text``; return it."""
        if not text.strip():
            raise SinklabError("empty message; type some text (or /stats, /reset, /quit)")
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "stream": True,
        }
        if self.session_id is not None:
            body["session_id"] = self.session_id
        reply = []
        with self._request("/chat/completions", body) as resp:
            for raw in resp:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    return "".join(reply)
                event = json.loads(data)
                if "error" in event:
                    raise SinklabError(f"the server failed the turn: {event['error']['message']}")
                self.session_id = event.get("session_id", self.session_id)
                for choice in event.get("choices", []):
                    piece = choice.get("delta", {}).get("content")
                    if piece:
                        reply.append(piece)
                        if on_text is not None:
                            on_text(piece)
        raise SinklabError("the server closed the connection before the reply ended")

    def stats(self) -> dict[str, Any]:
        if self.session_id is None:
            return {"turns": 0, "tokens_seen": 0, "kept": 0}
        data = self._get(f"/sessions/{self.session_id}")
        return {k: data[k] for k in ("turns", "tokens_seen", "kept")}

    def reset(self) -> None:
        """Start a new session (the old one stays on the server)."""
        self.session_id = None
