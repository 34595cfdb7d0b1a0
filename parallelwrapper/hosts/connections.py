"""A process group's own connections, found in /proc, so that a peer lost without closing anything ends the collective that waits on it at once.

A process killed closes its sockets, and gloo fails its peers' collective at once. A process that is
stopped, or whose machine's link is cut, closes nothing: its peers would wait in the collective
until its timeout (stall_timeout + 30 s), and gloo's own abort does not end a collective in flight
(ProcessGroupGloo.abort on torch 2.13, measured: the blocked all-reduce went on until the peer
exited). Shutting down the process's end of its group's connections does: the blocked read sees
the connection closed (1.5 s into a 60 s timeout, the moment it was shut), the peers at the other
ends see it closed too, and every member comes to the regroup (hosts/fleet.py). A group's
connections are the TCP connections this process made while it entered the group (its pairs, its
generation's store), less any to `spared` addresses (the fleet's store). Linux only: elsewhere
there is nothing to find, and a lost peer that closes nothing is waited for until the timeout.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from collections.abc import Collection

_SOCKET = re.compile(r"socket:\[(\d+)\]")


def _open() -> dict[int, int]:
    """This process's sockets: file descriptor -> the socket's inode (none where there is no /proc)."""
    found = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return {}
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if m := _SOCKET.fullmatch(link):
            found[int(fd)] = int(m.group(1))
    return found


class Connections:
    """The TCP connections this process opens from `mark()` to `taken()`: a group's, as it enters
    it. `taken` counts the groups (`taken_count`), so that a thread that decided to shut one group's
    connections shuts nothing of the next."""

    def __init__(self, spared: Collection[tuple[str, int]]) -> None:
        """`spared`: (IP, port) of endpoints never to shut (the fleet's store)."""
        self._spared = set(spared)
        self._before: set[int] = set()
        self._group: dict[int, int] = {}  # fd -> inode, the group's
        self._lock = threading.Lock()
        self.taken_count = 0

    def mark(self) -> None:
        """The group is about to be entered: what is open now is not its, and the last group's
        connections, which went with it, are no longer there to shut (a judge that sees a peer
        gone while the next forms shuts nothing: the forming's waits end by themselves)."""
        with self._lock:
            self._group = {}
        self._before = set(_open().values())

    def taken(self) -> None:
        """The group has been entered: its connections are those opened since `mark`."""
        group = {fd: inode for fd, inode in _open().items() if inode not in self._before and self._connected(fd)}
        with self._lock:
            self._group, self.taken_count = group, self.taken_count + 1

    def _connected(self, fd: int) -> bool:
        """Whether `fd` is a connected TCP socket to an endpoint not spared (not a listener, not the store)."""
        try:
            with socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as s:  # a duplicate: closing it leaves `fd` open
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN) not in (socket.AF_INET, socket.AF_INET6):
                    return False
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE) != socket.SOCK_STREAM or s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    return False
                return tuple(s.getpeername()[:2]) not in self._spared
        except OSError:  # not a socket any more, or not connected
            return False

    def shut(self, taken: int) -> int:
        """Shut down, both ways, every connection still open of the group taken `taken`-th (as
        `taken_count` was), if it is still the last one taken; how many. Once: a later call shuts
        nothing until the next group is taken."""
        with self._lock:
            if taken != self.taken_count:
                return 0
            group, self._group = self._group, {}
        shut = 0
        for fd, inode in group.items():
            try:
                with socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as s:
                    if os.fstat(s.fileno()).st_ino != inode:  # closed since, its number another socket's now
                        continue
                    s.shutdown(socket.SHUT_RDWR)
                shut += 1
            except OSError:  # closed since
                continue
        return shut


def endpoints(hosts: Collection[tuple[str, int]]) -> set[tuple[str, int]]:
    """Every (IP, port) that `hosts` (name or address, port) resolve to."""
    found = set()
    for host, port in hosts:
        try:
            found |= {(str(info[4][0]), port) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
        except OSError:  # unresolvable now: the store's client says so where it matters
            continue
    return found


__all__ = ["Connections", "endpoints"]
