"""LLM traffic: OpenAI-style accounting, rate limits, caches."""
