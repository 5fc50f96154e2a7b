"""Datasets, prompts, grading, the run entry point, tables and figures."""
