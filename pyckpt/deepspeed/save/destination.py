"""Where a save's files go, and who makes them visible: a save's destination.

Every save runs the same steps (:mod:`.collective_save`): arrival, preflight, DeepSpeed's save into
a staging folder, the agreement, the publication. What differs by destination is answered here, by
one object the save is handed:

- what the preflight's gather must also agree on, and what the other publishers do once it has (rank 0
  prepares first, for every destination: its staging name is the save's; :meth:`Destination.view`,
  :meth:`~Destination.agree`), and whether free space is counted per node (:attr:`~Destination.by_node`);
- what an existing folder of the tag may be replaced by (:meth:`replacement_problem`);
- whether the files are written in place from the state (:meth:`in_place`) and whether the write may be
  left to a background thread (:attr:`background`);
- the publication and its outcome, the same on every rank (:meth:`~Destination.publish`): rank 0 publishes
  one shared folder, each node's leader its node's folder.

:class:`SharedFolder` is the durable save's: one folder all ranks share, rank 0 its publisher. The
memory tier's node-local folders are :class:`~.node_share.NodeShare`.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, List, Optional, Tuple

from .publication import prune_after, publish_checkpoint
from .request import SaveRequest
from .retention import replace_problem


class Destination:
    """The questions a save asks its destination (see the module doc); :class:`SharedFolder` answers
    them for one shared folder."""

    by_node = False  # whether free space and the folder are per node
    background = True  # whether an asynchronous save may write in a background thread

    def view(self, mine: dict, publisher) -> None:
        """Adds to this rank's preflight view what every rank must agree on beyond the shared fields."""

    def agree(self, pre: List[dict], request: SaveRequest, rank: int, stack: contextlib.ExitStack,
              prepare: Callable, gather: Callable) -> Tuple[object, Optional[str]]:
        """After the gather found the views consistent: (a publisher this rank prepared now, or None;
        why the save cannot start, or None, the same on every rank)."""
        return None, None

    def replacement_problem(self, request: SaveRequest, publisher) -> Optional[str]:
        """Why the existing folder ``publisher.output`` (or a conversion's) must not be replaced."""
        raise NotImplementedError

    def in_place(self, engine) -> bool:
        """Whether this save writes its files itself from the state (:mod:`.slot_save`)."""
        return False

    def publish(self, engine, request: SaveRequest, group, publisher, failure: Optional[str],
                described: list) -> Tuple[bool, Optional[str]]:
        """Every rank, after DeepSpeed's save: the agreement of every rank's ``failure`` (None on success)
        and the publication; (ok, why not), the same on every rank."""
        raise NotImplementedError


class SharedFolder(Destination):
    """One folder every rank shares (``save_dir``): rank 0 prepares, publishes and prunes it."""

    def replacement_problem(self, request: SaveRequest, publisher) -> Optional[str]:
        """A folder the save would replace (the tag, or a conversion it was asked for) that is not what
        pyckpt writes there: DeepSpeed's own save would leave such a folder's files alone, replacing it
        whole would cost the user them."""
        save_dir, tag = request.save_dir, request.tag
        outputs = [(tag, "checkpoint")] + ([(tag + "_universal", "_universal")] if request.universal else []) + \
            ([(tag + "_hf", "_hf")] if request.export == "hf" else [])
        for name, kind in outputs:
            problem = replace_problem(os.path.join(save_dir, name), kind)
            if problem:
                return (f"{problem}; a save replaces only a checkpoint of its own tag. Choose another tag, or move "
                        "that folder away")
        return None

    def publish(self, engine, request: SaveRequest, group, publisher, failure: Optional[str],
                described: list) -> Tuple[bool, Optional[str]]:
        outcomes = group.all_gather(failure)
        result = None
        if group.rank == 0:
            result = publish_checkpoint(publisher, outcomes, request.save_dir, request.tag)
            if result[0] and request.keep_last:
                prune_after(request.save_dir, request.keep_last, request.tag)
        return tuple(group.broadcast(result))
