"""Observability: the router's Prometheus metrics (``metrics``) on its own light metric families
(``family``). Nothing is imported here."""
