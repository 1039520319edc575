"""Tests of the shared-memory registry, GPU-wide budgets, kvctl and metrics (real processes)."""
