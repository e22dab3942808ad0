"""Engines: a typed :class:`~towers.engines.job.Job` in, a typed result out.

``sync/`` trains synchronously (gradient hooks, buckets, the loop); ``ps/`` runs the parameter
server of the asynchronous modes (server state, mode policies, wire format, resume). Both build
their replicas and backpropagate shards through :mod:`towers.engines.replica`, and checkpoint
through :mod:`towers.engines.checkpoint`.
"""
