"""Benchmarks: offline throughput against transformers, online latency against any OpenAI server."""
