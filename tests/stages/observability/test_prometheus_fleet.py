"""A real Prometheus (Debian's binary) scraping a real ``kvrouter up`` fleet under a little traffic:
every Grafana panel query and every recording/alert rule in ``deploy/observability`` must return data.

Run as its own CI stage (``python -m pytest -q tests/stages/observability``): it needs
``prometheus`` and ``promtool`` on PATH. Prometheus runs with the committed ``prometheus.yml`` and
rules as they are; only the file-discovery target lists are written with the fleet's real ports.
An alert is ``<quantity> <op> <threshold>``: its quantity is what must return data (the alert
itself fires only when something is wrong, which this healthy fleet is not).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.waiting import poll

ROOT = Path(__file__).resolve().parents[3]
OBS = ROOT / "deploy" / "observability"
ADMIN_KEY = "stage-admin-key"
RATE_INTERVAL = "1m"
#: dashboard series that only a fault makes, which this healthy fleet of one router cannot have:
#: their queries must run (valid PromQL) and the router must declare the metric (its # TYPE
#: line), but they may answer nothing. The name, and the fault
NEEDS_A_FAULT = {
    "kvrouter_proxy_retries_total": "a worker refusing a connection (test_router_upstream.py)",
    "kvrouter_index_evicted_entries_total": "an index past max_index_entries or a rank's cap",
    # (the panel's and the alert's gauge, and the panel's counter of turns)
    "kvrouter_agreement_disagree": "a worker whose reported cached tokens disagree with its "
    "events (test_router_agreement_loop.py)",
}
#: series only a router with replicas (``replicas:``, ``--processes N``) exports at all: this
#: fleet's is one alone (tests/integration/router/replicas check those metrics)
REPLICAS_ONLY = "kvrouter_replica_"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kvrouter() -> list[str]:
    script = Path(sys.executable).with_name("kvrouter")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvrouter"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """``kvrouter up`` (router + 2 sim engines); yields the router URL and worker id -> URL."""
    tmp = tmp_path_factory.mktemp("fleet")
    env = dict(os.environ, KVROUTER_ADMIN_KEY=ADMIN_KEY)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    log = open(tmp / "up.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [*_kvrouter(), "up", "--workers", "2", "--port", "0", "--speedup", "20"],
        stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=ROOT,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        url = None
        for line in proc.stdout:
            m = re.search(r"kvrouter up: router (http://\S+)", line)
            if m:
                url = m.group(1)
                break
        assert url, f"kvrouter up did not start:\n{(tmp / 'up.log').read_text()}"
        auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
        body = httpx.get(f"{url}/workers", headers=auth, timeout=10).json()
        workers = {w["id"]: w["url"] for w in body["workers"]}
        assert len(workers) == 2, body
        yield url, workers
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        log.close()


@pytest.fixture(scope="module")
def prometheus(
    fleet: tuple[str, dict[str, str]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """Prometheus on the committed config and rules, 1 s scrapes, targets = the fleet."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not on PATH (apt-get install prometheus)"
    router_url, workers = fleet
    conf = tmp_path_factory.mktemp("prom")
    shutil.copytree(OBS / "rules", conf / "rules")
    config = yaml.safe_load((OBS / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    config["global"]["evaluation_interval"] = "1s"
    (conf / "prometheus.yml").write_text(yaml.safe_dump(config))
    (conf / "targets").mkdir()
    host = lambda u: u.split("://", 1)[1].rstrip("/")  # noqa: E731
    (conf / "targets" / "router.yml").write_text(yaml.safe_dump([{"targets": [host(router_url)]}]))
    (conf / "targets" / "workers.yml").write_text(
        yaml.safe_dump(
            [{"targets": [host(u)], "labels": {"worker": w}} for w, u in workers.items()]
        )
    )
    port = _free_port()
    log = open(conf / "prometheus.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [binary, f"--config.file={conf / 'prometheus.yml'}", f"--storage.tsdb.path={conf / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT, cwd=conf,
    )  # fmt: skip
    api = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            try:
                return httpx.get(f"{api}/-/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        poll(ready, 60, "Prometheus to start", every=0.2)
        yield api
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _traffic(router: str, stop: threading.Event) -> None:
    """Multi-turn chats (cache hits), /route queries, and a bad request (a 400) until stopped."""
    with httpx.Client(base_url=router, timeout=30) as client:
        i = 0
        while not stop.is_set():
            prefix = f"conversation {i % 3}: " + "the same long system prompt, " * 8
            client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": prefix + f"turn {i}"}],
                      "max_tokens": 8, "stream": i % 2 == 0},
            )  # fmt: skip
            client.post("/route", json={"prompt": prefix})
            client.post("/route", json={})  # a 400 (the refused requests' panel)
            i += 1


def _queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every dashboard target and every rule, template variables substituted."""
    out: list[tuple[str, str]] = []
    dash = json.loads((OBS / "grafana" / "kvrouter.json").read_text())
    for panel in dash["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", RATE_INTERVAL)
            expr = expr.replace("$worker", ".*")
            assert "$" not in expr, f"unsubstituted variable in {panel['title']!r}: {expr}"
            out.append((f"panel {panel['title']!r}", expr))
    for var in dash["templating"]["list"]:
        if var["type"] == "query":  # label_values(metric, label): the metric must have data
            m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["definition"])
            assert m, var["definition"]
            out.append((f"variable {var['name']}", f"count by ({m.group(2)}) ({m.group(1)})"))
    rules = yaml.safe_load((OBS / "rules" / "kvrouter.rules.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            expr = rule["expr"]
            if "alert" in rule:  # the quantity the alert compares
                m = re.fullmatch(r"(.+?)\s*(==|!=|>=|<=|>|<)\s*[0-9.]+", expr.strip(), re.S)
                assert m, f"alert {rule['alert']} is not '<quantity> <op> <threshold>': {expr}"
                expr = m.group(1)
            out.append((f"rule {rule.get('record') or rule.get('alert')}", expr))
    return out


def test_every_dashboard_query_and_rule_returns_data(
    fleet: tuple[str, dict[str, str]], prometheus: str
) -> None:
    router, _ = fleet
    stop = threading.Event()
    driver = threading.Thread(target=_traffic, args=(router, stop), daemon=True)
    driver.start()
    queries = _queries()
    assert len(queries) >= 30, len(queries)
    try:
        pending = {expr: where for where, expr in queries}
        faults = [e for e in pending if any(name in e for name in NEEDS_A_FAULT)]
        # (each still on the dashboard or in a rule)
        assert all(any(name in e for e in faults) for name in NEEDS_A_FAULT), faults
        faults += [e for e in pending if REPLICAS_ONLY in e]
        declared = httpx.get(f"{router}/metrics", timeout=10).text
        for name in NEEDS_A_FAULT:
            base = name.removesuffix("_total")
            assert re.search(rf"^# TYPE {base}\w* ", declared, re.M), name
        empty: dict[str, str] = {}

        def all_answered() -> bool:
            assert driver.is_alive(), "the traffic driver died"
            for expr, where in list(pending.items()):
                r = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10)
                body = r.json()
                assert body.get("status") == "success", f"{where}: {expr}\n{body}"
                if body["data"]["result"] or expr in faults:
                    del pending[expr]
                    empty.pop(expr, None)
                else:
                    empty[expr] = where
            return not pending

        try:
            poll(all_answered, 150, "every query to return data", every=0.2)
        except AssertionError:
            lines = "\n".join(f"  {w}: {e}" for e, w in empty.items())
            raise AssertionError(f"queries that returned nothing:\n{lines}") from None
    finally:
        stop.set()
        driver.join(timeout=40)


def test_promtool_checks_the_config_rules_and_rule_tests() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not on PATH (apt-get install prometheus)"
    for args, cwd in (
        (["check", "config", "prometheus.yml"], OBS),
        (["check", "rules", "rules/kvrouter.rules.yml"], OBS),
        (["test", "rules", "kvrouter.rules.test.yml"], OBS / "rules"),
    ):
        r = subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"promtool {' '.join(args)}:\n{r.stdout}\n{r.stderr}"
