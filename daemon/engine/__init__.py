"""The engine thread: one step = schedule -> run -> postprocess, and what feeds and times it."""
