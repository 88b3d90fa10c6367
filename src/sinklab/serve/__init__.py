"""``sinklab serve``: StreamingLLM as an OpenAI-compatible service.

A conversation is a *session*: its bounded sink cache (``n_sink + window`` positions, however
long it runs) lives between turns as a :class:`~sinklab.stream.state.StreamState`, is written to
disk after each completed turn, and joins the sessions being answered in one decode batch
(:class:`~sinklab.stream.generation.StreamBatch`) while its reply is generated.

Modules: :mod:`.config` (limits and the bind rule), :mod:`.protocol` (the OpenAI request and
response shapes, errors), :mod:`.sessions` (sessions and their files), :mod:`.engine` (the one
thread that runs the model: prefill, batched decode, commit), :mod:`.metrics` (Prometheus text),
:mod:`.app` (the HTTP routes, keys and limits), :mod:`.client` (``sinklab chat --server``).
"""
