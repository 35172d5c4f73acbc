"""The router's settings (one YAML file, ``KVROUTER_*`` environment variables, flags): the
``Settings`` tree in :mod:`router.settings.config`, its ``scoring:`` part (and the cost formula's
defaults) in :mod:`router.settings.scoring`, Kubernetes discovery in :mod:`router.settings.k8s`,
a worker entry in :mod:`router.settings.workers`, the Envoy endpoint picker in :mod:`router.settings.epp`, prefill/decode in :mod:`router.settings.pd`, replicas in
:mod:`router.settings.replicas`. Every other router package reads its
settings from here; this package imports only ``router.errors`` and the indexer's tier vocabulary."""

from indexer.events import DEFAULT_TIER_WEIGHTS
from router.settings.agreement import AgreementSettings
from router.settings.config import (
    ENV_PREFIX,
    HealthSettings,
    IndexSettings,
    ProxySettings,
    RouteSettings,
    ServerSettings,
    Settings,
    SnapshotSettings,
    SubscriberSettings,
    TracingSettings,
    describe_validation_error,
    load_settings,
)
from router.settings.epp import EppSettings
from router.settings.k8s import DiscoverySettings, KubernetesSettings
from router.settings.pd import PD_MODES, PD_PROTOCOLS, ROLES, PdSettings
from router.settings.replicas import PeerDiscoverySettings, ReplicaSettings
from router.settings.scoring import DEFAULT_CACHE_CREDIT, DEFAULT_OVERLAP_WEIGHT, ScoringSettings
from router.settings.workers import EVENTS_NONE, WorkerConfig, parse_worker_spec

__all__ = [
    "DEFAULT_CACHE_CREDIT",
    "DEFAULT_OVERLAP_WEIGHT",
    "DEFAULT_TIER_WEIGHTS",
    "ENV_PREFIX",
    "EVENTS_NONE",
    "PD_MODES",
    "PD_PROTOCOLS",
    "ROLES",
    "AgreementSettings",
    "DiscoverySettings",
    "EppSettings",
    "HealthSettings",
    "IndexSettings",
    "KubernetesSettings",
    "PdSettings",
    "PeerDiscoverySettings",
    "ProxySettings",
    "ReplicaSettings",
    "RouteSettings",
    "ScoringSettings",
    "ServerSettings",
    "Settings",
    "SnapshotSettings",
    "SubscriberSettings",
    "TracingSettings",
    "WorkerConfig",
    "describe_validation_error",
    "load_settings",
    "parse_worker_spec",
]
