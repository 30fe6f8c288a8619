"""``jmp.launch`` draws the run's two ports below the kernel's ephemeral range, which outgoing connections (gloo's,
in runs beside it) take ports from while the processes import: a port found free there could be gone."""

from __future__ import annotations

import socket
from pathlib import Path

from jmp.launch import _below_ephemeral_ports, free_port_pair

LINUX_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def test_the_drawn_ports_lie_below_the_ephemeral_range_where_one_is_known(tmp_path):
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    assert _below_ephemeral_ports(str(ranges)) == (20000, 32767)
    ranges.write_text("20500 60999\n")  # fewer than 1000 ports below it: the kernel's port-0 binding instead
    assert _below_ephemeral_ports(str(ranges)) is None
    assert _below_ephemeral_ports(str(tmp_path / "absent")) is None


def test_free_port_pair_gives_two_bindable_ports_outside_the_ephemeral_range():
    ports = {free_port_pair() for _ in range(5)}
    ephemeral_start = int(LINUX_RANGE.read_text().split()[0]) if LINUX_RANGE.exists() else None
    for port in ports:
        with socket.socket() as first, socket.socket() as second:
            first.bind(("", port))
            second.bind(("", port + 1))
        if ephemeral_start is not None and ephemeral_start - 1 - 20000 >= 1000:
            assert 20000 <= port and port + 1 < ephemeral_start
