"""Summarization: the flagship `summary` (anchors + fitted summaries + low-rank) and the published `hae`."""
