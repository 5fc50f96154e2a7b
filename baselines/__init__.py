"""Comparator KV-cache methods, one module each, all behind `longflow.policy.KVPolicy`."""
