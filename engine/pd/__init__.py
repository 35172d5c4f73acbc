"""Prefill/decode disaggregation in the bundled engine: vLLM's NIXL-pull exchange, over a block
endpoint of the prefill engine (docs/architecture.md §7).

* :mod:`engine.pd.params` — ``kv_transfer_params`` on the wire (vLLM's fields) and the errors;
* :mod:`engine.pd.leases` — the prefill engine's pinned blocks, one lease per transfer;
* :mod:`engine.pd.kv_io` — block bytes out of (prefill) and into (decode) the runner's pools;
* :mod:`engine.pd.wire` / :mod:`engine.pd.side_channel` — the pull between the two processes;
* :mod:`engine.pd.legs` — what the HTTP server does with a prefill leg and a decode leg.
"""
