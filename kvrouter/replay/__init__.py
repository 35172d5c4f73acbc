"""``kvrouter replay``: Mooncake-format traces through each placement policy, in deterministic
virtual time (``virtual``: the engine's scheduler and cache, the router's placement core, one
simulated clock) and live against running fleets (``live``), with the report (``report``)."""
