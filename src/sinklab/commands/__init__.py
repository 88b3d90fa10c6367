"""One module per CLI command. Each exposes ``register(app)``; :mod:`sinklab.cli` wires them."""
