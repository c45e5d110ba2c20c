"""Offline tools for compressed caches (HybridKV's head calibration)."""
