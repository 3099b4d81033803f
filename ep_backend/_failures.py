"""How a failed MoE call becomes the same ``ep_backend.errors`` type on every rank.

Two rules keep the ranks' calls paired:

* a rank that refuses its call before the C++ op's agreement step (a Python argument check, a
  tensor on the ``meta`` device, an argument the dispatcher cannot bind) still joins that step,
  through ``_reject``, so its peers raise instead of pairing this call with its next one;
* an error from the op itself is translated by ``_translate`` after the fact: the C++ code has
  already made every rank raise (its messages say "nothing was exchanged"), only the Python type
  and the message's length change.

Both run only once something has failed: a call that succeeds pays for a ``try`` block (free in
CPython 3.11+). (A meta input reaches the op's meta kernel, ``_fake``, which refuses it.)
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import NoReturn

import torch
import torch.distributed as dist

from ._custom_ops import _ops
from .errors import MoEError, MoEInputError, MoETimeoutError, MoETypeError

# Said by every error the C++ agreement raises, on every rank, before any data moved.
_AGREED = "nothing was exchanged"
_TIMEOUT_MARKERS = (
    "never joined", "timed out", "Timed out", "timeout caused pair closure",
    "lost the data exchange", "was masked by rank(s)",
)  # fmt: skip
# torch's words when it cannot bind an argument to the op's schema (before any kernel ran).
_UNBOUND = ("Expected a value of type", "expected a value of type", "Could not run")
_CPP_TRACE = re.compile(r"\n?Exception raised from [^\n]*(?:\n(?:frame #|\s*<omitting)[^\n]*)*")
_MISPAIRED = " is in call #"  # the agreement's words for ranks in different calls
_META = "a tensor argument is on the meta device; the MoE collectives move cpu and cuda tensors"
_REJECTED_RANKS = re.compile(
    r"rank\(s\) ([\d, ]+) (?:rejected|never joined|died)|masked by rank\(s\) ([\d, ]+)"
)
_KERNEL_PEER = re.compile(r"waiting for rank (\d+)")


def _short(message: str) -> str:
    """``message`` without the C++ stack traces torch embeds, unless the user asked for them."""
    if os.environ.get("TORCH_SHOW_CPP_STACKTRACES", "0") not in ("", "0"):
        return message
    return _CPP_TRACE.sub("", message).strip()


def _named_ranks(message: str) -> tuple[int, ...]:
    match = _REJECTED_RANKS.search(message) or _KERNEL_PEER.search(message)
    if match is None:
        return ()
    ranks = next(g for g in match.groups() if g is not None)
    return tuple(int(r) for r in ranks.replace(" ", "").split(",") if r)


def _input_error(op: str, exc: BaseException) -> MoEInputError:
    message = _short(f"{exc}")
    if not message.startswith("ep "):
        message = f"ep {op}: {message}"
    kind = MoETypeError if isinstance(exc, TypeError) else MoEInputError
    return kind(message, _named_ranks(message))


def _reject(pg: dist.ProcessGroup, op: str, exc: BaseException) -> NoReturn:
    """Raises ``exc`` as a ``MoEInputError`` on this rank after joining ``op``'s agreement step.

    Every check that can fail on one rank only goes through here: the peers, already in the C++
    op's agreement step, raise ``MoEInputError`` "rank(s) ... rejected their inputs" instead of
    waiting for this rank until the group times out (or pairing with its next call).
    """
    error = _input_error(op, exc)
    try:
        _ops.reject(op, f"{error}", pg.group_name)
    except RuntimeError as agreement:  # the expected outcome: it raised on every rank
        message = _short(f"{agreement}")
        if _MISPAIRED in message:  # the peers were in another call: say so here too
            raise type(error)(f"{error}; and {message}", error.ranks) from None
    raise error from None


def _left_before_agreement(exc: BaseException, inputs: Iterable[torch.Tensor | None]) -> bool:
    """Whether ``exc``, raised by an op call on this rank, came before the op's agreement."""
    message = f"{exc}"
    if _AGREED in message.lower():
        return False
    if isinstance(exc, NotImplementedError) or any(s in message for s in _UNBOUND):
        return True
    # A meta input selects the op's meta kernel, which never reaches the agreement.
    return any(t is not None and t.is_meta for t in inputs)


def _failed(
    pg: dist.ProcessGroup, op: str, exc: Exception, inputs: Iterable[torch.Tensor | None]
) -> BaseException:
    """What to raise for ``exc``, raised by the call of ``op``; joins the agreement first where
    this rank never reached it (then raises itself)."""
    if isinstance(exc, MoEError):
        return exc
    inputs = tuple(inputs)
    if _left_before_agreement(exc, inputs):
        if any(t is not None and t.is_meta for t in inputs):
            exc = ValueError(_META)
        _reject(pg, op, exc)
    return _translate(op, exc)


def _translate(op: str, exc: BaseException) -> BaseException:
    """The public type of an error raised by an op after its agreement (``exc`` itself if the
    error is none of the MoE failure classes)."""
    if isinstance(exc, MoEError) or not isinstance(exc, RuntimeError):
        return exc
    message = f"{exc}"
    if _AGREED in message.lower():
        return _input_error(op, exc)
    if any(marker in message for marker in _TIMEOUT_MARKERS):
        short = _short(message)
        if not short.startswith("ep "):
            short = f"ep {op}: {short}"
        return MoETimeoutError(short, _named_ranks(short))
    return exc
