"""Prefix identity and prefix caches, shared by the simulator, the policies and routerd.

* :mod:`routerd.prefix.chain`: a prompt's full KV blocks as hash-chain extents
  (:class:`PrefixBlocks`), built from content units (Mooncake ``hash_ids``, the shared-prefix
  generator's system prompts, questions and answers) or, online, from prompt text.
* :mod:`routerd.prefix.cache`: the engine-side cache, vLLM V1 automatic prefix caching
  (reference counts, an LRU free queue that keeps hashes), at the cost of extents, not blocks.
* :mod:`routerd.prefix.index`: the router-side approximate index (what a router learns from its
  own dispatches), per instance, LRU-bounded.
"""
