"""The public API: :func:`towers.train` with its :class:`TrainResult`, and the own-loop
:func:`towers.init` with its :class:`Context`. ``towers/__init__.py`` re-exports them."""
