"""Loaded by the vLLM servers of the prefill/decode pair (``pd_pair.py`` puts this folder on their
``PYTHONPATH``): NIXL's Python API (1.5.1, ``nixl_agent``) starts the UCX progress thread with a
poll delay of 0, so each idle server busy-polls a whole core. On CI's two cores the pair would
keep the machine 100 % busy while idle, and the machine then stalls for 10-30 s at a time
(sockets time out, health checks fail). A delay of 1 ms (at least ``NIXL_PTHR_DELAY_US``) makes
the thread wait on UCX's events instead; the transfer itself is unchanged (same thread, same UCX
transports). Measured: idle pair 97 % idle instead of 0 %, outputs and cached tokens identical."""

from __future__ import annotations

import os

try:
    import nixl_cu12._api as _api
except ImportError:  # not vLLM's venv, or another NIXL build: leave it alone
    _api = None

if _api is not None and hasattr(_api.nixlBind.nixlAgentConfig, "pthrDelay"):
    _Base = _api.nixlBind.nixlAgentConfig
    _DELAY_US = int(os.environ.get("NIXL_PTHR_DELAY_US", "1000"))

    class _IdleConfig(_Base):  # type: ignore[misc,valid-type]
        @property
        def pthrDelay(self) -> int:
            return int(_Base.pthrDelay.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, us: int) -> None:
            _Base.pthrDelay.__set__(self, max(us, _DELAY_US))

    _api.nixlBind.nixlAgentConfig = _IdleConfig
