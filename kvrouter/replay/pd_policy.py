"""Policy ``kvrouter`` on a prefill/decode fleet in virtual time: the router's joint decision and
its two legs, as the proxy runs them over vLLM's NIXL pull (``router/edge/pd_flow.py``).

Per request, :meth:`KvrouterPdPolicy.place_pd` places it (:meth:`Placer.place`) and picks
(:meth:`Placer.pick`, i.e. :func:`router.placement.pd.pick` with the settings' ``pd.mode``): the
decode worker, and a prefill worker when the pick is remote. The placement core is called as it
is; this module only flies the legs it decided, in the proxy's order:

* a remote pick's prefill leg is a flight on the prefill worker (``leg="prefill"``) that ends
  when the prefill worker answers (:meth:`prefill_answered`, with its cached tokens);
* the decode leg is a flight on the decode worker (``leg="decode"``: it builds nothing, its
  KV arrives by transfer) from the pick on, as the proxy's, so requests placed while the prompt
  is prefilled see the decode worker taken; it is predicted to reuse what the prefill worker
  held and sent once the run has pulled the blocks (:meth:`decode_sent`); an answer without a
  lease makes the pick fall back (the decode worker prefills itself, a flight of its own, as
  the proxy does with no ``kv_transfer_params``);
* a local pick is one flight on the decode worker, as in an aggregated fleet.

The decode leg's flight sees its first byte at the first token and ends at the last, as the
proxy's. The run (:mod:`kvrouter.replay.virtual`) moves the requests between the engines.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from engine.engine import LLMEngine
from kvrouter.replay.policies import KvrouterPolicy
from router.placement import REMOTE, Flight, Pick, cached_tokens
from router.settings import Settings

__all__ = ["KvrouterPdPolicy", "PdHandle"]


class PdHandle:
    """One request's pick and its flights (the prefill leg's only when remote)."""

    __slots__ = ("decode", "decode_flight", "pick", "prefill_flight", "remote", "sent")

    def __init__(self, pick: Pick, decode: int) -> None:
        self.pick = pick
        self.decode = decode
        self.remote = pick.mode == REMOTE
        self.prefill_flight: Flight | None = None
        self.decode_flight: Flight | None = None
        self.sent = not self.remote  # the decode leg went to the decode worker


class KvrouterPdPolicy(KvrouterPolicy):
    """See the module docstring; ``roles``: each worker's (``prefill`` or ``decode``)."""

    def __init__(
        self,
        engines: Sequence[LLMEngine],
        settings: Settings,
        clock: Callable[[], float],
        roles: Sequence[str],
    ) -> None:
        super().__init__(engines, settings, clock, 0, roles)
        #: picks by reason (router.placement.pd: over_threshold, cost_local, mode_always, ...)
        self.reasons: Counter[str] = Counter()
        #: remote picks that fell back to a local prefill, by cause
        self.fallbacks: Counter[str] = Counter()

    def choose(self, tokens: Sequence[int], now: float) -> tuple[int, Any]:
        raise TypeError("a PD fleet places with place_pd (two legs), not place")

    def place_pd(
        self, tokens: Sequence[int], now: float, max_tokens: int | None = None
    ) -> tuple[int, int | None, PdHandle]:
        """The decode worker, the prefill worker (None: a local prefill) and the handle;
        ``max_tokens`` as the live client sends it (the trace's output length)."""
        d = self.placer.place(tokens, max_tokens=max_tokens)
        pick = self.placer.pick(d)
        self.reasons[pick.reason] += 1
        dw = self._slot[pick.decode.cand.key]
        self.outstanding[dw] += 1
        h = PdHandle(pick, dw)
        p = pick.prefill
        if p is None:
            h.decode_flight = self.placer.fly(d, pick.decode.index, "proxy", endpoint="completions")
            return dw, None, h
        h.decode_flight = self.placer.fly(
            d, pick.decode.index, "proxy", endpoint="completions", leg="decode"
        )
        h.prefill_flight = self.placer.fly(
            d, p.index, "proxy", endpoint="completions", leg="prefill"
        )
        return dw, self._slot[p.cand.key], h

    def prefill_answered(self, h: PdHandle, now: float, cached: int) -> None:
        """The prefill worker answered (its one token): its leg ends."""
        f = h.prefill_flight
        assert f is not None
        f.first_byte()
        f.cached = cached
        f.done("200")

    def decode_sent(self, h: PdHandle, now: float, fallback: str = "") -> None:
        """The decode leg goes to the decode worker: with the pulled blocks, or (``fallback``:
        why not) prefilling itself."""
        pick, d = h.pick, h.pick.decision
        p = pick.prefill
        assert p is not None
        f = h.decode_flight
        assert f is not None
        h.sent = True
        if fallback:
            pick.fall_back(fallback)
            self.fallbacks[fallback] += 1
            h.remote = False
            f.done("prefill_failed")
            h.decode_flight = self.placer.fly(d, pick.decode.index, "proxy", endpoint="completions")
        else:  # (the decode leg's predicted hit is the prefill worker's, as the proxy's)
            f.predicted_tokens = cached_tokens(p.cand, d.tokens, d.block_size)

    def first_token(self, handle: Any, now: float) -> None:
        f = handle.decode_flight
        assert f is not None
        f.first_byte()

    def finish(self, handle: Any, now: float, cached: int | None = None) -> None:
        self.outstanding[handle.decode] -= 1
        f = handle.decode_flight
        assert f is not None
        if handle.sent:
            f.cached = cached  # (a remote pick's decode leg is not judged)
            f.done("200")
        else:  # refused before a decode leg (the engine's 400)
            assert handle.prefill_flight is not None
            handle.prefill_flight.done("400")
            f.done("prefill_refused")
