"""Models: loading any local, cached or embedded causal LM (:mod:`~sinklab.models.loading`),
architecture facts (:mod:`~sinklab.models.arch`), RoPE as a rotation by any offset
(:mod:`~sinklab.models.rotary`) and the offline switches (:mod:`~sinklab.models.offline`)."""
