"""Peer worker: ``attention-sinks`` 0.4.0 (transformers 4.34) streaming a token file.

Runs inside its own venv (created by ``benchmarks/stream_bench.py``); prints one JSON object.
It cannot import sinklab. Usage: python stream_peer_attention_sinks.py MODEL_DIR IDS_JSON N_SINK
WINDOW THREADS
"""

import json
import resource
import sys
import time

import torch


def main() -> None:
    model_dir, ids_file, n_sink, window, threads = sys.argv[1:6]
    torch.set_num_threads(int(threads))
    from attention_sinks import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        attention_sink_size=int(n_sink),
        attention_sink_window_size=int(window),
        torch_dtype=torch.float32,
    ).eval()
    with open(ids_file) as f:
        ids = torch.tensor(json.load(f))
    nll, ms, rss, past = [], [], {}, None
    with torch.inference_mode():
        for t in range(ids.numel() - 1):
            t0 = time.perf_counter()
            out = model(ids[t : t + 1].view(1, 1), past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            nll.append(float(torch.logsumexp(logits, -1) - logits[ids[t + 1]]))
            ms.append((time.perf_counter() - t0) * 1e3)
            if t + 1 == 2000:
                rss["2000"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rss["end"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cache_len = int(past[0][0].shape[-2]) if past is not None else 0
    import transformers

    print(
        json.dumps(
            {
                "nll": nll,
                "ms": ms,
                "peak_rss_mb": rss,
                "max_cache_len": cache_len,
                "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
            }
        )
    )


if __name__ == "__main__":
    main()
