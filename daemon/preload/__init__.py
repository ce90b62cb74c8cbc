"""Smart preloading: when a session will speak next, from its own history."""
