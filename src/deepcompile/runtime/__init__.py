"""Run-time state: the parameter registry and sharding, collectives, custom ops, eager fallback."""
