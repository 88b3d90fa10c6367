"""``sinklab chat`` on a terminal: line editing (readline) and Ctrl-C. Ctrl-C mid-reply stops the
reply and keeps none of it (the next turns are exactly those of a conversation where the message
was never sent, the cache saved and restored or, where it cannot be saved, read again); Ctrl-C at
the prompt and Ctrl-D end the chat with exit 0 and no word about ``--out``. In process with a
real SIGINT from inside the reply, and the real command on a pseudo-terminal (pexpect)."""

from __future__ import annotations

import io
import os
import signal
import sys
from pathlib import Path

import pytest

from helpers import run_main

ARGS = ("--n-sink", "2", "--window", "200", "--max-new-tokens", "8")


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, tiny_model_factory, chat_tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("tiny-chat-cli")
    tiny_model_factory("llama", seed=13).save_pretrained(folder)
    chat_tokenizer.save_pretrained(folder)
    return folder


def _chat(capsys, monkeypatch, folder: Path, lines: list[str], interrupt_turn: int | None = None):
    """Run ``chat`` on ``lines`` piped in; ``interrupt_turn``: SIGINT this process at the third
    token of that turn's reply (counted from 1). -> (code, stdout lines, stderr)."""
    from sinklab.stream.chat import ChatSession

    turn, sample = {"n": 0, "tokens": 0}, ChatSession.sample
    real_turn = ChatSession.turn

    def counting_turn(self, text, on_text=None):
        turn["n"], turn["tokens"] = turn["n"] + 1, 0
        return real_turn(self, text, on_text)

    def sampling(self, logits, temperature=None):
        turn["tokens"] += 1
        if turn["n"] == interrupt_turn and turn["tokens"] == 3:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, as the terminal sends it
        return sample(self, logits, temperature)

    monkeypatch.setattr(ChatSession, "turn", counting_turn)
    monkeypatch.setattr(ChatSession, "sample", sampling)
    stdin = "\n".join(lines) + "\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin.encode("utf-8"))))
    run = run_main(capsys, "chat", "--model", str(folder), *ARGS)
    return run.returncode, run.stdout.splitlines(), run.stderr


SCRIPT = ["the king is dead", "what of the queen", "long live the king", "/stats"]


@pytest.mark.parametrize("savable", [True, False], ids=["cache-restored", "read-again"])
def test_ctrl_c_mid_reply_keeps_nothing_of_it(capsys, monkeypatch, chat_dir, savable):
    if not savable:  # a cache that cannot be saved (as a hybrid sliding-window model's)
        from sinklab.errors import SinklabError
        from sinklab.stream.cache import SinkCache

        def refuse(self, row=0):
            raise SinklabError("this cache cannot be saved")

        monkeypatch.setattr(SinkCache, "state", refuse)
    code, out, err = _chat(capsys, monkeypatch, chat_dir, SCRIPT, interrupt_turn=2)
    assert code == 0, err
    assert "reply interrupted" in err and "--out" not in err and "Traceback" not in err
    ref_code, ref, ref_err = _chat(capsys, monkeypatch, chat_dir, [SCRIPT[0], *SCRIPT[2:]])
    assert ref_code == 0, ref_err
    assert len(out) == 4 and len(ref) == 3, (out, ref)
    assert out[0] == ref[0] and out[0]  # the first reply
    assert out[2] == ref[1]  # the reply after the interrupted one: as if it was never asked

    def counts(stats: str) -> str:  # the stats line without its speed
        return stats.rsplit(" at ", 1)[0]

    assert counts(out[3]) == counts(ref[2]) and out[3].startswith("turns 2,")  # same cache


def test_sigterm_mid_reply_still_ends_the_command(capsys, monkeypatch, chat_dir):
    """Only Ctrl-C (SIGINT) is the chat's: SIGTERM stops the process as for every command."""
    from sinklab.stream.chat import ChatSession

    def stop(self, logits, temperature=None):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not interrupt")

    monkeypatch.setattr(ChatSession, "sample", stop)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello\n")))
    run = run_main(capsys, "chat", "--model", str(chat_dir), *ARGS)
    assert run.returncode == 130 and "interrupted" in run.stderr


def _spawn(chat_dir: Path):
    pexpect = pytest.importorskip("pexpect")  # a dev dependency (pyproject's dev extra)
    cmd = [sys.executable, "-m", "sinklab.cli", "chat", "--model", str(chat_dir)]
    cmd += ["--n-sink", "2", "--window", "64", "--max-new-tokens", "100000"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "TERM": "xterm"}
    return pexpect.spawn(cmd[0], cmd[1:], env=env, encoding="utf-8", timeout=60)


def test_terminal_chat_line_editing_ctrl_c_and_ctrl_d(chat_dir):
    """The real command on a pseudo-terminal: an arrow key edits the line (readline), Ctrl-C
    mid-reply gives the prompt back with the reply not kept, Ctrl-D ends with exit 0."""
    child = _spawn(chat_dir)
    child.expect_exact("you> ")
    child.send("/bogs\x1b[Du\r")  # left arrow, then 'u' before the 's': /bogus
    child.expect_exact("unknown command /bogus")
    child.expect_exact("you> ")
    child.send("the king is dead\r")  # a reply of up to 100000 tokens: stopped by Ctrl-C
    child.expect(r"dead\r\n.{20}")  # some of the reply is out
    child.sendintr()
    child.expect_exact("reply interrupted")
    child.expect_exact("you> ")
    child.send("/stats\r")
    child.expect(r"turns (\d+), tokens seen (\d+)")
    assert child.match.group(1) == "0" and child.match.group(2) == "0"  # nothing kept
    child.expect_exact("you> ")
    child.sendeof()  # Ctrl-D
    child.expect(pytest.importorskip("pexpect").EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    assert "--out" not in child.before and "Traceback" not in child.before


def test_terminal_ctrl_c_at_the_prompt_ends_cleanly(chat_dir):
    child = _spawn(chat_dir)
    child.expect_exact("you> ")
    child.sendintr()
    child.expect(pytest.importorskip("pexpect").EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    assert "--out" not in child.before and "Traceback" not in child.before
