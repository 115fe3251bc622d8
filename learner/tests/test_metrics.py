"""hakmem-learnd's Prometheus endpoint (--metrics): a real daemon serving a
preloaded workload's measurements, scraped over HTTP with a real client and
read back with prometheus-client's own parser of the text format."""
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from conftest import ROOT, WORKLOAD, clean_env, ring_path, scaled, start, wait_for
from test_learnd import Learnd

from prometheus_client.parser import text_string_to_metric_families

from hakmem.metrics import MetricsError, parse_addr


def scrape(url):
    with urllib.request.urlopen(url, timeout=scaled(5)) as r:
        assert r.status == 200
        ctype = r.headers.get("Content-Type", "")
        body = r.read().decode()
    assert ctype.startswith("text/plain") and "version=0.0.4" in ctype, ctype
    return {f.name: f for f in text_string_to_metric_families(body)}, body


def endpoint(d):
    m = wait_for(lambda: re.search(r"metrics (http://\S+/metrics)", d.text()), 30, "the metrics URL in learnd's log")
    return m.group(1)


def samples(fams, name, **labels):
    fam = fams[name[:-len("_total")] if name.endswith("_total") else name]   # a counter's family drops _total
    return [s for s in fam.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def test_metrics_endpoint_serves_what_learnd_measures(tmp_path):
    d = Learnd(tmp_path, "--learner", "gp", "--metrics", "127.0.0.1:0")
    w = None
    try:
        url = endpoint(d)
        assert url.startswith("http://127.0.0.1:"), url       # localhost unless told otherwise
        fams, _ = scrape(url)
        assert samples(fams, "hakmem_learnd_info")[0].labels["version"]
        assert samples(fams, "hakmem_learnd_processes")[0].value == 0

        # Running until a trial is decided, then ended: learnd's screening (a
        # capture, the trace's analysis, 13 replays staggered 0.25 s) took
        # 7-10 s of a 12-s run here and in CI, and the A/B's first pair
        # needs 8 windows after it (3 left out after each switch).
        w = start(["burst", 64, 3000, scaled(60)], d.shm)
        ring_path(d.shm, w.pid)
        pid = str(w.pid)

        def measured():
            f, _ = scrape(url)
            got = samples(f, "hakmem_process_counter_rate", pid=pid, counter="allocs")
            return (f, got) if got and got[0].value > 0 and samples(f, "hakmem_process_policy_written_version",
                                                                     pid=pid)[0].value > 0 else None
        fams, got = wait_for(measured, 20, "the workload's allocation rate and a policy written to it")
        lab = got[0].labels
        assert lab["program"] == "workload" and lab["key"].startswith(str(WORKLOAD.resolve())), lab
        # The workload allocates millions of blocks a second: a rate, not a total.
        assert 1e4 < got[0].value < 1e10, got
        assert samples(fams, "hakmem_process_resident_bytes", pid=pid)[0].value > 1e6
        assert samples(fams, "hakmem_process_cost", pid=pid)[0].value >= 0
        # Every counter of the layout is exported, by name.
        from hakmem import layout as L
        names = {s.labels["counter"] for s in samples(fams, "hakmem_process_counter_rate", pid=pid)}
        assert names == set(L.CLASS_COUNTERS) | set(L.PROC_COUNTERS)
        assert samples(fams, "hakmem_learnd_processes")[0].value == 1
        assert samples(fams, "hakmem_program_processes", program="workload")[0].value == 1
        assert samples(fams, "hakmem_program_policy_changes_total", program="workload")[0].value >= 1
        verdicts = {s.labels["verdict"] for s in samples(fams, "hakmem_program_trials_total", program="workload")}
        assert verdicts == {"accepted", "rolled_back", "settled", "relearn"}
        assert fams["hakmem_learnd_windows"].type == "counter"

        wait_for(lambda: re.search(r"\bpolicy_(accepted|rolled_back) workload\b", d.text()), 45,
                 lambda: f"a verdict on the first trial:\n{d.text()[-3000:]}")
        w.terminate()
        assert w.wait(scaled(30)) == -signal.SIGTERM
        d.wait_log(f"process_exited workload[{w.pid}]")

        def forgotten():   # an exited process leaves the per-process series
            f, _ = scrape(url)
            return not samples(f, "hakmem_process_resident_bytes", pid=pid)
        wait_for(forgotten, 10, "the exited process's series to go")
        # Trials decided: the same count as learnd's log says, by verdict;
        # the program's series outlive its processes.
        fams, _ = scrape(url)
        log = d.text()
        for verdict, kind in (("accepted", "policy_accepted"), ("rolled_back", "policy_rolled_back")):
            want = len(re.findall(rf"\b{kind} workload\b", log))
            got = samples(fams, "hakmem_program_trials_total", program="workload", verdict=verdict)[0].value
            assert got == want, (verdict, got, want)
        decided = sum(s.value for s in samples(fams, "hakmem_program_trials_total", program="workload")
                      if s.labels["verdict"] in ("accepted", "rolled_back"))
        assert decided >= 1, f"no trial decided in the workload's run:\n{log[-3000:]}"
    finally:
        if w is not None and w.poll() is None:
            w.kill()
            w.wait()
        assert d.stop() == 0, d.text()
    # Stopped with learnd: the port is closed.
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=scaled(2))


def test_metrics_address_errors_are_one_line(tmp_path):
    assert parse_addr("") == ("127.0.0.1", 9711)
    assert parse_addr("9100") == ("127.0.0.1", 9100)
    assert parse_addr(":9100") == ("127.0.0.1", 9100)
    assert parse_addr("0.0.0.0:9100") == ("0.0.0.0", 9100)
    assert parse_addr("[::1]:0") == ("::1", 0)
    for bad in ("host.example:80", "127.0.0.1:http", "1.2.3.4:70000", "[::1]"):
        with pytest.raises(MetricsError):
            parse_addr(bad)
    # A port somebody else holds: learnd says so in one line and exits 1.
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "hakmem.daemon", "--foreground", "--db", str(tmp_path / "l.db"),
                            "--shm-dir", str(tmp_path / "shm"), "--run-dir", str(tmp_path / "run"),
                            "--metrics", f"127.0.0.1:{port}"], capture_output=True, text=True,
                           env=clean_env(), cwd=ROOT, timeout=scaled(60))
    finally:
        s.close()
    err = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert r.returncode == 1 and err == [f"hakmem-learnd: error: cannot serve metrics on 127.0.0.1:{port}: "
                                         f"Address already in use"], r.stderr
    assert not (tmp_path / "run" / "control.sock").exists()
    r = subprocess.run([sys.executable, "-m", "hakmem.daemon", "--db", str(tmp_path / "l.db"), "--metrics", "x:y"],
                       capture_output=True, text=True, env=clean_env(), cwd=ROOT, timeout=scaled(60))
    assert r.returncode == 1 and r.stderr.startswith("hakmem-learnd: error: metrics address 'x:y'"), r.stderr
