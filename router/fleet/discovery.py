"""Kubernetes worker discovery (``kubernetes.discovery``): the router lists and watches the pods
that carry the configured labels, through the Kubernetes API (lightkube, the ``k8s`` extra), and
keeps one dynamic worker per *ready* pod: added when the pod becomes ready, removed when it is
deleted, stops being ready or loses its IP. Static workers and ``POST /workers`` are untouched.

The loop is the one every Kubernetes controller runs: LIST (gives the current pods and a
``resourceVersion``), reconcile, WATCH from that version; a dropped watch is resumed from the last
version seen; a version the API server no longer holds (``410 Gone``, as a status or as an
``ERROR`` event) restarts with a LIST, whose result also removes the workers of pods deleted
while no watch was open.

A pod's worker: id = pod name, ``http://<podIP>:<port>``, ``tcp://<podIP>:<port>`` for events and
replay. Ports, data-parallel ranks, model and pool come from the pod's annotations
(``kvrouter.io/http-port``, ``events-port``, ``replay-port`` — ``none`` for no replay —,
``dp-ranks``, ``model``, ``pool``; defaults from the settings), or, with
``endpoints: kv_event_sources``, the event endpoints come from vLLM's ``GET /kv_event_sources`` on
the pod (one entry per data-parallel rank). A pod whose endpoints cannot be read yet is retried
every ``retry_s``.

A pod's role (prefill/decode disaggregation) is its label ``llm-d.ai/role`` read as llm-d reads it
(:func:`pod_role`): ``prefill``, ``decode``, ``prefill-decode`` or its older name ``both``; no
label is ``both``; an unknown value is ``both`` with a warning; an encoder-only pod (``encode``)
is no worker. The SGLang bootstrap port of a prefill pod comes from its annotation
``sglang.ai/bootstrap-port`` (or ``vllm.ai/bootstrap-port``); a malformed one is a warning and no
port. A pod's warnings are logged once (again when they change).

Workers are added and removed through the same calls as ``POST``/``DELETE /workers``
(:class:`WorkerSink`, the router state); this module never touches the index. Every change is made
by this module's tasks (one per changed pod, so a pod slow to describe itself delays no other),
one change at a time under a lock.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Mapping
from typing import Any, Protocol

import msgspec

from router.errors import ConfigError, RouterError
from router.fleet.pods import (
    NoEventSource,
    PodNotUsable,
    fetch_sources,
    pod_ready,
    worker_for_pod,
)
from router.fleet.upstream import UpstreamPool
from router.settings import DiscoverySettings, WorkerConfig

__all__ = [
    "BOOTSTRAP_ANNOTATIONS",
    "ROLE_LABEL",
    "KubernetesDiscovery",
    "WorkerSink",
    "pod_role",
    "with_role",
]

log = logging.getLogger("kvrouter.discovery")

#: the pod label llm-d's scheduler filters prefill and decode pods by
ROLE_LABEL = "llm-d.ai/role"
#: a prefill pod's SGLang bootstrap port, first found wins
BOOTSTRAP_ANNOTATIONS = ("sglang.ai/bootstrap-port", "vllm.ai/bootstrap-port")
#: llm-d's values of ``llm-d.ai/role`` (llm-d-inference-scheduler, pkg/plugins/filter/roles.go:
#: its prefill filter takes prefill, encode-prefill, prefill-decode, both, encode-prefill-decode;
#: its decode filter decode, prefill-decode, both, encode-prefill-decode), as kvrouter roles
_LLMD_ROLES = {
    "prefill": "prefill",
    "encode-prefill": "prefill",
    "decode": "decode",
    "prefill-decode": "both",
    "both": "both",  # llm-d: deprecated for prefill-decode
    "encode-prefill-decode": "both",
}


def pod_role(pod: Any) -> tuple[str, int | None, list[str]]:
    """(role, SGLang bootstrap port or None, warnings) of a pod, from its ``llm-d.ai/role``
    label and bootstrap-port annotation. Raises :class:`PodNotUsable` for an encoder-only pod
    (``encode``: it neither prefills nor decodes, llm-d's filters leave it out of both)."""
    meta = pod.metadata
    labels: Mapping[str, str] = (meta.labels if meta is not None else None) or {}
    ann: Mapping[str, str] = (meta.annotations if meta is not None else None) or {}
    warnings = []
    value = labels.get(ROLE_LABEL)
    if value is None:
        role = "both"
    elif value == "encode":
        raise PodNotUsable(f"label {ROLE_LABEL}=encode: an encoder neither prefills nor decodes")
    elif value in _LLMD_ROLES:
        role = _LLMD_ROLES[value]
    else:
        role = "both"
        known = ", ".join(sorted({*_LLMD_ROLES, "encode"}))
        warnings.append(f"label {ROLE_LABEL}={value!r} is not one of {known}: taken as both")
    port = None
    for name in BOOTSTRAP_ANNOTATIONS:
        raw = ann.get(name)
        if raw is None:
            continue
        try:
            port = int(raw.strip())
        except ValueError:
            port = None
        if port is None or not 1 <= port <= 65535:
            port = None
            warnings.append(f"annotation {name}={raw!r} is not a port: no bootstrap port")
        break
    return role, port, warnings


def with_role(cfg: WorkerConfig, pod: Any) -> tuple[WorkerConfig, list[str]]:
    """``cfg`` (the pod's worker, :func:`~router.fleet.pods.worker_for_pod`) with the pod's role
    and bootstrap port (:func:`pod_role`), and the warnings about them."""
    role, port, warnings = pod_role(pod)
    return msgspec.structs.replace(cfg, role=role, bootstrap_port=port), warnings


class WorkerSink(Protocol):
    """What discovery changes: the router's worker set (``router.runtime.Runtime``)."""

    def add_worker(self, cfg: WorkerConfig, *, dynamic: bool = ...) -> Awaitable[Any]: ...

    def remove_worker(self, worker_id: str) -> Awaitable[None]: ...


class KubernetesDiscovery:
    """Built by ``create_app`` (a missing client library or API configuration fails the start
    with :class:`ConfigError`); ``await run(sink)`` until cancelled (the lifespan owns the task)."""

    def __init__(self, settings: DiscoverySettings) -> None:
        try:
            import httpx2  # lightkube's HTTP client: also reads vLLM's /kv_event_sources
            import lightkube
        except ImportError as e:
            raise ConfigError(
                "kubernetes.discovery needs the Kubernetes client: pip install -e '.[k8s]' in the "
                "kvrouter checkout"
            ) from e
        self._lk = lightkube
        self._httpx = httpx2
        self.settings = settings
        self.sink: WorkerSink | None = None
        self.pods: dict[str, Any] = {}  # the latest version of every labelled pod
        self.workers: dict[str, WorkerConfig] = {}  # pod name -> the worker registered for it
        self.lists = 0  # LIST calls made (each start, and each 410)
        self._problems: dict[str, str] = {}  # pod -> why it is not a worker (logged once)
        self._notes: dict[str, list[str]] = {}  # pod -> its role warnings (logged once)
        self._lock = asyncio.Lock()
        self._dirty: set[str] = set()  # pods changed since their reconcile task read them
        self._tasks: dict[str, asyncio.Task[None]] = {}  # pod -> its reconcile task
        self._http: Any = None  # for /kv_event_sources, made by run()
        self._config = self._kubeconfig()  # a missing configuration fails the start

    def _kubeconfig(self) -> Any:
        lk, s = self._lk, self.settings
        if s.api_server is None:  # in a pod: its service account; elsewhere: ~/.kube/config
            try:
                return lk.KubeConfig.from_env()
            except lk.ConfigError as e:
                raise ConfigError(f"kubernetes.discovery: no Kubernetes API access: {e}") from e
        # e.g. a `kubectl proxy` sidecar: no credentials here. A kubeconfig with an empty user
        # (lightkube 1.0's from_server leaves the user out, which its client then refuses)
        context: dict[str, Any] = {"cluster": "api", "user": "anonymous"}
        if s.namespace:
            context["namespace"] = s.namespace
        return lk.KubeConfig.from_dict(
            {
                "clusters": [{"name": "api", "cluster": {"server": s.api_server}}],
                "users": [{"name": "anonymous", "user": {}}],
                "contexts": [{"name": "api", "context": context}],
                "current-context": "api",
            }
        )

    def client(self) -> Any:
        """A lightkube client with this discovery's API access (the caller closes it)."""
        timeout = self._httpx.Timeout(self.settings.timeout_s)
        return self._lk.AsyncClient(
            self._config, namespace=self.settings.namespace, timeout=timeout, trust_env=False
        )

    async def run(self, sink: WorkerSink) -> None:
        from lightkube.resources.core_v1 import Pod

        self.sink = sink
        s = self.settings
        client = self.client()
        # the router's client to workers (bounded reads; pods come and go: no kept connections)
        self._http = UpstreamPool(connect_s=s.timeout_s, read_s=s.timeout_s, write_s=s.timeout_s)
        retry = asyncio.create_task(self._retry_pending(), name="k8s-discovery-retry")
        try:
            while True:
                try:
                    version = await self._relist(client, Pod)
                except Exception as e:  # API server unreachable, forbidden...: try again
                    log.warning("listing pods %s failed: %r", s.labels, e)
                    await asyncio.sleep(s.retry_s)
                    continue
                await self._watch(client, Pod, version)
        finally:
            tasks = [retry, *self._tasks.values()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._http.aclose()
            await client.close()
            self.workers.clear()  # the router stops: nothing to clean up in it

    async def _relist(self, client: Any, pod_type: Any) -> str:
        s = self.settings
        listing = client.list(pod_type, namespace=s.namespace, labels=s.labels)
        pods = {p.metadata.name: p async for p in listing}
        self.lists += 1
        gone = [n for n in self.pods if n not in pods]
        for name in gone:
            del self.pods[name]
        self.pods.update(pods)
        for name in [*gone, *pods]:
            self._kick(name)
        log.info("kubernetes discovery: listed %d pods", len(pods))
        return str(listing.resourceVersion)

    async def _watch(self, client: Any, pod_type: Any, version: str) -> None:
        """Watch from ``version`` until the API server no longer has it (then: relist)."""
        s = self.settings
        while True:
            stream = client.watch(
                pod_type, namespace=s.namespace, labels=s.labels, resource_version=version
            )
            try:
                async for kind, pod in stream:
                    version = pod.metadata.resourceVersion or version
                    name = pod.metadata.name
                    if kind == "DELETED":
                        self.pods.pop(name, None)
                    elif kind in ("ADDED", "MODIFIED"):
                        self.pods[name] = pod
                    else:  # BOOKMARK: only a newer version
                        continue
                    self._kick(name)
            except (self._httpx.HTTPError, msgspec.DecodeError, msgspec.ValidationError) as e:
                if self._expired(e):
                    log.info("pod watch: resourceVersion %s expired, relisting", version)
                    return
                log.warning("pod watch broke: %r; resuming from %s", e, version)
            except Exception:  # a bug here must not end discovery for good
                log.exception("pod watch failed; resuming from %s", version)
            finally:
                await stream.aclose()
            await asyncio.sleep(s.retry_s)

    def _expired(self, e: Exception) -> bool:
        """410 Gone: in an ERROR event of the stream (lightkube's ApiError), or as the watch
        request's own status (a plain HTTPStatusError: lightkube streams it unparsed)."""
        if isinstance(e, self._lk.ApiError):
            return e.status.code == 410
        return isinstance(e, self._httpx.HTTPStatusError) and e.response.status_code == 410

    async def _retry_pending(self) -> None:
        """Ready pods without a worker (endpoints unreadable, add refused): try again."""
        while True:
            await asyncio.sleep(self.settings.retry_s)
            for name in [n for n in self._problems if n in self.pods]:
                self._kick(name)

    def _kick(self, name: str) -> None:
        """Pod ``name`` changed: reconcile it, in its own task (one slow pod's
        ``/kv_event_sources`` delays no other), once more if it changes meanwhile."""
        self._dirty.add(name)
        if name not in self._tasks:
            self._tasks[name] = asyncio.create_task(self._reconcile(name), name=f"k8s-pod-{name}")

    async def _reconcile(self, name: str) -> None:
        try:
            while name in self._dirty:
                self._dirty.discard(name)
                pod = self.pods.get(name)
                want: WorkerConfig | None = None
                why = None
                if pod is None:
                    self._notes.pop(name, None)
                elif pod_ready(pod):
                    try:
                        want = await self._describe(pod, self._http)
                    except PodNotUsable as e:
                        why = str(e)
                if name in self._dirty:
                    continue  # a newer state arrived while we were reading this one
                async with self._lock:  # one change to the worker set at a time
                    await self._apply(name, want, why)
        except Exception:  # a bug here must not leave the pod unreconciled for good
            log.exception("kubernetes discovery: reconciling pod %s failed", name)
            self._problems.setdefault(name, "reconciling failed")
        finally:  # no await since the loop's test: a kick from now on starts a new task
            self._tasks.pop(name, None)

    async def _apply(self, name: str, want: WorkerConfig | None, why: str | None) -> None:
        sink = self.sink
        assert sink is not None
        have = self.workers.get(name)
        if why is not None:
            self._problem(name, why)
            if have is not None:  # readiness removes a worker, not one failed read of a pod
                return
        elif want == have:
            self._problems.pop(name, None)
        if want == have:
            return
        if have is not None:
            del self.workers[name]
            try:
                await sink.remove_worker(name)
                log.info("kubernetes discovery: removed worker %s", name)
            except RouterError as e:  # removed by DELETE /workers meanwhile
                log.info("kubernetes discovery: worker %s was already gone: %s", name, e)
        if want is not None:
            try:
                await sink.add_worker(want, dynamic=True)
            except RouterError as e:  # a static worker of that name, an endpoint refused...
                self._problem(name, f"not added: {e}")
                return
            self.workers[name] = want
            self._problems.pop(name, None)
            log.info("kubernetes discovery: added worker %s at %s", name, want.url)

    async def _describe(self, pod: Any, http: Any) -> WorkerConfig:
        s = self.settings
        base = worker_for_pod(pod, s)  # (with kv_event_sources: the HTTP port)
        quiet = None
        if s.endpoints == "kv_event_sources":
            try:
                sources = await fetch_sources(http, base.base_url, s.timeout_s)
            except NoEventSource as e:  # it serves, without events: it joins approximate
                sources, quiet = [], f"publishes no KV events ({e}): routed approximately"
            base = worker_for_pod(pod, s, sources)
        cfg, warnings = with_role(base, pod)
        if quiet is not None:
            warnings = [*warnings, quiet]
        name = cfg.id
        if warnings != self._notes.get(name, []):
            for w in warnings:
                log.warning("kubernetes discovery: pod %s: %s", name, w)
        self._notes[name] = warnings
        return cfg

    def _problem(self, name: str, why: str) -> None:
        if self._problems.get(name) != why:
            log.warning("kubernetes discovery: pod %s is not a worker: %s", name, why)
        self._problems[name] = why
