"""The group's nodes: which ranks share an NVLink domain, found at group creation.

Each rank posts its host identity (host name and kernel boot id, so that two machines that
share a name still differ) through the group's store. Ranks with the same identity form a
node, numbered by its lowest rank. ``Options(ranks_per_node=k)`` (or ``EP_RANKS_PER_NODE=k``
where the option is 0) instead splits each host's ranks into nodes of ``k`` consecutive ranks:
emulated nodes, whose legs between them take the internode path on one host.

A group of one node keeps the intranode path. A group of several nodes takes the internode
path where its nodes are regular (equal size, at most 8 ranks each); a detected irregular one
is not an error (the ATen path serves it, with ``Topology.problem`` as the reason), but an
emulation request that cannot be honoured raises at group creation.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

MAX_RANKS_PER_NODE = 8
_KEY = "ep_topology/"
_ENV = "EP_RANKS_PER_NODE"


@dataclass(frozen=True)
class Topology:
    """Nodes of a group of ``R`` ranks.

    Attributes:
        num_nodes: number of nodes.
        ranks_per_node: ranks of each node when all are equal, else 0.
        node_of_rank: ``[R]`` node index of each rank (nodes numbered by their lowest rank).
        local_rank: ``[R]`` index of each rank within its node, in rank order.
        emulated: the nodes were split out of fewer hosts by ``ranks_per_node``.
        problem: why the internode path cannot serve this topology ("" when it can, or when it
            is one node).
    """

    num_nodes: int
    ranks_per_node: int
    node_of_rank: tuple[int, ...]
    local_rank: tuple[int, ...]
    emulated: bool = False
    problem: str = ""

    def ranks_of_node(self, node: int) -> list[int]:
        """The ranks of ``node``, in local-index order."""
        return [r for r, n in enumerate(self.node_of_rank) if n == node]


def host_identity() -> str:
    """This machine's identity: host name and kernel boot id (``/proc``; absent elsewhere)."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}/{boot}"


def requested_ranks_per_node(option: int) -> int:
    """The emulation request: ``option`` if non-zero, else ``EP_RANKS_PER_NODE``, else 0.

    Raises:
        ValueError: ``EP_RANKS_PER_NODE`` is not an integer in ``[0, 8]``.
    """
    if option:
        return option
    text = os.environ.get("EP_RANKS_PER_NODE", "").strip()
    if not text:
        return 0
    try:
        k = int(text)
    except ValueError:
        raise ValueError(f"ep: {_ENV} must be an integer in [0, 8], got {text!r}") from None
    if not 0 <= k <= MAX_RANKS_PER_NODE:
        raise ValueError(f"ep: {_ENV} must be in [0, {MAX_RANKS_PER_NODE}], got {k}")
    return k


def plan_topology(hosts: list[str], ranks_per_node: int = 0) -> Topology:
    """The topology of ranks on ``hosts`` (one identity per rank, in rank order).

    Args:
        hosts: ``[R]`` host identities.
        ranks_per_node: 0: a node per distinct host; ``k`` in 1..8: nodes of ``k`` consecutive
            ranks, each on one host.

    Raises:
        ValueError: ``ranks_per_node`` outside ``[0, 8]``, not dividing ``R``, or a node of
            ``k`` consecutive ranks that would span two hosts.
    """
    size = len(hosts)
    if size < 1:
        raise ValueError("ep: a topology needs at least one rank")
    k = ranks_per_node
    if not 0 <= k <= MAX_RANKS_PER_NODE:
        raise ValueError(
            f"ep: ranks_per_node must be 0 (find the nodes from the hosts) or in "
            f"[1, {MAX_RANKS_PER_NODE}], got {k}"
        )
    if k:
        if size % k:
            raise ValueError(
                f"ep: ranks_per_node={k} does not divide the group's {size} ranks (every node "
                f"must hold the same number of ranks)"
            )
        node_of_rank = [r // k for r in range(size)]
        for node in range(size // k):
            block = hosts[node * k : (node + 1) * k]
            if any(h != block[0] for h in block):
                first = next(i for i, h in enumerate(block) if h != block[0])
                raise ValueError(
                    f"ep: ranks_per_node={k} puts ranks {node * k} and {node * k + first} in one "
                    f"node, but they run on different hosts ({block[0]!r}, {block[first]!r})"
                )
        return Topology(
            num_nodes=size // k,
            ranks_per_node=k,
            node_of_rank=tuple(node_of_rank),
            local_rank=tuple(r % k for r in range(size)),
            emulated=size // k > len(set(hosts)),
        )
    node_of_host: dict[str, int] = {}
    node_of_rank = [node_of_host.setdefault(h, len(node_of_host)) for h in hosts]
    counts = [0] * len(node_of_host)
    local_rank = []
    for node in node_of_rank:
        local_rank.append(counts[node])
        counts[node] += 1
    num_nodes = len(counts)
    equal = all(c == counts[0] for c in counts)
    problem = ""
    if num_nodes > 1 and not equal:
        problem = f"the nodes hold unequal numbers of ranks ({counts}); internode needs equal ones"
    elif num_nodes > 1 and counts[0] > MAX_RANKS_PER_NODE:
        problem = (
            f"the nodes hold {counts[0]} ranks each; internode serves at most "
            f"{MAX_RANKS_PER_NODE} per node"
        )
    return Topology(
        num_nodes=num_nodes,
        ranks_per_node=counts[0] if equal else 0,
        node_of_rank=tuple(node_of_rank),
        local_rank=tuple(local_rank),
        problem=problem,
    )


def exchange_identities(
    store: Any, group_name: str, rank: int, size: int, ranks_per_node: int
) -> list[str]:
    """Every rank's ``"<ranks_per_node>|<host identity>"``, in rank order (collective).

    Goes through the group's store (a rank that never posts makes the others fail at the
    store's timeout), under keys named after the group: the store torch hands a backend may be
    shared with other groups, whose creation must not overwrite these keys.
    """
    prefix = f"{_KEY}{group_name}/"
    store.set(f"{prefix}{rank}", f"{ranks_per_node}|{host_identity()}")
    keys = [f"{prefix}{r}" for r in range(size)]
    values = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]


def discover(store: Any, group_name: str, rank: int, size: int, option: int) -> Topology:
    """The topology of a new group (collective, at group creation).

    Raises:
        ValueError: on every rank alike, for an emulation request it cannot honour or that
            the ranks disagree on.
    """
    mine = requested_ranks_per_node(option)
    if size == 1:  # one rank is one node, whatever the request (EP_RANKS_PER_NODE is global)
        return plan_topology(["self"])
    posted = exchange_identities(store, group_name, rank, size, mine)
    requested = [int(p.split("|", 1)[0]) for p in posted]
    if any(k != requested[0] for k in requested):
        raise ValueError(
            f"ep: the ranks ask for different ranks_per_node ({requested}, 0 = from the hosts); "
            f"set Options.ranks_per_node or {_ENV} alike on every rank"
        )
    return plan_topology([p.split("|", 1)[1] for p in posted], requested[0])


def install(backend: Any, topology: Topology) -> None:
    """Hands ``topology`` to the C++ backend, which the transports read."""
    backend._set_topology(
        topology.num_nodes,
        topology.ranks_per_node,
        list(topology.node_of_rank),
        list(topology.local_rank),
        topology.emulated,
        topology.problem,
    )


def of_backend(backend: Any) -> Topology:
    """The topology the C++ backend holds."""
    num_nodes, per_node, node_of_rank, local_rank, emulated, problem = backend._topology()
    return Topology(num_nodes, per_node, tuple(node_of_rank), tuple(local_rank), emulated, problem)


def topology(group: Any = None) -> Topology:
    """The nodes of an ``"ep"`` group (found at its creation; no communication).

    Args:
        group: an ``"ep"`` process group (default: WORLD).

    Returns:
        ``Topology``: ``num_nodes``, ``ranks_per_node``, ``node_of_rank``, ``local_rank``,
        ``emulated``, ``problem``.
    """
    from ._groups import get_backend

    return of_backend(get_backend(group))
