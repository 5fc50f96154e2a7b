"""Helpers shared by test modules (a test module imports these, never another test module)."""
