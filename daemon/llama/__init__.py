"""The model layer: llama.cpp (model.py is the only llama_cpp importer), GGUF metadata, the memory plan, CPU checks."""
