"""The lab: train tiny decoders and watch sinks form; measure what a sink costs.

* :mod:`sinklab.lab.model`: ``LabConfig`` / ``LabForCausalLM`` (model type ``sinklab-tiny``),
  attention variants softmax, softmax1, sink, gated, sigmoid through sinklab's attention seam;
* :mod:`sinklab.lab.data`: scene documents, a byte-level BPE tokenizer, strategies bos, packed,
  packed-bos, doc-mask;
* :mod:`sinklab.lab.train`: ``TrainConfig``, ``train`` (probe at every checkpoint), presets;
* :mod:`sinklab.lab.sweep`: ``run_sweep("variants" | "data", ...)``;
* :mod:`sinklab.lab.cost`: ``CostConfig``, ``run_cost``, ``fit_exponent``;
* :mod:`sinklab.lab.plots`: loss, sink emergence, sweep comparison, cost figures.
"""
