"""Successful-peer hindsight for the TRL bridge: which trajectory teaches which, and the privileged text.

The pure logic lives in :mod:`agentcredit.hindsight` (shared with the verl bridge, :mod:`agentcredit.verl.hindsight`);
this module keeps its public names: :func:`choose_peers`, :func:`peer_prefix`, :func:`last_action`,
:data:`PEER_HINDSIGHT_HEADER` (and :func:`first_appearance`). See :mod:`agentcredit.hindsight` for what each does.
"""

from __future__ import annotations

from agentcredit.hindsight import (PEER_HINDSIGHT_HEADER, choose_peers, first_appearance, last_action,  # noqa: F401
                                   peer_prefix)

__all__ = ["choose_peers", "peer_prefix", "last_action", "PEER_HINDSIGHT_HEADER"]
