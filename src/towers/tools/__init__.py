"""Tools built on the public API: the ``towers`` command (demo, compare, bench, run), plots, and
the model zoo they and the examples train. Nothing below ``tools`` imports from it."""
