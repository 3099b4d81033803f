"""The exception types of the MoE collectives: one per failure class, the same on every rank.

Every MoE collective first agrees with the other ranks of its group on its inputs. A failure
of that agreement, or of the call after it, raises one of these types on every rank that was in
the call, whichever rank caused it, so that one ``except`` clause handles it on all of them:

* ``MoEInputError`` (also a ``ValueError``, and a ``torch.distributed.DistError``, so a
  ``RuntimeError``): some rank passed an invalid argument, or the ranks disagreed (sizes,
  dtypes, flags, a handle of another dispatch, different collectives). Nothing was exchanged and
  the group is usable: fix the input and call again, on every rank.
* ``MoETypeError`` (a ``MoEInputError`` and a ``TypeError``): the rank that passed an argument of
  the wrong type raises this; its peers raise ``MoEInputError``.
* ``MoETimeoutError`` (a ``torch.distributed.DistBackendError`` and a ``TimeoutError``): a rank
  never joined the call within the group's timeout, or a kernel timed out waiting for a peer.
  ``ranks`` names them. The group cannot be used again: destroy it and make a new one.

Messages are one or two lines; the C++ stack trace torch appends to some errors is kept only
with ``TORCH_SHOW_CPP_STACKTRACES=1``.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["MoEError", "MoEInputError", "MoETimeoutError", "MoETypeError"]


class MoEError(dist.DistError):
    """Base class of the errors the MoE collectives raise on purpose (a ``RuntimeError``).

    Attributes:
        ranks: the ranks the message names as the cause (the ranks that rejected their inputs,
            never joined the call or stalled a kernel); empty where the message names none.
    """

    def __init__(self, message: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks

    def __reduce__(self) -> tuple[type, tuple[str, tuple[int, ...]]]:
        return type(self), (str(self), self.ranks)


class MoEInputError(MoEError, ValueError):
    """Some rank's input was invalid, or the ranks' inputs disagreed; raised on every rank.

    Nothing was exchanged; the group stays usable and the next valid call on every rank is
    unaffected. The rank whose input was bad says what was wrong; its peers say
    ``rank(s) r rejected their inputs`` (``ranks`` holds those ranks).
    """


class MoETypeError(MoEInputError, TypeError):
    """An argument of the wrong type, on the rank that passed it (its peers: ``MoEInputError``)."""


class MoETimeoutError(MoEError, dist.DistBackendError, TimeoutError):
    """A rank never joined the call, or a kernel timed out waiting for a peer (``ranks``).

    The group's state is unknown after it (its internal Gloo pairs are closed): destroy the
    group (``torch.distributed.destroy_process_group(group)``) and create a new one.
    """
