"""LongFlow: KV-cache policies, their transformers integration and a batched generation engine."""
