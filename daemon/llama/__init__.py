"""The model layer: llama.cpp (the model/ package is the only llama_cpp importer), GGUF metadata, the memory plan,
CPU checks."""
