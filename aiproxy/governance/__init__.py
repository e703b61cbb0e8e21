"""Who is asking, whether they may, and the record of it: identity, policy, guards,
tracing and audit, as filters of the request chain (aiproxy/pipeline/filters.py)."""
