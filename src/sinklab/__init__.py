"""sinklab: make attention sinks in transformer language models visible, measurable,
exploitable and removable."""

from sinklab.errors import SinklabError

__version__ = "0.1.0"
__all__ = ["SinklabError", "__version__"]
