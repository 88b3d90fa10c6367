"""Build vLLM engine configurations (no engine, no model load) with the sinklab-vllm plugin
installed, and report for each whether vLLM accepted it or the error it raised. Run inside
.venv-vllm, never in sinklab's venv (docs/vllm.md#refuses).

Reads a JSON list on stdin: ``[{"model": FOLDER, "env": {VAR: value}, "kwargs": {EngineArgs
fields...}}, ...]`` (``env`` set for that case only);
writes ``SINKLAB-RESULT [{"ok": true} | {"ok": false, "error": "..."}]`` as one line of stdout."""

from __future__ import annotations

import json
import os
import sys

for key, value in {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",
}.items():
    os.environ.setdefault(key, value)


def main() -> None:
    cases = json.loads(sys.stdin.read())
    from vllm.engine.arg_utils import EngineArgs

    out = []
    for case in cases:
        env = case.get("env") or {}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            EngineArgs(model=case["model"], **case["kwargs"]).create_engine_config()
        except Exception as exc:  # what vLLM raises is the result under test
            out.append({"ok": False, "type": type(exc).__name__, "error": str(exc)})
        else:
            out.append({"ok": True})
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    print("SINKLAB-RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
