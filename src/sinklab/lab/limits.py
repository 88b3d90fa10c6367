"""Upper bounds of the lab's sizes, in a module without torch so that ``--help`` can state them
(the commands import it at start-up). Each keeps a run within one small machine."""

from __future__ import annotations

# sinklab cost: one attention layer fitted per (task, T)
MAX_DIM = 4096  # embedding width: the longest --lengths is 4096, and d = T by default
MAX_STEPS = 100_000  # Adam steps per norm radius (the default is 300)
MAX_BISECTIONS = 64  # each halves the norm interval: 64 reach float64's resolution

# sinklab train: one lab decoder (its parameters are bounded by lab.config.MAX_PARAMS)
MAX_TRAIN_STEPS = 10_000_000
MAX_SEQ_LEN = 8192  # positions of a lab model
MAX_BATCH = 4096  # sequences per step
MAX_STEP_TOKENS = 1 << 20  # batch x sequence length: activations of one step stay within a machine
MAX_NPROC = 64
