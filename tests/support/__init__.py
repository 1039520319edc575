"""Helpers shared by the test suites (tiny local models, engine fixtures)."""
