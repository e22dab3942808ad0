"""Communication: the one layer that moves bytes between processes.

:mod:`~towers.comm.base` defines what engines may ask of a transport; :mod:`~towers.comm.group`
joins a job and picks the transport; :mod:`~towers.comm.shm` sums through shared memory between
workers on one host. Engines never call ``torch.distributed`` collectives themselves.
"""
