"""Prompt, embedding and semantic caches for OpenAI-style requests ([cache])."""
