"""Copying one node's checkpoint folder into a peer node's memory tier, verified before it counts.

Split by concept: the wire protocol, its limits and what both sides share (:mod:`.replica_protocol`,
whose docstring is the protocol's description), the receiving side (:mod:`.replica_receiver`:
:class:`~.replica_receiver.ReplicaReceiver`) and the sending side (:mod:`.replica_sender`:
:func:`~.replica_sender.send_folder`). This module names them for their importers; a test that patches
a name patches it in the module that uses it (:mod:`.replica_receiver` or :mod:`.replica_sender`),
not here.
"""

from __future__ import annotations

from .replica_protocol import Received, Sent, manifest_bytes, name_problem, tag_problem
from .replica_receiver import ReplicaReceiver
from .replica_sender import send_folder

# tests reach into these through this module
from .replica_protocol import CHUNK, CRC, ENTRY, HELLO, MAGIC_RECEIVER, OK, WINDOWS, _recv_exact, _verdict  # noqa: F401
from .replica_sender import _collect, _file_crc, _Session  # noqa: F401

__all__ = ["ReplicaReceiver", "Received", "send_folder", "Sent", "manifest_bytes", "name_problem", "tag_problem"]
