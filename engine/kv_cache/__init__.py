"""Paged KV cache bookkeeping (pure Python) and the cache tensor's sizing."""
