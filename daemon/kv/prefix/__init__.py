"""Prefix sharing: system prompts computed once, their cells shared by every session that starts alike."""
