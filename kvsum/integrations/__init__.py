"""kvsum outside one Python process: serving engines and KV stores.

- `kvsum.integrations.codec`: full-precision KV of one prompt (or one chunk of it) <-> kvsum's compressed bytes
  (a .kvsum safetensors file: packed codes stay packed), with no model at hand, for engines whose KV is laid out
  per token (LMCache chunks, vLLM pages). Only token-aligned quantizers fit there (docs/serving.md says why).
- `kvsum.integrations.lmcache`: a serde for LMCache's storage backends (`register()` adds the type "kvsum").
- `kvsum.integrations.vllm`: `KvsumConnector`, a vLLM KV connector that keeps prompt prefixes compressed in a
  `kvsum.Store` and rebuilds full-precision KV in vLLM's pages on a hit; `kvsum.integrations.prefix` is its
  vLLM-free part (prefix keys, longest stored prefix, page slots gathered and written).

Neither lmcache nor vllm is imported by kvsum itself: each module imports its engine only when used, and the
engine-free parts (the codec, the connector's bookkeeping) are tested without it. docs/serving.md says which
kvsum families fit paged engines at all, and how.
"""
