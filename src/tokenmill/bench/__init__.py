"""Benchmarks: `tokenmill bench serve` (a load generator for any OpenAI-compatible server)."""
