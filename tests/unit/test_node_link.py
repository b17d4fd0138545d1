"""The two-namespace link of ``bench/node_link.py``: a known number of bytes sent from one namespace to the other
over TCP takes the time the rate says, and the veth's qdisc saw them.

Each check builds its own pair of network namespaces joined by a veth pair (``ip netns add``; the machine's own
interfaces are never touched) and deletes them afterwards, also when the check fails. The time may exceed the
rate's by what the same transfer takes unthrottled at that moment (the processes' own time on a busy machine),
never fall below it. Skipped, with the reason, where namespaces are not permitted (not root, no
CAP_SYS_ADMIN, no ``ip``/``tc``, no veth or tbf). Negative control: the same transfer over an unthrottled pair
is far faster than the rate allows, so the timing check is not passing by accident.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import node_link  # noqa: E402

REFUSED = node_link.link_refused()
pytestmark = pytest.mark.skipif(REFUSED is not None, reason=f"bench/node_link.py cannot build its two-namespace link here: {REFUSED}")


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def _transfer(rate_bits: float | None, nbytes: int) -> tuple[float, int, int]:
    with node_link.node_link(rate_bits) as link:
        result = node_link.timed_transfer(link, nbytes)
    assert link.netns[0] not in _namespaces() and link.netns[1] not in _namespaces()
    return result


@pytest.mark.parametrize("link", ["100mbit", "1gbit"])
def test_known_bytes_cross_the_node_boundary_in_the_expected_time_at_the_set_rate(link):
    rate = node_link.LINKS[link]
    nbytes = int(rate / 8 * 0.5)  # half a second of payload at the set rate
    # What the machine itself needs for the transfer right now, unthrottled (see the module docstring).
    own = _transfer(None, nbytes)[0]
    seconds, carried, acks = _transfer(rate, nbytes)
    # the sender's qdisc carried the payload and its Ethernet/IP/TCP headers (~4.6 % at MTU 1500): every byte seen
    assert nbytes <= carried <= nbytes * 1.10, (carried, nbytes)
    assert 0 < acks < nbytes * 0.05, acks  # the other end's qdisc carried the ACKs only
    expected = nbytes * 8 / rate
    assert 0.80 * expected <= seconds <= 1.20 * expected + own, (seconds, expected, own)


def test_negative_control_an_unthrottled_pair_is_much_faster():
    rate = node_link.LINKS["100mbit"]
    nbytes = int(rate / 8 * 0.5)
    seconds, _, _ = _transfer(None, nbytes)
    assert seconds < 0.5 * nbytes * 8 / rate, seconds


def test_the_namespaces_are_deleted_when_the_body_fails():
    with pytest.raises(RuntimeError), node_link.node_link(100e6) as link:
        assert f"{link.netns[0]}" in _namespaces()
        raise RuntimeError("a failing run")
    listed = _namespaces()
    assert link.netns[0] not in listed and link.netns[1] not in listed
