"""The bundled KV cache engine: paged blocks, tiers, scheduler, runners, event publisher, server.

It imports ``indexer`` for the wire contract only and never imports ``router``.
"""
