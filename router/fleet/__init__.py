"""The fleet: the worker table (``registry``, pure state), its health checks (``health``), the one
HTTP client to workers (``upstream``), Kubernetes discovery (``discovery``, ``pods``). Nothing is
imported here, so reading the worker table never loads the HTTP client."""
