"""Rendezvous environment for a process started without torchrun (tests, one-process runs).

torchrun always sets ``RANK``; without it we are a lone process and rendezvous on a fresh local port. An inherited
``MASTER_ADDR``/``MASTER_PORT`` (e.g. from a parent that runs its own process group) must not be reused: that
port is already bound.
"""

from __future__ import annotations

import os
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_rendezvous_env() -> None:
    if "RANK" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
