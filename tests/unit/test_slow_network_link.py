"""The throttled link of ``bench/slow_network.py``: a known number of bytes takes the time the rate says.

Each check runs in its own private network namespace (``unshare -n``), so the machine's own loopback is
never touched. The time may exceed the rate's by what the same transfer takes unthrottled at that moment (the
processes' own time on a busy machine), never fall below it. Skipped, with the reason, where namespaces are not permitted (not root, no CAP_SYS_ADMIN, no
``tc``). Negative control: the same transfer on an unthrottled loopback is far faster than the rate allows,
so the timing check is not passing by accident.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import slow_network  # noqa: E402

REFUSED = slow_network.namespaces_refused()
pytestmark = pytest.mark.skipif(REFUSED is not None, reason=f"bench/slow_network.py cannot build its link here: {REFUSED}")

PROBE = """
import json, sys
sys.path.insert(0, {bench!r})
import slow_network
if {rate!r}:
    slow_network.setup_link({rate!r})
else:
    slow_network.subprocess.run(["ip", "link", "set", "lo", "mtu", "1500", "up"], check=True)
seconds, carried = slow_network.timed_transfer({nbytes!r})
print(json.dumps({{"seconds": seconds, "carried": carried}}))
"""


def _transfer_in_namespace(rate_bits: float | None, nbytes: int) -> dict:
    code = PROBE.format(bench=str(BENCH), rate=rate_bits, nbytes=nbytes)
    proc = subprocess.run(["unshare", "-n", "--", sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("link", ["100mbit", "1gbit"])
def test_known_bytes_take_the_expected_time_at_the_set_rate(link):
    rate = slow_network.LINKS[link]
    nbytes = int(rate / 8 * 0.5)  # half a second of payload at the set rate
    # What the machine itself needs for the transfer right now (unthrottled): on a busy machine the processes' own
    # time adds to the link's, and a check beside another heavy job must not mistake one for the other.
    own = _transfer_in_namespace(None, nbytes)["seconds"]
    result = _transfer_in_namespace(rate, nbytes)
    # the qdisc carried the payload and its TCP/IP headers (~3-6 % at MTU 1500): the throttle saw every byte
    assert nbytes <= result["carried"] <= nbytes * 1.10, result
    expected = nbytes * 8 / rate
    assert 0.80 * expected <= result["seconds"] <= 1.20 * expected + own, (result, expected, own)


def test_negative_control_an_unthrottled_loopback_is_much_faster():
    rate = slow_network.LINKS["100mbit"]
    nbytes = int(rate / 8 * 0.5)
    result = _transfer_in_namespace(None, nbytes)
    assert result["seconds"] < 0.5 * nbytes * 8 / rate, result
