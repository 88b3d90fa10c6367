"""Which handlers a model's attention sees: handlers bound to the model's own module objects.

The registry holds the modules weakly, so a model that is garbage-collected takes its bindings
with it; :func:`bind` removes exactly the handlers it added when its block exits, even on error.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from weakref import WeakKeyDictionary

from torch import nn

from sinklab.seam.handlers import AttentionHandler

# module -> the handler groups bound to it, one tuple per open `bind` block, outermost first
_BOUND: WeakKeyDictionary[nn.Module, list[tuple[AttentionHandler, ...]]] = WeakKeyDictionary()
_GENERATION = [0]  # counts every bind and unbind: a caller's check is current while it is equal


def binding_generation() -> int:
    """A number that changes whenever any handler is bound or unbound, so a check of the bound
    handlers (the sink cache's) is redone only when something may have changed."""
    return _GENERATION[0]


def bound_handlers(module: nn.Module, layer: int | None = None) -> list[AttentionHandler]:
    """The handlers bound to ``module`` in the order they were entered (outer blocks first);
    with ``layer``, only those active on that layer."""
    handlers = [h for group in _BOUND.get(module, ()) for h in group]
    return handlers if layer is None else [h for h in handlers if h.active(layer)]


@contextmanager
def bind(model: nn.Module, handlers: Sequence[AttentionHandler]) -> Iterator[None]:
    """Bind ``handlers`` to every module of ``model`` for the span of the block."""
    group = tuple(handlers)
    modules = list(model.modules())
    for module in modules:
        _BOUND.setdefault(module, []).append(group)
    _GENERATION[0] += 1
    try:
        yield
    finally:
        for module in modules:
            groups = _BOUND.get(module, [])
            for i in range(len(groups) - 1, -1, -1):  # this block's own group, by identity
                if groups[i] is group:
                    del groups[i]
                    break
            if not groups:
                _BOUND.pop(module, None)
        _GENERATION[0] += 1
