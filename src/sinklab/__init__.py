"""sinklab: make attention sinks in transformer language models visible, measurable,
exploitable and removable."""

from sinklab.models.offline import enforce_offline

enforce_offline()  # before any Hugging Face import: sinklab never downloads, nor tries to

from sinklab.errors import SinklabError  # noqa: E402

__version__ = "0.1.0"
__all__ = ["SinklabError", "__version__"]
