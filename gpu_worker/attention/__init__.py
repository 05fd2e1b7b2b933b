"""Attention backends behind one interface (`AttentionBackend`); see base.py for the KV layout."""
