"""Streaming: StreamingLLM's sink + window cache and everything that runs on it.

* :mod:`~sinklab.stream.policy`: what a cache keeps (pure eviction over positions);
* :mod:`~sinklab.stream.slots`: the per-row bookkeeping of one forward (no tensors);
* :mod:`~sinklab.stream.layer` and :mod:`~sinklab.stream.cache`: ``SinkCache`` on transformers'
  cache API (each layer's keys and values, RoPE re-rotation of kept sinks);
* :mod:`~sinklab.stream.evaluate`: streaming perplexity (the step loop) and ``StreamResult``;
* :mod:`~sinklab.stream.band`: the band evaluator (many queries per forward, same NLLs);
* :mod:`~sinklab.stream.oracle`: the recompute oracle;
* :mod:`~sinklab.stream.summary`: figures, collapse point and sentences of a stream result;
* :mod:`~sinklab.stream.generation` and :mod:`~sinklab.stream.chat`: bounded-memory decoding,
  one stream or many (``StreamBatch``), and multi-turn chat.
"""
