"""The prefix (prompt) KV cache in memory (``cache.py``), the trie walk it shares (``trie.py``), and its tier on
disk (``disk.py``)."""
