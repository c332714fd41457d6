"""Training ranks that notice when another one dies: one TCP connection from each rank to rank 0.

A process that dies (killed, out of memory, its node gone) has its sockets closed by the kernel, so
rank 0 reads an end of stream on that rank's lifeline at once, whatever the rank was doing, and a
rank other than 0 reads one on its own lifeline when rank 0 dies. Collectives cannot tell this
themselves: NCCL waits for a dead peer until its timeout, and rank 0 may wait days between two
requests. Keepalive probes cover a node that vanishes without closing anything. Knows nothing
about training: what to do about a lost rank is the caller's.
"""

import logging
import os
import socket
import struct
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

# A peer that answers no probe for IDLE + INTERVAL * COUNT seconds counts as gone.
_KEEPALIVE_IDLE_SECONDS, _KEEPALIVE_INTERVAL_SECONDS, _KEEPALIVE_COUNT = 30, 10, 3
_RANK = struct.Struct("!i")


def _keep_alive(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, _KEEPALIVE_IDLE_SECONDS)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, _KEEPALIVE_INTERVAL_SECONDS)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, _KEEPALIVE_COUNT)
    return sock


class Lifelines:
    """This rank's lifelines: on rank 0 one per other rank, elsewhere the one to rank 0."""

    def __init__(self, rank: int, sockets: dict[int, socket.socket]):
        self.rank = rank
        self._sockets = sockets
        """The peer's rank -> its connection."""
        self._stopping = threading.Event()
        self.lost = threading.Event()
        """Set once a peer's lifeline broke while the group was not stopping."""
        self.lost_rank: int | None = None

    @classmethod
    def connect(cls, rank: int, world_size: int, address: str,
                share_port: Callable[[int | None], int]) -> "Lifelines":
        """Rank 0 listens on `address`; the others connect to it and say their rank.

        Args:
            share_port: rank 0's value on every rank (a broadcast of the process group).
        """
        if rank != 0:
            sock = _keep_alive(socket.create_connection((address, share_port(None))))
            sock.sendall(_RANK.pack(rank))
            return cls(rank, {0: sock})
        with socket.create_server((address, 0)) as listener:
            share_port(listener.getsockname()[1])
            sockets = {}
            while len(sockets) < world_size - 1:
                sock, _ = listener.accept()
                (peer,) = _RANK.unpack(sock.recv(_RANK.size, socket.MSG_WAITALL))
                sockets[peer] = _keep_alive(sock)
        return cls(rank, sockets)

    def watch(self, on_lost: Callable[[int], None]) -> None:
        """Call `on_lost(rank)` (from a thread of its own) when a peer dies, unless `stop()` came first."""
        for peer, sock in self._sockets.items():
            threading.Thread(target=self._wait, args=(peer, sock, on_lost), name=f"lifeline-{peer}",
                             daemon=True).start()

    def _wait(self, peer: int, sock: socket.socket, on_lost: Callable[[int], None]) -> None:
        try:
            sock.recv(1)  # nothing is ever sent: this returns when the connection ends
        except OSError:
            pass
        if self._stopping.is_set() or self.lost.is_set():
            return
        self.lost_rank = peer
        self.lost.set()
        on_lost(peer)

    def stop(self) -> None:
        """The group is stopping on purpose: the ends of stream to come are not deaths."""
        self._stopping.set()


def exit_when_leader_dies(lifelines: Lifelines) -> None:
    """On a rank other than 0: end this process when rank 0 dies (its collectives would wait forever)."""
    def leave(_: int) -> None:
        logger.error("event=training_rank_lost rank=0: the server (training rank 0) stopped; rank %d exits too. "
                     "Start the server again, then this node's torchrun", lifelines.rank)
        logging.shutdown()
        os._exit(1)

    lifelines.watch(leave)
