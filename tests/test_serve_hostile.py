"""Hostile clients of ``sinklab serve`` (issue 29), against the real server on a tiny chat model:
each case asserts the status, the OpenAI-style JSON body, no traceback in the server's log, and
that another tenant's session and the files of the sessions folder are untouched. Also the
sessions folder as sinklab's own (marked; a folder holding anything else refused at start-up; a
user's ``package.json`` or ``config.json`` never touched) and the start-up refusals."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import httpx
import pytest

from helpers import assert_one_line_error, run_main
from serving import Served
from sinklab.serve.sessions import MARKER, SessionStore

N_SINK, WINDOW = 2, 30
KEYS = ("key-a", "key-b")


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, tiny_model_factory, chat_tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("tiny-chat-hostile")
    tiny_model_factory("llama", seed=13).save_pretrained(folder)
    chat_tokenizer.save_pretrained(folder)
    return folder


def _args(chat_dir: Path, sessions: Path, *more: str) -> list[str]:
    args = ["--model", str(chat_dir), "--n-sink", str(N_SINK), "--window", str(WINDOW)]
    args += ["--sessions", str(sessions), "--max-tokens", "64", *more]
    for key in KEYS:
        args += ["--api-key", key]
    return args


@pytest.fixture(scope="module")
def served(chat_dir, tmp_path_factory):
    sessions = tmp_path_factory.mktemp("hostile") / "sessions"
    server = Served(*_args(chat_dir, sessions, "--header-timeout", "2", "--prefill-chunk", "16"))
    server.sessions = sessions
    server.model = str(chat_dir)
    yield server
    server.stop()


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _body(model: str, text: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 3,
            **extra}  # fmt: skip


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def _refused(resp: httpx.Response, status: int, needle: str) -> None:
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert set(body) == {"error"} and needle in body["error"]["message"], body
    assert set(body["error"]) == {"message", "type", "param", "code"}


def _raw(head: bytes, parts: list[bytes] = ()) -> bytes:
    """Send bytes on a fresh connection and read the whole answer (a reset fails the test)."""
    with socket.create_connection(("127.0.0.1", _port_of), timeout=30) as s:
        s.sendall(head)
        for part in parts:
            s.sendall(part)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


_port_of = 0


def _json_of(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_hostile_requests_are_clean_4xx_and_touch_no_one_else(served):
    global _port_of
    _port_of = int(served.url.rsplit(":", 1)[1])
    url, model = served.base + "/chat/completions", served.model
    with httpx.Client(timeout=60) as http:
        keep = http.post(url, json=_body(model, "hello", session_id="keep"), headers=_auth("key-a"))
        assert keep.status_code == 200, keep.text
        files = _snapshot(served.sessions)
        b = _auth("key-b")
        deep = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        _refused(http.post(url, content=deep, headers=b), 400, "nests deeper")
        ignored = b'{"model": "m", "whatever": ' + b"{" * 0 + b"[" * 100_000 + b"]" * 100_000
        _refused(http.post(url, content=ignored + b"}", headers=b), 400, "nests deeper")
        lone = b'{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800b"}]}' % (
            model.encode()
        )
        _refused(http.post(url, content=lone, headers=b), 400, "surrogate")
        for seed in (2**64, -(2**63) - 1, 10**30):
            _refused(http.post(url, json=_body(model, "x", seed=seed), headers=b), 400, "64 bits")
        for t in (5e-324, 1.5e-307, 1e-5):
            resp = http.post(url, json=_body(model, "x", temperature=t), headers=b)
            _refused(resp, 400, "at least 0.0001")
        ok = http.post(url, json=_body(model, "x", temperature=1e-4, seed=2**64 - 1), headers=b)
        assert ok.status_code == 200, ok.text
        # another key's id and an absent one: the same 404, and b's 'keep' is b's own
        absent = http.get(served.base + "/sessions/nobody", headers=b).json()["error"]
        other = http.get(served.base + "/sessions/keep", headers=b).json()["error"]
        assert {**other, "message": ""} == {**absent, "message": ""}
        assert other["message"] == absent["message"].replace("nobody", "keep")
        # /metrics: aggregates only (no per-key series without --metrics-key)
        metrics = http.get(served.url + "/metrics", headers=b).text
        assert "sinklab_sessions " in metrics and "tenant=" not in metrics
        a_files = {n: d for n, d in _snapshot(served.sessions).items() if n in files}
        assert a_files == files  # key a's session files untouched
        assert http.get(served.base + "/sessions/keep", headers=_auth("key-a")).json()["turns"] == 1
    # a 200 KB header: 431 JSON, not a reset; a 2 MiB chunked body: 413 JSON, not a reset
    status, body = _json_of(_raw(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000
                                 + b"\r\n\r\n"))  # fmt: skip
    assert status == 431 and "headers" in body["error"]["message"]
    big = json.dumps(_body(model, "x" * (2 << 20))).encode()
    parts = [b"%x\r\n%s\r\n" % (len(big[i : i + 65536]), big[i : i + 65536])
             for i in range(0, len(big), 65536)] + [b"0\r\n\r\n"]  # fmt: skip
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-b\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")  # fmt: skip
    status, body = _json_of(_raw(head, parts))
    assert status == 413 and "over" in body["error"]["message"]
    # headers trickled past --header-timeout (2 s): 408, the connection closed
    with socket.create_connection(("127.0.0.1", _port_of), timeout=30) as s:
        start = time.monotonic()
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        waited = time.monotonic() - start
    assert _json_of(out)[0] == 408 and 1.5 < waited < 10
    with httpx.Client(timeout=10) as http:
        assert http.get(served.url + "/health").json()["status"] == "ok"
    assert "Traceback" not in served.log and "Exception in ASGI" not in served.log


def test_a_reply_the_client_did_not_receive_is_not_committed(served):
    url, model, a = served.base + "/chat/completions", served.model, _auth("key-a")
    with httpx.Client(timeout=60) as http:
        first = http.post(url, json=_body(model, "once", session_id="cut"), headers=a)
        assert first.status_code == 200
        before = http.get(served.base + "/sessions/cut", headers=a).json()
        body = {**_body(model, "twice", session_id="cut", stream=True), "max_tokens": 60}
        with http.stream("POST", url, json=body, headers=a) as resp:
            for n, _line in enumerate(resp.iter_lines()):
                if n >= 3:
                    break  # the client goes away mid-reply
        for _ in range(200):  # until the server has dropped the turn
            rows = http.get(served.base + "/sessions", headers=a).json()["data"]
            if not next(r for r in rows if r["id"] == "cut")["busy"]:
                break
            time.sleep(0.1)
        after = http.get(served.base + "/sessions/cut", headers=a).json()
        assert after == before  # turns and messages as before the dropped turn
        retry = http.post(url, json=_body(model, "twice", session_id="cut"), headers=a)
        assert retry.json()["session"]["turns"] == 2, retry.text
        kept = http.get(served.base + "/sessions/cut", headers=a).json()["messages"]
        assert [m["content"] for m in kept if m["role"] == "user"] == ["once", "twice"]
    assert "client gone mid-reply" in served.log
    assert "Traceback" not in served.log


def test_the_sessions_folder_is_sinklabs_own(chat_dir, tmp_path, capsys):
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "package.json").write_text('{"name": "mine"}')
    run = run_main(capsys, "serve", *_args(chat_dir, mine))
    assert_one_line_error(run, "holds files sinklab did not make")
    assert sorted(p.name for p in mine.iterdir()) == ["package.json"]
    folder = tmp_path / "sessions"
    server = Served(*_args(chat_dir, folder))
    try:
        assert (folder / MARKER).is_file()
        (folder / "package.json").write_text('{"name": "mine"}')  # a user's file, put there
        url, a = server.base + "/chat/completions", _auth("key-a")
        with httpx.Client(timeout=60) as http:
            made = http.post(url, json=_body(str(chat_dir), "hi", session_id="package"), headers=a)
            assert made.status_code == 200
            stem = SessionStore.stem(server_tenant("key-a"), "package")
            assert (folder / f"{stem}.json").is_file()
            assert http.delete(server.base + "/sessions/package", headers=a).status_code == 200
            assert not (folder / f"{stem}.json").exists()
            _refused(http.delete(server.base + "/sessions/package", headers=a), 404, "no session")
        assert (folder / "package.json").read_text() == '{"name": "mine"}'
    finally:
        server.stop()
    (folder / "config.json").write_text('{"mine": true}')
    again = Served(*_args(chat_dir, folder, "--metrics-key", "watcher"))
    try:
        assert "are not sinklab's (config.json, package.json); not read" in again.log
        with httpx.Client(timeout=60) as http:
            url = again.base + "/chat/completions"
            assert http.post(url, json=_body(str(chat_dir), "hi"), headers=_auth("key-b"))
            plain = http.get(again.url + "/metrics", headers=_auth("key-a")).text
            per_key = http.get(again.url + "/metrics", headers=_auth("watcher")).text
            assert http.get(again.url + "/metrics").status_code == 401
        assert "tenant=" not in plain and "sinklab_sessions 1" in plain
        tenant = server_tenant("key-b")
        assert f'sinklab_key_sessions{{tenant="{tenant}"}} 1' in per_key
    finally:
        again.stop()
    assert (folder / "config.json").read_text() == '{"mine": true}'
    assert (folder / "package.json").read_text() == '{"name": "mine"}'
    assert "Traceback" not in again.log


def server_tenant(key: str) -> str:
    from sinklab.serve.config import tenant_of

    return tenant_of(key)


@pytest.mark.skipif(os.geteuid() != 0 and os.access("/", os.W_OK), reason="needs a read-only dir")
def test_delete_on_a_read_only_folder_keeps_memory_and_disk_consistent(chat_dir, tmp_path):
    folder = tmp_path / "sessions"
    caps = "-dac_override,-dac_read_search"
    prefix = ("setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", "--")
    server = Served(*_args(chat_dir, folder), prefix=prefix if os.geteuid() == 0 else ())
    try:
        url, a = server.base + "/chat/completions", _auth("key-a")
        with httpx.Client(timeout=60) as http:
            assert http.post(url, json=_body(str(chat_dir), "hi", session_id="ro"), headers=a)
            files = _snapshot(folder)
            folder.chmod(0o555)
            try:
                resp = http.delete(server.base + "/sessions/ro", headers=a)
                _refused(resp, 503, "not deleted")
                assert http.get(server.base + "/sessions/ro", headers=a).json()["turns"] == 1
                assert _snapshot(folder) == files
            finally:
                folder.chmod(0o755)
            assert http.delete(server.base + "/sessions/ro", headers=a).status_code == 200
            assert sorted(_snapshot(folder)) == [MARKER]
    finally:
        server.stop()
    assert "Traceback" not in server.log


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--api-key", "clé"], "printable ASCII"),
        (["--api-key", "k", "--metrics-key", "mé"], "printable ASCII"),
        (["--session-ttl", "0"], "--session-ttl"),
        (["--prefill-chunk", "0"], "--prefill-chunk"),
    ],
)
def test_bad_serve_options_are_one_line(capsys, args, needle):
    assert_one_line_error(run_main(capsys, "serve", *args), needle)


def test_a_whole_reply_whose_client_left_is_not_committed(served):
    """A plain (not streamed) request whose client closes the connection before the reply is
    made: the turn is dropped (the session keeps its one turn), one log line, no traceback."""
    url, model, a = served.base + "/chat/completions", served.model, _auth("key-a")
    port = int(served.url.rsplit(":", 1)[1])
    with httpx.Client(timeout=60) as http:
        assert http.post(url, json=_body(model, "first", session_id="left"), headers=a).is_success
        body = json.dumps({**_body(model, "second", session_id="left"), "max_tokens": 60}).encode()
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-a\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(head + body)
        # gone at once: the server notices before it applies the turn (one log line)
        for _ in range(200):
            if "client gone; the turn was not applied" in served.log:
                break
            time.sleep(0.1)
        got = http.get(served.base + "/sessions/left", headers=a).json()["turns"]
        assert got == 1, served.log[-3000:]
    assert "client gone; the turn was not applied" in served.log
    assert "Traceback" not in served.log


def test_a_turn_answered_504_is_not_committed(chat_dir, tmp_path):
    """--request-timeout 1 and a prompt read one token a step: the turn is answered 504 (JSON)
    between prefill pieces, long before its prompt is read, and the session keeps its turns;
    the next turn is answered."""
    sessions = tmp_path / "sessions"
    more = ("--request-timeout", "1", "--prefill-chunk", "1", "--max-tokens", "4")
    server = Served(*_args(chat_dir, sessions, *more))
    url, a = server.base + "/chat/completions", _auth("key-a")
    try:
        with httpx.Client(timeout=120) as http:
            ok = http.post(url, json=_body(str(chat_dir), "hi", session_id="slow"), headers=a)
            assert ok.status_code == 200, ok.text
            long = " ".join(["to be or not to be that is the question"] * 800)
            start = time.monotonic()
            resp = http.post(url, json=_body(str(chat_dir), long, session_id="slow"), headers=a)
            _refused(resp, 504, "--request-timeout")
            assert time.monotonic() - start < 30
            row = http.get(server.base + "/sessions/slow", headers=a).json()
            assert row["turns"] == 1 and row["tokens_seen"] == ok.json()["session"]["tokens_seen"]
            again = http.post(url, json=_body(str(chat_dir), "again", session_id="slow"), headers=a)
            assert again.json()["session"]["turns"] == 2, again.text
    finally:
        server.stop()
    assert "Traceback" not in server.log


def _open_post(port: int, key: str, length: int, sent: bytes) -> socket.socket:
    """A POST whose body is announced as ``length`` bytes and only ``sent`` of it arrives."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (key.encode(), length, sent)
    )
    return s


def _read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_one_key_cannot_hold_the_server_and_tenants_see_nothing_of_each_other(chat_dir, tmp_path):
    """--max-requests-per-key 2: two trickled bodies of key a hold its two slots, so a third
    request of a gets 429 (JSON, Retry-After) before its body is read, while key b is answered;
    b naming a's session (GET, DELETE) gets the 404 it gets for an absent or malformed id, and
    a's session and files stay; the trickled bodies get 408 after --header-timeout, which frees
    a's slots, and /health, /metrics, GET /v1/models still answer a meanwhile.
    --max-connections-per-client 4: a fifth connection gets 503 JSON; --idle-timeout 1: a
    kept-alive connection is closed a second after its answer."""
    sessions = tmp_path / "sessions"
    more = ("--max-requests-per-key", "2", "--header-timeout", "3", "--idle-timeout", "1",
            "--max-connections-per-client", "4")  # fmt: skip
    server = Served(*_args(chat_dir, sessions, *more))
    port = int(server.url.rsplit(":", 1)[1])
    model, a, b = str(chat_dir), _auth("key-a"), _auth("key-b")
    url = server.base + "/chat/completions"
    fresh = httpx.Limits(max_keepalive_connections=0)  # a new connection each request
    try:
        with httpx.Client(timeout=60, limits=fresh) as http:
            assert http.post(url, json=_body(model, "hi", session_id="keep"), headers=a).is_success
            files = _snapshot(sessions)
            held = [_open_post(port, "key-a", 400, b'{"model": ') for _ in range(2)]
            time.sleep(0.5)  # both in flight, their bodies awaited
            over = http.get(server.base + "/sessions", headers=a)
            _refused(over, 429, "--max-requests-per-key 2")
            assert over.json()["error"]["code"] == "too_many_requests"
            assert over.headers["retry-after"] == "1"
            monitor = (server.url + "/health", server.url + "/metrics", server.base + "/models")
            for where in monitor:  # a monitor's probes are not counted against the key
                assert http.get(where, headers=a).status_code == 200, where
            assert http.get(server.base + "/sessions", headers=b).json()["data"] == []
            assert http.post(url, json=_body(model, "mine"), headers=b).is_success
            for method in ("GET", "DELETE"):
                theirs = http.request(method, server.base + "/sessions/keep", headers=b)
                for absent in ("nobody", "bad.id"):
                    resp = http.request(method, server.base + f"/sessions/{absent}", headers=b)
                    assert resp.status_code == theirs.status_code == 404
                    assert resp.text.replace(absent, "keep") == theirs.text
                    assert set(resp.headers) == set(theirs.headers)
            for s in held:  # the trickled bodies: 408 after --header-timeout, then closed
                with s:
                    status, body = _json_of(_read_all(s))
                    assert status == 408 and body["error"]["code"] == "request_timeout"
            assert http.get(server.base + "/sessions/keep", headers=a).json()["turns"] == 1
            assert {n: d for n, d in _snapshot(sessions).items() if n in files} == files
        # connections per client address: four open, the fifth refused with 503 JSON
        idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(4)]
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as fifth:
                status, body = _json_of(_read_all(fifth))
            assert status == 503 and body["error"]["code"] == "too_many_connections"
        finally:
            for s in idle:
                s.close()
        time.sleep(0.5)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            start, out = time.monotonic(), b""
            while chunk := s.recv(65536):
                out += chunk
            waited = time.monotonic() - start
        assert b'"status":"ok"' in out.replace(b" ", b"") and 0.5 < waited < 3, (out, waited)
    finally:
        server.stop()
    assert "Traceback" not in server.log and "Exception in ASGI" not in server.log


def test_a_client_gone_mid_body_is_one_log_line(served):
    """A client that announces a body, sends part of it and closes: one log line, no 500
    counted, no traceback; the server answers the next request."""
    port = int(served.url.rsplit(":", 1)[1])
    before = served.log.count("client gone during POST /v1/chat/completions")
    _open_post(port, "key-a", 4000, b'{"model": "m", "messages": [').close()
    for _ in range(100):
        if served.log.count("client gone during POST /v1/chat/completions") > before:
            break
        time.sleep(0.1)
    assert served.log.count("client gone during POST /v1/chat/completions") == before + 1
    assert "internal error" not in served.log and "Traceback" not in served.log
    with httpx.Client(timeout=30) as http:
        metrics = http.get(served.url + "/metrics", headers=_auth("key-a")).text
        assert 'status="500"' not in metrics
        assert http.get(served.url + "/health").json()["status"] == "ok"


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        (b'"temperature": NaN', "temperature", "finite"),
        (b'"top_p": Infinity', "top_p", "finite"),
        (b'"presence_penalty": -Infinity', "presence_penalty", "finite"),
        (b'"max_tokens": true', "max_tokens", "valid integer"),
        (b'"max_tokens": "2"', "max_tokens", "valid integer"),
        (b'"stream": 1', "stream", "valid boolean"),
        (b'"logit_bias": {"\\u0663": 1}', "logit_bias", "not a token id"),
        (b'"max_tokens": ' + b"9" * 5000, None, "not valid JSON"),
    ],
)
def test_values_openai_refuses_are_refused_not_coerced(served, extra, param, needle):
    """NaN and infinities, a bool or a string for a number, a non-ASCII digit as a token id, an
    integer of 5,000 digits: each a 400 naming the field, never read as something else."""
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], %s}' % (
        served.model.encode(),
        extra,
    )
    url = served.base + "/chat/completions"
    with httpx.Client(timeout=60) as http:
        resp = http.post(url, content=body, headers=_auth("key-b"))
    _refused(resp, 400, needle)
    assert resp.json()["error"]["param"] == param
    assert "Traceback" not in served.log


def _stream_times(url: str, body: dict, key: str, out: list[float], stop) -> None:
    """Stream ``body``, noting the arrival time of each chunk with text, until ``stop`` is set."""
    with (
        httpx.Client(timeout=120) as http,
        http.stream("POST", url, json=body, headers=_auth(key)) as resp,
    ):
        for line in resp.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get(
                "content"
            ):
                out.append(time.monotonic())
            if stop.is_set():
                return


def test_a_long_prompt_does_not_stop_another_sessions_stream(chat_dir, chat_tokenizer, tmp_path):
    """Over HTTP: while key a streams a reply, key b sends a prompt of some 1,000 tokens; with
    --prefill-chunk 8 it is read a piece a step between a's tokens: a receives a token at least
    every fifth piece, and its longest wait is a small part of b's whole read. (It fails when
    the engine reads a whole prompt before the next decode step: a then waits for all of it.)"""
    import threading

    from test_chat import TURNS

    more = ("--prefill-chunk", "8", "--max-tokens", "2000", "--max-batch", "4")
    server = Served(*_args(chat_dir, tmp_path / "sessions", *more))
    url, model = server.base + "/chat/completions", str(chat_dir)
    no_end = {str(t): -100 for t in chat_tokenizer.all_special_ids}  # a runs to max_tokens
    times: list[float] = []
    stop = threading.Event()
    talk = {**_body(model, TURNS[0], session_id="talk"), "max_tokens": 2000, "stream": True,
            "temperature": 0, "logit_bias": no_end}  # fmt: skip
    talker = threading.Thread(target=_stream_times, args=(url, talk, "key-a", times, stop))
    try:
        talker.start()
        for _ in range(600):
            if len(times) >= 5:
                break
            time.sleep(0.05)
        assert len(times) >= 5, server.log[-2000:]
        long_text = " ".join(TURNS * 20)
        with httpx.Client(timeout=300) as http:
            start = time.monotonic()
            resp = http.post(url, json={**_body(model, long_text), "max_tokens": 1},
                             headers=_auth("key-b"))  # fmt: skip
            end = time.monotonic()
        assert resp.status_code == 200, resp.text
        read = resp.json()["usage"]["prompt_tokens"]
        assert read > 700
        during = [t for t in times if start < t < end]
        gaps = [b - a for a, b in zip([start, *during], [*during, end], strict=True)]
        stop.set()
        talker.join(timeout=120)
        assert len(during) >= read // 8 // 5, (len(during), read)
        assert max(gaps) < (end - start) / 5, (max(gaps), end - start)
    finally:
        stop.set()
        server.stop()
    assert "Traceback" not in server.log


@pytest.mark.parametrize(
    ("route", "head", "extra", "param", "needle"),
    [
        ("completions", b'"prompt": "x"', b'"temperature": NaN', "temperature", "finite"),
        ("completions", b'"prompt": "x"', b'"max_tokens": true', "max_tokens", "valid integer"),
        ("completions", b'"prompt": "x"', b'"max_tokens": "2"', "max_tokens", "valid integer"),
        ("completions", b'"prompt": "x"', b'"echo": "yes"', "echo", "valid boolean"),
        ("completions", b'"prompt": "x"', b'"temperature": "0.5"', "temperature", "valid number"),
        ("responses", b'"input": "x"', b'"top_p": Infinity', "top_p", "finite"),
        (
            "responses",
            b'"input": "x"',
            b'"max_output_tokens": true',
            "max_output_tokens",
            "valid integer",
        ),
        ("responses", b'"input": "x"', b'"temperature": "0.5"', "temperature", "valid number"),
    ],
)
def test_the_other_routes_read_values_as_strictly_as_chat(
    served, route, head, extra, param, needle
):
    """/v1/completions and /v1/responses read their values as the chat route does: a string or a
    bool for a number, NaN or an infinity is a 400 naming the field, never coerced."""
    body = b'{"model": "%s", %s, %s}' % (served.model.encode(), head, extra)
    with httpx.Client(timeout=60) as http:
        resp = http.post(f"{served.base}/{route}", content=body, headers=_auth("key-b"))
    _refused(resp, 400, needle)
    assert resp.json()["error"]["param"] == param


def test_a_history_the_named_session_does_not_hold_is_refused_not_appended(served):
    """With a session_id, a resent conversation must be the session's: an edited one (another
    assistant reply) is refused (400 history_mismatch) and the session stays as it was; the
    session's own conversation with a new message continues it, reading only the new text."""
    url, model, a = served.base + "/chat/completions", served.model, _auth("key-a")
    with httpx.Client(timeout=60) as http:
        first = http.post(url, json=_body(model, "one", session_id="hist"), headers=a).json()
        reply = first["choices"][0]["message"]["content"]
        before = http.get(served.base + "/sessions/hist", headers=a).json()

        def resend(said: str) -> httpx.Response:
            history = [{"role": "user", "content": "one"}, {"role": "assistant", "content": said},
                       {"role": "user", "content": "two"}]  # fmt: skip
            body = {"model": model, "messages": history, "max_tokens": 3, "session_id": "hist"}
            return http.post(url, json=body, headers=a)

        edited = resend(reply + " (edited)")
        _refused(edited, 400, "does not")
        assert edited.json()["error"]["code"] == "history_mismatch"
        assert http.get(served.base + "/sessions/hist", headers=a).json() == before
        ok = resend(reply).json()
        assert ok["session"]["turns"] == 2
        assert ok["usage"]["prompt_tokens_details"]["cached_tokens"] == before["tokens_seen"]
        held = http.get(served.base + "/sessions/hist", headers=a).json()["messages"]
        assert [m["content"] for m in held if m["role"] == "user"] == ["one", "two"]
    assert "Traceback" not in served.log
