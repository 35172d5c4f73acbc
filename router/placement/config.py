"""What the placement core reads of the router's settings: :class:`PlacementSettings`, one narrow,
frozen object built once from :class:`router.settings.Settings` (:meth:`PlacementSettings.of`),
so the core depends on the keys it uses and not on the whole tree (ports, TLS, logging...). The
replay and the benchmarks build it the same way."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from router.placement.scoring import ScoreWeights
from router.settings.agreement import AgreementSettings
from router.settings.pd import PdSettings

if TYPE_CHECKING:
    from router.settings import Settings

__all__ = ["PlacementSettings"]


class PlacementSettings(msgspec.Struct, frozen=True):
    weights: ScoreWeights = msgspec.field(default_factory=ScoreWeights)
    temperature: float = 0.0
    seed: int | None = None
    predicted_ttl_s: float = 2.0
    predicted_max_blocks: int = 1_000_000
    #: accounted ``/route`` placements (``route.*``)
    account_ttl_s: float = 300.0
    max_accounted: int = 100_000
    #: replica sync's remote tickets (``replicas.*``)
    ticket_ttl_s: float = 120.0
    max_remote_tickets: int = 100_000
    max_hashes: int = 8192
    max_peer_state_bytes: int = 128 << 20
    max_remote_state_bytes: int = 512 << 20
    #: requests in flight through the doors at most (``proxy.max_inflight``)
    max_inflight: int = 1024
    pd: PdSettings = msgspec.field(default_factory=PdSettings)
    #: the closed loop (``agreement.*``): reported cached tokens judged against the index
    agreement: AgreementSettings = msgspec.field(default_factory=AgreementSettings)

    @classmethod
    def of(cls, settings: Settings) -> PlacementSettings:
        sc, rs = settings.scoring, settings.replicas
        return cls(
            weights=ScoreWeights(
                overlap_weight=sc.overlap_weight,
                tier_weights=sc.effective_tier_weights(),
                running_weight=sc.running_weight,
                waiting_weight=sc.waiting_weight,
                kv_usage_weight=sc.kv_usage_weight,
                cache_credit=sc.cache_credit,
                overflow_weight=sc.overflow_weight,
                replica_spread=sc.replica_spread,
            ),
            temperature=sc.temperature,
            seed=sc.seed,
            predicted_ttl_s=sc.predicted_ttl_s,
            predicted_max_blocks=sc.predicted_max_blocks,
            account_ttl_s=settings.route.account_ttl_s,
            max_accounted=settings.route.max_accounted,
            ticket_ttl_s=rs.ticket_ttl_s,
            max_remote_tickets=rs.max_remote_tickets,
            max_hashes=rs.max_hashes,
            max_peer_state_bytes=int(rs.max_peer_state_mib * (1 << 20)),
            max_remote_state_bytes=int(rs.max_remote_state_mib * (1 << 20)),
            max_inflight=settings.proxy.max_inflight,
            pd=settings.pd,
            agreement=settings.agreement,
        )
