"""What the parameter server needs from a mode: a policy for the server, a role for the towers.

A mode trained by the parameter server (:class:`ServerMode`; the modes themselves are in
:mod:`towers.engines.modes`) gives the server its policy (:mod:`towers.engines.ps.policies`: when
a request is answered, what an arriving result does) and each computing tower its role
(:mod:`towers.engines.ps.worker`: what a tower does with a shard's gradient and which fields it
sends back). The engine takes both from the job's mode once, at its start, and hands them to the
server and the towers; neither looks at the mode again.
"""

from __future__ import annotations

from ...core.modes import Engine, Mode
from .policies import Policy
from .worker import Gradients, Role

__all__ = ["ServerMode", "server_mode"]


class ServerMode(Mode):
    """A mode the parameter server trains (rank 0, one process besides the towers)."""

    engine = Engine.SERVER

    def policy(self, towers: int) -> Policy:
        """A fresh policy for a server with ``towers`` computing towers."""
        raise NotImplementedError

    def role(self) -> Role:
        """A fresh role for one computing tower (by default: send each shard's gradient)."""
        return Gradients()


def server_mode(mode: Mode) -> ServerMode:
    """``mode``, which the dispatch in :mod:`towers.engines.run` sent to this engine."""
    assert isinstance(mode, ServerMode), f"mode {mode} is not trained by the parameter server"
    return mode
