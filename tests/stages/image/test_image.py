"""The container images, as built by ``.ci/image.sh`` (which runs this module): their config
(non-root, ``kvrouter`` entrypoint, HEALTHCHECK, ports), their contents (no compiler, the C
accelerators built), and a smoke run of their own files.

podman's OCI runtime cannot start containers on these machines, so each image's root is mounted
read-only with ``podman image mount`` and its programs are run with ``chroot`` as the image's user,
in a private mount namespace that gives them /dev, /proc and a tmpfs /tmp.
That runs the image's interpreter, virtualenv and entrypoint exactly; only the container
runtime's isolation is missing.

    KVROUTER_IMAGE=localhost/kvrouter:ci KVROUTER_ENGINE_IMAGE=localhost/kvrouter-engine:ci \
        python -m pytest -q tests/stages/image
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.waiting import poll

ROUTER_IMAGE = os.environ.get("KVROUTER_IMAGE", "localhost/kvrouter:ci")
ENGINE_IMAGE = os.environ.get("KVROUTER_ENGINE_IMAGE", "localhost/kvrouter-engine:ci")
MAX_IMAGE_BYTES = 600 * 1024 * 1024
COMPILERS = ("gcc", "cc", "c++", "g++", "x86_64-linux-gnu-gcc-12", "aarch64-linux-gnu-gcc-12")


def podman(*args: str) -> str:
    return subprocess.run(
        ["podman", *args], check=True, capture_output=True, text=True, timeout=120
    ).stdout.strip()


def inspect(image: str) -> dict[str, Any]:
    return json.loads(podman("image", "inspect", image))[0]  # type: ignore[no-any-return]


class Rootfs:
    """The image's root filesystem, mounted read-only (as ``readOnlyRootFilesystem`` in the
    Kubernetes manifests), with a fresh tmpfs on /tmp for each command (their emptyDir)."""

    def __init__(self, image: str) -> None:
        self.image = image
        meta = inspect(image)
        self.config = meta["Config"]
        self.healthcheck: list[str] = (meta.get("Healthcheck") or {}).get("Test") or []
        self.path = Path(podman("image", "mount", image))

    def argv(self, *cmd: str, env: dict[str, str] | None = None) -> list[str]:
        """``cmd`` in the image, as its user, with the image's environment (+ ``env``)."""
        user = self.config.get("User") or "0"
        environ = dict(e.split("=", 1) for e in self.config.get("Env") or [])
        environ.update(env or {})
        root = str(self.path)
        script = (
            f'mount --rbind /dev "{root}/dev" && mount -t proc proc "{root}/proc" && '
            f'mount -t tmpfs -o mode=1777 tmpfs "{root}/tmp" && '
            f'exec chroot --userspec={user} "{root}" "$@"'
        )
        pairs = [f"{k}={v}" for k, v in environ.items()]
        return ["unshare", "--mount", "--fork", "sh", "-c", script, "sh", "env", "-i", *pairs, *cmd]

    def run(self, *cmd: str, env: dict[str, str] | None = None) -> str:
        return subprocess.run(
            self.argv(*cmd, env=env), check=True, capture_output=True, text=True, timeout=120
        ).stdout

    def close(self) -> None:
        subprocess.run(["podman", "image", "umount", self.image], capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def router_fs() -> Iterator[Rootfs]:
    fs = Rootfs(ROUTER_IMAGE)
    yield fs
    fs.close()


@pytest.fixture(scope="module")
def engine_fs() -> Iterator[Rootfs]:
    fs = Rootfs(ENGINE_IMAGE)
    yield fs
    fs.close()


def http(url: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, str], bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def start(fs: Rootfs, *cmd: str, pattern: str, env: dict[str, str] | None = None) -> Any:
    """Start ``cmd`` in the image; return (process, the first match of ``pattern``)."""
    proc = subprocess.Popen(
        fs.argv(*cmd, env=env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    out = proc.stdout
    assert out is not None
    seen = []
    for line in out:
        seen.append(line)
        m = re.search(pattern, line)
        if m:
            # keep reading what it prints, or it blocks once the pipe is full
            def drain() -> None:
                with out:
                    out.read()

            threading.Thread(target=drain, daemon=True).start()
            return proc, m
    out.close()
    proc.wait()
    raise AssertionError(f"{cmd} exited before printing {pattern!r}:\n{''.join(seen)}")


def stop(proc: subprocess.Popen[str]) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("image", [ROUTER_IMAGE, ENGINE_IMAGE])
def test_image_config(image: str) -> None:
    meta = inspect(image)
    cfg = meta["Config"]
    size = int(meta["Size"])
    print(f"\n{image}: {size / 2**20:.0f} MiB, user {cfg.get('User')}, cmd {cfg.get('Cmd')}")
    assert cfg.get("User") == "10001:10001", "runs as the non-root user kvrouter (uid 10001)"
    assert cfg.get("Entrypoint") == ["kvrouter"]
    check = (meta.get("Healthcheck") or {}).get("Test") or [""]
    assert check[0] == "CMD", "has a HEALTHCHECK"
    assert size < MAX_IMAGE_BYTES, f"{size / 2**20:.0f} MiB"


def test_router_image_has_accelerators_and_no_compiler(router_fs: Rootfs) -> None:
    for name in COMPILERS:
        for d in ("usr/bin", "usr/local/bin"):
            assert not (router_fs.path / d / name).exists(), f"/{d}/{name} in the final image"
    out = router_fs.run(
        "python", "-c", "import indexer._chash, router._native, lightkube; print('ok')"
    )
    assert out.strip() == "ok"
    assert router_fs.run("kvrouter", "--version").strip().startswith("kvrouter ")
    assert router_fs.run("id", "-u").strip() == "10001"
    write = subprocess.run(router_fs.argv("touch", "/opt/kvrouter/x"), capture_output=True)
    assert write.returncode != 0, "the root filesystem is read-only here, as in the manifests"


def test_router_image_up_serves_and_passes_its_healthcheck(router_fs: Rootfs) -> None:
    """``kvrouter up`` (router + two sim engines) from the image's files; a chat completion
    through the router twice (the second from the engine's cache), then the image's own
    HEALTHCHECK command against that router."""
    proc, m = start(
        router_fs, "kvrouter", "up", "--workers", "2", "--port", "0",
        pattern=r"kvrouter up: router (http://\S+)",
    )  # fmt: skip
    try:
        url = m.group(1)
        poll(lambda: http(url + "/ready")[0] == 200, 60, "router ready")
        body = {"messages": [{"role": "user", "content": "Hello from the image " * 4}]}
        body["max_tokens"] = 8
        status, headers, raw = http(url + "/v1/chat/completions", body)
        assert status == 200, raw
        worker = {k.lower(): v for k, v in headers.items()}["x-kvrouter-worker"]
        assert worker.startswith("engine-")
        assert json.loads(raw)["choices"][0]["message"]["content"]

        def cached() -> bool:
            status, _, raw = http(url + "/v1/chat/completions", body)
            usage = json.loads(raw)["usage"]
            return (
                status == 200
                and (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) > 0
            )

        poll(cached, 30, "the repeated prompt served from the cache")
        status, _, raw = http(url + "/metrics")
        assert status == 200 and b"kvrouter_" in raw
        port = url.rsplit(":", 1)[1]
        check = router_fs.healthcheck[1:]
        router_fs.run(*check, env={"KVROUTER_PORT": port})  # exit 0, or CalledProcessError
        print(f"\nrouter image: kvrouter up on {url}, chat served by {worker}, HEALTHCHECK ok")
    finally:
        stop(proc)


def test_engine_image_serves_health(engine_fs: Rootfs) -> None:
    assert engine_fs.config["Cmd"][0] == "engine"
    proc, m = start(
        engine_fs, "kvrouter", "engine", "--host", "127.0.0.1", "--port", "0",
        "--events", "tcp://127.0.0.1:0", "--replay", "tcp://127.0.0.1:0",
        pattern=r"kvrouter engine ready http=(\S+)",
    )  # fmt: skip
    try:
        status, _, _ = http(m.group(1) + "/health")
        assert status == 200
        status, _, raw = http(m.group(1) + "/v1/models")
        assert status == 200 and json.loads(raw)["data"]
        print(f"\nengine image: engine ready at {m.group(1)}")
    finally:
        stop(proc)
