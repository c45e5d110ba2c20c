"""The kvstash client: ``KVClient().prefill(doc)`` then ``.generate(query)``."""

from client.kvclient import Generation, KVClient, PrefixHandle

__all__ = ["Generation", "KVClient", "PrefixHandle"]
