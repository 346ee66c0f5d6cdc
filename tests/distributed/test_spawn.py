"""tests/support/spawn.py's run_ranks when the port it found for rank 0's rendezvous store is
taken before the store binds (another process of the suite took it: seen once in a suite run):
the ranks start again on another port; a port taken every time is still an error, named."""

from __future__ import annotations

import socket

import pytest

from tests.support import spawn


def world(rank, world_size):
    import torch.distributed as dist

    return dist.get_world_size() * 10 + rank


def test_a_taken_store_port_is_retried_on_another(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        ports = iter([taken, spawn.free_port()])
        monkeypatch.setattr(spawn, "free_port", lambda: next(ports))
        assert spawn.run_ranks(world, 1) == [10]  # the second port
        monkeypatch.setattr(spawn, "free_port", lambda: taken)
        with pytest.raises(spawn.StoreAddressTaken, match="EADDRINUSE"):
            spawn.run_ranks(world, 1)
