"""Triggers: async waits that run in the triggerer."""
