"""``python -m sinklab``: the command line (``torchrun --nproc-per-node 2 -m sinklab train``)."""

import sys

from sinklab.cli import main

sys.exit(main())
