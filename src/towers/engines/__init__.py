"""Engines: a typed :class:`~towers.engines.job.Job` in, a typed result out.

``sync/`` trains synchronously (gradient hooks, buckets, the loop); ``ps/`` runs the parameter
server of the asynchronous modes (server state, mode policies, wire format, resume). Which one
trains a job is its mode's (:mod:`towers.engines.modes`). Both build their replicas and
backpropagate shards through :mod:`towers.engines.replica`, and checkpoint through
:mod:`towers.engines.checkpoint`.
"""

# Importing the modes registers them by name with towers.core.modes; towers/__init__.py imports
# the engines, so every mode is registered before any part of towers runs.
from . import modes as modes
