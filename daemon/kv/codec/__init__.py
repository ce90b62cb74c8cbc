"""KV compression: the KV types a tier may hold, llama.cpp's sequence-state format, and transcoding between."""
