"""Images and audio in sessions: media by content (media_cache.py), prompts in parts (prompts.py), and the shared memory
frames come through (frame_areas.py)."""
