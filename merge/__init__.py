"""Pure merging: methods, streaming merge over safetensors, delta codecs, screening. No network code."""
