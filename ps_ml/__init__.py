"""Models and their flat parameter buffers, datasets and sample order, and the single-process SGD reference."""
