"""``rlplane two-node``: two storage nodes (127.0.0.2 and 127.0.0.4) hold the storage units,
one each (Ray packed them onto one before: two copies of a block shared a host); a client
on the head (127.0.0.3) moves the vlm-step batch over the transfer engine and over ZMQ,
read back bit for bit; every node is gone afterwards (ended by pid)."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil


def test_units_on_a_second_loopback_node_are_read_bit_exact_over_the_transfer_engine(tmp_path):
    """Run with --keep (as a user does before benching it), then stopped with Ctrl-C."""
    out, log = tmp_path / "two-node.json", tmp_path / "stdout.txt"
    recorded = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"  # where ray.init() looks for a cluster
    before = recorded.read_text() if recorded.exists() else None
    env = {"COLUMNS": "160", "PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "RAY_AUTH_MODE": "disabled",
           "RLPLANE_LOG_DIR": str(tmp_path)}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "rlplane_tools", "two-node", "--path", "te", "--path", "zmq",
                                 "--batch", "8", "--seqlen", "512", "--reps", "2", "--unit-bytes", str(128 << 20),
                                 "--storage-nodes", "2", "--replicas", "2",
                                 "--json", str(out), "--keep"], stdout=sink, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 240
        while "Ctrl-C stops it" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        assert "Ctrl-C stops it" in log.read_text(), log.read_text()
        data = json.loads(out.read_text())
        assert psutil.pid_exists(data["pids"][0])  # up while kept
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=150) == 0, log.read_text()
    finally:
        if proc.poll() is None:  # it did not stop: end it and, by the pids it recorded, its cluster
            proc.kill()
            proc.wait(timeout=30)
            pids = json.loads(out.read_text())["pids"] if out.exists() else []
            procs = []
            for pid in pids:
                try:
                    procs.append(psutil.Process(pid))
                    procs[-1].kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(procs, timeout=30)
    assert "every read bit-exact on te, zmq" in log.read_text()
    assert data["problems"] == [] and data["head_ip"] == "127.0.0.3" and data["node_ips"] == ["127.0.0.2", "127.0.0.4"]
    hosts = sorted(endpoint.removeprefix("tcp://").rpartition(":")[0] for _, endpoint in data["units"])
    assert hosts == ["127.0.0.2", "127.0.0.4"]  # one unit on each storage node: a block's two copies on two hosts
    for path in ("te", "zmq"):
        row = data["paths"][path]
        assert set(row["taken"].values()) == {path} and len(row["taken"]) == 2, row["taken"]
        assert row["problems"] == [] and len(row["get_ms_each"]) == 2
    assert data["batch"] == 8 and data["nbytes"] > 1 << 20  # images included
    # Both nodes' processes (and what they started) were ended on the way out.
    deadline = time.monotonic() + 30
    alive = [p for p in data["pids"] if psutil.pid_exists(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.5)
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"processes of the loopback cluster still run: {alive}"
    # Its address was never recorded where every later ray.init() on this machine would connect.
    assert (recorded.read_text() if recorded.exists() else None) == before


def test_two_node_refuses_an_unknown_data_path():
    res = subprocess.run([sys.executable, "-m", "rlplane_tools", "two-node", "--path", "rdma-please"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "unknown data path" in res.stdout
