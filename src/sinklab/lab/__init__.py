"""The lab: train tiny decoders and watch sinks form; measure what a sink costs.

* :mod:`sinklab.lab.model`: ``LabConfig`` / ``LabForCausalLM`` (model type ``sinklab-tiny``),
  attention variants softmax, softmax1, sink, gated, sigmoid, relu through sinklab's seam;
* :mod:`sinklab.lab.data`: scene documents, a byte-level BPE tokenizer, strategies bos, packed,
  packed-bos, doc-mask (task ``text``);
* :mod:`sinklab.lab.backcopy`: the bigram-backcopy task (Guo et al. 2024), online batches;
  :mod:`sinklab.lab.backcopy_metrics`: what each head does at trigger / non-trigger queries;
* :mod:`sinklab.lab.config`: ``TrainConfig``; :mod:`sinklab.lab.presets`: ``preset`` (cpu / gpu,
  per task), ``config_from_options`` (what a command line asks for);
* :mod:`sinklab.lab.train`: ``train`` (probe at every checkpoint; one rank of a
  ``torchrun ... -m sinklab train`` run);
  :mod:`sinklab.lab.summary`: a run's summary sentences;
* :mod:`sinklab.lab.ranks`: a process's rank and its DDP process group;
  :mod:`sinklab.lab.distributed`: ``train_distributed`` (DDP over spawned local processes);
* :mod:`sinklab.lab.sweep`: ``run_sweep("variants" | "data" | "length" | "depth", ...)``;
* :mod:`sinklab.lab.cost`: ``CostConfig``, ``run_cost``, ``fit_exponent``;
* :mod:`sinklab.lab.plots`: loss, sink emergence, sweep comparison, cost figures.
"""


def register() -> None:
    """Register the lab's model types (``sinklab-tiny``) with transformers' Auto classes, so that
    :func:`~sinklab.models.loading.load_model` loads
    a saved lab checkpoint like any model (idempotent;
    every ``sinklab`` command that loads a model calls it)."""
    from sinklab.lab.model import register_lab_models

    register_lab_models()
