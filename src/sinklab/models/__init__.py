"""Models: loading any local, cached or embedded causal LM (:mod:`~sinklab.models.loading`),
architecture facts (:mod:`~sinklab.models.arch`) and RoPE as a rotation by any offset
(:mod:`~sinklab.models.rotary`). The offline switches are core (:mod:`sinklab.offline`): the corpus
needs them too."""
