"""Peer worker: kvpress 0.5.5, ``DecodingPress`` around ``StreamingLLMPress``, streaming a token
file token by token (compression every step to ``n_sink + window`` positions).

Runs inside its own venv (created by ``benchmarks/stream_bench.py``); prints one JSON object.
Usage: python stream_peer_kvpress.py MODEL_DIR IDS_JSON N_SINK WINDOW THREADS
"""

import json
import resource
import sys
import time

import torch


def main() -> None:
    model_dir, ids_file, n_sink, window, threads = sys.argv[1:6]
    torch.set_num_threads(int(threads))
    from kvpress import DecodingPress, StreamingLLMPress
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    press = DecodingPress(
        base_press=StreamingLLMPress(n_sink=int(n_sink)),
        compression_interval=1,
        target_size=int(n_sink) + int(window),
        hidden_states_buffer_size=0,
    )
    with open(ids_file) as f:
        ids = torch.tensor(json.load(f))
    nll, ms, rss = [], [], {}
    cache = DynamicCache()
    with torch.inference_mode(), press(model):
        for t in range(ids.numel() - 1):
            t0 = time.perf_counter()
            out = model(ids[t : t + 1].view(1, 1), past_key_values=cache, use_cache=True)
            logits = out.logits[0, -1].float()
            nll.append(float(torch.logsumexp(logits, -1) - logits[ids[t + 1]]))
            ms.append((time.perf_counter() - t0) * 1e3)
            if t + 1 == 2000:
                rss["2000"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rss["end"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    import kvpress
    import transformers

    print(
        json.dumps(
            {
                "nll": nll,
                "ms": ms,
                "peak_rss_mb": rss,
                "max_cache_len": int(cache.layers[0].keys.shape[-2]),
                "versions": {
                    "transformers": transformers.__version__,
                    "kvpress": getattr(kvpress, "__version__", "0.5.5"),
                    "torch": torch.__version__,
                },
            }
        )
    )


if __name__ == "__main__":
    main()
